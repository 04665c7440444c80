"""Deadline-aware dynamic batching with back-pressure and per-robot fairness (torch-free).

Admission (`submit`), from the intake thread:
- a bounded queue: past `capacity` queued requests a new one is rejected at once with
  `overloaded` (the robot keeps executing its current chunk and retries; queueing it would only
  make every robot late);
- per-robot share: a robot with `per_robot` requests already queued is rejected with
  `robot_limit`, so one chatty or misbehaving robot cannot fill the queue;
- a request of more observations than one engine call takes (`limit`) is refused with
  `bad_request`: it could never run, so it must not read as back-pressure to retry.
A request that is admitted is run and answered, late if need be (the reply says so), unless
it expires first.

Expiry. A request may carry the time its client stops waiting for the answer (`expiry`: the
server's arrival + the request's `wait_ms`). One still queued at its expiry is never put in a
batch: its answer would reach nobody, and running it would make every other robot later. It
leaves the queue before any batch forms or any request is admitted, so it no longer counts
toward its robot's share, the capacity, a batch's fill or when the window closes, and
`take_expired` hands it back for the server to answer `expired` (every request still gets one
reply). A request without an expiry never expires; one already in a running batch is not
cancelled.

Batch formation (`next_batch`), from an inference thread:
- the window opens with the oldest queued request and closes after `window_s`, when enough
  observations that may share the batch are queued to fill `max_batch` (requests of another RTC
  kind do not count), or earlier when waiting longer would make the earliest deadline miss
  (deadline - the expected service time of such a batch), whichever comes first;
- candidates are ordered earliest deadline first, at most one per robot in the first pass (so
  a robot with two queued requests cannot push another robot's only request to the next
  batch), then further requests by deadline; only requests that may share an engine call
  join (same solver RTC mode and guidance weight, see `batching`);
- the batch is a prefix of that order, at most `max_batch` observations, as long as the
  latency rule below makes it.

The latency rule. Every padded batch size has a service time learned online (`ServiceTimes`:
one moving estimate per size the engine really runs, padding included), so a batch of the
first k candidates is expected to finish at F(k) = now + T(pad(k)), and the candidates it
leaves out, run next as one batch, at F(k) + T(pad(rest)). The batch takes the k with the
fewest expected misses over the two (ties: the larger k). So a batch does not grow past the
size at which its earliest deadline would miss when a smaller batch would keep it, unless the
requests that smaller batch leaves behind would then miss more deadlines than it saves. A
request that would miss even alone counts the same for every k and so holds nobody back; when
every candidate is lost the batch is as large as allowed. Under overload that keeps batches
large (the engine's throughput) while still giving each batch the urgent requests it can save;
the server answers admitted requests late (flagged `late`) rather than dropping them while their
client still waits (expiry above), and refuses new ones only when the queue is full
(back-pressure above).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from phyai_edge.serve.wire import ERR_BAD_REQUEST, ERR_OVERLOADED, ERR_ROBOT_LIMIT, ERR_SHUTDOWN

Clock = Callable[[], float]

# The captured batch sizes a serving engine pads to by default. The engine's time per chunk is
# close to linear in the padded size (H200, full PI0.5, cudagraph bf16: 21 ms at 1, 76 at 8,
# 268 at 32, 525 at 64: ~8 ms per sample above a small fixed part), so a padded row costs
# about as much as a real one, and what padding wastes is padded rows, not a ratio. Powers of
# two waste up to 15 rows (~120 ms) between 16 and 32, where a 500 ms budget puts the batches
# that can still meet it (a request waits for the batch in flight and then its own, so a batch
# must fit in about half the budget): steps of 4 there (at most 3 padded rows, ~25 ms), steps
# of 8 above 32 (batches that large only drain an overload) and powers of two below 8 (small
# batches: little to waste). Each size costs a capture at start-up (~1 s) and its graphs'
# memory; 14 sizes instead of 7.
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64)


def pad_size(n: int, batch_sizes: Sequence[int] | None) -> int:
    """Smallest captured batch size >= n (an engine with CUDA graphs or TensorRT profiles runs
    only those); n itself when the engine takes any size."""
    if not batch_sizes:
        return n
    fits = [b for b in sorted(batch_sizes) if b >= n]
    if not fits:
        raise ValueError(f"batch of {n} exceeds the largest captured batch size {max(batch_sizes)}")
    return fits[0]


def serving_batch_sizes(max_batch: int, sizes: Iterable[int] = DEFAULT_BATCH_SIZES) -> list[int]:
    """The sizes to capture for a server that runs at most `max_batch` observations per call:
    those up to it, and `max_batch` itself (a batch of max_batch needs a size to pad to)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return sorted({b for b in sizes if b <= max_batch} | {max_batch})


class ServiceTimes:
    """Seconds per batch, learned per padded batch size, for the latency rule.

    A size's estimate is a moving average that leans towards the slow side (a slow batch moves
    it half way, a fast one a tenth of the way): closing a batch late costs a deadline, a batch
    a little smaller than it could have been costs little. A batch counts as at most twice the
    estimate: a one-off stall (a capture, a collection pause: ~1 s against 60 ms) then raises it by
    half, where it would have raised it eightfold and taken ~40 batches of that size to come back
    down, closing batches early and small meanwhile; a lasting slowdown is still followed, the
    estimate growing by half a batch. A size not yet measured is read off
    its measured neighbours: linearly between the nearest below and above; above the largest,
    that size's time per observation (the engine's time per observation falls as batches grow,
    so this errs slow); below the smallest, the smallest's time (a smaller batch is not
    slower); with nothing measured yet, `prior_s`."""

    def __init__(self, prior_s: float = 0.05) -> None:
        self.prior_s = prior_s
        self._s: dict[int, float] = {}

    def record(self, size: int, seconds: float) -> None:
        old = self._s.get(size)
        if old is None:
            self._s[size] = seconds
        elif seconds > old:
            self._s[size] = 0.5 * old + 0.5 * min(seconds, 2.0 * old)
        else:
            self._s[size] = 0.9 * old + 0.1 * seconds

    def estimate(self, size: int) -> float:
        if size in self._s:
            return self._s[size]
        if not self._s:
            return self.prior_s
        below = [b for b in self._s if b < size]
        above = [b for b in self._s if b > size]
        if below and above:
            lo, hi = max(below), min(above)
            f = (size - lo) / (hi - lo)
            return self._s[lo] + f * (self._s[hi] - self._s[lo])
        if below:
            lo = max(below)
            return self._s[lo] * size / lo
        return self._s[min(above)]

    def snapshot(self) -> dict[int, float]:
        return dict(sorted(self._s.items()))


@dataclass(eq=False)  # identity, not field equality: payloads hold numpy arrays
class Pending:
    robot: str
    req_id: int
    size: int  # observations in the request
    deadline: float  # server monotonic seconds
    key: Any = None  # group key (see batching.group_key); None joins any batch
    payload: Any = None
    arrival: float = 0.0
    # When its client stops waiting (server monotonic seconds): still queued then, it is not
    # run but handed back by `take_expired`. None: never.
    expiry: float | None = None
    seq: int = 0  # arrival order: ties in deadline go first come, first served


@dataclass
class SchedulerConfig:
    max_batch: int = 16  # observations per engine call
    window_s: float = 0.005  # how long the first request of a batch waits for company
    capacity: int = 64  # queued requests, all robots together
    per_robot: int = 2  # queued requests per robot
    service_estimate_s: float = 0.05  # first guess of any batch's service time, until one is measured
    # The engine's captured batch sizes (None: it runs any size): the latency rule prices a
    # batch at the size it is padded to.
    batch_sizes: tuple[int, ...] | None = None


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
        self._expired: list[Pending] = []  # out of the queue, not yet handed back (take_expired)
        self._expired_n = 0  # requests expired so far: a waiting next_batch returns when it grows
        self._cond = threading.Condition()
        self._closed = False
        self._seq = 0
        self.times = ServiceTimes(self.cfg.service_estimate_s)
        sizes = self.cfg.batch_sizes
        self.batch_sizes: tuple[int, ...] | None = tuple(sorted(sizes)) if sizes else None
        # A batch larger than the largest captured size could not be padded to one.
        self.limit = min(self.cfg.max_batch, self.batch_sizes[-1]) if self.batch_sizes else self.cfg.max_batch

    # -- intake ----------------------------------------------------------------------------
    def submit(self, p: Pending) -> str | None:
        """Queue a request; returns None if accepted, else the error code of the rejection.
        Queued requests past their expiry leave the queue first (`take_expired`), so they
        count toward neither the capacity nor their robot's share."""
        with self._cond:
            if self._closed:
                return ERR_SHUTDOWN
            if p.size > self.limit:
                # Permanent, whatever the load: `overloaded` would tell the robot to retry.
                return ERR_BAD_REQUEST
            self._expire(self.clock())
            if len(self._queue) >= self.cfg.capacity:
                return ERR_OVERLOADED
            if self._per_robot.get(p.robot, 0) >= self.cfg.per_robot:
                return ERR_ROBOT_LIMIT
            p.arrival = p.arrival or self.clock()
            p.seq = self._seq
            self._seq += 1
            self._queue.append(p)
            self._per_robot[p.robot] = self._per_robot.get(p.robot, 0) + 1
            self._cond.notify()
            return None

    def _expire(self, now: float) -> None:
        """Move queued requests past their expiry out of the queue, to be handed back."""
        gone = [p for p in self._queue if p.expiry is not None and now >= p.expiry]
        if not gone:
            return
        ids = {id(p) for p in gone}
        self._queue = [p for p in self._queue if id(p) not in ids]
        self._release(gone)
        self._expired.extend(gone)
        self._expired_n += len(gone)
        self._cond.notify_all()  # a waiting next_batch returns, so that its caller answers them

    def _release(self, gone: Iterable[Pending]) -> None:
        """Give back the per-robot share of requests that left the queue."""
        for p in gone:
            left = self._per_robot.get(p.robot, 1) - 1
            if left:
                self._per_robot[p.robot] = left
            else:
                self._per_robot.pop(p.robot, None)

    def take_expired(self) -> list[Pending]:
        """The requests that expired in the queue (and were not handed back yet), in arrival
        order, each handed back once: the caller answers them (the server: `expired`). Checks
        the queue against the clock first, so everything past its expiry now is among them."""
        with self._cond:
            self._expire(self.clock())
            gone, self._expired = self._expired, []
            return sorted(gone, key=lambda p: p.seq)

    def __len__(self) -> int:
        """Queued requests not past their expiry."""
        with self._cond:
            self._expire(self.clock())
            return len(self._queue)

    def close(self) -> list[Pending]:
        """Stop; wakes every waiting `next_batch` and returns what was still queued (expired
        requests not handed back yet stay for `take_expired`)."""
        with self._cond:
            self._closed = True
            left, self._queue = self._queue, []
            self._per_robot.clear()
            self._cond.notify_all()
            return left

    # -- service times ---------------------------------------------------------------------
    def padded(self, observations: int) -> int:
        return pad_size(observations, self.batch_sizes)

    def record_service(self, size: int, seconds: float) -> None:
        """Measured time of one batch that the engine ran at `size` (padded) observations."""
        with self._cond:
            self.times.record(size, seconds)

    def service_estimates(self) -> dict[int, float]:
        with self._cond:
            return self.times.snapshot()

    # -- batch formation -------------------------------------------------------------------
    def _fill(self) -> int:
        """Observations the next batch would hold now: its candidates, not the whole queue (a
        request of another RTC kind cannot join it, so it does not make the batch full)."""
        return sum(p.size for p in self._candidates())

    def _close_time(self, now: float) -> float:
        """When the next batch is ready (queue not empty): `now` if its candidates fill it, else
        the window's end or the earliest deadline less that batch's service time. One candidate
        sort serves both."""
        fill = self._fill()
        if fill >= self.limit:
            return now
        oldest = min(p.arrival for p in self._queue)
        earliest = min(p.deadline for p in self._queue)
        return min(oldest + self.cfg.window_s, earliest - self.times.estimate(self.padded(fill)))

    def ready_at(self) -> float | None:
        """When `next_batch` would hand out a batch if nothing else arrived (None: queue empty)."""
        with self._cond:
            now = self.clock()
            self._expire(now)
            if not self._queue:
                return None
            return self._close_time(now)

    def _candidates(self) -> list[Pending]:
        """Queued requests in the order a batch takes them: earliest deadline first, one per
        robot before any robot's second, only those compatible with the most urgent one, at
        most `limit` observations."""
        order = sorted(self._queue, key=lambda p: (p.deadline, p.seq))
        key = order[0].key  # the most urgent request decides which kind of batch this is
        chosen: list[Pending] = []
        taken: set[int] = set()
        robots: set[str] = set()
        total = 0
        for first_pass in (True, False):
            for p in order:
                if id(p) in taken or (first_pass and p.robot in robots):
                    continue
                if not compatible(key, p.key) or total + p.size > self.limit:
                    continue
                if key is None and p.key is not None:
                    key = p.key  # an unguided head adopts the first guided request's kind
                chosen.append(p)
                taken.add(id(p))
                robots.add(p.robot)
                total += p.size
        return chosen

    def _take(self, candidates: list[Pending], now: float) -> int:
        """How many candidates the batch takes: the latency rule (module docstring)."""
        cost: dict[int, float] = {}

        def seconds(observations: int) -> float:
            size = self.padded(observations)
            if size not in cost:
                cost[size] = self.times.estimate(size)
            return cost[size]

        total = sum(p.size for p in candidates)
        best_k, best_misses, n = len(candidates), len(candidates) + 1, 0
        for k in range(1, len(candidates) + 1):
            n += candidates[k - 1].size
            first = now + seconds(n)
            misses = sum(first > p.deadline for p in candidates[:k])
            if k < len(candidates):
                second = first + seconds(total - n)
                misses += sum(second > p.deadline for p in candidates[k:])
            if misses <= best_misses:  # ties go to the larger batch: more work done per call
                best_k, best_misses = k, misses
        return best_k

    def _select(self) -> list[Pending]:
        candidates = self._candidates()
        chosen = candidates[:self._take(candidates, self.clock())]
        ids = {id(p) for p in chosen}
        self._queue = [p for p in self._queue if id(p) not in ids]
        self._release(chosen)
        return sorted(chosen, key=lambda p: (p.deadline, p.seq))

    def next_batch(self, timeout: float | None = None) -> list[Pending]:
        """Block until a batch is ready (or `timeout` seconds pass, or the scheduler closes, or
        requests expire: then an empty list). Requests past their expiry leave the queue before
        a batch forms, so they neither join it nor set when it closes. When some expire during
        the call (found so here, or by a `submit` meanwhile) and no batch is ready, it returns
        at once, for its caller to answer them (`take_expired`). It does not wake for an expiry
        itself: a queued request's window closes before long anyway, and one queued behind a
        running batch is checked when the batch is done."""
        end = None if timeout is None else self.clock() + timeout
        with self._cond:
            seen = self._expired_n
            while True:
                if self._closed:
                    return []
                now = self.clock()
                self._expire(now)
                if self._queue:
                    close = self._close_time(now)
                    if now >= close:
                        return self._select()
                    wait = close - now
                else:
                    wait = None
                if self._expired_n != seen:
                    return []
                if end is not None:
                    if now >= end:
                        return []
                    wait = end - now if wait is None else min(wait, end - now)
                self._cond.wait(wait)
