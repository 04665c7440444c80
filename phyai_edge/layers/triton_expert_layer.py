"""The action expert's adaptive Gemma block as one persistent Triton kernel at batch 1, beside
the per-op kernels it would replace. Measured slower on the H200: off by default (`set_enabled`).

The idea: at batch 1 a PI0.5 denoise step runs 18 blocks of ~8 dependent kernels each (QKV +
RoPE, attention, o_proj, residual + norm, gate/up + GeGLU, down, residual + norm), 0.82 ms a
step against a 0.16 ms weight-streaming floor. Here one launch runs a whole block: one program
per SM walks the block's seven phases, each phase's tiles spread over the programs, with a
grid-wide barrier between phases:
  A  q, k, v = rope(h @ Wqkv^T)                      tiles: (H + 2 Hkv) heads x column tiles
  B  ao = attention(q, [cached prefix k, k], ...)     tiles: (B x Hkv) x blocks of folded query rows
  C  split-K partials of ao @ Wo^T                     tiles: column tiles x splits
  D  x += gate_in * sum(partials); h = adanorm(x)      tiles: rows
  E  act = gelu_tanh(h @ Wg^T) * (h @ Wu^T)            tiles: column tiles
  F  split-K partials of act @ Wd^T                    tiles: column tiles x splits
  G  x += gate_post * sum(partials); h = next adanorm  tiles: rows
(x: M = B x T rows, W wide; h: the block's normed input.) C/D and F/G add the partials in split
order and round as `triton_ops.residual_ada_rms_norm` does with `SplitSums`; the attention is one
pass over all keys per block of query rows (key splits would need one more barrier to merge).

What the H200 said (2026-12-03, `benchmarks/expert_layer_gpu.py`, RESULTS.md): 18 blocks, 50 rows,
816 prefix keys, in CUDA graphs: per-op kernels 825 us, this kernel 1292 us (bit-identical to its
phases launched one by one, 1212 us). A grid barrier costs 1.71 us where a kernel boundary in a
CUDA graph costs 0.77 us (an empty kernel), so the 108 barriers cost more than the launches they
replace; the one-pass attention phase takes 30 us a block against the split kernel's 13.5; and
idle programs prefetching the next phases' weights to L2 made it slower (1523 us, removed). A
persistent kernel would have to overlap phases (per-tile dependencies instead of barriers) to
win; this one is kept as the measured baseline for that, tested, and off.

Barriers need every program resident at once: the launch has at most one program per SM and a
program fits an SM, so on an otherwise idle GPU all are resident, and a kernel of another stream
only delays the late programs until it ends. Two of these kernels running at once could each wait
for SMs the other holds: run it from one stream. Under Triton's CPU interpreter (programs run one
after another: a barrier would never open) and with `persistent=False`, the same kernel runs one
launch per phase: the tests use that, and the GPU benchmark checks the two agree bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from phyai_edge.layers.norm import Modulation
from phyai_edge.layers.triton_attention import _sm_count
from phyai_edge.layers.triton_dispatch import interpret_mode, tl, triton
from phyai_edge.layers.triton_gemm import _cos_sin_rows, split_size
from phyai_edge.layers.triton_ops import _per_batch, ada_rms_norm

MAX_ROWS = 64  # one 64-row tile (wgmma's height) holds a batch-1 step's 50 rows
DTYPES = (torch.bfloat16, torch.float16)
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PHASES = 7
_ENABLED = False  # measured slower than the per-op kernels (module docstring)


def set_enabled(on: bool) -> bool:
    """Route `adaptive_block_stack` through the persistent block (True) or the per-op kernels
    (False, the default); returns the previous setting (benchmarks time both)."""
    global _ENABLED
    before, _ENABLED = _ENABLED, bool(on)
    return before


def enabled() -> bool:
    return _ENABLED


@dataclass(frozen=True)
class LayerTiles:
    """The tiling of each phase. `qkv_n`: columns of each rotary half per QKV tile; `o_n`, `down_n`:
    output columns per split-K tile and `o_split`, `down_split` the K splits; `gu_n`: GeGLU output
    columns per tile (two accumulators: gate and up); `attn_m` / `attn_n`: folded query rows and
    keys per attention block. The GEMM tiles are the per-op kernels' batch-1 tiles
    (`triton_gemm.CONFIGS["*/m64*"]`), so phases C and F add the same partials in the same order."""

    qkv_n: int = 16
    attn_m: int = 16
    attn_n: int = 64
    o_n: int = 32
    o_split: int = 4
    gu_n: int = 32
    down_n: int = 32
    down_split: int = 4
    block_k: int = 128
    warps: int = 4
    stages: int = 3

    def __post_init__(self) -> None:
        for name in ("qkv_n", "attn_m", "attn_n", "o_n", "gu_n", "down_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"LayerTiles.{name}={v}: tl.dot needs a power of two >= 16")
        if min(self.o_split, self.down_split, self.warps, self.stages) < 1:
            raise ValueError(f"LayerTiles {self}: splits, warps and stages must be >= 1")


DEFAULT_TILES = LayerTiles()


# -- the rule callers apply --------------------------------------------------------------------------
def takes(blocks: Sequence[nn.Module], x: torch.Tensor, mask: torch.Tensor, dtypes=DTYPES) -> bool:
    """Whether the persistent block can run this stack: x (B, T, W) with B x T <= MAX_ROWS in one of
    `dtypes`; every block's QKV and gate/up fused, all four projections plain bias-free
    `nn.Linear`s of x's dtype; a head size that is an even power of two <= 256; a key-only mask."""
    if x.dim() != 3 or not 0 < x.shape[0] * x.shape[1] <= MAX_ROWS or x.dtype not in dtypes:
        return False
    if not (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1):
        return False
    for block in blocks:
        attn, mlp = block.self_attn, block.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up, mlp.down_proj)
        if any(type(lin) is not nn.Linear or lin.bias is not None or lin.weight.dtype != x.dtype for lin in linears):
            return False
        d = attn.head_dim
        if d < 16 or d > 256 or d & (d - 1) or attn.num_heads % attn.num_kv_heads:
            return False
    return True


# -- kernels ---------------------------------------------------------------------------------------------
if triton is not None:
    from phyai_edge.layers.triton_attention import _attend_block
    from phyai_edge.layers.triton_gemm import _mma
    from phyai_edge.layers.triton_math import _gelu_tanh, _keys_allowed, _rope

    @triton.jit
    def _grid_sync(bar_ptr, n_programs):
        """Wait until every program of the launch has arrived. bar_ptr[0] counts arrivals in the
        current round, bar_ptr[1] counts rounds. The last to arrive puts the count back to 0 and
        then (release) advances the round; the others spin (acquire) until the round they saw on
        arrival has passed. Both words stay consistent between launches. (Spinning on volatile
        loads instead of atomics measured the same: 1.78 vs 1.71 us a barrier.)"""
        tl.debug_barrier()  # every warp's stores issued before this program's arrival
        gen = tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")
        arrived = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == n_programs - 1:
            tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_add(bar_ptr + 1, 1, sem="release", scope="gpu")
        else:
            cur = gen
            while cur == gen:
                cur = tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()

    @triton.jit
    def _phase_qkv(tile, h_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
                   M, K, T, NH, NKV, s_cb, s_ct, s_sb, s_st,
                   HALF: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                   EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """Phase A, one tile: columns [j BN, (j+1) BN) of both rotary halves of one head of
        h @ Wqkv^T, rotated (q and k heads), stored to q (B, NH, T, D) / k, v (B, NKV, T, D)."""
        per_half = tl.cdiv(HALF, BN)
        head = tile // per_half
        d = (tile % per_half) * BN + tl.arange(0, BN)
        rm = tl.arange(0, BM)
        rk = tl.arange(0, BK)
        m_ok = rm < M
        d_ok = d < HALF
        row1 = head * (2 * HALF) + d
        acc1 = tl.zeros([BM, BN], tl.float32)
        acc2 = tl.zeros([BM, BN], tl.float32)
        for k in range(0, K, BK):
            kk = k + rk
            if EVEN_K:
                a_mask = m_ok[:, None]
                w_mask = d_ok[None, :]
            else:
                a_mask = m_ok[:, None] & (kk < K)[None, :]
                w_mask = d_ok[None, :] & (kk < K)[:, None]
            a = tl.load(h_ptr + rm[:, None] * K + kk[None, :], mask=a_mask, other=0.0, cache_modifier=".cg")
            w1 = tl.load(w_ptr + row1[None, :] * K + kk[:, None], mask=w_mask, other=0.0)
            w2 = tl.load(w_ptr + (row1 + HALF)[None, :] * K + kk[:, None], mask=w_mask, other=0.0)
            acc1 = _mma(a, w1, acc1, UPCAST, IEEE)
            acc2 = _mma(a, w2, acc2, UPCAST, IEEE)
        b = rm // T
        t = rm % T
        ok = m_ok[:, None] & d_ok[None, :]
        cs = cos_ptr + (b * s_cb + t * s_ct)[:, None] + d[None, :]
        sn = sin_ptr + (b * s_sb + t * s_st)[:, None] + d[None, :]
        r1, r2 = _rope(acc1, acc2, cs, sn, ok, HALF)
        rotate = head < NH + NKV  # v heads are not rotated
        o1 = tl.where(rotate, r1, acc1)
        o2 = tl.where(rotate, r2, acc2)
        if head < NH:
            dst = q_ptr + ((b * NH + head) * T + t)[:, None] * (2 * HALF) + d[None, :]
        elif head < NH + NKV:
            dst = k_ptr + ((b * NKV + head - NH) * T + t)[:, None] * (2 * HALF) + d[None, :]
        else:
            dst = v_ptr + ((b * NKV + head - NH - NKV) * T + t)[:, None] * (2 * HALF) + d[None, :]
        tl.store(dst, o1.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, o2.to(q_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _phase_attention(tile, q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, mask_ptr, ao_ptr,
                         T, TP, NH, NKV, scale_log2, skc_b, skc_h, skc_n, svc_b, svc_h, svc_n, sm_b,
                         D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr,
                         IEEE: tl.constexpr):
        """Phase B, one tile: a block of BM folded query rows (the NH / NKV query heads of one KV
        head, head-major: row g T + t) of one sample against the cached prefix keys (masked) and
        the step's own keys, one online-softmax pass; out to ao (B, T, NH, D) rows."""
        group = NH // NKV
        rows = group * T
        blocks = tl.cdiv(rows, BM)
        bh = tile // blocks
        b = bh // NKV
        h = bh % NKV
        r = (tile % blocks) * BM + tl.arange(0, BM)
        d = tl.arange(0, D)
        live = r < rows
        q = tl.load(q_ptr + ((b * NH + h * group) * T + r)[:, None] * D + d[None, :], mask=live[:, None], other=0.0,
                    cache_modifier=".cg")
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BM], -1.0e30, tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for n0 in range(0, TP, BN):
            c = n0 + tl.arange(0, BN)
            inb = c < TP
            kt = tl.load(kc_ptr + b * skc_b + h * skc_h + c[None, :] * skc_n + d[:, None], mask=inb[None, :], other=0.0)
            vb = tl.load(vc_ptr + b * svc_b + h * svc_h + c[:, None] * svc_n + d[None, :], mask=inb[:, None], other=0.0)
            ok = _keys_allowed(mask_ptr, b, sm_b, c, TP)
            m_i, l_i, acc = _attend_block(q, kt, vb, ok, m_i, l_i, acc, scale_log2, UPCAST, IEEE)
        own = (b * NKV + h) * T
        for n0 in range(0, T, BN):
            c = n0 + tl.arange(0, BN)
            inb = c < T
            kt = tl.load(k_ptr + (own + c)[None, :] * D + d[:, None], mask=inb[None, :], other=0.0,
                         cache_modifier=".cg")
            vb = tl.load(v_ptr + (own + c)[:, None] * D + d[None, :], mask=inb[:, None], other=0.0,
                         cache_modifier=".cg")
            ok = _keys_allowed(mask_ptr, b, sm_b, TP + c, TP + T)
            m_i, l_i, acc = _attend_block(q, kt, vb, ok, m_i, l_i, acc, scale_log2, UPCAST, IEEE)
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        g = r // T
        t = r % T
        dst = ao_ptr + ((b * T + t) * NH + h * group + g)[:, None] * D + d[None, :]
        tl.store(dst, out.to(ao_ptr.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _phase_split_linear(tile, a_ptr, w_ptr, part_ptr, M, N, K, k_per_split,
                            BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                            UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """Phases C and F, one tile: columns of one split of K of a (M, K) @ w (N, K)^T, as float32
        partials at part[split] (M, N)."""
        tiles_n = tl.cdiv(N, BN)
        split = tile // tiles_n
        rn = (tile % tiles_n) * BN + tl.arange(0, BN)
        rm = tl.arange(0, BM)
        rk = tl.arange(0, BK)
        m_ok = rm < M
        n_ok = rn < N
        k0 = split * k_per_split
        k_end = tl.minimum(k0 + k_per_split, K)
        acc = tl.zeros([BM, BN], tl.float32)
        for k in range(k0, k_end, BK):
            kk = k + rk
            if EVEN_K:
                a_mask = m_ok[:, None]
                w_mask = n_ok[None, :]
            else:
                a_mask = m_ok[:, None] & (kk < k_end)[None, :]
                w_mask = n_ok[None, :] & (kk < k_end)[:, None]
            a = tl.load(a_ptr + rm[:, None] * K + kk[None, :], mask=a_mask, other=0.0, cache_modifier=".cg")
            w = tl.load(w_ptr + rn[None, :] * K + kk[:, None], mask=w_mask, other=0.0)
            acc = _mma(a, w, acc, UPCAST, IEEE)
        tl.store(part_ptr + (split * M + rm)[:, None] * N + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _phase_residual_norm(row, xin_ptr, xout_ptr, part_ptr, gate_ptr, scale_ptr, shift_ptr, h_ptr,
                             M, W, T, eps, s_gate, s_scale, s_shift,
                             SPLITS: tl.constexpr, BLOCK_W: tl.constexpr):
        """Phases D and G, one row: x += gate * (the partials summed in split order, rounded to x's
        dtype), stored rounded; h = rms_norm(x) * (1 + scale) + shift (the sample's modulation)."""
        b = row // T
        cols = tl.arange(0, BLOCK_W)
        m = cols < W
        x = tl.load(xin_ptr + row * W + cols, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        y = tl.zeros([BLOCK_W], tl.float32)
        for s in tl.static_range(SPLITS):
            y += tl.load(part_ptr + (s * M + row) * W + cols, mask=m, other=0.0, cache_modifier=".cg")
        y = y.to(xout_ptr.dtype.element_ty).to(tl.float32)
        g = tl.load(gate_ptr + b * s_gate + cols, mask=m, other=0.0).to(tl.float32)
        r = (x + y * g).to(xout_ptr.dtype.element_ty)
        tl.store(xout_ptr + row * W + cols, r, mask=m)
        x = r.to(tl.float32)
        inv = tl.rsqrt((tl.sum(x * x, axis=0) / W + eps).to(tl.float32))
        sc = tl.load(scale_ptr + b * s_scale + cols, mask=m, other=0.0).to(tl.float32)
        sh = tl.load(shift_ptr + b * s_shift + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * W + cols, (x * inv * (1.0 + sc) + sh).to(h_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _phase_geglu(tile, h_ptr, w_ptr, act_ptr, M, F, K,
                     BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                     UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """Phase E, one tile: columns of gelu_tanh(h @ Wg^T) * (h @ Wu^T), Wg / Wu the first / last F
        rows of the fused weight."""
        rn = tile * BN + tl.arange(0, BN)
        rm = tl.arange(0, BM)
        rk = tl.arange(0, BK)
        m_ok = rm < M
        n_ok = rn < F
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        for k in range(0, K, BK):
            kk = k + rk
            if EVEN_K:
                a_mask = m_ok[:, None]
                w_mask = n_ok[None, :]
            else:
                a_mask = m_ok[:, None] & (kk < K)[None, :]
                w_mask = n_ok[None, :] & (kk < K)[:, None]
            a = tl.load(h_ptr + rm[:, None] * K + kk[None, :], mask=a_mask, other=0.0, cache_modifier=".cg")
            wg = tl.load(w_ptr + rn[None, :] * K + kk[:, None], mask=w_mask, other=0.0)
            wu = tl.load(w_ptr + (F + rn)[None, :] * K + kk[:, None], mask=w_mask, other=0.0)
            acc_g = _mma(a, wg, acc_g, UPCAST, IEEE)
            acc_u = _mma(a, wu, acc_u, UPCAST, IEEE)
        out = _gelu_tanh(acc_g) * acc_u
        tl.store(act_ptr + rm[:, None] * F + rn[None, :], out.to(act_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _expert_layer_kernel(
        xin_ptr, xout_ptr, h_ptr, wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr,
        cos_ptr, sin_ptr, kc_ptr, vc_ptr, mask_ptr,
        q_ptr, k_ptr, v_ptr, ao_ptr, act_ptr, part_ptr, bar_ptr,
        gin_ptr, sc2_ptr, sh2_ptr, gpost_ptr, scn_ptr, shn_ptr,
        M, W, T, TP, NH, NKV, F, o_per_split, d_per_split, eps2, eps_next, scale_log2,
        s_cb, s_ct, s_sb, s_st, skc_b, skc_h, skc_n, svc_b, svc_h, svc_n, sm_b,
        s_gin, s_sc2, s_sh2, s_gpost, s_scn, s_shn,
        FIRST: tl.constexpr, LAST: tl.constexpr, SYNC: tl.constexpr,
        D: tl.constexpr, QKV_N: tl.constexpr, ATT_M: tl.constexpr, ATT_N: tl.constexpr,
        O_N: tl.constexpr, O_SPLIT: tl.constexpr, GU_N: tl.constexpr, D_N: tl.constexpr, D_SPLIT: tl.constexpr,
        BM: tl.constexpr, BK: tl.constexpr, BLOCK_W: tl.constexpr,
        EVEN_W: tl.constexpr, EVEN_HD: tl.constexpr, EVEN_F: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Phases FIRST..LAST of one block (see the module docstring), a grid-wide barrier between
        consecutive phases when SYNC. Each phase's tiles are spread over the programs in turn."""
        pid = tl.program_id(0)
        npr = tl.num_programs(0)
        HALF: tl.constexpr = D // 2
        qkv_tiles = (NH + 2 * NKV) * tl.cdiv(HALF, QKV_N)
        att_tiles = (M // T) * NKV * tl.cdiv((NH // NKV) * T, ATT_M)
        if FIRST <= 0 and LAST >= 0:
            for tile in range(pid, qkv_tiles, npr):
                _phase_qkv(tile, h_ptr, wqkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
                           M, W, T, NH, NKV, s_cb, s_ct, s_sb, s_st,
                           HALF, QKV_N, BM, BK, EVEN_W, UPCAST, IEEE)
        if SYNC and FIRST <= 0 and LAST >= 1:
            _grid_sync(bar_ptr, npr)
        if FIRST <= 1 and LAST >= 1:
            for tile in range(pid, att_tiles, npr):
                _phase_attention(tile, q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, mask_ptr, ao_ptr,
                                 T, TP, NH, NKV, scale_log2, skc_b, skc_h, skc_n, svc_b, svc_h, svc_n, sm_b,
                                 D, ATT_M, ATT_N, UPCAST, IEEE)
        if SYNC and FIRST <= 1 and LAST >= 2:
            _grid_sync(bar_ptr, npr)
        if FIRST <= 2 and LAST >= 2:
            for tile in range(pid, tl.cdiv(W, O_N) * tl.cdiv(NH * D, o_per_split), npr):
                _phase_split_linear(tile, ao_ptr, wo_ptr, part_ptr, M, W, NH * D, o_per_split,
                                    O_N, BM, BK, EVEN_HD, UPCAST, IEEE)
        if SYNC and FIRST <= 2 and LAST >= 3:
            _grid_sync(bar_ptr, npr)
        if FIRST <= 3 and LAST >= 3:
            for row in range(pid, M, npr):
                _phase_residual_norm(row, xin_ptr, xout_ptr, part_ptr, gin_ptr, sc2_ptr, sh2_ptr, h_ptr,
                                     M, W, T, eps2, s_gin, s_sc2, s_sh2, O_SPLIT, BLOCK_W)
        if SYNC and FIRST <= 3 and LAST >= 4:
            _grid_sync(bar_ptr, npr)
        if FIRST <= 4 and LAST >= 4:
            for tile in range(pid, tl.cdiv(F, GU_N), npr):
                _phase_geglu(tile, h_ptr, wgu_ptr, act_ptr, M, F, W, GU_N, BM, BK, EVEN_W, UPCAST, IEEE)
        if SYNC and FIRST <= 4 and LAST >= 5:
            _grid_sync(bar_ptr, npr)
        if FIRST <= 5 and LAST >= 5:
            for tile in range(pid, tl.cdiv(W, D_N) * tl.cdiv(F, d_per_split), npr):
                _phase_split_linear(tile, act_ptr, wd_ptr, part_ptr, M, W, F, d_per_split,
                                    D_N, BM, BK, EVEN_F, UPCAST, IEEE)
        if SYNC and FIRST <= 5 and LAST >= 6:
            _grid_sync(bar_ptr, npr)
        if FIRST <= 6 and LAST >= 6:
            for row in range(pid, M, npr):
                _phase_residual_norm(row, xout_ptr, xout_ptr, part_ptr, gpost_ptr, scn_ptr, shn_ptr, h_ptr,
                                     M, W, T, eps_next, s_gpost, s_scn, s_shn, D_SPLIT, BLOCK_W)


# -- launcher ----------------------------------------------------------------------------------------------
def persistent_block_stack(
    blocks: Sequence[nn.Module],
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_mask: torch.Tensor,
    modulations: Sequence[tuple[Modulation, Modulation]],
    final: Modulation,
    final_eps: float,
    persistent: bool | None = None,
    tiles: LayerTiles = DEFAULT_TILES,
    programs: int | None = None,
    phases: Sequence[int] | None = None,
) -> torch.Tensor:
    """`fused_stacks.adaptive_block_stack`'s contract (returns the final norm's output) on one
    kernel launch per block. `key_mask`: (B, prefix + T) uint8, `triton_attention.kernel_key_mask`
    of the stack's mask. `persistent`: one launch per block with barriers (None: on a GPU; the
    interpreter cannot run it), else one launch per phase. `programs`: the persistent launch's size (None: one per
    SM; never more than the SMs). `phases`: with persistent=False, launch only these (a benchmark
    timing one phase; the output is then not the stack's). Needs `takes(blocks, x, mask)` for kernel dtypes."""
    if persistent is None:
        persistent = x.is_cuda and not interpret_mode()
    if persistent and not x.is_cuda:
        raise RuntimeError("the persistent block needs a CUDA device (its barrier would never open in the "
                           "interpreter, which runs programs one after another); use persistent=False")
    b, t, w = x.shape
    m = b * t
    if m > MAX_ROWS or not blocks:
        raise ValueError(f"persistent block: {m} rows (at most {MAX_ROWS}) and {len(blocks)} blocks")
    attn0, mlp0 = blocks[0].self_attn, blocks[0].mlp
    nh, nkv, d = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
    f = mlp0.down_proj.in_features
    tp = k_cache.shape[-2]
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("persistent block: the KV cache needs unit stride along the head dimension")
    if key_mask.shape != (b, tp + t) or key_mask.dtype != torch.uint8:
        raise ValueError(f"key_mask: (B, prefix + T) = {(b, tp + t)} uint8 expected, got {tuple(key_mask.shape)} "
                         f"{key_mask.dtype}")
    dev, dt = x.device, x.dtype
    x_in = x.reshape(m, w)
    if not x_in.is_contiguous():
        x_in = x_in.contiguous()
    scale0, shift0, _ = modulations[0][0]
    h = ada_rms_norm(x, scale0, shift0, blocks[0].input_layernorm.eps, "triton").reshape(m, w)
    res = torch.empty_like(x_in)
    q = torch.empty((b, nh, t, d), dtype=dt, device=dev)
    ks = torch.empty((b, nkv, t, d), dtype=dt, device=dev)
    vs = torch.empty_like(ks)
    ao = torch.empty((m, nh * d), dtype=dt, device=dev)
    act = torch.empty((m, f), dtype=dt, device=dev)
    part = torch.empty((max(tiles.o_split, tiles.down_split), m, w), dtype=torch.float32, device=dev)
    cos3, s_cb, s_ct = _cos_sin_rows(cos, b, t, d)
    sin3, s_sb, s_st = _cos_sin_rows(sin, b, t, d)
    bk = tiles.block_k
    o_per = split_size(nh * d, tiles.o_split, bk)
    d_per = split_size(f, tiles.down_split, bk)
    o_splits, d_splits = math.ceil(nh * d / o_per), math.ceil(f / d_per)
    upcast = interpret_mode()
    flags = dict(
        D=d, QKV_N=tiles.qkv_n, ATT_M=tiles.attn_m,
        ATT_N=tiles.attn_n, O_N=tiles.o_n, O_SPLIT=o_splits, GU_N=tiles.gu_n, D_N=tiles.down_n, D_SPLIT=d_splits,
        BM=MAX_ROWS if m > 16 else 16, BK=bk, BLOCK_W=triton.next_power_of_2(w),
        EVEN_W=w % bk == 0, EVEN_HD=(nh * d) % bk == 0 and o_per % bk == 0, EVEN_F=f % bk == 0 and d_per % bk == 0,
        UPCAST=upcast, IEEE=dt == torch.float32, num_warps=tiles.warps, num_stages=tiles.stages,
    )
    # Tiles per phase (for the phase-by-phase launches' grids).
    phase_tiles = (
        (nh + 2 * nkv) * triton.cdiv(d // 2, tiles.qkv_n),
        b * nkv * triton.cdiv((nh // nkv) * t, tiles.attn_m),
        triton.cdiv(w, tiles.o_n) * o_splits,
        m,
        triton.cdiv(f, tiles.gu_n),
        triton.cdiv(w, tiles.down_n) * d_splits,
        m,
    )
    size = min(programs or _sm_count(dev), _sm_count(dev)) if persistent else 0
    # Two barrier words per block launch, zeroed here (inside a captured graph: at every replay);
    # each launch leaves its pair consistent, but a fresh zero costs one memset a stack.
    words = torch.zeros(2 * len(blocks), dtype=torch.int32, device=dev) if persistent else part
    for i, block in enumerate(blocks):
        attn, mlp = block.self_attn, block.mlp
        (_, _, gate_in), (scale2, shift2, gate_post) = modulations[i]
        if i + 1 < len(blocks):
            next_scale, next_shift, _ = modulations[i + 1][0]
            eps_next = blocks[i + 1].input_layernorm.eps
        else:
            next_scale, next_shift, _ = final
            eps_next = final_eps
        gin, s_gin = _per_batch(gate_in, b, w)
        sc2, s_sc2 = _per_batch(scale2, b, w)
        sh2, s_sh2 = _per_batch(shift2, b, w)
        gpost, s_gpost = _per_batch(gate_post, b, w)
        scn, s_scn = _per_batch(next_scale, b, w)
        shn, s_shn = _per_batch(next_shift, b, w)
        kc, vc = k_cache[i], v_cache[i]
        args = (
            x_in if i == 0 else res, res, h, attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up.weight,
            mlp.down_proj.weight, cos3, sin3, kc, vc, key_mask,
            q, ks, vs, ao, act, part, words[2 * i:2 * i + 2] if persistent else part,
            gin, sc2, sh2, gpost, scn, shn,
            m, w, t, tp, nh, nkv, f, o_per, d_per,
            float(block.post_attention_layernorm.eps), float(eps_next), (1.0 / math.sqrt(d)) * 1.4426950408889634,
            s_cb, s_ct, s_sb, s_st, kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1),
            vc.stride(2), key_mask.stride(0),
            s_gin, s_sc2, s_sh2, s_gpost, s_scn, s_shn,
        )
        if persistent:
            _expert_layer_kernel[(size,)](*args, FIRST=0, LAST=PHASES - 1, SYNC=True, **flags)
        else:
            for phase in range(PHASES) if phases is None else phases:
                _expert_layer_kernel[(phase_tiles[phase],)](*args, FIRST=phase, LAST=phase, SYNC=False, **flags)
    return h.view(b, t, w)
