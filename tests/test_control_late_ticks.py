"""Late ticks: counted, and described in the log with when and around what, at most one line per interval."""

from __future__ import annotations

import time

from phyai_edge.control.clock import LateTicks, Tick
from phyai_edge.control.config import parse_config
from phyai_edge.control.daemon import Daemon
from phyai_edge.control.fakes import FakePolicy, run_ticks, test_config

MS = 1_000_000


def _tick(slot: int, woke_late_ms: float, period_ms: float = 20.0) -> Tick:
    deadline = round(slot * period_ms * MS)
    return Tick(slot=slot, deadline_ns=deadline, wake_ns=deadline + round(woke_late_ms * MS), slots_advanced=1)


def test_a_late_tick_says_whether_it_woke_late_or_worked_late_and_lines_are_rate_limited():
    late = LateTicks(limit_ns=5 * MS, interval_ns=1000 * MS)
    t = _tick(10, woke_late_ms=0.5)
    line = late.note(t, t.wake_ns + 7 * MS, "started an inference")
    assert line is not None
    assert "tick 10 published 7.50 ms after its deadline (limit 5 ms)" in line
    assert "woke 0.50 ms late, then 7.00 ms in the tick (started an inference)" in line
    # Within the interval: counted, not logged.
    for slot in (11, 12):
        t = _tick(slot, woke_late_ms=9.0)
        assert late.note(t, t.wake_ns, "") is None
    # After it: logged again, with the ticks not described since.
    t = _tick(70, woke_late_ms=6.0)
    line = late.note(t, t.wake_ns + MS, "")
    assert line is not None and "tick 70" in line and "2 more since the last such line" in line
    assert "(an action from the executing chunk)" in line
    assert late.summary() == {"limit_ms": 5.0, "count": 4, "worst_ms": 9.0, "worst_tick": 11}


def test_the_limit_defaults_to_a_quarter_of_the_period():
    base = {"cameras": {"top": {"source": "synthetic"}}}
    assert parse_config({**base, "robot": {"control_hz": 50}}).clock.late_limit_s(0.02) == 0.005
    cfg = parse_config({**base, "clock": {"late_warning_ms": 2.5}})
    assert cfg.clock.late_limit_s(cfg.robot.period_s) == 0.0025


class _SlowState:
    """The daemon's state source, with one `latest()` call (on the clock thread) made slow."""

    def __init__(self, inner, slow_call: int, sleep_s: float) -> None:
        self.inner, self.slow_call, self.sleep_s, self.calls = inner, slow_call, sleep_s, 0

    def latest(self):
        self.calls += 1
        if self.calls == self.slow_call:
            time.sleep(self.sleep_s)
        return self.inner.latest()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_the_daemon_logs_the_tick_its_own_work_made_late(caplog):
    cfg = test_config(clock={"late_warning_ms": 8.0})
    daemon = Daemon(cfg, policy=FakePolicy(latency_s=0.005), realtime=False)
    daemon.late_ticks.interval_ns = 0  # every late tick described, so a noisy one cannot hide it
    original_setup = daemon.setup

    def setup() -> None:
        original_setup()
        daemon.state = _SlowState(daemon.state, slow_call=40, sleep_s=0.015)

    daemon.setup = setup  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="phyai_edge.control"):
        run_ticks(daemon, 80)
    lines = [r.getMessage() for r in caplog.records if "after its deadline" in r.getMessage()]

    def in_tick_ms(line: str) -> float:
        return float(line.split("then ")[1].split(" ms in the tick")[0])

    # The slow read is the 40th tick's (slot 39 unless a loaded machine made the clock skip slots
    # before it): the one tick that spent >= 15 ms in its own work, whatever woke late around it.
    ours = [ln for ln in lines if in_tick_ms(ln) >= 15.0]
    assert len(ours) == 1, lines
    assert daemon.state.calls >= 40 and int(ours[0].split()[1]) >= 39, ours[0]
    summary = daemon.summary()["late_ticks"]
    assert summary["count"] >= 1 and summary["limit_ms"] == 8.0
    assert summary["worst_ms"] >= 15.0


def test_a_stall_of_whole_periods_is_late_from_the_first_missed_deadline():
    """After a 0.5 s stall at 50 Hz the clock skips 25 slots and re-bases the tick on the newest
    slot's deadline, so its own lateness was what was left past a whole period: under the limit,
    never counted as late, never logged. The stall counts from the first missed slot."""
    late = LateTicks(limit_ns=5 * MS, interval_ns=0)
    t = Tick(slot=125, deadline_ns=125 * 20 * MS, wake_ns=125 * 20 * MS + MS, slots_advanced=26)
    line = late.note(t, t.wake_ns + MS, "25 slot(s) missed before it", missed_ns=25 * 20 * MS)
    assert line is not None and "tick 125 published 502.00 ms after its deadline" in line
    assert "woke 501.00 ms late" in line and late.summary()["count"] == 1


def test_the_daemon_logs_a_stall_that_missed_slots(caplog):
    """A stall of several periods (the process stopped, a long GC) is a late tick in the log and the
    metrics, with the slots it missed; before, only the end-of-run summary's missed slots said so."""
    cfg = test_config(clock={"late_warning_ms": 8.0})
    daemon = Daemon(cfg, policy=FakePolicy(latency_s=0.005), realtime=False)
    daemon.late_ticks.interval_ns = 0
    original_setup = daemon.setup

    def setup() -> None:
        original_setup()
        daemon.state = _SlowState(daemon.state, slow_call=30, sleep_s=0.105)  # 5 periods and a bit

    daemon.setup = setup  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="phyai_edge.control"):
        run_ticks(daemon, 60)
    lines = [r.getMessage() for r in caplog.records if "slot(s) missed before it" in r.getMessage()]
    assert lines and daemon.stats.missed_slots >= 4, (lines, daemon.stats.missed_slots)
    assert any(float(ln.split("published ")[1].split(" ms")[0]) >= 80.0 for ln in lines), lines
