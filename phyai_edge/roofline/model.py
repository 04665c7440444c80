"""The Control-Time Roofline: what bounds a chunked policy's control rate under async RTC.

Notation (times in seconds, horizons in control ticks)
------------------------------------------------------
T       control period (1 / control rate f)
T_phys  the task's physical minimum period: the fastest the robot / environment loop can step
H       prediction horizon: actions per chunk
s       execution horizon: ticks between the starts of two consecutive inferences
N       flow-matching steps

The latency RTC sees is the one the daemon counts: from the tick an inference starts (the
observation is assembled, the state sampled, and the new chunk's row 0 is aligned to that tick)
to the tick its chunk is adopted:

    L = preprocess + vision + prefix + N * denoise_step + postprocess + transport

(transport: the observation and the chunk crossing the worker pipe, which the daemon's clock
runs through). The inference delay in ticks is d = ceil(L / T): the number of actions of the old
chunk that run while the new one is computed (the new chunk takes over at its index d).

The camera frame's age at the start tick is not in L. It makes the image older, but it does not
shift which rows of the chunk execute, so it does not enter d and cannot bound the control rate.
It is reported as staleness: the observation is camera_age + d * T old when the new chunk's
first action (its row d, on the adoption tick) runs.

Real-Time Chunking (Black et al., 2025) schedules d <= s <= H - d:
  * d <= s      a new inference starts every s ticks and only one is in flight, so it is done
                before the next one starts. Where d > s the next one starts as this one lands:
                the effective s is d (the daemon replans back to back; the clock never waits);
  * s <= H - d  the executing chunk was planned at tick k and covers k .. k+H-1; the next chunk
                starts at k+max(s, d) and arrives d ticks later, so the old chunk must last that
                long: max(s, d) + d <= H, or it runs out (the robot holds, STARVED).

A window of valid s exists iff 2d <= H. Write s_cap for the largest delay the schedule can
absorb: s_cap = min(H - s, floor(H / 2)) for a fixed s (d <= H - s while d <= s, 2d <= H after),
and s_cap = floor(H / 2) when s is free to choose.
Because d is an integer, ceil(L / T) <= s_cap  <=>  L <= s_cap * T, so the rate is feasible iff

    T >= T_phys   and   T >= L / s_cap,

which gives the roofline:

    T_min = max(T_phys, L / s_cap)         f_max = min(f_phys, s_cap / L)

In a log-log plot of f_max against L this is a flat roof (the physical loop) meeting a line of
slope -1 (the latency-bound side) at the ridge L* = s_cap * T_phys. While L <= L* inference
does not bound the control rate at all; it only sets how stale each chunk is (d ticks) and how
often the policy can replan (at most f / d chunks per second).

Which term binds: "physical" when T_phys >= L / s_cap; otherwise the largest latency group:
"inference" (vision + prefix + denoise), "processing" (preprocess + postprocess) or
"transport" (the worker pipe's and the publish's time: data moving rather than being computed).

Margins at the requested rate: latency headroom s_cap * T - L (how much slower the pipeline may
get before the rate is infeasible) and rate margin f_max / f - 1.

For comparison, without RTC (synchronous chunks) the robot executes a stretch of the chunk, stops,
and waits L for the next one: s actions per stretch when s is fixed, all H when it is free, so
the average rate is s / (s * T + L) (resp. H / (H * T + L)).

Assumptions
-----------
* H and s are counts of ticks and stay fixed when T changes (the chunk spans H * T seconds). A
  policy trained at 50 Hz should still run at 50 Hz: f_max above f means headroom, not a
  licence to run faster.
* One inference in flight at a time; the control clock never waits for inference.
* Latencies are taken as constants (use a high percentile, e.g. p90, for the RTC delay).
* GPU time is not shared with other robots; for batched serving give the batched stage times.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

# Latency groups that make up L and can bind the control rate (besides the physical loop).
# Camera age is in none of them: the daemon's d starts at the tick the observation is assembled,
# however old its frame already is, so that age only adds staleness.
GROUPS: dict[str, tuple[str, ...]] = {
    "inference": ("vision_s", "prefix_s", "denoise_total_s"),
    "processing": ("preprocess_s", "postprocess_s"),
    "transport": ("transport_s",),
}
BINDING_TERMS = ("physical", "inference", "processing", "transport")

# ceil(L / T) must not turn 60 ms / 20 ms = 3.0000000000000004 into 4 ticks.
_TICK_EPS = 1e-9


@dataclass(frozen=True)
class StageTimes:
    """Per-stage times of one control cycle, in seconds. `denoise_step_s` is one flow step;
    `camera_age_s` is the frame's age when the daemon assembles the observation (staleness only,
    not part of L)."""

    camera_age_s: float = 0.0
    preprocess_s: float = 0.0
    vision_s: float = 0.0
    prefix_s: float = 0.0
    denoise_step_s: float = 0.0
    steps: int = 10
    postprocess_s: float = 0.0
    transport_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is None or (isinstance(value, float) and math.isnan(value)) or value < 0:
                raise ValueError(f"StageTimes.{name} must be a non-negative number, got {value!r}")

    @property
    def denoise_total_s(self) -> float:
        return self.steps * self.denoise_step_s

    @property
    def inference_s(self) -> float:
        return self.group_s("inference")

    @property
    def latency_s(self) -> float:
        """L: from the tick the inference starts to the tick its chunk is adopted (what d counts)."""
        return sum(self.group_s(g) for g in GROUPS)

    def group_s(self, group: str) -> float:
        return sum(getattr(self, attr) for attr in GROUPS[group])

    def to_ms_dict(self) -> dict[str, float]:
        d = {k[:-2] + "_ms": v * 1e3 for k, v in asdict(self).items() if k.endswith("_s")}
        d["steps"] = self.steps
        d["denoise_total_ms"] = self.denoise_total_s * 1e3
        d["latency_ms"] = self.latency_s * 1e3
        return d


@dataclass(frozen=True)
class RobotParams:
    """The robot side: requested control period, horizons and the physical loop's limit."""

    control_period_s: float
    horizon: int
    exec_horizon: int | None = None  # None: free to choose within the RTC window
    physical_period_s: float | None = None  # None: the requested period is the physical limit

    def __post_init__(self) -> None:
        if not self.control_period_s > 0:
            raise ValueError(f"control_period_s must be > 0, got {self.control_period_s!r}")
        if self.horizon < 1:
            raise ValueError(f"horizon (H) must be >= 1 tick, got {self.horizon!r}")
        if self.exec_horizon is not None and not 1 <= self.exec_horizon <= self.horizon:
            raise ValueError(f"exec_horizon (s) must be in [1, H={self.horizon}], got {self.exec_horizon!r}")
        if self.physical_period_s is not None and not self.physical_period_s > 0:
            raise ValueError(f"physical_period_s must be > 0, got {self.physical_period_s!r}")

    @classmethod
    def from_rates(
        cls,
        rate_hz: float,
        horizon: int,
        exec_horizon: int | None = None,
        physical_rate_hz: float | None = None,
    ) -> RobotParams:
        if not rate_hz > 0:
            raise ValueError(f"control rate must be > 0 Hz, got {rate_hz!r}")
        if physical_rate_hz is not None and not physical_rate_hz > 0:
            raise ValueError(f"physical rate must be > 0 Hz, got {physical_rate_hz!r}")
        return cls(
            control_period_s=1.0 / rate_hz,
            horizon=horizon,
            exec_horizon=exec_horizon,
            physical_period_s=None if physical_rate_hz is None else 1.0 / physical_rate_hz,
        )

    @property
    def t_phys(self) -> float:
        return self.control_period_s if self.physical_period_s is None else self.physical_period_s

    @property
    def s_cap(self) -> int:
        """Largest delay d (ticks) the schedule absorbs: min(H - s, floor(H/2)) for a fixed s (a d
        above s only replans every d ticks instead of s), floor(H/2) if s is free."""
        if self.exec_horizon is None:
            return self.horizon // 2
        return min(self.horizon - self.exec_horizon, self.horizon // 2)


@dataclass(frozen=True)
class RooflineResult:
    latency_s: float  # L, camera age excluded: what the daemon's d counts
    delay_ticks: int  # d
    exec_horizon: int  # s used: the fixed s, or d (replan as soon as RTC allows) when s is free
    s_window: tuple[int, int]  # valid s: [d, H - d]; empty when lo > hi
    d_le_s: bool  # RTC's schedule as configured; where False the effective s is d
    s_le_h_minus_d: bool  # max(s, d) <= H - d: the executing chunk lasts until the next one lands
    rtc_ok: bool  # the run never starves: s_le_h_minus_d (with s free, the window [d, H - d] exists)
    rate_hz: float  # requested control rate
    physical_rate_hz: float
    achievable_rate_hz: float  # f_max
    feasible: bool  # requested rate reachable (RTC holds and not above the physical loop)
    chunk_rate_hz: float  # inferences per second at the requested rate with s used
    max_chunk_rate_hz: float  # f / d: the fastest replanning RTC allows at this rate
    sync_rate_hz: float  # without RTC: execute s actions (H with s free), stop, wait L
    observation_age_s: float  # camera age + d * T: the observation's age when the new chunk's first action runs
    binding: str
    ridge_latency_s: float  # L* = s_cap * T_phys
    latency_headroom_s: float  # s_cap * T - L
    rate_margin: float  # f_max / f - 1
    gpu_duty: float  # inference_s / (s used * T): share of time the accelerator is busy
    shares: dict[str, float] = field(default_factory=dict)  # latency share per group

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["s_window"] = list(self.s_window)
        return d


def delay_ticks(latency_s: float, period_s: float) -> int:
    """d = ceil(L / T), tolerant of floating-point noise at exact multiples."""
    if latency_s < 0 or period_s <= 0:
        raise ValueError(f"need latency >= 0 and period > 0, got L={latency_s!r}, T={period_s!r}")
    return max(0, math.ceil(latency_s / period_s - _TICK_EPS))


def rtc_constraints(d: int, s: int, horizon: int) -> tuple[bool, bool]:
    """(d <= s, max(s, d) <= H - d): RTC's schedule as configured, and whether the executing chunk
    lasts until the next lands (where d > s the next inference starts as this one lands)."""
    return d <= s, max(s, d) <= horizon - d


def max_control_rate(latency_s: float, robot: RobotParams) -> float:
    """f_max = min(f_phys, s_cap / L): the highest rate whose delay fits the RTC window."""
    f_phys = 1.0 / robot.t_phys
    if latency_s <= 0:
        return f_phys
    return min(f_phys, robot.s_cap / latency_s)


def binding_term(stages: StageTimes, robot: RobotParams) -> str:
    latency = stages.latency_s
    if latency <= 0 or robot.t_phys * robot.s_cap >= latency:
        return "physical"
    # Ties resolve in GROUPS order (inference first): the most expensive term to fix comes first.
    return max(GROUPS, key=lambda g: stages.group_s(g))


def analyze(stages: StageTimes, robot: RobotParams) -> RooflineResult:
    """Evaluate the roofline for one set of stage times at the requested robot parameters."""
    T = robot.control_period_s
    H = robot.horizon
    L = stages.latency_s
    d = delay_ticks(L, T)
    s_used = robot.exec_horizon if robot.exec_horizon is not None else max(d, 1)
    d_le_s, s_le = rtc_constraints(d, s_used, H)
    if robot.exec_horizon is None:
        # s is ours to choose: the constraint holds iff the window [d, H - d] is non-empty.
        d_le_s, s_le = True, 2 * d <= H and s_used <= H - d
    rtc_ok = s_le  # d > s slips the next start to this one's landing; only running out is a failure
    rate = 1.0 / T
    f_phys = 1.0 / robot.t_phys
    f_max = max_control_rate(L, robot)
    above_physical = robot.t_phys * (1 - 1e-12) > T
    feasible = rtc_ok and not above_physical
    # If d > s the next inference cannot start until this one ends: the real period is d ticks.
    s_eff = max(s_used, d)
    shares = {g: (stages.group_s(g) / L if L > 0 else 0.0) for g in GROUPS}
    # A synchronous runner executes the stretch it would replan after, then waits L: s actions
    # when s is fixed (the rest of the chunk is thrown away, as RTC's schedule does), all H when
    # nothing asks it to replan sooner.
    sync_stretch = robot.exec_horizon if robot.exec_horizon is not None else H
    return RooflineResult(
        latency_s=L,
        delay_ticks=d,
        exec_horizon=s_used,
        s_window=(d, H - d),
        d_le_s=d_le_s,
        s_le_h_minus_d=s_le,
        rtc_ok=rtc_ok,
        rate_hz=rate,
        physical_rate_hz=f_phys,
        achievable_rate_hz=f_max,
        feasible=feasible,
        chunk_rate_hz=rate / s_eff,
        max_chunk_rate_hz=rate / max(d, 1),
        sync_rate_hz=sync_stretch / (sync_stretch * T + L),
        # The new chunk's row 0 is the start tick, so its first executed row d runs d ticks after
        # the observation was assembled; the frame was camera_age old already then.
        observation_age_s=stages.camera_age_s + d * T,
        binding=binding_term(stages, robot),
        ridge_latency_s=robot.s_cap * robot.t_phys,
        latency_headroom_s=robot.s_cap * T - L,
        rate_margin=f_max / rate - 1.0,
        gpu_duty=stages.inference_s / (s_eff * T),
        shares=shares,
    )
