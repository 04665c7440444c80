"""The scheduler's latency rule and batch-size policy, on a fake clock with a fake engine whose
time per batch size is known: no sockets, no threads, no timing of real code.

`serve.simulate` drives one `Scheduler` the way the server's single inference thread does, with
robots that behave like `serve.loadgen` (a request every period; the next one only after the
answer; a refused request is skipped until the next period)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest

from phyai_edge.serve import wire
from phyai_edge.serve.scheduler import (
    DEFAULT_BATCH_SIZES,
    Pending,
    Scheduler,
    SchedulerConfig,
    ServiceTimes,
    pad_size,
    serving_batch_sizes,
)
from phyai_edge.serve.simulate import SimResult, TakeAllScheduler
from phyai_edge.serve.simulate import simulate as _simulate

POWERS_OF_TWO = (1, 2, 4, 8, 16, 32, 64)


def h200_like(size: int) -> float:
    """Seconds per padded batch, shaped like the H200's full PI0.5 (21 ms at 1, 78 at 8, 270 at
    32, 526 at 64): a small fixed part and ~8 ms per sample."""
    return 0.014 + 0.008 * size


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _p(robot: str, deadline: float, arrival: float, size: int = 1) -> Pending:
    return Pending(robot, 0, size, deadline, None, robot, arrival)


def _seeded(clock: FakeClock, sizes: Sequence[int], engine: Callable[[int], float] = h200_like,
            **cfg: object) -> Scheduler:
    s = Scheduler(SchedulerConfig(batch_sizes=tuple(sizes), **cfg), clock)  # type: ignore[arg-type]
    for b in sizes:
        s.record_service(b, engine(b))
    return s


def test_requests_of_another_rtc_kind_do_not_make_the_batch_full():
    """Four queued observations with max_batch 4, but two of them carry another RTC kind and
    cannot share the batch: the window stays open for company of the head's kind instead of
    closing at once with a half batch; once two more of its kind arrive, it is full."""
    clock = FakeClock()
    s = _seeded(clock, POWERS_OF_TWO, max_batch=4, window_s=0.010)
    a, b = ("guided", 5.0, 3, 25), ("inpaint", 5.0, 3, 25)  # delay-carrying keys: no mixing

    def req(robot: str, key: tuple) -> Pending:
        return Pending(robot, 0, 1, clock.t + 10, key, robot, clock.t)

    for robot, key in (("r0", a), ("r1", a), ("r2", b), ("r3", b)):
        assert s.submit(req(robot, key)) is None
    assert s.ready_at() == pytest.approx(clock.t + 0.010)  # the window, not now
    for robot in ("r4", "r5"):
        assert s.submit(req(robot, a)) is None
    assert s.ready_at() == clock.t  # four of the head's kind: full
    assert [p.robot for p in s.next_batch(timeout=0)] == ["r0", "r1", "r4", "r5"]


# -- service times ---------------------------------------------------------------------------
def test_service_times_lean_slow_and_fill_unmeasured_sizes():
    t = ServiceTimes(prior_s=0.05)
    assert t.estimate(8) == 0.05  # nothing measured yet
    t.record(8, 0.080)
    assert t.estimate(8) == pytest.approx(0.080)
    assert t.estimate(2) == pytest.approx(0.080)  # below the smallest measured: not faster
    assert t.estimate(16) == pytest.approx(0.160)  # above the largest: its time per observation
    t.record(32, 0.270)
    assert t.estimate(16) == pytest.approx(0.080 + (16 - 8) / (32 - 8) * (0.270 - 0.080))  # between: linear
    t.record(8, 0.120)  # slower: half way
    assert t.estimate(8) == pytest.approx(0.100)
    t.record(8, 0.000)  # faster: a tenth of the way
    assert t.estimate(8) == pytest.approx(0.090)
    assert list(t.snapshot()) == [8, 32]


def test_a_one_off_stall_moves_the_service_time_by_half_and_a_lasting_slowdown_is_followed():
    t = ServiceTimes()
    t.record(8, 0.060)
    t.record(8, 1.000)  # a capture or a pause: counts as twice the estimate
    assert t.estimate(8) == pytest.approx(0.090)
    for _ in range(6):
        t.record(8, 0.060)
    assert t.estimate(8) < 0.080  # back within a third of the true time in six batches
    slow = ServiceTimes()
    slow.record(8, 0.060)
    for _ in range(6):
        slow.record(8, 0.300)  # the GPU now really takes five times as long
    assert 0.28 < slow.estimate(8) <= 0.300  # within 5% after six batches


def test_serving_batch_sizes_stop_at_max_batch_and_include_it():
    assert serving_batch_sizes(64) == list(DEFAULT_BATCH_SIZES)
    assert serving_batch_sizes(16) == [1, 2, 4, 8, 12, 16]
    assert serving_batch_sizes(30) == [1, 2, 4, 8, 12, 16, 20, 24, 28, 30]
    assert pad_size(25, DEFAULT_BATCH_SIZES) == 28 and pad_size(33, DEFAULT_BATCH_SIZES) == 40
    with pytest.raises(ValueError, match="max_batch"):
        serving_batch_sizes(0)


def test_a_batch_larger_than_the_largest_size_is_never_formed():
    clock = FakeClock()
    s = Scheduler(SchedulerConfig(max_batch=64, batch_sizes=(1, 2, 4), window_s=0.0), clock)
    for i in range(6):
        assert s.submit(_p(f"r{i}", clock.t + 10, clock.t)) is None
    assert len(s.next_batch(0)) == 4
    # A request no engine call can take is refused as malformed, not as back-pressure to
    # retry (the robot would retry it forever), even while the queue is full.
    assert s.submit(_p("big", clock.t + 10, clock.t, size=5)) == wire.ERR_BAD_REQUEST
    for i in range(s.cfg.capacity - len(s)):
        assert s.submit(_p(f"q{i}", clock.t + 10, clock.t)) is None
    assert s.submit(_p("small", clock.t + 10, clock.t)) == wire.ERR_OVERLOADED
    assert s.submit(_p("big", clock.t + 10, clock.t, size=5)) == wire.ERR_BAD_REQUEST


# -- the latency rule --------------------------------------------------------------------------
def test_batch_stops_growing_where_the_earliest_deadline_would_miss():
    clock = FakeClock()
    s = _seeded(clock, POWERS_OF_TWO, max_batch=64, window_s=0.005)
    now = clock.t
    head = _p("late", now + 0.060, now - 0.440)  # waited 440 ms of its 500: 60 ms left
    rest = [_p(f"r{i:02d}", now + 0.5 - 0.001 * i, now - 0.001 * i) for i in range(31)]
    for p in [head, *rest]:
        s.submit(p)
    first = s.next_batch(0)
    # A batch of 32 (270 ms) would make it late; 4 (46 ms) is the largest that keeps it.
    assert first[0] is head and len(first) == 4
    clock.t += h200_like(4)
    second = s.next_batch(0)
    assert len(second) == 28
    finish = clock.t + h200_like(pad_size(28, POWERS_OF_TWO))
    assert all(finish <= p.deadline for p in [*first[1:], *second])


def test_a_lost_request_does_not_hold_its_neighbours_back():
    clock = FakeClock()
    s = _seeded(clock, POWERS_OF_TWO, max_batch=64)
    now = clock.t
    lost = _p("lost", now - 0.010, now - 0.510)  # already past its deadline
    tight = _p("tight", now + 0.031, now - 0.469)
    easy = [_p(f"e{i}", now + 0.5, now) for i in range(10)]
    for p in [lost, tight, *easy]:
        s.submit(p)
    # Bound by the tight one, not the lost one: 2 requests (30 ms) fit its 31 ms, 3 (pad 4: 46 ms) do not.
    assert s.next_batch(0) == [lost, tight]


def test_when_every_request_is_lost_the_batch_is_as_large_as_allowed():
    clock = FakeClock()
    s = _seeded(clock, POWERS_OF_TWO, max_batch=16)
    for i in range(20):
        s.submit(_p(f"r{i}", clock.t - 0.001, clock.t - 0.501))
    assert len(s.next_batch(0)) == 16  # overload: the largest batch drains the queue fastest


def test_window_closes_early_by_the_expected_time_of_what_is_queued():
    clock = FakeClock()
    s = _seeded(clock, POWERS_OF_TWO, max_batch=64, window_s=0.050)
    now = clock.t
    for i in range(8):
        s.submit(_p(f"r{i}", now + 0.100, now))
    # Eight queued cost 78 ms: waiting past deadline - 78 ms would make them late.
    assert s.ready_at() == pytest.approx(now + 0.100 - h200_like(8))
    assert s.next_batch(0) == []
    clock.t = now + 0.100 - h200_like(8)
    assert len(s.next_batch(0)) == 8


# -- a simulated server ------------------------------------------------------------------------
def simulate(robots: int, sizes: Sequence[int], **kw: object) -> SimResult:
    return _simulate(robots, h200_like, sizes, **kw)  # type: ignore[arg-type]


def test_a_load_the_engine_carries_meets_every_deadline():
    # 48 robots at 2 requests/s: 96 chunks/s against ~120/s at the largest batches.
    res = simulate(48, DEFAULT_BATCH_SIZES)
    worst = max(lat for _, lat in res.answers)
    assert res.answered == res.sent > 1800 and res.refused == 0
    assert res.late == 0 and worst <= 0.5, f"{res.late} late, worst {worst * 1e3:.0f} ms"


def test_take_all_with_powers_of_two_fails_48_robots_and_the_rule_does_not():
    # The scheduler before the rule took every queued request: with sizes 1, 2, 4, ..., 64 at 48
    # robots its batches settle around 26-33 requests padded to 32 or 64, and a request waits
    # for the batch in flight and then its own (the H200 run: p50 535 ms, nearly all late).
    before = simulate(48, POWERS_OF_TWO, rule=TakeAllScheduler)
    assert before.late > before.sent // 2
    assert np.median([lat for _, lat in before.answers]) > 0.5
    after = simulate(48, POWERS_OF_TWO)
    assert after.late == 0


def test_after_a_stall_the_backlog_clears_without_new_misses():
    # A one-second stall (a capture at a shape first met while serving) makes the requests
    # caught in it late; those sent once the backlog has cleared are on time again. Taking
    # every queued request instead keeps batches large, and late, well after it.
    stall, clear = (5.0, 1.0), 8.0
    res = simulate(48, DEFAULT_BATCH_SIZES, stall=stall)
    assert res.late > 0
    assert all(lat <= 0.5 for arrival, lat in res.answers if arrival > clear)
    before = simulate(48, DEFAULT_BATCH_SIZES, stall=stall, rule=TakeAllScheduler)
    assert any(lat > 0.5 for arrival, lat in before.answers if arrival > clear)


def test_overload_answers_every_admitted_request_at_the_engines_throughput():
    # 80 robots want 160 chunks/s from an engine that runs ~120/s. Robots wait for their answer
    # (one request in flight each), so nothing is refused with a queue this large; every request
    # is answered, some late, and batches stay large enough to keep the engine's throughput.
    res = simulate(80, DEFAULT_BATCH_SIZES)
    take_all = simulate(80, DEFAULT_BATCH_SIZES, rule=TakeAllScheduler)
    assert res.answered == res.sent and res.refused == 0
    assert 0 < res.late < take_all.late
    assert res.rate() > 0.95 * take_all.rate()
    assert res.rate() > 0.95 * 64 / h200_like(64)


def test_overload_with_a_small_queue_refuses_at_once():
    res = simulate(80, DEFAULT_BATCH_SIZES, capacity=32)
    assert res.refused > 0 and res.answered + res.refused == res.sent


def test_engine_from_measured_points_and_the_planning_table(capsys):
    from phyai_edge.serve.simulate import engine_from_points, main

    engine = engine_from_points({1: 0.0214, 8: 0.0758, 32: 0.2676, 64: 0.5249})
    assert engine(8) == pytest.approx(0.0758) and engine(16) == pytest.approx(0.0758 + (0.2676 - 0.0758) / 3)
    assert engine(128) == pytest.approx(2 * 0.5249)
    assert main(["--robots", "32", "--sizes", "1,2,4,8,16,32,64;any", "--rules", "latency", "--seconds", "5"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| latency")]
    assert [r.split("|")[1].strip() for r in rows] == ["latency, 7 sizes", "latency, any"]
    assert all(r.split("|")[4].strip() == "0" for r in rows)  # 32 robots: nobody late
