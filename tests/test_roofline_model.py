"""The roofline model's arithmetic on cases worked out by hand."""

from __future__ import annotations

import math

import pytest

from phyai_edge.roofline.model import (
    RobotParams,
    StageTimes,
    analyze,
    binding_term,
    delay_ticks,
    max_control_rate,
    rtc_constraints,
)

MS = 1e-3


def hand_case(**kw: float) -> StageTimes:
    # L = pre 3 + vision 10 + prefix 20 + 10 x 2 denoise + post 1 + transport 6 = 60 ms; the
    # frame is 5 ms old when the observation is assembled (staleness only, not in L)
    base = dict(
        camera_age_s=5 * MS,
        preprocess_s=3 * MS,
        vision_s=10 * MS,
        prefix_s=20 * MS,
        denoise_step_s=2 * MS,
        steps=10,
        postprocess_s=1 * MS,
        transport_s=6 * MS,
    )
    base.update(kw)
    return StageTimes(**base)


def test_stage_time_groups_add_up() -> None:
    t = hand_case()
    assert t.denoise_total_s == pytest.approx(20 * MS)
    assert t.inference_s == pytest.approx(50 * MS)
    assert t.group_s("processing") == pytest.approx(4 * MS)
    assert t.group_s("transport") == pytest.approx(6 * MS)
    assert t.latency_s == pytest.approx(60 * MS)
    assert t.to_ms_dict()["latency_ms"] == pytest.approx(60.0)
    assert t.to_ms_dict()["camera_age_ms"] == pytest.approx(5.0)


@pytest.mark.parametrize(
    ("latency_ms", "period_ms", "ticks"),
    [
        (60, 20, 3),
        (60.5, 20, 4),
        (59.9, 20, 3),
        (20, 20, 1),
        (0.1, 20, 1),
        (0, 20, 0),
        (70, 10, 7),
        (140, 20, 7),
    ],
)
def test_delay_ticks_is_ceil_without_float_noise(latency_ms: float, period_ms: float, ticks: int) -> None:
    # 0.07 / 0.01 and 0.14 / 0.02 are 7.000000000000001 in binary floats: still 7 ticks.
    assert delay_ticks(latency_ms * MS, period_ms * MS) == ticks


def test_rtc_constraint_halves() -> None:
    assert rtc_constraints(d=3, s=5, horizon=10) == (True, True)
    assert rtc_constraints(d=6, s=5, horizon=10) == (False, False)  # 5 > 10 - 6 too
    assert rtc_constraints(d=3, s=8, horizon=10) == (True, False)  # 8 > 10 - 3
    assert rtc_constraints(d=5, s=5, horizon=10) == (True, True)  # both bounds inclusive


def test_hand_case_physical_bound() -> None:
    robot = RobotParams.from_rates(50, horizon=10)  # T = 20 ms, s free -> s_cap = 5
    r = analyze(hand_case(), robot)
    assert r.delay_ticks == 3
    assert r.s_window == (3, 7)
    assert r.rtc_ok and r.feasible
    assert r.exec_horizon == 3  # free s: replan as soon as RTC allows
    assert r.achievable_rate_hz == pytest.approx(50.0)  # min(50, 5 / 0.060 = 83.3)
    assert r.binding == "physical"
    assert r.ridge_latency_s == pytest.approx(100 * MS)  # 5 ticks x 20 ms
    assert r.latency_headroom_s == pytest.approx(40 * MS)  # 100 - 60
    assert r.rate_margin == pytest.approx(0.0)
    assert r.chunk_rate_hz == pytest.approx(50 / 3)
    assert r.max_chunk_rate_hz == pytest.approx(50 / 3)
    assert r.sync_rate_hz == pytest.approx(10 / (10 * 0.02 + 0.06))  # 38.46 Hz
    assert r.gpu_duty == pytest.approx(50 / 60)  # 50 ms of inference every 3 x 20 ms
    assert r.shares["inference"] == pytest.approx(50 / 60)
    assert sum(r.shares.values()) == pytest.approx(1.0)
    assert r.observation_age_s == pytest.approx(65 * MS)  # 5 ms camera age + d = 3 ticks x 20 ms


def test_hand_case_inference_bound_when_horizon_too_short() -> None:
    robot = RobotParams.from_rates(50, horizon=4)  # s_cap = 2 ticks = 40 ms < 60 ms
    r = analyze(hand_case(), robot)
    assert r.delay_ticks == 3
    assert r.s_window == (3, 1)  # empty window
    assert not r.rtc_ok and not r.feasible
    assert r.achievable_rate_hz == pytest.approx(2 / 0.060)  # 33.3 Hz
    assert r.binding == "inference"  # 50 of the 60 ms
    assert r.latency_headroom_s == pytest.approx(-20 * MS)
    assert r.rate_margin == pytest.approx((2 / 0.060) / 50 - 1)


def test_fixed_exec_horizon_both_sides() -> None:
    # s = 2 < d = 3: the next inference starts as this one lands, so the real chunk period is d
    # ticks; the chunk lasts (3 + 3 <= 10) and the rate stays 50 Hz: the daemon never waits.
    r = analyze(hand_case(), RobotParams.from_rates(50, horizon=10, exec_horizon=2))
    assert (r.d_le_s, r.s_le_h_minus_d, r.rtc_ok) == (False, True, True)
    assert r.achievable_rate_hz == pytest.approx(50)  # s_cap = min(10 - 2, 5) = 5: 83 Hz, the loop's 50 binds
    assert r.chunk_rate_hz == pytest.approx(50 / 3) and r.binding == "physical"
    # s = 2 with d = 6 (L = 120 ms), H = 10: 6 + 6 > 10, the chunk runs out before the next lands.
    slow = hand_case(prefix_s=80 * MS)
    r = analyze(slow, RobotParams.from_rates(50, horizon=10, exec_horizon=2))
    assert r.delay_ticks == 6 and not r.rtc_ok and not r.s_le_h_minus_d
    assert r.achievable_rate_hz == pytest.approx(5 / slow.latency_s)
    # s = 8 > H - d = 7: the old chunk runs out before the new one lands.
    r = analyze(hand_case(), RobotParams.from_rates(50, horizon=10, exec_horizon=8))
    assert (r.d_le_s, r.s_le_h_minus_d, r.rtc_ok) == (True, False, False)
    assert r.achievable_rate_hz == pytest.approx(2 / 0.060)  # s_cap = min(8, 2)
    # s = 5 is inside [3, 7].
    r = analyze(hand_case(), RobotParams.from_rates(50, horizon=10, exec_horizon=5))
    assert r.rtc_ok and r.chunk_rate_hz == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("kw", "term"),
    [
        (dict(preprocess_s=80 * MS), "processing"),
        (dict(transport_s=90 * MS), "transport"),
        (dict(prefix_s=200 * MS), "inference"),
    ],
)
def test_binding_term_is_largest_group_when_latency_bound(kw: dict[str, float], term: str) -> None:
    robot = RobotParams.from_rates(50, horizon=10)  # ridge at 100 ms; all cases exceed it
    stages = hand_case(**kw)
    assert stages.latency_s > 0.1
    assert binding_term(stages, robot) == term


def test_camera_age_is_staleness_not_delay() -> None:
    """The daemon counts d from the tick the inference starts (the observation assembled, the new
    chunk's row 0 aligned to it) to the tick its chunk is adopted: the frame's age at that start
    makes the image older but shifts no row, so it leaves d, f_max, the headroom and the binding
    term alone and shows up only as the observation's age when the new chunk's first action runs."""
    robot = RobotParams.from_rates(50, horizon=10)  # T = 20 ms, ridge 100 ms
    fresh = analyze(hand_case(camera_age_s=0.0), robot)
    for age_ms in (5.0, 33.0, 500.0):  # 500 ms would put camera age + L far beyond the ridge
        r = analyze(hand_case(camera_age_s=age_ms * MS), robot)
        assert r.latency_s == pytest.approx(60 * MS) and r.delay_ticks == fresh.delay_ticks == 3
        assert (r.s_window, r.rtc_ok, r.feasible) == (fresh.s_window, True, True)
        assert r.achievable_rate_hz == pytest.approx(fresh.achievable_rate_hz)
        assert r.latency_headroom_s == pytest.approx(fresh.latency_headroom_s)
        assert r.sync_rate_hz == pytest.approx(fresh.sync_rate_hz)
        assert r.binding == "physical"
        assert r.observation_age_s == pytest.approx((age_ms + 3 * 20) * MS)
    # Past the ridge the largest group binds, never the camera: here inference, not "transport".
    slow = hand_case(camera_age_s=900 * MS, prefix_s=200 * MS, transport_s=1 * MS)
    assert binding_term(slow, robot) == "inference"
    assert slow.group_s("transport") == pytest.approx(1 * MS)


def test_sync_rate_executes_the_fixed_exec_horizon() -> None:
    """Without RTC a runner with a fixed s executes s actions, stops and waits L for the next chunk:
    s / (s * T + L). With s free nothing makes it replan early, so it runs the whole chunk:
    H / (H * T + L)."""
    stages = hand_case()  # L = 60 ms
    free = analyze(stages, RobotParams.from_rates(50, horizon=10))
    assert free.sync_rate_hz == pytest.approx(10 / (10 * 0.02 + 0.06))  # 38.5 Hz
    for s in (2, 5, 10):
        r = analyze(stages, RobotParams.from_rates(50, horizon=10, exec_horizon=s))
        assert r.sync_rate_hz == pytest.approx(s / (s * 0.02 + 0.06))  # s = 5: 31.25 Hz


def test_physical_rate_below_requested_rate() -> None:
    # Asking for 50 Hz on a task whose loop can only step at 20 Hz: infeasible, physical binds.
    robot = RobotParams.from_rates(50, horizon=10, physical_rate_hz=20)
    r = analyze(hand_case(), robot)
    assert r.rtc_ok and not r.feasible
    assert r.achievable_rate_hz == pytest.approx(20.0)
    assert r.binding == "physical"
    assert r.ridge_latency_s == pytest.approx(5 * 0.05)


def test_max_rate_is_the_feasibility_boundary() -> None:
    # f_max must sit exactly where analyze() flips from feasible to infeasible: that is the
    # claim ceil(L/T) <= s_cap <=> L <= s_cap * T that the closed form rests on.
    for latency_ms in (7.0, 33.0, 60.0, 123.4, 480.0, 999.0):
        for horizon, s in ((50, None), (50, 10), (50, 40), (16, None), (9, 3)):
            stages = StageTimes(vision_s=latency_ms * MS, steps=1)
            probe = RobotParams(1.0, horizon, s, physical_period_s=1e-4)  # physical loop far away
            f_max = max_control_rate(stages.latency_s, probe)
            below = RobotParams(1 / (f_max * 0.999), horizon, s, physical_period_s=1e-4)
            above = RobotParams(1 / (f_max * 1.001), horizon, s, physical_period_s=1e-4)
            assert analyze(stages, below).rtc_ok, (latency_ms, horizon, s)
            assert not analyze(stages, above).rtc_ok, (latency_ms, horizon, s)


def test_zero_latency_and_degenerate_horizon() -> None:
    r = analyze(StageTimes(), RobotParams.from_rates(50, horizon=10))
    assert r.delay_ticks == 0 and r.binding == "physical" and r.achievable_rate_hz == pytest.approx(50)
    # H = 1: no delay can be absorbed; any latency makes the loop infeasible.
    r = analyze(hand_case(), RobotParams.from_rates(50, horizon=1))
    assert not r.rtc_ok and r.achievable_rate_hz == 0.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: RobotParams.from_rates(50, horizon=10, exec_horizon=11),
        lambda: RobotParams.from_rates(50, horizon=10, exec_horizon=0),
        lambda: RobotParams.from_rates(0, horizon=10),
        lambda: RobotParams.from_rates(50, horizon=0),
        lambda: StageTimes(prefix_s=-1e-3),
        lambda: StageTimes(vision_s=math.nan),
    ],
)
def test_bad_parameters_raise(make: object) -> None:
    with pytest.raises(ValueError):
        make()  # type: ignore[operator]
