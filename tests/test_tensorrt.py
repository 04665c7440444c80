"""The TensorRT path, for PI0.5 and for the toy second adapter.

A real build and run need TensorRT and a GPU: that test is skipped here with the reason, and
TensorRT has never run on any machine this was written on. Everything up to the TensorRT calls
is tested on the CPU: the plan of which stage runs when and which tensor each buffer holds
(from the adapters' stage_specs), the batch axes, the batch-dynamic ONNX each build consumes
(onnx.checker, and onnxruntime against the eager stages at every profile's batch size), the
builder's decisions, and the run loop's bookkeeping. The last two use `helpers/fake_trt.py`,
a stand-in that records calls and executes "plans" with onnxruntime: it is NOT TensorRT.
"""

from __future__ import annotations

import importlib.util
import itertools
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.fake_trt import FakeTRT

from phyai_edge.adapters.base import StageSpec
from phyai_edge.engines.stages import batch_axes, static_plan
from phyai_edge.engines.tensorrt import (
    BuildOptions,
    LoopInputs,
    StageBindings,
    build_engine,
    build_for_adapter,
    calibration_batch,
    load_plans,
)
from phyai_edge.engines.timing import StageTimer

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None
SKIP_REAL = ("unverified here: " + ", ".join(
    m for m, ok in (("TensorRT is not installed", HAVE_TRT), ("no CUDA GPU", torch.cuda.is_available())) if not ok))
CPU = torch.device("cpu")


def pi05():
    from phyai_edge.adapters.pi05 import builtin_adapter

    return builtin_adapter("tiny")


def toy():
    from helpers.toy_adapter import load_adapter

    return load_adapter()


ADAPTERS = {"pi05": pi05, "toy": toy}


# -- the plan: which stage runs when, one buffer per name -----------------------------------
def test_pi05_plan_is_what_the_engine_used_to_hard_code():
    a = pi05()
    p = static_plan(a, 2, 3)
    assert p.feeds == ("images", "image_mask", "tokens", "token_mask")
    assert p.prefix == ["embed_images", "encode_prefix"] and p.graph.step == "denoise_step"
    assert (p.graph.step_x, p.graph.step_t, p.step_out) == ("x_t", "t", "velocity")
    assert p.graph.step_context == ("k_cache", "v_cache", "prefix_mask")
    assert {n: w for n, w in p.writers.items() if w not in ("preprocess",)} == {
        "image_embeds": "embed_images", "k_cache": "encode_prefix", "v_cache": "encode_prefix",
        "prefix_mask": "encode_prefix", "x_t": "solver", "t": "solver", "velocity": "denoise_step"}
    c = a.cfg
    p_len = 3 * c.vision.tokens_per_image + c.max_token_len
    kv = (c.prefix.depth, 2, c.prefix.num_kv_heads, p_len, c.prefix.head_dim)
    assert p.tensors["k_cache"] == p.tensors["v_cache"] == (kv, torch.float32)
    assert p.tensors["tokens"] == ((2, c.max_token_len), torch.int64)
    assert p.tensors["x_t"] == p.tensors["velocity"] == ((2, 50, 32), torch.float32)
    assert p.tensors["t"] == ((2,), torch.float32)
    assert list(p.io) == ["embed_images", "encode_prefix", "denoise_step"]


def test_toy_plan_comes_from_its_own_specs():
    a = toy()
    p = static_plan(a, 3)
    assert p.feeds == ("images", "image_mask", "state")
    assert p.prefix == ["encode_obs"] and p.graph.step == "velocity"
    assert (p.graph.step_x, p.graph.step_t, p.step_out, p.graph.step_context) == ("noisy", "time", "vel", ("cond",))
    assert p.writers["cond"] == "encode_obs" and p.writers["noisy"] == p.writers["time"] == "solver"
    assert p.tensors == {
        "images": ((3, 2, 3, 16, 16), torch.float32), "image_mask": ((3, 2), torch.bool),
        "state": ((3, 5), torch.float32), "cond": ((3, 32), torch.float32),
        "noisy": ((3, 12, 6), torch.float32), "time": ((3,), torch.float32), "vel": ((3, 12, 6), torch.float32)}


class _Edited:
    """The toy with its specs edited by `edit(specs, batch)`, to make specs no engine can bind."""

    def __init__(self, edit) -> None:
        self.inner, self.edit = toy(), edit

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def stage_specs(self, batch, views=None):
        return self.edit(self.inner.stage_specs(batch, views), batch)


def _with(spec: StageSpec, inputs=None, outputs=None) -> StageSpec:
    return StageSpec(spec.name, {**spec.inputs, **(inputs or {})}, outputs if outputs is not None else spec.outputs)


@pytest.mark.parametrize("edit, match", [
    (lambda s, b: [s[0], _with(s[1], inputs={"cond": ((b, 7), torch.float32)})], "one name is one buffer"),
    (lambda s, b: [s[0], _with(s[1], inputs={"cond": ((b, 32), torch.float16)})], "one name is one buffer"),
    (lambda s, b: [_with(s[0], outputs={**s[0].outputs, "images": ((b, 2, 3, 16, 16), torch.float32)}), s[1]],
     "already writes"),
    (lambda s, b: [_with(s[0], outputs={**s[0].outputs, "noisy": ((b, 12, 6), torch.float32)}), s[1]],
     "the solver writes"),
    (lambda s, b: [s[0], _with(s[1], outputs={**s[1].outputs, "extra": ((b, 12, 6), torch.float32)})],
     "must output one tensor"),
    (lambda s, b: [s[0], _with(s[1], outputs={"vel": ((b, 12, 4), torch.float32)})], "must output one tensor"),
])
def test_plan_refuses_specs_that_cannot_share_buffers(edit, match):
    with pytest.raises(ValueError, match=match):
        static_plan(_Edited(edit), 2)


def test_batch_axes_come_from_the_specs():
    # PI0.5's KV caches carry the batch on axis 1; in the tiny preset the depth (axis 0) is also 2,
    # so at batch 2 the shape alone could not tell which axis is the batch.
    axes = batch_axes(pi05(), 3)
    assert {n: ax for n, ax in axes.items() if ax != 0} == {"k_cache": 1, "v_cache": 1}
    assert set(axes) == set(static_plan(pi05(), 1, 3).tensors)
    assert set(batch_axes(toy()).values()) == {0}
    square = _Edited(lambda s, b: [_with(s[0], inputs={"state": ((b, b), torch.float32)}), s[1]])
    with pytest.raises(ValueError, match="one axis that scales"):
        batch_axes(square)


# -- build: what TensorRT would be given --------------------------------------------------
SHAPES = {1: {"x_t": (1, 50, 32), "t": (1,)}, 2: {"x_t": (2, 50, 32), "t": (2,)}}


def test_strongly_typed_build_with_a_profile_per_batch_and_a_reused_timing_cache(tmp_path):
    trt = FakeTRT({"x_t": (-1, 50, 32), "t": (-1,)})
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"old")
    info = build_engine(tmp_path / "d.onnx", tmp_path / "d.plan", SHAPES,
                        BuildOptions("fp16", timing_cache=cache, workspace_bytes=1 << 30), trt=trt)
    assert info["strongly_typed"] and info["profiles"] == [1, 2] and info["inputs"] == ["x_t", "t"]
    assert trt.network.flags == 1 << 5  # STRONGLY_TYPED: types come from the fp16 ONNX
    assert trt.config.flags == set()  # precision flags are meaningless (and refused) when strongly typed
    assert [p.shapes["x_t"] for p in trt.config.profiles] == [((1, 50, 32),) * 3, ((2, 50, 32),) * 3]
    assert ("timing_cache_in", b"old") in trt.calls and cache.read_bytes() == b"old+"
    assert ("workspace", 1 << 30) in trt.calls
    assert (tmp_path / "d.plan").read_bytes() == b"PLAN"


def test_int8_calibrator_build_is_weakly_typed_and_calibrates_at_its_batch(tmp_path):
    trt = FakeTRT({"x_t": (-1, 50, 32), "t": (-1,)})
    calibrator = types.SimpleNamespace(get_batch_size=lambda: 2)
    info = build_engine(tmp_path / "d.onnx", tmp_path / "d.plan", SHAPES, BuildOptions("int8"), calibrator, trt=trt)
    assert not info["strongly_typed"] and info["calibrated"]
    assert trt.network.flags == 0 and trt.config.flags == {"INT8", "FP16"}
    assert trt.config.int8_calibrator is calibrator and ("calibration_profile", 1) in trt.calls


def test_parse_errors_are_reported(tmp_path):
    trt = FakeTRT({"x_t": (1, 50, 32)}, parse_ok=False)
    with pytest.raises(RuntimeError, match="Unsupported op Foo"):
        build_engine(tmp_path / "d.onnx", tmp_path / "d.plan", {1: {"x_t": (1, 50, 32)}}, BuildOptions(), trt=trt)


@pytest.mark.parametrize("net, match", [
    ({"x_t": (-1, 50, 32), "t": (-1,), "noise_level": (-1,)}, r"network inputs \['noise_level'\] are not in"),
    ({"x_t": (-1, 50, 16), "t": (-1,)}, r"'x_t' is \(-1, 50, 16\) in the network but \(1, 50, 32\)"),
])
def test_build_refuses_a_network_the_spec_does_not_describe(tmp_path, net, match):
    with pytest.raises(ValueError, match=match):
        build_engine(tmp_path / "d.onnx", tmp_path / "d.plan", SHAPES, BuildOptions("fp32"), trt=FakeTRT(net))
    assert not (tmp_path / "d.plan").exists()


def _eager_outputs(adapter, stage, feeds):
    out = adapter.stage(stage)(*feeds.values())
    return out if isinstance(out, (tuple, list)) else (out,)


@pytest.mark.parametrize("name", ADAPTERS)
def test_build_for_adapter_gives_trt_batch_dynamic_onnx_and_profiles_from_the_specs(name, tmp_path):
    pytest.importorskip("onnxruntime")
    import onnx
    import onnxruntime as ort

    from phyai_edge.engines.onnx_export import sample_inputs

    adapter = ADAPTERS[name]()
    views = len(adapter.camera_names)
    trt = FakeTRT(None)
    onnx_dir = tmp_path / "onnx"
    meta = build_for_adapter(adapter, tmp_path / "trt", [1, 2], views, BuildOptions("fp32"), onnx_dir=onnx_dir, trt=trt)
    names = adapter.stage_names()
    assert meta["batch_sizes"] == [1, 2] and list(meta["stages"]) == names
    assert (tmp_path / "trt" / "plans.json").exists() and all((tmp_path / "trt" / f"{s}.plan").exists() for s in names)
    axes = batch_axes(adapter, views)
    for stage, config in zip(names, trt.configs):
        specs = {b: next(s for s in adapter.stage_specs(b, views) if s.name == stage) for b in (1, 2)}
        # The network's inputs are the spec's, and profile i pins them to the spec at batch i.
        assert meta["stages"][stage]["inputs"] == list(specs[1].inputs) and meta["stages"][stage]["profiles"] == [1, 2]
        assert [p.shapes for p in config.profiles] == [
            {n: (tuple(sh),) * 3 for n, (sh, _) in specs[b].inputs.items()} for b in (1, 2)]
        path = onnx_dir / f"{stage}.onnx"
        onnx.checker.check_model(str(path), full_check=True)
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for i in sess.get_inputs():  # symbolic exactly on the batch axis the specs imply
            assert [ax for ax, d in enumerate(i.shape) if isinstance(d, str)] == [axes[i.name]], (i.name, i.shape)
        for b in (1, 2):
            feeds = sample_inputs(specs[b], seed=b)
            got = sess.run(None, {n: t.numpy() for n, t in feeds.items()})
            with torch.no_grad():
                ref = _eager_outputs(adapter, stage, feeds)
            assert [o.name for o in sess.get_outputs()] == list(specs[b].outputs)
            for g, r, (out, (shape, _)) in zip(got, ref, specs[b].outputs.items()):
                assert g.shape == tuple(shape), (stage, out, b)
                r = r.float().numpy() if r.is_floating_point() else r.numpy()
                if r.dtype == np.bool_:
                    np.testing.assert_array_equal(g, r)
                else:
                    np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4, err_msg=f"{name} {stage}.{out} b{b}")


class _CalibratorBase:
    def __init__(self) -> None:
        pass


@pytest.mark.parametrize("name", ADAPTERS)
def test_int8_build_calibrates_each_stage_at_the_batch_its_samples_have(name, tmp_path):
    from phyai_edge.calibration import synthetic_observations
    from phyai_edge.calibration.stage_inputs import collect_stage_inputs

    adapter = ADAPTERS[name]()
    views = len(adapter.camera_names)
    samples = collect_stage_inputs(adapter, synthetic_observations(adapter, 4, seed=1), batch_size=2)
    trt = FakeTRT(None, calibrator_base=_CalibratorBase)
    meta = build_for_adapter(adapter, tmp_path / "trt", [1, 2], views, BuildOptions("int8"), samples,
                             onnx_dir=tmp_path / "onnx", trt=trt)
    assert all(st["calibrated"] and not st["strongly_typed"] for st in meta["stages"].values())
    for stage, config in zip(adapter.stage_names(), trt.configs):
        cal = config.int8_calibrator
        assert cal.get_batch_size() == 2 and config.calibration_profile == 1
        assert set(cal.buffers) == set(samples[stage][0])
        assert config.flags == {"INT8", "FP16"}
    with pytest.raises(ValueError, match=r"calibration samples for stages \['" + adapter.stage_names()[-1]):
        build_for_adapter(adapter, tmp_path / "trt2", [1], views, BuildOptions("int8"),
                          {s: v for s, v in samples.items() if s != adapter.stage_names()[-1]},
                          onnx_dir=tmp_path / "onnx2", trt=FakeTRT(None, calibrator_base=_CalibratorBase))


def test_calibration_batch_is_read_on_each_inputs_batch_axis():
    axes = batch_axes(pi05(), 3)
    kv_first = [{"k_cache": np.zeros((2, 3, 1, 4, 2), np.float32), "x_t": np.zeros((3, 50, 32), np.float32)}]
    assert calibration_batch(kv_first, axes) == 3  # axis 0 of the KV cache is the depth (2)
    with pytest.raises(ValueError, match="no calibration input with a batch axis"):
        calibration_batch([{"other": np.zeros(3)}], axes)


# -- run: the loop's bookkeeping, against the stand-in (NOT TensorRT) --------------------------
def _built(name, tmp_path, batch_sizes=(1, 2)):
    adapter = ADAPTERS[name]()
    views = len(adapter.camera_names)
    trt = FakeTRT(None)
    build_for_adapter(adapter, tmp_path / "trt", list(batch_sizes), views, BuildOptions("fp32"),
                      onnx_dir=tmp_path / "onnx", trt=trt)
    return adapter, views, trt


def _bindings(adapter, views, trt, plan_dir, batch):
    meta, engines = load_plans(plan_dir, adapter.stage_names(), trt.Runtime(None))
    profile = meta["batch_sizes"].index(batch)
    st = StageBindings(static_plan(adapter, batch, views), engines, profile, CPU, trt, lambda: 0)
    trt.register(st.buffers.values())
    return st


@pytest.mark.parametrize("name", ADAPTERS)
def test_run_loop_binds_every_tensor_and_feeds_the_step_each_step(name, tmp_path):
    """Stand-in contexts (onnxruntime behind a TensorRT-shaped API, see helpers/fake_trt.py) are
    driven by the engine's own binding and loop code; what they compute must be eager's chunk."""
    pytest.importorskip("onnxruntime")
    from phyai_edge.calibration import synthetic_observations
    from phyai_edge.engines.eager import EagerEngine
    from phyai_edge.engines.rtc import RTCGuidance, prefix_weights
    from phyai_edge.engines.solver import integrate

    adapter, views, trt = _built(name, tmp_path)
    b = 2
    st = _bindings(adapter, views, trt, tmp_path / "trt", b)
    plan = st.plan
    ctxs = trt.contexts[-len(plan.io):]
    for stage, ctx in zip(plan.io, ctxs):
        assert ctx.engine.stage == stage and ctx.profile == 1  # batch 2 is the second profile
        assert set(ctx.addresses) == set(ctx.engine.io) == {*plan.io[stage][0], *plan.io[stage][1]}
        assert all(ctx.addresses[n] == st.buffers[n].data_ptr() for n in ctx.addresses)
    assert {n: (tuple(t.shape), t.dtype) for n, t in st.buffers.items()} == plan.tensors

    obs = synthetic_observations(adapter, b, seed=3)
    inputs = adapter.preprocess(obs)
    noise = torch.randn(b, adapter.chunk_size, adapter.model_action_dim, generator=torch.Generator().manual_seed(4))
    timer = StageTimer(CPU)
    st.run_prefix(inputs.tensors, timer)
    assert [s for s, _ in trt.executed] == plan.prefix and set(timer.ms) == set(plan.prefix)
    trt.executed.clear()
    with torch.no_grad():
        chunk = integrate(st.velocity(), noise, adapter.solver)
    steps = adapter.solver.num_steps
    assert [s for s, _ in trt.executed] == [plan.graph.step] * steps  # the prefix is not re-run per step
    seen_t = [float(feeds[plan.graph.step_t][0]) for _, feeds in trt.executed]
    np.testing.assert_allclose(seen_t, adapter.solver.times(), rtol=0, atol=1e-7)
    assert torch.equal(trt.executed[0][1][plan.graph.step_x], noise)
    xs = [feeds[plan.graph.step_x] for _, feeds in trt.executed]
    assert all(not torch.equal(p, q) for p, q in itertools.pairwise(xs))

    ref_engine = EagerEngine(adapter)
    ref = ref_engine.run(inputs, noise=noise)
    np.testing.assert_allclose(chunk.numpy(), ref.numpy(), atol=1e-4, rtol=0)

    # The captured loop's static inputs (filled per call): RTC with a different delay per sample.
    h, d = adapter.chunk_size, adapter.model_action_dim
    target = torch.randn(b, h, d, generator=torch.Generator().manual_seed(5))
    weights = torch.stack([prefix_weights(h, 2, 4), prefix_weights(h, 5, 4)])
    for mode in ("inpaint", "guided-approx"):
        rtc = RTCGuidance(mode, target, weights, torch.ones(d), torch.tensor([2, 5]), 5.0)
        static = LoopInputs(b, h, d, rtc, CPU)
        static.fill(noise, rtc)
        with torch.no_grad():
            got = integrate(st.velocity(), static.noise, adapter.solver, static.guidance)
        np.testing.assert_allclose(got.numpy(), ref_engine.run(inputs, noise=noise, rtc=rtc).numpy(), atol=1e-4,
                                   rtol=0, err_msg=mode)


def test_run_loop_refuses_what_does_not_fit(tmp_path):
    pytest.importorskip("onnxruntime")
    from helpers.toy_adapter import ToyAdapter, ToyConfig, ToyModel

    from phyai_edge.calibration import synthetic_observations

    adapter, views, trt = _built("toy", tmp_path, batch_sizes=(1,))
    st = _bindings(adapter, views, trt, tmp_path / "trt", 1)
    x = adapter.preprocess(synthetic_observations(adapter, 1))
    with pytest.raises(ValueError, match=r"'images' of shape \(1, 2, 3, 20, 20\)"):
        st.run_prefix({**x.tensors, "images": torch.zeros(1, 2, 3, 20, 20)}, StageTimer(CPU))
    with pytest.raises(KeyError, match="'state' from preprocess"):
        st.run_prefix({k: v for k, v in x.tensors.items() if k != "state"}, StageTimer(CPU))
    with pytest.raises(RuntimeError, match=r"no plans for stages \['decode'\]"):
        load_plans(tmp_path / "trt", ["encode_obs", "decode"], trt.Runtime(None))
    # An adapter whose specs are not what the plans were built from (another hidden width).
    cfg = ToyConfig(hidden=16)
    other = ToyAdapter(cfg, ToyModel(cfg))
    _, engines = load_plans(tmp_path / "trt", other.stage_names(), trt.Runtime(None))
    with pytest.raises(RuntimeError, match="re-export"):
        StageBindings(static_plan(other, 1), engines, 0, CPU, trt, lambda: 0)


def test_engine_refuses_without_tensorrt_or_on_cpu():
    from phyai_edge.engines.tensorrt import TensorRTEngine

    with pytest.raises((RuntimeError, ValueError), match=r"TensorRT is not installed|CUDA device"):
        TensorRTEngine(pi05(), device="cpu", plan_dir=Path("/nonexistent"))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TRT and torch.cuda.is_available()), reason=SKIP_REAL)
def test_tensorrt_bundle_matches_eager(tmp_path):
    from phyai_edge.engines.exporter import ExportRequest, export_bundle
    from phyai_edge.engines.policy import load_bundle_policy

    out = tmp_path / "tiny-trt"
    m = export_bundle(ExportRequest(out=out, backend="tensorrt", precision="fp32", batch_sizes=[1, 2],
                                    timing_cache=tmp_path / "tc", progress=False))
    assert m["validation"]["status"] == "passed", m["validation"]
    policy = load_bundle_policy(out, device="cuda")
    assert policy.engine.backend == "tensorrt"
