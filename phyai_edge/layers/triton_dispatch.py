"""Whether and where the fused Triton kernels run: the one place that imports triton (optional),
knows whether its CPU interpreter is on, and resolves a requested backend ("reference", "triton",
"auto") for a device. `layers.triton_ops` and `layers.triton_attention` both dispatch through it.
"""

from __future__ import annotations

import os

import torch

try:  # optional: the references below need only torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent (CI)
    triton = None
    tl = None

BACKENDS = ("reference", "triton", "auto")


# -- dispatcher ---------------------------------------------------------------------------------
def triton_available() -> bool:
    return triton is not None


# Triton decides at decoration whether a kernel is interpreted: for a kernel module's kernels at its import (after this module's),
# for triton.language's own (tl.sum, ...) at triton's import. Both must have seen TRITON_INTERPRET=1.
_INTERPRET_ASKED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
_INTERPRET = (triton is not None and _INTERPRET_ASKED
              and type(getattr(tl, "sum", None)).__name__ == "InterpretedFunction")


def interpret_mode() -> bool:
    """The kernels run in Triton's CPU interpreter (numpy): `TRITON_INTERPRET=1` was set before
    this module was imported."""
    return _INTERPRET


def triton_status(device: torch.device | str) -> tuple[bool, str]:
    """Whether the kernels can run on `device`, and if not, why (one line)."""
    device = torch.device(device)
    if triton is None:
        return False, "triton is not installed (pip install triton)"
    if device.type == "cuda" or interpret_mode():
        return True, "triton kernels" + (" (TRITON_INTERPRET=1)" if interpret_mode() else "")
    if _INTERPRET_ASKED:
        return False, "TRITON_INTERPRET=1 was set after triton was imported (set it before anything imports triton)"
    return False, f"triton kernels need a CUDA device or TRITON_INTERPRET=1 (device is {device})"


def resolve_backend(requested: str, device: torch.device | str) -> str:
    """"reference" | "triton" | "auto" -> "reference" | "triton" for tensors on `device`."""
    if requested not in BACKENDS:
        raise ValueError(f"backend={requested!r}: choose one of {BACKENDS}")
    if requested == "reference":
        return "reference"
    ok, why = triton_status(device)
    if requested == "triton" and not ok:
        raise RuntimeError(f"backend='triton' cannot run: {why}")
    return "triton" if ok else "reference"


def _use_triton(backend: str, *tensors: torch.Tensor) -> bool:
    if backend == "reference":
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False  # autograd (exact RTC guidance): the kernels have no backward
    return resolve_backend(backend, tensors[0].device) == "triton"
