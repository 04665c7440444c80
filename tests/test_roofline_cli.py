"""`phyai-edge roofline` end to end: table, PNG and JSON in a temporary directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phyai_edge.cli import main

# The bench schema docs/roofline.md documents (one H200 run, milliseconds).
BENCH = {
    "adapter": "pi05",
    "preset": "full",
    "backend": "cudagraph",
    "device": "cuda",
    "gpu": "NVIDIA H200",
    "dtype": "bfloat16",
    "batch": 1,
    "views": 3,
    "steps": 10,
    "stages": {
        "embed_images": {"p50_ms": 2.0, "p90_ms": 2.5},
        "encode_prefix": {"p50_ms": 8.0, "p90_ms": 9.0},
        "denoise_step": {"p50_ms": 0.9, "p90_ms": 1.0},
        "preprocess": {"p50_ms": 1.5},
        "postprocess": {"p50_ms": 0.2, "p90_ms": 0.3},
    },
}


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["roofline", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_predict_two_devices_png_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, js = tmp_path / "r.png", tmp_path / "r.json"
    rc, out, _ = run(
        [
            "--device",
            "orin",
            "--device",
            "rtx-pro-6000",
            "--rate",
            "50",
            "--horizon",
            "50",
            "--plot",
            str(png),
            "--json",
            str(js),
        ],
        capsys,
    )
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    report = json.loads(js.read_text())
    orin, pro = report["points"]
    assert orin["device"] == "jetson-agx-orin-64gb" and pro["device"] == "rtx-pro-6000"
    assert report["robot"]["horizon"] == 50 and report["robot"]["s_cap"] == 25
    assert orin["result"]["delay_ticks"] > pro["result"]["delay_ticks"] >= 1
    assert orin["stage_times_ms"]["latency_ms"] > 5 * pro["stage_times_ms"]["latency_ms"]
    assert set(orin["stages"]) == {"embed_images", "encode_prefix", "denoise_step"}
    assert orin["stages"]["denoise_step"]["bound"] == "memory"
    assert "Jetson AGX Orin" in out and "binds" in out and "per-stage prediction" in out


def test_bench_point_calibrates_predictions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = tmp_path / "h200.json"
    bench.write_text(json.dumps(BENCH))
    rc, out, _ = run(
        ["--bench", str(bench), "--device", "h200", "--stat", "p50", "--no-plot", "--json", "-"], capsys
    )
    assert rc == 0
    report = json.loads(out)  # --json - prints only JSON
    assert "calibrated" in report["efficiency"]["source"]
    measured, predicted = report["points"]
    assert measured["kind"] == "measured" and predicted["kind"] == "predicted"
    # Calibrated on the same device and shape, the prediction reproduces the measured model stages.
    m, p = measured["stage_times_ms"], predicted["stage_times_ms"]
    for key in ("vision_ms", "prefix_ms", "denoise_step_ms"):
        assert p[key] == pytest.approx(m[key], rel=0.35), key
    assert m["preprocess_ms"] == pytest.approx(1.5)


def test_what_if_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def total(*flags: str) -> float:
        rc, out, _ = run(["--device", "thor", "--no-plot", "--json", "-", *flags], capsys)
        assert rc == 0
        return json.loads(out)["points"][0]["stage_times_ms"]["latency_ms"]

    base = total()
    assert total("--steps", "5") < base
    assert total("--views", "1") < base
    assert total("--precision", "fp8") < base
    assert total("--batch", "4") > base
    assert total("--transport-ms", "30") == pytest.approx(base + 30)

    rc, out, _ = run(["--device", "orin", "--precision", "fp8", "--no-plot"], capsys)
    assert rc == 0 and "skipped, no fp8" in out

    # s = 5 < d (13 on Orin): the daemon replans back to back every d ticks, and the rate holds
    rc, out, _ = run(["--device", "orin", "--exec-horizon", "5", "--no-plot", "--json", "-"], capsys)
    r = json.loads(out)["points"][0]["result"]
    assert not r["d_le_s"] and r["rtc_ok"] and r["binding"] == "physical"
    # s = 45 > H - d: the chunk runs out before the next one lands
    rc, out, _ = run(["--device", "orin", "--exec-horizon", "45", "--no-plot", "--json", "-"], capsys)
    r = json.loads(out)["points"][0]["result"]
    assert not r["rtc_ok"] and r["binding"] == "inference"


def test_bench_what_if_rescales_measured_stages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = tmp_path / "h200.json"
    bench.write_text(json.dumps(BENCH))
    rc, out, _ = run(
        ["--bench", str(bench), "--views", "1", "--stat", "p50", "--no-plot", "--json", "-"], capsys
    )
    assert rc == 0
    m = json.loads(out)["points"][0]["stage_times_ms"]
    assert m["vision_ms"] < 2.0 and m["prefix_ms"] < 8.0  # fewer views: cheaper vision and prefix


def test_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(["--bench", str(tmp_path / "missing.json"), "--no-plot"], capsys)
    assert rc == 2 and "error" in err
    rc, _, err = run(["--device", "tpu", "--no-plot"], capsys)
    assert rc == 2 and "unknown device" in err
    rc, _, err = run(["--device", "h200", "--exec-horizon", "60", "--no-plot"], capsys)
    assert rc == 2 and "exec_horizon" in err
    rc, out, _ = run(["--list-devices"], capsys)
    assert rc == 0 and "h200-sxm" in out and "sparse" in out


@pytest.mark.slow
def test_real_bench_output_feeds_roofline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The JSON `phyai-edge bench --json` really writes (tiny model, CPU) parses and plots."""
    pytest.importorskip("torch")
    assert main(["bench", "--preset", "tiny", "--json", "--iters", "1", "--warmup", "0"]) == 0
    bench = tmp_path / "tiny.json"
    bench.write_text(capsys.readouterr().out)
    png = tmp_path / "tiny.png"
    rc, out, _ = run(["--bench", str(bench), "--plot", str(png), "--json", "-"], capsys)
    assert rc == 0 and png.exists()
    report = json.loads(out)
    (point,) = report["points"]
    t = point["stage_times_ms"]
    assert (
        point["kind"] == "measured" and t["vision_ms"] > 0 and t["prefix_ms"] > 0 and t["denoise_step_ms"] > 0
    )
    assert t["preprocess_ms"] > 0 and t["steps"] == 10
    # float32 on a CPU is not a modelled precision: reported, and the default efficiency is kept.
    assert report["efficiency"]["source"].startswith("default")
    assert any("float32" in n for n in report["notes"])


def test_without_matplotlib_the_table_still_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A robot computer often has no matplotlib: the table is the answer, the chart is optional;
    asking for a chart explicitly says what to install."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.chdir(tmp_path)
    rc, out, _ = run(["--device", "orin"], capsys)
    assert rc == 0 and "Jetson AGX Orin" in out
    assert "no chart: matplotlib is not installed" in out
    assert not (tmp_path / "roofline.png").exists()
    with pytest.raises(SystemExit, match=r"--plot needs matplotlib"):
        run(["--device", "orin", "--plot", str(tmp_path / "x.png")], capsys)


def test_bench_prints_each_stage_floor(capsys: pytest.CaptureFixture[str]) -> None:
    """`phyai-edge bench --floor-device` puts each model stage's floor (the adapter's FLOP / byte
    count at the device's peaks) beside the measured time, in the table and in the JSON."""
    pytest.importorskip("torch")
    from phyai_edge.adapters.pi05.config import preset
    from phyai_edge.roofline.costs import stage_costs
    from phyai_edge.roofline.devices import find_device
    from phyai_edge.roofline.predict import stage_floors

    args = ["bench", "--preset", "tiny", "--dtype", "bfloat16", "--iters", "1", "--warmup", "0", "--floor-device", "h200"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["floor_device"] == "H200 SXM"
    want = stage_floors(stage_costs("pi05", preset("tiny"), batch=1, views=report["views"], prompt_tokens=48, steps=10),
                        find_device("h200"), "bf16")
    assert set(report["floors"]) == {"embed_images", "encode_prefix", "denoise_step", "solver_loop"}
    for stage, f in report["floors"].items():
        assert f["floor_ms"] == pytest.approx(want[stage].time_s * 1e3) and f["bound"] == want[stage].bound
    assert report["floors"]["solver_loop"]["floor_ms"] == pytest.approx(10 * report["floors"]["denoise_step"]["floor_ms"])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "floor ms" in out and "floor/p50" in out and "floors on H200 SXM: peaks from the device table" in out
    row = next(line for line in out.splitlines() if line.startswith("denoise_step"))
    assert row.split()[-2] == want["denoise_step"].bound


def test_bench_floors_say_why_not(capsys: pytest.CaptureFixture[str]) -> None:
    """No floors where the table has no peak for the precision: the reason is printed, the timings
    are not affected; on a CPU run nothing is asked for. An unknown device is refused before the
    run (a typo would otherwise cost a whole benchmark), naming the ones the table has."""
    pytest.importorskip("torch")
    base = ["bench", "--preset", "tiny", "--iters", "1", "--warmup", "0"]
    assert main([*base, "--floor-device", "orin"]) == 0  # float32
    out = capsys.readouterr().out
    assert "floor ms" not in out and "the table has no float32 peak" in out
    with pytest.raises(SystemExit) as exc:
        main([*base, "--floor-device", "no-such-gpu", "--json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--floor-device: unknown device 'no-such-gpu'" in err and "h200-sxm" in err
    assert main([*base, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["floor_device"] is None and report["floors"] == {}


def test_a_float32_bench_is_noted_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A CPU float32 bench (`phyai-edge bench --json` on a laptop) is not used to calibrate: one
    note says why, and the header names the default efficiency without nested parentheses."""
    bench = tmp_path / "cpu.json"
    bench.write_text(json.dumps({**BENCH, "device": "cpu", "gpu": None, "dtype": "float32"}))
    rc, out, _ = run(["--bench", str(bench), "--device", "orin", "--no-plot"], capsys)
    assert rc == 0
    notes = out.split("notes:", 1)[1].splitlines()
    assert sum("calibrat" in n for n in notes) == 1, notes
    assert "efficiency compute 0.50, bandwidth 0.70, default (0.5 of peak FLOPs" in out and "((" not in out


def test_camera_age_is_staleness_not_part_of_d(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/roofline.md section 4's example (33 ms camera age, 10 / 1 / 1 ms pre, post, transport):
    the daemon's d counts from the inference's start tick, so the frame's age is not in L. Orin's
    L is 268.2 ms and d = 14 (the 2026-12-05 model said 301.2 ms and 16); the camera age comes back
    as the observation's age when the new chunk's first action runs, camera age + d x T."""
    flags = ["--device", "orin", "--device", "rtx-pro-6000", "--rate", "50", "--horizon", "50", "--preprocess-ms",
             "10", "--postprocess-ms", "1", "--transport-ms", "1", "--no-plot"]

    def points(*extra: str) -> list[dict]:
        rc, out, _ = run([*flags, "--json", "-", *extra], capsys)
        assert rc == 0
        return json.loads(out)["points"]

    fresh = points()
    orin, pro = points("--camera-age-ms", "33")
    for p, f, latency, d in ((orin, fresh[0], 268.2, 14), (pro, fresh[1], 35.0, 2)):
        r = p["result"]
        assert p["stage_times_ms"]["latency_ms"] == pytest.approx(latency, abs=0.05)
        assert r["latency_s"] * 1e3 == pytest.approx(latency, abs=0.05) and r["delay_ticks"] == d
        for key in ("delay_ticks", "achievable_rate_hz", "latency_headroom_s", "binding", "sync_rate_hz"):
            assert r[key] == pytest.approx(f["result"][key]), key
        assert p["stage_times_ms"]["camera_age_ms"] == pytest.approx(33.0)
        assert r["observation_age_s"] * 1e3 == pytest.approx(33.0 + d * 20.0)
    assert orin["result"]["latency_headroom_s"] * 1e3 == pytest.approx(231.8, abs=0.05)
    rc, out, _ = run([*flags, "--camera-age-ms", "33"], capsys)
    assert rc == 0 and "obs age ms" in out
    assert "the observation is 313 ms old when the new chunk's first action runs (camera age 33 ms" in out


def test_a_float32_bench_is_labelled_fp32_not_bf16(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`phyai-edge bench --json` on a float32 engine (its default --dtype) fed to `roofline --bench`:
    the point, the header and the JSON say fp32, never the bf16 default; the device table has no
    fp32 peaks, so it neither calibrates the predictions (made at bf16, and the header says so) nor
    gets rescaled by ratios of bf16 predictions under a what-if flag."""
    bench = tmp_path / "h200_fp32.json"
    bench.write_text(json.dumps({**BENCH, "dtype": "float32", "precision": None}))
    rc, out, _ = run(["--bench", str(bench), "--device", "h200", "--stat", "p50", "--no-plot", "--json", "-"], capsys)
    assert rc == 0
    report = json.loads(out)
    assert "fp32 measured, bf16 predicted" in report["title"]
    measured, predicted = report["points"]
    assert (measured["precision"], predicted["precision"]) == ("fp32", "bf16")
    assert "fp32" in measured["label"] and report["model"]["precision"] == "fp32"
    assert report["efficiency"]["source"].startswith("default") and report["calibration"] is None
    assert any("predictions at bf16" in n for n in report["notes"])

    rc, out, _ = run(["--bench", str(bench), "--stat", "p50", "--no-plot"], capsys)
    assert rc == 0
    header = out.splitlines()[0]
    assert "fp32" in header and "bf16" not in header

    rc, out, _ = run(["--bench", str(bench), "--precision", "fp8", "--stat", "p50", "--no-plot", "--json", "-"], capsys)
    assert rc == 0
    report = json.loads(out)
    (point,) = report["points"]
    assert point["precision"] == "fp32"
    t = point["stage_times_ms"]
    assert (t["vision_ms"], t["prefix_ms"], t["denoise_step_ms"]) == pytest.approx((2.0, 8.0, 0.9))
    assert any("what-if not applied" in n and "fp32" in n for n in report["notes"])


def _daemon_metrics(model: dict[str, str]) -> int:
    """The daemon's own Prometheus endpoint on a free local port, serving `model` as
    phyai_model_info and ten observations of three stages; returns the port."""
    pytest.importorskip("prometheus_client")
    from phyai_edge.control.metrics import Metrics
    from phyai_edge.sim.launch import free_port

    port = free_port()
    metrics = Metrics()
    assert metrics.serve("127.0.0.1", port, model)
    for _ in range(10):
        metrics.stage_seconds.labels("embed_images").observe(0.003)
        metrics.stage_seconds.labels("encode_prefix").observe(0.008)
        metrics.stage_seconds.labels("denoise_step").observe(0.0012)
    return port


def test_metrics_of_a_daemon_model_the_model_it_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """`--metrics` against the daemon's own endpoint: phyai_model_info decides preset, views,
    steps, precision and H, and its gpu label is the device the run calibrates on."""
    port = _daemon_metrics({"adapter": "pi05", "preset": "full", "backend": "cudagraph", "device": "cuda",
                            "gpu": "NVIDIA H200", "dtype": "bfloat16", "precision": "fp8", "views": "2",
                            "horizon": "30", "steps": "5"})
    rc, out, _ = run(["--metrics", f"127.0.0.1:{port}", "--no-plot", "--json", "-"], capsys)
    assert rc == 0
    report = json.loads(out)
    assert {k: report["model"][k] for k in ("preset", "views", "steps", "precision")} == {
        "preset": "full", "views": 2, "steps": 5, "precision": "fp8"}
    assert report["robot"]["horizon"] == 30
    assert "calibrated" in report["efficiency"]["source"]  # found "NVIDIA H200" in the device table


def test_metrics_give_the_rate_and_s_unless_the_flags_do(capsys: pytest.CaptureFixture[str]) -> None:
    """`--metrics` alone: the daemon's rate_hz and exec_horizon labels are the robot side the
    roofline analyses; `--rate` and `--exec-horizon` given on the command line win over them."""
    port = _daemon_metrics({"adapter": "pi05", "preset": "full", "device": "cuda", "gpu": "NVIDIA H200",
                            "dtype": "bfloat16", "views": "3", "horizon": "50", "steps": "10", "rate_hz": "30",
                            "exec_horizon": "12"})
    source = ["--metrics", f"127.0.0.1:{port}", "--no-plot", "--json", "-"]
    rc, out, _ = run(source, capsys)
    assert rc == 0
    report = json.loads(out)
    assert {k: report["robot"][k] for k in ("rate_hz", "horizon", "exec_horizon")} == {
        "rate_hz": 30.0, "horizon": 50, "exec_horizon": 12}
    assert report["points"][0]["result"]["exec_horizon"] == 12
    rc, out, _ = run([*source, "--rate", "50", "--exec-horizon", "20"], capsys)
    assert rc == 0
    robot = json.loads(out)["robot"]
    assert (robot["rate_hz"], robot["exec_horizon"], robot["control_period_ms"]) == (50.0, 20, pytest.approx(20.0))


def test_a_horizon_longer_than_the_model_s_chunk_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(["--device", "orin", "--horizon", "100", "--no-plot"], capsys)
    assert rc == 2 and "--horizon 100: longer than the model's chunk (50 actions)" in err


def fails(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line on stderr a refused command line ends with (exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        main(["roofline", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("phyai-edge roofline: ")
    return err


@pytest.mark.parametrize("flag", ["--camera-age-ms", "--preprocess-ms", "--postprocess-ms", "--transport-ms"])
@pytest.mark.parametrize("value", ["-1", "inf", "nan"])
def test_time_flags_must_be_finite_ms(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """-1 and nan crashed in StageTimes, inf in the ceiling of L / T: tracebacks, not a line."""
    err = fails(["--device", "orin", "--no-plot", flag, value], capsys)
    assert f"{flag} {value}: expected a finite number of milliseconds >= 0" in err


@pytest.mark.parametrize("flag", ["--efficiency-compute", "--efficiency-bandwidth"])
def test_efficiency_flags_are_named_when_out_of_range(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The line read `efficiency.compute must be in (0, 1.5]`, a field no flag is called."""
    err = fails(["--device", "orin", "--no-plot", flag, "2"], capsys)
    assert f"{flag} 2: expected a fraction of peak in (0, 1.5]" in err


def test_a_calibrate_file_that_cannot_calibrate_is_refused(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """--calibrate with an fp32 run (or one with no GPU) fell back to the default factors, the
    header saying `default`, with no word that the file asked for was not used."""
    fp32 = tmp_path / "fp32.json"
    fp32.write_text(json.dumps({**BENCH, "dtype": "float32"}))
    err = fails(["--device", "orin", "--no-plot", "--calibrate", str(fp32)], capsys)
    assert f"--calibrate {fp32}: no run in it can calibrate (precision fp32 not modelled)" in err
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({k: v for k, v in BENCH.items() if k not in ("gpu", "device")}))
    err = fails(["--device", "orin", "--no-plot", "--calibrate", str(cpu)], capsys)
    assert "no run in it can calibrate" in err and "no device in it" in err
    good = tmp_path / "h200.json"
    good.write_text(json.dumps(BENCH))
    rc, out, _ = run(["--device", "orin", "--no-plot", "--calibrate", str(good), "--json", "-"], capsys)
    assert rc == 0 and "calibrated" in json.loads(out)["efficiency"]["source"]


def test_outputs_that_cannot_be_written_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A --json or --plot under a plain file (not a folder) ended in an OSError traceback."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    err = fails(["--device", "orin", "--no-plot", "--json", str(blocker / "r.json")], capsys)
    assert f"--json {blocker / 'r.json'}: cannot write it" in err
    pytest.importorskip("matplotlib")
    err = fails(["--device", "orin", "--plot", str(blocker / "r.png")], capsys)
    assert f"--plot {blocker / 'r.png'}: cannot write it" in err


def test_a_schedule_with_no_ridge_still_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """s = H leaves s_cap = 0 (no delay fits, L* = 0): the chart's log axis started at 0 and
    numpy raised `Geometric sequence cannot include zero`."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "r.png"
    rc, out, _ = run(["--device", "orin", "--horizon", "50", "--exec-horizon", "50", "--plot", str(png)], capsys)
    assert rc == 0 and png.read_bytes()[:4] == b"\x89PNG"
    assert "inference binds: L = 256 ms > L* = 0 ms, so at most 0.0 Hz" in out


def test_a_zero_latency_run_with_no_ridge_has_a_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """H = 1 (L* = 0) with L = 0: the verdict divided L by L* (ZeroDivisionError)."""
    bench = tmp_path / "zero.json"
    bench.write_text(json.dumps({**BENCH, "stages": {"embed_images": 0.0}}))
    rc, out, _ = run(["--bench", str(bench), "--horizon", "1", "--no-plot", "--stat", "p50"], capsys)
    assert rc == 0 and "L = 0 ms is all of the ridge L* = 0 ms" in out


def test_a_bench_with_no_known_stage_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It was analysed as L = 0, physical-bound and feasible, the stages only `ignored` in notes."""
    bench = tmp_path / "odd.json"
    bench.write_text(json.dumps({**BENCH, "stages": {"vit": 2.0, "llm": 8.0}}))
    rc, _, err = run(["--bench", str(bench), "--no-plot"], capsys)
    assert rc == 2 and f"{bench}: bench run #0 has no stage time this tool recognises (stages: vit, llm" in err
