"""The action expert attending with no mask to one KV buffer (`dense_expert`): the RoPE kernel
writing q, k and v into buffers it is given, attention folding token-major queries, the block
stack with a KV cache that has room for the step's own keys, and the engine choosing that loop
for full batches only. Kernels run under `TRITON_INTERPRET=1` on a CPU (or on a GPU); the same
checks run on the reference path everywhere."""

from __future__ import annotations

import copy

import pytest
import torch
from test_cudagraph import _inputs, _rel, _rtc
from test_triton_ops import DEVICE, DTYPES, KERNELS_RUN, _blocks, _float32_truth, _randn, _stack_inputs, tiny  # noqa: F401

from phyai_edge.engines.cudagraph import CudaGraphEngine
from phyai_edge.layers import fused_stacks, triton_ops
from phyai_edge.layers.attention import attention
from phyai_edge.layers.rotary import rope_cos_sin

BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(not KERNELS_RUN, reason="no Triton here"))]


def _nan(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_qkv_rope_writes_into_given_buffers(backend, dtype, kv_heads) -> None:
    """q into a (B, T, H, D) buffer seen transposed, k and v into the last T positions of a cache
    with a prefix before them: the values of the plain call (v copied exactly), every position of
    the buffers written, the prefix positions untouched."""
    b, t, heads, d, p = 2, 5, 4, 16, 7
    width = (heads + 2 * kv_heads) * d
    qkv = _randn(b, t, width, dtype=dtype, seed=21)
    positions = torch.arange(t)[None, :] + torch.tensor([[9], [4]])
    cos, sin = rope_cos_sin(positions.to(DEVICE), d, 10000.0, dtype)
    q_buf = _nan(b, t, heads, d, dtype=dtype)
    keys, values = _nan(b, kv_heads, p + t, d, dtype=dtype), _nan(b, kv_heads, p + t, d, dtype=dtype)
    out = (q_buf.transpose(1, 2), keys[:, :, p:], values[:, :, p:])
    q, k, v = triton_ops.qkv_rope(qkv, cos, sin, heads, kv_heads, d, backend, out=out)
    assert all(got is want for got, want in zip((q, k, v), out))
    rq, rk, rv = triton_ops.qkv_rope(qkv, cos, sin, heads, kv_heads, d, backend)
    assert torch.equal(q, rq) and torch.equal(k, rk) and torch.equal(v, rv)
    assert torch.isfinite(q_buf).all() and torch.isfinite(keys[:, :, p:]).all() and torch.isfinite(values[:, :, p:]).all()
    assert torch.isnan(keys[:, :, :p]).all() and torch.isnan(values[:, :, :p]).all()


def test_qkv_rope_refuses_wrong_buffers_by_name() -> None:
    b, t, heads, d = 1, 3, 2, 16
    qkv = _randn(b, t, (heads + 2) * d, seed=22)
    cos, sin = rope_cos_sin(torch.arange(t)[None].to(DEVICE), d, 10000.0, torch.float32)
    q, kv = _nan(b, heads, t, d, dtype=torch.float32), _nan(b, 1, t, d, dtype=torch.float32)
    with pytest.raises(ValueError, match="out k: a \\(1, 1, 3, 16\\)"):
        triton_ops.qkv_rope(qkv, cos, sin, heads, 1, d, out=(q, kv[:, :, :2], kv))
    with pytest.raises(ValueError, match=r"out v: .* unit last stride"):
        triton_ops.qkv_rope(qkv, cos, sin, heads, 1, d, out=(q, kv, kv.transpose(-1, -2).contiguous().transpose(-1, -2)))
    with pytest.raises(ValueError, match=r"out q: .*bfloat16"):
        triton_ops.qkv_rope(qkv, cos, sin, heads, 1, d, out=(q.bfloat16(), kv, kv))


@pytest.mark.parametrize("mask", [None, "keys"])
def test_attention_folds_token_major_queries_without_copies(mask) -> None:
    """One KV head, q a (B, T, H, D) buffer seen as (B, H, T, D): the same values as the head-major
    fold, and the output comes back as a view of a (B, T, H, D) buffer (what the o-projection
    reads)."""
    g = torch.Generator().manual_seed(5)
    b, t, heads, d, n = 2, 6, 4, 16, 11
    q = torch.randn(b, t, heads, d, generator=g).transpose(1, 2)
    k, v = torch.randn(b, 1, n, d, generator=g), torch.randn(b, 1, n, d, generator=g)
    m = None
    if mask == "keys":
        m = torch.ones(b, 1, 1, n, dtype=torch.bool)
        m[1, ..., 3:6] = False
    out = attention(q, k, v, m)
    want = attention(q.contiguous(), k, v, m)
    assert out.shape == want.shape and _rel(out, want) < 1e-6
    assert out.transpose(1, 2).is_contiguous()


def _joined(k_cache, v_cache, t):
    """The prefix cache copied into buffers with `t` free positions after it (NaN there)."""
    shape = (*k_cache.shape[:3], k_cache.shape[3] + t, k_cache.shape[4])
    keys, values = _nan(*shape, dtype=k_cache.dtype), _nan(*shape, dtype=k_cache.dtype)
    p = k_cache.shape[3]
    keys[..., :p, :] = k_cache
    values[..., :p, :] = v_cache
    return keys, values


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_block_stack_with_joined_kv_is_the_masked_stack(backend, dtype, kv_heads) -> None:
    """With every prefix key valid, the stack over a cache with room (each block writes its keys
    after the prefix, attention with no mask) equals the stack over the two-part keys with an
    all-true mask; every block's room is filled."""
    blocks = _blocks(dtype, kv_heads=kv_heads, heads=2 * kv_heads)
    x, cos, sin, k_cache, v_cache, mask, mods, final = _stack_inputs(blocks, dtype)
    mask = torch.ones_like(mask)
    t, p = x.shape[1], k_cache.shape[3]
    keys, values = _joined(k_cache, v_cache, t)
    with torch.no_grad():
        out = fused_stacks.adaptive_block_stack(blocks, x, cos, sin, keys[..., :p, :], values[..., :p, :], mask, mods,
                                                final, 1e-6, backend, joined=(keys, values))
        ref = fused_stacks.adaptive_block_stack(blocks, x, cos, sin, k_cache, v_cache, mask, mods, final, 1e-6,
                                                backend)
    assert torch.isfinite(out).all() and torch.isfinite(keys).all() and torch.isfinite(values).all()
    assert torch.equal(keys[..., :p, :], k_cache) and torch.equal(values[..., :p, :], v_cache)
    if dtype == torch.float32:
        assert _rel(out, ref) < 1e-5
    else:  # two roundings of the same function: judge both against float32
        truth = _float32_truth(blocks, (x, cos, sin, k_cache, v_cache, mask, mods, final))
        err, ref_err = _rel(out.float(), truth), _rel(ref.float(), truth)
        assert err < 2e-2 and err < 1.5 * ref_err + 1e-3, (err, ref_err)


def test_block_stack_refuses_joined_buffers_that_do_not_fit() -> None:
    blocks = _blocks(torch.float32)
    x, cos, sin, k_cache, v_cache, mask, mods, final = _stack_inputs(blocks, torch.float32)
    keys, values = _joined(k_cache, v_cache, x.shape[1] - 1)  # one position short
    with torch.no_grad(), pytest.raises(ValueError, match=r"joined keys: .*room for the step's 6 tokens"):
        fused_stacks.adaptive_block_stack(blocks, x, cos, sin, k_cache, v_cache, mask, mods, final, 1e-6,
                                          joined=(keys, values))
    keys, values = _joined(k_cache, v_cache, x.shape[1])
    with pytest.raises(ValueError, match="not for a step that needs a gradient"):
        fused_stacks.adaptive_block_stack(blocks, x.requires_grad_(True), cos, sin, k_cache, v_cache, mask, mods,
                                          final, 1e-6, joined=(keys, values))


def _counts(per_chunk: int) -> tuple[int, ...]:
    """Calls of the stack's attention in one `run`: once per step and block eagerly (CPU); on a GPU
    three times while the loop graph is first warmed up and captured (each case below is its
    graph's first use), none on a replay."""
    return (3 * per_chunk,) if torch.device(DEVICE).type == "cuda" else (per_chunk,)


def test_row_warps_are_powers_of_two() -> None:
    """The RoPE kernel's tile with v (8 + 2 heads of 128 columns at full size) asked for 5 warps,
    which only a GPU refuses."""
    assert {triton_ops._row_warps(n) for n in range(1, 5000, 7)} == {1, 2, 4, 8}
    assert triton_ops._row_warps(128 * 9) == 4 and triton_ops._row_warps(128 * 10) == 4


def test_engine_unmasked_expert_for_full_batches(tiny, monkeypatch, backend="reference") -> None:  # noqa: F811
    """From the batch threshold, a batch with every prompt token valid and every camera present
    runs the expert's attention unmasked over the cache with room; a padded batch, a missing
    camera, a smaller batch and exact RTC guidance keep the masked loop. All match the eager
    engine; the unmasked loop's RTC guided-approx too."""
    from phyai_edge.engines import cudagraph

    base, eager = tiny
    monkeypatch.setattr(cudagraph, "DENSE_EXPERT_MIN_BATCH", 2)
    calls = []
    real = fused_stacks.attention_unmasked
    monkeypatch.setattr(fused_stacks, "attention_unmasked", lambda *a: calls.append(1) or real(*a))
    fast = CudaGraphEngine(copy.deepcopy(base), device=DEVICE, dtype="float32", triton_ops=backend,
                           dense_prefix=False)  # only the expert's calls are counted
    per_chunk = base.solver.num_steps * len(base.module.expert_layers)
    noise = torch.randn(2, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(7))
    for valid, masked_view, unmasked in (([16, 16], False, True), ([9, 16], False, False), ([16, 16], True, False)):
        calls.clear()
        inputs = _inputs(base, 2, 3, valid, masked_view=masked_view)
        out, ref = fast.run(inputs, noise=noise), eager.run(inputs, noise=noise)
        assert len(calls) in _counts(per_chunk if unmasked else 0), (valid, masked_view)
        assert torch.isfinite(out).all() and _rel(out.cpu(), ref) < 1e-5, (valid, masked_view)
    full = _inputs(base, 2, 3, [16, 16])
    for mode, unmasked in (("guided-approx", True), ("guided", False)):
        calls.clear()
        rtc = _rtc(base, 2, mode)
        out, ref = fast.run(full, noise=noise, rtc=rtc), eager.run(full, noise=noise, rtc=rtc)
        assert len(calls) in _counts(per_chunk if unmasked else 0), mode
        assert _rel(out.cpu(), ref) < 1e-5, mode
    calls.clear()
    one = _inputs(base, 1, 3, [16])  # below the threshold: no room in its cache, masked
    assert _rel(fast.run(one, noise=noise[:1]).cpu(), eager.run(one, noise=noise[:1])) < 1e-5
    assert calls == [] and fast._graph_set(1, 3, 16).kv_room is None
    gs = fast._graph_set(2, 3, 16)
    assert gs.kv[0].data_ptr() == gs.kv_room[0].data_ptr() and gs.kv[0].shape[3] + base.chunk_size == gs.kv_room[0].shape[3]
    off = CudaGraphEngine(copy.deepcopy(base), device=DEVICE, dtype="float32", triton_ops=backend,
                          dense_expert=False)
    calls.clear()
    assert _rel(off.run(full, noise=noise).cpu(), eager.run(full, noise=noise)) < 1e-5
    assert calls == [] and off._graph_set(2, 3, 16).kv_room is None


@pytest.mark.skipif(not KERNELS_RUN, reason="no Triton here")
def test_engine_unmasked_expert_on_the_kernels(tiny, monkeypatch) -> None:  # noqa: F811
    """The same engine choice with the kernels running (interpreter or GPU): a full batch through
    the unmasked loop matches the eager engine. (The per-case matrix above runs on the reference
    path: each chunk under the interpreter takes tens of seconds.)"""
    from phyai_edge.engines import cudagraph

    base, eager = tiny
    monkeypatch.setattr(cudagraph, "DENSE_EXPERT_MIN_BATCH", 2)
    fast = CudaGraphEngine(copy.deepcopy(base), device=DEVICE, dtype="float32", triton_ops="triton",
                           early_step=False)  # the whole loop on the unmasked expert (test_early_step: beside)
    full = _inputs(base, 2, 3, [16, 16])
    noise = torch.randn(2, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(7))
    out = fast.run(full, noise=noise)
    assert ("none", base.solver, "dense") in fast._graph_set(2, 3, 16).loops
    assert torch.isfinite(out).all() and _rel(out.cpu(), eager.run(full, noise=noise)) < 1e-5


def test_engine_unmasked_expert_with_fp8_expert(tiny, monkeypatch) -> None:  # noqa: F811
    """fp8 expert linears (their reference path here) under the unmasked loop: the same chunk as the
    masked loop of an engine with the same weights, within the attention's rounding."""
    from phyai_edge.engines import cudagraph

    base, _ = tiny
    monkeypatch.setattr(cudagraph, "DENSE_EXPERT_MIN_BATCH", 2)
    full = _inputs(base, 2, 3, [16, 16])
    noise = torch.randn(2, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(8))
    outs = {}
    for dense in (True, False):
        eng = CudaGraphEngine(copy.deepcopy(base), device=DEVICE, dtype="float32", triton_ops="reference",
                              fp8="expert", dense_expert=dense, early_step=False)  # loop variant "dense"
        outs[dense] = eng.run(full, noise=noise).cpu()
        assert (("none", base.solver, "dense") in eng._graph_set(2, 3, 16).loops) == dense
    assert torch.isfinite(outs[True]).all() and _rel(outs[True], outs[False]) < 1e-5


def test_uniform_prompts_keep_their_exact_length(tiny, monkeypatch) -> None:  # noqa: F811
    """From the unmasked graphs' batch size, a batch whose prompts all have one length (9, not a
    multiple of the 16-token bucket) keeps exactly 9 positions and runs unmasked; mixed lengths
    keep the bucket and the mask; past EXACT_PROMPT_LENGTHS lengths the bucket again. Below the
    threshold (the daemon's batch 1) nothing changes. Every chunk matches the eager engine."""
    from phyai_edge.engines import cudagraph

    base, eager = tiny
    monkeypatch.setattr(cudagraph, "DENSE_EXPERT_MIN_BATCH", 2)
    monkeypatch.setattr(cudagraph, "EXACT_PROMPT_LENGTHS", 2)
    fast = CudaGraphEngine(copy.deepcopy(base), device=DEVICE, dtype="float32", triton_ops="reference",
                           dense_prefix=False, early_step=False)  # the whole loop: variant "dense"
    noise = torch.randn(2, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(9))
    # (valid lengths, positions kept, unmasked)
    for valid, length, unmasked in (([9, 9], 9, True), ([9, 12], 16, False), ([5, 5], 5, True),
                                    ([7, 7], 16, False), ([9, 9], 9, True)):
        x = _inputs(base, 2, 3, valid)
        out = fast.run(x, noise=noise)
        assert fast._prompt_length(x.tensors["token_mask"], 3) == length, valid
        # the unmasked loop exists for a set only once a batch has used it (captured on first use)
        assert (("none", base.solver, "dense") in fast._sets[(2, 3, length)].loops) == unmasked, valid
        assert _rel(out.cpu(), eager.run(x, noise=noise)) < 1e-5, valid
    assert fast._exact_lengths[(2, 3)] == {9, 5}
    one = _inputs(base, 1, 3, [9])
    assert fast._prompt_length(one.tensors["token_mask"], 3) == 16
    fast.warmup(2, 3, prompt_tokens=11)  # start-up capture for a known task prompt: its exact length
    assert (2, 3, 11) not in fast._sets  # the cap (2 lengths) is reached: bucket
    assert (2, 3, 16) in fast._sets
