"""A user's common mistakes get one line naming what is wrong (exit status 2), not a traceback:
a checkpoint folder that does not exist or holds no checkpoint, an unknown preset / backend /
dtype / adapter, a device torch cannot use here, a bundle exported from another checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from phyai_edge.cli import main as cli
from phyai_edge.engines.device import device_problem


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str | None, str]:
    """Exit status and stderr of one command; `fail` ends a command with SystemExit, as argparse does."""
    try:
        rc: int | str | None = cli(args)
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


def one_line(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"phyai-edge {command}: "), err
    return lines[0]


@pytest.fixture
def cpu_only_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """This torch as a CPU-only build would be, whatever the machine has."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--checkpoint", "{tmp}/nowhere"], "checkpoint folder not found: {tmp}/nowhere"),
        (["--checkpoint", "{tmp}"], "is not a PI0.5 checkpoint folder I know"),
        (["--preset", "huge"], "unknown PI0.5 preset 'huge'"),
        (["--preset", "huge", "--device", "meta"], "unknown PI0.5 preset 'huge'"),
        (["--backend", "foo"], "unknown backend 'foo'"),
        (["--dtype", "float8"], "unknown dtype 'float8'"),
        (["--adapter", "pi99"], "unknown adapter 'pi99'"),
        (["--engine", "{tmp}"], "has no manifest.json: not an engine bundle"),
        (["--device", "gpu"], "--device gpu: not a device; expected cpu, cuda, cuda:N or meta"),
        (["--batch", "0"], "--batch 0: expected an integer >= 1"),
        (["--floor-device", "foo"], "--floor-device: unknown device 'foo'"),
        (["--views", "9"], "--views 9: expected 1 to 3 for this model"),
        (["--views", "0"], "--views 0: expected an integer >= 1"),  # timed every camera
        (["--prompt-tokens", "-5"], "--prompt-tokens -5: expected an integer >= 1"),  # a traceback
        (["--threads", "-1"], "--threads -1: expected an integer >= 0"),  # a traceback
        # SystemExit(text): exit 1 and no command name, unlike every other usage error here
        (["--fp8", "expert"], "--fp8 / --fp8-scales need --backend cudagraph (got --backend eager)"),
        (["--device", "meta", "--engine", "{tmp}"], "--device meta counts a checkpoint's or preset's parameters"),
    ],
)
def test_bench_names_the_mistake(args: list[str], expected: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    args = [a.format(tmp=tmp_path) for a in args]
    rc, err = run(["bench", *args, "--iters", "1", "--warmup", "0"], capsys)
    assert rc == 2
    assert expected.format(tmp=tmp_path) in one_line(err, "bench")


def test_cuda_on_a_cpu_only_torch(cpu_only_torch: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["bench"], ["eval", str(tmp_path)], ["serve", "--duration", "0.1"]):
        rc, err = run([*command, "--device", "cuda"], capsys)
        assert rc == 2
        assert "--device cuda: this torch" in one_line(err, command[0]) and "CPU-only build" in err
    # The export checks before it exports anything (not at validation, after every stage).
    out = tmp_path / "bundle"
    rc, err = run(["export", "--preset", "tiny", "--out", str(out), "--device", "cuda:0", "--no-progress"], capsys)
    assert rc == 2 and "--device cuda:0: this torch" in one_line(err, "export")
    assert not out.exists()
    rc, err = run(["eval", str(tmp_path), "--reference-device", "cuda"], capsys)
    assert rc == 2 and one_line(err, "eval").startswith("phyai-edge eval: --reference-device cuda: ")


def test_device_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    assert device_problem("cpu") is None
    assert device_problem("meta", allow_meta=True) is None
    assert "not supported" in (device_problem("meta") or "")
    assert "not supported" in (device_problem("mps") or "")
    assert "not a device" in (device_problem("cuda:x") or "")
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "has CUDA 12.6 but sees no GPU" in (device_problem("cuda") or "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_problem("cuda") is None and device_problem("cuda:1") is None
    assert device_problem("cuda:2", flag="--device") == "--device cuda:2: this machine has 2 GPU(s) (cuda:0 .. cuda:1)"


def test_eval_and_serve_name_the_mistake(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run(["eval", str(tmp_path), "--checkpoint", str(tmp_path / "nowhere")], capsys)
    assert rc == 2 and "checkpoint folder not found" in one_line(err, "eval")
    rc, err = run(["eval", str(tmp_path), "--reference-backend", "foo"], capsys)
    assert rc == 2 and "unknown backend 'foo'" in one_line(err, "eval")
    rc, err = run(["serve", "--preset", "huge", "--duration", "0.1"], capsys)
    assert rc == 2 and "unknown PI0.5 preset 'huge'" in one_line(err, "serve")


def test_a_bundle_from_another_checkpoint_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("onnxruntime")
    from phyai_edge.adapters.pi05 import builtin_adapter, save_native

    mine = save_native(builtin_adapter("tiny", seed=0), tmp_path / "mine")
    other = save_native(builtin_adapter("tiny", seed=1), tmp_path / "other")
    bundle = tmp_path / "bundle"
    assert cli(["export", "--checkpoint", str(mine), "--out", str(bundle), "--steps", "2", "--no-validate",
                "--no-progress"]) == 0
    capsys.readouterr()
    rc, err = run(["bench", "--engine", str(bundle), "--checkpoint", str(other), "--iters", "1", "--warmup", "0"],
                  capsys)
    assert rc == 2 and "checkpoint hash differs" in one_line(err, "bench") and str(other) in err
    rc, err = run(["eval", str(tmp_path), "--engine", str(bundle), "--checkpoint", str(other)], capsys)
    assert rc == 2 and "checkpoint hash differs" in one_line(err, "eval")
    # Its own checkpoint is accepted.
    assert cli(["bench", "--engine", str(bundle), "--checkpoint", str(mine), "--iters", "1", "--warmup", "0"]) == 0


def test_output_paths_are_checked_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      restored_logging: None) -> None:
    """A summary or recording that cannot be written is refused at once: after a run it would be
    the run's record lost (and for `run`, after the model's load and warm-up)."""
    missing = tmp_path / "no" / "such" / "s.json"
    rc, err = run(["run", "--duration", "1", "--summary", str(missing)], capsys)
    assert rc == 2 and f"--summary {missing}: the folder {missing.parent} does not exist" in one_line(err, "run")
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc, err = run(["run", "--duration", "1", "--record", str(blocker / "rec")], capsys)
    assert rc == 2 and f"--record {blocker / 'rec'}: cannot make this folder" in one_line(err, "run")
    rc, err = run(["listen", "--json", str(missing)], capsys)
    assert rc == 2 and "--json" in one_line(err, "listen")
    # Before asking: the daemon took the instruction, then the reply's write was a traceback (exit 1: "refused").
    rc, err = run(["task", "fold the towel", "--endpoint", "tcp://127.0.0.1:9", "--timeout", "0.3", "--json",
                   str(missing)], capsys)
    assert rc == 2 and f"--json {missing}: the folder {missing.parent} does not exist" in one_line(err, "task")
    rc, err = run(["sim", "--report", str(tmp_path / "none.npz")], capsys)
    assert rc == 2 and "--report" in one_line(err, "sim")


def test_bench_on_meta_counts_the_checkpoint_it_is_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--device meta` ignored --checkpoint: it printed the preset's count (a missing folder too)."""
    from phyai_edge.adapters.pi05 import builtin_adapter, save_native

    ckpt = save_native(builtin_adapter("tiny", seed=0), tmp_path / "ckpt")
    assert cli(["bench", "--device", "meta", "--preset", "full", "--checkpoint", str(ckpt), "--json"]) == 0
    counted = json.loads(capsys.readouterr().out)
    assert counted["preset"] == "checkpoint" and counted["params"] < 10**6, counted  # tiny's, not full's 3.35e9
    rc, err = run(["bench", "--device", "meta", "--checkpoint", str(tmp_path / "nowhere")], capsys)
    assert rc == 2 and "checkpoint folder not found" in one_line(err, "bench")


def test_bench_refuses_no_timed_calls(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run(["bench", "--iters", "0"], capsys)
    assert rc == 2 and "--iters 0: expected an integer >= 1" in one_line(err, "bench")


def test_listen_names_an_endpoint_zeromq_cannot_parse(capsys: pytest.CaptureFixture[str],
                                                      restored_logging: None) -> None:
    rc, err = run(["listen", "--endpoint", "localhost:5555", "--duration", "1"], capsys)
    assert rc == 2 and "--endpoint 'localhost:5555'" in one_line(err, "listen")


def test_json_output_has_no_nan() -> None:
    """JSON has no NaN: an empty run's percentiles are null, which every parser reads."""
    import json

    from phyai_edge.commands.common import json_text

    text = json_text({"p50": float("nan"), "rows": [1.0, float("inf")], "n": 3})
    assert json.loads(text) == {"p50": None, "rows": [1.0, None], "n": 3}
    assert "NaN" not in text and "Infinity" not in text


def test_a_folder_of_pickles_says_why_it_is_not_loaded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    rc, err = run(["bench", "--checkpoint", str(tmp_path), "--iters", "1", "--warmup", "0"], capsys)
    line = one_line(err, "bench")
    assert rc == 2 and "pytorch_model.bin: pickled weights are never loaded" in line and "safetensors" in line


@pytest.mark.parametrize(("args", "expected"), [
    (["--seed", "99999999999"], "--seed 99999999999: expected 0 to 2147483647"),
    (["--batch-sizes", "0"], "--batch-sizes '0': every size must be at least 1"),
    (["--batch-sizes", "a,b"], "--batch-sizes 'a,b': expected sizes like 1,2,4,8"),
])
def test_eval_names_a_bad_flag_before_loading(args: list[str], expected: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run(["eval", "--synthetic", str(tmp_path / "rec"), *args], capsys)
    assert rc == 2 and expected in one_line(err, "eval")


def test_eval_says_a_file_is_not_a_recording_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "afile"
    f.write_text("")
    rc, err = run(["eval", str(f)], capsys)
    assert rc == 2 and "is a file; expected a `phyai-edge run --record` folder" in one_line(err, "eval")


def test_an_unknown_log_level_in_the_environment_is_named(monkeypatch, capsys):
    """PHYAI_EDGE_LOG_LEVEL is --log-level's default, which argparse never checks against its
    choices: "verbose" crashed the start with a traceback (exit 1, restarted by systemd)."""
    monkeypatch.setenv("PHYAI_EDGE_LOG_LEVEL", "verbose")
    rc, err = run(["run", "--duration", "0.1", "--no-realtime"], capsys)
    assert rc == 2
    assert one_line(err, "run") == "phyai-edge run: PHYAI_EDGE_LOG_LEVEL='verbose': expected one of debug, info, warning, error"


def test_eval_refuses_lerobot_frame_selection_on_a_recording(tmp_path, capsys):
    """--episodes, --max-frames and --stride select frames of a LeRobot dataset; on a recording they
    were accepted and ignored, and the whole recording ran."""
    rc, err = run(["eval", str(tmp_path / "rec"), "--max-frames", "3", "--stride", "2"], capsys)
    assert rc == 2
    assert one_line(err, "eval").endswith("--max-frames, --stride: select frames of a LeRobot dataset (--lerobot) "
                                          "only; a recording is evaluated whole")


@pytest.mark.parametrize("command", ["run", "listen", "serve", "sim"])
@pytest.mark.parametrize("value", ["-1", "inf", "nan"])
def test_a_duration_that_is_no_number_of_seconds_is_refused_before_loading(capsys, command, value):
    """argparse's float takes "inf" and "nan": `run` loaded and warmed the model, then died in the
    clock arithmetic without sending its SHUTDOWN message."""
    rc, err = run([command, "--duration", value], capsys)
    assert rc == 2
    assert one_line(err, command) == (f"phyai-edge {command}: --duration {float(value):g}: expected a finite number "
                                      "of seconds >= 0 (0: until stopped)")


@pytest.mark.parametrize(("argv", "says"), [
    (["eval", "rec", "--batch", "0"], "--batch 0: expected an integer >= 1"),  # evaluated nothing, scored perfect
    (["eval", "rec", "--stride", "0"], "--stride 0: expected an integer >= 1"),
    (["bench", "--steps", "0"], "--steps 0: expected an integer >= 1"),  # ran the model's 10
    (["roofline", "--device", "orin", "--rate", "0"], "--rate 0: expected a finite number > 0"),  # analysed 50 Hz
    (["roofline", "--device", "orin", "--horizon", "0"], "--horizon 0: expected an integer >= 1"),
    (["roofline", "--device", "orin", "--stat", "p42"], "--stat p42: expected one of p50, p90"),  # used p50
    (["serve", "--max-batch", "0"], "--max-batch 0: expected an integer >= 1"),  # started and served
    (["serve", "--window-ms", "nan"], "--window-ms nan: expected a finite number of milliseconds >= 0"),
    (["export", "--out", "b", "--steps", "0"], "--steps 0: expected an integer >= 1"),
    (["listen", "--count", "0"], "--count 0: expected an integer >= 1"),  # ran on, past the daemon's SHUTDOWN
    (["listen", "--count", "-1"], "--count -1: expected an integer >= 1"),  # stopped at the first message
    (["listen", "--priority", "-5"], "--priority -5: expected an integer >= 0"),  # ran unprioritised
    (["listen", "--print", "--json", "-"], "--print and --json - both write to stdout"),
    (["task", "--timeout", "inf"], "--timeout inf: expected a finite number > 0"),  # ZeroMQ's traceback, exit 1
    (["task", "--timeout", "nan"], "--timeout nan: expected a finite number > 0"),
    (["task", "--timeout", "1e30"], "--timeout 1e+30: expected at most 3600 seconds"),  # overflowed ZeroMQ's poll
])
def test_a_count_or_rate_out_of_range_is_refused_naming_the_flag(capsys, argv, says):
    """Zeros became the default without a word (`args.x or default`), or ran to a wrong result."""
    rc, err = run(argv, capsys)
    assert rc == 2
    assert one_line(err, argv[0]).startswith(f"phyai-edge {argv[0]}: {says}")


def test_a_reader_that_stops_early_is_not_a_traceback(tmp_path):
    """`phyai-edge roofline ... | head` printed a BrokenPipeError traceback and exited 1."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "phyai_edge", "roofline", "--device", "all", "--rate", "50",
                             "--horizon", "50", "--no-plot"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=tmp_path)
    assert proc.stdout is not None and proc.stdout.readline()  # the first line, then the reader goes away
    proc.stdout.close()
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert proc.wait(60) == 0 and "Traceback" not in err, err


@pytest.mark.parametrize("value", ["-1", "inf", "nan"])
def test_a_record_disk_floor_that_is_no_size_is_refused_before_loading(capsys, value):
    rc, err = run(["run", "--record-min-free-gb", value], capsys)
    assert rc == 2
    assert one_line(err, "run") == (f"phyai-edge run: --record-min-free-gb {float(value):g}: expected a finite "
                                    "number of GB >= 0 (0: no floor)")
