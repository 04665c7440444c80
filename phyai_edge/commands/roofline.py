"""`phyai-edge roofline`: what bounds the control rate, from measurements or predictions."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from phyai_edge.extras import install_hint
from phyai_edge.roofline.sources import STATS

HELP = "what bounds the control rate: model, processing, transport or robot"
DESCRIPTION = """\
Control-Time Roofline: given per-stage times (measured or predicted) and the robot's rate and
horizons, report the RTC inference delay d = ceil(L / T) (L: from the tick an inference starts to
the tick its chunk is adopted, as the daemon counts it; camera age is not in it), whether the
executing chunk lasts until the next one lands (max(s, d) + d <= H; with d > s the daemon replans
every d ticks), the achievable control and chunk rates, which term binds (inference, processing,
transport or the physical loop), the margin, and how old the observation is when the new chunk's
first action runs (camera age + d x T); draw the roofline chart.

Sources (any mix; with none, every device in the table is predicted):
  --bench FILE      a `phyai-edge bench --json` file (measured point; also calibrates predictions)
  --metrics URL     a running daemon's Prometheus endpoint, e.g. http://127.0.0.1:9100/metrics
                    (its model, rate, H and s too: --rate, --horizon, --exec-horizon override them)
  --device NAME     predict from FLOP/byte counts and the device table ('all' for every device)

Examples:
  phyai-edge roofline --device orin --device rtx-pro-6000 --rate 50 --horizon 50
  phyai-edge roofline --bench h200.json --device all --plot roofline.png --json out.json
  phyai-edge roofline --device thor --precision fp8 --steps 5 --views 2
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("sources")
    src.add_argument(
        "--bench",
        action="append",
        default=[],
        metavar="FILE",
        help="bench JSON or pi05_gpu.py report, FILE#KEY,... selects entries (repeatable)",
    )
    src.add_argument(
        "--metrics", action="append", default=[], metavar="URL", help="daemon /metrics URL (repeatable)"
    )
    src.add_argument(
        "--device", action="append", default=[], metavar="NAME",
        help="device to predict (a key or name from --list-devices, e.g. orin), or 'all' (repeatable)"
    )
    src.add_argument("--list-devices", action="store_true", help="print the device table and exit")
    src.add_argument("--stat", default="p90", help=f"statistic of measured stage times ({', '.join(STATS)})")

    model = p.add_argument_group("model (what-if)")
    model.add_argument("--adapter", default=None, help="adapter name (default: the bench's, else pi05)")
    model.add_argument("--preset", default=None, help="adapter preset (default: the bench's, else full)")
    model.add_argument("--batch", type=int, default=None, help="observations per inference (default 1)")
    model.add_argument("--views", type=int, default=None, help="camera views (default: adapter's)")
    model.add_argument(
        "--prompt-tokens", type=int, default=None, help="prompt tokens (default: padded length)"
    )
    model.add_argument("--steps", type=int, default=None, help="flow-matching steps N (default: adapter's)")
    model.add_argument("--precision", default=None, choices=["bf16", "fp16", "fp8", "int8"],
                       help="weight and GEMM precision (default: the bench's, else bf16; predictions "
                            "of an fp32 bench stay bf16, the device table has no fp32 peaks)")

    robot = p.add_argument_group("robot")
    # The first measured source's robot side: a bench's rate_hz / horizon / exec_horizon keys, or
    # a daemon's phyai_model_info labels of those names (--metrics); a flag given wins over it.
    robot.add_argument(
        "--rate", type=float, default=None,
        help="control rate in Hz (default: the first measured source's rate_hz, e.g. the daemon's "
             "robot.control_hz, else 50)"
    )
    robot.add_argument(
        "--physical-rate", type=float, default=None, help="task's max loop rate (default: the control rate)"
    )
    robot.add_argument(
        "--horizon", type=int, default=None,
        help="prediction horizon H (default: the first measured source's horizon, e.g. the daemon's "
             "chunking.horizon, else the adapter's chunk size)"
    )
    robot.add_argument(
        "--exec-horizon", type=int, default=None,
        help="execution horizon s (default: the first measured source's exec_horizon, e.g. the "
             "daemon's chunking.execution_horizon, else free)"
    )
    # Measured sources keep their own value unless the flag is given; predictions cannot see these.
    robot.add_argument("--camera-age-ms", type=float, default=None,
                       help="age of the frame when the observation is assembled: only makes the "
                            "observation older, not in L or d (default: measured, else 0)")
    robot.add_argument("--preprocess-ms", type=float, default=None,
                       help="override / supply preprocess time (default: measured, else 0)")
    robot.add_argument(
        "--postprocess-ms", type=float, default=None,
        help="override / supply postprocess time (default: measured, else 0)"
    )
    robot.add_argument(
        "--transport-ms", type=float, default=None,
        help="observation to the worker and chunk back, counted in L (default: measured, else 0)"
    )

    cal = p.add_argument_group("calibration")
    cal.add_argument(
        "--calibrate", default=None, metavar="FILE",
        help="bench JSON to fit efficiency factors on (default: the first measured source on a known GPU)"
    )
    cal.add_argument(
        "--efficiency-compute", type=float, default=None,
        help="fraction of peak FLOPs (default: fitted by the calibration, else 0.5)"
    )
    cal.add_argument(
        "--efficiency-bandwidth", type=float, default=None,
        help="fraction of peak bandwidth (default: fitted by the calibration, else 0.7)"
    )

    out = p.add_argument_group("output")
    out.add_argument(
        "--plot", default=None, metavar="PNG",
        help="chart path (default roofline.png; needs matplotlib, otherwise only the table is printed)",
    )
    out.add_argument("--no-plot", action="store_true", help="skip the chart")
    out.add_argument(
        "--json", default=None, metavar="PATH", help="write results as JSON ('-' for stdout only)"
    )
    out.add_argument("--stages", action="store_true", help="per-stage FLOP / byte / time breakdown")


@dataclass
class Point:
    label: str
    kind: str  # "measured" | "predicted"
    times: Any  # StageTimes
    device: str | None = None
    stages: dict[str, Any] = field(default_factory=dict)  # stage -> StagePrediction (predicted only)
    notes: list[str] = field(default_factory=list)
    result: Any = None
    precision: str | None = None  # what the times are at (None: a run that did not say)


def _ms(v: float | None) -> float | None:
    return None if v is None else v / 1e3


def _model_args(args: argparse.Namespace, meas: Any = None) -> dict[str, Any]:
    """Effective adapter / shape settings: explicit flags, else the measured run's, else defaults."""
    from phyai_edge.roofline.costs import cost_model

    adapter = args.adapter or (meas.adapter if meas else None) or "pi05"
    cm = cost_model(adapter)
    preset = args.preset or (meas.preset if meas else None) or "full"
    config = cm.load_config(preset)
    d = cm.defaults(config)
    return {
        "adapter": adapter,
        "preset": preset,
        "config": config,
        "batch": args.batch or (meas.batch if meas else None) or 1,
        "views": args.views or (meas.views if meas else None) or d["views"],
        "prompt_tokens": args.prompt_tokens
        if args.prompt_tokens is not None
        else (meas.prompt_tokens if meas and meas.prompt_tokens is not None else d["prompt_tokens"]),
        "steps": args.steps or (meas.steps if meas else None) or d["steps"],
        # A run's own precision even where it is not modelled (fp32): the header names what ran,
        # and `_prediction_precision` picks what devices are predicted at.
        "precision": args.precision or (meas.precision if meas else None) or "bf16",
        "horizon": d["horizon"],
    }


def _as_measured(args: argparse.Namespace) -> argparse.Namespace:
    """The flags with the what-if shape cleared, so the measured run's own shape is used."""
    shape = dict.fromkeys(("batch", "views", "steps", "precision", "prompt_tokens"))
    return argparse.Namespace(**{**vars(args), **shape})


def _costs(m: dict[str, Any], eager: bool = False) -> dict[str, Any]:
    """Stage costs for the settings in `m`. `eager`: the run had no precomputed time tables
    (the eager backend runs the adaptive-norm GEMMs every step); only PI0.5 has that option."""
    from phyai_edge.roofline.costs import stage_costs

    options = {"time_tables_precomputed": False} if eager and m["adapter"] == "pi05" else {}
    return stage_costs(
        m["adapter"],
        m["config"],
        batch=m["batch"],
        views=m["views"],
        prompt_tokens=m["prompt_tokens"],
        steps=m["steps"],
        precision=m["precision"],
        **options,
    )


def _measured_model_s(meas: Any, steps: int) -> dict[str, float]:
    s = meas.stages_s
    step = s.get("denoise_step") or (s["solver_loop"] / steps if s.get("solver_loop") else 0.0)
    return {"embed_images": s.get("vision", 0.0), "encode_prefix": s.get("prefix", 0.0), "denoise_step": step}


def _calibration_from(meas: Any, args: argparse.Namespace, notes: list[str]) -> Any:
    from phyai_edge.roofline.devices import find_device
    from phyai_edge.roofline.predict import calibrate

    if not meas.device:
        notes.append(f"{meas.label}: not used for calibration (no device in it)")
        return None
    if not meas.calibratable:  # its source's note already says why (a precision not modelled)
        return None
    try:
        dev = find_device(meas.device)
        # Calibrate on the run as it was measured, not on the what-if shape.
        m = _model_args(_as_measured(args), meas)
        measured = _measured_model_s(meas, m["steps"])
        if not any(measured.values()):
            notes.append(f"{meas.label}: no per-stage model times, cannot calibrate on it")
            return None
        costs = _costs(m, eager=meas.backend == "eager")
        return calibrate(costs, dev, m["precision"], measured, label=f"{meas.label}")
    except ValueError as e:
        notes.append(f"{meas.label}: not used for calibration ({e})")
        return None


def _prediction_precision(margs: dict[str, Any]) -> str:
    """What devices are predicted at: the requested / measured precision where the cost model has
    it, else bf16 (an fp32 run's shape predicted at bf16, and the header says so)."""
    from phyai_edge.roofline.costs import PRECISIONS

    return margs["precision"] if margs["precision"] in PRECISIONS else "bf16"


def _what_if(meas: Any, args: argparse.Namespace, notes: list[str]) -> tuple[Any, str | None]:
    """Measured StageTimes, with model stages rescaled when a what-if flag changes the shape:
    measured x predicted(new) / predicted(as measured), on the measured device; and the precision
    the times are then at."""
    from phyai_edge.roofline.devices import find_device
    from phyai_edge.roofline.predict import predict_stages

    times = meas.stage_times(steps=args.steps)
    changed = any(getattr(args, k) is not None for k in ("batch", "views", "prompt_tokens", "precision"))
    if not changed:
        return times, meas.precision
    if meas.precision is not None and meas.modelled_precision is None:
        # Ratios of predicted times need the run's own precision counted; taken at bf16 they
        # would treat an fp32 run as a bf16 one.
        notes.append(f"{meas.label}: what-if not applied (the run is {meas.precision}, which the cost model "
                     "does not count)")
        return times, meas.precision
    try:
        base = _model_args(_as_measured(args), meas)
        new = _model_args(args, meas)
        dev_name = meas.device or "h200-sxm"
        if not meas.device:
            notes.append(f"{meas.label}: device unknown, what-if ratios taken on H200 SXM")
        dev = find_device(dev_name)
        eager = meas.backend == "eager"
        p0 = predict_stages(_costs(base, eager), dev, base["precision"])
        p1 = predict_stages(_costs(new, eager), dev, new["precision"])
    except ValueError as e:
        notes.append(f"{meas.label}: what-if not applied ({e})")
        return times, meas.precision

    def k(stage: str) -> float:
        return p1[stage].time_s / p0[stage].time_s if p0[stage].time_s else 1.0

    notes.append(f"{meas.label}: model stages rescaled for the what-if shape (ratios of predicted times)")
    rescaled = replace(
        times,
        vision_s=times.vision_s * k("embed_images"),
        prefix_s=times.prefix_s * k("encode_prefix"),
        denoise_step_s=times.denoise_step_s * k("denoise_step"),
    )
    return rescaled, new["precision"]


def _apply_overheads(times: Any, args: argparse.Namespace) -> Any:
    """Explicit CLI overheads override what the measured source had; absent flags keep it."""
    kw = {}
    for flag, attr in (
        ("camera_age_ms", "camera_age_s"),
        ("preprocess_ms", "preprocess_s"),
        ("postprocess_ms", "postprocess_s"),
        ("transport_ms", "transport_s"),
    ):
        v = getattr(args, flag)
        if v is not None:
            kw[attr] = v / 1e3
    return replace(times, **kw)


def _device_keys(names: list[str]) -> list[str]:
    from phyai_edge.roofline.devices import DEVICES, find_device

    keys: list[str] = []
    for n in names:
        for part in n.split(","):
            if not part.strip():
                continue
            if part.strip().lower() == "all":
                keys.extend(DEVICES)
            else:
                keys.append(find_device(part).key)
    return list(dict.fromkeys(keys))


def list_devices() -> str:
    from phyai_edge.roofline.devices import DEVICES

    lines = [f"{'key':22} {'name':26} {'bf16':>8} {'fp16':>8} {'fp8':>8} {'int8':>8} {'GB/s':>7} {'GB':>5}"]
    for d in DEVICES.values():

        def cell(p: str, d: Any = d) -> str:
            peak = d.peaks.get(p)
            return "-" if peak is None else f"{peak.dense:g}"

        lines.append(
            f"{d.key:22} {d.name:26} {cell('bf16'):>8} {cell('fp16'):>8} {cell('fp8'):>8} {cell('int8'):>8} "
            f"{d.bandwidth_gbs:>7g} {d.memory_gb:>5g}"
        )
    lines.append("dense tensor peaks in TFLOPS / TOPS; sources and sparse->dense notes:")
    for d in DEVICES.values():
        lines.append(f"  {d.key}: {d.source}")
        for p, peak in d.peaks.items():
            if peak is not None and peak.note:
                sparse = " sparse" if peak.quoted_sparse else " dense"
                lines.append(
                    f"      {p}: {peak.note} (from vendor figure {peak.quoted:g} {peak.quoted_precision}{sparse})"
                )
    return "\n".join(lines)


def _precision_text(points: list[Point], default: str) -> str:
    """The header's precision: one name when every point is at it, else per kind (an fp32 bench
    beside bf16 predictions reads "fp32 measured, bf16 predicted")."""
    by_kind = {
        kind: list(dict.fromkeys(p.precision or default for p in points if p.kind == kind))
        for kind in ("measured", "predicted")
    }
    every = {*by_kind["measured"], *by_kind["predicted"]}
    if len(every) <= 1:
        return next(iter(every), default)
    return ", ".join(f"{'/'.join(v)} {kind}" for kind, v in by_kind.items() if v)


def _fmt_table(points: list[Point]) -> str:
    head = (
        f"{'source':42} {'L ms':>7} {'infer':>7} {'proc':>6} {'xport':>6} {'d':>3} {'s':>3} {'RTC':>4} "
        f"{'f_max Hz':>9} {'chunk Hz':>9} {'binds':>10} {'headroom ms':>11} {'GPU duty':>8} {'obs age ms':>10}"
    )
    rows = [head, "-" * len(head)]
    for p in points:
        r, t = p.result, p.times
        rows.append(
            f"{p.label[:42]:42} {r.latency_s * 1e3:7.1f} {t.inference_s * 1e3:7.1f} "
            f"{t.group_s('processing') * 1e3:6.1f} {t.group_s('transport') * 1e3:6.1f} {r.delay_ticks:3d} "
            f"{r.exec_horizon:3d} {'ok' if r.rtc_ok else 'FAIL':>4} {r.achievable_rate_hz:9.1f} "
            f"{r.chunk_rate_hz:9.2f} {r.binding:>10} {r.latency_headroom_s * 1e3:11.1f} {r.gpu_duty:8.0%} "
            f"{r.observation_age_s * 1e3:10.1f}"
        )
    return "\n".join(rows)


def _fmt_stages(p: Point) -> str:
    rows = [f"  {p.label}: per-stage prediction"]
    rows.append(
        f"    {'stage':14} {'GFLOP':>9} {'MB':>9} {'FLOP/B':>7} {'compute ms':>10} {'memory ms':>9} {'bound':>7} {'ms':>8}"
    )
    for name, sp in p.stages.items():
        c = sp.cost
        rows.append(
            f"    {name:14} {c.flops / 1e9:9.1f} {c.bytes / 1e6:9.1f} {c.intensity:7.0f} {sp.compute_s * 1e3:10.2f} "
            f"{sp.memory_s * 1e3:9.2f} {sp.bound:>7} {sp.time_s * 1e3:8.2f}"
        )
    t = p.times
    rows.append(f"    {'solver_loop':14} {t.steps} x denoise_step = {t.denoise_total_s * 1e3:.2f} ms")
    return "\n".join(rows)


def _verdict(p: Point) -> str:
    r = p.result
    window = f"[{r.s_window[0]}, {r.s_window[1]}]" if r.s_window[0] <= r.s_window[1] else "empty"
    share = r.shares.get("inference", 0.0)
    if r.binding == "physical":
        # L* is 0 where s_cap is (s = H, or H = 1): only L = 0 is physical-bound then
        of_ridge = f"{r.latency_s / r.ridge_latency_s:.0%}" if r.ridge_latency_s > 0 else "all"
        why = (
            f"the physical loop binds ({r.physical_rate_hz:g} Hz); L = {r.latency_s * 1e3:.0f} ms is "
            f"{of_ridge} of the ridge L* = {r.ridge_latency_s * 1e3:.0f} ms"
        )
    else:
        why = (
            f"{r.binding} binds: L = {r.latency_s * 1e3:.0f} ms > L* = {r.ridge_latency_s * 1e3:.0f} ms, "
            f"so at most {r.achievable_rate_hz:.1f} Hz"
        )
    slipped = (f" (the fixed s = {r.exec_horizon} is below d: the daemon replans every {r.delay_ticks} ticks)"
               if not r.d_le_s else "")
    age = (
        f"the observation is {r.observation_age_s * 1e3:.0f} ms old when the new chunk's first action runs "
        f"(camera age {p.times.camera_age_s * 1e3:.0f} ms + d x T)"
    )
    return (
        f"- {p.label}: {why}; d = {r.delay_ticks} ticks, valid s {window}{slipped}, inference is {share:.0%} of L, "
        f"replanning at most {r.max_chunk_rate_hz:.2f} chunks/s; {age}; "
        f"{'feasible' if r.feasible else 'NOT feasible'} at {r.rate_hz:g} Hz"
    )


def _check_fractions(*checks: tuple[str, float | None]) -> None:
    """`fail` at the first efficiency flag outside (0, 1.5], the range `Efficiency` accepts."""
    from phyai_edge.commands.common import fail

    for flag, value in checks:
        if value is not None and not 0 < value <= 1.5:  # NaN too
            fail("roofline", f"{flag} {value:g}: expected a fraction of peak in (0, 1.5]")


def main(args: argparse.Namespace) -> int:
    from phyai_edge.commands.common import check_at_least, check_finite, check_positive, fail

    # A zero here became the default (`args.rate or ...`): --rate 0 analysed 50 Hz without a word.
    check_at_least("roofline", ("--batch", args.batch, 1), ("--views", args.views, 1),
                   ("--prompt-tokens", args.prompt_tokens, 1), ("--steps", args.steps, 1),
                   ("--horizon", args.horizon, 1), ("--exec-horizon", args.exec_horizon, 1))
    check_positive("roofline", ("--rate", args.rate), ("--physical-rate", args.physical_rate))
    # A negative time crashed in StageTimes, and inf in the ceiling of L / T.
    check_finite("roofline", *((flag, value, 0, "milliseconds") for flag, value in (
        ("--camera-age-ms", args.camera_age_ms), ("--preprocess-ms", args.preprocess_ms),
        ("--postprocess-ms", args.postprocess_ms), ("--transport-ms", args.transport_ms))))
    _check_fractions(("--efficiency-compute", args.efficiency_compute),
                     ("--efficiency-bandwidth", args.efficiency_bandwidth))
    if args.stat not in STATS:
        fail("roofline", f"--stat {args.stat}: expected one of {', '.join(STATS)}")
    args.plot_given = args.plot is not None
    args.plot = args.plot or "roofline.png"
    from phyai_edge.roofline.costs import cost_model
    from phyai_edge.roofline.devices import DEVICES
    from phyai_edge.roofline.model import RobotParams, analyze
    from phyai_edge.roofline.predict import (
        DEFAULT_EFFICIENCY,
        Efficiency,
        Overheads,
        predict_stages,
        stage_times,
    )
    from phyai_edge.roofline.sources import fetch_metrics, load_bench, measurement_from_metrics

    if args.list_devices:
        print(list_devices())
        return 0
    notes: list[str] = []
    try:
        measurements = [m for path in args.bench for m in load_bench(path, stat=args.stat)]
        for url in args.metrics:
            try:
                text = fetch_metrics(url)
            except OSError as e:
                print(f"phyai-edge roofline: cannot read metrics from {url}: {e}", file=sys.stderr)
                return 2
            m = measurement_from_metrics(text, stat=args.stat, label=f"daemon {url} (measured)")
            if not m.stages_s:
                print(f"phyai-edge roofline: {url} exports no stage timings this tool recognises", file=sys.stderr)
                return 2
            measurements.append(m)
        device_keys = _device_keys(args.device)
    except (OSError, ValueError) as e:
        print(f"phyai-edge roofline: {e}", file=sys.stderr)
        return 2
    if not measurements and not device_keys:
        device_keys = list(DEVICES)
    for m in measurements:
        notes.extend(f"{m.label}: {n}" for n in m.notes)
        if m.first_step_beside_prefix:
            notes.append(f"{m.label}: the first flow step ran beside the prefix (early_step): its share is in the "
                         "measured prefix, so one step less is booked there")

    # Efficiency: explicit calibration file, else the first measured run on a known device.
    eff = DEFAULT_EFFICIENCY
    calib = None
    try:
        cal_runs = load_bench(args.calibrate, stat=args.stat) if args.calibrate else measurements
    except (OSError, ValueError) as e:
        print(f"phyai-edge roofline: --calibrate: {e}", file=sys.stderr)
        return 2
    cal_notes: list[str] = []
    for meas in cal_runs:
        if meas.stages_s and (calib := _calibration_from(meas, args, cal_notes)) is not None:
            eff = calib.efficiency
            break
    if args.calibrate and calib is None:
        # Asked for by name: the default factors in its place would look like a calibration.
        why = "; ".join(cal_notes) or "precision {} not modelled".format(
            ", ".join(sorted({str(m.precision) for m in cal_runs})))
        fail("roofline", f"--calibrate {args.calibrate}: no run in it can calibrate ({why})")
    notes.extend(cal_notes)
    if args.efficiency_compute is not None or args.efficiency_bandwidth is not None:
        try:
            eff = Efficiency(
                args.efficiency_compute if args.efficiency_compute is not None else eff.compute,
                args.efficiency_bandwidth if args.efficiency_bandwidth is not None else eff.bandwidth,
                "set on the command line",
            )
        except ValueError as e:
            print(f"phyai-edge roofline: {e}", file=sys.stderr)
            return 2
    if eff.compute < 0.2 or eff.bandwidth < 0.2:
        notes.append(
            f"calibrated efficiency is low (compute {eff.compute:.2f}, bandwidth {eff.bandwidth:.2f}): the "
            "measured run is likely launch-overhead bound, which does not transfer to slower devices as a ratio"
        )

    try:
        first = measurements[0] if measurements else None
        margs = _model_args(args, first)
        cm = cost_model(margs["adapter"])
        rate = args.rate or (first.rate_hz if first and first.rate_hz else None) or 50.0
        horizon = args.horizon or (first.horizon if first and first.horizon else None) or margs["horizon"]
        if horizon > margs["horizon"]:
            # the daemon cuts a chunk to the policy's own length: a longer H is not one it can run
            raise ValueError(f"--horizon {horizon}: longer than the model's chunk ({margs['horizon']} actions)")
        exec_h = args.exec_horizon or (first.exec_horizon if first else None)
        robot = RobotParams.from_rates(rate, horizon, exec_h, args.physical_rate)
    except ValueError as e:
        print(f"phyai-edge roofline: {e}", file=sys.stderr)
        return 2

    points: list[Point] = []
    for meas in measurements:
        pnotes: list[str] = []
        times, precision = _what_if(meas, args, pnotes)
        points.append(Point(meas.label, "measured", _apply_overheads(times, args), device=meas.device,
                            notes=pnotes, precision=precision))
        notes.extend(pnotes)

    overheads = Overheads(
        camera_age_s=_ms(args.camera_age_ms) or 0.0,
        preprocess_s=_ms(args.preprocess_ms) or 0.0,
        postprocess_s=_ms(args.postprocess_ms) or 0.0,
        transport_s=_ms(args.transport_ms) or 0.0,
    )
    pred_margs = {**margs, "precision": _prediction_precision(margs)}
    if device_keys and pred_margs["precision"] != margs["precision"]:
        notes.append(f"predictions at {pred_margs['precision']}: the device table has no {margs['precision']} "
                     "peaks (the measured run's precision)")
    costs = _costs(pred_margs) if device_keys else {}
    weights = cm.weights_bytes(margs["config"], pred_margs["precision"]) if device_keys else 0.0
    for key in device_keys:
        dev = DEVICES[key]
        if not dev.supports(pred_margs["precision"]):
            notes.append(
                f"{dev.name}: skipped, no {pred_margs['precision']} tensor cores ({', '.join(dev.precisions())})"
            )
            continue
        preds = predict_stages(costs, dev, pred_margs["precision"], eff)
        times = stage_times(preds, margs["steps"], overheads)
        pnotes = []
        if weights > dev.memory_gb * 1e9:
            pnotes.append(f"{dev.name}: weights ({weights / 1e9:.1f} GB) do not fit in {dev.memory_gb:g} GB")
        points.append(
            Point(f"{dev.name} (pred)", "predicted", times, device=dev.key, stages=preds, notes=pnotes,
                  precision=pred_margs["precision"])
        )
        notes.extend(pnotes)

    for p in points:
        p.result = analyze(p.times, robot)
    for p, meas in zip(points, measurements):
        if meas.delay_ticks is not None:
            # The daemon's own d is the ground truth the model's ceil(L / T) should match.
            n = f"{p.label}: daemon measured d = {meas.delay_ticks:g} ticks, model d = {p.result.delay_ticks}"
            p.notes.append(n)
            notes.append(n)

    s_txt = "free" if robot.exec_horizon is None else str(robot.exec_horizon)
    title = (
        f"{margs['adapter']}/{margs['preset']}  batch {margs['batch']}  views {margs['views']}  steps {margs['steps']}  "
        f"{_precision_text(points, pred_margs['precision'])}  |  {rate:g} Hz  H = {robot.horizon}  s = {s_txt}"
    )
    report = {
        "title": title,
        "model": {k: v for k, v in margs.items() if k != "config"},
        "robot": {
            "rate_hz": rate,
            "control_period_ms": robot.control_period_s * 1e3,
            "physical_rate_hz": 1.0 / robot.t_phys,
            "horizon": robot.horizon,
            "exec_horizon": robot.exec_horizon,
            "s_cap": robot.s_cap,
            "ridge_latency_ms": robot.s_cap * robot.t_phys * 1e3,
        },
        "efficiency": {"compute": eff.compute, "bandwidth": eff.bandwidth, "source": eff.source},
        "calibration": calib.per_stage if calib else None,
        "weights_gb": weights / 1e9 if weights else None,
        "points": [
            {
                "label": p.label,
                "kind": p.kind,
                "device": p.device,
                "precision": p.precision,
                "stage_times_ms": p.times.to_ms_dict(),
                "result": p.result.to_dict(),
                "stages": {k: v.to_dict() for k, v in p.stages.items()},
                "notes": p.notes,
            }
            for p in points
        ],
        "notes": notes,
    }

    plot_path = None
    plotting = not args.no_plot and bool(points)
    if plotting and importlib.util.find_spec("matplotlib") is None:
        # The table is the answer; the chart is optional (robot computers often lack matplotlib).
        if args.plot_given:
            raise SystemExit(f"--plot needs matplotlib: {install_hint('matplotlib')} (or pass --no-plot)")
        notes.append(f"no chart: matplotlib is not installed ({install_hint('matplotlib')})")
        plotting = False
    if plotting:
        from phyai_edge.roofline.plot import PlotPoint, plot_roofline

        try:
            plot_path = plot_roofline(
                [PlotPoint(p.label, p.result, p.kind == "measured") for p in points],
                robot,
                args.plot,
                title=f"Control-Time Roofline\n{title}\npredictions at {eff.compute:.2f} / {eff.bandwidth:.2f} "
                f"of peak FLOPs / bandwidth, {eff.source.split(' (')[0]}",
            )
        except OSError as e:
            fail("roofline", f"--plot {args.plot}: cannot write it ({e.strerror or e})")
        report["plot"] = str(plot_path)

    if args.json and args.json != "-":
        try:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        except OSError as e:
            fail("roofline", f"--json {args.json}: cannot write it ({e.strerror or e})")
    if args.json == "-":
        print(json.dumps(report, indent=2))
        return 0

    print(f"Control-Time Roofline  {title}")
    print(
        f"T = {robot.control_period_s * 1e3:.2f} ms, physical {1.0 / robot.t_phys:g} Hz, s_cap = {robot.s_cap} ticks, "
        f"ridge L* = {robot.s_cap * robot.t_phys * 1e3:.0f} ms; efficiency compute {eff.compute:.2f}, "
        f"bandwidth {eff.bandwidth:.2f}, {eff.source}"
    )
    print()
    print(_fmt_table(points))
    print()
    for p in points:
        print(_verdict(p))
    if args.stages or sum(p.kind == "predicted" for p in points) <= 2:
        for p in points:
            if p.stages:
                print()
                print(_fmt_stages(p))
    if notes:
        print()
        print("notes:")
        for n in dict.fromkeys(notes):
            print(f"  {n}")
    if plot_path:
        print(f"\nplot: {plot_path}")
    if args.json and args.json != "-":
        print(f"json: {args.json}")
    return 0
