"""The CUDA-graph engine against the eager reference on the tiny preset.

On a CPU the engine runs its static-buffer code eagerly (same stage bodies, prompt trimming,
modulation tables, fused projections, key-only masks, the graph-friendly RTC loop), so these
tests check everything but the capture itself; the GPU tests at the end check capture too.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from phyai_edge.adapters.base import ModelInputs, Observation
from phyai_edge.adapters.pi05 import builtin_adapter
from phyai_edge.control.worker import make_warmup_job, policy_info, run_job
from phyai_edge.engines import make_engine
from phyai_edge.engines.cudagraph import CudaGraphEngine, prompt_bucket
from phyai_edge.engines.eager import EagerEngine
from phyai_edge.engines.policy import load_policy
from phyai_edge.engines.rtc import RTCGuidance, prefix_weights


def _inputs(adapter, batch: int, views: int, valid: list[int], seed: int = 0, masked_view: bool = False) -> ModelInputs:
    cfg = adapter.cfg
    g = torch.Generator().manual_seed(seed)
    s, length = cfg.vision.image_size, cfg.max_token_len
    images = torch.rand(batch, views, 3, s, s, generator=g) * 2 - 1
    image_mask = torch.ones(batch, views, dtype=torch.bool)
    if masked_view and views > 1:
        image_mask[-1, -1] = False
        images[-1, -1] = -1.0
    tokens = torch.randint(1, cfg.vocab_size, (batch, length), generator=g)
    token_mask = torch.arange(length)[None, :] < torch.tensor(valid)[:, None]
    tokens = torch.where(token_mask, tokens, torch.zeros_like(tokens))
    return ModelInputs({"images": images, "image_mask": image_mask, "tokens": tokens, "token_mask": token_mask}, batch)


def _rtc(adapter, batch: int, mode: str, seed: int = 1) -> RTCGuidance:
    h, d = adapter.chunk_size, adapter.model_action_dim
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, h, d, generator=g) * 0.5
    weights = prefix_weights(h, 4, 20)
    dim_mask = torch.zeros(d)
    dim_mask[: adapter.action_dim] = 1.0
    return RTCGuidance(mode, target, weights, dim_mask, 4, 5.0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def engines():
    base = builtin_adapter("tiny", seed=3)
    eager = EagerEngine(copy.deepcopy(base), device="cpu", dtype="float32")
    fast = CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="float32")
    return base, eager, fast


def test_prompt_bucket() -> None:
    mask = torch.arange(40)[None, :] < torch.tensor([[5], [17]])
    assert prompt_bucket(mask, 16) == 32
    assert prompt_bucket(mask, 0) == 40
    assert prompt_bucket(torch.ones(1, 40, dtype=torch.bool), 16) == 40
    holes = mask.clone()
    holes[0, 2] = False  # not right-padded: keep every position
    assert prompt_bucket(holes, 16) == 40
    assert prompt_bucket(torch.zeros(2, 40, dtype=torch.bool), 16) == 16


@pytest.mark.parametrize("mode", ["none", "inpaint", "guided-approx", "guided"])
def test_matches_eager_fp32(engines, mode: str) -> None:
    base, eager, fast = engines
    inputs = _inputs(base, 2, 3, [9, 30], masked_view=True)
    noise = torch.randn(2, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(7))
    rtc = None if mode == "none" else _rtc(base, 2, mode)
    ref = eager.run(inputs, noise=noise, rtc=rtc)
    out = fast.run(inputs, noise=noise, rtc=rtc)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-5, mode
    if mode == "inpaint":
        assert torch.equal(out[:, :4], rtc.target[:, :4])  # lands exactly on the executing chunk


def test_trimming_changes_nothing(engines) -> None:
    base, _, fast = engines
    untrimmed = CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="float32", trim_prompt=False, fuse=False,
                                modulation_tables=False)
    inputs = _inputs(base, 2, 2, [3, 12], seed=5)
    noise = torch.randn(2, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(8))
    a = fast.run(inputs, noise=noise)
    b = untrimmed.run(inputs, noise=noise)
    assert _rel(a, b) < 1e-5
    assert (2, 2, 16) in fast._sets and (2, 2, base.cfg.max_token_len) in untrimmed._sets


def test_registry_and_stage_keys(engines) -> None:
    base, _, _ = engines
    eng = make_engine("cudagraph", copy.deepcopy(base), device="cpu", dtype="float32")
    assert isinstance(eng, CudaGraphEngine)
    eng.run(_inputs(base, 1, 3, [10]))
    # The same stage keys as the eager engine (CUDA events on a GPU, the host clock on CPU).
    ms = eng.last_stage_ms
    assert set(ms) == {"embed_images", "encode_prefix", "solver_loop", "denoise_step"}
    assert all(v > 0 for v in ms.values())
    assert ms["denoise_step"] == pytest.approx(ms["solver_loop"] / base.solver.num_steps)


def test_bf16_close_to_fp32(engines) -> None:
    base, eager, _ = engines
    fast = CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="bfloat16")
    inputs = _inputs(base, 1, 3, [20])
    noise = torch.randn(1, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(9))
    assert _rel(fast.run(inputs, noise=noise), eager.run(inputs, noise=noise)) < 3e-2


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graph capture)")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["none", "guided"])
def test_graphs_match_eager_on_gpu(mode: str) -> None:
    base = builtin_adapter("tiny", seed=3)
    eager = EagerEngine(copy.deepcopy(base), device="cuda", dtype="float32")
    fast = CudaGraphEngine(copy.deepcopy(base), device="cuda", dtype="float32")
    inputs = _inputs(base, 2, 3, [9, 30], masked_view=True).to("cuda")
    noise = torch.randn(2, base.chunk_size, base.model_action_dim, device="cuda")
    rtc = None if mode == "none" else _rtc(base, 2, mode)
    ref = eager.run(inputs, noise=noise, rtc=rtc)
    out = fast.run(inputs, noise=noise, rtc=rtc)
    assert not fast._sets[(2, 3, 32)].eager
    assert _rel(out, ref) < 1e-4
    assert set(fast.last_stage_ms) == {"embed_images", "encode_prefix", "solver_loop", "denoise_step"}
    # Replays pick up new inputs.
    noise2 = torch.randn_like(noise)
    assert _rel(fast.run(inputs, noise=noise2, rtc=rtc), eager.run(inputs, noise=noise2, rtc=rtc)) < 1e-4


def test_host_staging_copies_through_reused_buffers() -> None:
    """`_HostStaging` (RTC's way onto a CUDA device; staged here on the CPU): the destination gets
    the source's values in its own dtype, a name's buffer is reused while the shape holds and
    replaced when it changes, and an unstaged copy goes straight to the destination."""
    from phyai_edge.engines.cudagraph import _HostStaging

    st = _HostStaging()
    dst = torch.zeros(2, 5, 3)
    src = torch.arange(15, dtype=torch.float64).reshape(1, 5, 3).expand(2, 5, 3)
    st.copy(dst, src, "target", stage=True)
    buf = st.buffers["target"]
    assert torch.equal(dst, src.float()) and buf.dtype == torch.float32
    st.copy(dst, src * 2, "target", stage=True)
    assert st.buffers["target"] is buf and torch.equal(dst, 2 * src.float())
    small = torch.zeros(3)
    st.copy(small, torch.ones(3), "target", stage=True)  # another shape: a new buffer
    assert st.buffers["target"] is not buf and torch.equal(small, torch.ones(3))
    flags = torch.zeros(2, 4, 1, dtype=torch.bool)
    st.copy(flags, torch.tensor([True, False, True, False]).reshape(1, 4, 1).expand(2, 4, 1), "fixed", stage=False)
    assert "fixed" not in st.buffers and flags[:, 0].all() and not flags[:, 1].any()
    st.wait()  # nothing queued on a CPU: returns
    st.queued(torch.device("cpu"))
    assert st.done is None


def test_float32_matmuls_in_tf32_restores_the_process_setting() -> None:
    from phyai_edge.engines.cudagraph import float32_matmuls_in_tf32

    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):  # torch < 2.9 (JetPack 6's 2.5): the legacy flag alone
        before = matmul.allow_tf32
        try:
            for start in (False, True):
                matmul.allow_tf32 = start
                with float32_matmuls_in_tf32(True):
                    assert matmul.allow_tf32 is True
                assert matmul.allow_tf32 is start
        finally:
            matmul.allow_tf32 = before
        return
    before = matmul.fp32_precision
    try:
        for start in ("ieee", "none", "tf32"):
            matmul.fp32_precision = start
            with float32_matmuls_in_tf32(True):
                assert matmul.fp32_precision == "tf32"
            assert matmul.fp32_precision == start
            with float32_matmuls_in_tf32(False):
                assert matmul.fp32_precision == start
        matmul.fp32_precision = "ieee"
        with pytest.raises(RuntimeError, match="inside"), float32_matmuls_in_tf32(True):
            raise RuntimeError("inside")
        assert matmul.fp32_precision == "ieee"
        matmul.allow_tf32 = False  # a process that set the legacy flag reads it back unchanged
        with float32_matmuls_in_tf32(True):
            pass
        assert matmul.allow_tf32 is False
    finally:
        matmul.fp32_precision = before


def test_prompt_bucket_keeps_at_least() -> None:
    mask = torch.arange(40)[None, :] < torch.tensor([[5], [17]])
    assert prompt_bucket(mask, 16, at_least=20) == 32
    assert prompt_bucket(mask, 16, at_least=33) == 40  # never more than the prompt has
    same = torch.arange(40)[None, :] < torch.tensor([[12], [12]])
    assert prompt_bucket(same, 16, exact=True, at_least=12) == 12
    assert prompt_bucket(same, 16, exact=True, at_least=13) == 16  # room kept: the bucket


def test_a_warmup_job_keeps_room_for_every_robot_state() -> None:
    """The daemon's prompt stays fixed while the robot state moves, and PI0.5 writes the state into
    the prompt: with the tiny tokenizer its length runs from 54 to 65 tokens, across two buckets. A
    warm-up job (zero state) has the engine keep room for the longest, so every live state runs the
    graph set the warm-up captured, instead of a state of fewer tokens capturing another inside
    the control loop."""
    policy = load_policy(preset="tiny", backend="cudagraph", device="cpu")
    prompt = "pick up the cube"
    warm = make_warmup_job(policy_info(policy), prompt)
    rng = np.random.default_rng(0)
    states = [(rng.standard_normal(policy.state_dim) * s).astype(np.float32) for s in (0.1, 1.0, 5.0) for _ in range(40)]
    lengths = [int(policy.adapter.prompt_tokens([Observation({}, st, prompt)])[1].sum()) for st in [warm.state, *states]]
    longest = policy.adapter.longest_prompt_tokens(prompt)
    assert max(lengths) == longest  # no state writes more, and the bound is reached
    assert len({math.ceil(n / 16) for n in lengths}) == 2
    assert run_job(policy, warm).error is None
    shortest = states[lengths.index(min(lengths)) - 1]
    for st in (shortest, *states[:3]):
        assert run_job(policy, replace(warm, state=st, warmup=False)).error is None
    assert list(policy.engine._sets) == [(1, len(policy.camera_names), 80)]


def test_a_live_job_that_builds_graphs_is_logged(caplog) -> None:
    """A live (not warm-up) job that makes the engine build graphs, here an RTC mode the warm-up
    never ran, is a capture inside the control loop on a GPU: the worker says so, once per job that
    does it, and not for jobs that reuse what was built."""
    policy = load_policy(preset="tiny", backend="cudagraph", device="cpu")
    warm = make_warmup_job(policy_info(policy), "pick up the cube")
    assert run_job(policy, warm).error is None
    built = policy.engine.graphs_built
    assert built == 2  # one graph set and its loop without RTC
    prefix = np.zeros((policy.chunk_size - 10, policy.action_dim), np.float32)
    def warnings() -> list[logging.LogRecord]:
        # the worker's warnings only: other loggers' INFO lines reach caplog wherever an earlier test
        # left a logger's level at INFO (as `phyai-edge run` sets it)
        return [r for r in caplog.records if r.name.startswith("phyai_edge.control") and r.levelno >= logging.WARNING]

    with caplog.at_level("WARNING", logger="phyai_edge.control"):
        assert run_job(policy, replace(warm, warmup=False)).error is None  # the shape the warm-up ran
        assert not warnings()
        guided = replace(warm, warmup=False, job_id=7, rtc_mode="guided-approx", prefix=prefix, delay=3,
                         execution_horizon=10)
        assert run_job(policy, guided).error is None
        assert run_job(policy, guided).error is None
    assert policy.engine.graphs_built == built + 1
    (record,) = warnings()
    assert "inference 7 met a shape or RTC mode the warm-up did not run" in record.getMessage()


def _frames_obs(policy, present: list[int], seed: int = 0, state_scale: float = 0.3) -> Observation:
    rng = np.random.default_rng(seed)
    images = {n: rng.integers(0, 256, (40, 56, 3), dtype=np.uint8) if v in present else None
              for v, n in enumerate(policy.camera_names)}
    return Observation(images, (state_scale * rng.standard_normal(policy.state_dim)).astype(np.float32), "pick up the cube")


@pytest.mark.parametrize("backend", ["eager", "cudagraph"])
def test_absent_cameras_leave_the_model_with_the_same_chunk(backend: str) -> None:
    """A camera declared absent is left out of the model's inputs (one view of three here), and the
    chunk is what running its slot masked gives: its tokens were masked out of every attention and
    took no position. A declared camera that an observation does have is kept."""
    policy = load_policy(preset="tiny", backend=backend, device="cpu")
    names = policy.camera_names
    seen: list[int] = []
    run = policy.engine.run
    policy.engine.run = lambda inputs, **kw: (seen.append(inputs.tensors["images"].shape[1]), run(inputs, **kw))[1]
    noise = torch.randn(1, policy.chunk_size, policy.adapter.model_action_dim, generator=torch.Generator().manual_seed(3))
    obs = _frames_obs(policy, [0])
    masked = policy.infer(obs, noise=noise).actions
    assert policy.set_absent_cameras(names[1:]) == frozenset(names[1:])
    dropped = policy.infer(obs, noise=noise).actions
    both = policy.infer(_frames_obs(policy, [0, 2], seed=1), noise=noise)  # names[2] is there after all
    assert seen == [3, 1, 2]
    assert np.abs(dropped - masked).max() < 1e-4 * max(1.0, float(np.abs(masked).max()))
    policy.set_absent_cameras([])
    assert np.allclose(policy.infer(_frames_obs(policy, [0, 2], seed=1), noise=noise).actions, both.actions, atol=1e-4)
    assert seen[-1] == 3


def test_absent_cameras_are_refused_or_ignored_where_they_cannot_apply() -> None:
    policy = load_policy(preset="tiny", backend="eager", device="cpu")
    with pytest.raises(ValueError, match="unknown cameras \\['nope'\\]"):
        policy.set_absent_cameras(["nope"])
    with pytest.raises(ValueError, match="every camera is declared absent"):
        policy.set_absent_cameras(policy.camera_names)
    policy.engine.any_views = False  # an engine built for a fixed view count (ONNX, TensorRT)
    assert policy.set_absent_cameras(policy.camera_names[1:]) == frozenset()
    x = policy.adapter.preprocess([_frames_obs(policy, [0])])
    with pytest.raises(ValueError, match="cameras_present"):
        policy.adapter.drop_cameras(ModelInputs(dict(x.tensors), 1), {"left_wrist"})


def test_a_warmup_job_declares_the_cameras_without_a_source() -> None:
    """The daemon's warm-up frames are None exactly for policy cameras no source feeds: the worker
    declares those absent, so the warm-up captures the graph set of the views the live jobs run,
    and a live job (the same camera missing) reuses it."""
    policy = load_policy(preset="tiny", backend="cudagraph", device="cpu")
    names = policy.camera_names
    frames = {names[0]: (48, 64), names[1]: None, names[2]: None}
    warm = make_warmup_job(policy_info(policy), "pick up the cube", frames=frames)
    assert policy_info(policy).drops_cameras
    assert run_job(policy, warm).error is None
    assert policy.absent_cameras == frozenset(names[1:])
    live = replace(warm, warmup=False, images={names[0]: np.full((48, 64, 3), 9, np.uint8), names[1]: None,
                                               names[2]: None})
    assert run_job(policy, live).error is None
    assert [k[1] for k in policy.engine._sets] == [1]
