"""Calibration for low-precision engines: where the samples come from (recorded daemon
observations, a LeRobot dataset folder, or synthetic), the TensorRT int8 entropy calibrator, fp8
scales for the torch path and the onnxruntime int8 quantiser. What runs the model to turn samples
into per-stage inputs, and the accuracy report against a higher-precision reference, are the
engines' (`engines.stage_inputs`, `engines.accuracy`): this package stays below them."""

from phyai_edge.calibration.dataset import CalibrationSet, load_calibration_set, synthetic_observations
from phyai_edge.calibration.records import read_records

__all__ = [
    "CalibrationSet", "load_calibration_set", "read_records", "synthetic_observations",
]
