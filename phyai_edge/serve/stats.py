"""Per-robot latency and outcome counters, and where each batch's time went, for the server's
report (torch-free)."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# How long a robot may send nothing before its row leaves the per-robot table (`serve
# --forget-robot-s`). A running daemon asks every s control ticks (0.5 s at 50 Hz, s = 25), so ten
# silent minutes is a robot that is off or restarted under another name; each row kept costs up to
# ~130 KB (its recent latencies) and ~1 ms of every report, made on the intake thread.
FORGET_ROBOT_S = 600.0


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least q % of the samples at or
    below it (so with fewer than 100 samples the p99 is the largest one: a robot's worst
    latency is never hidden by a small sample); 0.0 for no samples (a report, not a statistic
    to divide by)."""
    return ranked(sorted(xs), q)


def ranked(s: list[float], q: float) -> float:
    """`percentile` of samples already sorted (a report sorts each window once for all its qs)."""
    if not s:
        return 0.0
    # q * n is exact for the integer q and n a report uses, so an exact rank is not rounded up.
    rank = math.ceil(q * len(s) / 100.0)
    return s[min(len(s), max(1, rank)) - 1]


@dataclass
class RobotStats:
    requests: int = 0
    served: int = 0
    rejected: int = 0
    errors: int = 0
    expired: int = 0  # admitted, then not run: still queued when the robot stopped waiting
    deadline_misses: int = 0
    last_seen: float = 0.0
    # Recent latencies only: a report should describe now, not the whole uptime.
    latency_ms: deque = field(default_factory=lambda: deque(maxlen=2000))
    queue_ms: deque = field(default_factory=lambda: deque(maxlen=2000))

    def copy(self) -> RobotStats:
        """The counters and windows as they are now (taken under the stats lock; summarised after)."""
        return dataclasses.replace(self, latency_ms=list(self.latency_ms), queue_ms=list(self.queue_ms))

    def summary(self, now: float | None = None) -> dict[str, Any]:
        # Each window sorted once: a report of 48 robots with full windows took ~28 ms sorting
        # four times a robot, on the intake thread.
        lat, q = sorted(self.latency_ms), sorted(self.queue_ms)
        now = time.monotonic() if now is None else now
        return {
            "requests": self.requests, "served": self.served, "rejected": self.rejected, "errors": self.errors,
            "expired": self.expired, "deadline_misses": self.deadline_misses,
            "latency_ms": {"p50": ranked(lat, 50), "p99": ranked(lat, 99), "max": lat[-1] if lat else 0.0},
            "queue_ms": {"p50": ranked(q, 50), "p99": ranked(q, 99)},
            "idle_s": round(now - self.last_seen, 3) if self.last_seen else None,
        }


@dataclass
class BatchRecord:
    """One batch, by phase, as the inference thread saw it (ms). The phases inside the engine
    call come from `Policy.infer`'s stage times, summed over the batch's engine calls."""

    observations: int  # real observations in the batch
    padded: int  # observations the engine ran (after padding; summed over calls)
    calls: int  # engine calls (more than one: groups split, or a failed call rerun per request)
    wait_ms: float  # the oldest request's arrival -> the batch formed (window and queue)
    service_ms: float  # the executor, end to end: what the batch after it waits for
    preprocess_ms: float = 0.0  # adapter.preprocess
    engine_ms: float = 0.0  # RTC guidance and the engine (Policy.infer less pre- and postprocess)
    postprocess_ms: float = 0.0
    reply_ms: float = 0.0  # encoding and queueing the replies
    reruns: int = 0  # requests run again alone after their group's call failed

    @property
    def batcher_ms(self) -> float:
        """Service time outside `Policy.infer`: grouping, noise draws, RTC split, padding,
        slicing the actions back (and, for a remote executor, the round trip)."""
        return self.service_ms - self.preprocess_ms - self.engine_ms - self.postprocess_ms


PHASES = ("wait_ms", "service_ms", "preprocess_ms", "engine_ms", "postprocess_ms", "batcher_ms", "reply_ms")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


class ServerStats:
    """Thread-safe: the intake thread counts arrivals and rejections, inference threads count
    answers, and either counts the requests that expired in the queue."""

    def __init__(self, forget_s: float = FORGET_ROBOT_S, clock: Callable[[], float] = time.monotonic) -> None:
        # A daemon's default robot name carries its pid, so every restart is a new robot:
        # forget robots idle this long, or the table (and memory) grows with every restart.
        if not (math.isfinite(forget_s) and forget_s > 0):
            raise ValueError(f"forget_s must be a finite number of seconds > 0, got {forget_s!r}")
        self.forget_s = forget_s
        self.clock = clock
        self._lock = threading.Lock()
        # In the order their robots last sent a request (`arrived` moves a robot to the end), so
        # the idle ones are at the front and forgetting them costs only the rows it removes.
        self.robots: OrderedDict[str, RobotStats] = OrderedDict()
        self.batches = 0
        self.batch_sizes: deque = deque(maxlen=2000)
        self.records: deque = deque(maxlen=2000)  # BatchRecord, the recent ones
        self.reruns = 0
        self.failed_batches = 0  # no engine call gave actions: in no batch size or phase above
        self.expired_total = 0  # every robot's, the forgotten ones' too
        self.intake_ms = 0.0  # decoding and admitting infer requests, on the intake thread
        self.intake_n = 0
        self.started = clock()

    def _robot(self, name: str) -> RobotStats:
        r = self.robots.get(name)
        if r is None:
            # Seen now: a row made by an answer after its robot was forgotten is forgotten again in turn.
            r = self.robots[name] = RobotStats(last_seen=self.clock())
        return r

    def _forget_idle(self, now: float) -> None:
        """Drop the robots that sent no request for `forget_s` (the front of the table)."""
        while self.robots:
            name, r = next(iter(self.robots.items()))
            if now - r.last_seen <= self.forget_s:
                return
            del self.robots[name]

    def arrived(self, robot: str) -> None:
        """A request from `robot`. Robots idle past `forget_s` are forgotten here too, not only when
        a report is made: a server that never reports (`report_s` 0, no `stats` request) would
        otherwise keep a row for every robot name it ever saw."""
        with self._lock:
            now = self.clock()
            r = self._robot(robot)
            self.robots.move_to_end(robot)  # the most recently seen
            r.requests += 1
            r.last_seen = now
            self._forget_idle(now)

    def rejected(self, robot: str) -> None:
        with self._lock:
            self._robot(robot).rejected += 1

    def expired(self, robot: str) -> None:
        """A request answered `expired`: not run, its robot had stopped waiting."""
        with self._lock:
            self._robot(robot).expired += 1
            self.expired_total += 1

    def answered(self, robot: str, ok: bool, latency_ms: float, queue_ms: float, missed: bool) -> None:
        with self._lock:
            r = self._robot(robot)
            if ok:
                r.served += 1
                r.latency_ms.append(latency_ms)
                r.queue_ms.append(queue_ms)
            else:
                r.errors += 1
            r.deadline_misses += int(missed)

    def batch(self, size: int, record: BatchRecord | None = None) -> None:
        """A batch the engine ran at `size` (padded) observations."""
        with self._lock:
            if record is not None:
                self.reruns += record.reruns
                if not record.calls:
                    # Its padded size is 0: counted as a batch it pulled the mean batch below the real
                    # observations per batch, and showed as a "batch 0" row. Its requests count as errors.
                    self.failed_batches += 1
                    return
                self.records.append(record)
            self.batches += 1
            self.batch_sizes.append(size)

    def intake(self, ms: float) -> None:
        with self._lock:
            self.intake_ms += ms
            self.intake_n += 1

    @staticmethod
    def _by_size(records: list[BatchRecord]) -> dict[int, dict[str, Any]]:
        groups: dict[int, list[BatchRecord]] = {}
        for r in records:
            groups.setdefault(r.padded, []).append(r)
        out: dict[int, dict[str, Any]] = {}
        for size, rs in sorted(groups.items()):
            service = [r.service_ms for r in rs]
            row: dict[str, Any] = {"batches": len(rs), "observations": _mean([r.observations for r in rs]),
                                   "service_p50_ms": percentile(service, 50), "service_max_ms": max(service)}
            row.update({k: _mean([getattr(r, k) for r in rs]) for k in PHASES})
            out[size] = row
        return out

    def report(self) -> dict[str, Any]:
        # The robots' windows copied under the lock and summarised after it: the inference threads
        # count their answers under the same lock, and waited for the whole report (~1 ms a robot
        # with full windows). The batch records are summarised after it too.
        with self._lock:
            now = self.clock()
            self._forget_idle(now)
            sizes = list(self.batch_sizes)
            records = list(self.records)
            real = [r.observations for r in records]
            rep: dict[str, Any] = {
                "uptime_s": round(now - self.started, 3),
                "batches": self.batches,
                # Padded: the sizes the engine ran. Real observations per batch beside it.
                "batch_size": {"mean": sum(sizes) / len(sizes) if sizes else 0.0, "max": max(sizes, default=0)},
                "observations_per_batch": {"mean": _mean(real), "max": max(real, default=0)},
                "reruns": self.reruns,
                "failed_batches": self.failed_batches,
                "expired": self.expired_total,
                "intake_ms_per_request": self.intake_ms / self.intake_n if self.intake_n else 0.0,
            }
            robots = {name: r.copy() for name, r in self.robots.items()}
        rep["by_size"] = self._by_size(records)
        rep["robots"] = {name: r.summary(now) for name, r in sorted(robots.items())}
        return rep


def format_report(rep: dict[str, Any]) -> str:
    """The report as fixed-width text: one line per padded batch size (where the time went),
    then one line per robot."""
    lines = [f"serve: {rep['batches']} batches, mean batch {rep['batch_size']['mean']:.1f} "
             f"({rep.get('observations_per_batch', {}).get('mean', 0.0):.1f} real), reruns {rep.get('reruns', 0)}, "
             + (f"failed batches {rep['failed_batches']}, " if rep.get("failed_batches") else "")
             + f"expired {rep.get('expired', 0)}, "
             + (f"graphs built while serving {rep['graphs_built_serving']}, " if "graphs_built_serving" in rep else "")
             + f"uptime {rep['uptime_s']:.0f} s"]
    for size, b in rep.get("by_size", {}).items():
        lines.append(f"  batch {size:>3}: {b['batches']} runs, {b['observations']:.1f} real, service "
                     f"{b['service_ms']:.1f} ms (pre {b['preprocess_ms']:.1f}, engine {b['engine_ms']:.1f}, "
                     f"post {b['postprocess_ms']:.1f}, batcher {b['batcher_ms']:.1f}), waited {b['wait_ms']:.1f}")
    lines.append(f"{'robot':<20}{'req':>7}{'ok':>7}{'rej':>6}{'err':>6}{'exp':>6}{'miss':>6}{'p50 ms':>9}"
                 f"{'p99 ms':>9}{'max ms':>9}{'idle s':>8}")
    for name, r in rep["robots"].items():
        lat = r["latency_ms"]
        idle = "" if r["idle_s"] is None else f"{r['idle_s']:.1f}"
        lines.append(f"{name[:19]:<20}{r['requests']:>7}{r['served']:>7}{r['rejected']:>6}{r['errors']:>6}"
                     f"{r.get('expired', 0):>6}{r['deadline_misses']:>6}{lat['p50']:>9.1f}{lat['p99']:>9.1f}{lat['max']:>9.1f}{idle:>8}")
    return "\n".join(lines)
