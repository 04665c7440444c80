"""The roofline chart: achievable control rate against the latency RTC's delay counts (log-log).

matplotlib is imported here only, with the Agg backend, so nothing else in the package (and
nothing on a robot) needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from phyai_edge.roofline.model import RobotParams, RooflineResult

_COLORS = {"physical": "#2a9d8f", "inference": "#e76f51", "processing": "#e9c46a", "transport": "#8d6cab"}


@dataclass(frozen=True)
class PlotPoint:
    label: str
    result: RooflineResult
    measured: bool


def plot_roofline(points: Sequence[PlotPoint], robot: RobotParams, path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    f_phys = 1.0 / robot.t_phys
    s_cap = robot.s_cap
    ridge_ms = s_cap * robot.t_phys * 1e3
    lat_ms = [p.result.latency_s * 1e3 for p in points if p.result.latency_s > 0]
    # The axis spans the ridge; with s_cap = 0 (s = H, or H = 1) there is none (no delay fits and
    # the roof is 0), and a log axis from 0 cannot be drawn: span the physical period instead.
    anchor_ms = ridge_ms if s_cap > 0 else robot.t_phys * 1e3
    lo = min([anchor_ms / 30, *[x / 3 for x in lat_ms]])
    hi = max([anchor_ms * 10, *[x * 3 for x in lat_ms]])
    x = np.geomspace(lo, hi, 400)

    fig, ax = plt.subplots(figsize=(10, 7), dpi=100)
    roof = np.minimum(f_phys, s_cap / (x / 1e3)) if s_cap > 0 else np.zeros_like(x)
    s_txt = "s free" if robot.exec_horizon is None else f"s = {robot.exec_horizon}"
    ax.plot(
        x,
        roof,
        color="black",
        lw=2.5,
        label=f"RTC roof: min(f_phys, s_cap / L), H = {robot.horizon}, {s_txt}",
    )
    ax.axhline(f_phys, color=_COLORS["physical"], ls=":", lw=1)
    # As RooflineResult.sync_rate_hz, but at T = T_phys, as the roof is: the most either runner
    # can do at each latency (the JSON's sync_rate_hz is at the requested period). A fixed s is the
    # stretch executed between two waits.
    stretch = robot.horizon if robot.exec_horizon is None else robot.exec_horizon
    sync = stretch / (stretch * robot.t_phys + x / 1e3)
    ax.plot(
        x,
        sync,
        color="grey",
        ls="--",
        lw=1.2,
        label=f"no RTC at T_phys: average rate, robot stops for L every {'H' if robot.exec_horizon is None else 's'} actions",
    )
    if s_cap > 0:
        ax.axvline(ridge_ms, color="grey", ls=":", lw=1)
        ax.annotate(
            f"ridge L* = s_cap·T_phys = {ridge_ms:.0f} ms",
            (ridge_ms, 0.0),
            xycoords=("data", "axes fraction"),
            xytext=(-4, 40),
            textcoords="offset points",
            rotation=90,
            ha="right",
            va="bottom",
            fontsize=8,
            color="dimgrey",
        )
    ax.annotate(
        f"physical loop {f_phys:g} Hz",
        (lo, f_phys),
        xytext=(4, 4),
        textcoords="offset points",
        fontsize=8,
        color=_COLORS["physical"],
    )
    rate = points[0].result.rate_hz if points else f_phys
    if abs(rate - f_phys) > 1e-9:
        ax.axhline(rate, color="tab:blue", ls="-.", lw=1, label=f"requested {rate:g} Hz")

    # Points crowd on the roof (every fast device sits at f_phys): number them, alternate the
    # numbers above and below the marker, and list the details in a box instead of at the point.
    seen: set[str] = set()
    listing = []
    order = sorted(range(len(points)), key=lambda i: points[i].result.latency_s)
    for rank, i in enumerate(order):
        p = points[i]
        r = p.result
        lx = max(r.latency_s * 1e3, lo)
        y = max(min(r.rate_hz, r.achievable_rate_hz), 1e-3)
        key = f"binds: {r.binding}"
        color = _COLORS.get(r.binding, "black")
        ax.scatter(
            [lx],
            [y],
            s=70,
            marker="o" if p.measured else "D",
            facecolors=color if p.measured else "white",
            edgecolors=color,
            linewidths=2,
            zorder=5,
            label=None if key in seen else key,
        )
        seen.add(key)
        ax.annotate(
            str(rank + 1),
            (lx, y),
            xytext=(0, 9 if rank % 2 == 0 else -17),
            textcoords="offset points",
            ha="center",
            fontsize=8,
            fontweight="bold",
        )
        listing.append(
            f"{rank + 1:>2}  {p.label}: L {r.latency_s * 1e3:.1f} ms, d {r.delay_ticks}, "
            f"max {r.achievable_rate_hz:.3g} Hz, {r.binding}, obs. age {r.observation_age_s * 1e3:.0f} ms"
        )
    if listing:
        ax.text(
            0.01,
            0.01,
            "\n".join(listing),
            transform=ax.transAxes,
            fontsize=7,
            family="monospace",
            va="bottom",
            ha="left",
            bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.85, "edgecolor": "lightgrey"},
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ymin = min(
        [f_phys / 30, *[max(min(p.result.rate_hz, p.result.achievable_rate_hz), 1e-3) / 2 for p in points]]
    )
    ax.set_ylim(ymin / 4, f_phys * 4)  # room below for the listing, above for the legend
    ax.set_xlabel(
        "latency L = pre + vision + prefix + N·denoise + post + transport (ms): inference start -> "
        "chunk adopted; camera age is not in it"
    )
    ax.set_ylabel("achievable control rate (Hz)")
    ax.set_title(title or "Control-Time Roofline")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="upper right")
    ax.text(
        0.99,
        0.01,
        "filled: measured   open: predicted",
        transform=ax.transAxes,
        ha="right",
        va="bottom",
        fontsize=7.5,
        color="dimgrey",
    )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    # Adaptive 256-colour palette when Pillow is there: the chart has few colours, and the
    # file is committed to the docs (~3x smaller than RGBA).
    fig.savefig(out)
    try:
        from PIL import Image

        with Image.open(out) as im:
            small = im.convert("RGB").quantize(colors=256)
        small.save(out, optimize=True)
    except ImportError:
        pass
    plt.close(fig)
    return out
