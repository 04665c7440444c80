"""Record a closed-loop run: the daemon (tiny PI0.5) driving `phyai-edge sim`, with one camera
outage, then the report, the chart and the roofline input. Produces what docs/sim.md shows.

    python benchmarks/sim_loop.py --out runs/sim --duration 20 --outage 10:2
    phyai-edge roofline --bench runs/sim/loop_bench.json --rate 50 --horizon 50 --exec-horizon 25
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phyai_edge.sim import launch

# The ALOHA config's loop: 50 Hz, the tiny PI0.5's 50-action chunk, 25 executed per inference.
ROOFLINE_ARGS = ["--rate", "50", "--horizon", "50", "--exec-horizon", "25"]


def wait_for(path: Path, text: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[3]} exited with {proc.returncode}; see {path}")
        time.sleep(0.1)
    raise SystemExit(f"no {text!r} in {path} after {timeout:.0f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/sim", help="folder for logs, the .npz, the chart and the JSON")
    p.add_argument("--duration", type=float, default=20.0, help="seconds the sim runs")
    p.add_argument("--outage", default="10:2", help="camera outage START:LENGTH in seconds ('' for none)")
    p.add_argument("--task", default="transfer_cube")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = out / "loop.toml"
    ports = launch.loop_config(cfg, clock={"priority": 0, "mlock": False})

    daemon = launch.start("run", ["--config", str(cfg), "--no-realtime", "--summary", str(out / "daemon.json")],
                          out / "daemon.log")
    sim = None
    try:
        wait_for(out / "daemon.log", "running", 120, daemon)
        sim_args = ["--config", str(cfg), "--task", args.task, "--duration", str(args.duration),
                    "--log", str(out / "run.npz"), "--summary", str(out / "sim.json")]
        if args.outage:
            sim_args += ["--camera-outage", args.outage]
        sim = launch.start("sim", sim_args, out / "sim.log")
        # The daemon's histograms just before the sim ends cover the whole closed loop; the
        # roofline reads the live endpoint too (inference stages and d, but no camera age).
        time.sleep(max(1.0, args.duration - 2.0))
        (out / "metrics.txt").write_text(launch.fetch_metrics(ports["metrics"]))
        live = subprocess.run(
            [sys.executable, "-m", "phyai_edge", "roofline", "--metrics", f"http://127.0.0.1:{ports['metrics']}/metrics",
             *ROOFLINE_ARGS, "--preset", "tiny", "--no-plot"],
            capture_output=True, text=True, cwd=launch.REPO_ROOT, env=launch._env(), timeout=60,
        )
        (out / "roofline_metrics.txt").write_text(live.stdout + live.stderr)
        sim.wait(args.duration + 60)
    finally:
        if sim is not None:
            launch.stop(sim)
        launch.stop(daemon)
    if sim.returncode != 0:
        raise SystemExit(f"the sim exited with {sim.returncode}; see {out / 'sim.log'}")

    report = [sys.executable, "-m", "phyai_edge", "sim", "--report", str(out / "run.npz"),
              "--metrics-file", str(out / "metrics.txt"), "--plot", str(out / "sim_run.png"),
              "--roofline-json", str(out / "loop_bench.json"), "--summary", str(out / "report.json")]
    subprocess.run(report, check=True, cwd=launch.REPO_ROOT, env=launch._env())
    bench = subprocess.run(
        [sys.executable, "-m", "phyai_edge", "roofline", "--bench", str(out / "loop_bench.json"), *ROOFLINE_ARGS,
         "--plot", str(out / "roofline_sim.png")],
        capture_output=True, text=True, cwd=launch.REPO_ROOT, env=launch._env(), timeout=120,
    )
    (out / "roofline_bench.txt").write_text(bench.stdout + bench.stderr)
    print(bench.stdout)
    result = json.loads((out / "report.json").read_text())
    t, s = result["timing"], result["sequence"]
    print(f"sim {t['rate_hz']:.2f} Hz, {s['received']} actions (contiguous: {s['contiguous']}), "
          f"transport p50 {t['transport']['p50_ms']:.2f} ms, render p50 {t['render']['p50_ms']:.1f} ms, "
          f"camera age p50 {t['camera_age_at_inference']['p50_ms']:.1f} ms, outages {result['outages']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
