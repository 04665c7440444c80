"""Static int8 (and fp8) quantisation of a stage's ONNX with onnxruntime's quantiser.

Output is QDQ ONNX (QuantizeLinear / DequantizeLinear pairs around each quantised MatMul /
Gemm / Conv): onnxruntime runs it on CPU, which gives a runnable, measurable int8 path on any
machine, and TensorRT consumes the same file as explicit quantisation. Scales are symmetric
(zero point 0) because TensorRT accepts only symmetric Q/DQ.

Only products with a weight (an initializer input) are quantised: the attention products
QK^T and PV take two activations, and quantising those costs much more accuracy than it
saves time at these sizes.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

QUANT_OPS = ("MatMul", "Gemm", "Conv")


def weight_nodes(path: str | Path) -> list[str]:
    """Names of MatMul / Gemm / Conv nodes that multiply by a weight initializer."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    # Constant nodes feeding a product count as weights too (constant folding may leave them).
    consts = {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    return [n.name for n in model.graph.node
            if n.op_type in QUANT_OPS and any(i in inits or i in consts for i in n.input[1:2])]


@contextlib.contextmanager
def _quiet_root_logger() -> Iterator[None]:
    # The quantiser logs advice to the root logger on every call; it is not actionable here.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def quantize_stage(
    src: str | Path,
    dst: str | Path,
    samples: list[dict[str, np.ndarray]],
    kind: str = "int8",
    per_channel: bool = True,
) -> Path:
    """Quantise `src` into `dst` using `samples` (stage inputs by name) for activation ranges."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    if not samples:
        raise ValueError("quantisation needs at least one calibration sample")

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter(samples)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._it, None)

    qtype = {"int8": QuantType.QInt8, "fp8": QuantType.QFLOAT8E4M3FN}[kind]
    nodes = weight_nodes(src)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    # The float8 path prints its histogram progress to stdout: keep the CLI's table readable.
    with _quiet_root_logger(), contextlib.redirect_stdout(io.StringIO()):
        quantize_static(
            str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ, activation_type=qtype, weight_type=qtype,
            per_channel=per_channel and kind == "int8", nodes_to_quantize=nodes, op_types_to_quantize=list(QUANT_OPS),
            # Float8 ranges come from the activation distribution (the only method ORT allows).
            calibrate_method=CalibrationMethod.MinMax if kind == "int8" else CalibrationMethod.Distribution,
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
        )
    return dst
