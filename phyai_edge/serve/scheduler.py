"""Deadline-aware dynamic batching with back-pressure and per-robot fairness (torch-free).

Admission (`submit`), from the intake thread:
- a bounded queue: past `capacity` queued requests a new one is rejected at once with
  `overloaded` (the robot keeps executing its current chunk and retries; queueing it would only
  make every robot late);
- per-robot share: a robot with `per_robot` requests already queued is rejected with
  `robot_limit`, so one chatty or misbehaving robot cannot fill the queue.

Batch formation (`next_batch`), from an inference thread:
- the window opens with the oldest queued request and closes after `window_s`, when enough
  observations are queued to fill `max_batch`, or earlier when waiting longer would make the
  earliest deadline miss (deadline - estimated service time), whichever comes first;
- requests are taken earliest deadline first, at most one per robot in the first pass (so a
  robot with two queued requests cannot push another robot's only request to the next batch),
  then further requests by deadline to fill the batch;
- only requests that may share an engine call join (same solver RTC mode and guidance
  weight, see `batching`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from phyai_edge.serve.wire import ERR_OVERLOADED, ERR_ROBOT_LIMIT, ERR_SHUTDOWN

Clock = Callable[[], float]


@dataclass(eq=False)  # identity, not field equality: payloads hold numpy arrays
class Pending:
    robot: str
    req_id: int
    size: int  # observations in the request
    deadline: float  # server monotonic seconds
    key: Any = None  # group key (see batching.group_key); None joins any batch
    payload: Any = None
    arrival: float = 0.0
    seq: int = 0  # arrival order: ties in deadline go first come, first served


@dataclass
class SchedulerConfig:
    max_batch: int = 16  # observations per engine call
    window_s: float = 0.005  # how long the first request of a batch waits for company
    capacity: int = 64  # queued requests, all robots together
    per_robot: int = 2  # queued requests per robot
    service_estimate_s: float = 0.05  # first guess of one batch's service time, refined as batches run


def compatible(a: Any, b: Any) -> bool:
    """Whether requests with group keys a and b may share an engine call. A request without
    solver RTC (key None) rides along with per-sample RTC requests of any mode (zero weights
    and d = 0 leave it untouched), but not with a key that carries a delay (an engine that
    takes one soft mask or one hard-prefix length for the whole batch)."""
    if a is None or b is None:
        other = b if a is None else a
        return other is None or (other[2] == -1 and other[3] == -1)
    return a == b


@dataclass
class Scheduler:
    cfg: SchedulerConfig = field(default_factory=SchedulerConfig)
    clock: Clock = time.monotonic

    def __post_init__(self) -> None:
        self._queue: list[Pending] = []
        self._per_robot: dict[str, int] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._seq = 0
        self.service_s = self.cfg.service_estimate_s

    # -- intake ----------------------------------------------------------------------------
    def submit(self, p: Pending) -> str | None:
        """Queue a request; returns None if accepted, else the error code of the rejection."""
        with self._cond:
            if self._closed:
                return ERR_SHUTDOWN
            if len(self._queue) >= self.cfg.capacity:
                return ERR_OVERLOADED
            if self._per_robot.get(p.robot, 0) >= self.cfg.per_robot:
                return ERR_ROBOT_LIMIT
            if p.size > self.cfg.max_batch:
                return ERR_OVERLOADED
            p.arrival = p.arrival or self.clock()
            p.seq = self._seq
            self._seq += 1
            self._queue.append(p)
            self._per_robot[p.robot] = self._per_robot.get(p.robot, 0) + 1
            self._cond.notify()
            return None

    def drop_robot(self, robot: str) -> list[Pending]:
        """Remove a robot's queued requests (it went away); returns them."""
        with self._cond:
            gone = [p for p in self._queue if p.robot == robot]
            self._queue = [p for p in self._queue if p.robot != robot]
            self._per_robot.pop(robot, None)
            return gone

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)

    def close(self) -> list[Pending]:
        """Stop; wakes every waiting `next_batch` and returns what was still queued."""
        with self._cond:
            self._closed = True
            left, self._queue = self._queue, []
            self._per_robot.clear()
            self._cond.notify_all()
            return left

    def record_service(self, seconds: float) -> None:
        """Measured time of one batch; a moving estimate that leans towards the slow side,
        because closing a window late costs a deadline and closing it early costs little."""
        with self._cond:
            if seconds > self.service_s:
                self.service_s = 0.5 * self.service_s + 0.5 * seconds
            else:
                self.service_s = 0.9 * self.service_s + 0.1 * seconds

    # -- batch formation -------------------------------------------------------------------
    def _close_time(self) -> float:
        oldest = min(p.arrival for p in self._queue)
        earliest = min(p.deadline for p in self._queue)
        return min(oldest + self.cfg.window_s, earliest - self.service_s)

    def _select(self) -> list[Pending]:
        order = sorted(self._queue, key=lambda p: (p.deadline, p.seq))
        key = order[0].key  # the most urgent request decides which kind of batch this is
        chosen: list[Pending] = []
        robots: set[str] = set()
        total = 0
        for first_pass in (True, False):
            for p in order:
                if p in chosen or (first_pass and p.robot in robots):
                    continue
                if not compatible(key, p.key) or total + p.size > self.cfg.max_batch:
                    continue
                if key is None and p.key is not None:
                    key = p.key  # an unguided head adopts the first guided request's kind
                chosen.append(p)
                robots.add(p.robot)
                total += p.size
        for p in chosen:
            self._queue.remove(p)
            left = self._per_robot.get(p.robot, 1) - 1
            if left:
                self._per_robot[p.robot] = left
            else:
                self._per_robot.pop(p.robot, None)
        return sorted(chosen, key=lambda p: (p.deadline, p.seq))

    def next_batch(self, timeout: float | None = None) -> list[Pending]:
        """Block until a batch is ready (or `timeout` seconds pass, or the scheduler closes:
        then an empty list)."""
        end = None if timeout is None else self.clock() + timeout
        with self._cond:
            while True:
                if self._closed:
                    return []
                now = self.clock()
                if self._queue:
                    queued = sum(p.size for p in self._queue)
                    if queued >= self.cfg.max_batch or now >= self._close_time():
                        return self._select()
                    wait = self._close_time() - now
                else:
                    wait = None
                if end is not None:
                    if now >= end:
                        return []
                    wait = end - now if wait is None else min(wait, end - now)
                self._cond.wait(wait)
