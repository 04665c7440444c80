"""Do the benchmark's inputs change a power-capped chunk's time? One engine, two input sets alternated.

At batch 32 a PI0.5 chunk holds the H200 at its 700 W cap, and switching power depends on the data,
so `phyai-edge bench` (random 480 x 640 uint8 frames through the adapter's preprocessing, 48 random
prompt tokens) and `pi05_gpu.py` (random normal frames at model resolution, 48 tokens) could differ
on one machine for that reason alone. This runs both input sets on one cudagraph engine (the full
preset as `phyai-edge bench` loads it), alternated for `--seconds` of sustained load, and prints each
set's median stage times.

    python benchmarks/input_sets_gpu.py --batch 32 --seconds 40      # on the GPU
    python benchmarks/input_sets_gpu.py --tiny --device cpu --seconds 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import parity_lerobot as par
from pi05_gpu import VALID_TOKENS, sync


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=40.0)
    args = ap.parse_args(argv)
    from phyai_edge.adapters.base import ModelInputs, Observation
    from phyai_edge.engines.policy import load_policy

    dev, b = args.device, args.batch
    pol = load_policy(preset="tiny" if args.tiny else "full", backend="cudagraph", device=dev, dtype="bfloat16")
    adapter, eng, cfg = pol.adapter, pol.engine, pol.adapter.cfg
    rng = np.random.default_rng(0)
    obs = [Observation(images={c: rng.integers(0, 256, (480, 640, 3), dtype=np.uint8) for c in pol.camera_names},
                       state=rng.uniform(-1, 1, pol.state_dim).astype(np.float32), prompt="pick up the cube")
           for _ in range(b)]
    base = adapter.preprocess(obs, device=dev)
    tokens = base.tensors["tokens"].clone()
    n = min(VALID_TOKENS, tokens.shape[1])
    tokens[:, :n] = torch.randint(4, min(200, cfg.vocab_size), (b, n))
    tokens[:, n:] = 0
    mask = torch.zeros_like(base.tensors["token_mask"])
    mask[:, :n] = True
    sets = {
        "bench CLI inputs": ModelInputs({**base.tensors, "tokens": tokens.to(dev), "token_mask": mask.to(dev)}, b),
        "pi05_gpu.py inputs": par.model_inputs(par.make_inputs(b, 3, [n] * b, dev, seed=3, max_len=cfg.max_token_len,
                                                               vocab=cfg.vocab_size)),
    }
    for x in sets.values():
        eng.run(x)
        eng.run(x)
    times: dict[str, list[dict[str, float]]] = {k: [] for k in sets}
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.seconds or not times[next(iter(sets))]:
        for name, x in sets.items():
            eng.run(x)
            sync(dev)
            times[name].append(dict(eng.last_stage_ms))
    print("| inputs | chunks | " + " | ".join(f"{s} p50 ms" for s in times[next(iter(sets))][0]) + " |")
    for name, rows in times.items():
        print(f"| {name} | {len(rows)} | " + " | ".join(f"{statistics.median(r[s] for r in rows):.2f}"
                                                         for s in rows[0]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
