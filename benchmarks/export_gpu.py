"""Full-size PI0.5 bundles on a GPU machine: export, load in a fresh process, check, time.

    python benchmarks/export_gpu.py [--checkpoint DIR] [--backends cudagraph,onnx]
                                    [--precision bf16] [--out engines] [--results benchmarks/RESULTS.md]

Without --checkpoint a full-size model with seeded random weights is written as a native
checkpoint first (same structure and cost as the real one; actions are meaningless).

For each backend: `export_bundle` (with its own validation against eager), then a fresh Python
process (`--child`) loads the bundle and produces one chunk; the parent measures the wall time
from spawning that process to the child's first chunk (what a robot restarted by systemd waits;
target <= 10 s), and the child compares the chunk with the eager engine on the same
observation and noise. The child also reports where that time went: imports, the load's own
breakdown (`policy.load_timings`: verify / hash, read weights, to device, adapter, engine build)
and the first chunk (CUDA graph capture included). A Markdown section is appended to the
results file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

T_PROCESS = time.perf_counter()  # as early as possible: the child's own start


def child(bundle: str, device: str, checkpoint: str | None) -> None:
    """Load the bundle, one chunk, then the eager comparison; one JSON line on stdout."""
    import logging

    import torch

    # The loader's INFO line (where the load's time went) on stderr, beside the parent's output.
    logging.basicConfig(level=logging.INFO, format="child %(name)s: %(message)s")

    from phyai_edge.calibration import synthetic_observations
    from phyai_edge.engines.policy import load_bundle_policy

    t0 = time.perf_counter()
    policy = load_bundle_policy(bundle, device=device)
    t_loaded = time.perf_counter()
    obs = synthetic_observations(policy.adapter, 1, seed=7)
    noise = torch.randn(1, policy.adapter.chunk_size, policy.adapter.model_action_dim,
                        generator=torch.Generator().manual_seed(0))
    result = policy.infer(obs, noise=noise)
    torch.cuda.synchronize()
    t_first = time.perf_counter()
    print("FIRST_CHUNK", flush=True)  # the parent stops its clock here
    warm = [policy.infer(obs, noise=noise).stage_ms["total"] for _ in range(5)]
    # load_bundle_policy's own breakdown of load_s (verify_s incl. hash_s, read_s, to_device_s,
    # adapter_s, engine_s); first_infer_s is the first chunk itself, CUDA graph capture included.
    out = {"bundle": bundle, "imports_s": t0 - T_PROCESS, "load_s": t_loaded - t0,
           "first_chunk_s": t_first - T_PROCESS, "first_infer_s": t_first - t_loaded,
           "load_breakdown": getattr(policy, "load_timings", {}),
           "weight_dtype": policy.manifest["checkpoint"].get("weight_dtype"),
           "warm_total_ms": sorted(warm)[len(warm) // 2], "stage_ms": result.stage_ms,
           "engine": {k: getattr(policy.engine, k, None) for k in ("fp8", "fp8_linears", "triton_ops", "triton_gemm")}}
    if checkpoint:
        from phyai_edge.engines.policy import load_policy

        solver = policy.adapter.solver
        del policy
        torch.cuda.empty_cache()
        ref = load_policy(checkpoint=checkpoint, backend="eager", device=device, dtype="float32")
        ref.adapter.solver = solver  # the bundle's step count
        want = ref.infer(obs, noise=noise)
        out["max_abs_error_vs_eager_fp32"] = float(abs(want.chunk.cpu() - result.chunk.cpu()).max())
    print("RESULT " + json.dumps(out), flush=True)


def make_checkpoint(folder: Path, device: str) -> Path:
    """A seeded full-size native checkpoint, drawn on `device` (a 3B-parameter draw on the CPU
    costs a minute of the device lease)."""
    from phyai_edge.adapters.pi05 import PI05Adapter, save_native
    from phyai_edge.adapters.pi05.builtin import builtin_adapter, seeded_model_on
    from phyai_edge.adapters.pi05.config import full

    if (folder / "phyai_edge.json").exists():
        return folder
    shell = builtin_adapter("full")  # meta weights; borrow its tokenizer and robot I/O
    adapter = PI05Adapter(full(), seeded_model_on(device, full(), seed=0), shell.tokenizer, shell.io)
    save_native(adapter, folder)
    del adapter
    return folder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--backends", default="cudagraph,onnx")
    p.add_argument("--precision", default="bf16", help="cudagraph precision (onnx uses fp16 on CUDA, else fp32)")
    p.add_argument("--fp8-scope", default="expert", help="with --precision fp8: expert, prefix or all")
    p.add_argument("--calibration-samples", type=int, default=8,
                   help="with --precision fp8: synthetic calibration observations (random weights: no data)")
    p.add_argument("--out", type=Path, default=Path("engines"))
    p.add_argument("--results", type=Path, default=Path("benchmarks/RESULTS.md"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--child", nargs=2, metavar=("BUNDLE", "CHECKPOINT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.device, args.child[1] or None)
        return 0

    import onnxruntime as ort

    from phyai_edge.engines.exporter import ExportRequest, export_bundle

    ckpt = args.checkpoint or make_checkpoint(Path("/tmp/phyai-pi05-full-seeded"), args.device)
    rows = []
    for backend in args.backends.split(","):
        out = args.out / f"pi05-full-{backend}"
        cuda_ort = "CUDAExecutionProvider" in ort.get_available_providers()
        precision = args.precision if backend == "cudagraph" else ("fp16" if cuda_ort else "fp32")
        device = args.device if backend != "onnx" or cuda_ort else "cpu"
        t0 = time.perf_counter()
        fp8 = {"calibration": "synthetic", "calibration_samples": args.calibration_samples,
               "fp8_scope": args.fp8_scope} if precision == "fp8" else {}
        manifest = export_bundle(ExportRequest(out=out, backend=backend, precision=precision, checkpoint=ckpt,
                                               device=device, overwrite=True, holdout=1, **fp8))
        export_s = time.perf_counter() - t0
        t_spawn = time.perf_counter()
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(out), str(ckpt), "--device", device],
                                stdout=subprocess.PIPE, text=True)
        first = None
        result = {}
        for line in proc.stdout:
            if line.startswith("FIRST_CHUNK") and first is None:
                first = time.perf_counter() - t_spawn
            elif line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
        proc.wait()
        rows.append({"backend": backend, "precision": precision, "device": device, "export_s": export_s,
                     "spawn_to_first_chunk_s": first, "validation": manifest["validation"], **result})
        print(json.dumps(rows[-1], indent=2, default=str))
    gpu = manifest["target"].get("gpu_name")
    lines = [f"\n## Export bundles, full-size PI0.5 ({datetime.now(timezone.utc):%Y-%m-%d}, {gpu})\n",
             "| backend | precision | device | export s | spawn -> first chunk s (target <= 10) | load s | "
             "warm chunk ms | max abs err vs eager fp32 | export validation | imports s | "
             "load: verify (hash) / read / to device / adapter / engine s | first chunk s (incl. capture) | "
             "stored weights |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for r in rows:
        v = r["validation"]
        b = r.get("load_breakdown") or {}
        lines.append(f"| {r['backend']} | {r['precision']} | {r['device']} | {r['export_s']:.0f} | "
                     f"{r['spawn_to_first_chunk_s'] or nan:.2f} | {r.get('load_s', nan):.2f} | "
                     f"{r.get('warm_total_ms', nan):.1f} | {r.get('max_abs_error_vs_eager_fp32', nan):.3g} | "
                     f"{v.get('status')} {v.get('max_abs_error', '')} | {r.get('imports_s', nan):.2f} | "
                     f"{b.get('verify_s', nan):.2f} ({b.get('hash_s', nan):.2f}) / {b.get('read_s', nan):.2f} / "
                     f"{b.get('to_device_s', nan):.2f} / {b.get('adapter_s', nan):.2f} / {b.get('engine_s', nan):.2f} | "
                     f"{r.get('first_infer_s', nan):.2f} | {r.get('weight_dtype') or '-'} |")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with args.results.open("a") as f:
        f.write("\n".join(lines) + "\n")
    print(f"appended to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
