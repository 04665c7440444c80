"""Small-M Triton GEMMs for the action expert's projections, with their elementwise epilogues
fused in, each beside its plain-torch reference.

Why: at batch 1 a PI0.5 denoise step multiplies 50 activation rows by each expert layer's four
weights (fused QKV 2560 x 1024, o_proj 1024 x 2048, fused gate/up 8192 x 1024, down 1024 x 4096).
Those GEMMs are memory-bound (the weights are read once, the activations are tiny), and on the
H200 cuBLAS read them at ~1.4 TB/s of the ~4.2 TB/s the GPU can copy (`benchmarks/RESULTS.md`,
the profile). Each layer also launches separate RoPE and GeGLU kernels after the QKV and gate/up
GEMMs, and every kernel in a CUDA graph costs a few microseconds whatever it does. Here:

- `linear_qkv_rope(h, weight, cos, sin, H, Hkv, D)`: the fused QKV GEMM with rotary embedding in
  its epilogue; returns q (B, H, T, D), k, v (B, Hkv, T, D), all contiguous. RoPE's rotate-half
  pairs column d of a head with column d + D/2, so a program accumulates the two halves of one
  head's column range as two accumulators (weight rows [head D + j, ...) and [head D + D/2 + j,
  ...)) and rotates them in registers before the one store.
- `linear_geglu(h, weight)`: the fused gate/up GEMM (weight (2 H, K), gate rows first) with
  gelu_tanh(gate) * up in the epilogue: two accumulators (gate rows j, up rows H + j), one
  (..., H) store; the (..., 2 H) intermediate never exists.
- `linear(h, weight)`: the plain GEMM (o_proj, down_proj), optionally split over K. A split-K
  call is two kernels: each split writes a float32 partial, and a second kernel sums the
  partials (in a fixed order: the result is deterministic), adds the bias and casts. The output
  of the expert's o_proj and down (N = 1024) is only ~16-32 column tiles wide, far fewer
  programs than the H200's 132 SMs; splitting K is the other way to put every SM to work. No
  atomics: those would need a zeroed float32 buffer (another kernel) and give run-to-run
  differences.
- The batch-1 folded norms (`triton_ops.FoldedNorm`): `norm=` on QKV + RoPE and gate/up + GeGLU
  finishes a norm its producer left folded; the producers and the output projection that finishes the
  last one are in `layers.triton_fold`, which shares this module's tiles, K loop and fold helpers.

Every op accepts an optional bias (the expert's linears have none), accumulates in float32 and
rounds once, in the activation dtype. Tile configs are explicit (`GemmConfig`); without one, a
small table keyed by shape class (`shape_class`, `CONFIGS`) gives it. Nothing autotunes at run
time: a robot's start-up time matters, and autotuning inside a CUDA graph's warm-up is fragile.

Dispatch: `backend` as in `layers.triton_ops` ("reference" | "triton" | "auto"); a dtype or layout
the kernels do not take (`kernel_takes`) runs the reference. A call whose input needs a gradient
(exact RTC guidance takes a vector-Jacobian product): QKV + RoPE and gate/up + GeGLU run their fused
kernels under autograd functions (`LinearQkvRopeFn`, `LinearGegluFn`, whose input gradient is one
cuBLAS GEMM; `set_fused_vjp_forward`), the plain linear the reference. Where the kernels are worth
it is a separate rule for callers, `takes(rows, weight)` / `module_takes(module, h)`: at most
`MAX_ROWS` rows, a 2-D bf16 / fp16 weight of a plain `nn.Linear` (an fp8 linear from
`layers.fp8`, or anything else, keeps its own forward). `fused_stacks.adaptive_block_stack(...,
gemm_backend=)` applies it layer by layer.

Under Triton's CPU interpreter (`TRITON_INTERPRET=1`) the tiles are upcast to float32 before
`tl.dot` (the interpreter's bf16 `tl.dot` is wrong in triton 3.9, as `layers.triton_attention`
notes) and its bf16 stores round toward zero, so CPU results sit within about one bf16 ulp of a
GPU's.

Status: tested against the references on CPU under the interpreter (`tests/test_triton_gemm.py`)
and on an H200 (`benchmarks/gemm_gpu.py`, each config checked against the reference, then timed
inside CUDA graphs): at M = 50 QKV+RoPE 6.48 vs 6.98 us, o_proj 6.52 vs 7.38, gate/up+GeGLU 8.51
vs 9.43, down 7.92 vs 8.14 (cuBLAS path); a batch-1 PI0.5 chunk 18.53 -> 17.52 ms. The M = 50
tiles of the table are the sweep's winners; the wider ones are unused while `MAX_ROWS` is 64.
Written against the
Triton API present in both 3.6 (the GPU machine) and 3.9 (here): `tl.dot` with `acc` and
`input_precision`, pointer-arithmetic loads and stores, `tl.program_id`, `tl.cdiv`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from phyai_edge.layers import triton_grad
from phyai_edge.layers.triton_dispatch import (
    Tickets,
    _per_batch,
    _use_triton,
    interpret_mode,
    launch_fitting,
    launch_options,
    needs_grad,
    tl,
    triton,
)
from phyai_edge.layers.triton_ops import FoldedNorm, SplitSums, bias_gelu_ref, geglu_ref, qkv_rope_ref

# Measured on an H200 (`benchmarks/gemm_gpu.py`, RESULTS.md): at M = 50 (batch 1) the kernels beat
# cuBLAS (+ the separate RoPE / GeGLU kernel) on all four projections by 3-13%; at M = 400 and 1600
# (batch 8, 32) cuBLAS won every shape but one (by 14-37%). So one 64-row tile is the limit.
MAX_ROWS = 64
# The weight dtypes `takes` sends to the kernels. float32 runs in the kernels too (the tests use
# it for tight checks) but is not routed there: on a GPU it would be an IEEE-precision tl.dot
# against cuBLAS's TF32 / SIMT paths, never measured.
TAKES_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OPS = ("linear", "gelu", "geglu", "qkv_rope")


# -- tile configs ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmConfig:
    """One kernel's tiling. `block_n` counts output columns: for `geglu` and `qkv_rope` a program
    holds two accumulators of that width (gate and up; the two rotary halves), so its weight tile
    is 2 x block_n rows. `split_k` > 1 splits K: `linear` writes float32 partials that a second
    kernel (or the consumer, `defer_sum`) adds; `geglu`, `qkv_rope` and the residual-fold linear add
    them in the kernel (each tile's last split, counted by a ticket, then runs the epilogue); `gelu`
    does not split."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    group_m: int = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name}={v}: tl.dot needs a power of two >= 16")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1 or self.group_m < 1:
            raise ValueError(f"GemmConfig {self}: split_k, num_warps, num_stages and group_m must be >= 1")

    def label(self) -> str:
        s = f"m{self.block_m} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages}"
        return s + (f" split{self.split_k}" if self.split_k > 1 else "") + (f" g{self.group_m}" if self.group_m > 1 else "")


def _m_class(rows: int) -> str:
    for bound in (16, 64, 256, 1024):
        if rows <= bound:
            return f"m{bound}"
    return "mbig"


def shape_class(op: str, rows: int, n: int) -> str:
    """The key of `CONFIGS` for an op at `rows` (M) and `n` output columns (for `geglu` H, for
    `qkv_rope` the fused width): M bucketed (16, 64, 256, 1024, more), and for `linear` whether
    N is narrow (<= 2048: at most 64 column tiles of 32, fewer programs than the H200 has SMs at
    small M, so split K) or wide."""
    if op not in OPS:
        raise ValueError(f"op {op!r}: choose one of {OPS}")
    key = f"{op}/{_m_class(rows)}"
    if op == "linear":
        key += "/narrow" if n <= 2048 else "/wide"
    return key


def _cfg(bm: int, bn: int, bk: int, warps: int = 4, stages: int = 3, split: int = 1, group: int = 1) -> GemmConfig:
    return GemmConfig(bm, bn, bk, warps, stages, split, group)


# First guesses, not measurements (nothing here has run on a GPU). The reasoning, for the H200:
# - M <= 64 (batch 1 = 50 rows): one 64-row tile (wgmma's native height) so each weight byte is
#   read from HBM once; narrow column tiles and split K so that ~128 programs stream the weight
#   (fewer leave SMs idle and bandwidth unused): QKV 10 heads x 8 tiles of 16 = 80 programs,
#   gate/up 4096 / 32 = 128, o_proj / down 1024 / 32 x split 4 = 128. block_k 128 and 3-4 stages
#   keep ~24-32 KB of weight in flight per program.
# - M in (64, 1024] (batch 8 = 400 rows): the weight is re-read by each row tile (from L2: the
#   largest, 16.8 MB, fits the 50 MB L2), so wider column tiles for more reuse.
# - more rows: compute-bound; 128 x 64 tiles with 8 warps, cuBLAS is expected to win there (the
#   `takes` rule keeps it).
CONFIGS: dict[str, GemmConfig] = {
    "linear/m16/narrow": _cfg(16, 32, 128, stages=4, split=4),
    "linear/m64/narrow": _cfg(64, 32, 128, stages=4, split=4),
    "linear/m256/narrow": _cfg(64, 64, 64, stages=4, split=2),
    "linear/m1024/narrow": _cfg(64, 64, 64, stages=4),
    "linear/mbig/narrow": _cfg(128, 128, 64, warps=8, group=8),
    "linear/m16/wide": _cfg(16, 64, 128, stages=4),
    "linear/m64/wide": _cfg(64, 64, 128, stages=4),
    "linear/m256/wide": _cfg(64, 64, 64, stages=4),
    "linear/m1024/wide": _cfg(64, 128, 64),
    "linear/mbig/wide": _cfg(128, 128, 64, warps=8, group=8),
    "geglu/m16": _cfg(16, 32, 128, stages=4),
    "geglu/m64": _cfg(64, 32, 128),
    "geglu/m256": _cfg(64, 64, 64),
    "geglu/m1024": _cfg(64, 64, 64),
    "geglu/mbig": _cfg(128, 64, 64, warps=8, group=8),
    "qkv_rope/m16": _cfg(16, 16, 128, stages=4),
    "qkv_rope/m64": _cfg(64, 16, 128, stages=4),
    "qkv_rope/m256": _cfg(64, 32, 64, stages=4),
    "qkv_rope/m1024": _cfg(64, 64, 64),
    "qkv_rope/mbig": _cfg(128, 64, 64, warps=8, group=8),
}
# The GELU epilogue needs the whole sums (no split K): the wide plain-linear tiles, which never split.
CONFIGS.update({f"gelu/{m}": CONFIGS[f"linear/{m}/wide"] for m in ("m16", "m64", "m256", "m1024", "mbig")})


def default_config(op: str, rows: int, n: int) -> GemmConfig:
    return CONFIGS[shape_class(op, rows, n)]


# -- the rule callers apply --------------------------------------------------------------------------
def takes(rows: int, weight: torch.Tensor) -> bool:
    """Worth sending to the kernels: at most MAX_ROWS activation rows against a 2-D bf16 / fp16
    weight (a memory-bound GEMM)."""
    return 0 < rows <= MAX_ROWS and weight.dim() == 2 and weight.dtype in TAKES_DTYPES


def module_takes(module: nn.Module | None, h: torch.Tensor) -> bool:
    """`module` is a plain `nn.Linear` (exactly: `layers.fp8.Fp8Linear` subclasses it and must keep
    its own forward) whose weight `takes` h's rows, in h's dtype. A call needing h's gradient (exact
    RTC guidance's VJP) is taken too, with a constant weight, unless `set_fused_vjp_forward(False)`:
    QKV + RoPE and gate/up + GeGLU then run on their fused kernels (`LinearQkvRopeFn`,
    `LinearGegluFn`), o_proj and down on cuBLAS (`linear` takes the reference under a gradient)."""
    if type(module) is not nn.Linear or h.dim() == 0 or h.shape[-1] == 0:
        return False
    if needs_grad(h) and (not _FUSED_VJP_FORWARD or module.weight.requires_grad):
        return False
    rows = h.numel() // h.shape[-1]
    return takes(rows, module.weight) and module.weight.dtype == h.dtype and h.shape[-1] == module.in_features


def kernel_takes(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """What the kernels can compute: float weights and activations of one dtype (bf16, fp16,
    float32), a 2-D weight (N, K) matching h's last axis, a bias (N,) if any."""
    if weight.dim() != 2 or h.dim() < 1 or h.shape[-1] != weight.shape[1] or h.numel() == 0:
        return False
    if weight.dtype not in KERNEL_DTYPES or h.dtype != weight.dtype:
        return False
    return bias is None or (bias.shape == (weight.shape[0],) and bias.dtype.is_floating_point)


# -- references ----------------------------------------------------------------------------------------
def linear_ref(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(h, weight, bias)


def linear_gelu_ref(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`GeluMLP`'s fc1 and activation: (..., K) -> (..., N)."""
    return bias_gelu_ref(F.linear(h, weight, bias))


def linear_geglu_ref(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`GatedMLP`'s fused gate/up projection and activation: (..., K) -> (..., H)."""
    return geglu_ref(F.linear(h, weight, bias))


def linear_qkv_rope_ref(
    h: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
    num_kv_heads: int, head_dim: int, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`GemmaAttention.qkv` with the fused projection: h (B, T, K) -> q, k, v."""
    return qkv_rope_ref(F.linear(h, weight, bias), cos, sin, num_heads, num_kv_heads, head_dim)


# -- kernels ---------------------------------------------------------------------------------------------
if triton is not None:
    from phyai_edge.layers.triton_dispatch import pdl_enter
    from phyai_edge.layers.triton_math import _gelu_tanh, _last_of, _rope

    @triton.jit
    def _mma(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """acc + a @ b in float32. UPCAST (the interpreter): multiply float32 copies, since the
        interpreter's bf16 dot is wrong. IEEE (float32 operands on a GPU while torch keeps float32
        matmuls in float32, `float32_matmuls_in_tf32`): no TF32 rounding."""
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(row tile, column tile) of program `pid`. GROUP_M = 1: column tiles vary fastest, so
        programs running together share one row tile of the activations and stream disjoint
        weight rows (the small-M case: one row tile). GROUP_M > 1: programs walk GROUP_M row
        tiles down one column tile before moving right, so a wave of programs touches GROUP_M
        row tiles and few column tiles, and both stay in L2 (the large-M case, where a whole row
        of column tiles would stream the entire weight through L2 once per row tile)."""
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        rows_here = tl.minimum(tiles_m - first_m, GROUP_M)
        local = pid % per_group
        return first_m + local % rows_here, local // rows_here

    @triton.jit
    def _split_tile(M, N, K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """A split-K program's output tile and K range: (column tile, split, rows rm, columns rn, their
        bounds, k0, k_end), the program's tile from grid axis 0 (`_tile`) and its split from axis 1."""
        pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        split = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = split * k_per_split
        return pid_n, split, rm, rn, rm < M, rn < N, k0, tl.minimum(k0 + k_per_split, K)

    @triton.jit
    def _linear_acc(a_ptr, w_ptr, rm, rn, m_ok, n_ok, k0, k_end, s_am, s_ak, s_wn, s_wk, EVEN_K: tl.constexpr,
                    UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        """The float32 sums of a (rows rm, columns rn) tile of a @ w^T over K in [k0, k_end): the
        plain linear's and the residual-fold linear's K loop (inlined into each)."""
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(k0, k_end, BLOCK_K):
            kk = k + rk
            if EVEN_K:  # no K mask: lets the loads vectorise along K
                a = tl.load(a_ptr + rm[:, None] * s_am + kk[None, :] * s_ak, mask=m_ok[:, None], other=0.0)
                w = tl.load(w_ptr + rn[None, :] * s_wn + kk[:, None] * s_wk, mask=n_ok[None, :], other=0.0,
                            eviction_policy="evict_first")
            else:
                k_ok = kk < k_end
                a = tl.load(a_ptr + rm[:, None] * s_am + kk[None, :] * s_ak, mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0)
                w = tl.load(w_ptr + rn[None, :] * s_wn + kk[:, None] * s_wk, mask=n_ok[None, :] & k_ok[:, None],
                            other=0.0, eviction_policy="evict_first")
            acc = _mma(a.to(w.dtype), w, acc, UPCAST, IEEE)
        return acc

    @triton.jit
    def _fold_rstd(stats_ptr, rm, m_ok, s_stm, stats_tiles, width, norm_eps, FOLD: tl.constexpr,
                   STATS_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
        """A folded norm's 1 / rms for rows rm (`triton_ops.FoldedNorm`): its producer's per-tile
        sums of squares added, in float32; ones without FOLD."""
        if FOLD:
            st = tl.arange(0, STATS_BLOCK)
            ss = tl.load(stats_ptr + rm[:, None] * s_stm + st[None, :], mask=m_ok[:, None] & (st < stats_tiles)[None, :],
                         other=0.0)
            rstd = tl.rsqrt((tl.sum(ss, axis=1) / width + norm_eps).to(tl.float32))
        else:
            rstd = tl.full([BLOCK_M], 1.0, tl.float32)
        return rstd

    @triton.jit
    def _fold_bias(nbias_ptr, sample, cols, offset, m_ok, c_ok, s_nbb, FOLD: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
        """A folded norm's shift W^T for rows of `sample` at columns `cols` and `cols + offset` (the
        two accumulators' columns), as (BLOCK_M, BLOCK_N) float32 blocks; zeros without FOLD."""
        if FOLD:
            nb = nbias_ptr + sample[:, None] * s_nbb + cols[None, :]
            ok = m_ok[:, None] & c_ok[None, :]
            first = tl.load(nb, mask=ok, other=0.0)
            second = tl.load(nb + offset, mask=ok, other=0.0)
        else:
            first = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            second = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        return first, second

    @triton.jit
    def _linear_kernel(
        a_ptr, w_ptr, bias_ptr, out_ptr,
        M, N, K, k_per_split,
        s_am, s_ak, s_wn, s_wk, s_os, s_om,
        HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, GELU: tl.constexpr, EVEN_K: tl.constexpr,
        UPCAST: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_enter(PDL)
        _, split, rm, rn, m_ok, n_ok, k0, k_end = _split_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _linear_acc(a_ptr, w_ptr, rm, rn, m_ok, n_ok, k0, k_end, s_am, s_ak, s_wn, s_wk, EVEN_K, UPCAST, IEEE,
                          BLOCK_M, BLOCK_N, BLOCK_K)
        dst = out_ptr + split * s_os + rm[:, None] * s_om + rn[None, :]
        if PARTIAL:  # float32 partial sum; the reduce kernel adds the bias and casts
            tl.store(dst, acc, mask=m_ok[:, None] & n_ok[None, :])
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GELU:
                acc = _gelu_tanh(acc)
            tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _split_k_reduce_kernel(
        part_ptr, bias_ptr, out_ptr, M, N, s_ps, s_pm, s_om,
        SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_enter(PDL)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = (rm[:, None] < M) & (rn[None, :] < N)
        src = part_ptr + rm[:, None] * s_pm + rn[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for s in tl.static_range(SPLITS):  # a fixed order: the same sum on every run
            acc += tl.load(src + s * s_ps, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * s_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _pair_acc(a_ptr, w1_ptr, w2_ptr, rm, m_ok, c_ok, k0, k_end, s_am, s_ak, s_wk, EVEN_K: tl.constexpr,
                  UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
        """The two float32 accumulators of a paired-column tile over K in [k0, k_end): a @ w1^T and a @
        w2^T, w1_ptr / w2_ptr pointing at the tile's two sets of weight rows (gate and up; a head's
        two rotary halves). GeGLU's and QKV + RoPE's K loop (inlined into each)."""
        rk = tl.arange(0, BLOCK_K)
        acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(k0, k_end, BLOCK_K):
            kk = k + rk
            if EVEN_K:
                a_mask = m_ok[:, None]
                w_mask = c_ok[None, :]
            else:
                a_mask = m_ok[:, None] & (kk < k_end)[None, :]
                w_mask = c_ok[None, :] & (kk < k_end)[:, None]
            a = tl.load(a_ptr + rm[:, None] * s_am + kk[None, :] * s_ak, mask=a_mask, other=0.0)
            w1 = tl.load(w1_ptr + kk[:, None] * s_wk, mask=w_mask, other=0.0, eviction_policy="evict_first")
            w2 = tl.load(w2_ptr + kk[:, None] * s_wk, mask=w_mask, other=0.0, eviction_policy="evict_first")
            acc1 = _mma(a, w1, acc1, UPCAST, IEEE)
            acc2 = _mma(a, w2, acc2, UPCAST, IEEE)
        return acc1, acc2

    @triton.jit
    def _pair_partials(acc1, acc2, part_ptr, rm, cols, offset, m_ok, c_ok, split, s_ps, s_pm):
        """Split K for a paired-column tile: this split's two float32 partials to columns `cols` and
        `cols + offset` of its slice of part (the tile's last split adds them, `_pair_sums`)."""
        ok = m_ok[:, None] & c_ok[None, :]
        src = part_ptr + rm[:, None] * s_pm + cols[None, :] + split * s_ps
        tl.store(src, acc1, mask=ok)
        tl.store(src + offset, acc2, mask=ok)

    @triton.jit
    def _pair_sums(part_ptr, rm, cols, offset, m_ok, c_ok, s_ps, s_pm, SPLITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The two whole float32 sums of a paired-column tile from its splits' partials, added in
        split order (as the plain linear's reducing kernel adds them: the same sums on every run).
        Read through L2 (".cg"): other programs wrote them during this kernel."""
        ok = m_ok[:, None] & c_ok[None, :]
        src = part_ptr + rm[:, None] * s_pm + cols[None, :]
        acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for s in tl.static_range(SPLITS):
            acc1 += tl.load(src + s * s_ps, mask=ok, other=0.0, cache_modifier=".cg")
            acc2 += tl.load(src + s * s_ps + offset, mask=ok, other=0.0, cache_modifier=".cg")
        return acc1, acc2

    @triton.jit
    def _geglu_epilogue(acc_g, acc_u, rstd, nb_g, nb_u, bias_ptr, out_ptr, pre_ptr, rm, rn, m_ok, n_ok, H, s_om,
                        s_pre, HAS_BIAS: tl.constexpr, FOLD: tl.constexpr, SAVE_PRE: tl.constexpr):
        """A gate/up tile's whole float32 sums finished: the folded norm, the bias, gelu(gate) * up.
        SAVE_PRE: the sums themselves also stored, rounded, as the packed (M, 2 H) gate/up output
        (what GeGLU's gradient reads)."""
        if FOLD:
            acc_g = acc_g * rstd[:, None] + nb_g
            acc_u = acc_u * rstd[:, None] + nb_u
        if HAS_BIAS:
            acc_g += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(bias_ptr + H + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SAVE_PRE:
            pre = pre_ptr + rm[:, None] * s_pre + rn[None, :]
            ok = m_ok[:, None] & n_ok[None, :]
            tl.store(pre, acc_g.to(pre_ptr.dtype.element_ty), mask=ok)
            tl.store(pre + H, acc_u.to(pre_ptr.dtype.element_ty), mask=ok)
        out = _gelu_tanh(acc_g) * acc_u
        tl.store(out_ptr + rm[:, None] * s_om + rn[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _linear_geglu_kernel(
        a_ptr, w_ptr, bias_ptr, out_ptr, pre_ptr, stats_ptr, nbias_ptr, part_ptr, ticket_ptr,
        M, H, K, k_per_split, rows_per_batch, stats_tiles, width, norm_eps,
        s_am, s_ak, s_wn, s_wk, s_om, s_pre, s_stm, s_nbb, s_ps, s_pm,
        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
        FOLD: tl.constexpr, STATS_BLOCK: tl.constexpr, SPLITS: tl.constexpr, SAVE_PRE: tl.constexpr,
    ):
        """Gate/up with GeGLU in the epilogue. Split K (SPLITS > 1): each split stores its two float32
        partials and the tile's last split to finish (a ticket per tile) adds them and runs the
        epilogue, which needs the whole sums."""
        pdl_enter(PDL)
        # rn: gate rows; the matching up rows are H + rn
        _, split, rm, rn, m_ok, n_ok, k0, k_end = _split_tile(M, H, K, k_per_split, BLOCK_M, BLOCK_N, GROUP_M)
        # FOLD: the input is a folded norm's u; its row factor and the shift's W^T are read before
        # the loop (in flight with the first weight tiles) and applied to the sums after it.
        rstd = _fold_rstd(stats_ptr, rm, m_ok, s_stm, stats_tiles, width, norm_eps, FOLD, STATS_BLOCK, BLOCK_M)
        nb_g, nb_u = _fold_bias(nbias_ptr, rm // rows_per_batch, rn, H, m_ok, n_ok, s_nbb, FOLD, BLOCK_M, BLOCK_N)
        acc_g, acc_u = _pair_acc(a_ptr, w_ptr + rn[None, :] * s_wn, w_ptr + (rn + H)[None, :] * s_wn, rm, m_ok, n_ok,
                                 k0, k_end, s_am, s_ak, s_wk, EVEN_K, UPCAST, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
        # Both branches written out (not an early return): Triton 3.6 compiles the code after a
        # constexpr-guarded return too, and without a split the ticket is not an int32 buffer.
        if SPLITS == 1:
            _geglu_epilogue(acc_g, acc_u, rstd, nb_g, nb_u, bias_ptr, out_ptr, pre_ptr, rm, rn, m_ok, n_ok, H, s_om,
                            s_pre, HAS_BIAS, FOLD, SAVE_PRE)
        else:
            _pair_partials(acc_g, acc_u, part_ptr, rm, rn, H, m_ok, n_ok, split, s_ps, s_pm)
            if _last_of(ticket_ptr + tl.program_id(0), SPLITS):
                acc_g, acc_u = _pair_sums(part_ptr, rm, rn, H, m_ok, n_ok, s_ps, s_pm, SPLITS, BLOCK_M, BLOCK_N)
                _geglu_epilogue(acc_g, acc_u, rstd, nb_g, nb_u, bias_ptr, out_ptr, pre_ptr, rm, rn, m_ok, n_ok, H,
                                s_om, s_pre, HAS_BIAS, FOLD, SAVE_PRE)

    @triton.jit
    def _linear_qkv_rope_kernel(
        a_ptr, w_ptr, bias_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, stats_ptr, nbias_ptr, part_ptr, ticket_ptr,
        M, K, k_per_split, seq_len, num_heads, num_kv_heads, tiles_per_half, stats_tiles, width, norm_eps,
        s_am, s_ak, s_wn, s_wk, s_cb, s_ct, s_sb, s_st, s_stm, s_nbb, s_ps, s_pm,
        HALF: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
        UPCAST: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
        FOLD: tl.constexpr, STATS_BLOCK: tl.constexpr, SPLITS: tl.constexpr,
    ):
        """Fused QKV with RoPE in the epilogue. Split K (SPLITS > 1): as `_linear_geglu_kernel`, the
        tile's last split adds the partials (the fused output's layout) and rotates the whole sums."""
        pdl_enter(PDL)
        # Program (head, j) owns columns j*BLOCK_N.. of both halves of one head of the fused
        # output (q heads, then k heads, then v heads), so rotate-half's partner is in registers.
        # Column tile pid_n counts (head, j) pairs: tiles_per_half * BLOCK_N columns per head.
        pid_m, pid_n = _tile(tl.program_id(0), M, (num_heads + 2 * num_kv_heads) * tiles_per_half * BLOCK_N,
                             BLOCK_M, BLOCK_N, GROUP_M)
        split = tl.program_id(1)
        head = pid_n // tiles_per_half
        d = (pid_n % tiles_per_half) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = rm < M
        d_ok = d < HALF
        row1 = head * (2 * HALF) + d  # weight rows of the first half's columns
        k0 = split * k_per_split
        k_end = tl.minimum(k0 + k_per_split, K)
        rstd = _fold_rstd(stats_ptr, rm, m_ok, s_stm, stats_tiles, width, norm_eps, FOLD, STATS_BLOCK, BLOCK_M)
        nb1, nb2 = _fold_bias(nbias_ptr, rm // seq_len, row1, HALF, m_ok, d_ok, s_nbb, FOLD, BLOCK_M, BLOCK_N)
        acc1, acc2 = _pair_acc(a_ptr, w_ptr + row1[None, :] * s_wn, w_ptr + (row1 + HALF)[None, :] * s_wn, rm, m_ok,
                               d_ok, k0, k_end, s_am, s_ak, s_wk, EVEN_K, UPCAST, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
        if SPLITS == 1:
            _qkv_rope_epilogue(acc1, acc2, rstd, nb1, nb2, bias_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, head, d,
                               row1, rm, m_ok, d_ok, seq_len, num_heads, num_kv_heads, s_cb, s_ct, s_sb, s_st,
                               HALF, HAS_BIAS, FOLD)
        else:
            _pair_partials(acc1, acc2, part_ptr, rm, row1, HALF, m_ok, d_ok, split, s_ps, s_pm)
            if _last_of(ticket_ptr + tl.program_id(0), SPLITS):
                acc1, acc2 = _pair_sums(part_ptr, rm, row1, HALF, m_ok, d_ok, s_ps, s_pm, SPLITS, BLOCK_M, BLOCK_N)
                _qkv_rope_epilogue(acc1, acc2, rstd, nb1, nb2, bias_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, head,
                                   d, row1, rm, m_ok, d_ok, seq_len, num_heads, num_kv_heads, s_cb, s_ct, s_sb, s_st,
                                   HALF, HAS_BIAS, FOLD)

    @triton.jit
    def _qkv_rope_epilogue(acc1, acc2, rstd, nb1, nb2, bias_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, head, d,
                           row1, rm, m_ok, d_ok, seq_len, num_heads, num_kv_heads, s_cb, s_ct, s_sb, s_st,
                           HALF: tl.constexpr, HAS_BIAS: tl.constexpr, FOLD: tl.constexpr):
        """A QKV tile's whole float32 sums (two rotary halves of one head's columns d) finished: the
        folded norm, the bias, RoPE on q and k heads, each head stored in its own tensor."""
        if FOLD:
            acc1 = acc1 * rstd[:, None] + nb1
            acc2 = acc2 * rstd[:, None] + nb2
        if HAS_BIAS:
            acc1 += tl.load(bias_ptr + row1, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            acc2 += tl.load(bias_ptr + row1 + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        b = rm // seq_len
        t = rm % seq_len
        ok = m_ok[:, None] & d_ok[None, :]
        cs = cos_ptr + (b * s_cb + t * s_ct)[:, None] + d[None, :]
        sn = sin_ptr + (b * s_sb + t * s_st)[:, None] + d[None, :]
        r1, r2 = _rope(acc1, acc2, cs, sn, ok, HALF)
        # v heads are not rotated; the selects below keep one code path for all heads.
        rotate = head < num_heads + num_kv_heads
        o1 = tl.where(rotate, r1, acc1)
        o2 = tl.where(rotate, r2, acc2)
        # Each head goes to its own (B, heads, T, D) tensor; the two stores a program does not
        # own are fully masked (clamped indices keep their addresses in bounds anyway).
        heads = head + d * 0  # the head index as a block, so the masks below are blocks
        is_q = ok & (heads < num_heads)[None, :]
        is_k = ok & ((heads >= num_heads) & (heads < num_heads + num_kv_heads))[None, :]
        is_v = ok & (heads >= num_heads + num_kv_heads)[None, :]
        qh = tl.minimum(head, num_heads - 1)
        kh = tl.minimum(tl.maximum(head - num_heads, 0), num_kv_heads - 1)
        vh = tl.minimum(tl.maximum(head - num_heads - num_kv_heads, 0), num_kv_heads - 1)
        cols = d[None, :]
        dst_q = q_ptr + ((b * num_heads + qh) * seq_len + t)[:, None] * (2 * HALF) + cols
        dst_k = k_ptr + ((b * num_kv_heads + kh) * seq_len + t)[:, None] * (2 * HALF) + cols
        dst_v = v_ptr + ((b * num_kv_heads + vh) * seq_len + t)[:, None] * (2 * HALF) + cols
        tl.store(dst_q, o1.to(q_ptr.dtype.element_ty), mask=is_q)
        tl.store(dst_q + HALF, o2.to(q_ptr.dtype.element_ty), mask=is_q)
        tl.store(dst_k, o1.to(k_ptr.dtype.element_ty), mask=is_k)
        tl.store(dst_k + HALF, o2.to(k_ptr.dtype.element_ty), mask=is_k)
        tl.store(dst_v, o1.to(v_ptr.dtype.element_ty), mask=is_v)
        tl.store(dst_v + HALF, o2.to(v_ptr.dtype.element_ty), mask=is_v)


# -- launchers -------------------------------------------------------------------------------------------
def _empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every kernel output and split-K partial is allocated here (the tests poison it to check it
    is fully written)."""
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """(..., width) as (rows, width) with unit column stride (a view when it can be)."""
    t = t.reshape(-1, width)
    return t if t.stride(-1) == 1 else t.contiguous()


def float32_matmuls_in_tf32() -> bool:
    """Whether torch lets float32 matmuls run in TF32 now (`torch.backends.cuda.matmul`); a bf16 /
    fp16 cudagraph engine turns that on while it captures (`cudagraph.float32_matmuls_in_tf32`)."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9
        return matmul.fp32_precision == "tf32"
    return bool(matmul.allow_tf32)  # pragma: no cover - torch < 2.9


def _flags(a: torch.Tensor, k: int, cfg: GemmConfig, weight_dtype: torch.dtype | None = None) -> dict[str, object]:
    # A float32 product is IEEE float32 unless torch's float32 matmuls may use TF32, as F.linear's
    # would (the kernels of one float32 engine's tests compare at 1e-5).
    fp32 = (weight_dtype or a.dtype) == torch.float32
    return {"EVEN_K": k % cfg.block_k == 0, "UPCAST": interpret_mode(), "IEEE": fp32 and not float32_matmuls_in_tf32(),
            "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m,
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **launch_options(a)}


def split_size(k: int, splits: int, block_k: int) -> int:
    """K per split of a split-K GEMM: a whole number of `block_k` blocks."""
    return math.ceil(math.ceil(k / splits) / block_k) * block_k


R = TypeVar("R")


def _fitting(kernel: str, device: torch.device, config: GemmConfig | None, chosen: GemmConfig,
             launch: Callable[[GemmConfig], R]) -> R:
    """`launch(config)`, or with `config` None the shape's tiling, where it does not fit the GPU
    (its pipeline stages' shared memory: an RTX GPU offers 99 KB a block against the H200's 227 KB)
    the same tiling with two stages, then one (`triton_dispatch.launch_fitting`). Fewer stages only
    change how far ahead the loads run, not the sums: the same bits."""
    if config is not None:
        return launch(config)
    tilings = (chosen, replace(chosen, num_stages=min(chosen.num_stages, 2)), replace(chosen, num_stages=1))
    return launch_fitting(kernel, device, tilings, launch)


def _linear_triton(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   cfg: GemmConfig | None, defer_sum: bool = False, gelu: bool = False) -> torch.Tensor | SplitSums:
    n, k = weight.shape
    a = _rows(h, k)
    m = a.shape[0]

    def launch(cfg: GemmConfig) -> torch.Tensor | SplitSums:
        out = _empty((*h.shape[:-1], n), h.dtype, h.device)
        out2 = out.view(m, n)
        # A split_k larger than K's blocks gives fewer splits.
        per = split_size(k, cfg.split_k, cfg.block_k)
        splits = math.ceil(k / per)
        bias_arg = bias if bias is not None else a  # unused pointer: anything valid
        flags = _flags(a, k, cfg)
        grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m), splits)
        if splits == 1:
            _linear_kernel[grid](a, weight, bias_arg, out2, m, n, k, per,
                                 a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), 0, out2.stride(0),
                                 HAS_BIAS=bias is not None, PARTIAL=False, GELU=gelu, **flags)
            return out
        if gelu:
            raise ValueError("linear: a GELU epilogue needs the whole sums (split_k 1)")
        part = _empty((splits, m, n), torch.float32, h.device)
        _linear_kernel[grid](a, weight, bias_arg, part, m, n, k, per,
                             a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), part.stride(0),
                             part.stride(1), HAS_BIAS=False, PARTIAL=True, GELU=False, **flags)
        if defer_sum and bias is None:
            return SplitSums(part, tuple(out.shape), h.dtype)
        rb_m, rb_n = 16, 128
        _split_k_reduce_kernel[(triton.cdiv(n, rb_n), triton.cdiv(m, rb_m))](
            part, bias_arg, out2, m, n, part.stride(0), part.stride(1), out2.stride(0),
            SPLITS=splits, HAS_BIAS=bias is not None, BLOCK_M=rb_m, BLOCK_N=rb_n, num_warps=4, **launch_options(part),
        )
        return out

    return _fitting("small-M GEMM", h.device, cfg, default_config("gelu" if gelu else "linear", m, n), launch)


def _fold_args(norm: FoldedNorm | None, norm_bias: torch.Tensor | None, a: torch.Tensor,
               rows_per_batch: int) -> tuple[list[object], dict[str, object]]:
    """The consumer kernels' folded-norm arguments: (stats, bias) pointers and their (tiles, width,
    eps, row stride, bias batch stride), and the FOLD / STATS_BLOCK constexprs (unused pointers
    without a norm: anything valid)."""
    if norm is None:
        return [a, a, 1, 1, 0.0, 0, 0], {"FOLD": False, "STATS_BLOCK": 1}
    stats = norm.stats
    nb, s_nbb = _per_batch(norm_bias, a.shape[0] // rows_per_batch, norm_bias.shape[-1])  # a modulation's product
    return ([stats, nb, stats.shape[1], norm.u.shape[-1], float(norm.eps), stats.stride(0), s_nbb],
            {"FOLD": True, "STATS_BLOCK": triton.next_power_of_2(stats.shape[1])})


def _split_buffers(k: int, m: int, width: int, tiles: int, cfg: GemmConfig, tickets: Tickets | None,
                   device: torch.device, fallback: torch.Tensor) -> tuple[int, int, list[object]]:
    """(splits, K per split, [partials, tickets, split stride, row stride]) for a paired-column
    kernel (`_pair_sums`): float32 partials (splits, m, width) and one ticket per tile where K is
    split (`tickets`: where the counters come from; None: a fresh zeroed buffer); unused pointers
    (anything valid) where it is not."""
    per = split_size(k, cfg.split_k, cfg.block_k)
    splits = math.ceil(k / per)
    if splits == 1:
        return 1, per, [fallback, fallback, 0, 0]
    part = _empty((splits, m, width), torch.float32, device)
    ticket = (tickets if tickets is not None else Tickets(device)).take(tiles)
    return splits, per, [part, ticket, part.stride(0), part.stride(1)]


def _geglu_triton(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  cfg: GemmConfig | None, norm: FoldedNorm | None = None,
                  norm_bias: torch.Tensor | None = None, tickets: Tickets | None = None,
                  pre: torch.Tensor | None = None) -> torch.Tensor:
    """`pre`: a (..., 2 H) buffer of h's dtype that also receives the gate/up sums (`LinearGegluFn`)."""
    two_h, k = weight.shape
    hidden = two_h // 2
    a = _rows(h, k)
    m = a.shape[0]
    per_batch = h[0].numel() // k if h.dim() > 1 else m
    (stats, nb, tiles, width, eps, s_stm, s_nbb), fold = _fold_args(norm, norm_bias, a, per_batch)
    pre2 = pre.view(m, two_h) if pre is not None else None

    def launch(cfg: GemmConfig) -> torch.Tensor:
        out = _empty((*h.shape[:-1], hidden), h.dtype, h.device)
        out2 = out.view(m, hidden)
        n_tiles = triton.cdiv(hidden, cfg.block_n) * triton.cdiv(m, cfg.block_m)
        splits, per, (part, ticket, s_ps, s_pm) = _split_buffers(k, m, two_h, n_tiles, cfg, tickets, h.device, out2)
        _linear_geglu_kernel[(n_tiles, splits)](
            a, weight, bias if bias is not None else a, out2, pre2 if pre2 is not None else out2, stats, nb, part,
            ticket, m, hidden, k, per, per_batch, tiles, width, eps,
            a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), out2.stride(0),
            pre2.stride(0) if pre2 is not None else 0, s_stm, s_nbb, s_ps, s_pm,
            HAS_BIAS=bias is not None, SPLITS=splits, SAVE_PRE=pre2 is not None, **fold, **_flags(a, k, cfg),
        )
        return out

    return _fitting("small-M GEMM + GeGLU", h.device, cfg, default_config("geglu", m, hidden), launch)


def _cos_sin_rows(c: torch.Tensor, batch: int, t: int, d: int) -> tuple[torch.Tensor, int, int]:
    """cos or sin (B or 1, 1, T, D) as (B or 1, T, D) with unit column stride, and its (batch,
    token) strides (batch stride 0: one table for every sample)."""
    c3 = c.reshape(c.shape[0], t, d)
    if c3.stride(-1) != 1:
        c3 = c3.contiguous()
    if c3.shape[0] not in (1, batch):
        raise ValueError(f"cos/sin batch {c3.shape[0]} does not broadcast over batch {batch}")
    return c3, (c3.stride(0) if c3.shape[0] > 1 else 0), c3.stride(1)


def _qkv_rope_triton(h: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     num_heads: int, num_kv_heads: int, head_dim: int, bias: torch.Tensor | None,
                     cfg: GemmConfig | None, norm: FoldedNorm | None = None, norm_bias: torch.Tensor | None = None,
                     tickets: Tickets | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, t, k = h.shape
    width = weight.shape[0]
    a = _rows(h, k)
    m = a.shape[0]
    fold_ptrs, fold = _fold_args(norm, norm_bias, a, t)
    cos3, s_cb, s_ct = _cos_sin_rows(cos, b, t, head_dim)
    sin3, s_sb, s_st = _cos_sin_rows(sin, b, t, head_dim)
    half = head_dim // 2

    def launch(cfg: GemmConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = _empty((b, num_heads, t, head_dim), h.dtype, h.device)
        kk = _empty((b, num_kv_heads, t, head_dim), h.dtype, h.device)
        v = _empty((b, num_kv_heads, t, head_dim), h.dtype, h.device)
        tiles = triton.cdiv(half, cfg.block_n)
        n_tiles = (num_heads + 2 * num_kv_heads) * tiles * triton.cdiv(m, cfg.block_m)
        splits, per, (part, ticket, s_ps, s_pm) = _split_buffers(k, m, width, n_tiles, cfg, tickets, h.device, q)
        stats, nb, stiles, swidth, eps, s_stm, s_nbb = fold_ptrs
        _linear_qkv_rope_kernel[(n_tiles, splits)](
            a, weight, bias if bias is not None else a, cos3, sin3, q, kk, v, stats, nb, part, ticket,
            m, k, per, t, num_heads, num_kv_heads, tiles, stiles, swidth, eps,
            a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), s_cb, s_ct, s_sb, s_st, s_stm, s_nbb,
            s_ps, s_pm, HALF=half, HAS_BIAS=bias is not None, SPLITS=splits, **fold, **_flags(a, k, cfg),
        )
        return q, kk, v

    return _fitting("small-M GEMM + RoPE", h.device, cfg, default_config("qkv_rope", m, width), launch)


# -- the ops (dispatched) ----------------------------------------------------------------------------------
def _present(*tensors: torch.Tensor | None) -> list[torch.Tensor]:
    return [t for t in tensors if t is not None]


def linear(h: torch.Tensor, weight: torch.Tensor, backend: str = "reference", *,
           bias: torch.Tensor | None = None, config: GemmConfig | None = None,
           defer_sum: bool = False) -> torch.Tensor | SplitSums:
    """h (..., K) @ weight (N, K)^T (+ bias) -> (..., N) in h.dtype, as `F.linear`. `config`: the
    tiling (None: `CONFIGS` by shape class); its `split_k` > 1 adds a second, reducing kernel.
    `defer_sum`: where the kernels split K (and there is no bias), return the unreduced
    `triton_ops.SplitSums` instead, for a consumer that adds them itself
    (`triton_ops.residual_ada_rms_norm`); elsewhere the tensor as usual. A call needing a
    gradient takes the reference (cuBLAS: the kernel would add a reducing kernel where it splits K)."""
    if not (_use_triton(backend, h, weight, *_present(bias)) and kernel_takes(h, weight, bias)):
        return linear_ref(h, weight, bias)
    return _linear_triton(h, weight, bias, config, defer_sum)


def linear_gelu(h: torch.Tensor, weight: torch.Tensor, backend: str = "reference", *,
                bias: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """gelu_tanh(h @ weight^T + bias) -> (..., N) in h.dtype (`GeluMLP`'s fc1 and activation, as
    SigLIP runs them); one kernel, the activation applied to the float32 sums."""
    if not (_use_triton(backend, h, weight, *_present(bias)) and kernel_takes(h, weight, bias)):
        return linear_gelu_ref(h, weight, bias)
    if config is not None and config.split_k > 1:
        raise ValueError("linear_gelu: split_k > 1 is not supported (GELU needs the whole sums)")
    return _linear_triton(h, weight, bias, config, gelu=True)


def folded_product_ref(norm: FoldedNorm, weight: torch.Tensor, norm_bias: torch.Tensor,
                       bias: torch.Tensor | None = None, cast: bool = True) -> torch.Tensor:
    """The product a folded norm's consumer computes, in float32 and then (with `cast`) rounded to
    u's dtype: (u W^T) rstd + norm_bias (+ bias), i.e. (rms_norm(r) (1 + scale) + shift) W^T up to
    rounding when norm_bias = shift W^T (`triton_ops.FoldedNorm`). norm_bias (B or 1, N) float32."""
    u = norm.u
    y = F.linear(u.float(), weight.float()) * norm.rstd().view(*u.shape[:-1], 1)
    y = y + norm_bias.float().view(norm_bias.shape[0], *([1] * (u.dim() - 2)), -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(u.dtype) if cast else y


def _check_norm(name: str, h: torch.Tensor, norm: FoldedNorm | None, norm_bias: torch.Tensor | None,
                n: int) -> None:
    if norm is None:
        if norm_bias is not None:
            raise ValueError(f"{name}: norm_bias without norm")
        return
    if norm.u.shape != h.shape:
        raise ValueError(f"{name}: h {tuple(h.shape)} is not the folded norm's u {tuple(norm.u.shape)}")
    if norm_bias is None or norm_bias.dim() != 2 or norm_bias.shape[1] != n or norm_bias.dtype != torch.float32:
        got = None if norm_bias is None else (tuple(norm_bias.shape), norm_bias.dtype)
        raise ValueError(f"{name}: norm_bias (B or 1, {n}) float32 expected with norm=, got {got}")
    if norm.stats.shape[0] != h.numel() // h.shape[-1] or norm.stats.dtype != torch.float32:
        raise ValueError(f"{name}: norm stats {tuple(norm.stats.shape)} {norm.stats.dtype} for {h.numel() // h.shape[-1]} rows")


def linear_geglu(h: torch.Tensor, weight: torch.Tensor, backend: str = "reference", *,
                 bias: torch.Tensor | None = None, config: GemmConfig | None = None,
                 norm: FoldedNorm | None = None, norm_bias: torch.Tensor | None = None,
                 tickets: Tickets | None = None) -> torch.Tensor:
    """gelu_tanh(h @ Wg^T) * (h @ Wu^T) for h (..., K) and the fused gate/up weight (2 H, K) (gate
    rows first, as `GatedMLP.fuse` concatenates them) -> (..., H) in h.dtype; one kernel, the
    activation applied to the float32 sums. `norm` (h being its u) with `norm_bias` (B or 1, 2 H)
    = shift W^T: the input's adaptive norm finished on the sums (`triton_ops.FoldedNorm`). A tiling
    with `split_k` > 1 splits K: the last split of each tile adds the float32 partials in split order
    and runs the epilogue (`tickets`: as `triton_fold.linear_residual_fold`'s). A call needing h's
    gradient runs `LinearGegluFn` (no norm; see `set_fused_vjp_forward`)."""
    if weight.dim() == 2 and weight.shape[0] % 2:
        raise ValueError(f"linear_geglu: the fused gate/up weight has an odd row count {weight.shape[0]}")
    _check_norm("linear_geglu", h, norm, norm_bias, weight.shape[0])
    grad = needs_grad(h)
    if (not (_use_triton(backend, h, weight, *_present(bias), differentiable=grad and _FUSED_VJP_FORWARD)
             and kernel_takes(h, weight, bias)) or needs_grad(weight, bias) or (grad and norm is not None)):
        if norm is not None:
            return geglu_ref(folded_product_ref(norm, weight, norm_bias, bias))
        return linear_geglu_ref(h, weight, bias)
    if grad:
        return LinearGegluFn.apply(h, weight, bias, config, tickets)
    return _geglu_triton(h, weight, bias, config, norm, norm_bias, tickets)


def linear_qkv_rope(
    h: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
    num_kv_heads: int, head_dim: int, backend: str = "reference", *, bias: torch.Tensor | None = None,
    config: GemmConfig | None = None, norm: FoldedNorm | None = None, norm_bias: torch.Tensor | None = None,
    tickets: Tickets | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused QKV projection of h (B, T, K) by weight ((H + 2 Hkv) D, K) with RoPE on q and k:
    the contract of `qkv_rope_ref(F.linear(h, weight), cos, sin, H, Hkv, D)` (q (B, H, T, D); k, v
    (B, Hkv, T, D)); cos, sin (B or 1, 1, T, D) as `rope_cos_sin` makes them. The kernel's q, k
    and v are contiguous (the reference's v is a view). `norm` / `norm_bias`, split K and `tickets`:
    as `linear_geglu`'s. A call needing h's gradient runs `LinearQkvRopeFn` (no norm; see
    `set_fused_vjp_forward`)."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    if h.dim() != 3:
        raise ValueError(f"linear_qkv_rope: h (B, T, K) expected, got shape {tuple(h.shape)}")
    if weight.dim() == 2 and weight.shape[0] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv weight rows {weight.shape[0]} != (heads + 2 kv heads) * head_dim")
    _check_norm("linear_qkv_rope", h, norm, norm_bias, weight.shape[0])
    grad = needs_grad(h)
    if (not (_use_triton(backend, h, weight, cos, sin, *_present(bias), differentiable=grad and _FUSED_VJP_FORWARD)
             and kernel_takes(h, weight, bias)) or needs_grad(weight, cos, sin, bias) or (grad and norm is not None)):
        if norm is not None:
            return qkv_rope_ref(folded_product_ref(norm, weight, norm_bias, bias), cos, sin, num_heads, num_kv_heads,
                                head_dim)
        return linear_qkv_rope_ref(h, weight, cos, sin, num_heads, num_kv_heads, head_dim, bias)
    if grad:
        return LinearQkvRopeFn.apply(h, weight, cos, sin, num_heads, num_kv_heads, head_dim, bias, config, tickets)
    return _qkv_rope_triton(h, weight, cos, sin, num_heads, num_kv_heads, head_dim, bias, config, norm, norm_bias,
                            tickets)


# -- exact RTC guidance: the forward's fused projections, differentiable ------------------------------
# Exact guidance takes a vector-Jacobian product through every denoise step: at batch 1 a step of ~400
# short kernels. QKV + RoPE and gate/up + GeGLU on their fused kernels are two kernels a block fewer
# than each GEMM and its elementwise kernel apart; their backward is the elementwise gradient kernel,
# then the input gradient as one cuBLAS GEMM (dh = dy W: the small-M kernel on the transposed weight
# was no faster, RESULTS.md). On an H100 (2026-12-05), batch 1, engines alternated: a guided chunk
# 28.98 -> 28.54 ms, the loop -2.0% (about 1.2 us for each of the 360 kernels a chunk removed).
_FUSED_VJP_FORWARD = True


def set_fused_vjp_forward(on: bool) -> bool:
    """Whether a call needing its input's gradient (exact RTC guidance) runs QKV + RoPE and gate/up +
    GeGLU forward on their fused small-M kernels (`LinearQkvRopeFn`, `LinearGegluFn`; the default)
    instead of cuBLAS and the elementwise kernel. Applies to graphs captured from now on; returns the
    previous setting."""
    global _FUSED_VJP_FORWARD
    before, _FUSED_VJP_FORWARD = _FUSED_VJP_FORWARD, bool(on)
    return before


def _input_grad(dout: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dh = dout (..., N) @ weight (N, K): a projection's input gradient."""
    return torch.matmul(dout.to(weight.dtype), weight)


class LinearQkvRopeFn(torch.autograd.Function):
    """`linear_qkv_rope` on its fused kernel, differentiable in h: RoPE's transpose
    (`triton_grad.rope_grad`, the rotation back, packed as the projection's output), then the
    projection's input gradient."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                num_heads: int, num_kv_heads: int, head_dim: int, bias: torch.Tensor | None,
                config: GemmConfig | None, tickets: Tickets | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(weight, cos, sin)
        return _qkv_rope_triton(h, weight, cos, sin, num_heads, num_kv_heads, head_dim, bias, config,
                                tickets=tickets)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight, cos, sin = ctx.saved_tensors
        dqkv = triton_grad.rope_grad(dq, dk, dv, cos, sin, weight.dtype)
        return (_input_grad(dqkv, weight), *([None] * 9))


class LinearGegluFn(torch.autograd.Function):
    """`linear_geglu` on its fused kernel, differentiable in h: the kernel also stores the gate/up
    sums (rounded to h's dtype) that GeGLU's gradient reads (`triton_grad.geglu_grad`), then the
    projection's input gradient."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                config: GemmConfig | None, tickets: Tickets | None) -> torch.Tensor:
        pre = _empty((*h.shape[:-1], weight.shape[0]), h.dtype, h.device)
        out = _geglu_triton(h, weight, bias, config, tickets=tickets, pre=pre)
        ctx.save_for_backward(weight, pre)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight, pre = ctx.saved_tensors
        return _input_grad(triton_grad.geglu_grad(pre, dout), weight), None, None, None, None
