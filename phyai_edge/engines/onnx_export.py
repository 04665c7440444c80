"""Adapter stages -> ONNX files, one per stage, with named static-shape inputs and outputs.

The TorchScript-tracing exporter (`dynamo=False`) is used on purpose: it needs nothing beyond
torch and onnx (the dynamo exporter pulls in onnxscript), it works offline, and our stages are
straight-line tensor code with static shapes, which is exactly what tracing handles well.
The exporter is deprecated upstream; `export_stage` falls back to the dynamo path if the
legacy one is ever removed.

Names match `Adapter.stage_specs`, so one stage's outputs feed the next by name in every
runtime (onnxruntime sessions, TensorRT contexts).
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phyai_edge.adapters.base import Adapter, StageSpec

OPSET = 17
# A protobuf cannot exceed 2 GiB; above this the weights go to one external-data file.
_EXTERNAL_DATA_BYTES = 1800 << 20

PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "int8")
TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class StageModule(nn.Module):
    """One stage as a module whose forward takes the stage's inputs positionally, in spec order."""

    def __init__(self, model: nn.Module, stage: str) -> None:
        super().__init__()
        self.model = model
        self.stage = stage

    def forward(self, *args: torch.Tensor) -> Any:
        return getattr(self.model, self.stage)(*args)


def sample_inputs(spec: StageSpec, seed: int = 0, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Plausible values for tracing or smoke-testing a stage: masks mostly true, ids small."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in spec.inputs.items():
        if dtype == torch.bool:
            t = torch.rand(shape, generator=gen) > 0.2
            if t.ndim >= 2:
                t[..., 0] = True  # every row keeps at least one valid entry, like real inputs
        elif dtype in (torch.int64, torch.int32):
            t = torch.randint(0, 100, shape, generator=gen, dtype=dtype)
        elif name == "t":
            t = torch.rand(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen).to(dtype)
        out[name] = t.to(device)
    return out


@contextlib.contextmanager
def export_ready(adapter: Adapter, precision: str = "fp32") -> Iterator[Adapter]:
    """The adapter set up for export at `precision`, restored afterwards.

    Yields an adapter whose `module` is cast to the precision and whose `stage_specs` report
    the matching dtypes. Lower precisions work on a copy of the module: casting the shared
    module to bf16 and back would lose the float32 bits the eager reference needs.
    """
    module = adapter.module
    dtype = TORCH_DTYPE.get(precision, torch.float32)
    old_flag = getattr(module, "time_embed_fp64", None)
    old_dtype = getattr(module, "compute_dtype", torch.float32)
    if dtype == torch.float32:
        twin, target = adapter, module
    else:
        twin = copy.copy(adapter)
        target = twin.module = copy.deepcopy(module)
    if hasattr(target, "set_precision"):
        target.set_precision(dtype)
    else:
        target.to(dtype)  # a model without its own precision switch: its weights in that dtype
    if old_flag is not None:
        # Neither onnxruntime nor TensorRT has a double-precision sine.
        target.time_embed_fp64 = False
    target.eval().requires_grad_(False)
    try:
        yield twin
    finally:
        if target is module:
            if old_flag is not None:
                module.time_embed_fp64 = old_flag
            if hasattr(module, "set_precision"):
                module.set_precision(old_dtype)


def _dynamic_axes(spec: StageSpec) -> dict[str, dict[int, str]]:
    """Only the batch dimension is dynamic: axis 1 for the per-layer KV caches, 0 otherwise."""
    axes = {}
    for name in [*spec.inputs, *spec.outputs]:
        axes[name] = {1 if name in ("k_cache", "v_cache") else 0: "batch"}
    return axes


def export_stage(
    module: nn.Module,
    spec: StageSpec,
    path: str | Path,
    opset: int = OPSET,
    dynamic_batch: bool = False,
    check: bool = True,
) -> Path:
    """Trace one stage into `path`. Large models keep their weights in `<path>.data` beside it."""
    import onnx

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    device = next(module.parameters()).device
    args = tuple(sample_inputs(spec, device=device).values())
    wrapper = StageModule(module, spec.name).eval()
    with tempfile.TemporaryDirectory(prefix="phyai-onnx-") as tmp:
        # Export into a private folder: the tracer may scatter one external file per tensor
        # for large models, and stages would otherwise overwrite each other's files.
        raw = Path(tmp) / "model.onnx"
        kwargs: dict[str, Any] = dict(
            input_names=list(spec.inputs), output_names=list(spec.outputs), opset_version=opset,
            do_constant_folding=True, dynamic_axes=_dynamic_axes(spec) if dynamic_batch else None,
        )
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # tracer chatter about shape-derived Python ints
            try:
                torch.onnx.export(wrapper, args, str(raw), dynamo=False, **kwargs)
            except (TypeError, NotImplementedError, RuntimeError) as exc:
                if "dynamo" not in str(exc) and "TorchScript" not in str(exc):
                    raise
                torch.onnx.export(wrapper, args, str(raw), dynamo=True, **kwargs)
        model = onnx.load(str(raw))
        size = sum(t.ByteSize() for t in model.graph.initializer)
        if path.exists():
            path.unlink()
        data = path.with_name(path.name + ".data")
        if size > _EXTERNAL_DATA_BYTES:
            if data.exists():
                data.unlink()
            onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data.name, size_threshold=1024)
        else:
            onnx.save_model(model, str(path))
    if check:
        check_onnx(path)
    return path


def check_onnx(path: str | Path) -> None:
    """onnx.checker on the file (by path, so models with external data are checked too)."""
    import onnx

    onnx.checker.check_model(str(path), full_check=False)


def onnx_io(path: str | Path) -> dict[str, list[tuple[str, list[int | str]]]]:
    """{"inputs": [(name, dims)], "outputs": [...]} as the file declares them (dims may be symbolic)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def dims(vi: Any) -> list[int | str]:
        return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]

    return {"inputs": [(i.name, dims(i)) for i in model.graph.input],
            "outputs": [(o.name, dims(o)) for o in model.graph.output]}
