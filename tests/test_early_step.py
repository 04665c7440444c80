"""The first flow step beside the prefix (`CudaGraphEngine(early_step=True)`): the stacks call the
hooks where the keys are written and read, and the engine gives the chunk it gives without it."""

from __future__ import annotations

import copy

import pytest
import torch
from test_cudagraph import _inputs, _rel, _rtc
from test_norm_fold import _one_sample
from test_triton_gemm import float32_routed  # noqa: F401
from test_triton_ops import DEVICE, _blocks, _plain_blocks, _randn, _stack_inputs, kernels, tiny  # noqa: F401

from phyai_edge.engines import cudagraph
from phyai_edge.engines.cudagraph import CudaGraphEngine
from phyai_edge.layers import fused_stacks
from phyai_edge.layers.rotary import rope_cos_sin


def test_the_prefix_stack_says_each_block_s_keys_once_they_are_written() -> None:
    blocks = _plain_blocks(torch.float32)
    b, t = 1, 40
    x = _randn(b, t, 48, seed=21)
    mask = torch.ones(b, t, dtype=torch.bool, device=DEVICE)
    positions = torch.arange(t, device=DEVICE)[None, :]
    cos, sin = rope_cos_sin(positions, blocks[0].self_attn.head_dim, 10000.0, torch.float32)
    shape = (len(blocks), b, blocks[0].self_attn.num_kv_heads, t, blocks[0].self_attn.head_dim)
    ks, vs = torch.full(shape, float("nan"), device=DEVICE), torch.full(shape, float("nan"), device=DEVICE)
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        fused_stacks.plain_block_stack(blocks, x, cos, sin, mask[:, None, None, :], out=(ks, vs),
                                       kv_ready=lambda i: seen.append((i, ks[i].clone(), vs[i].clone())))
    assert [i for i, _, _ in seen] == list(range(len(blocks)))
    for i, k, v in seen:  # written by then, and never changed after
        assert torch.isfinite(k).all() and torch.equal(k, ks[i]) and torch.equal(v, vs[i])


def _fill_on_wait(stack, k_cache, v_cache):
    """Run `stack(ks, vs, kv_wait)` on a NaN cache whose block i `kv_wait(i)` fills from the real
    one: (output, the blocks waited for, in order)."""
    ks, vs = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan"))
    order: list[int] = []

    def fill(i: int) -> None:
        order.append(i)
        ks[i].copy_(k_cache[i])
        vs[i].copy_(v_cache[i])

    with torch.no_grad():
        return stack(ks, vs, fill), order


def test_the_expert_stack_reads_each_block_s_keys_only_after_waiting_for_them() -> None:
    """The cache is NaN until `kv_wait(i)` fills block i's keys: the output is the one on the full
    cache only if no block reads its keys before its wait."""
    blocks = _blocks(torch.float32)
    x, cos, sin, k_cache, v_cache, mask, mods, final = _stack_inputs(blocks, torch.float32)
    with torch.no_grad():
        want = fused_stacks.adaptive_block_stack(blocks, x, cos, sin, k_cache, v_cache, mask, mods, final, 1e-6)
    got, order = _fill_on_wait(lambda ks, vs, wait: fused_stacks.adaptive_block_stack(
        blocks, x, cos, sin, ks, vs, mask, mods, final, 1e-6, kv_wait=wait), k_cache, v_cache)
    assert order == list(range(len(blocks)))
    assert torch.isfinite(got).all() and torch.equal(got, want)


@kernels
def test_the_folded_expert_stack_waits_too(float32_routed) -> None:  # noqa: F811
    """The same on batch 1's folded stack (norms in the small-M GEMMs), the path the option runs."""
    blocks = _blocks(torch.float32)
    with torch.no_grad():
        x, cos, sin, k_cache, v_cache, mask, mods, final = _one_sample(_stack_inputs(blocks, torch.float32))
        folded = fused_stacks.fold_modulation(blocks, mods)
    assert folded is not None and fused_stacks._folds(blocks, x, "triton", folded, None)
    kw = {"backend": "triton", "gemm_backend": "triton", "folded": folded}
    with torch.no_grad():
        want = fused_stacks.adaptive_block_stack(blocks, x, cos, sin, k_cache, v_cache, mask, mods, final, 1e-6, **kw)
    got, order = _fill_on_wait(lambda ks, vs, wait: fused_stacks.adaptive_block_stack(
        blocks, x, cos, sin, ks, vs, mask, mods, final, 1e-6, kv_wait=wait, **kw), k_cache, v_cache)
    assert order == list(range(len(blocks)))
    assert torch.isfinite(got).all() and torch.equal(got, want)


def test_the_stack_on_the_joined_cache_waits_too() -> None:
    """The unmasked expert (full batches) writes its own keys into the room after the prefix and
    attends over the whole buffer: it too reads block i's prefix keys only after `kv_wait(i)`."""
    blocks = _blocks(torch.float32)
    x, cos, sin, k_cache, v_cache, mask, mods, final = _stack_inputs(blocks, torch.float32)
    full = torch.ones_like(mask)
    t = x.shape[1]

    def stack(ks, vs, wait):
        room = tuple(torch.cat([c, torch.zeros_like(c[:, :, :, :t])], dim=3) for c in (ks, vs))
        if wait is not None:  # the prefix fills the room's prefix positions as it goes
            inner = wait

            def wait(i: int) -> None:
                inner(i)
                room[0][i, :, :, : ks.shape[3]].copy_(ks[i])
                room[1][i, :, :, : vs.shape[3]].copy_(vs[i])
        return fused_stacks.adaptive_block_stack(blocks, x, cos, sin, room[0][:, :, :, : ks.shape[3]],
                                                 room[1][:, :, :, : ks.shape[3]], full, mods, final, 1e-6,
                                                 joined=room, kv_wait=wait)

    with torch.no_grad():
        want = stack(k_cache, v_cache, None)
    got, order = _fill_on_wait(stack, k_cache, v_cache)
    assert order == list(range(len(blocks)))
    assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.parametrize("mode", ["none", "inpaint", "guided-approx", "guided"])
def test_engine_with_the_first_step_beside_the_prefix_gives_the_same_chunk(tiny, mode, monkeypatch) -> None:  # noqa: F811
    """Batch 1, every RTC mode: the same chunk as the engine without the option (the same operations
    on the same inputs: bit for bit on a CPU) and as the eager engine; in exact guidance the first
    step's gradient is taken beside the prefix too."""
    monkeypatch.setattr(cudagraph, "EARLY_STEP_GUIDED", True)
    base, eager = tiny
    early = CudaGraphEngine(copy.deepcopy(base), device=DEVICE, dtype="float32", triton_ops="reference",
                            early_step=True)
    plain = CudaGraphEngine(copy.deepcopy(base), device=DEVICE, dtype="float32", triton_ops="reference",
                            early_step=False)
    inputs = _inputs(base, 1, 3, [16])
    noise = torch.randn(1, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(7))
    rtc = None if mode == "none" else _rtc(base, 1, mode)
    out, ref = early.run(inputs, noise=noise, rtc=rtc), plain.run(inputs, noise=noise, rtc=rtc)
    gs = early._graph_set(1, 3, 16)
    assert early.last_early_step and early._first_step(gs, mode, False, False) == (False, False, mode == "guided")
    assert (mode, base.solver, "early") in gs.loops
    if DEVICE == "cuda":
        assert gs.prefix_steps[(False, False, mode == "guided")] is not None
        assert _rel(out.cpu(), ref.cpu()) < 1e-6
    else:
        assert torch.equal(out, ref)
    assert torch.isfinite(out).all() and _rel(out.cpu(), eager.run(inputs, noise=noise, rtc=rtc)) < 1e-5
    steps = base.solver.num_steps
    stages = early.last_stage_ms
    if steps > 1:  # the loop's time is the other steps'
        assert stages["denoise_step"] == pytest.approx(stages["solver_loop"] / (steps - 1))


def test_the_first_step_beside_the_prefix_is_for_small_batches_and_its_warm_up(tiny, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setattr(cudagraph, "EARLY_STEP_GUIDED", True)
    base, eager = tiny
    early = CudaGraphEngine(copy.deepcopy(base), device=DEVICE, dtype="float32", triton_ops="reference",
                            early_step=True)
    plain = CudaGraphEngine(copy.deepcopy(base), device=DEVICE, dtype="float32", triton_ops="reference",
                            early_step=False)
    most = cudagraph.EARLY_STEP_MAX_BATCH
    assert most >= 2
    for b, beside in ((2, True), (most, True), (most + 1, False)):
        batch = _inputs(base, b, 3, [(16, 12, 9)[i % 3] for i in range(b)])
        noise = torch.randn(b, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(7))
        out = early.run(batch, noise=noise)
        assert early.last_early_step == beside, b
        assert _rel(out.cpu(), eager.run(batch, noise=noise)) < 1e-5
        if beside and DEVICE != "cuda":  # the same operations in the same order as without the option
            assert torch.equal(out, plain.run(batch, noise=noise))
        gs = early._graph_set(b, 3, 16)
        assert ("first_velocity" in gs.loop_bufs) == beside
        assert (early._first_step(gs, "none", False, False) is not None) == beside
    # A warm-up builds what a call of its shape and mode replays: no graph built by the call.
    early.warmup(1, 3, prompt_tokens=16, modes=("guided-approx", "guided"))
    built = early.graphs_built
    one = _inputs(base, 1, 3, [16])
    for mode in ("guided-approx", "guided"):
        early.run(one, noise=noise[:1], rtc=_rtc(base, 1, mode))
    assert early.graphs_built == built
    # On by default with the fused stages, never without them.
    assert CudaGraphEngine(copy.deepcopy(base), device=DEVICE, dtype="float32", triton_ops="reference").early_step
    assert not CudaGraphEngine(copy.deepcopy(base), device=DEVICE, dtype="float32", triton_ops=False,
                               early_step=True).early_step


@pytest.mark.skipif(DEVICE != "cuda", reason="the fused kernels, captured on two streams, need a GPU")
@pytest.mark.parametrize("mode", ["none", "guided-approx", "guided"])
def test_the_fast_path_beside_the_prefix_on_a_gpu(tiny, mode, monkeypatch) -> None:  # noqa: F811
    """bf16 on the Triton kernels and small-M GEMMs (the default fast path): the same chunk."""
    monkeypatch.setattr(cudagraph, "EARLY_STEP_GUIDED", True)
    base, eager = tiny
    kw: dict = {"device": "cuda", "dtype": "bfloat16", "triton_ops": True, "triton_gemm": True}
    early = CudaGraphEngine(copy.deepcopy(base), early_step=True, **kw)
    plain = CudaGraphEngine(copy.deepcopy(base), early_step=False, **kw)
    inputs = _inputs(base, 1, 3, [16])
    noise = torch.randn(1, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(7))
    rtc = None if mode == "none" else _rtc(base, 1, mode)
    out, ref = early.run(inputs, noise=noise, rtc=rtc), plain.run(inputs, noise=noise, rtc=rtc)
    assert (mode, base.solver, "early") in early._graph_set(1, 3, 16).loops
    assert torch.isfinite(out).all() and _rel(out.float().cpu(), ref.float().cpu()) < 1e-6
    assert _rel(out.float().cpu(), eager.run(inputs, noise=noise, rtc=rtc)) < 2e-2


def test_bench_says_the_first_step_ran_beside_the_prefix(capsys) -> None:
    """`phyai-edge bench` on the cudagraph engine with the fused stages says what its prefix and loop
    rows then hold; with the model's own stages (no hooks) its JSON says the step was not moved."""
    import json

    from phyai_edge.cli import main as cli

    args = ["bench", "--backend", "cudagraph", "--triton-ops", "--batch", "1", "--iters", "1", "--warmup", "0",
            "--steps", "2"]
    assert cli(args) == 0
    assert "solver_loop and its floor are the other 1 steps" in capsys.readouterr().out
    assert cli([*args[:3], "--no-triton-ops", *args[4:], "--json"]) == 0  # the model's own stages: no hooks
    assert json.loads(capsys.readouterr().out)["early_step"] is False
    assert cli([*args, "--no-early-step", "--json"]) == 0  # the fused stages, the option off
    assert json.loads(capsys.readouterr().out)["early_step"] is False
    with pytest.raises(SystemExit) as exc:  # a usage error: exit 2, one line naming the flag
        cli(["bench", "--backend", "eager", "--early-step", "--iters", "1", "--warmup", "0"])
    assert exc.value.code == 2 and "phyai-edge bench: --early-step is a cudagraph engine option" in (
        capsys.readouterr().err)


def test_full_batches_run_the_first_step_beside_the_unmasked_prefix(tiny, monkeypatch) -> None:  # noqa: F811
    """Where a full batch takes the unmasked prefix and expert, the first step runs beside that
    prefix on the unmasked expert (the loop variant "dense, early"); a padded batch of the same
    size beside the masked one. Both give the chunk the engine gives without the option."""
    base, eager = tiny
    monkeypatch.setattr(cudagraph, "DENSE_PREFIX_MIN_BATCH", 2)
    monkeypatch.setattr(cudagraph, "DENSE_EXPERT_MIN_BATCH", 2)
    monkeypatch.setattr(cudagraph, "EARLY_STEP_GUIDED", True)
    kw: dict = {"device": DEVICE, "dtype": "float32", "triton_ops": "reference"}
    early = CudaGraphEngine(copy.deepcopy(base), early_step=True, **kw)
    plain = CudaGraphEngine(copy.deepcopy(base), early_step=False, **kw)
    noise = torch.randn(2, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(7))
    for valid, variant in (([16, 16], "dense, early"), ([16, 12], "early")):
        batch = _inputs(base, 2, 3, valid)
        out, ref = early.run(batch, noise=noise), plain.run(batch, noise=noise)
        assert early.last_early_step and not plain.last_early_step
        assert ("none", base.solver, variant) in early._graph_set(2, 3, 16).loops, valid
        if DEVICE == "cuda":
            assert _rel(out.cpu(), ref.cpu()) < 1e-6
        else:
            assert torch.equal(out, ref), valid
        assert _rel(out.cpu(), eager.run(batch, noise=noise)) < 1e-5
    gs = early._graph_set(2, 3, 16)
    if DEVICE == "cuda":
        assert gs.prefix_steps[(True, True, False)] is not None and gs.prefix_steps[(False, False, False)] is not None
    # Exact guidance on a full batch: the unmasked prefix, the masked expert (its gradient) beside it.
    full = _inputs(base, 2, 3, [16, 16])
    for mode, key in (("guided", (True, False, True)), ("guided-approx", (True, True, False))):
        rtc = _rtc(base, 2, mode)
        out, ref = early.run(full, noise=noise, rtc=rtc), plain.run(full, noise=noise, rtc=rtc)
        assert early.last_early_step and early._first_step(gs, mode, True, key[1]) == key, mode
        assert DEVICE != "cuda" or gs.prefix_steps[key] is not None
        if DEVICE != "cuda":
            assert torch.equal(out, ref), mode
        assert _rel(out.cpu(), eager.run(full, noise=noise, rtc=rtc)) < 1e-5, mode
    # A warm-up captures what such calls replay (the masked and the unmasked early loops).
    fresh = CudaGraphEngine(copy.deepcopy(base), early_step=True, **kw)
    fresh.warmup(2, 3, prompt_tokens=16, modes=("none", "guided"))
    built = fresh.graphs_built
    for rtc in (None, _rtc(base, 2, "guided")):
        fresh.run(full, noise=noise, rtc=rtc)
        fresh.run(_inputs(base, 2, 3, [16, 12]), noise=noise, rtc=rtc)
    assert fresh.graphs_built == built


def test_exact_guidance_keeps_the_whole_loop_without_its_switch(tiny, monkeypatch) -> None:  # noqa: F811
    """EARLY_STEP_GUIDED off: exact guidance runs every step in the loop (and its warm-up builds no
    prefix graph for it); the other modes still run their first step beside the prefix."""
    monkeypatch.setattr(cudagraph, "EARLY_STEP_GUIDED", False)
    base, eager = tiny
    engine = CudaGraphEngine(copy.deepcopy(base), device=DEVICE, dtype="float32", triton_ops="reference")
    one = _inputs(base, 1, 3, [16])
    noise = torch.randn(1, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(7))
    for mode, beside in (("guided", False), ("guided-approx", True)):
        rtc = _rtc(base, 1, mode)
        out = engine.run(one, noise=noise, rtc=rtc)
        assert engine.last_early_step == beside, mode
        assert _rel(out.cpu(), eager.run(one, noise=noise, rtc=rtc)) < 1e-5
    gs = engine._graph_set(1, 3, 16)
    assert ("guided", base.solver, "") in gs.loops and ("guided", base.solver, "early") not in gs.loops
    assert all(not key[2] for key in gs.prefix_steps)
