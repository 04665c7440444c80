"""Adaptive norms folded into the small-M GEMMs around them (`triton_ops.FoldedNorm`): the producer
(`triton_ops.ada_rms_fold`, `triton_fold.linear_residual_fold`, `linear_fold_start`), the consumers (`linear_qkv_rope` /
`linear_geglu` with `norm=`), the expert's stack with `folded=` and the PI0.5 stage and engine that
tabulate it.

What a fold must equal: the unfolded path (residual, then rms_norm(r) (1 + scale) + shift, then the
GEMM) up to rounding. float32 checks are tight (1e-5 relative: only the summation order differs);
bf16 checks are against float32 truths, as `test_triton_gemm.py` judges the stack. Kernel tests run
under Triton's interpreter on the CPU (`conftest.py`), outputs poisoned with NaN so an element a
kernel fails to write shows up.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_cudagraph import _rel
from test_triton_gemm import _denoise_args, _tiny_model, _weight, float32_routed, kernels, poisoned  # noqa: F401
from test_triton_ops import _blocks, _float32_truth, _stack_inputs, _stack_reference

from phyai_edge.layers import fused_stacks, triton_fold, triton_ops
from phyai_edge.layers import triton_gemm as tg
from phyai_edge.layers.norm import ada_rms_norm_ref
from phyai_edge.layers.rotary import rope_cos_sin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _unfolded(r, scale, shift, eps):
    """The norm as the model runs it, in float32: rms_norm(r) (1 + scale) + shift."""
    return ada_rms_norm_ref(r.float(), scale.float(), shift.float(), eps)


# -- the producers --------------------------------------------------------------------------------------
@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ada_rms_fold_kernel(dtype) -> None:
    x = _randn(2, 7, 40, dtype=dtype, seed=1, scale=3.0)
    scale = _randn(2, 1, 40, seed=2, scale=0.3)
    out = triton_ops.ada_rms_fold(x, scale, 1e-6, "triton")
    ref = triton_ops.ada_rms_fold_ref(x, scale, 1e-6)
    assert out.u.dtype == dtype and out.stats.shape == (14, 1)
    assert torch.allclose(out.stats, ref.stats, rtol=1e-5)
    assert _rel(out.u.float(), ref.u.float()) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.allclose(out.rstd(), torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6).flatten(), rtol=1e-5)


RESIDUAL_CONFIGS = {
    "one split": tg.GemmConfig(16, 16, 32),
    "split 3": tg.GemmConfig(16, 16, 16, split_k=3),  # the last split of each tile reduces, ragged K
    "default": None,
}


@kernels
@pytest.mark.parametrize("config", list(RESIDUAL_CONFIGS))
@pytest.mark.parametrize("batch", [1, 2])
def test_linear_residual_fold_kernel(poisoned, config, batch) -> None:  # noqa: F811
    """float32: the residual, u and the row statistics against the reference; the norm they stand
    for against the unfolded norm."""
    k, n, t = 72, 40, 7
    h = _randn(batch, t, k, seed=3)
    w = _weight(n, k, torch.float32, seed=4)
    x = _randn(batch, t, n, seed=5, scale=2.0)
    gate = _randn(batch, 1, n, seed=6)
    scale = _randn(batch, 1, n, seed=7, scale=0.3)
    r, norm = triton_fold.linear_residual_fold(h, w, x, gate, scale, 1e-6, "triton", config=RESIDUAL_CONFIGS[config])
    r_ref, norm_ref = triton_fold.linear_residual_fold(h, w, x, gate, scale, 1e-6, "reference")
    assert torch.isfinite(r).all() and torch.isfinite(norm.u).all() and torch.isfinite(norm.stats).all()
    assert _rel(r, r_ref) < 1e-5 and _rel(norm.u, norm_ref.u) < 1e-5
    assert torch.allclose(norm.stats.sum(-1), norm_ref.stats.sum(-1), rtol=1e-5)
    # what the fold stands for: u * rstd + shift is the norm of r
    shift = _randn(batch, 1, n, seed=8)
    normed = norm.u * norm.rstd().view(batch, t, 1) + shift
    assert _rel(normed, _unfolded(x + F.linear(h, w) * gate, scale, shift, 1e-6)) < 1e-5


@kernels
def test_linear_residual_fold_split_tickets_are_left_at_zero() -> None:
    """The in-kernel reduction's tickets go back to zero, so a shared buffer serves the next call."""
    from phyai_edge.layers.triton_dispatch import Tickets

    tickets = Tickets(torch.device(DEVICE))
    h, w = _randn(1, 5, 64, seed=1), _weight(32, 64, torch.float32, seed=2)
    x, gate, scale = _randn(1, 5, 32, seed=3), _randn(1, 1, 32, seed=4), _randn(1, 1, 32, seed=5)
    cfg = tg.GemmConfig(16, 16, 16, split_k=4)
    first = triton_fold.linear_residual_fold(h, w, x, gate, scale, 1e-6, "triton", config=cfg, tickets=tickets)
    assert int(tickets._buf.abs().sum()) == 0
    second = triton_fold.linear_residual_fold(h, w, x, gate, scale, 1e-6, "triton", config=cfg, tickets=tickets)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1].u, second[1].u)


def test_linear_residual_fold_checks() -> None:
    h, w, x = torch.zeros(1, 5, 8), torch.zeros(4, 8), torch.zeros(1, 5, 6)
    with pytest.raises(ValueError, match="do not match"):
        triton_fold.linear_residual_fold(h, w, x, torch.zeros(1, 1, 6), torch.zeros(1, 1, 6), 1e-6)


@kernels
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_fold_start_kernel(poisoned, out_dtype, bias) -> None:  # noqa: F811
    """The input projection that starts the stream (float32 weights, as PI0.5's action projection):
    r = (h W^T + b) in out_dtype, u and the row statistics of its first norm, against the reference
    (projection, cast, `ada_rms_fold_ref`) and the norm they stand for against the unfolded one."""
    batch, t, k, n = 2, 7, 24, 40
    h, w = _randn(batch, t, k, seed=40), _weight(n, k, torch.float32, seed=41)
    b = _randn(n, seed=42) if bias else None
    scale, shift = _randn(1, 1, n, seed=43, scale=0.3), _randn(1, 1, n, seed=44)
    r, norm = triton_fold.linear_fold_start(h, w, b, scale, 1e-6, out_dtype, "triton", config=tg.GemmConfig(16, 16, 16))
    want_r = F.linear(h, w, b).to(out_dtype)
    want = triton_ops.ada_rms_fold_ref(want_r, scale, 1e-6)
    assert r.dtype == norm.u.dtype == out_dtype and norm.stats.shape == (batch * t, 3)  # 40 columns in 16-wide tiles
    assert torch.isfinite(r).all() and torch.isfinite(norm.u).all() and torch.isfinite(norm.stats).all()
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2  # bf16: the interpreter truncates where a GPU rounds
    assert _rel(r.float(), want_r.float()) < tol and _rel(norm.u.float(), want.u.float()) < tol
    assert torch.allclose(norm.stats.sum(-1), want.stats.sum(-1), rtol=tol)
    normed = norm.u.float() * norm.rstd().view(batch, t, 1) + shift
    assert _rel(normed, _unfolded(r, scale, shift, 1e-6)) < tol
    ref_r, ref_norm = triton_fold.linear_fold_start(h, w, b, scale, 1e-6, out_dtype, "reference")
    assert torch.equal(ref_r, want_r) and torch.equal(ref_norm.u, want.u)


@kernels
@pytest.mark.parametrize("u_dtype", [torch.float32, torch.bfloat16])
def test_linear_folded_kernel(poisoned, u_dtype) -> None:  # noqa: F811
    """The output projection that finishes the final folded norm: float32 weights reading u in
    float32 or bf16 (PI0.5's action output projection after the bf16 expert), with a bias, against the
    unfolded norm then the linear, and against the reference path."""
    batch, t, k, n = 2, 7, 48, 20
    r, scale, shift, norm = _folded_input(batch, t, k, seed=50, dtype=u_dtype)
    w, b = _weight(n, k, torch.float32, seed=53), _randn(n, seed=54)
    nb = fused_stacks.fold_shift(shift, w)
    out = triton_fold.linear_folded(norm, w, nb, "triton", bias=b, out_dtype=torch.float32, config=tg.GemmConfig(16, 16, 16))
    want = F.linear(_unfolded(r, scale, shift, 1e-6), w, b)
    assert out.dtype == torch.float32 and out.shape == (batch, t, n) and torch.isfinite(out).all()
    # bf16: u is rounded where the unfolded norm's output would be
    assert _rel(out, want) < (1e-5 if u_dtype == torch.float32 else 1e-2)
    ref = triton_fold.linear_folded(norm, w, nb, "reference", bias=b)
    assert ref.dtype == torch.float32 and _rel(out, ref) < 1e-5
    with pytest.raises(ValueError, match="norm_bias"):
        triton_fold.linear_folded(norm, w, nb[:, :3], "triton")


# -- the consumers ----------------------------------------------------------------------------------------
def _folded_input(batch, t, k, seed, dtype=torch.float32):
    r = _randn(batch, t, k, seed=seed, scale=2.0).to(dtype)
    scale = _randn(batch, 1, k, seed=seed + 1, scale=0.3)
    shift = _randn(batch, 1, k, seed=seed + 2, scale=0.5)
    return r, scale, shift, triton_ops.ada_rms_fold_ref(r, scale, 1e-6)


@kernels
@pytest.mark.parametrize("batch", [1, 2])
def test_linear_geglu_with_a_folded_norm(poisoned, batch) -> None:  # noqa: F811
    k, hidden, t = 48, 40, 7
    r, scale, shift, norm = _folded_input(batch, t, k, seed=20)
    w = _weight(2 * hidden, k, torch.float32, seed=23)
    nb = F.linear(shift.reshape(batch, k), w)
    out = tg.linear_geglu(norm.u, w, "triton", norm=norm, norm_bias=nb, config=tg.GemmConfig(16, 16, 16))
    want = tg.linear_geglu_ref(_unfolded(r, scale, shift, 1e-6), w)
    assert torch.isfinite(out).all() and _rel(out, want) < 1e-5
    assert _rel(tg.linear_geglu(norm.u, w, "reference", norm=norm, norm_bias=nb), want) < 1e-5


@kernels
@pytest.mark.parametrize("batch", [1, 2])
def test_linear_qkv_rope_with_a_folded_norm(poisoned, batch) -> None:  # noqa: F811
    heads, kv_heads, d, k, t = 2, 1, 16, 48, 7
    r, scale, shift, norm = _folded_input(batch, t, k, seed=30)
    w = _weight((heads + 2 * kv_heads) * d, k, torch.float32, seed=33)
    positions = torch.arange(t, device=DEVICE)[None, :] + torch.arange(batch, device=DEVICE)[:, None] * 3
    cos, sin = rope_cos_sin(positions, d, 10000.0, torch.float32)
    nb = F.linear(shift.reshape(batch, k), w)
    out = tg.linear_qkv_rope(norm.u, w, cos, sin, heads, kv_heads, d, "triton", norm=norm, norm_bias=nb,
                             config=tg.GemmConfig(16, 16, 16))
    want = tg.linear_qkv_rope_ref(_unfolded(r, scale, shift, 1e-6), w, cos, sin, heads, kv_heads, d)
    for o, ref in zip(out, want):
        assert torch.isfinite(o).all() and _rel(o, ref) < 1e-5


def test_folded_consumer_checks() -> None:
    _, _, _, norm = _folded_input(1, 5, 8, seed=1)
    w = torch.zeros(6, 8)
    with pytest.raises(ValueError, match="norm_bias"):
        tg.linear_geglu(norm.u, w, norm=norm)
    with pytest.raises(ValueError, match="norm_bias without norm"):
        tg.linear_geglu(norm.u, w, norm_bias=torch.zeros(1, 6))
    with pytest.raises(ValueError, match="is not the folded norm's u"):
        tg.linear_geglu(norm.u[:, :3], w, norm=norm, norm_bias=torch.zeros(1, 6))
    with pytest.raises(ValueError, match="norm_bias"):  # float32 (B or 1, N) only
        tg.linear_geglu(norm.u, w, norm=norm, norm_bias=torch.zeros(1, 6, dtype=torch.bfloat16))
    short = triton_ops.FoldedNorm(norm.u, norm.stats[:2], norm.eps)
    with pytest.raises(ValueError, match="norm stats"):
        tg.linear_geglu(norm.u, w, norm=short, norm_bias=torch.zeros(1, 6))


@kernels
def test_folded_norm_bias_must_broadcast_over_the_batch() -> None:
    _, _, _, norm = _folded_input(2, 5, 16, seed=3)
    w = _weight(8, 16, torch.float32, seed=4)
    with pytest.raises(ValueError, match="does not broadcast"):
        tg.linear_geglu(norm.u, w, "triton", norm=norm, norm_bias=torch.zeros(3, 8, device=DEVICE))


# -- the stack, the stage, the engine ----------------------------------------------------------------------
def _one_sample(args):
    """The stack inputs of `test_triton_ops._stack_inputs` cut to batch 1 (the folded path's case)."""
    x, cos, sin, k_cache, v_cache, mask, mods, final = args
    one = [tuple(tuple(m[:1] for m in pair) for pair in layer) for layer in mods]
    return (x[:1], cos[:1], sin[:1], k_cache[:, :1], v_cache[:, :1], mask[:1], one, tuple(m[:1] for m in final))


@kernels
def test_block_stack_folded_fp32(poisoned, float32_routed, monkeypatch) -> None:  # noqa: F811
    """float32, every projection on the kernels: the folded stack runs 5 kernels a block where the
    unfolded one runs 7 (no norm kernel between GEMMs), and gives the model's result."""
    blocks = _blocks(torch.float32)
    args = _one_sample(_stack_inputs(blocks, torch.float32))
    folded = fused_stacks.fold_modulation(blocks, args[6])
    calls = {"norm": 0, "residual": 0}
    real_norm, real_res = triton_ops._residual_ada_norm_triton, triton_fold._linear_residual_triton

    def count(name, real):
        def counted(*a, **kw):
            calls[name] += 1
            return real(*a, **kw)
        return counted

    monkeypatch.setattr(triton_ops, "_residual_ada_norm_triton", count("norm", real_norm))
    monkeypatch.setattr(triton_fold, "_linear_residual_triton", count("residual", real_res))
    with torch.no_grad():
        out = fused_stacks.adaptive_block_stack(blocks, *args, 1e-6, backend="triton", gemm_backend="triton",
                                                folded=folded)
        ref = _stack_reference(blocks, *args)
    n = len(blocks)
    assert calls == {"norm": 2, "residual": 2 * n - 1}  # the first fold and the final norm; o_proj, down
    assert torch.isfinite(out).all() and _rel(out, ref) < 1e-5
    assert fused_stacks.set_fold_norms(False)
    try:
        calls.update(norm=0, residual=0)
        with torch.no_grad():
            plain = fused_stacks.adaptive_block_stack(blocks, *args, 1e-6, backend="triton", gemm_backend="triton",
                                                      folded=folded)
        assert calls == {"norm": 2 * n + 1, "residual": 0} and _rel(plain, ref) < 1e-5
    finally:
        fused_stacks.set_fold_norms(True)


@kernels
def test_block_stack_folded_bf16(poisoned) -> None:  # noqa: F811
    blocks = _blocks(torch.bfloat16)
    args = _one_sample(_stack_inputs(blocks, torch.bfloat16))
    folded = fused_stacks.fold_modulation(blocks, args[6])
    with torch.no_grad():
        out = fused_stacks.adaptive_block_stack(blocks, *args, 1e-6, backend="triton", gemm_backend="triton",
                                                folded=folded)
        plain = fused_stacks.adaptive_block_stack(blocks, *args, 1e-6, backend="triton", gemm_backend="triton")
        ref = _stack_reference(blocks, *args)
    truth = _float32_truth(blocks, args)
    err, ref_err, plain_err = _rel(out.float(), truth), _rel(ref.float(), truth), _rel(plain.float(), truth)
    assert torch.isfinite(out).all() and err < 2e-2 and err < 1.5 * max(ref_err, plain_err), (err, ref_err, plain_err)


def test_fold_needs_fused_projections_and_no_gradient() -> None:
    blocks = _blocks(torch.float32, fuse=False)
    args = _one_sample(_stack_inputs(blocks, torch.float32))
    assert fused_stacks.fold_modulation(blocks, args[6]) is None
    fused = _blocks(torch.float32)
    folded = fused_stacks.fold_modulation(fused, args[6])
    x = args[0].clone().requires_grad_(True)
    assert not fused_stacks._folds(fused, x, "triton", folded, None)  # a gradient: the unfolded path
    assert not fused_stacks._folds(fused, args[0], "triton", folded, joined=(args[3], args[4]))
    assert not fused_stacks._folds(fused, args[0], None, folded, None)
    assert fused_stacks._folds(fused, args[0], "reference", folded, None) is False  # the references fold nothing


@kernels
def test_fp8_linears_are_not_folded() -> None:
    """An fp8 expert keeps its own linears (and their activation scales): no fold, whatever the table says."""
    from phyai_edge.layers.fp8 import convert_fp8

    blocks = _blocks(torch.bfloat16)
    args = _one_sample(_stack_inputs(blocks, torch.bfloat16))
    folded = fused_stacks.fold_modulation(blocks, args[6])
    assert folded is not None and fused_stacks._folds(blocks, args[0], "triton", folded, None)
    holder = torch.nn.ModuleDict({"expert_layers": torch.nn.ModuleList(blocks)})
    assert convert_fp8(holder, "expert") > 0
    assert not fused_stacks._folds(blocks, args[0], "triton", folded, None)


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_denoise_stage_with_a_folded_table_entry(poisoned, float32_routed, monkeypatch, dtype) -> None:  # noqa: F811
    """The PI0.5 stage on the tiny preset at batch 1 with a table entry extended by `fold_modulation`
    (as the engine builds it), against the model's own step with the plain entry: the action
    projections fold too (one input-projection kernel, one output-projection kernel, no norm kernel)."""
    calls = {"norm": 0, "out": 0}
    real_norm, real_out = triton_ops._residual_ada_norm_triton, triton_fold._linear_folded_triton
    monkeypatch.setattr(triton_ops, "_residual_ada_norm_triton",
                        lambda *a, **kw: calls.__setitem__("norm", calls["norm"] + 1) or real_norm(*a, **kw))
    monkeypatch.setattr(triton_fold, "_linear_folded_triton",
                        lambda *a, **kw: calls.__setitem__("out", calls["out"] + 1) or real_out(*a, **kw))
    model = _tiny_model(dtype)
    x_t, t, k_cache, v_cache, prefix_mask = _denoise_args(model, b=1)
    stages = model.triton_stages("triton", gemm=True)
    with torch.no_grad():
        entry = model.time_modulation(t)
        extended = stages["fold_modulation"](entry)
        out = stages["denoise_step"](x_t, t, k_cache, v_cache, prefix_mask, modulation=extended)
        ref = model.denoise_step(x_t, t, k_cache, v_cache, prefix_mask, modulation=extended)
    assert calls == {"norm": 0, "out": 1}
    before = fused_stacks.set_fold_projections(False)
    try:  # the projections as the model runs them: the first fold and the final norm are kernels again
        with torch.no_grad():
            plain = stages["denoise_step"](x_t, t, k_cache, v_cache, prefix_mask, modulation=extended)
    finally:
        fused_stacks.set_fold_projections(before)
    assert calls == {"norm": 2, "out": 1} and _rel(plain, ref) < (1e-5 if dtype == torch.float32 else 2e-2)
    assert len(extended) == 4 and len(extended[2]) == model.cfg.expert.depth
    assert extended[3].shape == (1, model.cfg.max_action_dim)  # the final shift through the output projection
    assert torch.isfinite(out).all() and _rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


@kernels
def test_engine_folds_its_batch_one_norms(monkeypatch) -> None:
    """The engine's modulation table carries the folded part (once per flow time), and its batch-1
    chunk runs the folded stack: o_proj / down with the residual in their epilogue, within the
    bf16 engine's bound of eager float32. Only the denoise stages are taken from `triton_stages`
    (the vision and prefix Triton paths are slow under the interpreter and fold nothing)."""
    import copy

    from test_cudagraph import _inputs

    from phyai_edge.adapters.base import SolverSpec
    from phyai_edge.adapters.pi05 import builtin_adapter
    from phyai_edge.adapters.pi05.model import PI05Model
    from phyai_edge.engines.cudagraph import CudaGraphEngine
    from phyai_edge.engines.eager import EagerEngine

    tiny = builtin_adapter("tiny", seed=3)
    tiny.solver = SolverSpec(3)
    real = PI05Model.triton_stages

    def denoise_only(self, backend="auto", gemm=False):
        stages = real(self, backend, gemm=gemm)
        return {k: stages[k] for k in ("denoise_step", "step_context", "fold_modulation")}

    folds = []
    real_residual = triton_fold._linear_residual_triton
    monkeypatch.setattr(PI05Model, "triton_stages", denoise_only)
    monkeypatch.setattr(triton_fold, "_linear_residual_triton", lambda *a, **kw: folds.append(1) or real_residual(*a, **kw))
    fast = CudaGraphEngine(copy.deepcopy(tiny), device=DEVICE, dtype="bfloat16", triton_ops=True, triton_gemm=True)
    inputs = _inputs(tiny, 1, 1, [20])
    noise = torch.randn(1, tiny.chunk_size, tiny.model_action_dim, generator=torch.Generator().manual_seed(9))
    out = fast.run(inputs, noise=noise)
    table = fast._table(tiny.solver)
    assert all(len(entry) == 4 for entry in table)
    # o_proj and down of every block, and the input projection starting the stream, each step
    per_loop = (2 * tiny.cfg.expert.depth + 1) * tiny.solver.num_steps
    assert folds and len(folds) % per_loop == 0
    eager = EagerEngine(copy.deepcopy(tiny), device="cpu", dtype="float32")
    assert torch.isfinite(out).all() and _rel(out.cpu(), eager.run(inputs, noise=noise).cpu()) < 3e-2
