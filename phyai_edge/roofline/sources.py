"""Where measured stage times come from: a `phyai-edge bench --json` file or a daemon's
Prometheus `/metrics` endpoint. Both parsers are tolerant: unknown keys are ignored, stage names
have aliases, values may be in ms or s, and a missing stage is simply zero (and reported).
"""

from __future__ import annotations

import http.client
import json
import math
import re
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phyai_edge.roofline.costs import PRECISIONS
from phyai_edge.roofline.model import StageTimes

# Our stage key -> names a bench file or metric may use for it (compared after normalising).
STAGE_ALIASES: dict[str, tuple[str, ...]] = {
    "camera_age": ("camera_age", "frame_age", "image_age", "observation_age", "obs_age"),
    "preprocess": ("preprocess", "pre_process", "preprocessing"),
    "vision": ("embed_images", "vision", "vision_encoder", "siglip"),
    "prefix": ("encode_prefix", "prefix", "prefill"),
    "denoise_step": ("denoise_step", "flow_step", "expert_step"),
    "solver_loop": ("solver_loop", "solver", "denoise_loop", "denoise"),
    "postprocess": ("postprocess", "post_process", "postprocessing"),
    "transport": ("transport", "publish", "zmq_publish", "network"),
    "inference": ("inference", "infer", "model", "engine"),
    "total": ("total", "end_to_end", "e2e", "chunk"),
}
_ALIAS_TO_STAGE = {a: k for k, names in STAGE_ALIASES.items() for a in names}

# Preference order of statistics when the asked one is missing.
STATS = ("p50", "p90", "p95", "p99", "mean", "median", "max", "min")


@dataclass
class Measurement:
    """Stage times from one measured run, in seconds, plus what was run."""

    label: str
    stages_s: dict[str, float]  # our stage keys (see STAGE_ALIASES) -> seconds
    adapter: str | None = None
    preset: str | None = None
    device: str | None = None
    batch: int | None = None
    views: int | None = None
    steps: int | None = None
    prompt_tokens: int | None = None  # prompt length the run processed (None: the padded length)
    precision: str | None = None  # as it ran, e.g. "bf16", or "fp32", which `modelled` is not
    horizon: int | None = None
    exec_horizon: int | None = None
    rate_hz: float | None = None
    backend: str | None = None
    calibratable: bool = True  # False when the run's precision is not one the cost model has
    delay_ticks: float | None = None  # d as the daemon measured it (phyai_rtc_delay_ticks)
    stat: str = "p50"
    notes: list[str] = field(default_factory=list)

    @property
    def modelled_precision(self) -> str | None:
        """The run's precision where the cost model and the device table have it, else None."""
        return self.precision if self.precision in PRECISIONS else None

    @property
    def first_step_beside_prefix(self) -> bool:
        """Whether the run's loop timed one step fewer than it ran: the cudagraph engine's first
        flow step beside the prefix (`early_step`), seen as solver_loop / denoise_step = steps - 1."""
        s, n = self.stages_s, self.steps or 10
        loop, step = s.get("solver_loop"), s.get("denoise_step")
        return bool(loop and step and n > 1 and abs(loop / step - (n - 1)) < 0.5)

    def stage_times(self, steps: int | None = None) -> StageTimes:
        """Fold into the model's StageTimes. `steps` rescales the solver (what-if --steps)."""
        s = self.stages_s
        n_meas = self.steps or steps or 10
        n = steps or n_meas
        if s.get("denoise_step"):
            step = s["denoise_step"]
        elif s.get("solver_loop"):
            step = s["solver_loop"] / n_meas
        else:
            step = 0.0
        vision, prefix = s.get("vision", 0.0), s.get("prefix", 0.0)
        if self.first_step_beside_prefix:
            # The prefix's time holds the first step's share (it ran beside it) and the loop the
            # other steps: booking one step less as prefix makes vision + prefix + n steps the chunk.
            prefix = max(0.0, prefix - step)
        if not (vision or prefix or step):
            # Only an aggregate is known: book it all as inference (vision) so d still counts it.
            agg = s.get("inference") or max(
                0.0, s.get("total", 0.0) - s.get("preprocess", 0.0) - s.get("postprocess", 0.0)
            )
            vision = agg
        return StageTimes(
            camera_age_s=s.get("camera_age", 0.0),
            preprocess_s=s.get("preprocess", 0.0),
            vision_s=vision,
            prefix_s=prefix,
            denoise_step_s=step,
            steps=n,
            postprocess_s=s.get("postprocess", 0.0),
            transport_s=s.get("transport", 0.0),
        )


def normalise_name(name: str) -> str:
    n = name.strip().lower()
    n = re.sub(r"^phyai(?:[_-]?edge)?[_:]", "", n)  # daemon metric prefix: phyai_ (or phyai_edge_)
    n = re.sub(r"[^a-z0-9]+", "_", n).strip("_")
    return n


def stage_key(name: str) -> str | None:
    """Map a bench/metric stage name to our stage key, or None if it is not a stage."""
    n = normalise_name(name)
    for suffix in ("_seconds", "_second", "_ms", "_s", "_latency", "_time", "_duration"):
        if n.endswith(suffix) and n[: -len(suffix)]:
            n = n[: -len(suffix)]
    for prefix in ("stage_", "latency_", "time_"):
        if n.startswith(prefix) and n[len(prefix) :] in _ALIAS_TO_STAGE:
            n = n[len(prefix) :]
    return _ALIAS_TO_STAGE.get(n)


def _name_unit(name: str) -> float:
    """Seconds per unit of a stage named with a unit ("vision_s", "prefix_seconds": 1; "_us": 1e-6),
    else 1e-3: a bench stage's bare numbers are in ms unless its name says otherwise."""
    n = normalise_name(name)
    if n.endswith(("_s", "_seconds", "_second")):
        return 1.0
    return 1e-6 if n.endswith("_us") else 1e-3


def _stat_value(entry: Any, stat: str, unit: float = 1e-3) -> tuple[float | None, str]:
    """A stage entry -> (seconds, the statistic used). Accepts a number or a dict whose keys look
    like p50_ms, p50, p50_s, mean_ms, median...: a key's _ms / _us / _s suffix gives its unit, else
    `unit` (seconds per unit: the stage name's, `_name_unit`). Non-finite numbers are not usable."""
    if isinstance(entry, bool):
        return None, ""
    if isinstance(entry, (int, float)):
        return (float(entry) * unit, "value") if math.isfinite(entry) else (None, "")
    if not isinstance(entry, Mapping):
        return None, ""
    found: dict[str, float] = {}
    for k, v in entry.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        key = str(k).lower()
        scale = unit
        if key.endswith("_ms"):
            key = key[:-3]
        elif key.endswith("_us"):
            key, scale = key[:-3], 1e-6
        elif key.endswith("_s"):
            key, scale = key[:-2], 1.0
        found[key] = float(v) * scale
    for s in (stat, *STATS):
        if s in found:
            return found[s], s
    return None, ""


def parse_bench(
    data: Any, stat: str = "p50", label: str | None = None, select: list[str] | None = None
) -> list[Measurement]:
    """A bench JSON document -> one Measurement per run. Accepts one run (a dict with "stages"),
    a list of runs, {"runs"/"results": [...]}, or a `benchmarks/pi05_gpu.py` report (converted by
    `gpu_report.to_bench_runs`; `select` picks its entries, e.g. ["ablation.b1_compiled"])."""
    from phyai_edge.roofline import gpu_report

    if gpu_report.is_gpu_report(data):
        data = gpu_report.to_bench_runs(data, select)
    elif select:
        raise ValueError("selecting runs with FILE#KEY works on pi05_gpu.py reports only")
    if isinstance(data, list):
        runs = data
    elif isinstance(data, Mapping) and isinstance(data.get("runs") or data.get("results"), list):
        runs = data.get("runs") or data.get("results")
    else:
        runs = [data]
    out = []
    for i, run in enumerate(runs):
        if not isinstance(run, Mapping):
            raise ValueError(f"bench run #{i} is a {type(run).__name__}, expected an object with 'stages'")
        stages_obj = run.get("stages", run.get("timings"))
        if not isinstance(stages_obj, Mapping):
            raise ValueError(f"bench run #{i} has no 'stages' object (keys: {sorted(run)})")
        m = Measurement(label="", stages_s={}, stat=stat)
        for name, entry in stages_obj.items():
            key = stage_key(str(name))
            if key is None:
                m.notes.append(f"ignored stage {name!r}")
                continue
            value, used = _stat_value(entry, stat, _name_unit(str(name)))
            if value is None:
                m.notes.append(f"stage {name!r} has no usable number")
                continue
            if value < 0:  # a time cannot be negative: a broken timer, not something to analyse
                raise ValueError(f"bench run #{i}: stage {name!r} is {value * 1e3:g} ms, expected a time >= 0")
            if used not in (stat, "value"):
                m.notes.append(f"{name}: no {stat}, used {used}")
            m.stages_s[key] = value
        if not m.stages_s:
            # Zero for every stage would pass as a run the physical loop binds, with L = 0.
            raise ValueError(f"bench run #{i} has no stage time this tool recognises (stages: "
                             f"{', '.join(map(str, stages_obj)) or 'none'}; e.g. embed_images, encode_prefix, "
                             "denoise_step, solver_loop, engine)")
        extra = run.get("notes")
        if isinstance(extra, list):  # a converter's own notes (gpu_report)
            m.notes.extend(str(n) for n in extra)
        rtc = run.get("rtc")
        if isinstance(rtc, str) and rtc != "none":  # `phyai-edge bench --rtc`
            m.notes.append(f"timed with RTC {rtc}: its flow loop includes the guidance, which the floors and "
                           "predictions leave out")
        _fill_run_info(m, run)
        m.label = label or run.get("label") or _default_label(m, i, len(runs))
        out.append(m)
    return out


def _int_or_none(v: Any) -> int | None:
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


def _count(run: Mapping[str, Any], *keys: str, least: int = 1) -> int | None:
    """The first of `keys` that `run` has, as a whole number (None: absent or not a number); a
    ValueError naming the key where it is below `least` (a negative step count crashed later)."""
    for key in keys:
        if run.get(key) is not None:
            n = _int_or_none(run[key])
            if n is not None and n < least:
                raise ValueError(f"{key} {run[key]!r}: expected a whole number >= {least}")
            return n
    return None


_GENERIC_DEVICES = ("cpu", "cuda", "meta", "gpu", "mps")
# torch dtype names as the roofline's precisions (bench JSON, `phyai-edge bench` floors)
DTYPE_PRECISIONS = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float8_e4m3fn": "fp8", "int8": "int8"}
# Precisions a run may have that the cost model and the device table do not (no peaks for them):
# named in the roofline's short form so that the run is labelled as what it was, never as bf16.
# Kept apart from DTYPE_PRECISIONS, whose every entry `phyai-edge bench` looks peaks up for.
UNMODELLED_PRECISIONS = {"float32": "fp32", "float": "fp32", "fp32": "fp32", "tf32": "tf32",
                         "float64": "fp64", "double": "fp64", "fp64": "fp64"}


def _fill_run_info(m: Measurement, run: Mapping[str, Any]) -> None:
    m.adapter = run.get("adapter") or run.get("model")
    m.preset = run.get("preset")
    # `phyai-edge bench` writes device "cuda" / "cuda:0" and the GPU's name under "gpu".
    dev = run.get("device")
    if isinstance(dev, Mapping):  # {"name": "NVIDIA H200", ...}
        dev = dev.get("name")
    if dev is None or str(dev).split(":")[0].lower() in _GENERIC_DEVICES:
        dev = run.get("gpu") or dev
    m.device = None if dev is None else str(dev)
    m.backend = run.get("backend")
    m.batch = _count(run, "batch", "batch_size")
    m.views = _count(run, "views", "num_views")
    m.steps = _count(run, "steps", "num_steps")
    m.prompt_tokens = _count(run, "prompt_tokens", least=0)
    raw = run.get("precision") or run.get("dtype")
    prec = None
    if isinstance(raw, str):
        name = raw.lower().removeprefix("torch.")
        prec = DTYPE_PRECISIONS.get(name) or UNMODELLED_PRECISIONS.get(name, name)
        if prec not in PRECISIONS:
            # Its times are real and stay a measured point at its own precision; what it cannot
            # do is stand in for a modelled precision (calibration, what-if ratios).
            m.notes.append(
                f"precision {raw!r} ({prec}) is not modelled (the device table has {', '.join(PRECISIONS)} "
                f"peaks only): shown as measured at {prec}, not used to calibrate"
            )
            m.calibratable = False
    m.precision = prec
    m.horizon = _count(run, "horizon", "chunk_size")
    # The robot side a run was measured under (the daemon's phyai_model_info, the sim's document);
    # `--rate` / `--exec-horizon` given on the command line win over these.
    m.rate_hz = positive_rate(run.get("rate_hz", run.get("control_hz")))
    m.exec_horizon = _count(run, "exec_horizon", "execution_horizon", least=0) or None  # 0: free


def positive_rate(v: Any) -> float | None:
    """A control rate in Hz from a number or a label's text ("50"); None unless finite and > 0
    (also the sim report's reading of the daemon's rate_hz label)."""
    try:
        rate = float(v)
    except (TypeError, ValueError):
        return None
    return rate if math.isfinite(rate) and rate > 0 else None


def positive_count(v: Any) -> int | None:
    """A positive whole number from a number or a label's text ("3"), else None (the sim report's
    reading of the daemon's views / steps / horizon / exec_horizon labels)."""
    n = _int_or_none(v)
    return n if n is not None and n > 0 else None


def _default_label(m: Measurement, i: int, n: int) -> str:
    parts = [p for p in (m.device, m.adapter and f"{m.adapter}/{m.preset or '?'}", m.precision) if p]
    base = " ".join(parts) or "bench"
    return f"{base} (measured)" if n == 1 else f"{base} #{i} (measured)"


def load_bench(path: str | Path, stat: str = "p50") -> list[Measurement]:
    """Read a bench file. `FILE#key,key` selects entries of a pi05_gpu.py report."""
    p, select = Path(path), None
    if "#" in str(path) and not p.exists():
        head, _, tail = str(path).rpartition("#")
        p, select = Path(head), [k for k in tail.split(",") if k.strip()]
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    try:
        return parse_bench(data, stat=stat, select=select)
    except ValueError as e:  # name the file: several --bench may be given
        raise ValueError(f"{p}: {e}") from None


# --------------------------------------------------------------------------- Prometheus


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_ESCAPE_RE = re.compile(r'\\(["\\n])')  # a backslash, then what it escapes: " \ n


def _unescape(v: str) -> str:
    """A label value's escapes (backslash, quote, line feed) undone in one pass, so that an
    escaped backslash followed by an n stays a backslash and an n. Other backslashes are kept."""
    return _ESCAPE_RE.sub(lambda e: "\n" if e.group(1) == "n" else e.group(1), v)


def parse_prometheus(text: str) -> list[Sample]:
    """The Prometheus text exposition format, version 0.0.4: comments skipped, labels parsed
    with escapes, values as floats (+Inf, NaN accepted). Malformed lines are skipped."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            continue
        name, label_block, raw = m.groups()
        labels: dict[str, str] = {}
        if label_block:
            body = label_block[1:-1]
            pos = 0
            while pos < len(body):
                lm = _LABEL_RE.match(body, pos)
                if not lm:
                    break
                labels[lm.group(1)] = _unescape(lm.group(2))
                pos = lm.end()
        try:
            value = float(raw)
        except ValueError:
            continue
        out.append(Sample(name, labels, value))
    return out


MODEL_INFO = "phyai_model_info"


def daemon_model(text: str) -> dict[str, str]:
    """The labels of the daemon's `phyai_model_info` line: which model it runs (adapter, preset,
    backend, device, gpu, dtype, precision, bundle, views, horizon, steps, as far as it knew),
    unescaped; {} when the metrics have no such line. `phyai-edge roofline --metrics` and
    `phyai-edge sim --report` both read it here."""
    return _model_labels(parse_prometheus(text))


def _model_labels(samples: Iterable[Sample]) -> dict[str, str]:
    return next((dict(s.labels) for s in samples if s.name == MODEL_INFO), {})


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q."""
    bs = sorted(buckets)
    if not bs or bs[-1][1] <= 0:
        return None
    total = bs[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in bs:
        if count >= rank:
            if math.isinf(le):
                return prev_le  # the quantile lies above the highest finite bound
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return bs[-1][0]


def _unit_scale(name: str) -> float:
    n = name.lower()
    if "_ms" in n or "milliseconds" in n:
        return 1e-3
    if "_us" in n or "microseconds" in n:
        return 1e-6
    return 1.0  # Prometheus convention: seconds


def _metric_stage(sample_name: str, labels: Mapping[str, str]) -> str | None:
    for lbl in ("stage", "phase", "step", "name"):
        if lbl in labels:
            key = stage_key(labels[lbl])
            if key:
                return key
    base = re.sub(r"_(bucket|sum|count)$", "", sample_name)
    return stage_key(base)


def measurement_from_metrics(text: str, stat: str = "p50", label: str = "daemon (measured)") -> Measurement:
    """Stage times from a daemon's /metrics text. Per stage, in order of preference: a summary
    quantile, a histogram quantile, a histogram/summary mean (sum / count), a gauge value.
    What ran (adapter, preset, device or gpu, backend, views, steps, horizon, precision or dtype)
    and the robot side (rate_hz, exec_horizon) from the daemon's `phyai_model_info` labels, read
    as a bench run's keys; a gauge named for the horizon, the steps, the rate or s overrides its
    label."""
    # --stat as a quantile; mean is sum / count, and max / min have none (the median stands in, noted).
    q_wanted = {"p50": 0.5, "median": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99}.get(stat, 0.5)
    exact = {"mean"} if stat == "mean" else set() if stat in ("max", "min") else {
        f"quantile {q_wanted}", f"histogram q{q_wanted}"}
    quantiles: dict[str, dict[float, float]] = {}
    buckets: dict[str, dict[float, float]] = {}  # stage -> le -> count, summed over label sets
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    gauges: dict[str, float] = {}
    m = Measurement(label=label, stages_s={}, stat=stat)
    samples = parse_prometheus(text)
    model = _model_labels(samples)
    if model:
        _fill_run_info(m, model)
    for s in samples:
        base = normalise_name(s.name)
        _robot_param(m, base, s.value)
        if s.name.endswith("_created"):  # prometheus-client's creation timestamps, not timings
            continue
        key = _metric_stage(s.name, s.labels)
        if key is None or not math.isfinite(s.value):
            continue
        scale = _unit_scale(re.sub(r"_(bucket|sum|count)$", "", s.name))
        if s.name.endswith("_bucket") and "le" in s.labels:
            le = float(s.labels["le"]) * scale
            per_le = buckets.setdefault(key, {})
            per_le[le] = per_le.get(le, 0.0) + s.value
        elif s.name.endswith("_sum"):
            sums[key] = sums.get(key, 0.0) + s.value * scale
        elif s.name.endswith("_count"):
            counts[key] = counts.get(key, 0.0) + s.value
        elif "quantile" in s.labels:
            quantiles.setdefault(key, {})[float(s.labels["quantile"])] = s.value * scale
        else:
            gauges[key] = s.value * scale
    for key in set(quantiles) | set(buckets) | set(sums) | set(gauges):
        value, how = None, ""
        if stat == "mean" and key in sums and counts.get(key):
            value, how = sums[key] / counts[key], "mean"
        if value is None and quantiles.get(key):
            q = min(quantiles[key], key=lambda x: abs(x - q_wanted))
            value, how = quantiles[key][q], f"quantile {q}"
        elif value is None and key in buckets:
            value, how = histogram_quantile(q_wanted, buckets[key].items()), f"histogram q{q_wanted}"
        if value is None and key in sums and counts.get(key):
            value, how = sums[key] / counts[key], "mean"
        if value is None and key in gauges:
            value, how = gauges[key], "gauge"
        if value is not None and math.isfinite(value):
            m.stages_s[key] = value
            if how not in exact:
                m.notes.append(f"{key}: no {stat} in the metrics, used {how}")
    _worker_overhead_as_transport(m)
    return m


def _worker_overhead_as_transport(m: Measurement) -> None:
    """The daemon's worker times the whole job (`inference`) around the policy's own stages; the
    difference is moving the observation and the chunk across the worker pipe: transport.
    Percentiles do not add, so this is an estimate; it is never negative."""
    s = m.stages_s
    if "transport" in s or "inference" not in s:
        return
    step = s.get("solver_loop") or s.get("denoise_step", 0.0) * (m.steps or 10)
    parts = (
        s.get("preprocess", 0.0)
        + s.get("vision", 0.0)
        + s.get("prefix", 0.0)
        + step
        + s.get("postprocess", 0.0)
    )
    if parts > 0:
        s["transport"] = max(0.0, s["inference"] - parts)
        m.notes.append(f"transport: worker time minus its stages, {s['transport'] * 1e3:.2f} ms")


def _robot_param(m: Measurement, base: str, value: float) -> None:
    """Pick up the robot side the daemon exports, whatever it names them."""
    if not math.isfinite(value):
        return
    if base in ("control_rate_hz", "control_rate", "rate_hz"):
        m.rate_hz = value
    elif base in ("control_period_seconds", "control_period_s", "period_seconds"):
        m.rate_hz = 1.0 / value if value > 0 else None
    elif base in ("chunk_size", "horizon", "prediction_horizon", "rtc_horizon"):
        m.horizon = int(value)
    elif base in ("execution_horizon", "exec_horizon", "rtc_execution_horizon", "rtc_exec_horizon"):
        m.exec_horizon = int(value)
    elif base in ("num_steps", "flow_steps", "denoise_steps", "solver_steps"):
        m.steps = int(value)
    elif base in ("rtc_delay_ticks", "rtc_delay", "delay_ticks"):
        m.delay_ticks = value


def fetch_metrics(url: str, timeout_s: float = 5.0) -> str:
    if not re.match(r"^https?://", url):
        url = "http://" + url
    if not urllib.parse.urlparse(url).path.strip("/"):
        url = url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.read().decode("utf-8", "replace")
    except http.client.HTTPException as e:  # not OSError: e.g. the daemon's ZeroMQ port given by mistake
        raise OSError(f"not an HTTP endpoint ({type(e).__name__})") from None
