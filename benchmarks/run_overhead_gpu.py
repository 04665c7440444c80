"""Where a `CudaGraphEngine.run` call spends the time its stage events do not see. One question, one run.

`benchmarks/pi05_gpu.py` times a chunk as the wall time of `run()` plus a device synchronize; the
stage times are CUDA events between the graph replays. On the H200 (2026-12-04) the wall time
exceeded the stages' sum by ~1.0 ms at batch 1, ~1.2 at 8 and ~3.2 at 32: host work before the
first launch, copies between the replays, the output's clone, or syncs. Here, on the seeded
full-size PI0.5 engine as `pi05_gpu.py --triton-only` builds it (default options, inputs already on
the device), for batch 1, 8 and 32:

- the wall time per call, the stage-event sum, and their gap (medians);
- the time `run()` takes to return to the host (before the synchronize): if it is close to the wall
  time, something inside `run()` waits for the device;
- one call under `cProfile` (host time per function, syncs included), top entries.

    PYTHONPATH=$PWD python3 benchmarks/run_overhead_gpu.py --json $OUT/overhead.json    # H200
    PYTHONPATH=. python benchmarks/run_overhead_gpu.py --device cpu --tiny               # plumbing
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import parity_lerobot as par  # benchmarks/ is on sys.path when this runs as a script
from pi05_gpu import VALID_TOKENS, seeded_adapter, sync


def measure(engine: Any, inputs: Any, noise: torch.Tensor, device: str, reps: int) -> dict[str, Any]:
    walls, returns, stages = [], [], []
    for i in range(reps + 3):
        sync(device)
        t0 = time.perf_counter()
        engine.run(inputs, noise=noise)
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        if i >= 3:
            walls.append((t2 - t0) * 1e3)
            returns.append((t1 - t0) * 1e3)
            st = engine.last_stage_ms
            stages.append(st["embed_images"] + st["encode_prefix"] + st["solver_loop"])
    wall, ret, stage = statistics.median(walls), statistics.median(returns), statistics.median(stages)
    prof = cProfile.Profile()
    sync(device)
    prof.enable()
    engine.run(inputs, noise=noise)
    sync(device)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    return {"wall_ms": wall, "returns_after_ms": ret, "stage_sum_ms": stage, "gap_ms": wall - stage,
            "profile": buf.getvalue()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    from phyai_edge.engines.cudagraph import CudaGraphEngine

    dev = args.device
    adapter = seeded_adapter(dev, args.tiny)
    cfg = adapter.cfg
    engine = CudaGraphEngine(adapter, device=dev, dtype="bfloat16" if dev.startswith("cuda") else "float32")
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
                           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "batches": {}}
    for b in (int(x) for x in args.batches.split(",")):
        x = par.model_inputs(par.make_inputs(b, 3, [min(VALID_TOKENS, cfg.max_token_len)] * b, dev, seed=3,
                                             max_len=cfg.max_token_len, vocab=cfg.vocab_size))
        noise = torch.randn(b, adapter.chunk_size, adapter.model_action_dim,
                            generator=torch.Generator().manual_seed(4)).to(dev)
        engine.warmup(b, 3, VALID_TOKENS)
        r = measure(engine, x, noise, dev, 3 if args.tiny else args.reps)
        out["batches"][b] = r
        print(f"batch {b}: wall {r['wall_ms']:.3f} ms, stages {r['stage_sum_ms']:.3f}, gap {r['gap_ms']:.3f}, "
              f"run() returns after {r['returns_after_ms']:.3f} ms")
        print(r["profile"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
