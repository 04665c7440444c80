"""The roofline chart: achievable control rate against end-to-end latency (log-log).

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
    lo = min([ridge_ms / 30, *[x / 3 for x in lat_ms]])
    hi = max([ridge_ms * 10, *[x * 3 for x in lat_ms]])
    x = np.geomspace(lo, hi, 400)

    fig, ax = plt.subplots(figsize=(9, 6), dpi=110)
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
    sync = robot.horizon / (robot.horizon * robot.t_phys + x / 1e3)
    ax.plot(
        x,
        sync,
        color="grey",
        ls="--",
        lw=1.2,
        label="no RTC: average rate, robot stops for L every H actions",
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

    seen: set[str] = set()
    for i, p in enumerate(points):
        r = p.result
        lx = max(r.latency_s * 1e3, lo)
        y = max(min(r.rate_hz, r.achievable_rate_hz), 1e-3)
        key = f"binds: {r.binding}"
        ax.scatter(
            [lx],
            [y],
            s=70,
            marker="o" if p.measured else "D",
            facecolors=_COLORS.get(r.binding, "black") if p.measured else "white",
            edgecolors=_COLORS.get(r.binding, "black"),
            linewidths=2,
            zorder=5,
            label=None if key in seen else key,
        )
        seen.add(key)
        ax.annotate(
            f"{p.label}\nd={r.delay_ticks}, {r.achievable_rate_hz:.3g} Hz max",
            (lx, y),
            xytext=(8, -14 - 10 * (i % 3)),
            textcoords="offset points",
            fontsize=7.5,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ymin = min(
        [f_phys / 30, *[max(min(p.result.rate_hz, p.result.achievable_rate_hz), 1e-3) / 2 for p in points]]
    )
    ax.set_ylim(ymin, f_phys * 3)
    ax.set_xlabel(
        "end-to-end latency L = camera age + pre + vision + prefix + N·denoise + post + transport (ms)"
    )
    ax.set_ylabel("achievable control rate (Hz)")
    ax.set_title(title or "Control-Time Roofline")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="lower left")
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
    fig.savefig(out)
    plt.close(fig)
    return out
