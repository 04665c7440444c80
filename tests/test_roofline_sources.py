"""Bench JSON and Prometheus text parsing."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from phyai_edge.roofline.sources import (
    fetch_metrics,
    histogram_quantile,
    load_bench,
    measurement_from_metrics,
    parse_bench,
    parse_prometheus,
    stage_key,
)

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
    "prompt_tokens": 48,
    "stages": {
        "embed_images": {"p50_ms": 2.0, "p90_ms": 2.5},
        "encode_prefix": {"p50_ms": 8.0, "p90_ms": 9.0},
        "denoise_step": {"p50_ms": 0.9, "p90_ms": 1.0},
        "solver_loop": {"p50_ms": 9.5, "p90_ms": 10.5},
        "preprocess": {"p50_ms": 1.5},
        "postprocess": {"p50_ms": 0.2, "p90_ms": 0.3},
        "engine": {"p50_ms": 19.3, "p90_ms": 21.0},
        "total": {"p50_ms": 21.0, "p90_ms": 23.0},
        "h2d_copy": {"p50_ms": 0.1},
    },
}


def test_bench_schema() -> None:
    (m,) = parse_bench(BENCH, stat="p90")
    assert m.device == "NVIDIA H200"  # the GPU name, not bench's generic "cuda"
    assert m.adapter == "pi05" and m.steps == 10 and m.backend == "cudagraph"
    assert m.precision == "bf16"  # torch dtype names are normalised
    assert m.stages_s["inference"] == pytest.approx(21.0e-3)  # "engine" is the aggregate
    assert m.stages_s["vision"] == pytest.approx(2.5e-3)
    assert m.stages_s["prefix"] == pytest.approx(9.0e-3)
    assert m.stages_s["preprocess"] == pytest.approx(1.5e-3)  # no p90: falls back to p50
    assert any("no p90" in n for n in m.notes)
    assert any("h2d_copy" in n for n in m.notes)  # unknown stage is reported, not fatal
    t = m.stage_times()
    assert t.denoise_step_s == pytest.approx(1.0e-3)  # denoise_step wins over solver_loop / steps
    assert t.latency_s == pytest.approx((1.5 + 2.5 + 9.0 + 10 * 1.0 + 0.3) * 1e-3)
    assert m.stage_times(steps=5).denoise_total_s == pytest.approx(5e-3)  # what-if --steps
    assert not any("RTC" in n for n in m.notes)
    (guided,) = parse_bench({**BENCH, "rtc": "guided"})  # `phyai-edge bench --rtc guided`
    assert any("timed with RTC guided" in n for n in guided.notes)


def test_bench_tolerates_other_shapes() -> None:
    # Plain numbers are milliseconds, *_s keys are seconds, only a solver loop is given.
    doc = {
        "results": [
            {
                "device": {"name": "RTX 4090"},
                "steps": 5,
                "stages": {"vision": 3, "prefix_ms": 12.0, "solver_loop": {"mean_s": 0.010}},
            },
            {"stages": {"total": {"p50_ms": 40.0}, "preprocess": 2.0}},
        ]
    }
    a, b = parse_bench(doc)
    assert a.device == "RTX 4090"
    ta = a.stage_times()
    assert ta.vision_s == pytest.approx(3e-3) and ta.prefix_s == pytest.approx(12e-3)
    assert ta.denoise_step_s == pytest.approx(0.002)  # 10 ms over the run's 5 steps
    tb = b.stage_times()  # only a total: booked as inference minus the known pre-processing
    assert tb.latency_s == pytest.approx(40e-3)
    assert tb.inference_s == pytest.approx(38e-3)


def test_bench_float32_cpu_run_is_not_calibratable() -> None:
    """A float32 run keeps its precision (fp32, not the bf16 default) and its label says so; the
    device table has no fp32 peaks, so it is not calibrated on."""
    (m,) = parse_bench({"device": "cpu", "gpu": None, "dtype": "float32", "stages": {"embed_images": 5.0}})
    assert m.device == "cpu" and m.precision == "fp32" and not m.calibratable
    assert m.modelled_precision is None and "fp32" in m.label
    assert any("float32" in n and "not used to calibrate" in n for n in m.notes)
    # a bundle's manifest names it fp32 already; torch's spelling is normalised the same way
    for doc in ({"precision": "fp32"}, {"dtype": "torch.float32"}):
        (m,) = parse_bench({**doc, "stages": {"embed_images": 5.0}})
        assert (m.precision, m.calibratable) == ("fp32", False)
    (m,) = parse_bench({"dtype": "bfloat16", "stages": {"embed_images": 5.0}})
    assert (m.precision, m.modelled_precision, m.calibratable) == ("bf16", "bf16", True)


def test_bench_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="stages"):
        parse_bench({"device": "h200"})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_bench(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(BENCH))
    assert load_bench(good)[0].stages_s["prefix"] == pytest.approx(8e-3)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("embed_images", "vision"),
        ("phyai_edge_encode_prefix_seconds", "prefix"),
        ("phyai-edge:denoise_step_ms", "denoise_step"),
        ("stage_preprocess_seconds", "preprocess"),
        ("camera_age_seconds", "camera_age"),
        ("inference_latency_seconds", "inference"),
        ("phyai_inference_seconds", "inference"),  # the daemon's own prefix is phyai_
        ("phyai_tick_lateness_seconds", None),
        ("deadline_misses_total", None),
        ("chunk_size", None),
    ],
)
def test_stage_names(name: str, key: str | None) -> None:
    assert stage_key(name) == key


METRICS = r"""
# HELP phyai_edge_stage_seconds Time per stage.
# TYPE phyai_edge_stage_seconds summary
phyai_edge_stage_seconds{stage="embed_images",quantile="0.5"} 0.002
phyai_edge_stage_seconds{stage="embed_images",quantile="0.9"} 0.003
phyai_edge_stage_seconds_sum{stage="embed_images"} 2.2
phyai_edge_stage_seconds_count{stage="embed_images"} 1000
phyai_edge_stage_seconds{stage="encode_prefix",quantile="0.5"} 0.008
phyai_edge_stage_seconds{stage="encode_prefix",quantile="0.9"} 0.010
# TYPE phyai_edge_solver_loop_seconds histogram
phyai_edge_solver_loop_seconds_bucket{le="0.005"} 0
phyai_edge_solver_loop_seconds_bucket{le="0.01"} 40
phyai_edge_solver_loop_seconds_bucket{le="0.02"} 100
phyai_edge_solver_loop_seconds_bucket{le="+Inf"} 100
phyai_edge_solver_loop_seconds_sum 1.1
phyai_edge_solver_loop_seconds_count 100
# TYPE phyai_edge_camera_age_seconds gauge
phyai_edge_camera_age_seconds{camera="wrist \"left\""} 0.015
phyai_edge_transport_ms 1.5 1712345678000
phyai_edge_deadline_misses_total 3
phyai_edge_control_rate_hz 50
phyai_edge_chunk_size 50
phyai_edge_rtc_execution_horizon 20
phyai_edge_num_steps 10
this line is garbage
"""


def test_parse_prometheus_lines() -> None:
    samples = parse_prometheus(METRICS)
    names = [s.name for s in samples]
    assert "phyai_edge_stage_seconds" in names and "this" not in names
    cam = next(s for s in samples if s.name == "phyai_edge_camera_age_seconds")
    assert cam.labels == {"camera": 'wrist "left"'}  # escaped quote inside a label value
    tx = next(s for s in samples if s.name == "phyai_edge_transport_ms")
    assert tx.value == 1.5  # the trailing timestamp is not the value
    inf = next(s for s in samples if s.labels.get("le") == "+Inf")
    assert inf.value == 100


def test_histogram_quantile_by_hand() -> None:
    buckets = [(0.005, 0), (0.01, 40), (0.02, 100), (float("inf"), 100)]
    # rank 50 lies in (0.01, 0.02] which holds counts 40..100: 0.01 + 0.01 * 10 / 60
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.01 + 0.01 * 10 / 60)
    assert histogram_quantile(0.2, buckets) == pytest.approx(0.005 + 0.005 * 20 / 40)
    assert histogram_quantile(0.5, []) is None


def test_measurement_from_metrics() -> None:
    m = measurement_from_metrics(METRICS, stat="p90")
    assert m.stages_s["vision"] == pytest.approx(0.003)  # summary quantile 0.9
    assert m.stages_s["prefix"] == pytest.approx(0.010)
    assert m.stages_s["solver_loop"] == pytest.approx(0.01 + 0.01 * 50 / 60)  # histogram q0.9
    assert m.stages_s["camera_age"] == pytest.approx(0.015)
    assert m.stages_s["transport"] == pytest.approx(0.0015)  # unit taken from the _ms name
    assert (m.rate_hz, m.horizon, m.exec_horizon, m.steps) == (50, 50, 20, 10)
    t = m.stage_times()
    assert t.denoise_step_s == pytest.approx(m.stages_s["solver_loop"] / 10)
    p50 = measurement_from_metrics(METRICS, stat="p50")
    assert p50.stages_s["vision"] == pytest.approx(0.002)


def test_fetch_metrics_over_http() -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = METRICS.encode() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        text = fetch_metrics(f"127.0.0.1:{port}")  # scheme and /metrics filled in
        assert "phyai_edge_stage_seconds" in text
    finally:
        server.shutdown()
        server.server_close()


def test_real_daemon_metrics_endpoint() -> None:
    """The daemon's own Metrics class (prometheus-client) served on loopback, read back by us."""
    pytest.importorskip("prometheus_client")
    import socket

    from phyai_edge.control.metrics import Metrics

    with socket.socket() as sock:  # a free port; the tiny race with serve() is acceptable here
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    metrics = Metrics()
    assert metrics.serve("127.0.0.1", port)
    for _ in range(10):
        metrics.stage_seconds.labels("preprocess").observe(0.0015)
        metrics.stage_seconds.labels("embed_images").observe(0.003)
        metrics.stage_seconds.labels("encode_prefix").observe(0.008)
        metrics.stage_seconds.labels("solver_loop").observe(0.012)
        metrics.stage_seconds.labels("denoise_step").observe(0.0012)
        metrics.stage_seconds.labels("postprocess").observe(0.0004)
        metrics.inference_seconds.observe(0.030)
    metrics.rtc_delay.set(2)
    m = measurement_from_metrics(fetch_metrics(f"http://127.0.0.1:{port}/metrics"), stat="p50")
    # Histogram buckets (1, 2, 5, 10, 20, 50 ms ...): every sample of a stage sits in one bucket,
    # so the interpolated median is the bucket's midpoint.
    assert m.stages_s["vision"] == pytest.approx(0.0035)  # in (2, 5] ms
    assert m.stages_s["prefix"] == pytest.approx(0.0075)  # in (5, 10] ms
    assert m.stages_s["solver_loop"] == pytest.approx(0.015)  # in (10, 20] ms
    assert m.stages_s["inference"] == pytest.approx(0.035)  # in (20, 50] ms
    assert m.delay_ticks == 2
    t = m.stage_times()
    assert t.denoise_step_s == pytest.approx(0.0015)  # denoise_step histogram, (1, 2] ms
    assert t.transport_s >= 0 and "transport" in m.stages_s


def test_label_escapes_are_undone_in_one_pass() -> None:
    """An escaped backslash followed by an n is a backslash and an n, not a line break; \\n alone
    is a line break, \\" a quote; a backslash before anything else stays."""
    (s,) = parse_prometheus(r'm{a="x\\ny",b="l1\nl2",c="say \"hi\"",d="C:\\dir\\",e="\t"} 1')
    assert s.labels == {"a": "x\\ny", "b": "l1\nl2", "c": 'say "hi"', "d": "C:\\dir\\", "e": "\\t"}


# A daemon's /metrics: two stage histograms, the worker's whole job, and which model ran.
MODEL_METRICS = r"""
# TYPE phyai_stage_seconds histogram
phyai_stage_seconds_bucket{stage="embed_images",le="0.002"} 0.0
phyai_stage_seconds_bucket{stage="embed_images",le="0.005"} 10.0
phyai_stage_seconds_bucket{stage="embed_images",le="+Inf"} 10.0
phyai_stage_seconds_bucket{stage="denoise_step",le="0.001"} 0.0
phyai_stage_seconds_bucket{stage="denoise_step",le="0.002"} 10.0
phyai_stage_seconds_bucket{stage="denoise_step",le="+Inf"} 10.0
phyai_inference_seconds_bucket{le="0.01"} 0.0
phyai_inference_seconds_bucket{le="0.02"} 10.0
phyai_inference_seconds_bucket{le="+Inf"} 10.0
# HELP phyai_model_info The model the daemon runs
# TYPE phyai_model_info gauge
phyai_model_info{adapter="pi05",backend="cudagraph",bundle="/e/a\\nb",device="cuda",dtype="bfloat16",gpu="NVIDIA H200",horizon="30",precision="fp8",preset="full",steps="5",views="2"} 1.0
"""


def test_metrics_take_the_model_from_phyai_model_info() -> None:
    """`roofline --metrics` models what the daemon says it runs: preset, views, steps, horizon,
    backend, the precision (fp8 over the bundle's bfloat16 dtype) and the GPU's name where the
    device is only "cuda"; the steps also split the worker's time into its stages."""
    from phyai_edge.roofline.sources import daemon_model

    m = measurement_from_metrics(MODEL_METRICS)
    assert (m.adapter, m.preset, m.backend, m.device, m.precision) == ("pi05", "full", "cudagraph", "NVIDIA H200", "fp8")
    assert (m.views, m.steps, m.horizon, m.calibratable) == (2, 5, 30, True)
    # 15 ms whole job - 3.5 ms vision - 5 x 1.5 ms steps: 4 ms outside the stages.
    assert m.stages_s["transport"] == pytest.approx(0.004)
    assert set(m.stages_s) == {"vision", "denoise_step", "inference", "transport"}  # the info line is no stage
    assert daemon_model(MODEL_METRICS)["bundle"] == "/e/a\\nb"

    # Without the GPU's name: the config's "cuda"; a float32 CPU daemon is not calibrated on.
    cpu = MODEL_METRICS.replace('gpu="NVIDIA H200",', "").replace('precision="fp8",', "")
    assert measurement_from_metrics(cpu).device == "cuda" and measurement_from_metrics(cpu).precision == "bf16"
    f32 = measurement_from_metrics(cpu.replace('device="cuda"', 'device="cpu"').replace("bfloat16", "float32"))
    assert f32.device == "cpu" and f32.precision == "fp32" and not f32.calibratable
    # No model line (an older daemon): nothing assumed, the flags and defaults decide.
    old = measurement_from_metrics(MODEL_METRICS.split("# HELP phyai_model_info")[0])
    assert (old.preset, old.device, old.precision, old.views, old.steps, old.horizon) == (None,) * 6
    # A gauge naming the horizon or the steps still wins over the label.
    assert measurement_from_metrics(MODEL_METRICS + "phyai_chunk_size 50\n").horizon == 50


def test_one_model_info_parser_for_the_sim_and_the_roofline() -> None:
    from phyai_edge.roofline import sources
    from phyai_edge.sim import report

    assert report.daemon_model is sources.daemon_model


def test_metrics_take_the_rate_and_s_from_phyai_model_info() -> None:
    """The daemon's rate_hz and exec_horizon labels are the run's rate and s; a gauge named for
    either still wins; without them (an older daemon) both are left to the flags and defaults."""
    labels = 'phyai_model_info{adapter="pi05",'
    text = MODEL_METRICS.replace(labels, labels + 'exec_horizon="12",rate_hz="30",')
    m = measurement_from_metrics(text)
    assert (m.rate_hz, m.exec_horizon, m.horizon) == (30.0, 12, 30)
    assert (measurement_from_metrics(MODEL_METRICS).rate_hz, measurement_from_metrics(MODEL_METRICS).exec_horizon) == (
        None, None)
    gauged = measurement_from_metrics(text + "phyai_control_rate_hz 40\nphyai_execution_horizon 8\n")
    assert (gauged.rate_hz, gauged.exec_horizon) == (40.0, 8)
    # Labels that are no rate or no s are left out rather than failing the roofline.
    bad = measurement_from_metrics(text.replace('rate_hz="30"', 'rate_hz="0"').replace('"12"', '"x"'))
    assert (bad.rate_hz, bad.exec_horizon) == (None, None)


def test_a_run_with_the_first_step_beside_the_prefix_books_its_chunk_once() -> None:
    """The cudagraph engine's `early_step`: its loop times 9 of 10 steps and its prefix holds the
    first step's share. The model's chunk (vision + prefix + 10 steps) is then the measured one, and
    a run whose loop timed every step is left as it is."""
    from phyai_edge.roofline.sources import Measurement

    step = 0.758e-3
    early = Measurement("h200", {"vision": 2.09e-3, "prefix": 5.58e-3, "denoise_step": step,
                                 "solver_loop": 9 * step}, steps=10)
    assert early.first_step_beside_prefix
    st = early.stage_times()
    assert st.prefix_s == pytest.approx(5.58e-3 - step)
    assert st.inference_s == pytest.approx(2.09e-3 + 5.58e-3 + 9 * step)
    assert early.stage_times(steps=5).inference_s == pytest.approx(2.09e-3 + 5.58e-3 + 4 * step)  # what-if
    plain = Measurement("h200", {"vision": 2.09e-3, "prefix": 5.24e-3, "denoise_step": step,
                                 "solver_loop": 10 * step}, steps=10)
    assert not plain.first_step_beside_prefix
    assert plain.stage_times().prefix_s == pytest.approx(5.24e-3)


def test_a_negative_stage_time_is_refused_and_a_non_finite_one_unused() -> None:
    """A negative time reached StageTimes and crashed the CLI with a traceback; a bare NaN (JSON
    allows it) did the same, where a NaN inside a stage's object was already skipped."""
    with pytest.raises(ValueError, match=r"stage 'encode_prefix' is -8 ms"):
        parse_bench({"stages": {"embed_images": 2.0, "encode_prefix": -8.0}})
    with pytest.raises(ValueError, match=r"stage 'embed_images' is -2 ms"):
        parse_bench({"stages": {"embed_images": {"p50_ms": -2.0}, "encode_prefix": 8.0}})
    (m,) = parse_bench({"stages": {"embed_images": float("nan"), "encode_prefix": 8.0}})
    assert "vision" not in m.stages_s and "stage 'embed_images' has no usable number" in m.notes


def test_a_bare_number_takes_its_unit_from_the_stage_name() -> None:
    """`vision_s: 0.002` was read as 0.002 ms (the name's _s was stripped, the number taken as ms)."""
    (m,) = parse_bench({"stages": {"embed_images_s": 0.002, "prefix_seconds": {"p50": 0.008},
                                   "denoise_step_ms": 0.9, "solver_loop": {"p50_us": 9000}}})
    assert m.stages_s["vision"] == pytest.approx(0.002)
    assert m.stages_s["prefix"] == pytest.approx(0.008)
    assert m.stages_s["denoise_step"] == pytest.approx(0.0009)
    assert m.stages_s["solver_loop"] == pytest.approx(0.009)


def test_a_run_with_no_known_stage_is_refused() -> None:
    """It became a point with L = 0 that the physical loop binds, feasible at any rate."""
    with pytest.raises(ValueError, match=r"run #0 has no stage time this tool recognises \(stages: foo, bar"):
        parse_bench({"gpu": "NVIDIA H200", "stages": {"foo": 2.0, "bar": 8.0}})
    with pytest.raises(ValueError, match=r"stages: none"):
        parse_bench({"stages": {}})


@pytest.mark.parametrize("field, value", [("steps", -2), ("views", 0), ("batch", -1), ("horizon", 0),
                                          ("num_steps", "-3"), ("exec_horizon", -1)])
def test_run_counts_below_one_are_refused_by_name(field: str, value: object) -> None:
    """steps -2 crashed in StageTimes with a traceback; 0 views / batch fell back to the default."""
    with pytest.raises(ValueError, match=rf"^{field} '?{value}'?: expected a whole number >= "):
        parse_bench({field: value, "stages": {"embed_images": 2.0}})
    (m,) = parse_bench({"exec_horizon": 0, "stages": {"embed_images": 2.0}})  # 0: s free, as before
    assert m.exec_horizon is None


def test_load_bench_names_the_file(tmp_path) -> None:
    bad = tmp_path / "run.json"
    bad.write_text(json.dumps({"steps": -1, "stages": {"embed_images": 2.0}}))
    with pytest.raises(ValueError, match=r"run\.json: steps -1"):
        load_bench(bad)


HISTOGRAM = """
phyai_inference_stage_seconds_bucket{stage="embed_images",le="0.01"} 50
phyai_inference_stage_seconds_bucket{stage="embed_images",le="0.1"} 100
phyai_inference_stage_seconds_bucket{stage="embed_images",le="+Inf"} 100
phyai_inference_stage_seconds_sum{stage="embed_images"} 3.0
phyai_inference_stage_seconds_count{stage="embed_images"} 100
"""


def test_metrics_mean_is_sum_over_count_and_a_missing_stat_is_noted() -> None:
    """--stat mean / max / min took the histogram's median from a daemon without a word."""
    mean = measurement_from_metrics(HISTOGRAM, stat="mean")
    assert mean.stages_s["vision"] == pytest.approx(0.03) and mean.notes == []
    for stat in ("max", "min"):
        m = measurement_from_metrics(HISTOGRAM, stat=stat)
        assert m.stages_s["vision"] == pytest.approx(0.01)
        assert m.notes == [f"vision: no {stat} in the metrics, used histogram q0.5"]
    assert measurement_from_metrics(HISTOGRAM, stat="p50").notes == []


def test_fetch_metrics_from_a_port_that_is_not_http_is_an_oserror() -> None:
    """The daemon's ZeroMQ port given by mistake raised http.client.BadStatusLine (no OSError),
    a traceback past the CLI's `cannot read metrics` line."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        conn.recv(1024)
        conn.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f")  # a ZMTP greeting, not HTTP
        conn.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with pytest.raises(OSError, match="not an HTTP endpoint"):
            fetch_metrics(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=5.0)
    finally:
        thread.join(5)
        server.close()
