"""PI0.5 at 50 Hz with H = 50: is Jetson AGX Orin inference-bound and RTX PRO 6000 physical-loop-bound?

Prints the numbers behind the "published conclusion" section of docs/roofline.md:
  1. the default prediction (bf16, 3 views, 10 steps, s free),
  2. the same with a fixed execution horizon s,
  3. the compute efficiency at which each device crosses the ridge L* (becomes inference-bound),
  4. the synchronous (no RTC) average rate for comparison (s actions between waits for a fixed s,
     H with s free).

L is the latency the daemon's d counts (inference start -> chunk adopted); camera age is not in it
and shows up only in the observation's age when the new chunk's first action runs.

Run: PYTHONPATH=. python benchmarks/roofline_pi05_conclusion.py
"""

from __future__ import annotations

from phyai_edge.roofline.costs import cost_model, stage_costs
from phyai_edge.roofline.devices import find_device
from phyai_edge.roofline.model import RobotParams, StageTimes, analyze
from phyai_edge.roofline.predict import Efficiency, Overheads, predict_stages, stage_times

RATE_HZ, HORIZON = 50.0, 50
DEVICES = ("jetson-agx-orin-64gb", "rtx-pro-6000")


def predicted(
    device: str, eff: Efficiency, precision: str = "bf16", extra: Overheads | None = None
) -> StageTimes:
    cfg = cost_model("pi05").load_config("full")
    costs = stage_costs("pi05", cfg, precision=precision)
    preds = predict_stages(costs, find_device(device), precision, eff)
    return stage_times(preds, cfg.num_steps, extra or Overheads())


def break_even_compute_efficiency(device: str, robot: RobotParams, bandwidth: float = 0.7) -> float:
    """Largest compute efficiency at which L exceeds the ridge (bisection on a monotone L(e))."""
    lo, hi = 1e-4, 1.0
    if analyze(predicted(device, Efficiency(lo, bandwidth)), robot).binding == "physical":
        return 0.0  # never inference-bound in (0, 1]
    for _ in range(60):
        mid = (lo + hi) / 2
        if analyze(predicted(device, Efficiency(mid, bandwidth)), robot).binding == "physical":
            hi = mid
        else:
            lo = mid
    return lo


def row(name: str, t: StageTimes, robot: RobotParams) -> str:
    r = analyze(t, robot)
    window = f"[{r.s_window[0]}, {r.s_window[1]}]" if r.s_window[0] <= r.s_window[1] else "empty"
    return (
        f"  {name:24} L = {r.latency_s * 1e3:7.1f} ms  d = {r.delay_ticks:3d}  s window {window:9}  "
        f"RTC {'ok  ' if r.rtc_ok else 'FAIL'}  f_max = {r.achievable_rate_hz:5.1f} Hz  binds: {r.binding:10}  "
        f"headroom {r.latency_headroom_s * 1e3:7.1f} ms  no-RTC avg {r.sync_rate_hz:5.1f} Hz  "
        f"obs age {r.observation_age_s * 1e3:6.1f} ms"
    )


def main() -> None:
    free = RobotParams.from_rates(RATE_HZ, HORIZON)
    eff = Efficiency()
    print(f"PI0.5 full, bf16, 3 views, 200 prompt tokens, 10 steps; {RATE_HZ:g} Hz, H = {HORIZON}")
    print(f"ridge L* = floor(H/2) x T = {free.s_cap * free.control_period_s * 1e3:.0f} ms (s free)")
    print(f"\n1. default efficiency ({eff.compute} compute, {eff.bandwidth} bandwidth), s free:")
    for d in DEVICES:
        print(row(find_device(d).name, predicted(d, eff), free))
    print("\n   + 33 ms camera age (30 fps, worst case; staleness, not in L), 10 ms preprocess, 1 ms postprocess, "
          "1 ms transport:")
    extra = Overheads(camera_age_s=0.033, preprocess_s=0.010, postprocess_s=0.001, transport_s=0.001)
    for d in DEVICES:
        print(row(find_device(d).name, predicted(d, eff, extra=extra), free))
    for s in (5, 10, 25):
        fixed = RobotParams.from_rates(RATE_HZ, HORIZON, exec_horizon=s)
        print(f"\n2. fixed execution horizon s = {s} (replan every {s / RATE_HZ * 1e3:.0f} ms, or every d "
              f"ticks where d > s: the next inference starts as the last one lands):")
        for d in DEVICES:
            print(row(find_device(d).name, predicted(d, eff), fixed))
    print("\n3. compute efficiency below which the device becomes inference-bound (bandwidth 0.7, s free):")
    for d in DEVICES:
        e = break_even_compute_efficiency(d, free)
        print(f"  {find_device(d).name:24} e_c < {e:.3f} of the dense bf16 peak")
    print("\n4. Orin at int8 weights (GEMMs at the int8 rate, attention at bf16):")
    print(row("Jetson AGX Orin 64GB int8", predicted(DEVICES[0], eff, precision="int8"), free))


if __name__ == "__main__":
    main()
