"""Engine bundles: export with the CLI, load back, and every refusal case."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")

from phyai_edge.adapters.pi05 import builtin_adapter, save_native
from phyai_edge.calibration import synthetic_observations
from phyai_edge.cli import main as cli
from phyai_edge.engines.bundle import (
    BundleError,
    Platform,
    builtin_source,
    parse_builtin_source,
    read_manifest,
    seal,
    verify_bundle,
)
from phyai_edge.engines.exporter import ExportRequest, export_bundle
from phyai_edge.engines.onnxrt import OnnxRuntimeEngine
from phyai_edge.engines.policy import load_bundle_policy, load_policy


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_native(builtin_adapter("tiny", seed=0), tmp_path_factory.mktemp("ckpt") / "pi05_tiny")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, checkpoint) -> Path:
    out = tmp_path_factory.mktemp("engines") / "tiny-onnx"
    rc = cli(["export", "--checkpoint", str(checkpoint), "--out", str(out), "--backend", "onnx",
              "--batch", "1,2", "--steps", "5", "--no-progress"])
    assert rc == 0
    return out


def _copy(bundle: Path, tmp_path: Path) -> Path:
    dst = tmp_path / bundle.name
    shutil.copytree(bundle, dst)
    return dst


def test_manifest_describes_the_bundle(bundle, checkpoint):
    m = read_manifest(bundle)
    assert m["backend"] == "onnxruntime" and m["batch_sizes"] == [1, 2] and m["steps"] == 5 and m["views"] == 3
    assert m["adapter"]["name"] == "pi05" and m["adapter"]["preset"] == "tiny"
    assert set(m["precision"].values()) == {"fp32"}
    specs = {s["name"]: s for s in m["stages"]["2"]}
    assert specs["denoise_step"]["inputs"]["t"] == {"shape": [2], "dtype": "float32"}
    assert specs["encode_prefix"]["outputs"]["k_cache"]["shape"][1] == 2
    assert m["versions"]["torch"] == torch.__version__ and m["versions"]["onnxruntime"]
    assert "gpu_name" in m["target"] and "compute_capability" in m["target"]
    for rel in ("checkpoint/phyai_edge.json", "checkpoint/norm_stats.json", "checkpoint/tokenizer.json",
                "onnx/b1/denoise_step.onnx", "onnx/b2/encode_prefix.onnx"):
        assert rel in m["files"], rel
    assert "checkpoint/model.safetensors" not in m["files"]  # ONNX bundles carry weights in the graphs
    v = m["validation"]
    print(f"bundle validation: max |onnxruntime - eager| = {v['max_abs_error']:.3g}")
    assert v["status"] == "passed" and v["max_abs_error"] < 1e-3
    verify_bundle(bundle, checkpoint=checkpoint)  # the exporting checkpoint matches


def test_round_trip_gives_the_engine_s_actions(bundle, checkpoint):
    policy = load_policy(bundle=bundle)
    assert policy.engine.backend == "onnxruntime" and policy.adapter.solver.num_steps == 5
    obs = synthetic_observations(policy.adapter, 2, seed=4)
    noise = torch.randn(2, 50, 32, generator=torch.Generator().manual_seed(0))
    got = policy.infer(obs, noise=noise).actions
    # The same ONNX files through an engine made directly.
    direct = OnnxRuntimeEngine(policy.adapter, model_dir=bundle / "onnx", batch_sizes=[1, 2])
    chunk = direct.run(policy.adapter.preprocess(obs), noise=noise)
    np.testing.assert_allclose(got, policy.adapter.postprocess(chunk), atol=1e-6)
    # And the bundle agrees with eager on the original checkpoint.
    eager = load_policy(checkpoint=checkpoint)
    eager.adapter.solver = policy.adapter.solver
    ref = eager.infer(obs, noise=noise).actions
    assert np.abs(ref - got).max() < 1e-3
    one = policy.infer(obs[:1], noise=noise[:1]).actions  # the other batch size works too
    np.testing.assert_allclose(one, got[:1], atol=1e-4)


def test_refuses_a_file_that_fails_its_hash(bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    f = b / "onnx" / "b1" / "denoise_step.onnx"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    f.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"fail their hash.*onnx/b1/denoise_step.onnx"):
        load_bundle_policy(b)


def test_refuses_a_missing_file(bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    (b / "checkpoint" / "norm_stats.json").unlink()
    with pytest.raises(BundleError, match=r"missing 1 file.*norm_stats.json"):
        load_policy(bundle=b)


def test_refuses_an_edited_manifest(bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    m = json.loads((b / "manifest.json").read_text())
    m["steps"] = 3
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="edited after export"):
        load_policy(bundle=b)


def test_refuses_a_manifest_that_is_not_an_object(bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    (b / "manifest.json").write_text("[1, 2]")
    with pytest.raises(BundleError, match=r"manifest\.json.*not a JSON object"):
        load_policy(bundle=b)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("backend", None, r"field 'backend' is missing"),
    ("checkpoint", "weights", r"field 'checkpoint' is missing or not a dict"),
    ("files", {}, r"field 'files' lists no files"),
])
def test_refuses_a_sealed_manifest_without_what_loaders_read(bundle, tmp_path, field, value, message):
    """Re-sealed by hand, so only the field check can object: a missing backend was a KeyError at
    load time, and an empty file list made the hash check pass over nothing."""
    b = _copy(bundle, tmp_path)
    m = json.loads((b / "manifest.json").read_text())
    if value is None:
        del m[field]
    else:
        m[field] = value
    (b / "manifest.json").write_text(json.dumps(seal(m)))
    with pytest.raises(BundleError, match=message):
        load_policy(bundle=b)


def test_a_preset_bundle_says_a_checkpoint_cannot_be_checked_against_it(bundle, tmp_path, checkpoint):
    """A bundle exported from a built-in preset records a hash of its tensors, which no checkpoint
    folder's files can match: the refusal says so instead of "checkpoint hash differs"."""
    b = _copy(bundle, tmp_path)
    m = json.loads((b / "manifest.json").read_text())
    m["checkpoint"]["source"] = "builtin:tiny:seed=0"
    (b / "manifest.json").write_text(json.dumps(seal(m)))
    with pytest.raises(BundleError, match=r"built-in preset \(builtin:tiny:seed=0\).*without a checkpoint") as err:
        verify_bundle(b, checkpoint=checkpoint)
    assert "hash differs" not in str(err.value)


def test_the_preset_source_string_reads_back_and_a_folder_is_not_one(tmp_path):
    """The exporter writes a preset's source with `builtin_source`; eval and the checkpoint check read
    it back with `parse_builtin_source`, and a folder's path (even one named like a preset) is none."""
    assert parse_builtin_source(builtin_source("full", 12)) == ("full", 12)
    assert parse_builtin_source(str(tmp_path / "builtin:tiny")) is None
    assert parse_builtin_source("builtin:tiny:seed=x") is None


def test_refuses_a_newer_format_saying_to_upgrade(bundle, tmp_path):
    """A bundle written by a newer phyai-edge: re-exporting here is one way out, but the message
    must say what happened (this phyai-edge is older than the bundle)."""
    b = _copy(bundle, tmp_path)
    m = json.loads((b / "manifest.json").read_text())
    m["format"] = "phyai-edge/bundle/2"
    (b / "manifest.json").write_text(json.dumps(seal(m)))
    with pytest.raises(BundleError, match=r"manifest\.json: format 'phyai-edge/bundle/2'.*newer phyai-edge.*upgrade"):
        load_policy(bundle=b)
    m["format"] = "something/else"
    (b / "manifest.json").write_text(json.dumps(seal(m)))
    with pytest.raises(BundleError, match=r"format 'something/else'.*reads 'phyai-edge/bundle/1'") as err:
        load_policy(bundle=b)
    assert "newer phyai-edge" not in str(err.value)


def test_refuses_a_different_checkpoint(bundle, tmp_path):
    other = save_native(builtin_adapter("tiny", seed=1), tmp_path / "other")
    with pytest.raises(BundleError, match="checkpoint hash differs"):
        load_bundle_policy(bundle, checkpoint=other)
    with pytest.raises(BundleError, match="checkpoint hash differs"):  # the front door, as the daemon calls it
        load_policy(bundle=bundle, checkpoint=other)


def _as_tensorrt(bundle: Path, tmp_path: Path, cc: str = "8.7", trt: str = "10.3.0") -> Path:
    """The bundle as if built by TensorRT on another machine (re-sealed, so only the
    platform check can object)."""
    b = _copy(bundle, tmp_path)
    m = json.loads((b / "manifest.json").read_text())
    m["backend"] = "tensorrt"
    m["target"].update(gpu_name="Orin (nvgpu)", compute_capability=cc, cuda_available=True)
    m["versions"]["tensorrt"] = trt
    (b / "manifest.json").write_text(json.dumps(seal(m)))
    return b


def test_refuses_another_gpu_architecture(bundle, tmp_path):
    b = _as_tensorrt(bundle, tmp_path)
    h200 = Platform(True, "NVIDIA H200", "9.0", {"tensorrt": "10.3.0"})
    with pytest.raises(BundleError, match=r"GPU architecture differs.*8\.7.*H200.*9\.0"):
        verify_bundle(b, device="cuda", here=h200)
    with pytest.raises(BundleError, match="no CUDA GPU"):
        verify_bundle(b, device="cuda", here=Platform(False, None, None, {}))
    with pytest.raises(BundleError, match="CUDA device"):
        verify_bundle(b, device="cpu", here=h200)


def test_refuses_another_tensorrt_version(bundle, tmp_path):
    b = _as_tensorrt(bundle, tmp_path)
    orin = Platform(True, "Orin (nvgpu)", "8.7", {"tensorrt": "10.7.0"})
    with pytest.raises(BundleError, match=r"TensorRT version differs.*10\.3\.0.*10\.7\.0"):
        verify_bundle(b, device="cuda", here=orin)
    same = Platform(True, "Orin (nvgpu)", "8.7", {"tensorrt": "10.3.0"})
    assert verify_bundle(b, device="cuda", here=same)["backend"] == "tensorrt"


def test_warns_on_another_gpu_model_of_the_same_architecture(bundle, tmp_path, caplog):
    """A plan built on one GPU model loads on another of its compute capability, but TensorRT
    tuned it for the first: loaded, with one warning that says to re-export."""
    b = _as_tensorrt(bundle, tmp_path, cc="8.9", trt="10.7.0")
    rtx = Platform(True, "NVIDIA GeForce RTX 4080", "8.9", {"tensorrt": "10.7.0"})
    with caplog.at_level("WARNING", logger="phyai_edge.engines.bundle"):
        assert verify_bundle(b, device="cuda", here=rtx)["backend"] == "tensorrt"
    assert any("built on Orin (nvgpu), running on NVIDIA GeForce RTX 4080" in r.getMessage() for r in caplog.records)


def test_refuses_a_folder_that_is_not_a_bundle(tmp_path):
    with pytest.raises(BundleError, match=r"no manifest\.json"):
        load_policy(bundle=tmp_path)


def test_cudagraph_bundle_carries_the_weights(tmp_path, checkpoint):
    out = tmp_path / "tiny-cg"
    assert cli(["export", "--checkpoint", str(checkpoint), "--out", str(out), "--backend", "cudagraph",
                "--precision", "bf16", "--no-progress"]) == 0
    m = read_manifest(out)
    assert m["checkpoint"]["weights_included"] and "checkpoint/model.safetensors" in m["files"]
    assert m["dtype"] == "bfloat16"
    if not torch.cuda.is_available():
        assert m["validation"]["status"] == "skipped"
        with pytest.raises(BundleError, match="CUDA device"):
            load_policy(bundle=out)
    # The weights in the bundle are the checkpoint's, stored in the engine's precision: same
    # hash, same eager actions at that precision (tests/test_bundle_weights.py has the rest).
    assert m["checkpoint"]["weight_dtype"] == "bfloat16"
    verify_bundle(out, device="cuda", checkpoint=checkpoint, here=Platform(True, "x", "9.0", {}))
    from phyai_edge.engines.bundle import bundle_adapter
    from phyai_edge.engines.eager import EagerEngine

    ad = bundle_adapter(out, m)
    ref = builtin_adapter("tiny", seed=0)
    inputs = ref.preprocess(synthetic_observations(ref, 1))
    noise = torch.randn(1, 50, 32)
    a = EagerEngine(ad, dtype="bfloat16").run(inputs, noise=noise)
    b = EagerEngine(ref, dtype="bfloat16").run(inputs, noise=noise)
    assert torch.equal(a, b)


def test_export_refuses_to_overwrite_without_the_flag(bundle, capsys):
    assert cli(["export", "--preset", "tiny", "--out", str(bundle), "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_a_bundle_that_failed_its_validation_is_refused(bundle, tmp_path):
    """`phyai-edge export` writes a bundle that failed validation (exit 1) for inspection; loading it
    for a robot is refused, naming the error and the tolerance."""
    b = _copy(bundle, tmp_path)
    m = json.loads((b / "manifest.json").read_text())
    m["validation"].update(status="failed", max_abs_error=0.5, tolerance=1e-3)
    (b / "manifest.json").write_text(json.dumps(seal(m)))
    with pytest.raises(BundleError, match=r"failed its validation at export \(max \|error\| 0.5 over the tolerance 0.001\)"):
        load_bundle_policy(b)


def test_overwrite_leaves_a_folder_that_is_not_a_bundle(tmp_path, capsys):
    mine = tmp_path / "notes"
    (mine / "sub").mkdir(parents=True)
    (mine / "sub" / "data.txt").write_text("keep me")
    assert cli(["export", "--preset", "tiny", "--out", str(mine), "--overwrite", "--no-progress"]) == 2
    assert "is not an engine bundle (no manifest.json)" in capsys.readouterr().err
    assert (mine / "sub" / "data.txt").read_text() == "keep me"
    afile = tmp_path / "afile"
    afile.write_text("")
    assert cli(["export", "--preset", "tiny", "--out", str(afile), "--no-progress"]) == 2
    assert "a file, not a folder" in capsys.readouterr().err


def test_a_failing_export_never_replaces_the_bundle_in_place(bundle, tmp_path, checkpoint, monkeypatch, capsys):
    """--overwrite over a good bundle with an export that fails validation: the good one stays, the
    new one is written beside it for inspection (exit 1)."""
    from phyai_edge.engines import exporter

    b = _copy(bundle, tmp_path)
    before = (b / "manifest.json").read_text()
    monkeypatch.setitem(exporter.TOLERANCE, "fp32", 1e-12)
    rc = cli(["export", "--checkpoint", str(checkpoint), "--out", str(b), "--backend", "onnx", "--batch", "1",
              "--steps", "2", "--overwrite", "--no-progress"])
    assert rc == 1
    assert (b / "manifest.json").read_text() == before
    beside = tmp_path / f"{b.name}.failed-validation"
    assert read_manifest(beside)["validation"]["status"] == "failed"
    assert f"the new bundle is in {beside}" in capsys.readouterr().out


def test_export_help_lists_the_options(capsys):
    with pytest.raises(SystemExit):
        cli(["export", "--help"])
    text = capsys.readouterr().out
    for opt in ("--backend", "--precision", "--batch", "--views", "--calibration", "--steps", "tensorrt"):
        assert opt in text


def test_export_reports_progress_through_validation(tmp_path):
    """Every long phase of an export says what it is doing, validation included (a capture and a
    float32 reference run per batch size at full size). Without a bar (progress off) each phase
    prints a line per step: those lines are what this reads."""
    lines: list[str] = []
    export_bundle(ExportRequest(out=tmp_path / "b", backend="onnx", batch_sizes=[1, 2], steps=2, holdout=1,
                                progress=False),
                  adapter=builtin_adapter("tiny", seed=0), echo=lines.append)
    assert "checkpoint: 1 step(s)" in lines and "  checkpoint: written done" in lines
    at = lines.index("validate fp32: 2 step(s)")
    assert lines[at + 1:at + 3] == ["  validate fp32: b1 done", "  validate fp32: b2 done"]


def test_tensorrt_version_read_from_a_module_without_pip_metadata(tmp_path, monkeypatch):
    """JetPack installs TensorRT's Python bindings from an apt package, which may carry no pip
    metadata: the version then comes from the module itself, or every TensorRT bundle would be
    refused there as "TensorRT is not installed"."""
    import importlib.metadata as md
    import sys

    from phyai_edge.engines import bundle as bundle_mod

    def no_metadata(name):
        raise md.PackageNotFoundError(name)

    pkg = tmp_path / "site" / "tensorrt"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "10.3.0"\n')
    monkeypatch.setattr(md, "version", no_metadata)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "tensorrt", raising=False)
    try:
        assert bundle_mod._tensorrt_version() == "10.3.0"
    finally:
        sys.modules.pop("tensorrt", None)


def test_an_export_ended_by_sigterm_leaves_no_partial_folder(tmp_path, checkpoint):
    """systemd's stop or a CI timeout sends SIGTERM: the export ends through its clean-up, as with
    Ctrl-C, and no hidden half-written folder is left."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "engines" / "tiny"
    proc = subprocess.Popen([sys.executable, "-m", "phyai_edge", "export", "--checkpoint", str(checkpoint), "--out",
                             str(out), "--backend", "onnx", "--batch", "1,2", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    end = time.monotonic() + 120
    while not any(out.parent.glob(".tiny.partial-*")) and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.05)
    assert proc.poll() is None, "the export ended before it could be stopped: " + proc.stdout.read()[-2000:]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    assert not list(out.parent.glob(".tiny.partial-*")) and not out.exists()


def test_bench_on_a_bundle_reports_its_precision(bundle, capsys):
    """`bench --engine --json` says which bundle ran and at which precision (the manifest's, not
    --dtype's default), which `phyai-edge roofline --bench` reads."""
    assert cli(["bench", "--engine", str(bundle), "--iters", "1", "--warmup", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bundle"] == str(bundle) and report["precision"] == "fp32"


def test_bench_takes_a_bundle_s_floors_at_its_own_precision(bundle, capsys):
    """The floors were taken at --dtype's peak: an fp32 bundle benched with --dtype bfloat16 was
    compared with bf16 floors it never ran at. The table has no fp32 peak, so now it says so."""
    assert cli(["bench", "--engine", str(bundle), "--dtype", "bfloat16", "--floor-device", "h200", "--iters", "1",
                "--warmup", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "float32" and report["floors"] == {}
    assert "the table has no float32 peak" in report["floor_note"]
