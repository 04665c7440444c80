"""Each PI0.5 stage exported to ONNX, checked, and run with onnxruntime against eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from phyai_edge.adapters.pi05 import builtin_adapter
from phyai_edge.calibration import synthetic_observations
from phyai_edge.engines import make_engine
from phyai_edge.engines.onnx_export import export_ready, export_stage, onnx_io, sample_inputs
from phyai_edge.engines.rtc import RTCGuidance, prefix_weights


@pytest.fixture(scope="module")
def adapter():
    return builtin_adapter("tiny")


def test_each_stage_exports_checks_and_matches_eager(adapter, tmp_path):
    import onnx
    import onnxruntime as ort

    with export_ready(adapter, "fp32") as twin:
        for spec in twin.stage_specs(1, 3):
            path = export_stage(twin.module, spec, tmp_path / f"{spec.name}.onnx")
            model = onnx.load(str(path))
            assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
            io = onnx_io(path)
            # Static shapes, names as the adapter declares them.
            assert [n for n, _ in io["inputs"]] == list(spec.inputs)
            assert [n for n, _ in io["outputs"]] == list(spec.outputs)
            assert all(isinstance(d, int) for _, dims in io["inputs"] for d in dims)
            feeds = sample_inputs(spec, seed=3)
            sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            got = sess.run(None, {n: t.numpy() for n, t in feeds.items()})
            want = getattr(twin.module, spec.name)(*feeds.values())
            want = want if isinstance(want, tuple) else (want,)
            for name, g, w in zip(spec.outputs, got, want):
                err = float(np.abs(g.astype(np.float32) - w.float().numpy()).max())
                print(f"{spec.name}.{name}: max |onnx - eager| = {err:.3g}")
                assert err < 1e-4, (spec.name, name, err)
    assert adapter.module.time_embed_fp64  # export_ready restored the reference setting


def test_denoise_step_takes_time_as_input(adapter, tmp_path):
    import onnxruntime as ort

    with export_ready(adapter) as twin:
        spec = next(s for s in twin.stage_specs(1, 3) if s.name == "denoise_step")
        path = export_stage(twin.module, spec, tmp_path / "d.onnx")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {n: t.numpy() for n, t in sample_inputs(spec).items()}
    outs = []
    for t in (0.9, 0.3):
        feeds["t"] = np.full((1,), t, np.float32)
        outs.append(sess.run(None, feeds)[0])
    assert np.abs(outs[0] - outs[1]).max() > 1e-3  # t is live, not folded into a constant


def test_onnxruntime_engine_matches_eager_chunk(adapter):
    eager = make_engine("eager", adapter)
    ort_engine = make_engine("onnxruntime", adapter, batch_sizes=(2,))
    obs = synthetic_observations(adapter, 2, seed=5)
    inputs = adapter.preprocess(obs)
    noise = torch.randn(2, adapter.chunk_size, adapter.model_action_dim, generator=torch.Generator().manual_seed(1))
    ref = eager.run(inputs, noise=noise)
    got = ort_engine.run(inputs, noise=noise)
    err = float((ref - got).abs().max())
    print(f"chunk max |onnxruntime - eager| = {err:.3g}")
    assert err < 1e-3
    assert set(ort_engine.last_stage_ms) >= {"embed_images", "encode_prefix", "denoise_step"}
    with pytest.raises(ValueError, match="batch sizes"):
        ort_engine.run(adapter.preprocess(obs[:1]))


@pytest.mark.parametrize("mode", ["guided-approx", "inpaint"])
def test_rtc_through_the_shared_solver_matches_eager(adapter, mode):
    eager = make_engine("eager", adapter)
    ort_engine = make_engine("onnxruntime", adapter)
    inputs = adapter.preprocess(synthetic_observations(adapter, 1, seed=9))
    h, d = adapter.chunk_size, adapter.model_action_dim
    gen = torch.Generator().manual_seed(2)
    target = torch.randn(1, h, d, generator=gen) * 0.5
    dim_mask = torch.zeros(d)
    dim_mask[: adapter.action_dim] = 1
    rtc = RTCGuidance(mode, target, prefix_weights(h, 5, 25), dim_mask, 5, 5.0)
    noise = torch.randn(1, h, d, generator=gen)
    plain = eager.run(inputs, noise=noise)
    ref = eager.run(inputs, noise=noise, rtc=rtc)
    got = ort_engine.run(inputs, noise=noise, rtc=rtc)
    assert float((ref - plain).abs().max()) > 1e-2  # guidance changed the chunk
    assert float((ref - got).abs().max()) < 1e-3


def test_exact_guidance_is_refused_with_a_reason(adapter):
    ort_engine = make_engine("onnxruntime", adapter)
    inputs = adapter.preprocess(synthetic_observations(adapter, 1))
    h, d = adapter.chunk_size, adapter.model_action_dim
    rtc = RTCGuidance("guided", torch.zeros(1, h, d), prefix_weights(h, 2, 10), torch.ones(d), 2, 5.0)
    with pytest.raises(ValueError, match="guided-approx"):
        ort_engine.run(inputs, rtc=rtc)


def test_fp16_export_is_typed(adapter, tmp_path):
    import onnx

    with export_ready(adapter, "fp16") as twin:
        spec = next(s for s in twin.stage_specs(1, 3) if s.name == "encode_prefix")
        path = export_stage(twin.module, spec, tmp_path / "e.onnx", dynamic_batch=True)
    types = {i.name: i.type.tensor_type.elem_type for i in onnx.load(str(path)).graph.input}
    assert types["image_embeds"] == onnx.TensorProto.FLOAT16
    dims = onnx_io(path)["inputs"][0][1]
    assert dims[0] == "batch"
    assert next(adapter.module.parameters()).dtype == torch.float32  # the shared module untouched


def test_export_without_onnx_installed_says_what_to_install(tmp_path, capsys, monkeypatch):
    import importlib.util

    from phyai_edge.cli import main as cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnx" else real(name, *a))
    rc = cli(["export", "--preset", "tiny", "--backend", "onnx", "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "the onnx backend needs onnx: pip install 'phyai-edge[onnx]'" in err
    assert not (tmp_path / "b").exists()
