"""Do the batch-1 norms folded into the small-M GEMMs make the chunk faster? One A/B question.

Two cudagraph engines on the same seeded full-size PI0.5 (bf16, 3 cameras, 48 prompt tokens, 10
steps), one captured with the norms folded into the GEMMs (`fused_stacks.set_fold_norms(True)`,
the default) and one with their own kernels, then their `run` calls alternated (A B A B ...) so
that clock and host drift fall on both alike. Prints p50 / p90 of the wall-clock chunk and the
CUDA-event stage times of each, their ratio, and each chunk's error against eager float32.

    python benchmarks/norm_fold_gpu.py --reps 200 --json $OUT/fold_ab.json     # on the GPU
    python benchmarks/norm_fold_gpu.py --tiny --device cpu --reps 2             # plumbing check
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import parity_lerobot as par
from pi05_gpu import VALID_TOKENS, seeded_adapter, sync


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--reps", type=int, default=200, help="calls of each engine, alternated")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--builtin", action="store_true",
                    help="the full preset as `phyai-edge bench` loads it (`builtin_adapter('full', device=)`), and "
                         "`run` drawing its own noise, instead of this script's seeded adapter and fixed noise")
    args = ap.parse_args(argv)
    from phyai_edge.engines.cudagraph import CudaGraphEngine
    from phyai_edge.engines.eager import EagerEngine
    from phyai_edge.layers.fused_stacks import set_fold_norms

    dev = args.device
    if args.builtin:
        from phyai_edge.adapters.pi05 import builtin_adapter

        adapter = builtin_adapter("tiny" if args.tiny else "full", device=dev)
    else:
        adapter = seeded_adapter(dev, args.tiny)
    cfg = adapter.cfg
    x = par.model_inputs(par.make_inputs(1, 3, [VALID_TOKENS], dev, seed=3, max_len=cfg.max_token_len,
                                         vocab=cfg.vocab_size))
    noise = torch.randn(1, adapter.chunk_size, adapter.model_action_dim,
                        generator=torch.Generator().manual_seed(4)).to(dev)
    opts = {} if dev.startswith("cuda") else {"triton_ops": "triton", "triton_gemm": True}  # the interpreter
    folds = {"folded": True, "norm kernels": False}

    def run(name: str, noise: torch.Tensor | None) -> torch.Tensor:
        # The switch is read when the step is captured (GPU) or, with no graphs (a CPU), at every call.
        before = set_fold_norms(folds[name])
        try:
            return engines[name].run(x, noise=noise)
        finally:
            set_fold_norms(before)

    engines: dict[str, Any] = {}
    for name in folds:
        engines[name] = CudaGraphEngine(copy.deepcopy(adapter), device=dev, dtype="bfloat16", **opts)
        before = set_fold_norms(folds[name])
        try:
            engines[name].warmup(1, 3, VALID_TOKENS)
        finally:
            set_fold_norms(before)
        run(name, noise)
    eager32 = EagerEngine(adapter, device=dev, dtype="float32")
    ref = eager32.run(x, noise=noise)
    chunks = {name: run(name, noise) for name in engines}
    walls: dict[str, list[float]] = {n: [] for n in engines}
    stages: dict[str, dict[str, list[float]]] = {n: {} for n in engines}
    for _ in range(3):  # warm
        for name in engines:
            run(name, noise)
    sync(dev)
    timed_noise = None if args.builtin else noise
    for _ in range(args.reps):
        for name, eng in engines.items():
            t0 = time.perf_counter()
            run(name, timed_noise)
            sync(dev)
            walls[name].append((time.perf_counter() - t0) * 1e3)
            for k, v in eng.last_stage_ms.items():
                stages[name].setdefault(k, []).append(v)

    def q(v: list[float], p: float) -> float:
        return sorted(v)[min(len(v) - 1, int(p * len(v)))]

    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "reps": args.reps,
                           "device": torch.cuda.get_device_name() if dev.startswith("cuda") else dev, "engines": {}}
    lines = ["| engine | chunk p50 ms | p90 | vision / prefix / loop p50 ms | step p50 ms | vs eager fp32 max abs / scale |",
             "|---|---|---|---|---|---|"]
    for name in engines:
        st = {k: statistics.median(v) for k, v in stages[name].items()}
        err = par.err(chunks[name], ref)
        res["engines"][name] = {"p50": statistics.median(walls[name]), "p90": q(walls[name], 0.9), "stages_p50": st,
                                "vs_eager_fp32": err}
        lines.append(f"| {name} | {statistics.median(walls[name]):.3f} | {q(walls[name], 0.9):.3f} | "
                     f"{st.get('embed_images', 0):.3f} / {st.get('encode_prefix', 0):.3f} / {st.get('solver_loop', 0):.3f} | "
                     f"{st.get('denoise_step', 0):.4f} | {err['max_abs_over_scale']:.2e} |")
    a, b = res["engines"]["folded"], res["engines"]["norm kernels"]
    res["ratio_p50"] = a["p50"] / b["p50"]
    res["ratio_loop"] = a["stages_p50"].get("solver_loop", 0) / max(b["stages_p50"].get("solver_loop", 1e-9), 1e-9)
    res["max_abs_between"] = float((chunks["folded"] - chunks["norm kernels"]).abs().max())
    lines.append(f"\nfolded / norm kernels: chunk p50 {res['ratio_p50']:.4f}, loop p50 {res['ratio_loop']:.4f}; "
                 f"max abs between the two chunks {res['max_abs_between']:.3e}")
    print("\n".join(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
