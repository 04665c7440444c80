"""Control-Time Roofline: what bounds the robot's control rate (inference, pre/post-processing,
transport or the physical loop), from measured or predicted stage times.

Modules: `model` (the RTC arithmetic), `costs` (per-stage FLOP / byte counts per adapter),
`devices` (peak throughput and bandwidth table), `predict` (stage times on a device, calibration),
`sources` (bench JSON and Prometheus metrics), `plot` (the chart; imports matplotlib lazily).
Nothing here imports torch.
"""

from phyai_edge.roofline.costs import COST_MODELS, CostModel, StageCost, register_cost_model, stage_costs
from phyai_edge.roofline.devices import DEVICES, Device, find_device
from phyai_edge.roofline.model import RobotParams, RooflineResult, StageTimes, analyze, delay_ticks
from phyai_edge.roofline.predict import Efficiency, calibrate, predict_stages

__all__ = [
    "COST_MODELS",
    "DEVICES",
    "CostModel",
    "Device",
    "Efficiency",
    "RobotParams",
    "RooflineResult",
    "StageCost",
    "StageTimes",
    "analyze",
    "calibrate",
    "delay_ticks",
    "find_device",
    "predict_stages",
    "register_cost_model",
    "stage_costs",
]
