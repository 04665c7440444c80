"""`phyai-edge eval` with an exported bundle: its calls are padded to the sizes it was built for."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from phyai_edge.cli import main as cli

pytest.importorskip("onnxruntime")


def _bundle_and_recording(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str,
                          *export_flags: str) -> tuple[Path, Path]:
    """A tiny ONNX bundle exported with `export_flags`, and a synthetic recording to evaluate."""
    bundle = tmp_path / name
    assert cli(["export", "--preset", "tiny", *export_flags, "--out", str(bundle), "--no-validate",
                "--no-progress"]) == 0
    data = tmp_path / "rec"
    assert cli(["eval", str(data), "--synthetic"]) == 0
    capsys.readouterr()
    return bundle, data


def _reports_both_ways(data: Path, bundle: Path, capsys: pytest.CaptureFixture[str]) -> list[dict]:
    """eval's JSON report with the bundle as the engine, then as the reference."""
    reports = []
    for args in (["--engine", str(bundle), "--reference-backend", "eager"], ["--reference-engine", str(bundle)]):
        assert cli(["eval", str(data), *args, "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    return reports


def test_eval_runs_a_bundle_at_its_exported_batch_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    bundle, data = _bundle_and_recording(tmp_path, capsys, "tiny-onnx", "--batch", "1,2")
    # The default --batch (8 frames a call) is larger than any size the bundle has: the calls
    # must be split and padded to 1 or 2, not sent at 8, fail, and rerun one frame at a time.
    with caplog.at_level(logging.WARNING):
        for rep in _reports_both_ways(data, bundle, capsys):
            assert rep["overall"]["frames"] == 8 and rep["overall"]["failures"] == 0
            assert rep["overall"]["reference_max"] < 1e-3  # the same model and noise on both sides
    assert not [r for r in caplog.records if "running them one by one" in r.getMessage()]


def test_the_engine_compared_with_a_bundle_runs_the_bundles_weights(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`--engine B --reference-backend eager` without --checkpoint: the reference loaded the
    built-in preset with eval's own seed, not the weights B was exported from, and the
    reference column was the difference of two models. It now loads what B's manifest names."""
    bundle, data = _bundle_and_recording(tmp_path, capsys, "tiny-seed3", "--seed", "3", "--batch", "1,2")
    for rep in _reports_both_ways(data, bundle, capsys):
        assert rep["overall"]["failures"] == 0 and rep["overall"]["reference_max"] < 1e-3
    # other weights named on the command line are refused: the reference column would be the
    # difference of two models (it ran, and read 1e-1 as the engines' difference)
    with pytest.raises(SystemExit) as exit_:
        cli(["eval", str(data), "--engine", str(bundle), "--reference-backend", "eager", "--preset", "tiny",
             "--json"])
    assert exit_.value.code == 2
    assert "was exported from the preset tiny at seed 3" in capsys.readouterr().err
    assert cli(["eval", str(data), "--engine", str(bundle), "--reference-backend", "eager", "--preset", "tiny",
                "--seed", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["overall"]["reference_max"] < 1e-3


def test_the_engine_compared_with_a_bundle_runs_its_flow_steps(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A bundle exported with --steps 3 was compared with an eager reference at the preset's 10
    steps: 0.18 mean difference, reported as the engines'."""
    bundle, data = _bundle_and_recording(tmp_path, capsys, "tiny-3-steps", "--steps", "3")
    for rep in _reports_both_ways(data, bundle, capsys):
        assert rep["overall"]["reference_max"] < 1e-3


def test_batch_sizes_a_bundle_lacks_are_one_line_before_anything_runs(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`bench --engine B --batch 4` on a batch-1 bundle ended in the engine's traceback; `eval
    --batch-sizes 4` ran, failed every call, and every frame again alone (exit 1)."""
    bundle, data = _bundle_and_recording(tmp_path, capsys, "tiny-b1")
    for argv, says in ((["bench", "--engine", str(bundle), "--batch", "4"],
                        "--batch 4: the engine bundle .* was exported for batch sizes 1"),
                       (["eval", str(data), "--engine", str(bundle), "--batch", "4", "--batch-sizes", "4"],
                        "--batch-sizes 4: the engine bundle takes batch sizes 1 only")):
        with pytest.raises(SystemExit) as exit_:
            cli(argv)
        assert exit_.value.code == 2
        assert re.search(says, capsys.readouterr().err), argv
