"""Per-robot latency and outcome counters for the server's report (torch-free)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile; 0.0 for no samples (a report, not a statistic to divide by)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(q / 100.0 * (len(s) - 1))))
    return s[k]


@dataclass
class RobotStats:
    requests: int = 0
    served: int = 0
    rejected: int = 0
    errors: int = 0
    deadline_misses: int = 0
    last_seen: float = 0.0
    # Recent latencies only: a report should describe now, not the whole uptime.
    latency_ms: deque = field(default_factory=lambda: deque(maxlen=2000))
    queue_ms: deque = field(default_factory=lambda: deque(maxlen=2000))

    def summary(self) -> dict[str, Any]:
        lat, q = list(self.latency_ms), list(self.queue_ms)
        return {
            "requests": self.requests, "served": self.served, "rejected": self.rejected, "errors": self.errors,
            "deadline_misses": self.deadline_misses,
            "latency_ms": {"p50": percentile(lat, 50), "p99": percentile(lat, 99), "max": max(lat, default=0.0)},
            "queue_ms": {"p50": percentile(q, 50), "p99": percentile(q, 99)},
            "idle_s": round(time.monotonic() - self.last_seen, 3) if self.last_seen else None,
        }


class ServerStats:
    """Thread-safe: the intake thread counts arrivals and rejections, inference threads count
    answers."""

    def __init__(self, forget_s: float = 3600.0) -> None:
        # A daemon's default robot name carries its pid, so every restart is a new robot:
        # forget robots idle this long, or the table (and memory) grows with every restart.
        self.forget_s = forget_s
        self._lock = threading.Lock()
        self.robots: dict[str, RobotStats] = {}
        self.batches = 0
        self.batch_sizes: deque = deque(maxlen=2000)
        self.started = time.monotonic()

    def _robot(self, name: str) -> RobotStats:
        r = self.robots.get(name)
        if r is None:
            r = self.robots[name] = RobotStats()
        return r

    def arrived(self, robot: str) -> None:
        with self._lock:
            r = self._robot(robot)
            r.requests += 1
            r.last_seen = time.monotonic()

    def rejected(self, robot: str) -> None:
        with self._lock:
            self._robot(robot).rejected += 1

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

    def batch(self, size: int) -> None:
        with self._lock:
            self.batches += 1
            self.batch_sizes.append(size)

    def report(self) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            for name in [n for n, r in self.robots.items() if r.last_seen and now - r.last_seen > self.forget_s]:
                del self.robots[name]
            sizes = list(self.batch_sizes)
            return {
                "uptime_s": round(time.monotonic() - self.started, 3),
                "batches": self.batches,
                "batch_size": {"mean": sum(sizes) / len(sizes) if sizes else 0.0, "max": max(sizes, default=0)},
                "robots": {name: r.summary() for name, r in sorted(self.robots.items())},
            }


def format_report(rep: dict[str, Any]) -> str:
    """The report as a fixed-width table, one robot a line."""
    lines = [f"serve: {rep['batches']} batches, mean batch {rep['batch_size']['mean']:.1f}, "
             f"uptime {rep['uptime_s']:.0f} s",
             f"{'robot':<20}{'req':>7}{'ok':>7}{'rej':>6}{'err':>6}{'miss':>6}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
             f"{'idle s':>8}"]
    for name, r in rep["robots"].items():
        lat = r["latency_ms"]
        idle = "" if r["idle_s"] is None else f"{r['idle_s']:.1f}"
        lines.append(f"{name[:19]:<20}{r['requests']:>7}{r['served']:>7}{r['rejected']:>6}{r['errors']:>6}"
                     f"{r['deadline_misses']:>6}{lat['p50']:>9.1f}{lat['p99']:>9.1f}{lat['max']:>9.1f}{idle:>8}")
    return "\n".join(lines)
