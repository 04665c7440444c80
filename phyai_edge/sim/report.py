"""What a recorded sim run shows: sequence integrity, latencies, camera age, HOLD behaviour, a
closed loop, and a chart. Also the stage times of the loop in the form `phyai-edge roofline
--bench` reads. Works on the .npz that `phyai-edge sim --log` writes; needs only numpy
(matplotlib for the chart).

Times are CLOCK_MONOTONIC nanoseconds of the one host that runs the sim and the daemon, so the
daemon's header times and the sim's own stamps are directly comparable.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from phyai_edge.control.protocol import Flag
from phyai_edge.roofline.sources import (  # as `roofline --metrics` reads them
    daemon_model,
    positive_count,
    positive_rate,
)

# The joints whose position servos are stiff enough to follow a target within a few steps
# (kp 800-1600 against frictionloss 50-60); forearm roll and the wrists (kp 10-50 against
# frictionloss 30) barely move under position control in gym-aloha's MJCF.
TRACKING_JOINTS = (0, 1, 2, 7, 8, 9)
JOINT_LABELS = ("waist", "shoulder", "elbow")


class SimRun:
    """The arrays of one log, plus its metadata."""

    def __init__(self, data: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        self.d = data
        self.meta = meta
        self.period_s = 1.0 / float(meta.get("control_hz", 50.0))
        self.t0 = int(data["step_ns"][0]) if data["step_ns"].size else 0

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.d[name]
        except KeyError:
            raise AttributeError(name) from None

    def rel_s(self, ns: np.ndarray | int) -> np.ndarray:
        """Seconds since the first control step."""
        return (np.asarray(ns, dtype=np.int64) - self.t0) / 1e9


def load_log(path: str | Path) -> SimRun:
    with np.load(path, allow_pickle=False) as z:
        data = {k: z[k] for k in z.files}
    meta = json.loads(str(data.pop("meta")))
    return SimRun(data, meta)


def stats_ms(values: Any) -> dict[str, float]:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {"n": 0}
    return {
        "n": int(v.size),
        "min_ms": float(v.min()),
        "p50_ms": float(np.percentile(v, 50)),
        "p90_ms": float(np.percentile(v, 90)),
        "p99_ms": float(np.percentile(v, 99)),
        "max_ms": float(v.max()),
        "mean_ms": float(v.mean()),
    }


# ---------------------------------------------------------------- sequence numbers


def sequence_check(run: SimRun) -> dict[str, Any]:
    """Per daemon session: received seqs must be contiguous; applied seqs must be increasing and
    every applied seq one that was received (the sim applies the newest, so it may skip seqs it
    received in the same step, but never an unreceived or older one)."""
    seq, session = run.rx_seq, run.rx_session
    gaps, repeats, lost = 0, 0, 0
    for s in np.unique(session):
        ss = seq[session == s]
        d = np.diff(ss)
        gaps += int(np.count_nonzero(d > 1))
        lost += int(np.sum(d[d > 1] - 1))
        repeats += int(np.count_nonzero(d < 1))
    applied = run.applied_seq[run.applied_seq >= 0]
    received = set(seq.tolist())
    return {
        "received": int(seq.size),
        "sessions": len(np.unique(session)),
        "first_seq": int(seq[0]) if seq.size else -1,
        "last_seq": int(seq[-1]) if seq.size else -1,
        "gaps": gaps,
        "lost": lost,
        "repeats": repeats,
        "contiguous": gaps == 0 and repeats == 0,
        "applied": int(applied.size),
        "applied_increasing": bool(np.all(np.diff(applied) > 0)) if len(np.unique(session)) <= 1 else None,
        "applied_all_received": all(int(a) in received for a in applied),
        "hold_steps": int(np.count_nonzero(run.hold)),
        "superseded": int(seq.size) - int(applied.size) - int(np.count_nonzero(run.rx_flags & int(Flag.HOLD))),
    }


# ---------------------------------------------------------------- timing


def timing(run: SimRun) -> dict[str, Any]:
    T = run.period_s
    out: dict[str, Any] = {}
    steps = run.step_ns
    if steps.size > 1:
        out["rate_hz"] = float((steps.size - 1) / ((steps[-1] - steps[0]) / 1e9))
        out["step_interval"] = stats_ms(np.diff(steps) / 1e6)
        out["step_work"] = stats_ms(run.step_ms)
    out["transport"] = stats_ms((run.rx_recv_ns - run.rx_publish_ns) / 1e6)
    # Arrival to the sim step that applied it: the two clocks' phase, a real part of the latency.
    applied = np.flatnonzero(run.applied_seq >= 0)
    # A restarted daemon numbers from 0 again, so a seq names one message per session: the one a
    # step applied is the newest with that seq received by that step. (One index by seq alone
    # took the last session's message for every session, and a wait of minus the gap between.)
    by_seq: dict[int, list[int]] = {}
    for i, s in enumerate(run.rx_seq):
        by_seq.setdefault(int(s), []).append(i)
    waits, action_lat = [], []
    for k in applied:
        i = next((i for i in reversed(by_seq.get(int(run.applied_seq[k]), [])) if run.rx_step[i] <= k), None)
        if i is not None:
            waits.append((steps[k] - run.rx_recv_ns[i]) / 1e6)
            action_lat.append((steps[k] - run.rx_publish_ns[i]) / 1e6)
    out["wait_for_step"] = stats_ms(waits)
    out["publish_to_apply"] = stats_ms(action_lat)

    fr = run.frame_capture_ns
    if fr.size:
        # Per camera, over the intervals while its stream was on: an outage is not a slow camera,
        # and several cameras on one PUB are not a faster one.
        stops = np.sort(run.event_ns[run.event_kind == "camera_stop"])
        intervals, span = 0, 0
        for cam in np.unique(run.frame_camera):
            c = fr[run.frame_camera == cam]
            # no camera stop in (previous frame, this frame]
            on = np.searchsorted(stops, c[1:], "right") == np.searchsorted(stops, c[:-1], "right")
            intervals += int(np.count_nonzero(on))
            span += int(np.diff(c)[on].sum())
        out["frames"] = int(fr.size)
        out["frame_rate_hz"] = float(intervals / (span / 1e9)) if span > 0 else float("nan")
        out["render"] = stats_ms(run.frame_render_ms)
        out["frame_send"] = stats_ms((run.frame_sent_ns - fr) / 1e6 - run.frame_render_ms)

    # Per adopted chunk: the daemon started inference d ticks before the tick that first
    # published from the chunk (index d, flag CHUNK_START), with an observation whose time is the
    # oldest input's capture time (here: the frame's, matched exactly against what we sent).
    start = (run.rx_flags & int(Flag.CHUNK_START)) != 0
    if not start.any():  # an older daemon without CHUNK_START: the first message of each chunk
        _, first = np.unique(run.rx_chunk, return_index=True)
        start = np.zeros(run.rx_seq.size, bool)
        start[first] = run.rx_chunk[first] > 0
    idx = np.flatnonzero(start & (run.rx_obs_ns > 0))
    ages, delays, obs_to_action, matched = [], [], [], 0
    for i in idx:
        d = int(run.rx_index[i])
        t_start = run.rx_publish_ns[i] - round(d * T * 1e9)
        obs = int(run.rx_obs_ns[i])
        if fr.size:
            j = int(np.argmin(np.abs(fr - obs)))
            if abs(int(fr[j]) - obs) < 10_000:  # within 10 us: the float round trip of the header
                matched += 1
        ages.append((t_start - obs) / 1e6)
        delays.append(d * T * 1e3)
        obs_to_action.append((run.rx_recv_ns[i] - obs) / 1e6)
    out["chunks"] = int(idx.size)
    out["chunks_obs_is_frame"] = matched
    out["camera_age_at_inference"] = stats_ms(ages)
    out["chunk_delay"] = stats_ms(delays)
    out["obs_to_first_action"] = stats_ms(obs_to_action)
    return out


# ---------------------------------------------------------------- HOLD and camera outages


def holds(run: SimRun) -> dict[str, Any]:
    f = run.rx_flags
    by_reason = {}
    for flag in (Flag.STALE, Flag.WARMUP, Flag.STARVED, Flag.ESTOP, Flag.SHUTDOWN, Flag.NONFINITE):
        n = int(np.count_nonzero(((f & int(Flag.HOLD)) != 0) & ((f & int(flag)) != 0)))
        if n:
            by_reason[flag.name.lower()] = n
    return {"hold_messages": int(np.count_nonzero(f & int(Flag.HOLD))), "by_reason": by_reason,
            "clamped": int(np.count_nonzero(f & int(Flag.CLAMPED))), "late": int(np.count_nonzero(f & int(Flag.LATE)))}


def outages(run: SimRun, slack_ms: float | None = None, settle_s: float = 0.5) -> list[dict[str, Any]]:
    """For each camera stop: when the daemon started holding, relative to the last frame we sent
    and to its age limit; whether any motion command was published after the limit (plus
    `slack_ms` for the tick grid and scheduling; default two periods); whether the sim really
    held (target unchanged, stiff joints still after `settle_s`); and how long it took to
    publish policy actions again after the stream came back."""
    kinds, times = run.event_kind, run.event_ns
    max_age_ms = float(run.meta.get("camera_max_age_ms") or 0.0)
    T_ns = round(run.period_s * 1e9)
    pub, flags = run.rx_publish_ns, run.rx_flags
    hold = (flags & int(Flag.HOLD)) != 0
    stale = (flags & int(Flag.STALE)) != 0
    out = []
    for i, kind in enumerate(kinds):
        if kind != "camera_stop":
            continue
        stop = int(times[i])
        later = [int(times[j]) for j in range(i + 1, len(kinds)) if kinds[j] == "camera_start"]
        restart = later[0] if later else None
        before = run.frame_capture_ns[run.frame_capture_ns <= stop]
        last_frame = int(before[-1]) if before.size else stop
        item: dict[str, Any] = {
            "stop_s": float(run.rel_s(stop)),
            "restart_s": float(run.rel_s(restart)) if restart is not None else None,
            "last_frame_s": float(run.rel_s(last_frame)),
            "camera_max_age_ms": max_age_ms,
        }
        window_end = restart if restart is not None else int(pub[-1]) + 1 if pub.size else stop
        first_hold = np.flatnonzero((pub >= stop) & hold & stale & (pub < window_end))
        if first_hold.size:
            k = int(first_hold[0])
            item["hold_after_last_frame_ms"] = (int(pub[k]) - last_frame) / 1e6
            item["hold_after_stop_ms"] = (int(pub[k]) - stop) / 1e6
            # The sim's side of the HOLD: from the step that received it to the restart.
            steps = run.step_ns
            in_hold = (steps >= run.rx_recv_ns[k]) & (steps < window_end)
            settled = in_hold & (steps >= run.rx_recv_ns[k] + round(settle_s * 1e9))
            tgt = run.target[in_hold][:, TRACKING_JOINTS]
            item["hold_steps"] = int(np.count_nonzero(in_hold))
            item["target_changes_during_hold"] = int(np.count_nonzero(np.any(np.diff(tgt, axis=0) != 0, axis=1)))
            q = run.joints[settled][:, TRACKING_JOINTS]
            # Per step the largest move of a stiff joint; the median, because the weakly servoed
            # forearm-roll and wrist joints keep swinging slowly for seconds and drag the others.
            moves = np.abs(np.diff(q, axis=0)).max(axis=1) if len(q) > 1 else None
            item["joint_step_settled_p50_rad"] = float(np.median(moves)) if moves is not None else None
            item["joint_step_settled_max_rad"] = float(moves.max()) if moves is not None else None
        else:
            item["hold_after_last_frame_ms"] = None
        if max_age_ms:
            # Motion commands published after the newest frame had passed its age limit (plus one
            # tick for the daemon's tick grid and one for scheduling on a loaded machine).
            slack_ns = 2 * T_ns if slack_ms is None else round(slack_ms * 1e6)
            limit = last_frame + round(max_age_ms * 1e6) + slack_ns
            item["motion_after_limit"] = int(np.count_nonzero((pub > limit) & (pub < window_end) & ~hold))
        if restart is not None:
            resumed = np.flatnonzero((pub >= restart) & ~hold)
            item["resumed_after_restart_ms"] = (int(pub[resumed[0]]) - restart) / 1e6 if resumed.size else None
        out.append(item)
    return out


# ---------------------------------------------------------------- the loop is closed


def closed_loop(run: SimRun, max_lag: int = 10) -> dict[str, Any]:
    """Do the measured joints follow the commanded targets? Per stiff joint: how far it moved,
    the correlation of target and position, and the lag (steps) at which changes of the target
    best predict changes of the position (positive: the joint follows the command)."""
    tgt = run.target.astype(np.float64)
    q = run.joints.astype(np.float64)
    per_joint = {}
    for j in TRACKING_JOINTS:
        a, b = tgt[:, j], q[:, j]
        moved = float(b.max() - b.min()) if b.size else 0.0
        corr = float(np.corrcoef(a, b)[0, 1]) if a.std() > 1e-6 and b.std() > 1e-6 else float("nan")
        da, db = np.diff(a), np.diff(b)
        best_lag, best = 0, -np.inf
        for lag in range(-max_lag, max_lag + 1):
            x, y = (da[: len(da) - lag], db[lag:]) if lag >= 0 else (da[-lag:], db[: len(db) + lag])
            if x.size > 10 and x.std() > 1e-9 and y.std() > 1e-9:
                c = float(np.corrcoef(x, y)[0, 1])
                if c > best:
                    best_lag, best = lag, c
        per_joint[f"{'left' if j < 7 else 'right'}_{JOINT_LABELS[j % 7]}"] = {
            "range_rad": moved, "corr": corr, "lag_steps": best_lag,
            "lag_corr": best if math.isfinite(best) else float("nan"),
            "rms_tracking_error_rad": float(np.sqrt(np.mean((a - b) ** 2))) if a.size else float("nan"),
        }
    moving = [v for v in per_joint.values() if v["range_rad"] > 0.05]
    # How much the stiff joints move per step while the policy drives them (for comparison with
    # the same number during a HOLD, in `outages`).
    driven = ~run.hold.astype(bool)
    steps_q = np.abs(np.diff(q[:, TRACKING_JOINTS], axis=0))[driven[1:]] if q.shape[0] > 1 else np.zeros((0, 6))
    return {
        "joints": per_joint,
        "driven_joint_step_p50_rad": float(np.percentile(steps_q.max(axis=1), 50)) if steps_q.size else float("nan"),
        "moving_joints": len(moving),
        "median_corr_moving": float(np.median([v["corr"] for v in moving])) if moving else float("nan"),
    }


# ---------------------------------------------------------------- the daemon's metrics


_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)')


def _histograms(text: str) -> dict[tuple[str, str], dict[str, Any]]:
    """Prometheus histograms by (metric, stage label): buckets (le -> cumulative count), sum, count."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m or line.startswith("#"):
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        lab = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        h = out.setdefault((base, lab.get("stage", "")), {"buckets": {}, "sum": 0.0, "count": 0.0})
        try:
            v = float(value)
        except ValueError:
            continue
        if name.endswith("_bucket") and "le" in lab:
            h["buckets"][float(lab["le"])] = v
        elif name.endswith("_sum"):
            h["sum"] = v
        elif name.endswith("_count"):
            h["count"] = v
    return out


def _hist_quantile(q: float, buckets: dict[float, float]) -> float:
    """Linear interpolation inside the bucket holding rank q (Prometheus' histogram_quantile)."""
    items = sorted(buckets.items())
    if not items or items[-1][1] <= 0:
        return float("nan")
    rank = q * items[-1][1]
    prev_le, prev_n = 0.0, 0.0
    for le, n in items:
        if n >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n else 1.0)
        prev_le, prev_n = le, n
    return items[-1][0]


def daemon_inference(metrics_text: str) -> dict[str, dict[str, float]]:
    """Inference times from the daemon's histograms, in ms (quantiles interpolated in buckets)."""
    out = {}
    for (name, stage), h in _histograms(metrics_text).items():
        if name == "phyai_inference_seconds":
            key = "inference"
        elif name == "phyai_inference_stage_seconds" and stage:
            key = stage
        else:
            continue
        if not h["count"]:
            continue
        out[key] = {
            "n": int(h["count"]),
            "mean_ms": 1e3 * h["sum"] / h["count"],
            "p50_ms": 1e3 * _hist_quantile(0.5, h["buckets"]),
            "p90_ms": 1e3 * _hist_quantile(0.9, h["buckets"]),
            "p99_ms": 1e3 * _hist_quantile(0.99, h["buckets"]),
        }
    return out


# ---------------------------------------------------------------- all of it


def analyse(run: SimRun, metrics_text: str | None = None) -> dict[str, Any]:
    result = {
        "meta": {k: v for k, v in run.meta.items() if k != "cameras"},
        "steps": int(run.step_ns.size),
        "sequence": sequence_check(run),
        "timing": timing(run),
        "holds": holds(run),
        "outages": outages(run),
        "closed_loop": closed_loop(run),
    }
    if metrics_text:
        result["daemon_inference"] = daemon_inference(metrics_text)
        model = daemon_model(metrics_text)
        if model:
            result["daemon_model"] = model
    return result


def roofline_bench(result: dict[str, Any]) -> dict[str, Any]:
    """The loop's measured stage times as a bench document for `phyai-edge roofline --bench`.

    What ran (adapter, preset, backend, device, gpu, dtype, precision, views, steps, horizon) and
    the daemon's rate_hz and exec_horizon are its `phyai_model_info` when its metrics were
    captured; without them, or for a label it left out, the tiny CPU preset the sim runs by
    default is assumed, at the sim's control rate, with s left free.

    camera_age: the frame's age when the daemon assembled the observation (render and send
    included); transport: daemon publish -> sim receive of an action, plus the worker's time
    outside the model's stages when those are known; inference: the daemon's own histogram when
    its metrics were captured, else the measured chunk delay (d ticks, an upper bound quantised
    to the period).
    """
    t = result["timing"]
    meta = result.get("meta", {})
    model = result.get("daemon_model", {})
    steps = positive_count(model.get("steps"))

    def pick(s: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in s.items() if k.endswith("_ms")}

    stages: dict[str, Any] = {
        "camera_age": pick(t["camera_age_at_inference"]),
        "transport": pick(t["transport"]),
    }
    inf = result.get("daemon_inference", {})
    if "inference" in inf:
        pre, post = inf.get("preprocess"), inf.get("postprocess")
        if pre and post:
            # The worker's whole-inference time includes pre/post-processing; give the roofline
            # the three parts so it does not count them twice.
            stages["preprocess"] = pick(pre)
            stages["postprocess"] = pick(post)
            stages["inference"] = {k: max(0.0, v - pre.get(k, 0.0) - post.get(k, 0.0))
                                   for k, v in pick(inf["inference"]).items()}
        else:
            stages["inference"] = pick(inf["inference"])
        # The model's own stages, when the engine reported them: the roofline then books vision,
        # prefix and the solver separately instead of one aggregate.
        for stage in ("embed_images", "encode_prefix", "solver_loop", "denoise_step"):
            if stage in inf:
                stages[stage] = pick(inf[stage])
        if any(stage in inf for stage in ("embed_images", "encode_prefix", "solver_loop", "denoise_step")):
            # With the model's stages the roofline ignores the whole-inference aggregate, so the
            # worker's time outside them (observation and chunk across the worker pipe) would be
            # lost: book it as transport, as `phyai-edge roofline --metrics` does.
            stages["transport"] = dict(stages["transport"])
            for k, whole in pick(inf["inference"]).items():
                solver = inf.get("solver_loop", {}).get(k)
                if solver is None:
                    solver = inf.get("denoise_step", {}).get(k, 0.0) * (steps or int(meta.get("steps", 10)))
                parts = solver + sum(inf.get(stage, {}).get(k, 0.0) for stage in
                                     ("preprocess", "embed_images", "encode_prefix", "postprocess"))
                if k in stages["transport"]:
                    stages["transport"][k] += max(0.0, whole - parts)
        source = "daemon metrics"
    else:
        stages["inference"] = pick(t["chunk_delay"])
        source = "chunk delay (upper bound)"
    # The keys `phyai-edge roofline --bench` reads (roofline/sources.py `_fill_run_info`); dtype
    # is a torch name there ("bfloat16" -> bf16), precision (an fp8 bundle's) wins over it, and
    # gpu names the device where device is only "cuda".
    doc: dict[str, Any] = {
        "adapter": model.get("adapter") or "pi05",
        "preset": model.get("preset") or meta.get("preset", "tiny"),
        "device": model.get("device") or meta.get("device", "cpu (phyai-edge sim closed loop)"),
    }
    for key in ("backend", "gpu", "dtype", "precision"):
        if model.get(key):
            doc[key] = model[key]
    doc["batch"] = 1
    views, exec_horizon = positive_count(model.get("views")), positive_count(model.get("exec_horizon"))
    if views:
        doc["views"] = views
    if steps:
        doc["steps"] = steps
    doc["horizon"] = positive_count(model.get("horizon")) or meta.get("horizon", 50)
    doc["rate_hz"] = positive_rate(model.get("rate_hz")) or meta.get("control_hz", 50.0)
    if exec_horizon:  # s; without it the roofline leaves s free
        doc["exec_horizon"] = exec_horizon
    what = "model from the daemon's phyai_model_info" if model else "model assumed (no phyai_model_info)"
    doc["source"] = f"phyai-edge sim --report; inference from {source}; {what}"
    doc["stages"] = stages
    return doc


# ---------------------------------------------------------------- the chart


def _spans(mask: np.ndarray, t: np.ndarray) -> list[tuple[float, float]]:
    spans, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = t[i]
        elif not m and start is not None:
            spans.append((start, t[i]))
            start = None
    if start is not None:
        spans.append((start, t[-1]))
    return spans


def plot_run(run: SimRun, result: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = run.rel_s(run.step_ns)
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True, gridspec_kw={"height_ratios": [1, 1, 1.1]})
    held = _spans(run.hold.astype(bool), t)
    outage = []
    stop = None
    for kind, ns in zip(run.event_kind, run.event_ns):
        if kind == "camera_stop":
            stop = float(run.rel_s(ns))
        elif kind == "camera_start" and stop is not None:
            outage.append((stop, float(run.rel_s(ns))))
            stop = None
    if stop is not None:
        outage.append((stop, float(t[-1])))
    colors = ("C0", "C1", "C2")
    for ax, arm, base in ((axes[0], "left", 0), (axes[1], "right", 7)):
        for c, (j, name) in zip(colors, enumerate(JOINT_LABELS)):
            ax.plot(t, run.target[:, base + j], "--", color=c, lw=1, alpha=0.8)
            ax.plot(t, run.joints[:, base + j], "-", color=c, lw=1.4, label=f"{name}")
        for a, b in held:
            ax.axvspan(a, b, color="0.85", lw=0, zorder=0)
        for a, b in outage:
            ax.axvspan(a, b, color="tomato", alpha=0.15, lw=0, zorder=0)
        ax.set_ylabel(f"{arm} arm [rad]")
        ax.legend(loc="upper right", fontsize=8, ncol=3, title="solid: measured, dashed: target", title_fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_title("phyai-edge sim: ALOHA joints under the daemon (grey: sim holding, red: camera stream off)")

    ax = axes[2]
    ax.plot(run.rel_s(run.rx_recv_ns), (run.rx_recv_ns - run.rx_publish_ns) / 1e6, ".", ms=2, color="C0",
            label="action transport (publish -> sim)")
    if run.step_ms.size:
        ax.plot(t, run.step_ms, ".", ms=2, color="C7", alpha=0.6, label="sim step work (physics, state, render)")
    start = np.flatnonzero((run.rx_flags & int(Flag.CHUNK_START)) != 0)
    if start.size:
        T_ns = run.period_s * 1e9
        t_start = run.rx_publish_ns[start] - run.rx_index[start] * T_ns
        ax.plot(run.rel_s(run.rx_recv_ns[start]), (t_start - run.rx_obs_ns[start]) / 1e6, "o", ms=4, color="C3",
                label="camera age at inference start")
        ax.plot(run.rel_s(run.rx_recv_ns[start]), run.rx_index[start] * run.period_s * 1e3, "s", ms=4, mfc="none",
                color="C2", label="chunk delay d x T (inference)")
    ax.axhline(run.period_s * 1e3, color="k", lw=1, ls=":", label=f"control period {run.period_s * 1e3:.0f} ms")
    inf = result.get("daemon_inference", {}).get("inference")
    if inf:
        ax.axhline(inf["p50_ms"], color="C2", lw=1, ls="--", label=f"daemon inference p50 {inf['p50_ms']:.0f} ms")
    ax.set_yscale("log")
    # Headroom above the data for the legend (log axis: a factor, not an offset).
    ys = [np.asarray(line.get_ydata(), dtype=float) for line in ax.get_lines()]
    top = max([float(np.nanmax(y)) for y in ys if y.size] + [run.period_s * 1e3])
    ax.set_ylim(0.05, top * 60)
    ax.set_ylabel("ms")
    ax.set_xlabel("time since the sim's first step [s]")
    ax.legend(loc="upper left", fontsize=8, ncol=3)
    ax.grid(alpha=0.3, which="both")
    for a, b in outage:
        ax.axvspan(a, b, color="tomato", alpha=0.15, lw=0, zorder=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
