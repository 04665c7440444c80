"""Do the batch-1 norms folded into the small-M GEMMs make the chunk faster? One A/B question.

Two cudagraph engines on the same seeded full-size PI0.5 (bf16, 3 cameras, 48 prompt tokens, 10
steps), one captured with the norms folded into the GEMMs (`fused_stacks.set_fold_norms(True)`,
the default) and one with their own kernels, then their `run` calls alternated (A B A B ...) so
that clock and host drift fall on both alike (`engine_ab_gpu.py`, which this runs with those two
variants). Prints p50 / p90 of the wall-clock chunk and the CUDA-event stage times of each, their
ratio, and each chunk's error against eager float32.

    python benchmarks/norm_fold_gpu.py --reps 200 --json $OUT/fold_ab.json     # on the GPU
    python benchmarks/norm_fold_gpu.py --tiny --device cpu --reps 2             # plumbing check
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_ab_gpu import Variant, engine_args, run_ab, table, write_json


def main(argv: list[str] | None = None) -> int:
    args = engine_args(__doc__, reps=200).parse_args(argv)
    res = run_ab([Variant("folded"), Variant("norm kernels", fold=False)], args.device, args.tiny, args.reps,
                 args.builtin)
    kernels = res["engines"]["norm kernels"]
    res["ratio_p50"], res["ratio_loop"] = kernels["ratio_p50"] ** -1, kernels["ratio_loop"] ** -1
    res["max_abs_between"] = kernels["max_abs_vs_first"]
    print(table(res))
    print(f"\nfolded / norm kernels: chunk p50 {res['ratio_p50']:.4f}, loop p50 {res['ratio_loop']:.4f}; "
          f"max abs between the two chunks {res['max_abs_between']:.3e}")
    write_json(res, args.json)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
