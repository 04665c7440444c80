"""FP8 (E4M3) linear layers with per-tensor scales, and the swap that puts them into a model.

`Fp8Linear` keeps the weight as `float8_e4m3fn` with one float32 scale (`w ~ w_fp8 * weight_scale`)
and has two paths:

- `scaled_mm` (CUDA, compute capability >= 8.9: Ada, Hopper, Blackwell): activations are cast to
  E4M3 with a per-tensor scale (static from calibration, or dynamic: amax of this call's input, on
  the device, so it is graph-capturable) and `torch._scaled_mm` multiplies the two fp8 operands
  with fp32 accumulation, output in the activation dtype (bf16 / fp16). torch 2.13's constraints,
  all met here: both operands 2-D, `self` row-major (the activation rows, made contiguous), `mat2`
  column-major (the (N, K) row-major fp8 weight, transposed: a view), K and N multiples of 16,
  scale_a / scale_b float32 scalars (tensorwise scaling), bias in the output dtype.
- `reference` (any device): the same rounding in plain torch: the activation is rounded through
  E4M3 at the same scale (unless weight-only), the E4M3 weight is dequantised to the activation
  dtype, and `F.linear` multiplies. On CPU this is what runs, and what the tests compare.

`activations`: "dynamic" (default; per call amax of the input), "static" (the calibration's input
scale: `calibration/fp8.py` input amax / 448; inputs beyond it saturate at +-448 * scale), or
"none" (weight-only: dequantise the weight and multiply in the activation dtype, on every device;
it halves the resident size of the fp8 copy but is not faster: no torch kernel reads fp8 weights
against bf16 activations).

What the swap (`convert_fp8`) does to a model, and why it keeps the checkpoint readable:
`Fp8Linear` subclasses `nn.Linear` and keeps the original `weight` / `bias` Parameters (the same
objects, not copies), so the state dict has exactly the model's names and values; the fp8 weight
and the scales are non-persistent buffers, recomputed from the weight at conversion. The cost is
memory: the fp8 copy sits beside the bf16 weights (+50% for the converted layers). An fp8-converted
model is an engine artefact: call `remove_fp8` (as `PI05Model.set_precision` does) before casting
it or loading weights into it, or the fp8 copy goes stale.

Fusion: fuse first, then quantise the fused linears (`layers/fused.py`; the engine does
`set_precision -> fuse_projections -> convert_fp8`). The fused QKV / gate-up GEMM is what makes
the batch-1 action expert cheaper (fewer launches, one read of the activations), and the parts of
a fused projection share one input, so one activation cast and one activation scale serve them
all. The price: one weight scale for the concatenation (the largest part's amax), so a part with
much smaller weights than its siblings loses some E4M3 resolution (it still has E4M3's 3
mantissa bits relative to its own magnitude until it falls ~2^9 below the largest; the accuracy
tests and `benchmarks/pi05_gpu.py` measure the end result). A fused Fp8Linear is attached with
`attach_unregistered`, like the bf16 fused linear it replaces, so `unfuse_projections` drops it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from phyai_edge.layers.triton_dispatch import interpret_mode, launch_options, tl, triton, triton_available

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 value
MIN_CAPABILITY = (8, 9)  # Ada (8.9), Hopper (9.0) and later have fp8 tensor cores
ACTIVATIONS = ("dynamic", "static", "none")
BACKENDS = ("auto", "scaled_mm", "reference")
_TINY = 1e-12

# fused attribute -> the part linears it concatenates (layers/gemma.py, layers/mlp.py, layers/siglip.py)
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
# the projections a scope converts: attention and MLP linears of these submodules of PI05Model
# (norm-modulation denses, the time MLP and the action in/out projections stay float32: tiny)
SCOPES = {"expert": ("expert_layers",), "prefix": ("prefix_layers",),
          "all": ("vision.encoder", "projector", "prefix_layers", "expert_layers")}
_PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "gate_proj", "up_proj", "down_proj",
                "fc1", "fc2", "qkv_proj", "gate_up"}


def _tensor_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def scaled_mm_supported(device: torch.device | str, capability: tuple[int, int] | None = None) -> bool:
    """Whether `torch._scaled_mm` with E4M3 runs on `device`: CUDA (not ROCm: it uses the fnuz
    variant) with compute capability >= 8.9. `capability` overrides the query (for tests)."""
    device = torch.device(device)
    if device.type != "cuda" or getattr(torch.version, "hip", None):
        return False
    if capability is None:
        if not torch.cuda.is_available():
            return False
        capability = _capability(_tensor_device(device).index or 0)
    return tuple(capability) >= MIN_CAPABILITY


def select_backend(device: torch.device | str, requested: str = "auto",
                   activations: str = "dynamic", capability: tuple[int, int] | None = None) -> str:
    """"scaled_mm" or "reference" for a layer whose weight lives on `device`."""
    if requested not in BACKENDS:
        raise ValueError(f"fp8 backend {requested!r}: choose one of {BACKENDS}")
    fast = scaled_mm_supported(device, capability)
    if requested == "scaled_mm":
        if activations == "none":
            raise ValueError("the scaled_mm fp8 path multiplies two fp8 operands; weight-only fp8 "
                             "(activations='none') runs the reference path")
        if not fast and torch.device(device).type == "cuda":
            raise RuntimeError(f"torch._scaled_mm with float8_e4m3fn needs a CUDA GPU of compute capability "
                               f">= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada, Hopper or later); {device} has "
                               f"{capability or 'an older one'}")
        return "scaled_mm"  # on CPU too: torch has a CPU _scaled_mm (used by tests to check the maths)
    if requested == "reference" or activations == "none":
        return "reference"
    return "scaled_mm" if fast else "reference"


def weight_scale_of(weight: torch.Tensor) -> float:
    """Per-tensor scale mapping the weight's amax onto the top of E4M3."""
    return max(float(weight.detach().abs().max()), _TINY) / FP8_MAX


def quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale, saturated to +-448, as E4M3 (what fp8 GEMMs with amax scaling do)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


if triton is not None:
    from phyai_edge.layers.triton_dispatch import pdl_enter
    FP8_MAX_TL = tl.constexpr(FP8_MAX)

    @triton.jit
    def _quantize_kernel(x_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """out = saturate(x / scale) in out's dtype: E4M3 on a GPU (Triton's float32 -> fp8e4nv
        cast rounds to nearest even, as torch's does), float32 in the CPU test (the interpreter's
        fp8 cast is wrong: it turned 124.3 into 64)."""
        pdl_enter(PDL)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        x = tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32)
        y = x / tl.load(scale_ptr).to(tl.float32)
        y = tl.minimum(tl.maximum(y, -FP8_MAX_TL), FP8_MAX_TL)
        tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=ok)


def quantize_kernel(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = FP8_DTYPE) -> torch.Tensor:
    """`quantize` as one Triton pass over x (read x, write one byte an element); `scale` a float32
    scalar tensor on x's device. The reference reads x, writes a float32 copy, divides, clamps and
    casts: four passes and ~27 bytes moved per element, which at the prefix's batch-32 down
    projection (26112 x 16384) costs more than the fp8 GEMM saves. `out_dtype` float32 returns the
    saturated quotient before the cast (the CPU tests)."""
    src = x.contiguous()
    out = torch.empty(src.shape, dtype=out_dtype, device=x.device)
    block = 4096
    _quantize_kernel[(triton.cdiv(src.numel(), block),)](src, scale.reshape(1), out, src.numel(), BLOCK=block,
                                                         **launch_options(src))
    return out


def quantize_fast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`quantize` in one kernel on CUDA with triton installed, else the reference."""
    if x.is_cuda and triton_available() and isinstance(scale, torch.Tensor) and not interpret_mode():
        return quantize_kernel(x, scale)
    return quantize(x, scale)


def dynamic_scale(x: torch.Tensor) -> torch.Tensor:
    """This tensor's own per-tensor scale, as a float32 scalar on its device (no host sync)."""
    return (x.detach().abs().amax().float() / FP8_MAX).clamp(min=_TINY).reshape(())


class Fp8Linear(nn.Linear):
    """`nn.Linear` whose product runs with an E4M3 weight (and E4M3 activations unless weight-only).

    `Fp8Linear(linear, weight_scale=None, input_scale=None, activations="dynamic", backend="auto")`.
    `weight_scale`: calibration's weight amax / 448, else the weight's own amax / 448. `input_scale`:
    calibration's input amax / 448 (needed by activations="static"). in_features and out_features
    must be multiples of 16 (torch._scaled_mm's constraint; checked on every device so a model that
    converts on CPU also converts on the GPU).
    """

    def __init__(self, linear: nn.Linear, weight_scale: float | None = None, input_scale: float | None = None,
                 activations: str = "dynamic", backend: str = "auto") -> None:
        nn.Module.__init__(self)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Fp8Linear wraps an nn.Linear, got {type(linear).__name__}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"fp8 activations {activations!r}: choose one of {ACTIVATIONS}")
        k, n = linear.in_features, linear.out_features
        if k % 16 or n % 16:
            raise ValueError(f"fp8 linear ({k} -> {n}): in_features and out_features must be multiples of 16 "
                             "(torch._scaled_mm needs K and N divisible by 16); keep this layer in bf16")
        if not linear.weight.dtype.is_floating_point or linear.weight.dtype == FP8_DTYPE:
            raise ValueError(f"fp8 linear: the source weight must be a float tensor, got {linear.weight.dtype}")
        if activations == "static" and input_scale is None:
            raise ValueError("fp8 activations='static' needs input_scale (from calibration); use 'dynamic' without one")
        self.in_features, self.out_features = k, n
        # the same Parameters (not copies): the state dict and a checkpoint written from it are unchanged
        self.register_parameter("weight", linear.weight)
        self.register_parameter("bias", linear.bias)
        self.activations = activations
        dev = linear.weight.device
        scale = weight_scale if weight_scale is not None else weight_scale_of(linear.weight)
        if not scale > 0:
            raise ValueError(f"fp8 weight scale must be positive, got {scale}")
        with torch.no_grad():
            self.register_buffer("weight_fp8", quantize(linear.weight, scale).contiguous(), persistent=False)
        self.register_buffer("weight_scale", torch.tensor(float(scale), dtype=torch.float32, device=dev),
                             persistent=False)
        self.register_buffer("input_scale", None if input_scale is None else
                             torch.tensor(max(float(input_scale), _TINY), dtype=torch.float32, device=dev),
                             persistent=False)
        self.requested_backend = backend
        self.backend = select_backend(dev, backend, activations)

    def _apply(self, fn, *args, **kwargs):  # .to(device) / .cuda(): choose the path for the new device
        out = super()._apply(fn, *args, **kwargs)
        self.backend = select_backend(self.weight_fp8.device, self.requested_backend, self.activations)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8=e4m3, activations={self.activations}, backend={self.backend}")

    def _input_scale(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == "static":
            return self.input_scale
        return dynamic_scale(x)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight_fp8.to(dtype) * self.weight_scale.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_fp8.dtype != FP8_DTYPE:
            raise RuntimeError("this Fp8Linear's fp8 weight was cast (by .to() / .float() on the model); call "
                               "layers.fp8.remove_fp8(model) before casting, then convert again")
        if torch.is_grad_enabled() and x.requires_grad:
            return _Fp8LinearFn.apply(x, self)  # exact RTC guidance takes a VJP through the expert
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "scaled_mm":
            return self.forward_scaled_mm(x)
        return self.forward_reference(x)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Plain torch, any device: the same rounding as the fp8 GEMM (up to accumulation order
        and the dequantised weight's rounding to the activation dtype)."""
        if self.activations != "none":
            s = self._input_scale(x)
            x = (quantize(x, s).to(x.dtype) * s.to(x.dtype))
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def forward_scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"fp8 linear expects {self.in_features} input features, got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        s = self._input_scale(x2)
        xq = quantize_fast(x2, s).contiguous()  # row-major (M, K)
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
        fused_bias = self.bias is not None and out_dtype != torch.float32
        out = torch._scaled_mm(xq, self.weight_fp8.t(), scale_a=s, scale_b=self.weight_scale,
                               bias=self.bias.to(out_dtype) if fused_bias else None, out_dtype=out_dtype)
        if self.bias is not None and not fused_bias:
            out = out + self.bias.to(out_dtype)  # _scaled_mm takes no bias with a float32 output
        return out.to(x.dtype).reshape(*lead, self.out_features)


class _Fp8LinearFn(torch.autograd.Function):
    """The fp8 product forward; backward is the input gradient through the dequantised weight
    (straight-through for the activation rounding, whose own derivative is zero almost
    everywhere; `_scaled_mm` has no autograd formula, and casting a gradient to E4M3 without a
    scale would flush it). Weights are frozen: no weight or bias gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:  # type: ignore[override]
        ctx.layer = layer
        with torch.no_grad():
            return layer._forward(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad @ ctx.layer.dequantized_weight(grad.dtype), None


# -- converting a model ----------------------------------------------------------------------
def _scale_for(scales: Mapping[str, Mapping[str, float]] | None, names: list[str], key: str) -> float | None:
    """The largest scale of `names` (a fused linear's parts) in the calibration's table, or None."""
    if not scales:
        return None
    found = [scales[n][key] for n in names if n in scales and key in scales[n]]
    return max(found) if len(found) == len(names) else None


def _targets(model: nn.Module, scope: str) -> Iterator[tuple[str, nn.Module, str, nn.Linear, list[str], bool]]:
    """(full name, owner, attribute, linear, names of the calibrated linears it covers, fused?)."""
    if scope not in SCOPES:
        raise ValueError(f"fp8 scope {scope!r}: choose one of {tuple(SCOPES)}")
    for root_name in SCOPES[scope]:
        root = model.get_submodule(root_name)
        if isinstance(root, nn.Linear):  # a scope that is one linear (the projector)
            owner_name, _, attr = root_name.rpartition(".")
            yield root_name, model.get_submodule(owner_name), attr, root, [root_name], False
            continue
        for sub_name, owner in root.named_modules():
            if isinstance(owner, nn.Linear):
                continue
            owner_name = f"{root_name}.{sub_name}" if sub_name else root_name
            fused_parts: set[str] = set()
            for attr, parts in FUSED_PARTS.items():
                lin = owner.__dict__.get(attr)
                if isinstance(lin, nn.Linear):
                    fused_parts.update(parts)
                    yield f"{owner_name}.{attr}", owner, attr, lin, [f"{owner_name}.{p}" for p in parts], True
            for attr, lin in owner.named_children():
                if isinstance(lin, nn.Linear) and attr in _PROJECTIONS and attr not in fused_parts:
                    yield f"{owner_name}.{attr}", owner, attr, lin, [f"{owner_name}.{attr}"], False


def convert_fp8(model: nn.Module, scope: str = "expert", scales: Mapping[str, Mapping[str, float]] | None = None,
                activations: str | None = None, backend: str = "auto") -> int:
    """Swap the attention and MLP linears under `scope` ("expert", "prefix", "all") for
    `Fp8Linear`s, in place. Call after the model has its final dtype and device, and after
    `fuse_projections` (fused QKV / gate-up become one fp8 GEMM each). `scales`: the calibration
    table (`calibration.fp8.load_scales`), keyed by the unfused linears' names; a fused linear
    takes the largest of its parts' scales. `activations`: default "static" with scales, else
    "dynamic". Returns how many linears were converted."""
    from phyai_edge.layers.fused import attach_unregistered

    act = activations or ("static" if scales else "dynamic")
    count = 0
    for name, owner, attr, lin, names, fused in list(_targets(model, scope)):
        if isinstance(lin, Fp8Linear):
            continue
        w_scale = _scale_for(scales, names, "weight_scale")
        i_scale = _scale_for(scales, names, "input_scale")
        this_act = act
        if act == "static" and i_scale is None:
            this_act = "dynamic"  # a linear the calibration never saw: scale each call instead
        try:
            fp8 = Fp8Linear(lin, w_scale, i_scale, this_act, backend)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        if fused:
            attach_unregistered(owner, attr, fp8)
        else:
            setattr(owner, attr, fp8)
        count += 1
    return count


def remove_fp8(model: nn.Module) -> int:
    """Put plain `nn.Linear`s (the same weight and bias Parameters) back where `convert_fp8`
    put registered Fp8Linears; fused ones are dropped by `unfuse_projections`. Returns how many."""
    count = 0
    for owner in list(model.modules()):
        for attr, child in list(owner.named_children()):
            if isinstance(child, Fp8Linear):
                plain = nn.Linear.__new__(nn.Linear)
                nn.Module.__init__(plain)
                plain.in_features, plain.out_features = child.in_features, child.out_features
                plain.register_parameter("weight", child.weight)
                plain.register_parameter("bias", child.bias)
                setattr(owner, attr, plain)
                count += 1
    return count


def fp8_linears(model: nn.Module) -> list[Fp8Linear]:
    """Every Fp8Linear in the model, registered or attached as a fused projection."""
    found: list[Fp8Linear] = []
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            found.append(m)
        for attr in FUSED_PARTS:
            v = m.__dict__.get(attr)
            if isinstance(v, Fp8Linear):
                found.append(v)
    return found
