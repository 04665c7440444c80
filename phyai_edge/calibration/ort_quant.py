"""Static int8 (and fp8) quantisation of a stage's ONNX with onnxruntime's quantiser.

Output is QDQ ONNX (QuantizeLinear / DequantizeLinear pairs around each quantised MatMul /
Gemm / Conv): onnxruntime runs it on CPU, which gives a runnable, measurable int8 path on any
machine, and TensorRT consumes the same file as explicit quantisation. Scales are symmetric
(zero point 0) because TensorRT accepts only symmetric Q/DQ.

Only products with a weight (an initializer input) are quantised: the attention products
QK^T and PV take two activations, and quantising those costs much more accuracy than it
saves time at these sizes. Products whose weight is one of `keep_float` (the linears the model
keeps in float32 at every reduced precision: for PI0.5 the adaptive norms' modulation, the time
MLP and the action projections, `PI05Model.precision_dtypes`) stay float too: they are tiny,
and in int8 they cost most of the accuracy (the action output projection writes the velocity).
They are found by value (the stored weight or its transpose), because the exported node names
keep only the last module name ("/dense_3/Gemm", "/action_out_proj/MatMul").

Biases stay float (`QuantizeBias` off): the quantiser would otherwise store a Conv / Gemm bias as
int32 behind a DequantizeLinear, which TensorRT's ONNX parser refuses ("only activation types
allowed as input to this layer"), and the file must build there as it runs here. A source whose
weights live in an external-data file (export_stage's choice above 2 GB: the full model's prefix)
is quantised with external data too, for the quantiser's own augmented float copy and for the
output: either is past protobuf's 2 GB limit at full size.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

QUANT_OPS = ("MatMul", "Gemm", "Conv")


def weight_nodes(path: str | Path, keep_float: Sequence[np.ndarray] = ()) -> list[str]:
    """Names of MatMul / Gemm / Conv nodes that multiply by a weight initializer, except those
    whose weight is one of `keep_float` ((out, in) linear weights; stored as is or transposed)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    weights: dict[str, Any] = {i.name: i for i in model.graph.initializer}
    # Constant nodes feeding a product count as weights too (constant folding may leave them).
    for n in model.graph.node:
        if n.op_type == "Constant":
            value = next((a.t for a in n.attribute if a.name == "value"), None)
            weights[n.output[0]] = value
    nodes = [n for n in model.graph.node if n.op_type in QUANT_OPS and n.input[1:2] and n.input[1] in weights]
    return [n.name for n in nodes if not _is_kept(weights[n.input[1]], keep_float, Path(path).parent)]


def uses_external_data(path: str | Path) -> bool:
    """Whether the ONNX file at `path` keeps any initializer in an external-data file."""
    import onnx
    from onnx import external_data_helper

    model = onnx.load(str(path), load_external_data=False)
    return any(external_data_helper.uses_external_data(t) for t in model.graph.initializer)


def _is_kept(tensor: Any, keep_float: Sequence[np.ndarray], base_dir: Path) -> bool:
    if tensor is None or not keep_float:
        return False
    from onnx import external_data_helper, numpy_helper

    dims = tuple(tensor.dims)
    if not any(dims in (w.shape, w.shape[::-1]) for w in keep_float):
        return False
    if external_data_helper.uses_external_data(tensor):
        tensor = copy.deepcopy(tensor)
        external_data_helper.load_external_data_for_tensor(tensor, str(base_dir))
    value = numpy_helper.to_array(tensor)
    return any(np.array_equal(value, w) or np.array_equal(value, w.T) for w in keep_float
               if dims in (w.shape, w.shape[::-1]))


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


def float32_weights(module: Any) -> list[np.ndarray]:
    """The weights of the linears the model keeps in float32 at every reduced precision (its
    `precision_dtypes` rule; PI0.5: the adaptive norms' modulation, the time MLP, the action
    projections), which a quantised ONNX (`quantize_stage(keep_float=)`, for onnxruntime and for
    TensorRT's Q/DQ builds alike) leaves in float as well. Empty without such a rule."""
    import torch

    rule = getattr(module, "precision_dtypes", None)
    if rule is None:
        return []
    dtypes = rule(torch.float16)
    return [m.weight.detach().float().cpu().numpy() for name, m in module.named_modules()
            if isinstance(m, torch.nn.Linear) and dtypes.get(f"{name}.weight") == torch.float32]


def quantize_stage(
    src: str | Path,
    dst: str | Path,
    samples: list[dict[str, np.ndarray]],
    kind: str = "int8",
    per_channel: bool = True,
    keep_float: Sequence[np.ndarray] = (),
) -> Path:
    """Quantise `src` into `dst` using `samples` (stage inputs by name) for activation ranges;
    products by a weight in `keep_float` ((out, in) linear weights) are left in float."""
    import onnx
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
    nodes = weight_nodes(src, keep_float)
    # The rest are excluded by name too: an empty nodes_to_quantize means "every node" to the quantiser.
    chosen = set(nodes)
    excluded = [n.name for n in onnx.load(str(src), load_external_data=False).graph.node
                if n.op_type in QUANT_OPS and n.name not in chosen]
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    external = uses_external_data(src)
    stale = dst.with_name(dst.name + ".data")
    if external and stale.exists():
        stale.unlink()  # onnx appends to an existing data file: a leftover would grow, not be replaced
    # The float8 path prints its histogram progress to stdout: keep the CLI's table readable.
    with _quiet_root_logger(), contextlib.redirect_stdout(io.StringIO()):
        quantize_static(
            str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ, activation_type=qtype, weight_type=qtype,
            per_channel=per_channel and kind == "int8", nodes_to_quantize=nodes, nodes_to_exclude=excluded,
            op_types_to_quantize=list(QUANT_OPS),
            # Float8 ranges come from the activation distribution (the only method ORT allows).
            calibrate_method=CalibrationMethod.MinMax if kind == "int8" else CalibrationMethod.Distribution,
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False},
            use_external_data_format=external,
        )
    return dst
