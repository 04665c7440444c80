"""Export audit: quantised ONNX as TensorRT must take it (no int32 bias dequantisation, external
data at full size), calibration recordings read without decoding every frame, a synthetic
calibration that says so, a TensorRT older than the API written against refused, and progress
that reaches a log off a terminal as it happens."""

from __future__ import annotations

import io
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from phyai_edge.adapters.pi05 import builtin_adapter
from phyai_edge.calibration import synthetic_observations
from phyai_edge.engines.stage_inputs import collect_stage_inputs

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def adapter() -> Any:
    return builtin_adapter("tiny")


@pytest.fixture(scope="module")
def samples(adapter: Any) -> dict[str, list[dict[str, np.ndarray]]]:
    return collect_stage_inputs(adapter, synthetic_observations(adapter, 2, seed=4), seed=2000)


def _dequantised_int32(path: Path) -> list[str]:
    """DequantizeLinear nodes whose quantised input is an int32 initializer (a quantised bias)."""
    import onnx

    graph = onnx.load(str(path)).graph
    int32 = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.INT32}
    return [n.name for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in int32]


def test_int8_qdq_onnx_has_no_int32_bias_tensorrt_would_refuse(adapter, samples, tmp_path: Path) -> None:
    """The patch convolution's bias came out of the quantiser as int32 behind a DequantizeLinear;
    TensorRT's parser takes only activation types into a Dequantize layer, so `--int8-mode qdq`
    could not build embed_images. The bias stays float; the batch stays dynamic for the profiles."""
    import onnxruntime as ort

    from phyai_edge.calibration.ort_quant import float32_weights, quantize_stage
    from phyai_edge.engines.onnx_export import export_ready, export_stage, onnx_io

    with export_ready(adapter, "fp32") as twin:
        spec = next(s for s in twin.stage_specs(1, 3) if s.name == "embed_images")
        src = export_stage(twin.module, spec, tmp_path / "embed_images.onnx", dynamic_batch=True)
        dst = quantize_stage(src, tmp_path / "embed_images.int8.onnx", samples["embed_images"], kind="int8",
                             keep_float=float32_weights(twin.module))
    assert not _dequantised_int32(dst)
    assert "Conv" in {n.op_type for n in __import__("onnx").load(str(dst)).graph.node}
    assert onnx_io(dst)["inputs"][0][1][0] == "batch"
    sess = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"])
    held = synthetic_observations(adapter, 2, seed=11)  # images of the kind calibrated on, not seen by it
    for b in (1, 2):
        images = adapter.preprocess(held[:b]).tensors["images"]
        got = sess.run(None, {"images": images.numpy()})[0]
        want = adapter.module.embed_images(images).numpy()
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert got.shape[0] == b and rel < 0.05, (b, rel)


def test_a_source_with_external_data_quantises_to_external_data(adapter, samples, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """export_stage keeps weights over ~1.8 GB in `<stage>.onnx.data` (the full model's prefix is
    10 GB in float32); the quantiser then saved its augmented float copy and its output inline, past
    protobuf's 2 GB limit. Here the threshold is lowered so the tiny model takes the same path."""
    import onnx
    import onnxruntime as ort

    import phyai_edge.engines.onnx_export as onnx_export
    from phyai_edge.calibration.ort_quant import quantize_stage, uses_external_data

    monkeypatch.setattr(onnx_export, "_EXTERNAL_DATA_BYTES", 0)
    with onnx_export.export_ready(adapter, "fp32") as twin:
        spec = next(s for s in twin.stage_specs(1, 3) if s.name == "denoise_step")
        src = onnx_export.export_stage(twin.module, spec, tmp_path / "src" / "denoise_step.onnx")
    assert uses_external_data(src)
    dst = tmp_path / "q" / "denoise_step.onnx"
    dst.parent.mkdir()
    dst.with_name(dst.name + ".data").write_bytes(b"left over from an earlier run")
    for kind in ("int8", "fp8"):
        quantize_stage(src, dst, samples["denoise_step"], kind=kind)
        assert uses_external_data(dst), kind
        model = onnx.load(str(dst), load_external_data=False)
        external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        inline = [t.name for t in model.graph.initializer if len(t.raw_data) >= 1024]
        assert len(external) >= 10 and not inline, (kind, inline)
        onnx.checker.check_model(str(dst))
        sess = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"])
        feeds = samples["denoise_step"][3]
        got = sess.run(None, feeds)[0]
        want = adapter.module.denoise_step(*(torch.from_numpy(v) for v in feeds.values())).numpy()
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert rel < 0.1, (kind, rel)


def _recording(folder: Path, n: int, cameras: list[str], failed: set[int]) -> None:
    from phyai_edge.control.recorder import Recorder

    rec = Recorder(folder, {"cameras": {c: c for c in cameras}})
    rng = np.random.default_rng(0)
    for i in range(n):
        rec.add({"job_id": i, "images": {c: rng.integers(0, 255, (24, 32, 3), dtype=np.uint8) for c in cameras},
                 "bgr": {}, "state": rng.uniform(-1, 1, 14).astype(np.float32), "timestamp": float(i),
                 "prompt": "fold the towel", "rtc_mode": "none", "prefix": None, "delay_estimate": 0,
                 "start_slot": i, "actions": None, "delay": 0, "error": "boom" if i in failed else ""})
    rec.close()


def test_a_recording_is_subsampled_before_its_frames_are_read(adapter, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """load_calibration_set decoded every frame of the recording and then kept `limit` of them:
    a day's recording does not fit in memory. The same records are picked (evenly over the usable
    ones), and only theirs are read."""
    import phyai_edge.calibration.records as records
    from phyai_edge.calibration import load_calibration_set

    _recording(tmp_path, 40, adapter.camera_names, failed={5})
    real_load = np.load
    frames_read: list[str] = []

    class Counting:
        def __init__(self, z: Any) -> None:
            self.z, self.files = z, z.files

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.z.close()

        def __getitem__(self, key: str) -> Any:
            if key.startswith("image."):
                frames_read.append(key)
            return self.z[key]

    monkeypatch.setattr(records.np, "load", lambda f, **kw: Counting(real_load(f, **kw)))
    cset = load_calibration_set(tmp_path, adapter, limit=6)
    usable = [float(i) for i in range(40) if i != 5]
    want = [usable[int(i)] for i in np.linspace(0, len(usable) - 1, num=6)]
    assert [o.timestamp for o in cset.observations] == want
    assert len(frames_read) == 6 * len(adapter.camera_names)


def test_synthetic_calibration_is_a_warning_even_when_asked_for(adapter) -> None:
    """`--calibration synthetic` gave int8 / fp8 scales (and an accuracy report) from random images
    without a word; only leaving --calibration out printed a note."""
    from phyai_edge.engines.exporter import ExportRequest, _calibration, summary_table

    for calibration in ("synthetic", None):
        said: list[str] = []
        req = ExportRequest(out=Path("unused"), precision="int8", calibration=calibration, calibration_samples=2,
                            holdout=1)
        _, _, source = _calibration(req, adapter, said.append)
        assert source == "synthetic"
        assert any(s.startswith("WARNING") and "synthetic" in s and "--calibration DIR" in s for s in said), said
    said = []
    _calibration(ExportRequest(out=Path("unused"), precision="fp32", calibration="synthetic", holdout=1), adapter,
                 said.append)
    assert not said  # nothing is calibrated at fp32
    manifest = {"files": {}, "backend": "tensorrt", "dtype": "float32", "precision": {"denoise_step": "fp8"},
                "batch_sizes": [1], "views": 3, "steps": 10, "validation": {"status": "skipped"},
                "calibration": {"source": "synthetic"}}
    assert "synthetic observations" in summary_table(manifest, Path("b"))


def test_tensorrt_older_than_10_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """JetPack 6.0's TensorRT 8.6 has no strongly typed networks and makes an implicit-batch network
    from create_network(0): the build failed with an AttributeError or a parser error."""
    from phyai_edge.engines.tensorrt import import_tensorrt

    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="8.6.2"))
    with pytest.raises(RuntimeError, match=r"TensorRT 8\.6\.2 is installed.*TensorRT 10 or newer"):
        import_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.3.0"))
    assert import_tensorrt().__version__ == "10.3.0"


class _Pipe(io.RawIOBase):
    """The far end of a pipe (journald, a CI runner): what the process has actually written."""

    def __init__(self) -> None:
        self.received = b""

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.received += bytes(b)
        return len(b)


def test_progress_lines_reach_a_pipe_as_they_happen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off a terminal Python block-buffers stdout: the per-step lines of an export under systemd or
    in CI arrived all at once when it ended (or never, when it was killed)."""
    import phyai_edge.engines.exporter as exporter

    pipe = _Pipe()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BufferedWriter(pipe), line_buffering=False))
    seen_at_validation: list[bytes] = []
    real_validate = exporter._validate

    def validate(*args: Any, **kwargs: Any) -> Any:
        seen_at_validation.append(pipe.received)
        return real_validate(*args, **kwargs)

    monkeypatch.setattr(exporter, "_validate", validate)
    exporter.export_bundle(exporter.ExportRequest(out=tmp_path / "b", steps=2, validate=False, progress=True),
                           adapter=builtin_adapter("tiny"))
    assert b"onnx b1 fp32: denoise_step done" in seen_at_validation[0]


def test_no_progress_bar_off_a_terminal_even_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library default (`ExportRequest.progress=True`, what benchmarks/export_gpu.py uses) drew
    tqdm bars into whatever stderr was: a log file full of carriage-return redraws."""
    pytest.importorskip("tqdm")
    from phyai_edge.engines.exporter import Progress

    said: list[str] = []
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    progress = Progress(True, said.append)
    with progress.phase("onnx b1 fp32", ["a", "b"]) as done:
        done("a")
    assert progress.tqdm is None and said == ["onnx b1 fp32: 2 step(s)", "  onnx b1 fp32: a done"]
    assert sys.stderr.getvalue() == ""


def test_fp8_bundles_record_their_real_opset_and_calibration_source(tmp_path: Path) -> None:
    """The manifest said opset 17 for fp8 ONNX files the quantiser had raised to 19, and an fp8
    cudagraph (or TensorRT) bundle's calibration entry lost where its samples came from."""
    from phyai_edge.engines.bundle import read_manifest
    from phyai_edge.engines.exporter import ExportRequest, export_bundle

    lines: list[str] = []
    common = dict(precision="fp8", calibration="synthetic", calibration_samples=2, holdout=1, steps=2,
                  progress=False, validate=False)
    export_bundle(ExportRequest(out=tmp_path / "onnx", backend="onnx", **common), adapter=builtin_adapter("tiny"),
                  echo=lines.append)
    assert read_manifest(tmp_path / "onnx")["artefacts"]["onnx"]["opset"] == 19
    export_bundle(ExportRequest(out=tmp_path / "cg", backend="cudagraph", **common), adapter=builtin_adapter("tiny"),
                  echo=lines.append)
    cal = read_manifest(tmp_path / "cg")["calibration"]
    assert cal["source"] == "synthetic" and "fake_fp8_vs_fp32" in cal
    assert sum("calibration: synthetic observations" in line for line in lines) == 2


def test_an_int8_cache_left_in_the_plan_folder_is_not_reused(tmp_path: Path) -> None:
    """The int8 calibration cache was keyed by its path alone (`<plan_dir>/<stage>.int8.cache`), and
    TensorRT checks only its version header: a build into a folder holding another checkpoint's
    cache (same architecture, same tensor names) took that model's scales without calibrating."""
    from test_tensorrt import FakeTRT

    from phyai_edge.engines.tensorrt import BuildOptions, build_for_adapter

    class CalibratorBase:
        def __init__(self) -> None:
            pass

    adapter = builtin_adapter("tiny")
    calibration = collect_stage_inputs(adapter, synthetic_observations(adapter, 1), seed=2000)
    plans = tmp_path / "trt"
    plans.mkdir()
    for stage in adapter.stage_names():
        (plans / f"{stage}.int8.cache").write_bytes(b"TRT-10 scales of another checkpoint")
    trt = FakeTRT(None)
    trt.IInt8EntropyCalibrator2 = CalibratorBase
    built: list[Any] = []
    trt.Builder.build_serialized_network = lambda self, network, config: built.append(config.int8_calibrator) or b"PLAN"
    build_for_adapter(adapter, plans, [1], 3, BuildOptions("int8"), calibration=calibration, trt=trt)
    assert len(built) == 3 and all(c.read_calibration_cache() is None for c in built)
