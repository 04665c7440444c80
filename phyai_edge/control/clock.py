"""The fixed-period clock: absolute deadlines, measured lateness, counted overruns, real-time setup.

Deadlines are `start + k * period` on CLOCK_MONOTONIC (nanoseconds, integer arithmetic), so
lateness never accumulates. When a tick is woken more than one period late, the missed slots are
skipped (their actions are obsolete) and counted; the caller learns how many slots passed so it
can keep the chunk aligned with time.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import sys
import time
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("phyai_edge.control")


@dataclass
class Tick:
    slot: int  # index of the deadline on the grid (skipped slots included)
    deadline_ns: int
    wake_ns: int
    slots_advanced: int  # 1 normally; more when earlier slots were missed; 0 when interrupted
    interrupted: bool = False  # woken early by the interrupt fd (a signal): no slot consumed

    @property
    def lateness_ns(self) -> int:
        return self.wake_ns - self.deadline_ns


class LatenessLog:
    """Preallocated lateness samples (ns) so the tick path never allocates; wraps when full."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        self.values = np.zeros(capacity, dtype=np.int64)
        self.count = 0

    def add(self, value_ns: int) -> None:
        self.values[self.count % self.values.size] = value_ns
        self.count += 1

    def samples(self) -> np.ndarray:
        """Every sample kept, in storage order (once the log has wrapped, not in time order)."""
        return self.values[: min(self.count, self.values.size)]

    def recent(self, n: int) -> np.ndarray:
        """The last `n` samples (fewer before there are n), oldest first, across the wrap."""
        n = min(n, self.count, self.values.size)
        end = self.count % self.values.size
        if n <= end:
            return self.values[end - n:end]
        return np.concatenate((self.values[self.values.size - (n - end):], self.values[:end]))

    def summary_ms(self) -> dict[str, float]:
        s = self.samples()
        if s.size == 0:
            return {"p50": float("nan"), "p99": float("nan"), "max": float("nan"), "n": 0}
        ms = s / 1e6
        return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)), "max": float(ms.max()), "n": int(s.size)}


class LateTicks:
    """Ticks that published more than `limit_ns` after their deadline, counted, and described in at
    most one log line per `interval_ns`: which tick, whether the thread woke late (the scheduler, or
    another thread holding the GIL when the sleep ended) or woke on time and then spent the time in
    the tick's own work, and what that tick did. The lateness histogram says how often; this says
    when and around what, in the journal beside the other events."""

    def __init__(self, limit_ns: int, interval_ns: int = 10 * 10**9) -> None:
        self.limit_ns = limit_ns
        self.interval_ns = interval_ns
        self.count = 0
        self.worst_ns = 0
        self.worst_slot = -1
        self._unreported = 0
        self._last_report_ns: int | None = None

    def note(self, tick: Tick, published_ns: int, doing: str, missed_ns: int = 0) -> str | None:
        """Count a late tick (the caller checked `published_ns - tick.deadline_ns > limit_ns`, or
        that slots were missed before it); the line to log, or None while the last one is recent.
        `missed_ns`: the missed slots' periods. The tick's deadline is its own slot's, so after a
        stall the clock's lateness is only what is left of it past a whole period; the stall
        itself counts from the first missed slot's deadline."""
        late = published_ns - tick.deadline_ns + missed_ns
        woke = tick.lateness_ns + missed_ns
        self.count += 1
        self._unreported += 1
        if late > self.worst_ns:
            self.worst_ns, self.worst_slot = late, tick.slot
        if self._last_report_ns is not None and tick.wake_ns - self._last_report_ns < self.interval_ns:
            return None
        others = self._unreported - 1  # late ticks not described since the last line
        since = f"; {others} more since the last such line" if others else ""
        self._last_report_ns, self._unreported = tick.wake_ns, 0
        return (f"tick {tick.slot} published {late / 1e6:.2f} ms after its deadline (limit {self.limit_ns / 1e6:g} ms): "
                f"woke {woke / 1e6:.2f} ms late, then {(published_ns - tick.wake_ns) / 1e6:.2f} ms in the tick"
                f" ({doing or 'an action from the executing chunk'}){since}")

    def summary(self) -> dict[str, float | int]:
        return {"limit_ms": self.limit_ns / 1e6, "count": self.count,
                "worst_ms": self.worst_ns / 1e6, "worst_tick": self.worst_slot}


class PeriodicClock:
    def __init__(self, period_s: float, spin_s: float = 150e-6) -> None:
        if period_s <= 0:
            raise ValueError("period must be positive")
        self.period_ns = round(period_s * 1e9)
        self.spin_ns = round(spin_s * 1e9)
        self.start_ns = 0
        self.slot = -1
        self.missed = 0  # slots skipped because a tick woke more than one period late

    def start(self, start_ns: int | None = None) -> None:
        """The first deadline is one period after start (or `start_ns` itself if given)."""
        self.start_ns = time.monotonic_ns() + self.period_ns if start_ns is None else start_ns
        self.slot = -1

    def deadline(self, slot: int) -> int:
        return self.start_ns + slot * self.period_ns

    def wait(self, interrupt_fd: int | None = None) -> Tick:
        """Sleep to the next deadline (coarse sleep, then spin the last `spin_ns`).

        With `interrupt_fd` (the read end of signal.set_wakeup_fd's pipe) the coarse sleep is a
        select() that returns as soon as a signal arrives, so SIGTERM is handled at once instead
        of at the next deadline.
        """
        target_slot = self.slot + 1
        deadline = self.deadline(target_slot)
        now = time.monotonic_ns()
        remaining = deadline - now - self.spin_ns
        if remaining > 0:
            if interrupt_fd is None:
                time.sleep(remaining / 1e9)
            else:
                readable, _, _ = select.select([interrupt_fd], [], [], remaining / 1e9)
                if readable:
                    with contextlib.suppress(BlockingIOError):
                        os.read(interrupt_fd, 512)
                    now = time.monotonic_ns()
                    return Tick(self.slot, now, now, 0, interrupted=True)
        while True:
            now = time.monotonic_ns()
            if now >= deadline:
                break
        # More than one period late: the next slots' deadlines have passed too; jump to the latest.
        late_slots = (now - deadline) // self.period_ns
        if late_slots > 0:
            self.missed += late_slots
            target_slot += late_slots
            deadline = self.deadline(target_slot)
        advanced = target_slot - self.slot
        self.slot = target_slot
        return Tick(target_slot, deadline, now, advanced)


# ---------------------------------------------------------------- real-time setup


def promote_threads(names: tuple[str, ...], priority: int) -> list[str]:
    """SCHED_FIFO for this process's helper threads whose name starts with one of `names`.

    Why: a helper thread holding the GIL while a busy machine preempts it would keep the
    (real-time) clock thread waiting for the GIL: priority inversion. These threads block on
    I/O almost all the time, so running them at a real-time priority below the clock's costs
    nothing.
    """
    import threading

    done = []
    for t in threading.enumerate():
        if t.native_id is None or not t.name.startswith(names) or t is threading.current_thread():
            continue
        try:
            os.sched_setscheduler(t.native_id, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(priority))
            done.append(t.name)
        except OSError:
            pass
    return done


def fifo_permitted(priority: int) -> bool:
    """Whether this process may use SCHED_FIFO at `priority`, tried on a throwaway thread."""
    if priority <= 0 or not sys.platform.startswith("linux"):
        return False
    import threading

    ok = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, name="rt-probe")
    t.start()
    t.join()
    return bool(ok)

_MCL_CURRENT, _MCL_FUTURE, _MCL_ONFAULT = 1, 2, 4


def setup_realtime(priority: int, cpus: tuple[int, ...], mlock: bool) -> list[str]:
    """Best effort: SCHED_FIFO for the calling thread, CPU affinity, locked memory.

    Returns one human line per setting (what was done or why not); the caller logs them. Called
    from the clock thread after every helper thread and the worker process have started, since
    Linux applies these to the calling thread and threads/processes inherit them.
    """
    notes: list[str] = []
    if not sys.platform.startswith("linux"):
        return ["real-time setup skipped: not Linux"]
    if priority > 0:
        try:
            # RESET_ON_FORK: a worker process started later (a restart) gets normal scheduling.
            os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(priority))
            notes.append(f"clock thread: SCHED_FIFO priority {priority}")
        except PermissionError:
            notes.append(
                f"clock thread: SCHED_FIFO {priority} not permitted; running SCHED_OTHER "
                "(grant LimitRTPRIO / CAP_SYS_NICE, see systemd/INSTALL.md)"
            )
        except OSError as exc:
            notes.append(f"clock thread: SCHED_FIFO {priority} failed ({exc.strerror}); running SCHED_OTHER")
    if cpus:
        try:
            os.sched_setaffinity(0, set(cpus))
            notes.append(f"clock thread: CPU affinity {sorted(cpus)}")
        except OSError as exc:
            notes.append(f"clock thread: CPU affinity {sorted(cpus)} failed ({exc.strerror})")
    if mlock:
        libc = ctypes.CDLL(None, use_errno=True)
        # ONFAULT locks pages as they are touched instead of faulting in every mapping now.
        flags = _MCL_CURRENT | _MCL_FUTURE | _MCL_ONFAULT
        if libc.mlockall(flags) != 0 and libc.mlockall(_MCL_CURRENT | _MCL_FUTURE) != 0:
            err = ctypes.get_errno()
            notes.append(f"memory: mlockall failed ({os.strerror(err)}); pages may be swapped (raise LimitMEMLOCK)")
        else:
            notes.append("memory: locked (mlockall)")
    return notes


def realtime_refused(note: str) -> bool:
    """Whether a `setup_realtime` note says a setting was refused (the loop then runs without it)."""
    return "not permitted" in note or "failed" in note
