"""Backward passes for the fused ops, so exact RTC guidance runs its forward on the kernels too.

The exact `guided` RTC mode takes, every flow step, a vector-Jacobian product of the denoiser's
velocity with respect to the noisy actions: a backward pass through the action expert for the
input gradient only (the weights, the prefix's KV cache, the rotary tables and the time
modulations are constants). Without a backward for the kernels that pass ran every op on its
plain-torch reference, forward and backward (on the H200 a batch-1 chunk took +352-362% over the
unguided one; now +76-80%, batch 8 +109% -> +33-35%, batch 32 +67% -> +21.5-22.8%, by machine: RESULTS.md).
Here are the backward kernels of the autograd functions that the fused ops use when a gradient is
needed (each function lives beside its forward op and kernel; this module needs only
`triton_dispatch`), for the gradients of the activation inputs only:

- `triton_ops.AdaRmsNormFn`, `triton_ops.ResidualAdaRmsNormFn`: the adaptive RMSNorm's input gradient
  `rstd * (g - xhat * mean(g * xhat))` with `g = dout * (1 + scale)`, added to the gradient that
  reaches the residual stream from below, and for the gated residual `x + y * gate` the same sum
  times the gate for y: one kernel (`_ada_norm_grad_kernel`).
- `triton_ops.QkvRopeFn`: RoPE is a rotation per (d, d + D/2) pair, so its transpose is the rotation back:
  the kernel reads dq, dk, dv through their strides and writes the packed (B, T, (H + 2 Hkv) D)
  gradient of the QKV projection's output (`_rope_grad_kernel`).
- `triton_ops.GegluFn`: `d gate = dout * up * gelu'(gate)`, `d up = dout * gelu(gate)`, packed as the fused
  gate/up output (`_geglu_grad_kernel`).
- `triton_attention.SplitAttentionFn`: the split-KV kernel's forward, which also writes each folded
  query row's log-sum-exp, and a backward of one launch over the same two-part keys (the cached
  prefix, a constant, and the step's own): `_attn_bwd_kernel`. Its first programs give dq =
  scale * sum p (dp - delta) k with p from the forward's log-sum-exp, dp = dO v and delta =
  rowsum(dO o), each over a range of keys; the rest give the step's own keys and values theirs,
  each over a range of query rows. Ranges are sized so a small batch still fills the GPU
  (`plan_grad`); a block split over ranges writes float32 partials, and whichever of its programs
  finishes last (a ticket counter) sums them in range order, so the result does not depend on
  scheduling. No key is copied (SDPA would need the two parts joined) and no forward is recomputed.
  Chosen by shape (`triton_attention.GRAD_ON_KERNEL`); on the H200 it beat SDPA over the joined
  keys (cuDNN's fused forward and backward) at batches 1-16 of PI0.5's expert: benchmarks/RESULTS.md.

The projections' input gradients are one cuBLAS GEMM each: QKV + RoPE and gate/up + GeGLU run forward
on their fused small-M kernels (`triton_gemm.LinearQkvRopeFn`, `LinearGegluFn`: RoPE's and GeGLU's
gradients from here, then the GEMM), o_proj and down on `F.linear`. The small-M kernel on the
transposed weight was no faster than cuBLAS for those GEMMs (RESULTS.md, 2026-12-05).

The ops in `layers.triton_ops` and `triton_attention.attention_split` choose those functions when
their inputs need a gradient (`triton_dispatch.needs_grad`); the references stay what autograd
differentiates on the reference backend. Each backward is tested against autograd through the
reference (`tests/test_triton_grad.py`, the kernels under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from phyai_edge.layers.triton_dispatch import (
    NO_SPLIT,
    Tickets,
    _block,
    _per_batch,
    _row_warps,
    _rows,
    _sm_count,
    interpret_mode,
    launch_fitting,
    launch_options,
    tl,
    triton,
)

# -- kernels --------------------------------------------------------------------------------------
if triton is not None:
    from phyai_edge.layers.triton_dispatch import pdl_enter
    from phyai_edge.layers.triton_math import (
        _dot,
        _gelu_tanh_grad,
        _keys_allowed,
        _last_of,
        _rope_transposed,
        _token_heads,
    )

    @triton.jit
    def _ada_norm_grad_kernel(
        r_ptr, dh_ptr, dr_ptr, scale_ptr, gate_ptr, dx_ptr, dy_ptr,
        n_cols, rows_per_batch, eps,
        stride_r, stride_dh, stride_dr, stride_dx, stride_dy, stride_scale_b, stride_gate_b,
        HAS_DR: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_enter(PDL)
        row = tl.program_id(0)
        b = row // rows_per_batch
        cols = tl.arange(0, BLOCK)
        m = cols < n_cols
        x = tl.load(r_ptr + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
        inv = tl.rsqrt((tl.sum(x * x, axis=0) / n_cols + eps).to(tl.float32))
        xhat = x * inv
        sc = tl.load(scale_ptr + b * stride_scale_b + cols, mask=m, other=0.0).to(tl.float32)
        g = tl.load(dh_ptr + row * stride_dh + cols, mask=m, other=0.0).to(tl.float32) * (1.0 + sc)
        dx = inv * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
        if HAS_DR:  # the residual stream's own gradient, from the blocks below
            dx += tl.load(dr_ptr + row * stride_dr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
        if HAS_GATE:
            gt = tl.load(gate_ptr + b * stride_gate_b + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(dy_ptr + row * stride_dy + cols, (dx * gt).to(dy_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_grad_kernel(
        dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, out_ptr,
        seq_len, num_heads, num_kv_heads,
        stride_cs_b, stride_cs_t, stride_sn_b, stride_sn_t,
        stride_q_b, stride_q_h, stride_q_t, stride_k_b, stride_k_h, stride_k_t, stride_v_b, stride_v_h, stride_v_t,
        stride_out_b, stride_out_t,
        HALF: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_enter(PDL)
        # One program a token, all its heads, as the forward kernel (`triton_ops._qkv_rope_kernel`).
        b, t, heads, cols, m, is_q, is_k, qh, kh = _token_heads(seq_len, num_heads, num_kv_heads, HALF, BLOCK, HEADS)
        is_v = (heads >= num_heads + num_kv_heads) & (heads < num_heads + 2 * num_kv_heads)
        vh = tl.maximum(heads - num_heads - num_kv_heads, 0)
        src_q = dq_ptr + b * stride_q_b + qh * stride_q_h + t * stride_q_t + cols
        src_k = dk_ptr + b * stride_k_b + kh * stride_k_h + t * stride_k_t + cols
        src_v = dv_ptr + b * stride_v_b + vh * stride_v_h + t * stride_v_t + cols
        d1 = (tl.load(src_q, mask=m & is_q, other=0.0).to(tl.float32)
              + tl.load(src_k, mask=m & is_k, other=0.0).to(tl.float32))
        d2 = (tl.load(src_q + HALF, mask=m & is_q, other=0.0).to(tl.float32)
              + tl.load(src_k + HALF, mask=m & is_k, other=0.0).to(tl.float32))
        cs = cos_ptr + b * stride_cs_b + t * stride_cs_t + cols
        sn = sin_ptr + b * stride_sn_b + t * stride_sn_t + cols
        g1, g2 = _rope_transposed(d1, d2, cs, sn, m, HALF)
        v1 = tl.load(src_v, mask=m & is_v, other=0.0).to(tl.float32)
        v2 = tl.load(src_v + HALF, mask=m & is_v, other=0.0).to(tl.float32)
        g1 = tl.where(is_v, v1, g1)
        g2 = tl.where(is_v, v2, g2)
        dst = out_ptr + b * stride_out_b + t * stride_out_t + heads * (2 * HALF) + cols
        ok = m & (heads < num_heads + 2 * num_kv_heads)
        tl.store(dst, g1.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, g2.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _geglu_grad_kernel(gu_ptr, dout_ptr, dgu_ptr, hidden, stride_in, stride_dout, stride_dgu,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < hidden
        g = tl.load(gu_ptr + row * stride_in + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_in + hidden + cols, mask=m, other=0.0).to(tl.float32)
        d = tl.load(dout_ptr + row * stride_dout + cols, mask=m, other=0.0).to(tl.float32)
        gelu, dgelu = _gelu_tanh_grad(g)
        tl.store(dgu_ptr + row * stride_dgu + cols, (d * u * dgelu).to(dgu_ptr.dtype.element_ty), mask=m)
        tl.store(dgu_ptr + row * stride_dgu + hidden + cols, (d * gelu).to(dgu_ptr.dtype.element_ty), mask=m)


# -- launchers ------------------------------------------------------------------------------------
def _alloc(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every gradient kernel's output is allocated here (the tests poison it)."""
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def ada_norm_grad(r: torch.Tensor, dh: torch.Tensor, dr: torch.Tensor | None, scale: torch.Tensor,
                  gate: torch.Tensor | None, eps: float, y_dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For h = ada_rms_norm(r, scale, shift) (r (B, T, N) as the forward normalised it) and the
    gradients dh of h and dr of r itself (None: none): r's whole gradient, in r.dtype, and with a
    gate (B or 1, 1, N) that gradient times the gate (the gated residual's y), in `y_dtype`."""
    b, n = r.shape[0], r.shape[-1]
    r2, dh2 = _rows(r, n), _rows(dh, n)
    dx = _alloc(r.shape, r.dtype, r.device)
    dx2 = dx.view(-1, n)
    sc, s_sc = _per_batch(scale, b, n)
    dr2 = _rows(dr, n) if dr is not None else r2
    if gate is not None:
        g, s_g = _per_batch(gate, b, n)
        dy = _alloc(r.shape, y_dtype or r.dtype, r.device)
        dy2 = dy.view(-1, n)
    else:  # unused pointers: anything valid
        g, s_g, dy, dy2 = sc, 0, None, dx2
    _ada_norm_grad_kernel[(r2.shape[0],)](
        r2, dh2, dr2, sc, g, dx2, dy2,
        n, r[0].numel() // n, float(eps),
        r2.stride(0), dh2.stride(0), dr2.stride(0), dx2.stride(0), dy2.stride(0), s_sc, s_g,
        HAS_DR=dr is not None, HAS_GATE=gate is not None, BLOCK=_block(n), **launch_options(r2),
    )
    return dx, dy


def rope_grad(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
    """The gradient of `qkv_rope`'s packed input (B, T, (H + 2 Hkv) D) in `dtype`, from its
    outputs' gradients dq (B, H, T, D), dk, dv (B, Hkv, T, D) (any strides with a unit last one)."""
    b, num_heads, t, head_dim = dq.shape
    num_kv_heads = dk.shape[1]
    dq, dk, dv = (g if g.stride(-1) == 1 else g.contiguous() for g in (dq, dk, dv))
    cos3, sin3 = (c.reshape(c.shape[0], t, head_dim) for c in (cos, sin))
    cos3, sin3 = (c if c.stride(-1) == 1 else c.contiguous() for c in (cos3, sin3))
    heads = num_heads + 2 * num_kv_heads
    out = _alloc((b, t, heads * head_dim), dtype, dq.device)
    half = head_dim // 2
    _rope_grad_kernel[(b * t,)](
        dq, dk, dv, cos3, sin3, out,
        t, num_heads, num_kv_heads,
        cos3.stride(0) if cos3.shape[0] > 1 else 0, cos3.stride(1),
        sin3.stride(0) if sin3.shape[0] > 1 else 0, sin3.stride(1),
        *dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], out.stride(0), out.stride(1),
        HALF=half, BLOCK=_block(half), HEADS=triton.next_power_of_2(heads),
        num_warps=_row_warps(half * heads), **launch_options(dq),
    )
    return out


def geglu_grad(gate_up: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """The gradient of `geglu`'s input gate_up (..., 2 H) from its output's dout (..., H)."""
    hidden = gate_up.shape[-1] // 2
    gu, d = _rows(gate_up, 2 * hidden), _rows(dout, hidden)
    out = _alloc(gate_up.shape, gate_up.dtype, gate_up.device)
    out2 = out.view(-1, 2 * hidden)
    block = min(1024, _block(hidden))
    _geglu_grad_kernel[(gu.shape[0], triton.cdiv(hidden, block))](
        gu, d, out2, hidden, gu.stride(0), d.stride(0), out2.stride(0), BLOCK=block, **launch_options(gu)
    )
    return out


# -- the split attention's backward -----------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _folded_rows(ptr, b, head, tok, s_b, s_h, s_t, d):
        """Pointers to folded query rows (head, token) of a (B, Hq, Tq, D) tensor, columns d."""
        return ptr + (b * s_b + head * s_h + tok * s_t)[:, None] + d[None, :]

    @triton.jit
    def _rows_in(q_ptr, do_ptr, o_ptr, lse_ptr, b, h, bh, r, end, rows, tq, groups,
                 sq_b, sq_h, sq_t, sdo_b, sdo_h, sdo_t, so_b, so_h, so_t, d):
        """Folded query rows r (< end) of one (batch, KV head) of `rows`: q, dO, the forward's
        log-sum-exp and delta = rowsum(dO * O), all zero from `end`."""
        live = r < end
        head = h * groups + r // tq
        tok = r % tq
        q = tl.load(_folded_rows(q_ptr, b, head, tok, sq_b, sq_h, sq_t, d), mask=live[:, None], other=0.0)
        do = tl.load(_folded_rows(do_ptr, b, head, tok, sdo_b, sdo_h, sdo_t, d), mask=live[:, None], other=0.0)
        o = tl.load(_folded_rows(o_ptr, b, head, tok, so_b, so_h, so_t, d), mask=live[:, None], other=0.0)
        lse = tl.load(lse_ptr + bh * rows + r, mask=live, other=0.0)
        return q, do, lse, tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)

    @triton.jit
    def _dq_block(q, do, lse, delta, kb, vb, ok, acc, scale_log2, UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """One key block's share of dq / scale: sum_keys p (dp - delta) k, with p from the forward's
        log-sum-exp and dp = dO v; kb, vb (BLOCK_N, D), ok the keys that may be attended."""
        s = _dot(q, tl.trans(kb), UPCAST, IEEE) * scale_log2
        p = tl.where(ok[None, :], tl.exp2(s - lse[:, None]), 0.0)
        ds = p * (_dot(do, tl.trans(vb), UPCAST, IEEE) - delta[:, None])
        return acc + _dot(ds.to(kb.dtype), kb, UPCAST, IEEE)

    @triton.jit
    def _merge_partials(part_ptr, stride_split, splits, offs, mask):
        """The sum of `splits` float32 partials at offs (split s at s * stride_split), in split order
        (the same sum whichever program merges); read through L2: other programs wrote them."""
        acc = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        for s in range(1, splits):
            acc += tl.load(part_ptr + s * stride_split + offs, mask=mask, other=0.0, cache_modifier=".cg")
        return acc

    @triton.jit
    def _dq_program(
        q_ptr, do_ptr, o_ptr, k_ptr, v_ptr, k2_ptr, v2_ptr, m_ptr, lse_ptr, dq_ptr, pq_ptr, ticket_ptr,
        pid, b, h, bh, rows, keys1, keys2, tq, groups, scale_log2, scale, q_blocks, q_splits, keys_per_split,
        sq_b, sq_h, sq_t, sdo_b, sdo_h, sdo_t, so_b, so_h, so_t, sdq_b, sdq_h, sdq_t,
        sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sk2_b, sk2_h, sk2_n, sv2_b, sv2_h, sv2_n, sm_b,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ):
        """One (query block, key range) program of `_attn_bwd_kernel`: dq = scale * sum p (dp - delta) k
        over its keys, one loop per key part."""
        d = tl.arange(0, D)
        keys = keys1 + keys2
        blk = pid % q_blocks
        split = pid // q_blocks
        r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        q, do, lse, delta = _rows_in(q_ptr, do_ptr, o_ptr, lse_ptr, b, h, bh, r, rows, rows, tq, groups,
                                     sq_b, sq_h, sq_t, sdo_b, sdo_h, sdo_t, so_b, so_h, so_t, d)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        start = split * keys_per_split
        end = tl.minimum(start + keys_per_split, keys)
        end1 = tl.minimum(end, keys1)
        for n0 in range(start, end1, BLOCK_N):  # the cached part
            c = n0 + tl.arange(0, BLOCK_N)
            inb = c < end1
            kb = tl.load(k_ptr + b * sk_b + h * sk_h + c[:, None] * sk_n + d[None, :], mask=inb[:, None], other=0.0)
            vb = tl.load(v_ptr + b * sv_b + h * sv_h + c[:, None] * sv_n + d[None, :], mask=inb[:, None], other=0.0)
            ok = _keys_allowed(m_ptr, b, sm_b, c, end1)
            acc = _dq_block(q, do, lse, delta, kb, vb, ok, acc, scale_log2, UPCAST, IEEE)
        for n0 in range(tl.maximum(start, keys1), end, BLOCK_N):  # the step's own
            c = n0 + tl.arange(0, BLOCK_N)
            inb = c < end
            c2 = c - keys1
            kb = tl.load(k2_ptr + b * sk2_b + h * sk2_h + c2[:, None] * sk2_n + d[None, :], mask=inb[:, None],
                         other=0.0)
            vb = tl.load(v2_ptr + b * sv2_b + h * sv2_h + c2[:, None] * sv2_n + d[None, :], mask=inb[:, None],
                         other=0.0)
            ok = _keys_allowed(m_ptr, b, sm_b, c, end)
            acc = _dq_block(q, do, lse, delta, kb, vb, ok, acc, scale_log2, UPCAST, IEEE)
        live = r < rows
        dst = _folded_rows(dq_ptr, b, h * groups + r // tq, r % tq, sdq_b, sdq_h, sdq_t, d)
        if q_splits == 1:
            tl.store(dst, (acc * scale).to(dq_ptr.dtype.element_ty), mask=live[:, None])
        else:
            offs = (bh * rows + r)[:, None] * D + d[None, :]
            split_stride = tl.num_programs(1) * rows * D
            tl.store(pq_ptr + split * split_stride + offs, acc, mask=live[:, None])
            if _last_of(ticket_ptr + bh * q_blocks + blk, q_splits):
                acc = _merge_partials(pq_ptr, split_stride, q_splits, offs, live[:, None])
                tl.store(dst, (acc * scale).to(dq_ptr.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _dkdv_program(
        q_ptr, do_ptr, o_ptr, k2_ptr, v2_ptr, m_ptr, lse_ptr, dk_ptr, dv_ptr, pkv_ptr, ticket_ptr,
        j, b, h, bh, rows, keys1, keys2, tq, groups, scale_log2, scale, q_blocks, kv_blocks, kv_splits,
        rows_per_split,
        sq_b, sq_h, sq_t, sdo_b, sdo_h, sdo_t, so_b, so_h, so_t, sk2_b, sk2_h, sk2_n, sv2_b, sv2_h, sv2_n, sm_b,
        sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n,
        D: tl.constexpr, KV_BLOCK_M: tl.constexpr, KV_BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """One (block of the step's own keys, row range) program of `_attn_bwd_kernel`: dv = sum p dO and
        dk = scale * sum p (dp - delta) q over its rows."""
        d = tl.arange(0, D)
        keys = keys1 + keys2
        blk = j % kv_blocks
        split = j // kv_blocks
        c2 = blk * KV_BLOCK_N + tl.arange(0, KV_BLOCK_N)
        inb = c2 < keys2
        kb = tl.load(k2_ptr + b * sk2_b + h * sk2_h + c2[:, None] * sk2_n + d[None, :], mask=inb[:, None], other=0.0)
        vb = tl.load(v2_ptr + b * sv2_b + h * sv2_h + c2[:, None] * sv2_n + d[None, :], mask=inb[:, None], other=0.0)
        ok = _keys_allowed(m_ptr, b, sm_b, keys1 + c2, keys)
        dk = tl.zeros([KV_BLOCK_N, D], tl.float32)
        dv = tl.zeros([KV_BLOCK_N, D], tl.float32)
        r_start = split * rows_per_split
        r_end = tl.minimum(r_start + rows_per_split, rows)
        for m0 in range(r_start, r_end, KV_BLOCK_M):
            r = m0 + tl.arange(0, KV_BLOCK_M)
            q, do, lse, delta = _rows_in(q_ptr, do_ptr, o_ptr, lse_ptr, b, h, bh, r, r_end, rows, tq, groups,
                                         sq_b, sq_h, sq_t, sdo_b, sdo_h, sdo_t, so_b, so_h, so_t, d)
            p = tl.exp2(_dot(q, tl.trans(kb), UPCAST, IEEE) * scale_log2 - lse[:, None])
            p = tl.where((r < r_end)[:, None] & ok[None, :], p, 0.0)
            dv += _dot(tl.trans(p.to(do.dtype)), do, UPCAST, IEEE)
            ds = p * (_dot(do, tl.trans(vb), UPCAST, IEEE) - delta[:, None])
            dk += _dot(tl.trans(ds.to(q.dtype)), q, UPCAST, IEEE)
        dk_dst = dk_ptr + b * sdk_b + h * sdk_h + c2[:, None] * sdk_n + d[None, :]
        dv_dst = dv_ptr + b * sdv_b + h * sdv_h + c2[:, None] * sdv_n + d[None, :]
        if kv_splits == 1:
            tl.store(dk_dst, (dk * scale).to(dk_ptr.dtype.element_ty), mask=inb[:, None])
            tl.store(dv_dst, dv.to(dv_ptr.dtype.element_ty), mask=inb[:, None])
        else:
            offs = ((bh * 2) * keys2 + c2)[:, None] * D + d[None, :]  # (split, bh, dk | dv, key, D)
            split_stride = tl.num_programs(1) * 2 * keys2 * D
            tl.store(pkv_ptr + split * split_stride + offs, dk, mask=inb[:, None])
            tl.store(pkv_ptr + split * split_stride + keys2 * D + offs, dv, mask=inb[:, None])
            if _last_of(ticket_ptr + tl.num_programs(1) * q_blocks + bh * kv_blocks + blk, kv_splits):
                dk = _merge_partials(pkv_ptr, split_stride, kv_splits, offs, inb[:, None])
                dv = _merge_partials(pkv_ptr + keys2 * D, split_stride, kv_splits, offs, inb[:, None])
                tl.store(dk_dst, (dk * scale).to(dk_ptr.dtype.element_ty), mask=inb[:, None])
                tl.store(dv_dst, dv.to(dv_ptr.dtype.element_ty), mask=inb[:, None])

    @triton.jit
    def _attn_bwd_kernel(
        q_ptr, do_ptr, o_ptr, k_ptr, v_ptr, k2_ptr, v2_ptr, m_ptr, lse_ptr,
        dq_ptr, dk_ptr, dv_ptr, pq_ptr, pkv_ptr, ticket_ptr,
        rows, keys1, keys2, tq, groups, scale_log2, scale,
        q_blocks, q_splits, keys_per_split, kv_blocks, kv_splits, rows_per_split,
        sq_b, sq_h, sq_t, sdo_b, sdo_h, sdo_t, so_b, so_h, so_t, sdq_b, sdq_h, sdq_t,
        sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sk2_b, sk2_h, sk2_n, sv2_b, sv2_h, sv2_n, sm_b,
        sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n,
        HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        KV_BLOCK_M: tl.constexpr, KV_BLOCK_N: tl.constexpr,
        UPCAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    ):
        """The split attention's backward, two kinds of program in one launch (they need nothing from
        each other: each row's log-sum-exp comes from the forward, delta is recomputed where needed).
        Programs [0, q_blocks * q_splits) are `_dq_program`s (one query block and key range each),
        the rest `_dkdv_program`s (one block of the step's own keys and row range each). With more
        than one range, float32 partials go to pq / pkv and the last program of a block (a ticket)
        sums them in range order, so the result does not depend on which program finishes last. The
        cached keys get no gradient. Row r of the folded query is (head h * groups + r // tq, token
        r % tq)."""
        pdl_enter(PDL)
        pid = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // HKV
        h = bh % HKV
        if pid < q_blocks * q_splits:
            _dq_program(q_ptr, do_ptr, o_ptr, k_ptr, v_ptr, k2_ptr, v2_ptr, m_ptr, lse_ptr, dq_ptr, pq_ptr, ticket_ptr,
                        pid, b, h, bh, rows, keys1, keys2, tq, groups, scale_log2, scale, q_blocks, q_splits,
                        keys_per_split, sq_b, sq_h, sq_t, sdo_b, sdo_h, sdo_t, so_b, so_h, so_t, sdq_b, sdq_h, sdq_t,
                        sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sk2_b, sk2_h, sk2_n, sv2_b, sv2_h, sv2_n, sm_b,
                        D, BLOCK_M, BLOCK_N, UPCAST, IEEE)
        else:
            _dkdv_program(q_ptr, do_ptr, o_ptr, k2_ptr, v2_ptr, m_ptr, lse_ptr, dk_ptr, dv_ptr, pkv_ptr, ticket_ptr,
                          pid - q_blocks * q_splits, b, h, bh, rows, keys1, keys2, tq, groups, scale_log2, scale,
                          q_blocks, kv_blocks, kv_splits, rows_per_split, sq_b, sq_h, sq_t, sdo_b, sdo_h, sdo_t,
                          so_b, so_h, so_t, sk2_b, sk2_h, sk2_n, sv2_b, sv2_h, sv2_n, sm_b, sdk_b, sdk_h, sdk_n,
                          sdv_b, sdv_h, sdv_n, D, KV_BLOCK_M, KV_BLOCK_N, UPCAST, IEEE)


@dataclass(frozen=True)
class GradConfig:
    """The attention backward's tiling: query rows and keys per dq block, the step's own keys and
    query rows per dk / dv block, warps and pipeline stages, and the fewest keys (rows) a dq
    (dk / dv) range may hold. `benchmarks/attention_grad_gpu.py` sweeps them on a GPU; which one a
    shape gets is `grad_config`'s rule. The defaults are the small-batch tiling: on the H200
    (2026-12-04) the fastest of 18, or tied with it, at PI0.5's expert batches 1 and 4 (16.1 / 33.7
    us; one pipeline stage beat two or three in an earlier 38-tiling sweep)."""

    block_m: int = 32
    block_n: int = 64
    kv_block_m: int = 32
    kv_block_n: int = 16
    warps: int = 4
    stages: int = 1
    min_keys: int = 64
    min_rows: int = 32


# 64-row dq blocks on one warpgroup (4 warps: Hopper's wgmma takes 64 rows a warpgroup) with three
# stages, each over every key (one dq range: no float32 partials to write and merge), and 64-row dk /
# dv blocks, each over every row (one dk / dv range, likewise). On the H200 (2026-12-04) at PI0.5's
# expert batch 8 / 16 / 24 / 32 / 64: 48.9 / 78.1 / 99.8 / 131.1 / 230.0 us with dk / dv row ranges of
# 64 rows or more, against 60.6 / 99.1 / 148.1 / 176.3 / 313.1 for the tenth session's 32-row tiling;
# one dk / dv range then took 41.4 us at batch 8 and 118.2 at 32 (48.7 / 131.2 with the ranges, same
# call); the same blocks with two dq key ranges took 152.8 us at batch 32; at batch 4 both tilings
# took 34.1. Wider dk / dv key blocks (32, 64) were slower at every batch (e.g. 180.9 at 32).
LARGE_GRAD = GradConfig(block_m=64, block_n=32, kv_block_m=64, stages=3, min_keys=NO_SPLIT, min_rows=NO_SPLIT)


# the least shared memory: where neither tiling above fits the GPU (see `split_attention_grad`)
SMALL_GRAD = GradConfig(block_m=16, block_n=32, kv_block_m=16)


def grad_config(rows: int, groups: int, sms: int) -> GradConfig:
    """The tiling `split_attention_grad` takes for `rows` folded query rows in each of `groups`
    (batch x KV heads) on a GPU of `sms` SMs: `LARGE_GRAD` once its 64-row blocks give at least a
    quarter of the SMs a program (PI0.5's expert from batch 5 on 132 SMs), the default `GradConfig`
    below that. A module attribute, so a benchmark can swap the rule."""
    return LARGE_GRAD if 4 * triton.cdiv(rows, LARGE_GRAD.block_m) * groups >= sms else GradConfig()


def plan_grad(rows: int, keys: int, keys2: int, groups: int, sms: int, cfg: GradConfig
              ) -> tuple[int, int, int, int]:
    """(dq key ranges, keys per range, dk / dv row ranges, rows per range): enough programs of
    each kind for about two per SM, no dq range under `cfg.min_keys` keys and no dk / dv range
    under `cfg.min_rows` rows, each range a whole number of blocks."""
    q_programs = triton.cdiv(rows, cfg.block_m) * groups
    q_splits = max(1, min(triton.cdiv(2 * sms, q_programs), keys // max(cfg.min_keys, 1)))
    per_keys = triton.cdiv(triton.cdiv(keys, q_splits), cfg.block_n) * cfg.block_n
    kv_programs = max(triton.cdiv(keys2, cfg.kv_block_n) * groups, 1)  # no new keys: no such program runs
    kv_splits = max(1, min(triton.cdiv(sms, kv_programs), rows // max(cfg.min_rows, 1)))
    per_rows = triton.cdiv(triton.cdiv(rows, kv_splits), cfg.kv_block_m) * cfg.kv_block_m
    return triton.cdiv(keys, per_keys), per_keys, triton.cdiv(rows, per_rows), per_rows


def split_attention_grad(q: torch.Tensor, k_cached: torch.Tensor, k_new: torch.Tensor, v_cached: torch.Tensor,
                         v_new: torch.Tensor, key_mask: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                         dout: torch.Tensor, scale: float, tickets: Tickets | None = None,
                         config: GradConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `triton_attention.attention_split` over (cached, new) keys for q (B, Hq, Tq, D)
    and the new keys and values (B, Hkv, Tn, D), from its output `out`, each folded row's
    log-sum-exp `lse` (B x Hkv, Hq / Hkv x Tq) float32 as the forward wrote it (`lse_out`) and the
    output's gradient `dout` (both (B, Hq, Tq, D), any strides with a unit last one); key_mask
    (B, N1 + N2) uint8 as the forward read it (`kernel_key_mask`). One launch (`_attn_bwd_kernel`);
    `tickets`: where its merges take their counters (None: a fresh zeroed buffer); `config`: its
    tiling (None: `grad_config`'s choice for the shape, or where that does not fit the GPU the
    default `GradConfig`, then `SMALL_GRAD`: `triton_dispatch.launch_fitting`)."""
    b, hq, tq, d = q.shape
    hkv = k_new.shape[1]
    groups = hq // hkv
    rows = groups * tq
    keys1, keys2 = k_cached.shape[2], k_new.shape[2]
    q, dout, out = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, dout, out))
    sms = _sm_count(q.device)

    def launch(cfg: GradConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq = _alloc((b, hq, tq, d), q.dtype, q.device)
        dk = _alloc((b, hkv, keys2, d), k_new.dtype, q.device)
        dv = _alloc((b, hkv, keys2, d), v_new.dtype, q.device)
        q_splits, per_keys, kv_splits, per_rows = plan_grad(rows, keys1 + keys2, keys2, b * hkv, sms, cfg)
        q_blocks, kv_blocks = triton.cdiv(rows, cfg.block_m), triton.cdiv(keys2, cfg.kv_block_n)
        # float32 partials only where a block's work is split (else the kernel never reads them)
        pq = _alloc((q_splits, b * hkv, rows, d), torch.float32, q.device) if q_splits > 1 else lse
        pkv = _alloc((kv_splits, b * hkv, 2, keys2, d), torch.float32, q.device) if kv_splits > 1 else lse
        if q_splits > 1 or kv_splits > 1:
            ticket_buf = (tickets if tickets is not None else Tickets(q.device)).take(b * hkv * (q_blocks + kv_blocks))
        else:
            ticket_buf = lse
        strides4 = [s for t in (q, dout, out, dq) for s in t.stride()[:3]]
        _attn_bwd_kernel[(q_blocks * q_splits + kv_blocks * kv_splits, b * hkv)](
            q, dout, out, k_cached, v_cached, k_new, v_new, key_mask, lse, dq, dk, dv, pq, pkv, ticket_buf,
            rows, keys1, keys2, tq, groups, scale * 1.4426950408889634, scale,
            q_blocks, q_splits, per_keys, kv_blocks, kv_splits, per_rows, *strides4,
            *k_cached.stride()[:3], *v_cached.stride()[:3], *k_new.stride()[:3], *v_new.stride()[:3],
            key_mask.stride(0), *dk.stride()[:3], *dv.stride()[:3],
            HKV=hkv, D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, KV_BLOCK_M=cfg.kv_block_m,
            KV_BLOCK_N=cfg.kv_block_n, UPCAST=interpret_mode(), IEEE=q.dtype == torch.float32, num_warps=cfg.warps,
            num_stages=cfg.stages, **launch_options(q),
        )
        return dq, dk, dv

    if config is not None:
        return launch(config)
    chosen = grad_config(rows, b * hkv, sms)
    return launch_fitting("attention backward", q.device, (chosen, GradConfig(), SMALL_GRAD), launch)
