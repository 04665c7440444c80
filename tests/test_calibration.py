"""Calibration sets (daemon recordings, LeRobot folders, synthetic), fp8 scales, the TensorRT
entropy calibrator's logic, and the onnxruntime int8 bundle's accuracy report."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from phyai_edge.adapters.pi05 import builtin_adapter
from phyai_edge.calibration import load_calibration_set, read_records, synthetic_observations
from phyai_edge.calibration.fp8 import collect_amax, fake_fp8, load_scales, save_scales, scales_from_amax
from phyai_edge.calibration.trt_calibrator import entropy_calibrator
from phyai_edge.engines.stage_inputs import collect_stage_inputs


@pytest.fixture
def adapter():
    return builtin_adapter("tiny")


def _record(folder: Path, n: int, cameras: list[str]) -> None:
    """What `phyai-edge run --record` writes, through the daemon's own recorder."""
    from phyai_edge.control.recorder import Recorder

    rec = Recorder(folder, {"cameras": {c: c for c in cameras}})
    rng = np.random.default_rng(0)
    for i in range(n):
        images = {c: rng.integers(0, 255, (48, 64, 3), dtype=np.uint8) for c in cameras}
        images[cameras[-1]] = None if i == 1 else images[cameras[-1]]  # a camera dropped once
        rec.add({"job_id": i, "images": images, "bgr": {}, "state": rng.uniform(-1, 1, 14).astype(np.float32),
                 "timestamp": float(i), "prompt": f"task {i}", "rtc_mode": "none", "prefix": None,
                 "delay_estimate": 0, "start_slot": i, "actions": None, "delay": 0, "error": ""})
    rec.close()


def test_reads_daemon_recordings(adapter, tmp_path):
    _record(tmp_path, 3, adapter.camera_names)
    obs = read_records(tmp_path, adapter.camera_names)
    assert [o.prompt for o in obs] == ["task 0", "task 1", "task 2"]
    assert obs[1].images[adapter.camera_names[-1]] is None and obs[0].images["top"].shape == (48, 64, 3)
    cset = load_calibration_set(tmp_path, adapter, limit=2)
    assert len(cset.observations) == 2 and cset.source.startswith("recording:")
    adapter.preprocess(cset.observations)  # valid model inputs


def _lerobot(root: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    cv2 = pytest.importorskip("cv2")
    (root / "meta").mkdir(parents=True)
    info = {"codebase_version": "v2.1", "features": {
        "observation.images.top": {"dtype": "image", "shape": [32, 40, 3]},
        "observation.images.wrist": {"dtype": "video", "shape": [32, 40, 3]},
        "observation.state": {"dtype": "float32", "shape": [14]},
        "action": {"dtype": "float32", "shape": [14]}}}
    (root / "meta" / "info.json").write_text(json.dumps(info))
    (root / "meta" / "tasks.jsonl").write_text(json.dumps({"task_index": 0, "task": "fold the towel"}) + "\n")
    rows = {"observation.images.top": [], "observation.state": [], "episode_index": [], "frame_index": [],
            "task_index": [], "timestamp": []}
    for i in range(5):
        img = np.full((32, 40, 3), 20 * i, np.uint8)
        _, png = cv2.imencode(".png", img)
        rows["observation.images.top"].append({"bytes": png.tobytes(), "path": None})
        rows["observation.state"].append([float(i)] * 14)
        rows["episode_index"].append(0)
        rows["frame_index"].append(i)
        rows["task_index"].append(0)
        rows["timestamp"].append(i / 30)
        # The wrist camera is a video feature, decoded to LeRobot's image-folder layout.
        d = root / "images" / "observation.images.wrist" / "episode_000000"
        d.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(d / f"frame_{i:06d}.png"), np.full((32, 40, 3), 7, np.uint8))
    (root / "data" / "chunk-000").mkdir(parents=True)
    pq.write_table(pa.table(rows), root / "data" / "chunk-000" / "episode_000000.parquet")


def test_reads_a_lerobot_dataset_folder(adapter, tmp_path):
    _lerobot(tmp_path)
    cset = load_calibration_set(tmp_path, adapter, limit=3)
    # Model cameras top/left_wrist/right_wrist; dataset top/wrist: matched by name where
    # they agree, the rest absent.
    obs = cset.observations
    assert len(obs) == 3 and cset.source.startswith("lerobot:")
    assert obs[0].prompt == "fold the towel" and obs[-1].state[0] == 4.0
    assert obs[1].images["top"].shape == (32, 40, 3) and obs[1].images["left_wrist"] is None
    from phyai_edge.calibration.lerobot import read_lerobot

    mapped = read_lerobot(tmp_path, adapter.camera_names, limit=2, camera_map={"top": "top", "left_wrist": "wrist"})
    assert int(mapped[0].images["left_wrist"][0, 0, 0]) == 7


def test_unknown_calibration_folder_says_what_it_expects(adapter, tmp_path):
    with pytest.raises(ValueError, match="LeRobot dataset"):
        load_calibration_set(tmp_path, adapter)


def test_synthetic_observations_are_valid_inputs(adapter):
    obs = synthetic_observations(adapter, 3, seed=1)
    x = adapter.preprocess(obs)
    assert x.batch_size == 3 and torch.isfinite(x.tensors["images"]).all()


def test_stage_inputs_cover_every_flow_step(adapter):
    s = collect_stage_inputs(adapter, synthetic_observations(adapter, 3), batch_size=2)
    assert len(s["embed_images"]) == 2  # 3 observations -> two batches of 2 (last one padded)
    assert len(s["denoise_step"]) == 2 * adapter.solver.num_steps
    assert s["denoise_step"][0]["k_cache"].shape[1] == 2


def test_fp8_scales_round_trip_and_fake_quantisation(adapter, tmp_path):
    obs = synthetic_observations(adapter, 2)
    amax = collect_amax(adapter.module, lambda: collect_stage_inputs(adapter, obs))
    scales = scales_from_amax(amax)
    assert len(scales) > 10 and all(s["input_scale"] > 0 and s["weight_scale"] > 0 for s in scales.values())
    path = save_scales(tmp_path / "fp8_scales.safetensors", scales)
    loaded = load_scales(path)
    assert loaded.keys() == scales.keys()
    assert json.loads(path.with_suffix(".json").read_text())["fp8_max"] == 448.0
    twin = load_scales(path.with_suffix(".json"))  # the readable twin loads to the same numbers
    assert twin.keys() == loaded.keys()
    assert all(abs(twin[n][k] - loaded[n][k]) <= 1e-7 * abs(loaded[n][k]) for n in loaded for k in loaded[n])
    bad = tmp_path / "not_scales.json"
    bad.write_text(json.dumps({"format": "something else", "scales": {}}))
    with pytest.raises(ValueError, match="not an fp8 scales file"):
        load_scales(bad)
    w = adapter.module.action_out_proj.weight.clone()
    x = adapter.preprocess(obs[:1])
    from phyai_edge.engines.eager import EagerEngine

    noise = torch.randn(1, 50, 32)
    ref = EagerEngine(adapter).run(x, noise=noise)
    with fake_fp8(adapter.module, loaded):
        q = EagerEngine(adapter).run(x, noise=noise)
    assert torch.equal(adapter.module.action_out_proj.weight, w)  # restored
    rel = float((q - ref).norm() / ref.norm())
    print(f"fake-fp8 chunk relative error: {rel:.3g}")
    assert 0 < rel < 0.2


class _FakeCalibratorBase:
    def __init__(self) -> None:
        pass


def test_entropy_calibrator_feeds_batches_and_caches(tmp_path):
    fake_trt = types.SimpleNamespace(IInt8EntropyCalibrator2=_FakeCalibratorBase)
    samples = [{"x_t": np.full((2, 4), i, np.float32), "k_cache": np.zeros((1, 2, 1, 3, 2), np.float32)}
               for i in range(3)]
    cal = entropy_calibrator(samples, tmp_path / "c.cache", device="cpu", trt=fake_trt)
    assert cal.get_batch_size() == 2  # batch read from the KV cache's axis 1
    for i in range(3):
        ptrs = cal.get_batch(["k_cache", "x_t"])
        assert len(ptrs) == 2 and ptrs[1] == cal.buffers["x_t"].data_ptr()
        assert float(cal.buffers["x_t"][0, 0]) == i
    assert cal.get_batch(["x_t"]) is None
    assert cal.read_calibration_cache() is None
    cal.write_calibration_cache(b"TRT-scales")
    assert entropy_calibrator(samples, tmp_path / "c.cache", device="cpu", trt=fake_trt).read_calibration_cache() == b"TRT-scales"


def test_entropy_calibrator_keeps_its_error_instead_of_raising_into_tensorrt(tmp_path):
    # TensorRT's Python bridge catches an exception from get_batch and only prints it; the
    # calibrator must end the data and keep the error for build_engine to raise.
    fake_trt = types.SimpleNamespace(IInt8EntropyCalibrator2=_FakeCalibratorBase)
    samples = [{"x_t": np.zeros((2, 4), np.float32)} for _ in range(2)]
    cal = entropy_calibrator(samples, tmp_path / "c.cache", device="cpu", trt=fake_trt)
    assert cal.error is None
    assert cal.get_batch(["x_t", "t"]) is None
    assert isinstance(cal.error, KeyError) and "no input 't'" in str(cal.error)
    assert cal.get_batch(["x_t"]) is None  # stays ended after an error


def test_int8_onnx_bundle_reports_its_accuracy(tmp_path, adapter):
    pytest.importorskip("onnxruntime")
    from phyai_edge.engines.bundle import read_manifest
    from phyai_edge.engines.exporter import ExportRequest, export_bundle

    out = tmp_path / "tiny-int8"
    export_bundle(ExportRequest(out=out, backend="onnx", precision="int8", calibration="synthetic",
                                calibration_samples=4, holdout=2, progress=False), adapter=adapter)
    m = read_manifest(out)
    cal = m["calibration"]["report"]
    print(f"int8 (onnxruntime QDQ) vs bf16: max {cal['vs_bf16']['max_abs_error']:.3g}, rel-RMSE "
          f"{cal['vs_bf16']['relative_rmse']:.3g}; vs fp32 rel-RMSE {cal['vs_fp32']['relative_rmse']:.3g}")
    assert m["validation"]["status"] == "passed"
    assert 0 < cal["vs_fp32"]["relative_rmse"] < 0.1
    assert (out / "calibration" / "report.json").exists()
    import onnx

    ops = {n.op_type for n in onnx.load(str(out / "onnx" / "b1" / "denoise_step.onnx")).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops



def _quantised_products(path: Path) -> set[str]:
    """Names of the MatMul / Gemm / Conv nodes whose weight input comes through a DequantizeLinear."""
    import onnx

    graph = onnx.load(str(path)).graph
    dq = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return {n.name for n in graph.node if n.op_type in ("MatMul", "Gemm", "Conv") and n.input[1] in dq}


def test_int8_onnx_keeps_the_float32_parts_in_float(tmp_path, adapter):
    """The linears every reduced precision keeps float32 (PI05Model.precision_dtypes: the adaptive
    norms' modulation, the time MLP, the action projections) stay float in the int8 QDQ graph: they
    are tiny, and the action output projection writes the velocity itself."""
    pytest.importorskip("onnxruntime")
    from phyai_edge.engines.bundle import read_manifest
    from phyai_edge.engines.exporter import ExportRequest, export_bundle

    out = tmp_path / "tiny-int8"
    export_bundle(ExportRequest(out=out, backend="onnx", precision="int8", calibration="synthetic",
                                calibration_samples=8, holdout=8, progress=False), adapter=adapter)
    q = _quantised_products(out / "onnx" / "b1" / "denoise_step.onnx")
    kept = {n for n in q if any(k in n for k in ("action_in_proj", "action_out_proj", "time_mlp", "/dense"))}
    assert not kept, f"float32 parts quantised: {sorted(kept)}"
    assert {"/q_proj/MatMul", "/mlp/down_proj/MatMul"} <= q  # the expert's projections still are
    assert "/projector/MatMul" in _quantised_products(out / "onnx" / "b1" / "embed_images.onnx")
    cal = read_manifest(out)["calibration"]["report"]
    print(f"int8 vs fp32 rel-RMSE {cal['vs_fp32']['relative_rmse']:.3g}")
    assert cal["vs_fp32"]["relative_rmse"] < 0.005  # 0.0086 with those parts in int8, 0.0022 without


def test_recorded_failed_frames_are_left_out(adapter, tmp_path):
    """A frame the daemon got no actions for (its `error` set; here a NaN state, which the adapter
    refuses) and a file the recorder left half written are skipped, not the end of the export."""
    from phyai_edge.control.recorder import Recorder

    rec = Recorder(tmp_path, {"cameras": {}})
    rng = np.random.default_rng(0)
    for i in range(4):
        state = np.full(14, np.nan, np.float32) if i == 1 else rng.uniform(-1, 1, 14).astype(np.float32)
        rec.add({"job_id": i, "images": {"top": rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)}, "bgr": {},
                 "state": state, "timestamp": float(i), "prompt": "fold the towel", "rtc_mode": "none", "prefix": None,
                 "delay_estimate": 0, "start_slot": i, "actions": None, "delay": 0,
                 "error": "ValueError: observation 0: state has NaN or Inf values" if i == 1 else ""})
    rec.close()
    (tmp_path / "obs_000004.npz").write_bytes((tmp_path / "obs_000003.npz").read_bytes()[:100])  # cut short
    obs = read_records(tmp_path, adapter.camera_names)
    assert [o.timestamp for o in obs] == [0.0, 2.0, 3.0]
    cset = load_calibration_set(tmp_path, adapter, limit=8)
    assert len(cset.observations) == 3
    collect_stage_inputs(adapter, cset.observations)  # every one a valid model input


def test_a_lerobot_dataset_without_the_model_cameras_is_refused(adapter, tmp_path):
    """Calibrating with every camera absent would set the vision tower's ranges from the blank
    images of absent cameras: refused, naming both sides' cameras. So is a camera map that
    names a camera the model does not have."""
    _lerobot(tmp_path)
    from phyai_edge.calibration.lerobot import read_lerobot

    info = json.loads((tmp_path / "meta" / "info.json").read_text())
    for k in [k for k in info["features"] if k.startswith("observation.images.")]:
        del info["features"][k]
    (tmp_path / "meta" / "info.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match=r"none of the model's cameras \['top', 'left_wrist', 'right_wrist'\]"):
        load_calibration_set(tmp_path, adapter, limit=3)
    _lerobot(tmp_path / "two")
    with pytest.raises(ValueError, match=r"not model cameras: \['front'\]"):
        read_lerobot(tmp_path / "two", adapter.camera_names, limit=2, camera_map={"front": "top"})


def test_fewer_calibration_samples_than_asked_are_reported(adapter, tmp_path):
    """A recording shorter than --calibration-samples + --holdout calibrates with what it has:
    said at export time and recorded in the report (how many calibrated, how many held out)."""
    pytest.importorskip("onnxruntime")
    from phyai_edge.engines.bundle import read_manifest
    from phyai_edge.engines.exporter import ExportRequest, export_bundle

    _record(tmp_path / "rec", 5, adapter.camera_names)
    said: list[str] = []
    out = tmp_path / "b"
    export_bundle(ExportRequest(out=out, backend="onnx", precision="int8", calibration=str(tmp_path / "rec"),
                                calibration_samples=8, holdout=2, progress=False), adapter=adapter, echo=said.append)
    assert any("3 calibration sample(s) of the 8 asked" in s for s in said), said
    cal = read_manifest(out)["calibration"]
    assert (cal["samples"], cal["held_out"]) == (3, 2) and cal["report"]["vs_fp32"]["samples"] == 2


def test_calibration_noise_is_not_the_held_out_reports(adapter, tmp_path, monkeypatch):
    """The report runs each held-out sample from noise drawn with the export's seed; calibration
    must not have seen that noise (x_t at t = 1 is the noise itself): its draws come from another
    seed, so no held-out input is one a scale was set from."""
    pytest.importorskip("onnxruntime")
    import phyai_edge.engines.stage_inputs as stage_inputs
    from phyai_edge.engines.exporter import ExportRequest, export_bundle

    seen: list[np.ndarray] = []
    real = stage_inputs.collect_stage_inputs

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.extend(s["x_t"] for s in out["denoise_step"] if float(s["t"][0]) == 1.0)
        return out

    monkeypatch.setattr(stage_inputs, "collect_stage_inputs", spy)
    export_bundle(ExportRequest(out=tmp_path / "b", backend="onnx", precision="int8", calibration="synthetic",
                                calibration_samples=4, holdout=2, progress=False, validate=False), adapter=adapter)
    gen = torch.Generator().manual_seed(0)  # compare_engines' draws for the held-out samples
    report = [torch.randn(1, adapter.chunk_size, adapter.model_action_dim, generator=gen).numpy() for _ in range(2)]
    assert len(seen) == 4
    assert not any(np.array_equal(x, r) for x in seen for r in report)


def test_accuracy_counts_real_samples_not_the_last_batchs_filler():
    """Three held-out observations at batch 2 run as two batches, the second filled with a
    repeat of the first: the report says 3 samples, and the filler's error is not in it."""
    from phyai_edge.adapters.pi05 import builtin_adapter
    from phyai_edge.calibration import synthetic_observations
    from phyai_edge.engines.accuracy import compare_engines

    adapter = builtin_adapter("tiny", seed=0)
    obs = synthetic_observations(adapter, 3, seed=1)

    class Offset:
        """The reference plus 1 in the rows of the filler only (batch row 1 of the second call)."""

        def __init__(self, ref) -> None:
            self.ref, self.calls = ref, 0

        def run(self, inputs, noise=None):
            out = self.ref.run(inputs, noise=noise).clone()
            self.calls += 1
            if self.calls == 2:
                out[1:] += 1.0
            return out

    from phyai_edge.engines.accuracy import reference_engine

    ref = reference_engine(adapter)
    rep = compare_engines(adapter, Offset(ref), ref, obs, batch_size=2)
    assert rep["samples"] == 3 and rep["max_abs_error"] == 0.0
