"""The design rule "a new model needs one new adapter module and no change to the runtime", tested.

`helpers/toy_adapter.py` is a second flow-matching policy that is not PI0.5 (conv image encoder +
MLPs, two stages `encode_obs` -> `velocity` with their own tensor names, no tokenizer, its own
config and checkpoint folder). It is registered the way a new model would be (an entry in
`phyai_edge.adapters.ADAPTERS`) and then run through the runtime unchanged: `load_policy`, the
eager engine, RTC in every solver mode, the daemon's worker path and a short daemon run, the
serve batcher and rollout API, `bench`, and ONNX export -> onnxruntime engine -> bundle.

The cudagraph engine runs it too, on its generic path (static buffers from `stage_specs`);
where the rule does not hold, a test would be an `xfail(strict=True)` naming what a new model
would have to change in the runtime.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phyai_edge.adapters.base import Adapter, Observation
from phyai_edge.engines.base import RTCRequest

TOY_MODULE = "helpers.toy_adapter"


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    import phyai_edge.adapters as adapters

    monkeypatch.setitem(adapters.ADAPTERS, "toy", TOY_MODULE)


@pytest.fixture
def policy():
    from phyai_edge.engines.policy import load_policy

    return load_policy(adapter="toy", backend="eager", device="cpu", seed=0)


def toy_obs(adapter, seed: int = 0, size=(20, 28), missing: str | None = None) -> Observation:
    rng = np.random.default_rng(seed)
    images = {n: (None if n == missing else rng.integers(0, 256, (*size, 3), dtype=np.uint8))
              for n in adapter.camera_names}
    state = (rng.uniform(-1, 1, adapter.state_dim)).astype(np.float32)
    return Observation(images=images, state=state, prompt="")


def noise(adapter, batch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, adapter.chunk_size, adapter.model_action_dim, generator=g)


def test_toy_is_an_adapter_and_not_pi05(policy):
    a = policy.adapter
    members = [*Adapter.__annotations__, *(n for n in vars(Adapter) if not n.startswith("_"))]
    missing = [n for n in members if not hasattr(a, n)]
    assert not missing, missing
    assert a.name == "toy" and a.stage_names() == ["encode_obs", "velocity"]
    assert "tokens" not in a.preprocess([toy_obs(a)]).tensors
    assert type(a).__module__ == TOY_MODULE


def test_load_policy_and_eager_engine(policy):
    a = policy.adapter
    obs = [toy_obs(a, seed=i) for i in range(3)]
    n = noise(a, 3, seed=1)
    res = policy.infer(obs, noise=n)
    assert res.actions.shape == (3, a.chunk_size, a.action_dim) and res.actions.dtype == np.float32
    assert np.isfinite(res.actions).all()
    # The engine timed the toy's own stages, not PI0.5's.
    assert {"encode_obs", "velocity", "solver_loop", "preprocess", "postprocess"} <= set(res.stage_ms)
    assert "embed_images" not in res.stage_ms
    # Same inputs and noise: same actions; each sample as it would be alone (batch composition).
    np.testing.assert_array_equal(policy.infer(obs, noise=n).actions, res.actions)
    alone = policy.infer([obs[1]], noise=n[1:2]).actions
    np.testing.assert_allclose(alone[0], res.actions[1], atol=1e-5, rtol=0)
    # A missing camera is masked out, not an error.
    assert np.isfinite(policy.infer([toy_obs(a, missing="wrist")], noise=n[:1]).actions).all()
    # And it is a flow policy: the engine's chunk is the adapter's Euler loop over its velocity stage.
    x = a.preprocess([obs[0]]).tensors
    cond = a.module.encode_obs(x["images"], x["image_mask"], x["state"])
    xt = n[:1].clone()
    for t in a.solver.times():
        xt = xt + a.solver.dt * a.module.velocity(xt, torch.full((1,), t), cond)
    np.testing.assert_allclose(res.chunk[:1].numpy(), xt.numpy(), atol=1e-6, rtol=0)


def test_eager_bf16(policy):
    """A model without PI0.5's `set_precision`: the eager engine casts its weights."""
    import copy

    from phyai_edge.engines.eager import EagerEngine
    from phyai_edge.engines.policy import Policy

    a = copy.copy(policy.adapter)
    a.module = copy.deepcopy(policy.adapter.module)
    bf16 = Policy(a, EagerEngine(a, dtype="bfloat16"))
    obs = [toy_obs(a, seed=2)]
    n = noise(a, 1, seed=2)
    got, ref = bf16.infer(obs, noise=n).actions, policy.infer(obs, noise=n).actions
    assert next(a.module.parameters()).dtype == torch.bfloat16
    np.testing.assert_allclose(got, ref, atol=0.1, rtol=0)
    assert not np.array_equal(got, ref)


@pytest.mark.parametrize("mode", ["inpaint", "guided-approx", "guided"])
def test_rtc_in_the_solver(policy, mode):
    a = policy.adapter
    h, s = a.chunk_size, 4
    obs = toy_obs(a, seed=5)
    n = noise(a, 1, seed=6)
    prefix = np.random.default_rng(7).uniform(-1, 1, (h - 2, a.action_dim)).astype(np.float32) * 3
    free = policy.infer([obs], noise=n).actions[0]
    d = 3
    guided = policy.infer([obs], rtc=RTCRequest(mode, prefix, d, s), noise=n).actions[0]
    free_gap = np.abs(free[:d] - prefix[:d]).max()
    gap = np.abs(guided[:d] - prefix[:d]).max()
    assert free_gap > 0.5
    if mode == "inpaint":
        np.testing.assert_allclose(guided[:d], prefix[:d], atol=1e-5, rtol=0)
    else:
        assert gap < 0.5 * free_gap, (gap, free_gap)
    # Per-sample RTC (serve / rollout batches) gives the same as the shared request.
    per = policy.infer([obs, obs], rtc=[RTCRequest(mode, prefix, d, s), None], noise=n.repeat(2, 1, 1)).actions
    np.testing.assert_allclose(per[0], guided, atol=1e-5, rtol=0)
    np.testing.assert_allclose(per[1], free, atol=1e-5, rtol=0)


def test_daemon_worker_path_with_a_policy_spec_factory():
    from phyai_edge.control.worker import Job, PolicySpec, ThreadWorker, run_job

    spec = PolicySpec(kwargs={"adapter": "toy", "backend": "eager", "device": "cpu"})
    pol = spec.build()
    a = pol.adapter
    obs = toy_obs(a, seed=3)
    prefix = np.zeros((a.chunk_size, a.action_dim), np.float32)
    n = noise(a, 1, seed=4)
    job = Job(7, dict(obs.images), {}, obs.state, "", 0.0, "inpaint", prefix, 2, 4, 5.0, noise=n.numpy())
    res = run_job(pol, job)
    assert res.error is None, res.error
    direct = pol.infer([obs], rtc=RTCRequest("inpaint", prefix, 2, 4), noise=n).actions[0]
    np.testing.assert_array_equal(res.actions, direct)
    # The worker thread builds the policy from the spec and reports its shape to the daemon.
    w = ThreadWorker(spec)
    try:
        info = w.start(60)
        assert (info.chunk_size, info.action_dim, info.state_dim) == (a.chunk_size, a.action_dim, a.state_dim)
        assert tuple(info.camera_names) == tuple(a.camera_names)
        assert w.run_sync(job).error is None
    finally:
        w.close()


def test_short_daemon_run_with_synthetic_camera_and_state():
    from test_control_daemon import Running, count

    from phyai_edge.control.daemon import Daemon
    from phyai_edge.control.fakes import test_config
    from phyai_edge.control.protocol import Flag

    cfg = test_config(model={"adapter": "toy", "worker": "thread", "warmup": 1},
                      cameras={"top": {"source": "synthetic", "width": 32, "height": 24},
                               "wrist": {"source": "synthetic", "width": 32, "height": 24}},
                      chunking={"mode": "inpaint", "execution_horizon": 4, "delay_initial": 2})
    run = Running(Daemon(cfg, realtime=False))
    try:
        run.wait_for(lambda: count(run, lambda h, v: not h.flags & Flag.HOLD) >= 30, what="30 policy actions")
    finally:
        run.stop()
    seqs = [h.seq for h, _ in run.actions()]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    st = run.daemon.stats
    assert st.adopted >= 2 and st.failures == 0
    vals = [np.asarray(v) for h, v in run.actions() if not h.flags & Flag.HOLD]
    assert all(v.shape[-1] == 4 and v.size == 4 and np.isfinite(v).all() for v in vals), {v.shape for v in vals}


def test_serve_batcher_and_rollout(policy):
    from phyai_edge.serve.batching import BatchItem, run_items
    from phyai_edge.serve.rollout import RolloutPolicy

    a = policy.adapter
    pre = np.random.default_rng(1).uniform(-1, 1, (a.chunk_size, a.action_dim)).astype(np.float32)
    items = [BatchItem([toy_obs(a, seed=i)], RTCRequest("guided-approx", pre, i % 3, 4) if i % 2 else None,
                       noise(a, 1, seed=i)) for i in range(4)]
    got = run_items(policy, items)
    assert {r.batch for r in got} == {4}
    for it, r in zip(items, got):
        alone = policy.infer(it.observations, rtc=it.rtc, noise=it.noise).actions
        np.testing.assert_allclose(r.actions, alone, atol=1e-5, rtol=0)
    out = RolloutPolicy(policy, seed=2).act([toy_obs(a, seed=i) for i in range(3)])
    assert out.actions.shape == (3, a.chunk_size, a.action_dim) and np.isfinite(out.actions).all()


def test_bench_runs_the_toy(capsys):
    from phyai_edge.cli import main as cli

    assert cli(["bench", "--adapter", "toy", "--iters", "2", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "encode_obs" in out and "velocity" in out


def test_onnx_export_onnxruntime_engine_and_bundle(policy, tmp_path):
    pytest.importorskip("onnxruntime")
    from phyai_edge.engines.bundle import read_manifest
    from phyai_edge.engines.exporter import ExportRequest, export_bundle
    from phyai_edge.engines.onnxrt import OnnxRuntimeEngine
    from phyai_edge.engines.policy import Policy, load_policy

    a = policy.adapter
    obs = [toy_obs(a, seed=i) for i in range(2)]
    n = noise(a, 2, seed=9)
    ref = policy.infer(obs, noise=n).actions
    pre = np.random.default_rng(3).uniform(-1, 1, (a.chunk_size, a.action_dim)).astype(np.float32)
    ref_rtc = policy.infer(obs, rtc=RTCRequest("inpaint", pre, 3, 4), noise=n).actions

    # The onnxruntime engine exporting the adapter's stages itself (make_engine's path).
    ort = Policy(a, OnnxRuntimeEngine(a, batch_sizes=[2]))
    np.testing.assert_allclose(ort.infer(obs, noise=n).actions, ref, atol=1e-4, rtol=0)

    # The exporter -> bundle -> load_policy(bundle=...) path a robot uses.
    out = tmp_path / "toy-onnx"
    m = export_bundle(ExportRequest(out=out, backend="onnx", adapter="toy", batch_sizes=[1, 2], progress=False),
                      echo=lambda s: None)
    assert m["validation"]["status"] == "passed", m["validation"]
    m = read_manifest(out)
    assert m["adapter"]["name"] == "toy" and [s["name"] for s in m["stages"]["1"]] == ["encode_obs", "velocity"]
    assert "onnx/b2/velocity.onnx" in m["files"] and "checkpoint/toy.json" in m["files"]
    bundled = load_policy(bundle=out)
    assert bundled.adapter.name == "toy" and bundled.engine.backend == "onnxruntime"
    np.testing.assert_allclose(bundled.infer(obs, noise=n).actions, ref, atol=1e-4, rtol=0)
    np.testing.assert_allclose(bundled.infer(obs, rtc=RTCRequest("inpaint", pre, 3, 4), noise=n).actions, ref_rtc,
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("batch", [1, 2])
def test_cudagraph_engine_runs_the_toy(policy, batch, caplog):
    """CPU run of the cudagraph engine's generic path (static buffers from the toy's stage_specs,
    the per-chunk stages and the solver loop run eagerly, as they would be captured), every RTC
    mode, against the eager engine; as tests/test_cudagraph.py does for PI0.5."""
    _check_cudagraph_toy(policy, batch, "cpu", caplog, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graph capture)")
@pytest.mark.parametrize("batch", [1, 2])
def test_cudagraph_engine_captures_the_toy_on_a_gpu(policy, batch, caplog, monkeypatch):
    """The same on a GPU: the per-chunk stages captured in one graph and each RTC mode's solver loop in
    another, replayed, against the eager engine on the CPU (float32 both; TF32 off for the toy's
    convolution)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    _check_cudagraph_toy(policy, batch, "cuda", caplog, atol=1e-4)


def _check_cudagraph_toy(policy, batch, device, caplog, atol):
    import copy
    import logging

    from phyai_edge.engines.cudagraph import CudaGraphEngine
    from phyai_edge.engines.rtc import RTCGuidance, prefix_weights

    a = copy.copy(policy.adapter)
    a.module = copy.deepcopy(policy.adapter.module)
    with caplog.at_level(logging.INFO, logger="phyai_edge.engines.cudagraph"):
        eng = CudaGraphEngine(a, device=device, dtype="float32")
    assert eng.generic
    fallback = sum("CUDA graphs need a CUDA device" in r.getMessage() for r in caplog.records)
    assert fallback == (1 if device == "cpu" else 0)
    eager = policy.engine
    obs = [toy_obs(a, seed=10 + i, missing="wrist" if i == 1 else None) for i in range(batch)]
    x = a.preprocess(obs)
    n = noise(a, batch, seed=batch)
    h, d = a.chunk_size, a.model_action_dim
    target = torch.randn(batch, h, d, generator=torch.Generator().manual_seed(5)) * 0.5
    dim_mask = torch.zeros(d)
    dim_mask[: a.action_dim] = 1.0
    shared = prefix_weights(h, 3, 4)
    # Per-sample rows: the second sample (batch 2) has its own delay and soft mask.
    per_sample = torch.stack([prefix_weights(h, 3 + i, 4) for i in range(batch)])
    delays = torch.tensor([3 + i for i in range(batch)])
    cases = [None] + [RTCGuidance(m, target, shared, dim_mask, 3, 5.0) for m in ("inpaint", "guided-approx", "guided")]
    cases += [RTCGuidance(m, target, per_sample, dim_mask, delays, 5.0) for m in ("inpaint", "guided-approx", "guided")]
    free = eager.run(x, noise=n)
    for rtc in cases:
        want = eager.run(x, noise=n, rtc=rtc)
        got = eng.run(x, noise=n, rtc=rtc).cpu()
        assert got.shape == (batch, h, d)
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
        if rtc is not None:  # the guidance did something, so the comparison is not of two free runs
            assert (got - free).abs().max() > 1e-3, rtc.mode
    assert set(eng.last_stage_ms) == {"encode_obs", "velocity", "solver_loop"}
    if device != "cpu":  # every graph captured, none fell back to eager
        said = [r.getMessage() for r in caplog.records]
        assert not any("capture failed" in m or "eagerly" in m for m in said), said
    # Through the policy API too (the runtime unchanged: make_engine by name).
    from phyai_edge.engines.policy import Policy

    np.testing.assert_allclose(Policy(a, eng).infer(obs, noise=n).actions, policy.infer(obs, noise=n).actions,
                               atol=atol, rtol=0)


def test_cudagraph_engine_toy_bf16(policy):
    """A model without `set_precision` on the cudagraph engine: cast like the eager engine."""
    import copy

    from phyai_edge.engines.cudagraph import CudaGraphEngine
    from phyai_edge.engines.eager import EagerEngine

    twins = []
    for _ in range(2):
        a = copy.copy(policy.adapter)
        a.module = copy.deepcopy(policy.adapter.module)
        twins.append(a)
    fast, ref = CudaGraphEngine(twins[0], device="cpu", dtype="bfloat16"), EagerEngine(twins[1], dtype="bfloat16")
    assert next(twins[0].module.parameters()).dtype == torch.bfloat16
    x = twins[0].preprocess([toy_obs(twins[0], seed=4)])
    n = noise(twins[0], 1, seed=4)
    torch.testing.assert_close(fast.run(x, noise=n), ref.run(x, noise=n), atol=1e-5, rtol=0)


def test_onnx_stage_falls_back_to_basic_optimisations(tmp_path, monkeypatch, caplog):
    """A graph onnxruntime rejects after its full optimisations (1.30 fuses float8 Q/DQ into
    QGemm / QLinearConv and then refuses them; the fp8 export above fails validation there) is
    opened again with basic ones, with a warning; any other error, or a second rejection, is raised."""
    ort = pytest.importorskip("onnxruntime")
    from types import SimpleNamespace

    from phyai_edge.engines import onnxrt

    class InvalidGraph(Exception):  # noqa: N818 - the name onnxruntime's pybind error class has
        pass

    levels = []

    def session(path, sess_options, providers, reject=(ort.GraphOptimizationLevel.ORT_ENABLE_ALL,)):
        levels.append(sess_options.graph_optimization_level)
        if sess_options.graph_optimization_level in reject:
            raise InvalidGraph("[ONNXRuntimeError] : 10 : INVALID_GRAPH : QGemm float8")
        io = SimpleNamespace(name="x", shape=[1, 2], type="tensor(float)")
        return SimpleNamespace(get_inputs=lambda: [io], get_outputs=lambda: [io])

    path = tmp_path / "stage.onnx"
    path.write_bytes(b"")
    monkeypatch.setattr(ort, "InferenceSession", session)
    with caplog.at_level("WARNING", logger="phyai_edge.engines.onnxrt"):
        stage = onnxrt._Stage(path, ["CPUExecutionProvider"], torch.device("cpu"), None)
    assert levels == [ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC]
    assert stage.inputs == ["x"] and "basic optimisations" in caplog.text and "stage.onnx" in caplog.text
    everything = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: session(*a, **k, reject=everything))
    with pytest.raises(InvalidGraph):
        onnxrt._Stage(path, ["CPUExecutionProvider"], torch.device("cpu"), None)
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no file")))
    with pytest.raises(RuntimeError, match="no file"):
        onnxrt._Stage(path, ["CPUExecutionProvider"], torch.device("cpu"), None)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantised_onnx_export(tmp_path, precision):
    """int8 / fp8 ONNX bundles: per-stage calibration inputs are recorded through the toy's own stages."""
    pytest.importorskip("onnxruntime")
    from phyai_edge.engines.exporter import ExportRequest, export_bundle

    m = export_bundle(ExportRequest(out=tmp_path / f"toy-{precision}", backend="onnx", precision=precision,
                                    adapter="toy", calibration_samples=4, holdout=2, progress=False),
                      echo=lambda s: None)
    assert m["validation"]["status"] == "passed", m["validation"]
    assert set(m["precision"]) == {"encode_obs", "velocity"}
