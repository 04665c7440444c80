"""Backward passes of the fused ops (`layers/triton_grad.py`): each kernel's gradient against autograd
through the op's reference, the routing (which calls take the kernels' backward, which the
reference's), the action-expert stack's vector-Jacobian product and the engine's exact RTC mode.

Without a GPU the kernels run under `TRITON_INTERPRET=1` (set by `conftest.py`); every kernel test
skips with the reason where triton is absent.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_cudagraph import _inputs, _rel, _rtc
from test_triton_attention import _RefusesBlockRows
from test_triton_ops import (  # noqa: F401  (poisoned, tiny: fixtures)
    DEVICE,
    DTYPES,
    _blocks,
    _randn,
    _stack_inputs,
    kernels,
    poisoned,
    tiny,
)

from phyai_edge.engines.cudagraph import CudaGraphEngine
from phyai_edge.layers import fused_stacks, triton_attention, triton_dispatch, triton_grad, triton_ops
from phyai_edge.layers.attention import attention
from phyai_edge.layers.rotary import rope_cos_sin
from phyai_edge.layers.triton_attention import attention_split

GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture
def poisoned_grads(poisoned, monkeypatch):  # noqa: F811
    """The forward and gradient kernels' outputs start as NaN."""

    def alloc(shape, dtype, device):
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(triton_grad, "_alloc", alloc)


@pytest.fixture
def spies(monkeypatch):
    """Counts of each gradient launcher's calls."""
    calls: dict[str, int] = {}
    for name in ("ada_norm_grad", "rope_grad", "geglu_grad", "split_attention_grad"):
        fn = getattr(triton_grad, name)

        def spy(*a, _fn=fn, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **k)

        monkeypatch.setattr(triton_grad, name, spy)
    return calls


def _grads(fn, inputs, cotangents):
    """d <outputs, cotangents> / d inputs, with fresh leaves."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.float() * c.float()).sum() for o, c in zip(outs, cotangents) if c is not None)
    return torch.autograd.grad(loss, leaves)


def _check_grads(got, ref, dtype) -> None:
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert torch.isfinite(g).all(), "gradient not fully written (NaN poison left)"
        assert _rel(g.float(), r.float()) < GRAD_TOL[dtype], _rel(g.float(), r.float())


# -- each op ----------------------------------------------------------------------------------------
NORM_SHAPES = [(1, 50, 1024), (2, 7, 96), (3, 5, 1000)]


@kernels
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_batch", [True, False])
def test_ada_rms_norm_grad(poisoned_grads, spies, shape, dtype, per_batch) -> None:
    b, _, n = shape
    mb = b if per_batch else 1
    x = _randn(*shape, dtype=dtype, seed=1)
    scale, shift = _randn(mb, 1, n, dtype=dtype, seed=2, scale=0.3), _randn(mb, 1, n, dtype=dtype, seed=3)
    dh = _randn(*shape, dtype=dtype, seed=4)
    got = _grads(lambda t: triton_ops.ada_rms_norm(t, scale, shift, 1e-6, "triton"), [x], [dh])
    ref = _grads(lambda t: triton_ops.ada_rms_norm(t, scale, shift, 1e-6, "reference"), [x], [dh])
    _check_grads(got, ref, dtype)
    assert spies == {"ada_norm_grad": 1}


@kernels
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("used", ["both", "normed only", "residual only"])
def test_residual_ada_rms_norm_grad(poisoned_grads, spies, shape, dtype, used) -> None:
    """Both outputs carry a gradient (a block's residual feeds the next block), or only the normed
    one (the last block's residual feeds nothing), or only the residual."""
    b, _, n = shape
    x, y = _randn(*shape, dtype=dtype, seed=1), _randn(*shape, dtype=dtype, seed=5, scale=2.0)
    gate, scale, shift = (_randn(b, 1, n, dtype=dtype, seed=s, scale=0.3) for s in (6, 7, 8))
    dres = _randn(*shape, dtype=dtype, seed=9) if used != "normed only" else None
    dh = _randn(*shape, dtype=dtype, seed=10) if used != "residual only" else None
    got = _grads(lambda s, t: triton_ops.residual_ada_rms_norm(s, t, gate, scale, shift, 1e-6, "triton"), [x, y],
                 [dres, dh])
    ref = _grads(lambda s, t: triton_ops.residual_ada_rms_norm(s, t, gate, scale, shift, 1e-6, "reference"),
                 [x, y], [dres, dh])
    _check_grads(got, ref, dtype)
    assert spies == {"ada_norm_grad": 1}


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 1, 32), (2, 2, 16), (3, 1, 6)])
@pytest.mark.parametrize("per_batch", [True, False])
def test_qkv_rope_grad(poisoned_grads, spies, dtype, heads, per_batch) -> None:
    num_heads, num_kv, d = heads
    b, t = 2, 5
    qkv = _randn(b, t, (num_heads + 2 * num_kv) * d, dtype=dtype, seed=1)
    positions = torch.arange(t, device=DEVICE)[None] + (torch.tensor([[3], [11]], device=DEVICE) if per_batch else 4)
    cos, sin = rope_cos_sin(positions, d, 10000.0, dtype)
    cot = [_randn(b, num_heads, t, d, dtype=dtype, seed=2), _randn(b, num_kv, t, d, dtype=dtype, seed=3),
           _randn(b, num_kv, t, d, dtype=dtype, seed=4)]
    got = _grads(lambda q: triton_ops.qkv_rope(q, cos, sin, num_heads, num_kv, d, "triton"), [qkv], cot)
    ref = _grads(lambda q: triton_ops.qkv_rope(q, cos, sin, num_heads, num_kv, d, "reference"), [qkv], cot)
    _check_grads(got, ref, dtype)
    assert spies == {"rope_grad": 1}


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 50, 2 * 4096), (2, 3, 2 * 33)])
def test_geglu_grad(poisoned_grads, spies, dtype, shape) -> None:
    gate_up = _randn(*shape, dtype=dtype, seed=1, scale=2.0)  # both tails of the GELU
    dout = _randn(*shape[:-1], shape[-1] // 2, dtype=dtype, seed=2)
    got = _grads(lambda g: triton_ops.geglu(g, "triton"), [gate_up], [dout])
    ref = _grads(lambda g: triton_ops.geglu(g, "reference"), [gate_up], [dout])
    _check_grads(got, ref, dtype)
    assert spies == {"geglu_grad": 1}


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 4, 1, 6, 9, 16), (1, 8, 1, 50, 70, 32), (2, 4, 2, 5, 33, 16)])
def test_split_attention_grad(poisoned_grads, spies, dtype, shape, monkeypatch) -> None:
    """Queries and the step's own keys / values differentiated through the split kernel's
    backward; the cached prefix part constant, partly masked in one sample and wholly masked in
    another (its rows then attend to every key, as in the forward)."""
    monkeypatch.setattr(triton_attention, "GRAD_ON_KERNEL", True)  # at every shape
    b, h, _, t, _, d = shape
    q, k_new, v_new, k_cached, v_cached, mask = _attention_case(*shape, dtype)
    dout = _randn(b, h, t, d, dtype=dtype, seed=6)
    got = _grads(lambda qq, kk, vv: attention_split(qq, (k_cached, kk), (v_cached, vv), mask, backend="triton"),
                 [q, k_new, v_new], [dout])
    ref = _grads(lambda qq, kk, vv: attention(qq, torch.cat([k_cached, kk], 2), torch.cat([v_cached, vv], 2), mask),
                 [q, k_new, v_new], [dout])
    _check_grads(got, ref, dtype)
    assert spies == {"split_attention_grad": 1}
    with torch.no_grad():  # the forward is the split kernel's
        plain = attention_split(q, (k_cached, k_new), (v_cached, v_new), mask, backend="triton")
    fwd = attention_split(q.clone().requires_grad_(True), (k_cached, k_new), (v_cached, v_new), mask,
                          backend="triton")
    assert type(fwd.grad_fn).__name__ == "SplitAttentionFnBackward"
    assert torch.equal(fwd.detach(), plain)


def _attention_case(b, h, hkv, t, p, d, dtype):
    q = _randn(b, h, t, d, dtype=dtype, seed=1)
    k_new, v_new = _randn(b, hkv, t, d, dtype=dtype, seed=2), _randn(b, hkv, t, d, dtype=dtype, seed=3)
    k_cached, v_cached = _randn(b, hkv, p, d, dtype=dtype, seed=4), _randn(b, hkv, p, d, dtype=dtype, seed=5)
    mask = torch.ones(b, 1, 1, p + t, dtype=torch.bool, device=DEVICE)
    mask[-1, ..., p - 4 : p] = False
    if b > 1:
        mask[0] = False  # a wholly masked sample: its rows attend to every key, as in the forward
    return q, k_new, v_new, k_cached, v_cached, mask


# Tilings of the backward on the interpreter's 8 "SMs": one range of each kind; dq's keys and dk / dv's
# rows both split (the in-kernel merges); the large-batch tiling (64-row blocks, 64-row dk / dv blocks).
GRAD_TILINGS = {
    "whole": triton_grad.GradConfig(min_keys=1 << 20, min_rows=1 << 20),
    "split": triton_grad.GradConfig(block_n=16, kv_block_m=16, min_keys=16, min_rows=16),
    "large": triton_grad.LARGE_GRAD,
}


@kernels
def test_grad_tiling_by_shape() -> None:
    """`grad_config` gives PI0.5's expert (400 folded rows a sample, one KV head) on the H200's 132 SMs
    the large-batch tiling (one dq range) where its 64-row blocks give a quarter of the SMs a program
    (from batch 5), the default below."""
    large = triton_grad.LARGE_GRAD
    assert triton_grad.grad_config(400, 32, 132) == large
    assert triton_grad.grad_config(400, 5, 132) == large
    assert triton_grad.grad_config(400, 4, 132) == triton_grad.GradConfig()
    assert triton_grad.grad_config(400, 1, 132) == triton_grad.GradConfig()
    assert large.block_m == 64 and triton_grad.GradConfig().block_m == 32
    for batch in (5, 8, 32, 64):  # one dq range and one dk / dv range, whatever the batch
        q_splits, _, kv_splits, _ = triton_grad.plan_grad(400, 866, 50, batch, 132, large)
        assert q_splits == kv_splits == 1


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiling", list(GRAD_TILINGS))
def test_split_attention_grad_tilings(poisoned_grads, dtype, tiling) -> None:
    """The backward launch against autograd through the reference for each tiling; where the work
    is split, the partials are merged in range order, so two calls give the same bits, and the
    merge counters are left at zero for the next call."""
    b, h, hkv, t, p, d = 2, 4, 1, 20, 70, 32
    q, k_new, v_new, k_cached, v_cached, mask = _attention_case(b, h, hkv, t, p, d, dtype)
    dout = _randn(b, h, t, d, dtype=dtype, seed=6)
    cfg = GRAD_TILINGS[tiling]
    rows, keys = h // hkv * t, p + t
    q_splits, _, kv_splits, _ = triton_grad.plan_grad(rows, keys, t, b * hkv, triton_grad._sm_count(q.device), cfg)
    assert (q_splits > 1 and kv_splits > 1) if tiling == "split" else (q_splits == kv_splits == 1)
    key_mask = triton_attention.kernel_key_mask(mask, b)
    scale = d ** -0.5
    lse = torch.empty(b * hkv, rows, dtype=torch.float32, device=DEVICE)
    out = triton_attention._split_attention_triton(q.reshape(b, hkv, rows, d), (k_cached, k_new), (v_cached, v_new),
                                                   key_mask, scale, None, t, lse_out=lse).transpose(1, 2)
    tickets = triton_attention.Tickets(q.device)
    got = triton_grad.split_attention_grad(q, k_cached, k_new, v_cached, v_new, key_mask, out, lse, dout, scale,
                                           tickets, cfg)
    ref = _grads(lambda qq, kk, vv: attention(qq, torch.cat([k_cached, kk], 2), torch.cat([v_cached, vv], 2), mask),
                 [q, k_new, v_new], [dout])
    _check_grads(got, ref, dtype)
    again = triton_grad.split_attention_grad(q, k_cached, k_new, v_cached, v_new, key_mask, out, lse, dout, scale,
                                             tickets, cfg)
    assert all(torch.equal(a, g) for a, g in zip(again, got))
    if tiling == "split":
        assert tickets._buf is not None and int(tickets._buf.abs().sum()) == 0


@kernels
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("inline_merge", [True, False])
def test_forward_writes_each_rows_log_sum_exp(splits, inline_merge) -> None:
    """What the backward reads instead of a pass of its own: the forward's log-sum-exp of each folded
    row's scaled scores (base 2) over the keys it may attend, whether one program holds a row's keys,
    the split kernel merges its splits or a second kernel does; a wholly masked row over every key."""
    b, h, hkv, t, p, d = 2, 4, 2, 5, 40, 16
    q, k_new, v_new, k_cached, v_cached, mask = _attention_case(b, h, hkv, t, p, d, torch.float32)
    key_mask = triton_attention.kernel_key_mask(mask, b)
    rows = h // hkv * t
    lse = torch.full((b * hkv, rows), float("nan"), device=DEVICE)
    cfg = triton_attention.SplitConfig(block_m=16, block_n=16, min_keys=16, inline_merge=inline_merge)
    triton_attention._split_attention_triton(q.reshape(b, hkv, rows, d), (k_cached, k_new), (v_cached, v_new),
                                             key_mask, 0.25, splits, t, cfg, lse_out=lse)
    k = torch.cat([k_cached, k_new], 2)
    scores = (q.reshape(b, hkv, rows, d) @ k.transpose(-1, -2)) * 0.25
    scores = scores.masked_fill(key_mask[:, None, None, :] == 0, float("-inf"))
    want = (torch.logsumexp(scores, -1) / torch.log(torch.tensor(2.0))).reshape(b * hkv, rows)
    assert torch.allclose(lse, want, atol=1e-5, rtol=1e-5), (lse - want).abs().max()


@kernels
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_vjp_attention_by_shape(spies, monkeypatch, batch) -> None:
    """By default the split kernel's backward serves batch x KV heads up to `GRAD_KERNEL_MAX_HEADS`
    (2 here, so both sides of the rule run) and SDPA over the joined keys the rest; the gradients agree."""
    monkeypatch.setattr(triton_attention, "GRAD_KERNEL_MAX_HEADS", 2)
    q = _randn(batch, 2, 3, 16, seed=1)
    k_new, v_new = _randn(batch, 1, 3, 16, seed=2), _randn(batch, 1, 3, 16, seed=3)
    k_cached, v_cached = _randn(batch, 1, 5, 16, seed=4), _randn(batch, 1, 5, 16, seed=5)
    mask = torch.ones(batch, 1, 1, 8, dtype=torch.bool, device=DEVICE)
    dout = _randn(batch, 2, 3, 16, seed=6)
    got = _grads(lambda qq, kk, vv: attention_split(qq, (k_cached, kk), (v_cached, vv), mask, backend="triton"),
                 [q, k_new, v_new], [dout])
    ref = _grads(lambda qq, kk, vv: attention(qq, torch.cat([k_cached, kk], 2), torch.cat([v_cached, vv], 2), mask),
                 [q, k_new, v_new], [dout])
    _check_grads(got, ref, torch.float32)
    on_kernel = batch <= triton_attention.GRAD_KERNEL_MAX_HEADS
    assert spies == ({"split_attention_grad": 1} if on_kernel else {})


# -- routing ----------------------------------------------------------------------------------------
@kernels
def test_gradients_the_kernels_do_not_give_take_the_reference(spies) -> None:
    """A gradient for a modulation, the rotary tables or the cached keys is the reference's (the
    kernels' backward differentiates activations only); no gradient at all runs the plain kernel."""
    x = _randn(2, 5, 64, seed=1).requires_grad_(True)
    scale, shift = _randn(2, 1, 64, seed=2).requires_grad_(True), _randn(2, 1, 64, seed=3)
    out = triton_ops.ada_rms_norm(x, scale, shift, 1e-6, backend="triton")
    assert "AdaRmsNormFn" not in type(out.grad_fn).__name__
    gs = torch.autograd.grad(out.sum(), scale)[0]
    sc = scale.detach().requires_grad_(True)
    ref = torch.autograd.grad(triton_ops.ada_rms_norm(x, sc, shift, 1e-6, backend="reference").sum(), sc)[0]
    assert torch.allclose(gs, ref)
    with torch.no_grad():
        assert triton_ops.ada_rms_norm(x, scale, shift, 1e-6, backend="triton").grad_fn is None
    assert type(triton_ops.ada_rms_norm(x, scale.detach(), shift, 1e-6, backend="triton").grad_fn).__name__ == \
        "AdaRmsNormFnBackward"

    qkv = _randn(1, 3, 3 * 16, seed=4).requires_grad_(True)
    cos, sin = rope_cos_sin(torch.arange(3, device=DEVICE)[None], 16, 10000.0, torch.float32)
    q, _, _ = triton_ops.qkv_rope(qkv, cos.requires_grad_(True), sin, 1, 1, 16, "triton")
    assert "QkvRopeFn" not in type(q.grad_fn).__name__
    k_cached = _randn(1, 1, 4, 16, seed=5).requires_grad_(True)
    new = _randn(1, 1, 3, 16, seed=6).requires_grad_(True)
    mask = torch.ones(1, 1, 1, 7, dtype=torch.bool, device=DEVICE)
    att = attention_split(_randn(1, 2, 3, 16, seed=7), (k_cached, new), (k_cached.detach(), new), mask,
                          backend="triton")
    assert "SplitAttentionFn" not in type(att.grad_fn).__name__
    torch.autograd.grad(att.sum(), k_cached)  # SDPA's gradient reaches the cached keys
    assert spies == {}


# -- the action-expert stack and the engine -----------------------------------------------------------
@kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_stack_vjp(poisoned_grads, spies, dtype) -> None:
    """The expert stack's input gradient (what exact guidance takes) on the kernels, small-M GEMM
    routing on, against autograd through the reference path; every op on its kernel's backward."""
    blocks = _blocks(dtype)
    x, *rest = _stack_inputs(blocks, dtype)
    cot = _randn(*x.shape, dtype=dtype, seed=21)

    def stack(backend, gemm):
        return lambda t: fused_stacks.adaptive_block_stack(blocks, t, *rest, 1e-6, backend=backend,
                                                           gemm_backend=gemm)

    (got,) = _grads(stack("triton", "triton"), [x], [cot])
    n = len(blocks)
    assert spies == {"ada_norm_grad": 2 * n + 1, "rope_grad": n, "geglu_grad": n, "split_attention_grad": n}
    (ref,) = _grads(stack("reference", None), [x], [cot])
    assert torch.isfinite(got).all()
    if dtype == torch.float32:
        assert _rel(got, ref) < 1e-5
        return
    # bf16: both against the float32 gradient. Through three blocks of random weights either path's
    # error is a few percent and which is smaller varies with the rounding (CPU: 3.5e-2 against the
    # reference's 1.8e-2; H200: 3.5e-2 against 1.0e-1): a bound for both, not a ranking. The fp32 case
    # above and each op's bf16 test are where the backward's arithmetic is pinned down.
    truth_blocks = [copy.deepcopy(b).float() for b in blocks]
    for b in truth_blocks:
        b.self_attn.fuse()
        b.mlp.fuse()
    f32 = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in (x, *rest[:5])]
    (truth,) = _grads(lambda t: fused_stacks.adaptive_block_stack(truth_blocks, t, *f32[1:], *rest[5:], 1e-6),
                      [f32[0]], [cot])
    err, ref_err = _rel(got.float(), truth), _rel(ref.float(), truth)
    assert err < 6e-2, (err, ref_err)


@kernels
def test_engine_exact_guidance_on_the_kernels(tiny, spies) -> None:  # noqa: F811
    """The engine's exact RTC mode (a VJP every flow step) runs its forward and backward on the
    kernels and gives eager's chunk (fp32)."""
    base, eager = tiny
    fast = CudaGraphEngine(copy.deepcopy(base), device=DEVICE, dtype="float32", triton_ops=True)
    inputs = _inputs(base, 2, 3, [9, 30], masked_view=True)
    noise = torch.randn(2, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(7))
    rtc = _rtc(base, 2, "guided")
    out, ref = fast.run(inputs, noise=noise, rtc=rtc), eager.run(inputs, noise=noise, rtc=rtc)
    steps, depth = base.solver.num_steps, len(base.module.expert_layers)
    # once a step and block per pass through the loop (on a GPU, capture runs it more than once)
    passes = spies.get("rope_grad", 0) // (steps * depth)
    assert passes >= 1
    assert spies == {"ada_norm_grad": passes * steps * (2 * depth + 1), "rope_grad": passes * steps * depth,
                     "geglu_grad": passes * steps * depth, "split_attention_grad": passes * steps * depth}
    assert _rel(out.cpu(), ref.cpu()) < 1e-5
    unguided = fast.run(inputs, noise=noise)
    assert _rel(out.cpu(), unguided.cpu()) > 1e-3  # the guidance changed the chunk


@kernels
def test_backward_tiling_too_big_for_the_gpu_falls_back(monkeypatch, caplog) -> None:
    """Where the large-batch tiling does not fit the GPU (its 64-row blocks refused at launch, as
    Triton refuses a tiling that asks for more shared memory than the GPU has), the default
    `GradConfig` runs instead, with that tiling's own gradients, said once in the log."""
    monkeypatch.setattr(triton_dispatch, "_DOES_NOT_FIT", set())
    monkeypatch.setattr(triton_grad, "grad_config", lambda rows, groups, sms: triton_grad.LARGE_GRAD)
    b, h, hkv, t, p, d = 2, 4, 1, 20, 70, 32
    q, k_new, v_new, k_cached, v_cached, mask = _attention_case(b, h, hkv, t, p, d, torch.float32)
    dout = _randn(b, h, t, d, seed=6)
    key_mask = triton_attention.kernel_key_mask(mask, b)
    rows = h // hkv * t
    lse = torch.empty(b * hkv, rows, dtype=torch.float32, device=DEVICE)
    out = triton_attention._split_attention_triton(q.reshape(b, hkv, rows, d), (k_cached, k_new), (v_cached, v_new),
                                                   key_mask, d ** -0.5, None, t, lse_out=lse).transpose(1, 2)
    args = (q, k_cached, k_new, v_cached, v_new, key_mask, out, lse, dout, d ** -0.5)
    want = triton_grad.split_attention_grad(*args, config=triton_grad.GradConfig())
    refusing = _RefusesBlockRows(triton_grad._attn_bwd_kernel, triton_grad.LARGE_GRAD.block_m)
    monkeypatch.setattr(triton_grad, "_attn_bwd_kernel", refusing)
    with caplog.at_level("WARNING", logger="phyai_edge.layers.triton_dispatch"):
        got = triton_grad.split_attention_grad(*args)
        again = triton_grad.split_attention_grad(*args)
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and all(torch.equal(g, w) for g, w in zip(again, want))
    assert refusing.refused == 1
    assert sum("attention backward: tiling" in r.getMessage() for r in caplog.records) == 1
