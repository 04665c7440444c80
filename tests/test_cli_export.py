"""`phyai-edge export`'s progress: bars on a terminal, plain lines in a log file or the journal."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from phyai_edge.cli import main as cli

pytest.importorskip("onnxruntime")
pytest.importorskip("tqdm")

ARGS = ["export", "--preset", "tiny", "--steps", "2", "--no-validate"]


def test_progress_is_a_line_per_step_off_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert not sys.stderr.isatty()  # captured: what a redirect to a file or journald looks like
    assert cli([*ARGS, "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr()
    assert "\r" not in out.err and "\r" not in out.out  # no bar redraws
    assert "onnx b1 fp32: 3 step(s)" in out.out and "  onnx b1 fp32: denoise_step done" in out.out


def test_progress_bars_on_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli([*ARGS, "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr()
    assert "onnx b1 fp32" in out.err and "\r" in out.err  # tqdm's bar, redrawn in place
    assert "step(s)" not in out.out
    # --no-progress wins on a terminal too.
    assert cli([*ARGS, "--out", str(tmp_path / "c"), "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "\r" not in out.err and "onnx b1 fp32: 3 step(s)" in out.out


def test_ctrl_c_is_one_line_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C cleaned up (no half-written folder) but ended in a KeyboardInterrupt traceback."""
    import phyai_edge.engines.exporter as exporter

    def interrupted(req):
        raise KeyboardInterrupt

    monkeypatch.setattr(exporter, "export_bundle", interrupted)
    out = tmp_path / "b"
    assert cli(["export", "--preset", "tiny", "--out", str(out), "--no-progress"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"phyai-edge export: interrupted; {out} is left as it was"]
