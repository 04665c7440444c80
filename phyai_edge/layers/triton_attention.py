"""Split-KV attention for short query blocks over a long cached prefix (a Triton kernel), beside
its reference.

Why: in a PI0.5 denoise step the action expert's 50 query tokens attend to ~870 keys (the cached
prefix and themselves) through 8 query heads sharing one KV head. Folded into the query axis that
is 400 rows against one KV head: a flash-style kernel tiles it into ~7 programs, so one call uses
7 of the H200's 132 SMs and took ~51 us (55% of a compiled step at batch 1, measured with
`benchmarks/pi05_profile.py`). Splitting the keys across programs (flash-decoding) fills the
GPU: each program reduces its own key range to a partial output and log-sum-exp, and the last
program of a query block to finish merges the partials (or, per tiling, a second small kernel
does). With one split the kernel writes the output directly, which is what every shape but the
expert's batch 1-2 uses: there are enough query blocks, and each extra split re-reads keys and
writes partials (`default_config` has the measurements). Reading the keys as two parts also saves
SDPA's concatenation, and folding the query heads reads each KV block once for all of them: on
the H200 the kernel beat SDPA (cuDNN's flash kernel plus the concatenation) at every PI0.5 shape
timed, the expert at batch 1-64 and the prefix at batch 1-32 (1.2-4.8x;
`benchmarks/attention_gpu.py`), so the stacks call it wherever it takes the shape.

`attention_split(q, k, v, mask)` has the contract of `layers.attention.attention` for key-only
masks (B, 1, 1, Tk): grouped KV heads, boolean mask, a query row with no allowed key sees all keys.
Dispatch follows `layers.triton_ops`: "reference" (the model's own SDPA path), "triton", "auto";
a call that needs a gradient, a non-key-only mask, or a head size the kernel does not take
(not a power of two in 16..256) runs the reference. Under Triton's CPU interpreter the dot
products run in float32 on operands rounded as on the GPU (the interpreter's bf16 `tl.dot` is
wrong in triton 3.9).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from phyai_edge.layers import triton_grad
from phyai_edge.layers.attention import _full_rows, attention, concat
from phyai_edge.layers.triton_dispatch import (
    NO_SPLIT,
    Tickets,
    _sm_count,
    _use_triton,
    interpret_mode,
    launch_fitting,
    launch_options,
    needs_grad,
    tl,
    triton,
)

TRACE_SLOTS = 13  # int64 per program of a traced split-kernel call (`_split_attn_kernel(TRACE=True)`)
MIN_KEYS_PER_SPLIT = 128  # below this a split's merge traffic costs more than its parallelism buys
ONE_PASS_BLOCK_M = 64  # query rows per program of SDPA's one-pass (cuDNN / flash) kernels


@dataclass(frozen=True)
class SplitConfig:
    """The split kernel's tiling: query rows and keys per block, warps and software-pipeline
    stages per program, and the fewest keys a split may hold (below that a split's merge traffic
    costs more than its parallelism buys). `benchmarks/attention_gpu.py` sweeps them on a GPU."""

    block_m: int = 64
    block_n: int = 64
    warps: int = 4
    stages: int = 2
    min_keys: int = MIN_KEYS_PER_SPLIT
    # Merge the splits in the split kernel itself (the last program to finish a query block
    # merges it) rather than in a second kernel; see `_split_attn_kernel`. Measured faster only
    # for 16-row blocks (`FEW_BLOCKS`).
    inline_merge: bool = False
    # Warp-specialise the key loops (`tl.range(warp_specialize=True)`): measured by
    # `benchmarks/attention_gpu.py`, not used by `default_config`.
    warp_specialize: bool = False
    # Load the key / value tiles with the tensor-memory accelerator (Hopper; host-side descriptors)
    # instead of per-thread asynchronous copies: measured by `benchmarks/attention_timeline_gpu.py`.
    tma: bool = False
    # Compute each key block transposed (scores as keys x rows, the output as D x rows): the products
    # then have the keys or D as their 64-row side, which Hopper's warpgroup MMA needs, where 16
    # query rows alone compile to the older synchronous MMA (Triton 3.6 and 3.9 for sm_90). Pays
    # only for 16-row blocks (`FEW_BLOCKS`); 32 rows or more measured slower (RESULTS.md 2026-12-05).
    keys_as_rows: bool = False


# Measured on an H200 (benchmarks/attention_gpu.py, RESULTS.md 2026-12-03), PI0.5's head size 256.
# Splitting the keys pays only where even 16-row blocks leave most SMs idle (the expert at batch
# 1-2): there 16-row blocks on 8 warps, split keys, and the last program of a query block merges it
# (13.5 us; a second merge kernel 14.0). Everywhere else one program takes all of its block's keys:
# a split costs float32 partials and their merge, and each block of folded query rows re-reads its
# sample's keys from L2, so the kernel is bound by those reads and bigger blocks win once they
# alone about fill the GPU. One split, in us against the earlier 64-row tiling with 2-5 splits and
# a merge kernel: expert b8 29.8 vs 32.8, b16 30.6 vs 52.8 (64-row blocks); expert b24 39.0 vs
# 72.3, b32 42.4 vs 78.8, prefix b2 41.6 vs 63.0 (128-row blocks, two warpgroups); prefix b1 26.9
# vs 36.7 (64-row). Between the classes (expert b3-b4) the split 64-row tiling stays.
# The expert at batch 1-2 since 2026-12-04 (fifteenth session, `benchmarks/attention_timeline_gpu.py`:
# each program's key loop took ~2.6 us a 64-key block and the merge ~3 us of the ~13): key / value
# tiles by TMA, three stages on 4 warps, the merge unrolled: 12.2 -> 10.9 us alone, the batch-1 flow
# loop -3.8% end to end. Compiled for sm_90 (Triton 3.6 and 3.9) it asks 141344 bytes of shared memory;
# before Hopper (no TMA: Orin, RTX 30 / 40) or where it does not fit, `FEW_BLOCKS_COMPACT`, the tiling
# it replaced, runs instead (`_tilings`). Since 2026-12-05 (eighteenth session) each key block is computed
# keys x rows (`keys_as_rows`: warpgroup MMA instead of synchronous MMA), 11.9 -> 11.5 us alone
# (207872 bytes of shared memory on sm_90).
FEW_BLOCKS = SplitConfig(block_m=16, block_n=64, warps=4, stages=3, min_keys=128, inline_merge=True, tma=True,
                         keys_as_rows=True)
FEW_BLOCKS_COMPACT = SplitConfig(block_m=16, block_n=64, warps=8, stages=2, min_keys=128, inline_merge=True)
MANY_BLOCKS = SplitConfig(block_m=64, block_n=64, warps=4, stages=1, min_keys=64, inline_merge=False)
# 64-row blocks (the prefix at batch 1, the expert at batch 8-16) since 2026-12-04 (sixteenth
# session, `benchmarks/attention_gpu.py`, side by side): key / value tiles by TMA with three stages,
# prefix b1 27.4 -> 23.9 us, expert b8 29.6 -> 22.8, b16 30.6 -> 23.2 (two TMA stages: no gain; the
# per-block clocks of `attention_timeline_gpu.py` went 2.6 -> 1.8 us a 64-key block). Compiled for sm_90
# it asks 230400 bytes of shared memory (Hopper's limit is 232448); before Hopper or where it does not
# fit, `MID_BLOCKS_COMPACT`, the tiling it replaced, runs instead.
MID_BLOCKS = SplitConfig(block_m=64, block_n=64, warps=4, stages=3, min_keys=NO_SPLIT, inline_merge=False, tma=True)
MID_BLOCKS_COMPACT = SplitConfig(block_m=64, block_n=64, warps=4, stages=2, min_keys=NO_SPLIT, inline_merge=False)
# 128-row blocks (the expert from batch 24, the prefix from batch 2) since 2026-12-05 (eighteenth
# session, `benchmarks/attention_gpu.py`, side by side): key / value tiles by TMA, the same warps and
# stages: expert b24 38.9 -> 38.1 us, b32 43.1 -> 41.6, prefix b2 41.8 -> 38.7, b8 171.9 -> 155.8.
# Before Hopper or where it does not fit, `BIG_BLOCKS_COMPACT`, the tiling it replaced, runs instead.
BIG_BLOCKS = SplitConfig(block_m=128, block_n=64, warps=8, stages=2, min_keys=NO_SPLIT, inline_merge=False, tma=True)
BIG_BLOCKS_COMPACT = SplitConfig(block_m=128, block_n=64, warps=8, stages=2, min_keys=NO_SPLIT, inline_merge=False)
BIG_BLOCK_M = 128
# Where the shape's tiling asks for more shared memory than the GPU has (compiled by Triton 3.9:
# BIG_BLOCKS 128 KB, MID_BLOCKS_COMPACT 96 KB, FEW_BLOCKS_COMPACT 72 KB a block, against 99 KB on an
# RTX GPU, 163 KB on Orin, 227 KB on Hopper), these are tried in order; the last asks for the least.
# The TMA tilings fall back to their compact forms first (`_fallbacks`), so each shape keeps its class.
SMALL_BLOCKS = SplitConfig(block_m=16, block_n=32, warps=4, stages=1, min_keys=64, inline_merge=False)
FALLBACK_TILINGS = (MID_BLOCKS_COMPACT, FEW_BLOCKS_COMPACT, SMALL_BLOCKS)


def _fallbacks(chosen: SplitConfig) -> tuple[SplitConfig, ...]:
    """The tilings `launch_fitting` tries after `chosen` where it does not fit the GPU."""
    if chosen is FEW_BLOCKS:
        return FEW_BLOCKS_COMPACT, SMALL_BLOCKS
    return (BIG_BLOCKS_COMPACT, *FALLBACK_TILINGS) if chosen is BIG_BLOCKS else FALLBACK_TILINGS


def _tilings(chosen: SplitConfig, device: torch.device) -> tuple[SplitConfig, ...]:
    """`chosen` and its fallbacks, in the order `launch_fitting` tries them. A TMA tiling on a GPU
    without TMA (before Hopper) starts at its fallback: its stage count was measured for TMA tiles."""
    rest = _fallbacks(chosen)
    return (chosen, *rest) if not chosen.tma or _has_tma(device) else rest


def _has_tma(device: torch.device) -> bool:
    """Whether key / value tiles may be loaded by TMA descriptors on `device`: Hopper and later, or
    the CPU interpreter (which runs the descriptor path)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


_INLINE_MERGE = True


def set_inline_merge(on: bool) -> bool:
    """Whether `default_config` may merge the splits inside the split kernel (True, the default:
    where its tiling says so) or always in a second kernel (False); returns the previous setting
    (benchmarks time both)."""
    global _INLINE_MERGE
    before, _INLINE_MERGE = _INLINE_MERGE, bool(on)
    return before


def default_config(rows: int, groups: int, sms: int) -> SplitConfig:
    """The tiling for `rows` query rows per KV head (grouped heads folded) in `groups` = batch x
    KV heads on `sms` SMs: 16-row tiles and split keys where 64-row tiles would leave most SMs idle
    even after splitting the keys; one split with 64-row tiles where those give a quarter of the
    SMs work, with 128-row tiles where those give ~70%; split 64-row tiles in between."""
    blocks64 = math.ceil(rows / ONE_PASS_BLOCK_M) * groups
    if math.ceil(rows / BIG_BLOCK_M) * groups >= 0.7 * sms:  # expert from batch 24, prefix from 2
        return BIG_BLOCKS
    if blocks64 >= sms / 4:  # expert batch 8-16, prefix batch 1
        return MID_BLOCKS
    cfg = FEW_BLOCKS if blocks64 < max(sms // 8, 1) else MANY_BLOCKS
    return cfg if _INLINE_MERGE or not cfg.inline_merge else replace(cfg, inline_merge=False)


def plan_splits(rows: int, keys: int, groups: int, sms: int, block_m: int, block_n: int,
                min_keys: int = MIN_KEYS_PER_SPLIT) -> tuple[int, int]:
    """(splits, keys per split): enough programs for about two per SM, no split under `min_keys`
    keys, each split a whole number of key blocks. `groups` = batch x KV heads."""
    programs = math.ceil(rows / block_m) * groups
    want = max(1, math.ceil(2 * sms / programs))
    splits = max(1, min(want, keys // max(min_keys, 1)))
    per = math.ceil(math.ceil(keys / splits) / block_n) * block_n
    return math.ceil(keys / per), per


def kernel_takes(q: torch.Tensor, mask: torch.Tensor) -> bool:
    d = q.shape[-1]
    key_only = mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1
    return key_only and 16 <= d <= 256 and d & (d - 1) == 0


if triton is not None:
    from phyai_edge.layers.triton_dispatch import pdl_enter
    from phyai_edge.layers.triton_math import _clock, _clock_after, _dot, _keys_allowed, _last_of

    @triton.jit
    def _attend_block(q, kt, vb, ok, m_i, l_i, acc, scale_log2, UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """One key block of the online softmax: kt (D, BLOCK_N), vb (BLOCK_N, D), ok (BLOCK_N,)
        the keys that may be attended; returns the updated (max, sum, accumulator). IEEE (float32
        operands on a GPU): no TF32 rounding in the dots, so a float32 call means float32."""
        # float32 explicitly: under torch.compile a Python float argument arrives as fp64, which
        # would turn the loop-carried statistics into fp64.
        s = (_dot(q, kt, UPCAST, IEEE) * scale_log2).to(tl.float32)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # p rounded to the values' dtype first, on every path, as the GPU's product takes it
        acc = acc * alpha[:, None] + _dot(p.to(vb.dtype), vb, UPCAST, IEEE)
        return m_new, l_i, acc

    @triton.jit
    def _attend_block_t(qt, kt, vb, ok, m_i, l_i, acc_t, scale_log2, UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """`_attend_block` transposed: qt (D, BLOCK_M), acc_t (D, BLOCK_M), the scores (BLOCK_N,
        BLOCK_M), the statistics per column; the same online softmax."""
        s = (_dot(tl.trans(kt), qt, UPCAST, IEEE) * scale_log2).to(tl.float32)
        s = tl.where(ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc_t = acc_t * alpha[None, :] + _dot(tl.trans(vb), p.to(vb.dtype), UPCAST, IEEE)
        return m_new, l_i, acc_t

    @triton.jit
    def _attend_either(q, kt, vb, ok, m_i, l_i, acc, scale_log2, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                       KEYS_AS_ROWS: tl.constexpr):
        if KEYS_AS_ROWS:
            return _attend_block_t(q, kt, vb, ok, m_i, l_i, acc, scale_log2, UPCAST, IEEE)
        else:
            return _attend_block(q, kt, vb, ok, m_i, l_i, acc, scale_log2, UPCAST, IEEE)

    @triton.jit
    def _kv_tiles(k_desc, v_desc, k_ptr, v_ptr, b, h, n, limit, d, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                  TMA: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
        """One key part's block of keys n.. as kt (D, BLOCK_N) and values (BLOCK_N, D), positions
        counted within the part. TMA: whole tiles by descriptor (rows past the part's end come back
        as zeros; rows at or past `limit` belong to the next split and are masked out of the scores
        by the caller, so p = 0 there); else pointer loads with keys from `limit` on read as zeros."""
        if TMA:
            kt = tl.trans(k_desc.load([b, h, n, 0]).reshape(BLOCK_N, D))
            vb = v_desc.load([b, h, n, 0]).reshape(BLOCK_N, D)
        else:
            c = n + tl.arange(0, BLOCK_N)
            inb = c < limit
            kt = tl.load(k_ptr + b * sk_b + h * sk_h + c[None, :] * sk_n + d[:, None], mask=inb[None, :], other=0.0)
            vb = tl.load(v_ptr + b * sv_b + h * sv_h + c[:, None] * sv_n + d[None, :], mask=inb[:, None], other=0.0)
        return kt, vb

    @triton.jit
    def _split_attn_kernel(
        q_ptr, k_ptr, v_ptr, k2_ptr, v2_ptr, m_ptr, o_ptr, lse_ptr, out_ptr, ticket_ptr, lse_out_ptr, trace_ptr,
        k_desc, v_desc, k2_desc, v2_desc,
        rows, keys, keys1, keys_per_split, scale_log2, tq,
        sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
        sk2_b, sk2_h, sk2_n, sv2_b, sv2_h, sv2_n, sm_b,
        so_s, so_b, so_h, so_g, so_t, sl_s, sl_bh, sf_b, sf_h, sf_g, sf_t,
        HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        FINAL: tl.constexpr, MERGE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
        WS: tl.constexpr, LSE_OUT: tl.constexpr, SPLITS: tl.constexpr, TRACE: tl.constexpr = False,
        TMA: tl.constexpr = False, KEYS_AS_ROWS: tl.constexpr = False,
    ):
        """One (query block, key split, batch x KV head) program. FINAL (one split): the output
        goes straight to out. Else a float32 partial and its log-sum-exp (base 2) go to o / lse;
        with MERGE the last program of a query block to finish (its ticket counts the splits done)
        merges all splits of that block into out, so no second kernel runs. LSE_OUT: each row's
        whole log-sum-exp (base 2 of the scaled scores) also goes to lse_out (B x Hkv, rows), which
        the backward (`triton_grad.split_attention_grad`) reads instead of recomputing it. TRACE (a
        GPU only; `benchmarks/attention_timeline_gpu.py`): each program writes TRACE_SLOTS int64 to
        trace: %globaltimer and %clock64 at its start, %clock64 once its queries are loaded, once its
        keys are done, once its ticket is drawn and once it has merged (0 where it does not), then
        %clock64 and %globaltimer at its end, and its SM; then %clock64 as each of its first four
        blocks of cached keys is done. KEYS_AS_ROWS: each block computed transposed
        (`_attend_block_t`), the same sums."""
        pdl_enter(PDL)
        if TRACE:
            g_start = tl.extra.cuda.globaltimer()
            c_start = _clock()
        pid_m = tl.program_id(0)
        split = tl.program_id(1)
        bh = tl.program_id(2)
        slot = trace_ptr + ((bh * tl.num_programs(1) + split) * tl.num_programs(0) + pid_m) * 13  # TRACE_SLOTS
        b = bh // HKV
        h = bh % HKV
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, D)
        q_rows = q_ptr + b * sq_b + h * sq_h
        if KEYS_AS_ROWS:  # q and the accumulator held transposed, (D, BLOCK_M)
            q = tl.load(q_rows + r[None, :] * sq_m + d[:, None], mask=r[None, :] < rows, other=0.0)
            acc = tl.zeros([D, BLOCK_M], tl.float32)
        else:
            q = tl.load(q_rows + r[:, None] * sq_m + d[None, :], mask=r[:, None] < rows, other=0.0)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
        if UPCAST:
            q = q.to(tl.float32)
        if TRACE:
            c_q = _clock_after(tl.sum(tl.sum(q.to(tl.float32), axis=1), axis=0))
        # A finite start: a block whose keys are all masked then gives p = 0, not exp(-inf + inf).
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        start = split * keys_per_split
        end = tl.minimum(start + keys_per_split, keys)
        # Keys 0..keys1-1 come from the first part (the cached prefix), the rest from the second
        # (the step's own keys): the two are never concatenated in memory. One loop per part, so
        # each block issues one load per operand rather than two masked ones.
        end1 = tl.minimum(end, keys1)
        for n0 in tl.range(start, end1, BLOCK_N, warp_specialize=WS):
            c = n0 + tl.arange(0, BLOCK_N)
            kt, vb = _kv_tiles(k_desc, v_desc, k_ptr, v_ptr, b, h, n0, end1, d, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                               TMA, BLOCK_N, D)
            ok = _keys_allowed(m_ptr, b, sm_b, c, end1)
            m_i, l_i, acc = _attend_either(q, kt, vb, ok, m_i, l_i, acc, scale_log2, UPCAST, IEEE, KEYS_AS_ROWS)
            if TRACE:
                it = (n0 - start) // BLOCK_N
                tl.store(slot + 9 + it, _clock_after(tl.sum(l_i, axis=0)), mask=it < 4)
        for n0 in tl.range(tl.maximum(start, keys1), end, BLOCK_N, warp_specialize=WS):
            c = n0 + tl.arange(0, BLOCK_N)
            kt, vb = _kv_tiles(k2_desc, v2_desc, k2_ptr, v2_ptr, b, h, n0 - keys1, end - keys1, d, sk2_b, sk2_h, sk2_n,
                               sv2_b, sv2_h, sv2_n, TMA, BLOCK_N, D)
            ok = _keys_allowed(m_ptr, b, sm_b, c, end)
            m_i, l_i, acc = _attend_either(q, kt, vb, ok, m_i, l_i, acc, scale_log2, UPCAST, IEEE, KEYS_AS_ROWS)
        if TRACE:
            c_keys = _clock_after(tl.sum(l_i, axis=0))
            c_ticket = c_keys
            c_merged = tl.full([], 0, tl.int64)
        if KEYS_AS_ROWS:
            acc = tl.trans(acc)
        out = acc / tl.maximum(l_i, 1e-30)[:, None]  # a split with no allowed key: 0, weighted 0 below
        # Row r of the folded query is (group r // tq, token r % tq): a final output goes straight
        # to its (B, Tq, Hq, D) place, so the o-projection reads it without a transpose copy.
        o = o_ptr + split * so_s + b * so_b + h * so_h + ((r // tq) * so_g + (r % tq) * so_t)[:, None] + d[None, :]
        tl.store(o, out.to(o_ptr.dtype.element_ty), mask=r[:, None] < rows)
        if FINAL and LSE_OUT:
            tl.store(lse_out_ptr + bh * rows + r, m_i + tl.log2(tl.maximum(l_i, 1e-30)), mask=r < rows)
        if not FINAL:
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
            tl.store(lse_ptr + split * sl_s + bh * sl_bh + r, lse, mask=r < rows)
            # The program that draws a query block's last ticket merges its splits. Nested, not
            # `and`: Triton evaluates both operands, and the ticket's atomics must not run without MERGE.
            if MERGE:
                last = _last_of(ticket_ptr + bh * tl.num_programs(0) + pid_m, SPLITS)
                if TRACE:
                    c_ticket = _clock_after(last.to(tl.float32))
                if last:
                    _merge_rows(o_ptr, lse_ptr, out_ptr, lse_out_ptr, b, h, bh, r, rows, tq,
                                so_s, so_b, so_h, so_g, so_t, sl_s, sl_bh, sf_b, sf_h, sf_g, sf_t, D, BLOCK_M, LSE_OUT,
                                SPLITS)
                    if TRACE:
                        c_merged = _clock()
        if TRACE:
            tl.store(slot + 0, g_start)
            tl.store(slot + 1, c_start)
            tl.store(slot + 2, c_q)
            tl.store(slot + 3, c_keys)
            tl.store(slot + 4, c_ticket)
            tl.store(slot + 5, c_merged)
            tl.store(slot + 6, _clock())
            tl.store(slot + 7, tl.extra.cuda.globaltimer())
            tl.store(slot + 8, tl.extra.cuda.smid().to(tl.int64))

    @triton.jit
    def _merge_rows(p_ptr, lse_ptr, out_ptr, lse_out_ptr, b, h, bh, r, rows, tq,
                    sp_s, sp_b, sp_h, sp_g, sp_t, sl_s, sl_bh, so_b, so_h, so_g, so_t,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, LSE_OUT: tl.constexpr, SPLITS: tl.constexpr):
        """Merge the float32 partials of query rows r (each split's output weighted by its share
        of the softmax mass, 2^(lse - max)) into out (and with LSE_OUT the rows' whole log-sum-exp
        into lse_out). The partials are read through L2 (".cg"): other programs wrote them during
        this kernel. The split count is a constant and the loops unrolled, so every split's loads
        are in flight together (a loop over a run-time count issued them one split at a time: ~3 us
        of the batch-1 expert attention's 13, `benchmarks/attention_timeline_gpu.py`)."""
        d = tl.arange(0, D)
        live = r < rows
        # row r of the folded query is (group r // tq, token r % tq)
        prow = (r // tq) * sp_g + (r % tq) * sp_t
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for s in tl.static_range(SPLITS):
            lse = tl.load(lse_ptr + s * sl_s + bh * sl_bh + r, mask=live, other=float("-inf"), cache_modifier=".cg")
            top = tl.maximum(top, lse)
        top = tl.where(top == float("-inf"), 0.0, top)  # rows past the end: keep them finite
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        wsum = tl.zeros([BLOCK_M], tl.float32)
        for s in tl.static_range(SPLITS):
            lse = tl.load(lse_ptr + s * sl_s + bh * sl_bh + r, mask=live, other=float("-inf"), cache_modifier=".cg")
            w = tl.exp2(lse - top)
            part = tl.load(p_ptr + s * sp_s + b * sp_b + h * sp_h + prow[:, None] + d[None, :],
                           mask=live[:, None], other=0.0, cache_modifier=".cg")
            acc += w[:, None] * part
            wsum += w
        out = acc / tl.maximum(wsum, 1e-30)[:, None]
        dst = out_ptr + b * so_b + h * so_h + ((r // tq) * so_g + (r % tq) * so_t)[:, None] + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=live[:, None])
        if LSE_OUT:
            tl.store(lse_out_ptr + bh * rows + r, top + tl.log2(tl.maximum(wsum, 1e-30)), mask=live)

    @triton.jit
    def _merge_kernel(
        p_ptr, lse_ptr, out_ptr, lse_out_ptr, rows, tq,
        sp_s, sp_b, sp_h, sp_g, sp_t, sl_s, sl_bh, so_b, so_h, so_g, so_t,
        HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr, LSE_OUT: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        pdl_enter(PDL)
        bh = tl.program_id(1)
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        _merge_rows(p_ptr, lse_ptr, out_ptr, lse_out_ptr, bh // HKV, bh % HKV, bh, r, rows, tq,
                    sp_s, sp_b, sp_h, sp_g, sp_t, sl_s, sl_bh, so_b, so_h, so_g, so_t, D, BLOCK_M, LSE_OUT, SPLITS)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every kernel output is allocated here (the tests poison it to check it is fully written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _split_attention_triton(q: torch.Tensor, ks: tuple[torch.Tensor, torch.Tensor],
                            vs: tuple[torch.Tensor, torch.Tensor], key_mask: torch.Tensor,
                            scale: float, splits: int | None, tq: int,
                            config: SplitConfig | None = None, tickets: Tickets | None = None,
                            lse_out: torch.Tensor | None = None, trace: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, Hkv, G * Tq, D) (the G query heads of each KV head folded into the rows), keys and
    values in two parts (B, Hkv, N1 / N2, D), key_mask (B, N1 + N2) uint8 (`kernel_key_mask`)
    -> (B, Tq, Hkv * G, D). `lse_out` (B x Hkv, G * Tq) float32: where each folded row's
    log-sum-exp goes (base 2, of the scaled scores), for the backward. `trace`: an int64 buffer of
    `TRACE_SLOTS` per program for a timeline (`_split_attn_kernel`'s TRACE; a GPU only). `config` None:
    `default_config`'s tiling for the shape, or where that does not fit the GPU (or is a TMA tiling on
    a GPU without TMA) the first of its fallbacks that does (`_tilings`, `triton_dispatch.launch_fitting`)."""
    def launch(cfg: SplitConfig) -> torch.Tensor:
        return _split_attention_launch(q, ks, vs, key_mask, scale, splits, tq, cfg, tickets, lse_out, trace)

    if config is not None:
        return launch(config)
    b, hkv, rows, _ = q.shape
    chosen = default_config(rows, b * hkv, _sm_count(q.device))
    return launch_fitting("split attention", q.device, _tilings(chosen, q.device), launch)


def _split_attention_launch(q: torch.Tensor, ks: tuple[torch.Tensor, torch.Tensor],
                            vs: tuple[torch.Tensor, torch.Tensor], key_mask: torch.Tensor, scale: float,
                            splits: int | None, tq: int, cfg: SplitConfig, tickets: Tickets | None,
                            lse_out: torch.Tensor | None, trace: torch.Tensor | None = None) -> torch.Tensor:
    b, hkv, rows, d = q.shape
    groups = rows // tq
    (k, k2), (v, v2) = ks, vs
    keys1 = k.shape[2]
    keys = keys1 + k2.shape[2]
    bm, bn = cfg.block_m, cfg.block_n
    if splits is None:
        splits, per = plan_splits(rows, keys, b * hkv, _sm_count(q.device), bm, bn, cfg.min_keys)
    else:
        per = math.ceil(math.ceil(keys / splits) / bn) * bn
        splits = math.ceil(keys / per)
    out = _empty((b, tq, hkv * groups, d), q.dtype, q.device)
    # (b, kv head, group, token) strides of the output
    os_ = (out.stride(0), groups * out.stride(2), out.stride(2), out.stride(1))
    mask_u8 = key_mask
    final = splits == 1
    merge = cfg.inline_merge and not final
    lse = _empty((splits, b * hkv, rows), torch.float32, q.device)
    if final:
        part, ps = out, (0, *os_)
    else:  # partials in the folded layout: (split, b, kv head, group, token) strides
        part = _empty((splits, b, hkv, rows, d), torch.float32, q.device)
        ps = (part.stride(0), part.stride(1), part.stride(2), tq * part.stride(3), part.stride(3))
    grid = (triton.cdiv(rows, bm), splits, b * hkv)
    # one ticket per (query block, batch x KV head), zero on entry and left at zero on exit;
    # without the in-kernel merge the kernel never reads the argument (any tensor will do)
    ticket_buf = lse
    if merge:
        ticket_buf = (tickets if tickets is not None else Tickets(q.device)).take(grid[0] * grid[2])
    lse_out_buf = lse_out if lse_out is not None else lse  # never read without LSE_OUT
    if trace is not None and trace.numel() < grid[0] * grid[1] * grid[2] * TRACE_SLOTS:
        raise ValueError(f"split attention trace: {trace.numel()} slots for {grid} programs x {TRACE_SLOTS}")
    descs = _kv_descriptors(k, v, k2, v2, bn) if cfg.tma else None
    _split_attn_kernel[grid](
        q, k, v, k2, v2, mask_u8, part, lse, out, ticket_buf, lse_out_buf, trace if trace is not None else lse,
        *(descs or (k, v, k2, v2)),
        rows, keys, keys1, per, scale * 1.4426950408889634, tq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), k2.stride(0), k2.stride(1), k2.stride(2),
        v2.stride(0), v2.stride(1), v2.stride(2), mask_u8.stride(0),
        *ps, lse.stride(0), lse.stride(1), *os_,
        HKV=hkv, D=d, BLOCK_M=bm, BLOCK_N=bn, FINAL=final, MERGE=merge, UPCAST=interpret_mode(),
        IEEE=q.dtype == torch.float32,
        WS=cfg.warp_specialize, LSE_OUT=lse_out is not None, SPLITS=splits, TRACE=trace is not None,
        TMA=descs is not None, KEYS_AS_ROWS=cfg.keys_as_rows,
        num_warps=cfg.warps,
        num_stages=cfg.stages, **launch_options(q),
    )
    if not final and not merge:
        mb = 32
        _merge_kernel[(triton.cdiv(rows, mb), b * hkv)](
            part, lse, out, lse_out_buf, rows, tq, *ps, lse.stride(0), lse.stride(1), *os_,
            HKV=hkv, D=d, BLOCK_M=mb, LSE_OUT=lse_out is not None, SPLITS=splits, num_warps=4, **launch_options(q),
        )
    return out


def _kv_descriptors(k: torch.Tensor, v: torch.Tensor, k2: torch.Tensor, v2: torch.Tensor,
                    block_n: int) -> tuple[Any, ...] | None:
    """TMA descriptors of the key / value parts, (1, 1, block_n, D) tiles; None where TMA cannot
    take them (no `triton.tools.tensor_descriptor`, both parts empty, strides not 16-byte
    multiples). An empty part (the prefix's one-part call) gets the other part's descriptors: the
    kernel's loop over an empty part never runs, so they are never read."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - triton < 3.4
        return None
    if not _has_tma(k.device):
        return None
    if k.shape[2] == 0:
        k, v = k2, v2
    elif k2.shape[2] == 0:
        k2, v2 = k, v
    parts = (k, v, k2, v2)
    if any(t.shape[2] == 0 or t.stride(-1) != 1 or any((s * t.element_size()) % 16 for s in t.stride()[:-1])
           or t.data_ptr() % 16 for t in parts):
        return None
    return tuple(TensorDescriptor.from_tensor(t, [1, 1, block_n, t.shape[-1]]) for t in parts)


KV = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _parts(x: KV) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(x, torch.Tensor):  # one part: an empty second one
        return x, x[:, :, :0]
    return x


# Where a call needing a gradient (exact RTC guidance) takes the split kernel with its backward
# (`triton_grad.SplitAttentionFn`) rather than SDPA over the joined keys: None by shape, up to
# GRAD_KERNEL_MAX_HEADS (batch x KV heads); True / False always / never (benchmarks time each). On
# the H200 (2026-12-04, benchmarks/attention_grad_gpu.py) PI0.5's expert attention forward + backward
# took 30 / 57 / 89 / 118 / 186 / 323 us on the kernel (the backward's tiling by `grad_config`) against
# 120 / 133 / 152 / 216 / 340 / 594 us for SDPA over the joined keys at batches 1 / 4 / 8 / 16 / 32 / 64;
# larger batches are unmeasured, so they keep SDPA.
GRAD_ON_KERNEL: bool | None = None
GRAD_KERNEL_MAX_HEADS = 64


def _grad_on_kernel(batch_heads: int) -> bool:
    return GRAD_ON_KERNEL if GRAD_ON_KERNEL is not None else batch_heads <= GRAD_KERNEL_MAX_HEADS


def kernel_key_mask(mask: torch.Tensor, batch: int) -> torch.Tensor:
    """A key-only mask (B or 1, 1, 1, Tk) as the kernel reads it: (B, Tk) uint8, a row with no
    allowed key opened to all keys (`_full_rows`). A stack of layers shares one mask, so it
    computes this once (`attention_split(key_mask=)`) instead of once per layer."""
    return _full_rows(mask)[:, 0, 0, :].expand(batch, mask.shape[-1]).to(torch.uint8)


def attention_split(
    q: torch.Tensor, k: KV, v: KV, mask: torch.Tensor, scale: float | None = None,
    backend: str = "reference", splits: int | None = None,
    key_mask: torch.Tensor | None = None, config: SplitConfig | None = None,
    tickets: Tickets | None = None,
) -> torch.Tensor:
    """q (B, Hq, Tq, D); k, v (B, Hkv, Tk, D), or each as two parts (cached, new) that together
    make Tk keys (attended as if concatenated, without the copy); mask bool (B, 1, 1, Tk)
    -> (B, Hq, Tq, D).

    The kernel's result is a transposed view of a contiguous (B, Tq, Hq, D) tensor, so
    `out.transpose(1, 2).reshape(B, Tq, Hq * D)` (what an output projection reads) copies nothing.
    `splits`: how many key ranges (None: enough to fill the GPU, see `plan_splits`).
    `key_mask`: `kernel_key_mask(mask, B)` computed ahead (it depends on the mask alone).
    `config`: the kernel's tiling (None: `default_config` by shape).
    `tickets`: where the in-kernel merge takes its counters (None: a fresh zeroed buffer)."""
    ks, vs = _parts(k), _parts(v)
    # A call needing a gradient (exact RTC guidance) for q and the new keys / values takes the kernel
    # with a backward of its own (`triton_grad.SplitAttentionFn`) up to a measured batch (`GRAD_ON_KERNEL`),
    # else SDPA over the joined keys (cuDNN's fused forward and backward); one for the cached part, SDPA.
    if not (kernel_takes(q, mask) and not needs_grad(ks[0], vs[0])
            and _use_triton(backend, q, *ks, *vs, differentiable=_grad_on_kernel(q.shape[0] * ks[0].shape[1]))):
        k_all = ks[0] if ks[1].shape[2] == 0 else concat(ks, dim=2)
        v_all = vs[0] if vs[1].shape[2] == 0 else concat(vs, dim=2)
        return attention(q, k_all, v_all, mask, scale)
    b, hq, tq, d = q.shape
    hkv = ks[0].shape[1]
    if key_mask is None:
        key_mask = kernel_key_mask(mask, b)
    # Query heads sharing a KV head are folded into the rows, as `attention` does (a view for
    # contiguous q), so K and V are read once per KV head.
    sm_scale = scale if scale is not None else 1.0 / math.sqrt(d)

    def run(lse_out: torch.Tensor | None = None) -> torch.Tensor:  # (B, Tq, Hq, D)
        qf = q.reshape(b, hkv, (hq // hkv) * tq, d)
        return _split_attention_triton(qf, ks, vs, key_mask, sm_scale, splits, tq, config, tickets, lse_out)

    if needs_grad(q, ks[1], vs[1]):
        return SplitAttentionFn.apply(q, ks[1], vs[1], ks[0], vs[0], key_mask, sm_scale, run, tickets)
    return run().transpose(1, 2)  # (B, Hq, Tq, D), a view of the (B, Tq, Hq, D) buffer


def stack_attention(mask: torch.Tensor, batch: int, backend: str) -> Callable[..., torch.Tensor]:
    """The attention a stack of layers sharing `mask` calls (`GemmaAttention.attend(attention_fn=)`):
    the split kernel wherever it takes the shape, else SDPA; the kernel's form of the mask and the
    merge tickets made once for the whole stack."""
    key_only = mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1
    key_mask = kernel_key_mask(mask, batch) if key_only and backend != "reference" else None
    tickets = Tickets(mask.device)  # allocates nothing until a call merges in-kernel

    def attend(q: torch.Tensor, k: KV, v: KV, m: torch.Tensor) -> torch.Tensor:
        return attention_split(q, k, v, m, backend=backend,
                               key_mask=key_mask if m is mask else None, tickets=tickets)

    attend.key_mask = key_mask  # type: ignore[attr-defined]  # for `triton_expert_layer`, which reads the mask itself
    attend.tickets = tickets  # type: ignore[attr-defined]  # shared with the stack's other in-kernel reductions
    return attend


class SplitAttentionFn(torch.autograd.Function):
    """`triton_attention.attention_split` over (cached, new) key parts on the split-KV kernel
    (`run(lse_out)`: its launch, made by the caller, returning the (B, Tq, Hq, D) buffer and
    writing each folded row's log-sum-exp to lse_out), differentiable in q and the new keys and
    values by `split_attention_grad`, which reads those log-sum-exps instead of recomputing them."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cached: torch.Tensor,
                v_cached: torch.Tensor, key_mask: torch.Tensor, scale: float, run: Any,
                tickets: Tickets | None) -> torch.Tensor:
        b, hq, tq, _ = q.shape
        lse = torch.empty((b * k_new.shape[1], hq // k_new.shape[1] * tq), dtype=torch.float32, device=q.device)
        out = run(lse).transpose(1, 2)  # (B, Hq, Tq, D), a view of the (B, Tq, Hq, D) buffer
        ctx.save_for_backward(q, k_new, v_new, k_cached, v_cached, key_mask, out, lse)
        ctx.scale, ctx.tickets = scale, tickets
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k_new, v_new, k_cached, v_cached, key_mask, out, lse = ctx.saved_tensors
        dq, dk, dv = triton_grad.split_attention_grad(q, k_cached, k_new, v_cached, v_new, key_mask, out, lse, dout,
                                                      ctx.scale, ctx.tickets)
        return dq, dk, dv, None, None, None, None, None, None
