"""Fused Triton kernels for the elementwise chains of PI0.5's action expert, Gemma prefix and SigLIP
vision tower, each beside its plain-torch reference, and the dispatcher that chooses between them.

At batch 1 a PI0.5 denoise step (18 adaptive Gemma layers over 50 tokens) is bound by the number
of small kernels, not by bytes or FLOPs (`benchmarks/RESULTS.md`, "PI0.5 on the H200"). Between
the GEMMs and the attention, each layer runs chains of tiny elementwise ops; these kernels do
each chain in one launch, one program per row (a row of 1024 fits one block):

- `ada_rms_norm`: adaptive RMSNorm + modulation, `normed * (1 + scale) + shift`, statistics in
  float32, output in the activation dtype (eager: ~10 kernels).
- `residual_ada_rms_norm`: the gated residual `x + y * gate` fused with the *next* adaptive
  RMSNorm; writes the new residual and the next op's normed input (eager: ~12 kernels).
- `qkv_rope`: rotary embedding on q and k straight out of the fused QKV GEMM's output
  (split + rotate-half + cast, written as contiguous (B, H, T, D)); v stays a view
  (eager: ~14 kernels, the transposes' copies included). Or into buffers the caller gives (any
  strides), v copied there in the same kernel.
- `geglu`: `gelu_tanh(gate) * up` from the fused gate/up GEMM's output (eager: 2-3 kernels).
- attention: split-KV over the cached prefix and the step's own keys without concatenating them
  (`layers.triton_attention`).
- `layer_norm` / `residual_layer_norm`: SigLIP's LayerNorm (statistics, weight and bias in
  float32, one cast back), alone or fused with the residual add before it; writes the new
  residual and the normed input (eager in bf16: the add, a cast up, the norm, a cast down). Narrow
  rows share a program.
- `bias_gelu`: GELU (tanh) on SigLIP's fc1 output, with an optional bias. The vision stack passes
  none: cuBLAS already adds the bias in the GEMM's epilogue (the H200 profile's vision GEMMs are
  `nvjet_*_bias_*` kernels, four a block), so the op replaces one kernel with one.

The stacks of blocks that run on these ops (PI0.5's expert, prefix and vision tower) are in
`layers.fused_stacks`.

Dispatch (`backend`): "reference" (the default: plain torch, everywhere), "triton" (the kernels;
an error where they cannot run) or "auto" (the kernels on CUDA when triton is installed, or on
any device under `TRITON_INTERPRET=1`; else the reference). A call whose inputs need a gradient
(exact RTC guidance takes a vector-Jacobian product through the step) runs the kernel under an
autograd function whose backward is a kernel too (`layers.triton_grad`: `ada_rms_norm`,
`residual_ada_rms_norm`, `qkv_rope`, `geglu`, the split attention), for the gradients of the
activations; a gradient for a modulation, the rotary tables or through `out=` buffers takes the
reference, which autograd differentiates, as do the other ops here.

Status: tested against the references on CPU under `TRITON_INTERPRET=1`
(`tests/test_triton_ops.py`); all of them compiled and timed on an H200 (`benchmarks/RESULTS.md`:
with the split-KV attention a batch-1 PI0.5 chunk 48.4 -> 18.5 ms under CUDA graphs; the SigLIP
stack took the vision stage 4.09 -> 2.31 ms at batch 1, 70.7 -> 38.9 ms at batch 32).

This module imports without triton installed: the references and the dispatcher work, and the
kernels are simply absent (`triton_available()` is False).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from phyai_edge.layers import triton_grad
from phyai_edge.layers.mlp import gelu_tanh
from phyai_edge.layers.norm import ada_rms_norm_ref, layer_norm_ref
from phyai_edge.layers.rotary import apply_rope
from phyai_edge.layers.triton_dispatch import (  # noqa: F401  (re-exported: the ops' public dispatch API)
    BACKENDS,
    _block,
    _per_batch,
    _row_warps,
    _rows,
    _use_triton,
    interpret_mode,
    launch_options,
    needs_grad,
    resolve_backend,
    tl,
    triton,
    triton_available,
    triton_status,
)


def _empty(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """Every kernel output is allocated here (the tests poison it to check it is fully written)."""
    return torch.empty(tuple(shape), dtype=like.dtype, device=like.device)


@dataclass(frozen=True)
class SplitSums:
    """A split-K GEMM's float32 partial sums (splits, rows, N), not yet added (`triton_gemm.linear(
    ..., defer_sum=True)`). A consumer adds them in split order and rounds to `dtype`, exactly as
    the GEMM's own reducing kernel would (`total`); `residual_ada_rms_norm` does it inside its
    kernel, which saves the reducing kernel's launch (one a projection, two a layer)."""

    parts: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype

    def total(self) -> torch.Tensor:
        acc = self.parts[0].clone()
        for s in range(1, self.parts.shape[0]):  # split order, as the reducing kernel adds
            acc += self.parts[s]
        return acc.to(self.dtype).view(self.shape)


@dataclass(frozen=True)
class FoldedNorm:
    """An adaptive RMS norm of a residual r left for the GEMM that reads it to finish (the batch-1
    small-M GEMMs of `triton_gemm`, `norm=`). Instead of rms_norm(r) (1 + scale) + shift, its
    producer writes u = r (1 + scale) in r's dtype and float32 sums of r^2 per row, one column per
    column tile it wrote (`stats` (rows, tiles)); the consumer GEMM scales each row of its float32
    product u W^T by rsqrt(sum / width + eps) and adds shift W^T (a vector per flow step, tabulated
    once: `fused_stacks.fold_modulation`). The row factor and the shift pass through the product
    linearly, so this is the norm's result up to rounding (u is rounded where the normed value
    was); what it saves is the norm's kernel between the two GEMMs."""

    u: torch.Tensor
    stats: torch.Tensor
    eps: float

    def rstd(self) -> torch.Tensor:
        """(rows,) float32: 1 / rms of each row of r."""
        return torch.rsqrt(self.stats.sum(-1) / self.u.shape[-1] + self.eps)


# -- references -----------------------------------------------------------------------------------
def ada_rms_fold_ref(x: torch.Tensor, scale: torch.Tensor, eps: float) -> FoldedNorm:
    """`FoldedNorm` of x (B, T, N) for an adaptive norm with `scale` (B or 1, 1, N)."""
    xf = x.float()
    return FoldedNorm((xf * (1.0 + scale.float())).to(x.dtype), (xf * xf).sum(-1).reshape(-1, 1), float(eps))


def residual_ref(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`GemmaBlock._residual` with a gate, in the residual's dtype."""
    return x + y * gate.to(x.dtype)


def residual_ada_rms_norm_ref(
    x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    r = residual_ref(x, y, gate)
    return r, ada_rms_norm_ref(r, scale, shift, eps)


def qkv_rope_ref(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`GemmaAttention.qkv` after its projection: qkv (B, T, (H + 2 Hkv) D) -> q (B, H, T, D),
    k, v (B, Hkv, T, D), RoPE on q and k (`layers.rotary.apply_rope`)."""
    b, t, _ = qkv.shape
    nq, nkv = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
    q = q.reshape(b, t, num_heads, head_dim).transpose(1, 2)
    k = k.reshape(b, t, num_kv_heads, head_dim).transpose(1, 2)
    v = v.reshape(b, t, num_kv_heads, head_dim).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def geglu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """`GatedMLP`'s activation on the fused gate/up output (gate first, then up)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return gelu_tanh(gate) * up


def residual_layer_norm_ref(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`SiglipBlock`'s residual `x + y`, then the next LayerNorm on it: (r, normed r)."""
    r = x + y
    return r, layer_norm_ref(r, weight, bias, eps)


def bias_gelu_ref(y: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`GeluMLP`'s activation, gelu_tanh(y + bias), in y.dtype."""
    return gelu_tanh(y if bias is None else y + bias.to(y.dtype))


# -- kernels --------------------------------------------------------------------------------------
if triton is not None:
    from phyai_edge.layers.triton_dispatch import pdl_enter
    from phyai_edge.layers.triton_math import _gelu_tanh, _rope, _token_heads

    @triton.jit
    def _residual_ada_norm_kernel(
        x_ptr, y_ptr, gate_ptr, scale_ptr, shift_ptr, res_ptr, out_ptr, stats_ptr,
        n_cols, rows_per_batch, eps,
        stride_x, stride_y, stride_res, stride_out,
        stride_gate_b, stride_scale_b, stride_shift_b, stride_y_split,
        HAS_RESIDUAL: tl.constexpr, Y_SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
        FOLD: tl.constexpr,
    ):
        pdl_enter(PDL)
        row = tl.program_id(0)
        b = row // rows_per_batch
        cols = tl.arange(0, BLOCK)
        m = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            if Y_SPLITS > 0:  # y as a split-K GEMM's float32 partials: add, round as its reduce would
                y = tl.zeros([BLOCK], tl.float32)
                for s in tl.static_range(Y_SPLITS):
                    y += tl.load(y_ptr + s * stride_y_split + row * stride_y + cols, mask=m, other=0.0)
                y = y.to(res_ptr.dtype.element_ty).to(tl.float32)
            else:
                y = tl.load(y_ptr + row * stride_y + cols, mask=m, other=0.0).to(tl.float32)
            g = tl.load(gate_ptr + b * stride_gate_b + cols, mask=m, other=0.0).to(tl.float32)
            r = (x + y * g).to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + row * stride_res + cols, r, mask=m)
            x = r.to(tl.float32)  # normalise the residual as stored (rounded), as the reference does
        sc = tl.load(scale_ptr + b * stride_scale_b + cols, mask=m, other=0.0).to(tl.float32)
        if FOLD:  # the norm left to the next GEMM (`FoldedNorm`): x (1 + scale) and the row's sum of squares
            tl.store(out_ptr + row * stride_out + cols, (x * (1.0 + sc)).to(out_ptr.dtype.element_ty), mask=m)
            tl.store(stats_ptr + row, tl.sum(x * x, axis=0))
        else:
            # float32 explicitly: under torch.compile a Python float argument arrives as fp64.
            inv = tl.rsqrt((tl.sum(x * x, axis=0) / n_cols + eps).to(tl.float32))
            sh = tl.load(shift_ptr + b * stride_shift_b + cols, mask=m, other=0.0).to(tl.float32)
            out = x * inv * (1.0 + sc) + sh
            tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _qkv_rope_kernel(
        qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
        seq_len, num_heads, num_kv_heads,
        stride_qkv_b, stride_qkv_t, stride_cs_b, stride_cs_t, stride_sn_b, stride_sn_t,
        stride_q_b, stride_q_h, stride_q_t, stride_k_b, stride_k_h, stride_k_t, stride_v_b, stride_v_h, stride_v_t,
        HALF: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr, WRITE_V: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_enter(PDL)
        # One program per token, all its q and k heads (and v's with WRITE_V) as one (HEADS, BLOCK)
        # tile: the token's cos / sin are read once, not once per head. (One program per
        # (token, head) ran at about half the bandwidth: 134 vs 65 us at the batch-32 prefix's
        # 26112 tokens, H200.)
        b, t, heads, cols, m, is_q, is_k, qh, kh = _token_heads(seq_len, num_heads, num_kv_heads, HALF, BLOCK, HEADS)
        src = qkv_ptr + b * stride_qkv_b + t * stride_qkv_t + heads * (2 * HALF) + cols
        x1 = tl.load(src, mask=m & (is_q | is_k), other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=m & (is_q | is_k), other=0.0).to(tl.float32)
        cs = cos_ptr + b * stride_cs_b + t * stride_cs_t + cols
        sn = sin_ptr + b * stride_sn_b + t * stride_sn_t + cols
        o1, o2 = _rope(x1, x2, cs, sn, m, HALF)
        dst_q = q_ptr + b * stride_q_b + qh * stride_q_h + t * stride_q_t + cols
        dst_k = k_ptr + b * stride_k_b + kh * stride_k_h + t * stride_k_t + cols
        tl.store(dst_q, o1.to(q_ptr.dtype.element_ty), mask=m & is_q)
        tl.store(dst_q + HALF, o2.to(q_ptr.dtype.element_ty), mask=m & is_q)
        tl.store(dst_k, o1.to(k_ptr.dtype.element_ty), mask=m & is_k)
        tl.store(dst_k + HALF, o2.to(k_ptr.dtype.element_ty), mask=m & is_k)
        if WRITE_V:  # v copied as it is (no rotation) into a buffer of the caller's
            is_v = (heads >= num_heads + num_kv_heads) & (heads < num_heads + 2 * num_kv_heads)
            y1 = tl.load(src, mask=m & is_v, other=0.0)
            y2 = tl.load(src + HALF, mask=m & is_v, other=0.0)
            vh = tl.maximum(heads - num_heads - num_kv_heads, 0)
            dst_v = v_ptr + b * stride_v_b + vh * stride_v_h + t * stride_v_t + cols
            tl.store(dst_v, y1.to(v_ptr.dtype.element_ty), mask=m & is_v)
            tl.store(dst_v + HALF, y2.to(v_ptr.dtype.element_ty), mask=m & is_v)

    @triton.jit
    def _geglu_kernel(gu_ptr, out_ptr, hidden, stride_in, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < hidden
        g = tl.load(gu_ptr + row * stride_in + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_in + hidden + cols, mask=m, other=0.0).to(tl.float32)
        out = _gelu_tanh(g) * u
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _residual_layer_norm_kernel(
        x_ptr, y_ptr, w_ptr, b_ptr, res_ptr, out_ptr,
        n_rows, n_cols, eps,
        stride_x, stride_y, stride_res, stride_out,
        HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
        ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_enter(PDL)
        # ROWS rows per program, each whole in registers; int64: rows * stride passes 2**31 elements
        # at large batches.
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        m = (rows < n_rows) & (cols < n_cols)
        x = tl.load(x_ptr + rows * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            y = tl.load(y_ptr + rows * stride_y + cols, mask=m, other=0.0).to(tl.float32)
            r = (x + y).to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + rows * stride_res + cols, r, mask=m)
            x = r.to(tl.float32)  # normalise the residual as stored (rounded), as the reference does
        # Two passes over the row held in registers (mean, then the centred square), not
        # E[x^2] - mean^2: that cancels badly when |mean| >> std, as in residual streams.
        mean = tl.sum(x, axis=1)[:, None] / n_cols
        d = tl.where(m, x - mean, 0.0)
        # float32 explicitly: under torch.compile a Python float argument arrives as fp64.
        rstd = tl.rsqrt((tl.sum(d * d, axis=1)[:, None] / n_cols + eps).to(tl.float32))
        out = d * rstd
        if HAS_WEIGHT:
            out = out * tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        if HAS_BIAS:
            out = out + tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _bias_gelu_kernel(y_ptr, b_ptr, out_ptr, total, n_cols, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        # over the flat (contiguous) tensor: no row boundary to respect but the bias's column
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < total
        g = tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            g = g + tl.load(b_ptr + offs % n_cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, _gelu_tanh(g).to(out_ptr.dtype.element_ty), mask=m)


def _residual_ada_norm_triton(x, y, gate, scale, shift, eps, fold=False):
    b, n = x.shape[0], x.shape[-1]
    rows_per_batch = x[0].numel() // n
    x2 = _rows(x, n)
    out = _empty(x.shape, x)
    out2 = out.view(-1, n)
    sc, s_sc = _per_batch(scale, b, n)
    sh, s_sh = _per_batch(shift, b, n)
    splits, s_split = 0, 0
    if isinstance(y, SplitSums):
        if y.parts.shape[1:] != x2.shape or y.parts.stride(-1) != 1:
            raise ValueError(f"split sums of shape {tuple(y.parts.shape)} for a residual of {tuple(x2.shape)}")
        splits, s_split = y.parts.shape[0], y.parts.stride(0)
        y2 = y.parts[0]  # the first split's rows; the kernel steps to the others by s_split
    elif y is not None:
        y2 = _rows(y, n)
    if y is not None:
        g, s_g = _per_batch(gate, b, n)
        res = _empty(x.shape, x)
        res2 = res.view(-1, n)
        sy, sres = y2.stride(0), res2.stride(0)
    else:  # unused pointers: anything valid
        y2, g, res, res2, s_g, sy, sres = x2, sc, None, out2, 0, 0, 0
    stats = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device) if fold else out2
    _residual_ada_norm_kernel[(x2.shape[0],)](
        x2, y2, g, sc, sh, res2, out2, stats,
        n, rows_per_batch, float(eps),
        x2.stride(0), sy, sres, out2.stride(0),
        s_g, s_sc, s_sh, s_split,
        HAS_RESIDUAL=y is not None, Y_SPLITS=splits, BLOCK=_block(n), FOLD=fold, **launch_options(x2),
    )
    return res, (FoldedNorm(out, stats, float(eps)) if fold else out)


def _layer_norm_triton(x, y, weight, bias, eps):
    n = x.shape[-1]
    x2 = _rows(x, n)
    out = _empty(x.shape, x)
    out2 = out.view(-1, n)
    if y is not None:
        if y.shape != x.shape or y.dtype != x.dtype:
            raise ValueError(f"residual_layer_norm: y {tuple(y.shape)} {y.dtype} must match x "
                             f"{tuple(x.shape)} {x.dtype}")
        y2 = _rows(y, n)
        res = _empty(x.shape, x)
        res2 = res.view(-1, n)
    else:  # unused pointers: anything valid
        y2, res, res2 = x2, None, out2
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != (n,):
            raise ValueError(f"layer norm {name} of shape {tuple(p.shape)} for width {n}")
    w = weight.contiguous() if weight is not None else x2
    b = bias.contiguous() if bias is not None else x2
    block = _block(n)
    # Narrow rows share a program (up to 2048 elements): a row of a few dozen would leave most of
    # a program's threads idle. SigLIP's 1152 (block 2048) is one row per program.
    rows = max(1, 2048 // block)
    _residual_layer_norm_kernel[(triton.cdiv(x2.shape[0], rows),)](
        x2, y2, w, b, res2, out2,
        x2.shape[0], n, float(eps),
        x2.stride(0), y2.stride(0), res2.stride(0), out2.stride(0),
        HAS_RESIDUAL=y is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        ROWS=rows, BLOCK=block, num_warps=_row_warps(rows * block), **launch_options(x2),
    )
    return res, out


# -- the ops (dispatched) -------------------------------------------------------------------------
def ada_rms_norm(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float, backend: str = "reference"
) -> torch.Tensor:
    """x (B, T, N); scale, shift (B or 1, 1, N) -> rms_norm(x) * (1 + scale) + shift in x.dtype."""
    # The kernel's backward gives x's gradient; one for the modulation is the reference's.
    if needs_grad(scale, shift) or not _use_triton(backend, x, scale, shift, differentiable=True):
        return ada_rms_norm_ref(x, scale, shift, eps)
    if needs_grad(x):
        return AdaRmsNormFn.apply(x, scale, shift, eps)
    return _residual_ada_norm_triton(x, None, None, scale, shift, eps)[1]


def ada_rms_fold(x: torch.Tensor, scale: torch.Tensor, eps: float, backend: str = "reference") -> FoldedNorm:
    """The adaptive norm of x (B, T, N) left folded for the next GEMM (`FoldedNorm`); no gradient."""
    if needs_grad(x, scale) or not _use_triton(backend, x, scale):
        return ada_rms_fold_ref(x, scale, eps)
    return _residual_ada_norm_triton(x, None, None, scale, scale, eps, fold=True)[1]


def residual_ada_rms_norm(
    x: torch.Tensor,
    y: torch.Tensor | SplitSums,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float,
    backend: str = "reference",
) -> tuple[torch.Tensor, torch.Tensor]:
    """r = x + y * gate (the gated residual, in x.dtype), then ada_rms_norm(r, scale, shift):
    returns (r, normed r). x, y (B, T, N); gate, scale, shift (B or 1, 1, N). y may be a split-K
    GEMM's unreduced `SplitSums`: added here as its reducing kernel would (same result)."""
    if isinstance(y, SplitSums) and y.dtype != x.dtype:  # the kernel rounds the sum to x's dtype
        y = y.total()
    yt = y.parts if isinstance(y, SplitSums) else y
    if needs_grad(gate, scale, shift) or not _use_triton(backend, x, yt, gate, scale, shift, differentiable=True):
        return residual_ada_rms_norm_ref(x, y.total() if isinstance(y, SplitSums) else y, gate, scale, shift, eps)
    if needs_grad(x, yt):
        return ResidualAdaRmsNormFn.apply(x, y.total() if isinstance(y, SplitSums) else y, gate, scale, shift, eps)
    return _residual_ada_norm_triton(x, y, gate, scale, shift, eps)


def qkv_rope(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    backend: str = "reference",
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `qkv_rope_ref`; cos, sin (B or 1, 1, T, D) as `rope_cos_sin` makes them.

    `out`: (q, k, v) buffers shaped (B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, D), any strides with a
    unit last one (a (B, T, H, D) buffer seen transposed; the free positions of a KV cache with
    room for the step's own keys), written and returned; v is then a copy too (in the same kernel)."""
    b, t, _ = qkv.shape
    if out is not None:
        _check_qkv_out(out, b, t, num_heads, num_kv_heads, head_dim, qkv.dtype)
    # The kernel's backward gives qkv's gradient; a gradient for the tables, or through buffers
    # written in place, is the reference's.
    if (needs_grad(cos, sin) or (out is not None and needs_grad(qkv))
            or not _use_triton(backend, qkv, cos, sin, differentiable=True)):
        q, k, v = qkv_rope_ref(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
        if out is None:
            return q, k, v
        return out[0].copy_(q), out[1].copy_(k), out[2].copy_(v)
    if needs_grad(qkv):
        return QkvRopeFn.apply(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
    return _qkv_rope_triton(qkv, cos, sin, num_heads, num_kv_heads, head_dim, out)


def _qkv_rope_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                     head_dim: int, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, t, width = qkv.shape
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    if width != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv width {width} != (heads + 2 kv heads) * head_dim")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    nq, nkv = num_heads * head_dim, num_kv_heads * head_dim
    if out is None:
        q = _empty((b, num_heads, t, head_dim), qkv)
        k = _empty((b, num_kv_heads, t, head_dim), qkv)
        v = qkv[..., nq + nkv :].reshape(b, t, num_kv_heads, head_dim).transpose(1, 2)
    else:
        q, k, v = out
    cos3, sin3 = cos.reshape(cos.shape[0], t, head_dim), sin.reshape(sin.shape[0], t, head_dim)
    if cos3.stride(-1) != 1:
        cos3 = cos3.contiguous()
    if sin3.stride(-1) != 1:
        sin3 = sin3.contiguous()
    for c in (cos3, sin3):
        if c.shape[0] not in (1, b):
            raise ValueError(f"cos/sin batch {c.shape[0]} does not broadcast over batch {b}")
    half = head_dim // 2
    heads = num_heads + (2 if out is not None else 1) * num_kv_heads
    _qkv_rope_kernel[(b * t,)](
        qkv, cos3, sin3, q, k, v,
        t, num_heads, num_kv_heads,
        qkv.stride(0), qkv.stride(1),
        cos3.stride(0) if cos3.shape[0] > 1 else 0, cos3.stride(1),
        sin3.stride(0) if sin3.shape[0] > 1 else 0, sin3.stride(1),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        HALF=half, BLOCK=_block(half), HEADS=triton.next_power_of_2(heads), WRITE_V=out is not None,
        num_warps=_row_warps(half * heads), **launch_options(qkv),
    )
    return q, k, v


def check_out_buffer(label: str, buf: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> None:
    """A ValueError starting with `label` unless `buf`, a buffer a kernel writes through its
    strides, has this shape and dtype and a unit last stride (any other strides: a slice of a
    larger cache, a transposed view)."""
    if tuple(buf.shape) != tuple(shape) or buf.dtype != dtype or buf.stride(-1) != 1:
        raise ValueError(f"{label}: a {tuple(shape)} {dtype} tensor with a unit last stride expected, got "
                         f"{tuple(buf.shape)} {buf.dtype} with strides {buf.stride()}")


def _check_qkv_out(out: tuple[torch.Tensor, ...], b: int, t: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, dtype: torch.dtype) -> None:
    """A ValueError naming the first of `qkv_rope`'s output buffers that is not a (B, heads, T, D)
    tensor of `dtype` with a unit last stride."""
    if len(out) != 3:
        raise ValueError(f"qkv_rope out: (q, k, v) expected, got {len(out)} tensors")
    for name, buf, heads in zip("qkv", out, (num_heads, num_kv_heads, num_kv_heads)):
        check_out_buffer(f"qkv_rope out {name}", buf, (b, heads, t, head_dim), dtype)


def geglu(gate_up: torch.Tensor, backend: str = "reference") -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up (..., 2 H) = cat([gate, up], -1) -> (..., H)."""
    if not _use_triton(backend, gate_up, differentiable=True):
        return geglu_ref(gate_up)
    if needs_grad(gate_up):
        return GegluFn.apply(gate_up)
    return _geglu_triton(gate_up)


def _geglu_triton(gate_up: torch.Tensor) -> torch.Tensor:
    hidden = gate_up.shape[-1] // 2
    gu = _rows(gate_up, 2 * hidden)
    out = _empty((*gate_up.shape[:-1], hidden), gate_up)
    out2 = out.view(-1, hidden)
    block = min(1024, _block(hidden))
    _geglu_kernel[(gu.shape[0], triton.cdiv(hidden, block))](
        gu, out2, hidden, gu.stride(0), out2.stride(0), BLOCK=block, **launch_options(gu)
    )
    return out


def _present(*tensors: torch.Tensor | None) -> list[torch.Tensor]:
    return [t for t in tensors if t is not None]


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, backend: str = "reference"
) -> torch.Tensor:
    """LayerNorm of x (..., N) over its last axis, statistics, weight and bias in float32, output in
    x.dtype (`layers.norm.layer_norm_ref`)."""
    if not _use_triton(backend, x, *_present(weight, bias)):
        return layer_norm_ref(x, weight, bias, eps)
    return _layer_norm_triton(x, None, weight, bias, eps)[1]


def residual_layer_norm(
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    backend: str = "reference",
) -> tuple[torch.Tensor, torch.Tensor]:
    """r = x + y (x, y (..., N) of one dtype), then layer_norm(r): returns (r, normed r), both in
    x.dtype."""
    if not _use_triton(backend, x, y, *_present(weight, bias)):
        return residual_layer_norm_ref(x, y, weight, bias, eps)
    return _layer_norm_triton(x, y, weight, bias, eps)


def bias_gelu(y: torch.Tensor, bias: torch.Tensor | None = None, backend: str = "reference") -> torch.Tensor:
    """gelu_tanh(y + bias) for y (..., N) and bias (N,) or None, in y.dtype. The sum stays in
    float32 (the reference rounds it to y.dtype before the GELU)."""
    if not _use_triton(backend, y, *_present(bias)):
        return bias_gelu_ref(y, bias)
    n = y.shape[-1]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias of shape {tuple(bias.shape)} for width {n}")
    src = y if y.is_contiguous() else y.contiguous()
    out = _empty(y.shape, y)
    block = 1024
    _bias_gelu_kernel[(triton.cdiv(src.numel(), block),)](
        src, bias.contiguous() if bias is not None else src, out, src.numel(), n,
        HAS_BIAS=bias is not None, BLOCK=block, **launch_options(src),
    )
    return out


# -- autograd functions: the kernels above, differentiated by `layers.triton_grad`'s kernels ------
class AdaRmsNormFn(torch.autograd.Function):
    """`triton_ops.ada_rms_norm` on its kernel, differentiable in x."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, scale)
        ctx.eps = eps
        return _residual_ada_norm_triton(x, None, None, scale, shift, eps)[1]

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, scale = ctx.saved_tensors
        dx, _ = triton_grad.ada_norm_grad(x, dh, None, scale, None, ctx.eps)
        return dx, None, None, None


class ResidualAdaRmsNormFn(torch.autograd.Function):
    """`triton_ops.residual_ada_rms_norm` on its kernel, differentiable in x and y."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor,
                shift: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        res, out = _residual_ada_norm_triton(x, y, gate, scale, shift, eps)
        ctx.save_for_backward(res, gate, scale)
        ctx.eps, ctx.y_dtype = eps, y.dtype
        # The last block's residual feeds nothing: its gradient arrives as None, not as zeros.
        ctx.set_materialize_grads(False)
        return res, out

    @staticmethod
    def backward(ctx: Any, dres: torch.Tensor | None, dh: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        res, gate, scale = ctx.saved_tensors
        if dh is None:
            dh = torch.zeros_like(res)
        dx, dy = triton_grad.ada_norm_grad(res, dh, dres, scale, gate, ctx.eps, ctx.y_dtype)
        return dx, dy, None, None, None, None


class QkvRopeFn(torch.autograd.Function):
    """`triton_ops.qkv_rope` on its kernel, differentiable in the packed qkv."""

    @staticmethod
    def forward(ctx: Any, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = qkv.shape
        # v written by the kernel too, not handed back as a view of qkv (an autograd function's
        # output viewing its input would be tied to that input's version).
        out = tuple(_empty((b, heads, t, head_dim), qkv) for heads in (num_heads, num_kv_heads, num_kv_heads))
        ctx.save_for_backward(cos, sin)
        ctx.dtype = qkv.dtype
        return _qkv_rope_triton(qkv, cos, sin, num_heads, num_kv_heads, head_dim, out)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        return triton_grad.rope_grad(dq, dk, dv, cos, sin, ctx.dtype), None, None, None, None, None


class GegluFn(torch.autograd.Function):
    """`triton_ops.geglu` on its kernel, differentiable in gate_up."""

    @staticmethod
    def forward(ctx: Any, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        return _geglu_triton(gate_up)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> torch.Tensor:
        (gate_up,) = ctx.saved_tensors
        return triton_grad.geglu_grad(gate_up, dout)
