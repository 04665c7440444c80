"""Whether and where the fused Triton kernels run: the one place that imports triton (optional),
knows whether its CPU interpreter is on, and resolves a requested backend ("reference", "triton",
"auto") for a device. `layers.triton_ops` and `layers.triton_attention` both dispatch through it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

try:  # optional: the references below need only torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent (CI)
    triton = None
    tl = None

try:  # what a launch raises when a tiling asks for more shared memory (or registers) than the GPU has
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - older triton, or none
    class OutOfResources(Exception):  # type: ignore[no-redef]  # noqa: N818  (triton's name; never raised)
        pass

try:  # programmatic dependent launch (Hopper and later): present in triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # pragma: no cover - older triton, or none
    HAS_GDC = False

BACKENDS = ("reference", "triton", "auto")
# The oldest Triton these kernels have run with: 3.6 on the H200 (benchmarks/RESULTS.md), 3.9 in
# the tests' interpreter. Older ones lack APIs they use or compile them differently (3.1, which
# JetPack 6's PyTorch 2.5 pairs with, cannot even interpret them): such a Triton counts as absent,
# so the engine runs the reference ops instead of failing at its first launch.
MIN_TRITON = (3, 6)
log = logging.getLogger(__name__)


# -- dispatcher ---------------------------------------------------------------------------------
def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def triton_available() -> bool:
    """Triton is installed and not older than MIN_TRITON."""
    return triton is not None and _version(getattr(triton, "__version__", "0")) >= MIN_TRITON


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
    if not triton_available():
        have, need = getattr(triton, "__version__", "0"), ".".join(map(str, MIN_TRITON))
        return False, f"triton {have} is older than {need}, the oldest these kernels were run with (pip install 'triton>={need}')"
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


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Autograd will differentiate through a call on these tensors (exact RTC guidance takes a
    vector-Jacobian product through the denoise step)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


_KERNEL_BACKWARD = True


def set_kernel_backward(on: bool) -> bool:
    """Whether calls needing a gradient take the kernels and their backward (`layers.triton_grad`;
    the default) or the references (as before those existed: benchmarks time both). Applies to
    graphs captured from now on; returns the previous setting."""
    global _KERNEL_BACKWARD
    before, _KERNEL_BACKWARD = _KERNEL_BACKWARD, bool(on)
    return before


def _use_triton(backend: str, *tensors: torch.Tensor, differentiable: bool = False) -> bool:
    """The kernels run this call. `differentiable`: the op has a backward for its kernels
    (`layers.triton_grad`), so a call needing a gradient may take them too (unless
    `set_kernel_backward(False)`); otherwise such a call runs the reference, which autograd
    differentiates."""
    if backend == "reference":
        return False
    if not (differentiable and _KERNEL_BACKWARD) and needs_grad(*tensors):
        return False
    return resolve_backend(backend, tensors[0].device) == "triton"


# -- launch shapes, shared by the kernel modules -------------------------------------------------
_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device (cached); 8 elsewhere."""
    if device.type != "cuda":
        return 8  # the interpreter: small shapes still split, so the merge is exercised
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


NO_SPLIT = 1 << 30  # a tiling's fewest keys (rows) per range that no range reaches: one range, no merge
C = TypeVar("C")
R = TypeVar("R")
_DOES_NOT_FIT: set[tuple[str, int, object]] = set()  # (kernel, device index, tiling) that failed to fit


def launch_fitting(kernel: str, device: torch.device, tilings: Sequence[C], launch: Callable[[C], R]) -> R:
    """`launch(tiling)` with the first of `tilings` that fits `device`, returning what it returns.
    The tilings are chosen on an H200 (227 KB of shared memory a block); an RTX GPU offers 99 KB and
    Orin 163 KB, and how much a tiling asks for changes between Triton versions. Triton raises
    `OutOfResources` at a shape's first launch (an engine's warm-up, before capture), before anything
    is enqueued: that tiling is remembered for the device, said once in the log, and the next one
    tried; later calls go straight to the one that fits."""
    idx = -1 if device.type != "cuda" else device.index if device.index is not None else torch.cuda.current_device()
    tried: list[str] = []
    for tiling in dict.fromkeys(tilings):  # in order, without repeats
        if (kernel, idx, tiling) in _DOES_NOT_FIT:
            continue
        try:
            return launch(tiling)
        except OutOfResources as exc:
            _DOES_NOT_FIT.add((kernel, idx, tiling))
            tried.append(f"{tiling}: {exc}")
            log.warning("%s: tiling %s does not fit this GPU (%s); trying a smaller one", kernel, tiling, exc)
    raise RuntimeError(f"{kernel}: none of its tilings fits this GPU: {'; '.join(tried) or 'all failed before'}")


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """A (..., width) tensor as (rows, width) with unit column stride (a view when it can be)."""
    t = t.reshape(-1, width)
    return t if t.stride(-1) == 1 else t.contiguous()


def _per_batch(m: torch.Tensor, batch: int, width: int) -> tuple[torch.Tensor, int]:
    """A (B or 1, 1, width) modulation as (B or 1, width) rows and its batch stride (0: broadcast)."""
    rows = _rows(m, width)
    if rows.shape[0] not in (1, batch):
        raise ValueError(f"modulation of shape {tuple(m.shape)} does not broadcast over batch {batch}")
    return rows, (rows.stride(0) if rows.shape[0] > 1 else 0)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _row_warps(elements: int) -> int:
    """Warps for a program holding `elements` of each row tensor in registers: 8 from 2048 (SigLIP's
    1152-wide rows), so a thread holds 8 floats of each rather than 16 (Triton's layer-norm
    tutorial's rule), rounded down to a power of two (Triton's requirement; the interpreter does not
    check it)."""
    warps = max(elements // 256, 1)
    return min(1 << (warps.bit_length() - 1), 8)


# -- counters for in-kernel merges ------------------------------------------------------------------
class Tickets:
    """Zeroed int32 counters for the in-kernel merges (the split attention's partial outputs, its
    backward's partial gradients), handed out in slices. A kernel leaves its
    slice at zero again, but each call still takes a fresh slice: two calls never share one, so
    graphs replayed on different streams cannot race on a ticket. One zero-fill per `CHUNK`
    tickets: a stack of layers shares one `Tickets` (`stack_attention`), so a CUDA graph of a
    whole denoise step holds one or two fills, not one per layer."""

    CHUNK = 8192

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buf: torch.Tensor | None = None
        self._used = 0

    def take(self, n: int) -> torch.Tensor:
        if self._buf is None or self._used + n > self._buf.numel():
            self._buf = torch.zeros(max(self.CHUNK, n), dtype=torch.int32, device=self.device)
            self._used = 0
        out = self._buf[self._used:self._used + n]
        self._used += n
        return out


# -- programmatic dependent launch ------------------------------------------------------------------
# A CUDA-graph replay of a batch-1 denoise step is ~150 small dependent kernels, each 3-10 us, and
# each waits for its predecessor to finish completely before it is even launched. With PDL (sm_90+)
# a kernel is launched while its predecessor still runs; its programs wait at `griddepcontrol.wait`
# (all of the predecessor's writes then visible) before any load or store, and release their own
# successor at once, so reads after writes and writes after reads keep stream order; a kernel that
# is not ours (cuBLAS, torch) is ordered as usual. Off unless PHYAI_EDGE_PDL=1 (or `set_pdl(True)`):
# on the H200 it gave bit-identical chunks but slower ones (batch 1 17.47 vs 17.01 ms), and slower
# still with each GEMM / attention program asking L2 for its weights / cached keys before the wait
# (18.90 vs 16.68 ms, 2026-12-03; docs/gpu_kernels.md).
PDL_ENV = "PHYAI_EDGE_PDL"
_PDL_ON = os.environ.get(PDL_ENV, "0").lower() in ("1", "true", "on")
_PDL_CAPABLE: dict[int, bool] = {}


def set_pdl(on: bool) -> bool:
    """Turn programmatic dependent launch on or off for kernels launched (or captured) from now
    on; returns the previous setting (benchmarks time both)."""
    global _PDL_ON
    before, _PDL_ON = _PDL_ON, bool(on)
    return before


def launch_options(t: torch.Tensor) -> dict[str, bool]:
    """Keyword arguments for a kernel launch on t's device: PDL on a CUDA device of compute
    capability >= 9.0 (griddepcontrol is an sm_90 instruction) with PDL on; else off (CPU, the
    interpreter, Ampere / Ada / Orin)."""
    if not (_PDL_ON and HAS_GDC and t.is_cuda and not _INTERPRET):
        return {"PDL": False}
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _PDL_CAPABLE:
        _PDL_CAPABLE[idx] = torch.cuda.get_device_capability(idx) >= (9, 0)
    return {"PDL": True, "launch_pdl": True} if _PDL_CAPABLE[idx] else {"PDL": False}


if triton is not None:

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):  # noqa: N803  (a Triton compile-time constant)
        """Wait for the preceding kernel's writes, then let the next kernel launch."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
