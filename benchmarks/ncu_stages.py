"""Each kernel of one PI0.5 stage under Nsight Compute: what bounds it, kernel by kernel.

The CUDA-event and `torch.profiler` numbers (`pi05_profile.py`) say how long a stage's kernels take;
this says why: for every kernel of one eager call of a stage (the same kernels the graphs replay),
its duration alone on the GPU, the DRAM and L2 bytes it moved, its SM busy fraction, achieved
occupancy and its warps' top stall reasons. Kernels of one name are summed into one row.

    python benchmarks/ncu_stages.py --stages denoise_step --batch 1 --out $OUT/ncu     # on the GPU
    python benchmarks/ncu_stages.py --parse $OUT/ncu/denoise_step.csv                  # a saved CSV again

The driver starts `ncu` once per stage on this script's `--child` mode, which builds the seeded
full-size engine, runs the stage once to compile, then once between cudaProfilerStart / Stop.
`ncu --cache-control all` (its default) flushes L2 before each kernel: the weights are cold as they
are in a batch-1 step (620 MB a step against a 60 MB L2), the activations colder than they are.
Clocks are left alone (`--clock-control none`). Seeded random weights (no checkpoint needed).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

STAGES = ("embed_images", "encode_prefix", "denoise_step")
# Sections for every stage; WarpStateStats (stall reasons) adds passes, so only where asked.
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy")
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum",
           "sm__cycles_active.avg", "sm__cycles_elapsed.avg", "launch__grid_size", "launch__block_size",
           "launch__registers_per_thread", "sm__warps_active.avg.pct_of_peak_sustained_active")
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")
TIME_SCALE = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
BYTE_SCALE = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def short_name(kernel: str) -> str:
    """A kernel's name without its template arguments and parameter list (cuBLAS / CUTLASS names run
    to hundreds of characters)."""
    name = re.sub(r"\(.*$", "", kernel.strip())
    depth, out = 0, []
    for ch in name:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">"
    name = "".join(out).strip()
    return (name.split(" ")[-1] or kernel)[:90]


def _number(text: str) -> float | None:
    text = text.strip().replace(",", "")
    if not text or text in ("n/a", "N/A"):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def parse_raw_csv(path: Path) -> list[dict[str, Any]]:
    """ncu's `--csv --page raw` log: a header row, a units row, then one row per kernel launch.
    Returns one dict per launch: name, duration (us), bytes, cycles, occupancy, stalls."""
    lines = path.read_text(errors="replace").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise SystemExit(f"{path}: no ncu CSV table in it (did ncu profile any kernel?)")
    rows = list(csv.reader(lines[start:]))
    header, units, data = rows[0], rows[1], rows[2:]
    col = {h: i for i, h in enumerate(header)}

    def get(row: list[str], metric: str, scale: dict[str, float] | None = None) -> float | None:
        i = col.get(metric)
        if i is None or i >= len(row):
            return None
        v = _number(row[i])
        if v is None or scale is None:
            return v
        return v * scale.get(units[i].strip(), 1.0)

    stall_cols = [(m.group(1), i) for h, i in col.items() if (m := STALL.match(h))]
    out = []
    for row in data:
        if len(row) < len(header) // 2:
            continue
        stalls = {name: _number(row[i]) or 0.0 for name, i in stall_cols}
        out.append({
            "name": short_name(row[col["Kernel Name"]]),
            "us": get(row, "gpu__time_duration.sum", TIME_SCALE) or 0.0,
            "dram_read": get(row, "dram__bytes_read.sum", BYTE_SCALE) or 0.0,
            "dram_write": get(row, "dram__bytes_write.sum", BYTE_SCALE) or 0.0,
            "l2_bytes": get(row, "lts__t_bytes.sum", BYTE_SCALE) or 0.0,
            "sm_active": get(row, "sm__cycles_active.avg") or 0.0,
            "sm_elapsed": get(row, "sm__cycles_elapsed.avg") or 0.0,
            "grid": get(row, "launch__grid_size") or 0.0,
            "block": get(row, "launch__block_size") or 0.0,
            "regs": get(row, "launch__registers_per_thread") or 0.0,
            "occupancy": get(row, "sm__warps_active.avg.pct_of_peak_sustained_active") or 0.0,
            "stalls": stalls,
        })
    return out


def summarize(launches: list[dict[str, Any]], dram_tbs: float = 4.2) -> list[dict[str, Any]]:
    """Launches of one name summed: calls, total / mean us, achieved DRAM TB/s, the DRAM bytes'
    time at `dram_tbs` against the kernel's (how far from its bandwidth floor), SM busy share,
    occupancy, and the three largest stall reasons (cycles a warp waits per instruction issued)."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for launch in launches:
        groups[launch["name"]].append(launch)
    rows = []
    for name, ls in groups.items():
        us = sum(x["us"] for x in ls)
        dram = sum(x["dram_read"] + x["dram_write"] for x in ls)
        stalls: dict[str, float] = defaultdict(float)
        for x in ls:
            for k, v in x["stalls"].items():
                stalls[k] += v * x["us"]
        top = sorted(stalls.items(), key=lambda kv: -kv[1])[:3]
        rows.append({
            "name": name, "calls": len(ls), "us": us, "mean_us": us / len(ls),
            "dram_mb": dram / 1e6, "dram_tbs": dram / (us * 1e-6) / 1e12 if us else 0.0,
            "floor_share": (dram / (dram_tbs * 1e12)) / (us * 1e-6) if us else 0.0,
            "l2_mb": sum(x["l2_bytes"] for x in ls) / 1e6,
            "sm_busy": (sum(x["sm_active"] for x in ls) / sum(x["sm_elapsed"] for x in ls)
                        if sum(x["sm_elapsed"] for x in ls) else 0.0),
            "occupancy": sum(x["occupancy"] * x["us"] for x in ls) / us if us else 0.0,
            "grid": ls[0]["grid"], "block": ls[0]["block"], "regs": ls[0]["regs"],
            "stalls": [(k, v / us) for k, v in top] if us else [],
        })
    return sorted(rows, key=lambda r: -r["us"])


def table(stage: str, rows: list[dict[str, Any]]) -> str:
    total = sum(r["us"] for r in rows)
    calls = sum(r["calls"] for r in rows)
    dram = sum(r["dram_mb"] for r in rows)
    lines = [f"{stage}: {calls} kernels, {total:.1f} us alone under ncu, {dram:.1f} MB from / to DRAM "
             f"({dram / 1e6 / (total * 1e-6) if total else 0:.2f} TB/s over the stage)", "",
             "| kernel | calls | us (mean) | share | DRAM MB | DRAM TB/s | SM busy | occupancy % | grid x block, regs "
             "| top stalls (cycles / issue) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        stalls = ", ".join(f"{k} {v:.1f}" for k, v in r["stalls"] if v > 0) or "-"
        lines.append(f"| `{r['name']}` | {r['calls']} | {r['us']:.1f} ({r['mean_us']:.2f}) | {r['us'] / total:.0%} | "
                     f"{r['dram_mb']:.1f} | {r['dram_tbs']:.2f} | {r['sm_busy']:.0%} | {r['occupancy']:.0f} | "
                     f"{r['grid']:.0f} x {r['block']:.0f}, {r['regs']:.0f} | {stalls} |")
    return "\n".join(lines)


# -- the child: one stage, once, between cudaProfilerStart / Stop ------------------------------
def child(stage: str, batch: int, device: str, tiny: bool) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import parity_lerobot as par
    from pi05_gpu import VALID_TOKENS, seeded_adapter

    from phyai_edge.engines.cudagraph import CudaGraphEngine

    adapter = seeded_adapter(device, tiny)
    cfg = adapter.cfg
    eng = CudaGraphEngine(adapter, device=device, dtype="bfloat16", triton_ops=True if tiny else None)
    x = par.model_inputs(par.make_inputs(batch, 3, [VALID_TOKENS] * batch, device, seed=3,
                                         max_len=cfg.max_token_len, vocab=cfg.vocab_size))
    noise = torch.randn(batch, adapter.chunk_size, adapter.model_action_dim, device=device)
    eng.warmup(batch, 3, VALID_TOKENS)
    eng.run(x, noise=noise)  # fills the static buffers (images, prompt, KV cache) the stages read
    length = next(k[2] for k in eng._sets if k[:2] == (batch, 3))
    gs = eng._sets[(batch, 3, length)]
    kc, vc, pmask = gs.kv
    step = eng._stages["denoise_step"]
    mod = eng._table(adapter.solver)[0]
    joined = {} if gs.kv_room is None else {"joined": gs.kv_room}
    dense_prefix = eng._unmasked(batch)[0]
    calls = {
        "embed_images": lambda: eng._vision(gs),
        "encode_prefix": lambda: eng._prefix(gs, dense_prefix, eng._prefix_out(gs)),
        "denoise_step": lambda: step(gs.loop_bufs["noise"], torch.full((batch,), 1.0, device=device), kc, vc,
                                     pmask, modulation=mod, **joined),
    }
    fn = calls[stage]
    cuda = device.startswith("cuda")
    # as the engine's graphs run them: float32 matmuls (the action projections) in TF32
    from phyai_edge.engines.cudagraph import float32_matmuls_in_tf32

    with torch.no_grad(), float32_matmuls_in_tf32(True):
        fn()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        fn()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
    print(f"child: {stage} batch {batch} ran on {device}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="denoise_step", help=f"comma-separated, of {', '.join(STAGES)}")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny preset (with --child on a CPU: plumbing only)")
    ap.add_argument("--stalls", default="denoise_step",
                    help="stages that also collect warp stall reasons (more replay passes)")
    ap.add_argument("--out", type=Path, default=Path("runs/ncu"))
    ap.add_argument("--timeout-s", type=float, default=300, help="per stage")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--parse", type=Path, help="summarize a saved ncu raw CSV instead of profiling")
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.batch, args.device, args.tiny)
        return 0
    if args.parse:
        print(table(args.parse.stem, summarize(parse_raw_csv(args.parse))))
        return 0
    ncu = shutil.which("ncu") or next((str(p) for p in sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"))), None)
    if ncu is None:
        raise SystemExit("ncu not found on PATH or under /opt/nvidia/nsight-compute")
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "batch": args.batch, "stages": {}}
    md = []
    for stage in args.stages.split(","):
        if stage not in STAGES:
            raise SystemExit(f"--stages: {stage!r} is not one of {', '.join(STAGES)}")
        log = args.out / f"{stage}.csv"
        sections = SECTIONS + (("WarpStateStats",) if stage in args.stalls.split(",") else ())
        cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--cache-control", "all",
               "--target-processes", "all", "--print-units", "base", "--csv", "--page", "raw",
               "--log-file", str(log), "--metrics", ",".join(METRICS)]
        for s in sections:
            cmd += ["--section", s]
        cmd += [sys.executable, str(Path(__file__).resolve()), "--child", stage, "--batch", str(args.batch),
                "--device", args.device] + (["--tiny"] if args.tiny else [])
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, env=os.environ.copy())
        secs = time.perf_counter() - t0
        if done.returncode != 0 or not log.exists():
            print(f"{stage}: ncu failed (rc {done.returncode}, {secs:.0f} s):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            report["stages"][stage] = {"error": (done.stdout + done.stderr)[-3000:]}
            continue
        rows = summarize(parse_raw_csv(log))
        report["stages"][stage] = {"seconds": secs, "kernels": rows}
        text = table(stage, rows)
        md.append(text)
        print(f"{stage} ({secs:.0f} s under ncu)\n{text}\n", flush=True)
        (args.out / "ncu.json").write_text(json.dumps(report, indent=1))
    (args.out / "ncu.md").write_text("\n\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
