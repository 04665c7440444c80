"""`phyai-edge eval REC` replays a daemon recording through the model that made it: meta.json
names it (checkpoint, bundle or preset, adapter options), so a plain `eval REC` does not
quietly compare the robot's chunks with the tiny built-in model's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from phyai_edge.cli import main as cli
from phyai_edge.control.daemon import Daemon
from phyai_edge.control.fakes import run_ticks, test_config


def _record(root: Path, **model) -> Path:
    cfg = test_config(model={"worker": "thread", "warmup": 1, **model},
                      chunking={"mode": "guided-approx", "execution_horizon": 25, "delay_initial": 3})
    run_ticks(Daemon(cfg, record_dir=str(root), realtime=False, status_line=False), 120)
    return root


@pytest.fixture(scope="module")
def relative(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A recording of the tiny model run with an adapter option that changes its actions."""
    return _record(tmp_path_factory.mktemp("rec") / "relative",
                   adapter_options={"relative_actions": "6,-1,6,-1"}, noise_seed=3)


@pytest.mark.slow
def test_eval_replays_through_the_recordings_model(relative: Path, capsys: pytest.CaptureFixture[str]) -> None:
    meta = json.loads((relative / "meta.json").read_text())
    assert meta["model"]["adapter_options"] == {"relative_actions": "6,-1,6,-1"} and meta["model"]["preset"] == "tiny"
    assert cli(["eval", str(relative), "--batch", "1", "--json"]) == 0
    out = capsys.readouterr()
    rep = json.loads(out.out)
    assert rep["overall"]["recorded_noise"] == rep["overall"]["frames"] >= 2
    # the thread worker ran at this process's torch threads: the same arithmetic, to the bit
    assert rep["overall"]["recorded_max"] == 0.0
    assert "the model the recording's daemon ran: built-in preset tiny" in out.err
    assert "adapter options relative_actions=6,-1,6,-1" in out.err
    # a model chosen on the command line is the one replayed (here: without the option, far off)
    assert cli(["eval", str(relative), "--batch", "1", "--preset", "tiny", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["overall"]["recorded_max"] > 1e-2 and "recording's daemon ran" not in out.err


@pytest.mark.slow
def test_a_recorded_model_eval_cannot_build_is_refused_by_name(relative: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    def variant(name: str, **model) -> Path:
        d = tmp_path / name
        shutil.copytree(relative, d)
        meta = json.loads((d / "meta.json").read_text())
        meta["model"].update(model)
        (d / "meta.json").write_text(json.dumps(meta))
        return d

    gone = variant("gone", checkpoint="/nonexistent/ckpt/pi05")
    with pytest.raises(SystemExit):
        cli(["eval", str(gone)])
    assert "the recording's model.checkpoint /nonexistent/ckpt/pi05 is not on this machine" in capsys.readouterr().err
    factory = variant("factory", factory="my_robot.policies:make")
    with pytest.raises(SystemExit):
        cli(["eval", str(factory)])
    assert "model.factory 'my_robot.policies:make', which eval cannot rebuild" in capsys.readouterr().err
    both = tmp_path / "both"
    both.mkdir()
    shutil.copytree(relative, both / "a")
    shutil.copytree(variant("plain", adapter_options={}), both / "b")
    with pytest.raises(SystemExit):
        cli(["eval", str(both)])
    assert "a and b were recorded with different models (model.adapter_options" in capsys.readouterr().err


def test_a_recording_made_through_a_bundle_says_the_bundle_s_engine_and_precision(tmp_path: Path) -> None:
    """The daemon of an int8 ONNX bundle recorded backend eager and dtype float32: the config's
    defaults, which a bundle does not use."""
    from phyai_edge.control.daemon import recorded_model
    from phyai_edge.engines.bundle import seal

    folder = tmp_path / "b"
    folder.mkdir()
    manifest = seal({"format": "phyai-edge/bundle/1", "backend": "onnxruntime", "dtype": "float32",
                     "precision": {"encode_prefix": "int8", "denoise_step": "int8"}, "checkpoint": {},
                     "files": {"x": {}}, "batch_sizes": [1]})
    (folder / "manifest.json").write_text(json.dumps(manifest))
    m = recorded_model(test_config(model={"bundle": str(folder)}))
    assert (m["backend"], m["dtype"], m["precision"]) == ("onnxruntime", "float32", "int8")
    assert "precision" not in recorded_model(test_config())
