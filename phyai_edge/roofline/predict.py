"""Predicted stage times on a device: the classic roofline per stage, scaled by efficiency.

    t_compute = gemm_flops / (peak[precision] * e_c) + (flops - gemm_flops) / (peak[16-bit] * e_c)
    t_memory  = bytes / (bandwidth * e_m)
    t_stage   = t_compute if the stage is compute-bound at 100 % of peak, else t_memory

e_c and e_m are the fractions of peak a real engine reaches on compute-bound and memory-bound
stages. They come from a measured run when we have one (`calibrate`: ideal time at 100 % of
peak divided by measured time, per class, on the measured device) and otherwise from the
documented defaults below (0.5 of peak FLOPs, 0.7 of peak bandwidth: what tuned TensorRT /
cuBLAS engines typically reach at these shapes; kernel-launch gaps are folded into them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from phyai_edge.roofline.costs import StageCost
from phyai_edge.roofline.devices import Device
from phyai_edge.roofline.model import StageTimes

MODEL_STAGES = ("embed_images", "encode_prefix", "denoise_step")


@dataclass(frozen=True)
class Efficiency:
    compute: float = 0.5
    bandwidth: float = 0.7
    source: str = "default (0.5 of peak FLOPs, 0.7 of peak bandwidth)"

    def __post_init__(self) -> None:
        for name in ("compute", "bandwidth"):
            value = getattr(self, name)
            if not 0 < value <= 1.5:  # > 1 allowed a little: measured runs may beat a sloppy count
                raise ValueError(f"efficiency.{name} must be in (0, 1.5], got {value!r}")


DEFAULT_EFFICIENCY = Efficiency()


@dataclass(frozen=True)
class StagePrediction:
    stage: str
    time_s: float
    compute_s: float
    memory_s: float
    cost: StageCost

    @property
    def bound(self) -> str:
        return "compute" if self.time_s == self.compute_s else "memory"

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "time_ms": self.time_s * 1e3,
            "compute_ms": self.compute_s * 1e3,
            "memory_ms": self.memory_s * 1e3,
            "bound": self.bound,
            "gflop": self.cost.flops / 1e9,
            "mbytes": self.cost.bytes / 1e6,
            "weights_mbytes": self.cost.weight_bytes / 1e6,
            "intensity_flop_per_byte": self.cost.intensity,
        }


def _sixteen_bit(precision: str) -> str:
    # Attention runs in the activations' 16-bit type: fp16 engines stay fp16, the rest use bf16.
    return "fp16" if precision == "fp16" else "bf16"


def predict_stage(
    stage: str, cost: StageCost, device: Device, precision: str, eff: Efficiency = DEFAULT_EFFICIENCY
) -> StagePrediction:
    peak = device.peak_flops(precision)
    peak16 = device.peak_flops(_sixteen_bit(precision))
    ideal_c = cost.gemm_flops / peak + (cost.flops - cost.gemm_flops) / peak16
    ideal_m = cost.bytes / device.bandwidth
    t_c, t_m = ideal_c / eff.compute, ideal_m / eff.bandwidth
    # A stage gets the efficiency of the class the ideal roofline puts it in, as `calibrate` fits
    # them: with max(t_c, t_m) a low memory factor (launch-bound memory stages) would turn
    # compute-bound stages memory-bound and the calibrated device would not reproduce its run.
    time_s = t_c if ideal_c >= ideal_m else t_m
    return StagePrediction(stage=stage, time_s=time_s, compute_s=t_c, memory_s=t_m, cost=cost)


def predict_stages(
    costs: Mapping[str, StageCost], device: Device, precision: str, eff: Efficiency = DEFAULT_EFFICIENCY
) -> dict[str, StagePrediction]:
    return {s: predict_stage(s, costs[s], device, precision, eff) for s in MODEL_STAGES if s in costs}


# The device's peaks themselves: what a stage cannot beat.
AT_PEAK = Efficiency(1.0, 1.0, "the device's peak FLOPs and bandwidth (a floor)")


def stage_floors(costs: Mapping[str, StageCost], device: Device, precision: str) -> dict[str, StagePrediction]:
    """The least time each model stage (and the whole solver loop) can take on `device`: its FLOPs
    at the peak rate or its bytes at the peak bandwidth, whichever is longer. `phyai-edge bench`
    and `benchmarks/pi05_gpu.py` print measured times against these."""
    stages = (*MODEL_STAGES, "solver_loop")
    return {s: predict_stage(s, costs[s], device, precision, AT_PEAK) for s in stages if s in costs}


@dataclass(frozen=True)
class Overheads:
    """Times the FLOP model cannot see: give measured values (defaults are zero: an upper bound)."""

    camera_age_s: float = 0.0
    preprocess_s: float = 0.0
    postprocess_s: float = 0.0
    transport_s: float = 0.0


def stage_times(
    preds: Mapping[str, StagePrediction], steps: int, extra: Overheads = Overheads()
) -> StageTimes:
    def t(name: str) -> float:
        return preds[name].time_s if name in preds else 0.0

    return StageTimes(
        camera_age_s=extra.camera_age_s,
        preprocess_s=extra.preprocess_s,
        vision_s=t("embed_images"),
        prefix_s=t("encode_prefix"),
        denoise_step_s=t("denoise_step"),
        steps=steps,
        postprocess_s=extra.postprocess_s,
        transport_s=extra.transport_s,
    )


@dataclass(frozen=True)
class Calibration:
    efficiency: Efficiency
    per_stage: dict[str, dict[str, Any]] = field(default_factory=dict)  # stage -> ideal/measured/eff/bound


def calibrate(
    costs: Mapping[str, StageCost],
    device: Device,
    precision: str,
    measured_s: Mapping[str, float],
    fallback: Efficiency = DEFAULT_EFFICIENCY,
    label: str = "",
) -> Calibration:
    """Efficiency per class from a measured run: sum(ideal) / sum(measured) over the stages the
    ideal roofline calls compute-bound (resp. memory-bound). A class with no measured stage keeps
    the fallback. Time-weighted, so the stage that dominates latency dominates the factor."""
    ideal = predict_stages(costs, device, precision, Efficiency(1.0, 1.0, "peak"))
    sums: dict[str, list[float]] = {"compute": [0.0, 0.0], "memory": [0.0, 0.0]}
    per_stage: dict[str, dict[str, Any]] = {}
    for stage, pred in ideal.items():
        m = measured_s.get(stage)
        if not m or m <= 0:
            continue
        sums[pred.bound][0] += pred.time_s
        sums[pred.bound][1] += m
        per_stage[stage] = {
            "ideal_ms": pred.time_s * 1e3,
            "measured_ms": m * 1e3,
            "efficiency": pred.time_s / m,
            "bound": pred.bound,
        }
    e_c = sums["compute"][0] / sums["compute"][1] if sums["compute"][1] else fallback.compute
    e_m = sums["memory"][0] / sums["memory"][1] if sums["memory"][1] else fallback.bandwidth
    # Clamp into the range Efficiency accepts: a measurement faster than 1.5x peak means the
    # count is wrong for this run, and a tiny factor would predict nonsense elsewhere.
    e_c = min(max(e_c, 1e-3), 1.5)
    e_m = min(max(e_m, 1e-3), 1.5)
    src = f"calibrated on {label or device.name} ({precision})"
    return Calibration(Efficiency(e_c, e_m, src), per_stage)
