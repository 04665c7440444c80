"""Batch-1 adaptive norms folded into the small-M GEMMs around them (`triton_ops.FoldedNorm`): the
GEMMs that produce a folded norm and the one that finishes it outside a Gemma block.

An adaptive RMS norm only ever feeds a linear layer, and rms_norm(r) (1 + scale) + shift = rstd(r) *
r (1 + scale) + shift with rstd a per-row scalar, so the producer writes u = r (1 + scale) and per-row
sums of r^2 and the consumer GEMM computes (u W^T) rstd + shift W^T (shift W^T tabulated once per
flow time: `fused_stacks.fold_shift`). Here:

- `linear_residual_fold`: o_proj / down with the gated residual and the next norm's u and row sums in
  the epilogue; split K added inside the kernel by each output tile's last split (a ticket per tile,
  partials in split order), so neither a reducing kernel nor a norm kernel follows.
- `linear_fold_start`: an input projection that starts the residual stream (with its bias), the
  stream's first norm folded: PI0.5's float32 action input projection, its cast and the first norm in
  one kernel.
- `linear_folded`: a plain linear finishing a folded norm (PI0.5's float32 action output projection
  after the final norm), u cast to the weight's dtype tile by tile.

The norm's consumers inside a block, QKV + RoPE and gate/up + GeGLU, take `norm=` in
`layers.triton_gemm`, whose tiles, K loop and fold helpers these kernels share. Tested in
`tests/test_norm_fold.py` (under Triton's interpreter on the CPU, and on the H200); measured in
`benchmarks/RESULTS.md` (2026-12-04, fourteenth and fifteenth sessions) and `docs/gpu_kernels.md`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from phyai_edge.layers import triton_gemm as _gemm
from phyai_edge.layers.triton_dispatch import Tickets, _per_batch, _use_triton, needs_grad, tl, triton
from phyai_edge.layers.triton_gemm import (
    KERNEL_DTYPES,
    GemmConfig,
    _cfg,
    _check_norm,
    _flags,
    _fold_args,
    _present,
    _rows,
    default_config,
    folded_product_ref,
    kernel_takes,
    linear_ref,
)
from phyai_edge.layers.triton_ops import FoldedNorm

# The residual-fold GEMM's tiling (`linear_residual_fold`); None: the plain linear's for the shape.
RESIDUAL_CONFIG: GemmConfig | None = None
# `linear_folded`'s (the whole K in each program: the norm's row factor needs the whole sums). A
# first guess for PI0.5's output projection (32 columns, K 1024: one program), not swept.
FOLDED_CONFIG = _cfg(64, 32, 128, stages=4)


# -- kernels ---------------------------------------------------------------------------------------------
if triton is not None:
    from phyai_edge.layers.triton_dispatch import pdl_enter
    from phyai_edge.layers.triton_gemm import _fold_bias, _fold_rstd, _linear_acc, _split_tile, _tile
    from phyai_edge.layers.triton_math import _last_of

    @triton.jit
    def _residual_fold_epilogue(y, x, g, sc, rm, rn, m_ok, n_ok, pid_n, res_ptr, u_ptr, stats_ptr, s_rm, s_um, s_stm,
                                HAS_RES: tl.constexpr):
        """The gated residual r = x + y gate of a (rows, columns) tile of the GEMM's float32 sums y,
        rounded as the GEMM's own output and then the residual are (without HAS_RES r is y, rounded
        once: a projection starting the stream), and the next adaptive norm left folded: u = r (1 +
        scale) and the tile's sum of r^2 per row (column pid_n of stats). x, g (the gate) and sc (the
        scale): the tile's float32 operands, loaded by the caller."""
        ok = m_ok[:, None] & n_ok[None, :]
        if HAS_RES:
            y = y.to(res_ptr.dtype.element_ty).to(tl.float32)
            r = (x + y * g).to(res_ptr.dtype.element_ty)
        else:
            r = y.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + rm[:, None] * s_rm + rn[None, :], r, mask=ok)
        rf = r.to(tl.float32)
        tl.store(u_ptr + rm[:, None] * s_um + rn[None, :], (rf * (1.0 + sc)).to(u_ptr.dtype.element_ty), mask=ok)
        tl.store(stats_ptr + rm * s_stm + pid_n, tl.sum(rf * rf, axis=1), mask=m_ok)

    @triton.jit
    def _linear_residual_kernel(
        a_ptr, w_ptr, bias_ptr, part_ptr, ticket_ptr, x_ptr, gate_ptr, scale_ptr, res_ptr, u_ptr, stats_ptr,
        M, N, K, k_per_split, rows_per_batch,
        s_am, s_ak, s_wn, s_wk, s_ps, s_pm, s_xm, s_gb, s_sb, s_rm, s_um, s_stm,
        SPLITS: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
        HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):
        """o_proj / down with the residual and the next norm's fold in the epilogue. Split K: each
        split stores its float32 partial, and the last split of a tile to finish (a ticket per
        tile) adds all of them in split order (as the reducing kernel would) and runs the epilogue,
        so no second kernel reduces them and no norm kernel follows. Without HAS_RES (the input
        projection that starts the residual stream, with its bias) the stream is the product."""
        pdl_enter(PDL)
        pid = tl.program_id(0)
        pid_n, split, rm, rn, m_ok, n_ok, k0, k_end = _split_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N, GROUP_M)
        # The epilogue's operands are loaded ahead of the loop, in flight with the first tiles: the
        # last split's tail is then the partials' reads alone (wasted loads for the other splits).
        ok = m_ok[:, None] & n_ok[None, :]
        b = (rm // rows_per_batch)[:, None]
        if HAS_RES:
            x = tl.load(x_ptr + rm[:, None] * s_xm + rn[None, :], mask=ok, other=0.0).to(tl.float32)
            g = tl.load(gate_ptr + b * s_gb + rn[None, :], mask=ok, other=0.0).to(tl.float32)
        else:
            x = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            g = x
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        else:
            bias = tl.zeros([1, BLOCK_N], tl.float32)
        sc = tl.load(scale_ptr + b * s_sb + rn[None, :], mask=ok, other=0.0).to(tl.float32)
        acc = _linear_acc(a_ptr, w_ptr, rm, rn, m_ok, n_ok, k0, k_end, s_am, s_ak, s_wn, s_wk, EVEN_K, UPCAST, IEEE,
                          BLOCK_M, BLOCK_N, BLOCK_K)
        if SPLITS == 1:
            _residual_fold_epilogue(acc + bias, x, g, sc, rm, rn, m_ok, n_ok, pid_n, res_ptr, u_ptr, stats_ptr, s_rm,
                                    s_um, s_stm, HAS_RES)
        else:
            src = part_ptr + rm[:, None] * s_pm + rn[None, :]
            tl.store(src + split * s_ps, acc, mask=ok)
            if _last_of(ticket_ptr + pid, SPLITS):
                y = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in tl.static_range(SPLITS):  # split order: the same sum on every run
                    y += tl.load(src + s * s_ps, mask=ok, other=0.0, cache_modifier=".cg")
                _residual_fold_epilogue(y + bias, x, g, sc, rm, rn, m_ok, n_ok, pid_n, res_ptr, u_ptr, stats_ptr, s_rm,
                                        s_um, s_stm, HAS_RES)

    @triton.jit
    def _linear_folded_kernel(
        a_ptr, w_ptr, bias_ptr, out_ptr, stats_ptr, nbias_ptr,
        M, N, K, rows_per_batch, stats_tiles, width, norm_eps,
        s_am, s_ak, s_wn, s_wk, s_om, s_stm, s_nbb,
        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
        STATS_BLOCK: tl.constexpr,
    ):
        """A linear layer reading a folded norm (`triton_ops.FoldedNorm`): (u W^T) rstd + shift W^T (+
        bias), stored in out's dtype; u is cast to the weight's dtype tile by tile (the action
        expert's float32 output projection reads the bf16 stream)."""
        pdl_enter(PDL)
        pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        rstd = _fold_rstd(stats_ptr, rm, m_ok, s_stm, stats_tiles, width, norm_eps, True, STATS_BLOCK, BLOCK_M)
        nb, _ = _fold_bias(nbias_ptr, rm // rows_per_batch, rn, 0, m_ok, n_ok, s_nbb, True, BLOCK_M, BLOCK_N)
        acc = _linear_acc(a_ptr, w_ptr, rm, rn, m_ok, n_ok, 0, K, s_am, s_ak, s_wn, s_wk, EVEN_K, UPCAST, IEEE,
                          BLOCK_M, BLOCK_N, BLOCK_K)
        acc = acc * rstd[:, None] + nb
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * s_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


# -- launchers -------------------------------------------------------------------------------------------
def _linear_residual_triton(h: torch.Tensor, weight: torch.Tensor, x: torch.Tensor | None, gate: torch.Tensor | None,
                            scale: torch.Tensor, eps: float, cfg: GemmConfig | None, tickets: Tickets | None,
                            bias: torch.Tensor | None = None,
                            out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, FoldedNorm]:
    """The residual-fold GEMM; x None: no residual (the stream starts as h W^T + bias, in
    `out_dtype`)."""
    n, k = weight.shape
    a = _rows(h, k)
    m = a.shape[0]
    shape = (*h.shape[:-1], n)
    dtype = out_dtype if x is None else x.dtype
    batch = shape[0]
    per_batch = m // batch
    if x is None:  # unused pointers: anything valid
        x2, g, s_gb = a, a, 0
    else:
        x2 = _rows(x, n)
        g, s_gb = _per_batch(gate, batch, n)
    sc, s_sb = _per_batch(scale, batch, n)

    def launch(cfg: GemmConfig) -> tuple[torch.Tensor, FoldedNorm]:
        res = _gemm._empty(shape, dtype, h.device)
        u = _gemm._empty(shape, dtype, h.device)
        res2, u2 = res.view(m, n), u.view(m, n)
        tiles_n = triton.cdiv(n, cfg.block_n)
        stats = _gemm._empty((m, tiles_n), torch.float32, h.device)
        tiles = tiles_n * triton.cdiv(m, cfg.block_m)
        splits, per, (part, ticket, s_ps, s_pm) = _gemm._split_buffers(k, m, n, tiles, cfg, tickets, h.device, res2)
        _linear_residual_kernel[(tiles, splits)](
            a, weight, bias if bias is not None else a, part, ticket, x2, g, sc, res2, u2, stats, m, n, k, per,
            per_batch, a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), s_ps, s_pm, x2.stride(0), s_gb,
            s_sb, res2.stride(0), u2.stride(0), stats.stride(0), SPLITS=splits, HAS_RES=x is not None,
            HAS_BIAS=bias is not None, **_flags(a, k, cfg, weight.dtype),
        )
        return res, FoldedNorm(u, stats, float(eps))

    return _gemm._fitting("small-M GEMM + residual", h.device, cfg, RESIDUAL_CONFIG or default_config("linear", m, n),
                    launch)


def _linear_folded_triton(norm: FoldedNorm, weight: torch.Tensor, bias: torch.Tensor | None, norm_bias: torch.Tensor,
                          out_dtype: torch.dtype, cfg: GemmConfig | None) -> torch.Tensor:
    u = norm.u
    n, k = weight.shape
    a = _rows(u, k)
    m = a.shape[0]
    per_batch = u[0].numel() // k if u.dim() > 1 else m
    (stats, nb, tiles, width, eps, s_stm, s_nbb), fold = _fold_args(norm, norm_bias, a, per_batch)

    def launch(cfg: GemmConfig) -> torch.Tensor:
        out = _gemm._empty((*u.shape[:-1], n), out_dtype, u.device)
        out2 = out.view(m, n)
        grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m),)
        _linear_folded_kernel[grid](
            a, weight, bias if bias is not None else a, out2, stats, nb, m, n, k, per_batch, tiles, width, eps,
            a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), out2.stride(0), s_stm, s_nbb,
            HAS_BIAS=bias is not None, STATS_BLOCK=fold["STATS_BLOCK"], **_flags(a, k, cfg, weight.dtype),
        )
        return out

    return _gemm._fitting("small-M GEMM, folded norm", u.device, cfg, FOLDED_CONFIG, launch)


# -- the ops (dispatched) ----------------------------------------------------------------------------------
def linear_residual_fold(h: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, gate: torch.Tensor,
                         scale: torch.Tensor, eps: float, backend: str = "reference", *,
                         config: GemmConfig | None = None,
                         tickets: Tickets | None = None) -> tuple[torch.Tensor, FoldedNorm]:
    """o_proj / down with what follows them in an adaptive Gemma block, in one kernel: y = h W^T,
    the gated residual r = x + y gate (x (B, T, N); gate, scale (B or 1, 1, N)), and the next
    adaptive norm of r left folded for the GEMM that reads it (`triton_ops.FoldedNorm`: u = r (1 +
    scale), r^2 summed per row and column tile). Returns (r, the folded norm). Split K (the
    tiling's `split_k`) is reduced inside the kernel by each tile's last split (`tickets`: where
    its counters come from; None: a fresh zeroed buffer). No bias, no gradient."""
    n = weight.shape[0] if weight.dim() == 2 else -1
    if x.dim() != 3 or x.shape[-1] != n or h.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"linear_residual_fold: h {tuple(h.shape)}, weight {tuple(weight.shape)} and residual "
                         f"{tuple(x.shape)} do not match")
    if not (_use_triton(backend, h, weight, x, gate, scale) and kernel_takes(h, weight)) or needs_grad(h, x):
        y = linear_ref(h, weight)
        r = (x.float() + y.float() * gate.float()).to(x.dtype)
        rf = r.float()
        u = (rf * (1.0 + scale.float())).to(x.dtype)
        return r, FoldedNorm(u, (rf * rf).sum(-1).reshape(-1, 1), float(eps))
    return _linear_residual_triton(h, weight, x, gate, scale, eps, config, tickets)


def linear_fold_start(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor, eps: float,
                      out_dtype: torch.dtype, backend: str = "reference", *,
                      config: GemmConfig | None = None) -> tuple[torch.Tensor, FoldedNorm]:
    """An input projection that starts a residual stream, with the stream's first adaptive norm left
    folded, in one kernel: r = (h W^T + bias) in `out_dtype` (rounded once, as `F.linear(h, W,
    bias).to(out_dtype)`), and the norm of r with `scale` (B or 1, 1, N) as a `FoldedNorm` (u = r (1 +
    scale), r^2 summed per row and column tile). Returns (r, the folded norm); no gradient. PI0.5's
    float32 action input projection feeding the bf16 expert: the projection, its cast and the first
    norm were three kernels."""
    n = weight.shape[0] if weight.dim() == 2 else -1
    if scale.shape[-1] != n:
        raise ValueError(f"linear_fold_start: scale {tuple(scale.shape)} does not match weight {tuple(weight.shape)}")
    if h.dim() != 3 or not (_use_triton(backend, h, weight, scale, *_present(bias)) and kernel_takes(h, weight, bias)) \
            or needs_grad(h, weight):
        return _fold_start_ref(h, weight, bias, scale, eps, out_dtype)
    if config is None:  # the residual GEMM's tiling with one K block for PI0.5's 32 inputs (no 128-deep stages)
        m, k = h.numel() // h.shape[-1], h.shape[-1]
        config = replace(default_config("linear", m, n), block_k=max(16, min(128, triton.next_power_of_2(k))),
                         split_k=1)
    return _linear_residual_triton(h, weight, None, None, scale, eps, config, None, bias=bias, out_dtype=out_dtype)


def _fold_start_ref(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor, eps: float,
                    out_dtype: torch.dtype) -> tuple[torch.Tensor, FoldedNorm]:
    r = F.linear(h, weight, bias).to(out_dtype)
    rf = r.float()
    u = (rf * (1.0 + scale.float())).to(out_dtype)
    return r, FoldedNorm(u, (rf * rf).sum(-1).reshape(-1, 1), float(eps))


def linear_folded(norm: FoldedNorm, weight: torch.Tensor, norm_bias: torch.Tensor, backend: str = "reference", *,
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                  config: GemmConfig | None = None) -> torch.Tensor:
    """A linear layer reading a folded adaptive norm (`triton_ops.FoldedNorm`, norm_bias (B or 1, N)
    float32 = shift W^T): (rms_norm(r) (1 + scale) + shift) W^T + bias up to rounding, in
    `out_dtype` (None: the weight's). The norm's u is cast to the weight's dtype (PI0.5's float32
    output projection after the bf16 expert: the final norm, a cast and the projection were three
    kernels). One program column per 32 outputs; the whole K in each."""
    u = norm.u
    out_dtype = out_dtype or weight.dtype
    n = weight.shape[0] if weight.dim() == 2 else -1
    _check_norm("linear_folded", u, norm, norm_bias, n)
    takes = (weight.dim() == 2 and weight.dtype in KERNEL_DTYPES and u.dtype in KERNEL_DTYPES
             and weight.shape[1] == u.shape[-1] and (bias is None or bias.shape == (n,)))
    if not (takes and _use_triton(backend, u, weight, norm_bias, *_present(bias))) or needs_grad(u, weight):
        return folded_product_ref(norm, weight, norm_bias, bias, cast=False).to(out_dtype)
    return _linear_folded_triton(norm, weight, bias, norm_bias, out_dtype, config)
