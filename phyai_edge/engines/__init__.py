"""Backends behind one `Engine` interface, the shared solver loop, and the `Policy` facade."""

from __future__ import annotations

import importlib
from typing import Any

# backend name -> "module:Class"; imported only when chosen.
BACKENDS = {
    "eager": "phyai_edge.engines.eager:EagerEngine",
    "cudagraph": "phyai_edge.engines.cudagraph:CudaGraphEngine",
    "onnxruntime": "phyai_edge.engines.onnxrt:OnnxRuntimeEngine",
    "tensorrt": "phyai_edge.engines.tensorrt:TensorRTEngine",
}


# Short names the commands and configs take (`export --backend onnx` writes an onnxruntime bundle).
BACKEND_ALIASES = {"onnx": "onnxruntime", "ort": "onnxruntime", "trt": "tensorrt"}


def backend_name(name: str) -> str:
    """The backend `name` stands for (itself, or the one its alias names)."""
    return BACKEND_ALIASES.get(name, name)


def make_engine(backend: str, adapter: Any, **kwargs: Any):
    backend = backend_name(backend)
    try:
        target = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown backend {backend!r}; available: {sorted(BACKENDS)}") from None
    module_name, cls_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise RuntimeError(f"backend {backend!r} is not available in this install: {exc}") from exc
    return getattr(module, cls_name)(adapter, **kwargs)
