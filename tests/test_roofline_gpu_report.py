"""The committed H200 run (benchmarks/runs/pi05_gpu_2026-12-02.json, written by
benchmarks/pi05_gpu.py) read by the roofline: converted, placed on the chart, used to calibrate.
Every expected value is derived from the committed file, not copied from it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from phyai_edge.cli import main
from phyai_edge.roofline import gpu_report
from phyai_edge.roofline.costs import cost_model
from phyai_edge.roofline.devices import find_device
from phyai_edge.roofline.sources import load_bench, parse_bench

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "runs" / "pi05_gpu_2026-12-02.json"
SELECT = ("ablation.b1_compiled", "ours.b1_v3", "lerobot.b1_v3")
RAW = json.loads(RUN.read_text())


def raw(name: str) -> dict:
    section, key = name.split(".", 1)
    return RAW[section][key]


def test_report_is_recognised_and_every_timed_entry_converts() -> None:
    assert gpu_report.is_gpu_report(RAW)
    timed = [
        f"{s}.{k}"
        for s in gpu_report.SECTIONS
        for k, e in RAW.get(s, {}).items()
        if isinstance(e, dict) and "p50" in e
    ]
    runs = gpu_report.to_bench_runs(RAW)
    assert [r["key"] for r in runs] == timed
    assert len(parse_bench(RAW)) == len(timed)


def test_prompt_tokens_solved_from_the_reports_floors() -> None:
    p = gpu_report.solve_prompt_tokens(RAW, [])
    assert p is not None
    cm = cost_model("pi05")
    config = cm.load_config("full")
    assert 0 < p < config.max_token_len  # trimmed below the padded length
    for key, fl in RAW["floors"].items():
        batch, views = int(key[1 : key.index("_")]), int(key.rsplit("_v", 1)[1])
        costs = cm.stage_costs(config, batch=batch, views=views, prompt_tokens=p, steps=1, precision="bf16")
        assert costs["denoise_step"].flops / 1e9 == pytest.approx(fl["denoise_step"]["gflop"], rel=1e-12)
        assert costs["embed_images"].flops / 1e9 == pytest.approx(fl["embed_images"]["gflop"], rel=1e-12)


def test_selected_entries_parse_to_the_measured_stage_times() -> None:
    ms = load_bench(f"{RUN}#{','.join(SELECT)}", stat="p50")
    assert len(ms) == len(SELECT)
    prompt = gpu_report.solve_prompt_tokens(RAW, [])
    views = cost_model("pi05").defaults(cost_model("pi05").load_config("full"))["views"]
    for m, name in zip(ms, SELECT):
        e = raw(name)
        assert m.device == RAW["device"] and find_device(m.device).key == "h200-sxm"
        assert (m.adapter, m.preset, m.precision, m.batch, m.views) == ("pi05", "full", "bf16", 1, views)
        t = m.stage_times()
        # L is the measured wall clock, whatever the split.
        assert t.latency_s == pytest.approx(e["p50"] / 1e3, rel=1e-9)
        st = e.get("stages_p50")
        if st:  # our engines: per-stage medians, host-side remainder as preprocess
            assert m.prompt_tokens == prompt
            assert m.steps == round(st["solver_loop"] / st["denoise_step"])
            assert t.vision_s == pytest.approx(st["embed_images"] / 1e3)
            assert t.prefix_s == pytest.approx(st["encode_prefix"] / 1e3)
            assert t.denoise_total_s == pytest.approx(st["denoise_step"] * m.steps / 1e3)
            gap = e["p50"] - st["embed_images"] - st["encode_prefix"] - st["solver_loop"]
            assert t.preprocess_s == pytest.approx(gap / 1e3)
        else:  # LeRobot: only the whole chunk, booked as inference, padded prompt
            assert m.prompt_tokens is None
            assert t.inference_s == pytest.approx(e["p50"] / 1e3)
    with pytest.raises(ValueError, match="not in the report"):
        load_bench(f"{RUN}#ours.b2_v9")
    with pytest.raises(ValueError, match="ambiguous"):
        load_bench(f"{RUN}#b1_v3")  # in ours and lerobot


def test_cli_places_the_h200_points_and_calibrates_on_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "r.png"
    rc = main(
        [
            "roofline",
            "--bench",
            f"{RUN}#{','.join(SELECT)}",
            "--device",
            "h200",
            "--device",
            "orin",
            "--rate",
            "50",
            "--horizon",
            "50",
            "--stat",
            "p50",
            "--plot",
            str(png),
            "--json",
            "-",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    measured = [p for p in report["points"] if p["kind"] == "measured"]
    assert len(measured) == len(SELECT)
    period_ms = 1e3 / 50
    for p, name in zip(measured, SELECT):
        wall = raw(name)["p50"]
        assert p["device"] == RAW["device"]
        assert p["result"]["latency_s"] * 1e3 == pytest.approx(wall)
        assert p["result"]["delay_ticks"] == math.ceil(wall / period_ms)
        assert p["result"]["binding"] == "physical"  # every H200 point is left of the ridge at 50 Hz
    # Calibrated on the first selected run: the factors are ideal / measured per class.
    first = raw(SELECT[0])["stages_p50"]
    cal = report["calibration"]
    assert "graphs+compile" in report["efficiency"]["source"]
    for stage, c in cal.items():
        assert c["measured_ms"] == pytest.approx(first[stage])
    for cls, key in (("compute", "compute"), ("memory", "bandwidth")):
        rows = [c for c in cal.values() if c["bound"] == cls]
        expect = sum(c["ideal_ms"] for c in rows) / sum(c["measured_ms"] for c in rows)
        assert report["efficiency"][key] == pytest.approx(expect)
    # Calibrating on the H200 reproduces the H200 run's model stages.
    h200 = next(p for p in report["points"] if p["kind"] == "predicted" and p["device"] == "h200-sxm")
    model_ms = first["embed_images"] + first["encode_prefix"] + first["solver_loop"]
    assert h200["stage_times_ms"]["latency_ms"] == pytest.approx(model_ms, rel=1e-6)
    assert any("launch-overhead bound" in n for n in report["notes"])


TRITON_RUN = RUN.with_name("pi05_triton_2026-12-02.json")


def test_variant_sections_convert() -> None:
    """A `pi05_gpu.py --triton-only` report: entries keyed variant-first ("triton+compile_b1")
    become runs at that batch, 3 views, with the variant in the label and the stage medians."""
    raw_t = json.loads(TRITON_RUN.read_text())
    assert gpu_report.is_gpu_report(raw_t)
    runs = {r["key"]: r for r in gpu_report.to_bench_runs(raw_t, ["triton.triton+compile_b1", "triton_b32"])}
    r1 = runs["triton.triton+compile_b1"]
    assert (r1["batch"], r1["views"], r1["backend"]) == (1, 3, "cudagraph+triton+compile")
    assert "triton+compile" in r1["label"]
    want = raw_t["triton"]["triton+compile_b1"]
    assert r1["stages"]["engine"]["p50_ms"] == want["p50"]
    assert r1["stages"]["denoise_step"]["p50_ms"] == want["stages_p50"]["denoise_step"]
    assert r1["steps"] == round(want["stages_p50"]["solver_loop"] / want["stages_p50"]["denoise_step"])
    assert runs["triton.triton_b32"]["batch"] == 32
    assert "triton.triton_b1_info" not in {r["key"] for r in gpu_report.to_bench_runs(raw_t)}
