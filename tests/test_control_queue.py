"""Chunk queue (daemon-side RTC), clock and safety guard, without a daemon around them."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from phyai_edge.control.clock import PeriodicClock
from phyai_edge.control.config import Limits
from phyai_edge.control.protocol import Flag
from phyai_edge.control.rtc import ChunkQueue, DelayEstimator
from phyai_edge.control.safety import ActionGuard


def chunk(h: int, value: float, dim: int = 2) -> np.ndarray:
    return np.full((h, dim), value, np.float32) + np.arange(h, dtype=np.float32)[:, None] / 100


def test_takeover_at_measured_delay_and_prefix_alignment():
    q = ChunkQueue("inpaint", 20, 5, 4, DelayEstimator(initial=2))
    assert q.wants_inference() and q.plan(100).prefix is None
    assert q.adopt(chunk(20, 0.0), 1, start_slot=100, now_slot=103, obs_time_s=1.0) == 3
    assert q.delays.estimate() == 3
    a, c = q.next_action()
    assert c.index == 4 and a[0] == np.float32(0.03)
    q.next_action()  # index 5 is next: s = 5 actions of this chunk have "run" (0..4)
    assert q.wants_inference()
    plan = q.plan(105)
    # prefix[i] is what runs at index i of the new chunk = executing index 5 + i
    np.testing.assert_allclose(plan.prefix[:, 0], chunk(20, 0.0)[5:, 0])
    assert plan.delay == 3


def test_missed_slots_skip_actions_and_late_chunks_are_dropped():
    q = ChunkQueue("none", 10, 4, 4, DelayEstimator(initial=1))
    q.adopt(chunk(10, 0.0), 1, 0, 1, 0.0)
    q.skip(3)
    _a, c = q.next_action()
    assert c.index == 5  # took index 4: slot 1 + 3 skipped
    assert q.adopt(chunk(10, 1.0), 2, 0, 10, 0.0) is None  # delay 10 >= H: nothing left to run
    assert q.current.chunk_id == 1


def test_a_chunk_that_arrives_too_late_to_run_is_not_a_delay_the_next_prefixes_plan_for():
    """A stall (a worker restart, a frozen process) delivered a chunk after H slots. Its delay went
    into the estimator's window, whose maximum then froze the whole prefix of the next ten
    requests: the robot followed each old chunk to its end before the new one's fresh actions."""
    q = ChunkQueue("inpaint", 20, 5, 4, DelayEstimator(initial=2, window=10))
    assert q.adopt(chunk(20, 0.0), 1, start_slot=0, now_slot=3, obs_time_s=0.0) == 3
    assert q.adopt(chunk(20, 1.0), 2, start_slot=10, now_slot=90, obs_time_s=0.0) is None  # 80 slots: stale
    assert q.last_delay == 80  # still said (the daemon logs and counts it)
    assert q.adopt(chunk(20, 2.0), 3, start_slot=100, now_slot=104, obs_time_s=0.0) == 4
    for _ in range(5):
        q.next_action()
    plan = q.plan(109)
    assert plan.delay == 4 and plan.prefix.shape[0] == 11  # the measured delays, not the stall


def test_crossfade_blends_from_old_to_new():
    q = ChunkQueue("crossfade", 20, 5, 4, DelayEstimator(initial=2))
    q.adopt(np.zeros((20, 2), np.float32), 1, 0, 0, 0.0)
    for _ in range(6):
        q.next_action()
    q.adopt(np.ones((20, 2), np.float32), 2, 5, 7, 0.0)
    got = [q.next_action()[0][0] for _ in range(6)]
    np.testing.assert_allclose(got, [0.2, 0.4, 0.6, 0.8, 1.0, 1.0], rtol=1e-6)


def test_delay_estimator_takes_recent_maximum():
    d = DelayEstimator(initial=3, window=3)
    assert d.estimate() == 3
    for x in (2, 5, 1, 1):
        d.record(x)
    assert d.estimate() == 5
    d.record(1)
    assert d.estimate() == 1
    assert DelayEstimator(fixed=4).estimate() == 4


def test_guard_clamps_rate_limits_and_never_passes_nan():
    g = ActionGuard(2, Limits(action_min=-1.0, action_max=(1.0, 0.5), max_rate=10.0), period_s=0.02, hold_mode="last")
    out, flags = g.finalize(np.array([0.1, 2.0], np.float32))
    assert flags == Flag.CLAMPED and out.tolist() == [np.float32(0.1), 0.5] and g.last_clamps == ("position",)
    out, flags = g.finalize(np.array([0.9, 0.5], np.float32))  # 0.8 in one 20 ms tick > 10/s
    assert flags == Flag.CLAMPED and np.allclose(out, [0.3, 0.5]) and g.last_clamps == ("rate",)
    out, flags = g.finalize(np.array([0.4, 0.5], np.float32))
    assert flags == 0 and g.last_clamps == ()
    out, flags = g.finalize(np.array([np.nan, 0.0], np.float32))
    assert flags & Flag.NONFINITE and flags & Flag.HOLD and np.isfinite(out).all() and np.allclose(out, [0.4, 0.5])
    _, flags = g.finalize(np.array([-3.0, 0.5], np.float32))  # below action_min, then too fast from 0.4
    assert flags == Flag.CLAMPED and g.last_clamps == ("position", "rate")
    assert (g.counters.clamped_limit, g.counters.clamped_rate, g.counters.nonfinite) == (2, 2, 1)
    assert np.allclose(ActionGuard(2, Limits(), 0.02, "zero").hold_target(np.ones(2)), 0)
    assert np.allclose(ActionGuard(2, Limits(), 0.02, "state").hold_target(np.ones(2)), 1)


def test_clock_keeps_absolute_deadlines_and_counts_overruns():
    c = PeriodicClock(0.005, spin_s=0.0005)
    c.start()
    t = c.wait()
    assert t.slot == 0 and t.lateness_ns >= 0
    time.sleep(0.0125)  # overrun: slots 1 and 2 pass
    t = c.wait()
    assert t.slots_advanced >= 2 and c.missed >= 1
    assert t.deadline_ns == c.start_ns + t.slot * c.period_ns
    t2 = c.wait()
    assert t2.slot == t.slot + 1 and t2.slots_advanced == 1


def test_sd_notify_datagrams(tmp_path):
    import socket

    from phyai_edge.control.notify import Notifier

    path = str(tmp_path / "n.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(path)
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
    assert n.enabled and n.watchdog_interval_s == 0.5  # a quarter of WatchdogSec: one late tick is survived
    assert n.ready("up") and n.watchdog() and n.status("ok")
    msgs = [srv.recv(100).decode() for _ in range(3)]
    assert msgs == ["READY=1\nSTATUS=up", "WATCHDOG=1", "STATUS=ok"]
    assert not Notifier({}).enabled and not Notifier({}).ready()
    assert Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "5", "WATCHDOG_PID": "1"}).watchdog_interval_s == 0.0
    srv.close()


def test_guard_preview_is_what_finalize_will_publish():
    """RTC's prefix goes through `preview`: the rows the robot will really be commanded, position
    clip then rate limit from the last published action, and the guard itself untouched."""
    g = ActionGuard(2, Limits(action_min=-1.0, action_max=(1.0, 0.5), max_rate=10.0), period_s=0.02, hold_mode="last")
    g.finalize(np.array([0.0, 0.0], np.float32))
    rows = np.array([[0.5, 2.0], [0.9, 0.4], [np.nan, 0.0], [-3.0, -0.1]], np.float32)
    last, counters = g.last.copy(), dataclasses.replace(g.counters)
    seen = g.preview(rows)
    assert np.array_equal(g.last, last) and g.counters == counters
    published = [g.finalize(r)[0] for r in rows[[0, 1, 3]]]  # the NaN row would be a HOLD
    g2 = ActionGuard(2, Limits(action_min=-1.0, action_max=(1.0, 0.5), max_rate=10.0), period_s=0.02, hold_mode="last")
    g2.finalize(np.array([0.0, 0.0], np.float32))
    clean = g2.preview(rows[[0, 1, 3]])
    assert np.allclose(clean, published)
    assert np.isnan(seen[2, 0]) and np.allclose(seen[:2], clean[:2])
    slow = np.array([[0.05, 0.05], [0.1, 0.1]], np.float32)  # within the rate limit from the last action
    g3 = ActionGuard(2, Limits(action_min=-1.0, action_max=(1.0, 0.5), max_rate=10.0), period_s=0.02, hold_mode="last")
    g3.finalize(np.array([0.0, 0.0], np.float32))
    assert np.array_equal(g3.preview(slow), slow) and np.array_equal(g3.finalize(slow[0])[0], slow[0])
    unlimited = ActionGuard(2, Limits(), 0.02, "last")
    assert np.array_equal(unlimited.preview(rows), rows, equal_nan=True)  # no limits: the same values


def test_guard_preview_matches_finalize_to_the_bit_where_the_rate_bound_rounds():
    """preview's shortcut tested |a - last| <= max_step, finalize clips to last + max_step rounded
    to float32: for a = 0.0040714447 after last = -0.08498785 with a step of 0.08905929 the first
    passes and the second moves a by one ulp, so RTC's prefix was not what the robot got. Random
    actions at the bound and one ulp either side must come out of both the same, bit for bit."""
    def both(last: float, step: float, a: float) -> tuple[np.ndarray, np.ndarray]:
        g = ActionGuard(1, Limits(max_rate=1.0), 0.02, "last")
        g.max_step = np.array([step], np.float32)
        g.last = np.array([last], np.float32)
        seen = g.preview(np.array([[a]], np.float32))[0]
        return seen, g.finalize(np.array([a], np.float32))[0]

    seen, published = both(-0.08498785, 0.08905929, 0.0040714447)
    assert seen.tobytes() == published.tobytes()
    rng = np.random.default_rng(7)
    lasts, steps = rng.uniform(-1, 1, 2000).astype(np.float32), rng.uniform(0.001, 0.2, 2000).astype(np.float32)
    for last, step, side in zip(lasts, steps, rng.choice([-1, 1], 2000)):
        a = np.float32(last + side * step)  # at the bound, give or take the rounding
        for b in (np.nextafter(a, np.float32(-2)), a, np.nextafter(a, np.float32(2))):
            seen, published = both(float(last), float(step), float(b))
            assert seen.tobytes() == published.tobytes(), (last, step, b)
