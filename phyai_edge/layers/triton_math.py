"""Device functions the Triton kernel modules share, so a forward kernel, its GEMM-epilogue twins
and its backward compute (and round) alike: GELU (tanh form) and its derivative, rotate-half RoPE
and its transpose, the one-program-a-token head tile of the RoPE kernels, and the split attention's
key-mask test, merge ticket and float32-accumulating product (its forward and its backward). Imported
only where triton is installed."""

from __future__ import annotations

from phyai_edge.layers.triton_dispatch import tl, triton

if triton is not None:

    @triton.jit
    def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """a @ b with float32 accumulation (operands upcast under the interpreter, which has no bf16
        dot; IEEE for float32 operands on a GPU, so no TF32 rounding)."""
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32))
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _gelu_tanh_th(g):
        """tanh(sqrt(2 / pi) (g + 0.044715 g^3)) of a float32 block, its argument clamped to
        [-15, 15] (tanh(15) is 1 in float32; no exp overflow)."""
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi)
        inner = tl.minimum(tl.maximum(inner, -15.0), 15.0)
        return 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)

    @triton.jit
    def _gelu_tanh(g):
        """GELU (tanh approximation) of a float32 block."""
        return 0.5 * g * (1.0 + _gelu_tanh_th(g))

    @triton.jit
    def _gelu_tanh_grad(g):
        """(gelu_tanh(g), its derivative) of a float32 block."""
        th = _gelu_tanh_th(g)
        dgelu = 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
        return 0.5 * g * (1.0 + th), dgelu

    @triton.jit
    def _cos_sin(cs, sn, mask, HALF: tl.constexpr):
        """A row's cos / sin halves as float32: `cs` / `sn` point at the first half, the second
        half `HALF` further."""
        c1 = tl.load(cs, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cs + HALF, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sn, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sn + HALF, mask=mask, other=0.0).to(tl.float32)
        return c1, c2, s1, s2

    @triton.jit
    def _rope(x1, x2, cs, sn, mask, HALF: tl.constexpr):
        """rotate_half RoPE on a head's two halves (float32 blocks), cos / sin as `_cos_sin` reads
        them. Shared by the RoPE kernel and the GEMM epilogues (`triton_gemm`, `triton_gemm_tma`),
        so all round alike."""
        c1, c2, s1, s2 = _cos_sin(cs, sn, mask, HALF)
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2  # (x1, x2) -> x * cos + (-x2, x1) * sin

    @triton.jit
    def _rope_transposed(d1, d2, cs, sn, mask, HALF: tl.constexpr):
        """The transpose of `_rope` (the rotation back): the gradient of its input from its
        output's (d1, d2)."""
        c1, c2, s1, s2 = _cos_sin(cs, sn, mask, HALF)
        return d1 * c1 + d2 * s2, d2 * c2 - d1 * s1

    @triton.jit
    def _token_heads(seq_len, num_heads, num_kv_heads, HALF: tl.constexpr, BLOCK: tl.constexpr,
                     HEADS: tl.constexpr):
        """The RoPE kernels' tile: one program a token (batch b, position t), all its q, k and v
        heads as the (HEADS, BLOCK) rows of one half-head each. Returns b, t, the head and column
        indices, the column mask, which rows are q / k heads, and each row's q / k head index
        (clamped where the row is not one)."""
        bt = tl.program_id(0)
        b = bt // seq_len
        t = bt % seq_len
        heads = tl.arange(0, HEADS)[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        m = cols < HALF
        is_q = heads < num_heads
        is_k = (heads >= num_heads) & (heads < num_heads + num_kv_heads)
        qh = tl.minimum(heads, num_heads - 1)
        kh = tl.maximum(heads - num_heads, 0)
        return b, t, heads, cols, m, is_q, is_k, qh, kh

    @triton.jit
    def _keys_allowed(m_ptr, b, sm_b, c, keys):
        """Which keys c (< keys) the key mask (B, keys) uint8 allows."""
        inb = c < keys
        return inb & (tl.load(m_ptr + b * sm_b + c, mask=inb, other=0) != 0)

    @triton.jit
    def _clock():
        """The SM's cycle counter (%clock64): for `TRACE` timelines only (a GPU; not the interpreter)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _clock_after(x):
        """%clock64 read once the scalar x is known: the read sits in a branch on x, so it cannot be
        issued before the loads and arithmetic x depends on have finished."""
        t = tl.full([], 0, tl.int64)
        if x != 3.0e38:
            t = _clock()
        return t

    @triton.jit
    def _last_of(ticket, splits):
        """Every thread's stores issued (the barrier), then one release-acquire ticket: True for the
        program that draws the last of `splits` (it sees every split's writes), which also puts the
        ticket back to 0 for the next call."""
        tl.debug_barrier()
        last = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == splits - 1
        if last:
            tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")
        return last
