"""What refusing NaN / Inf weights at load costs: a full-size native folder (seeded weights, written
in bf16 as a cudagraph bundle stores them) read onto the GPU by the strict loader with the check and
with it stubbed out, alternated. Prints medians of the loader's `read_s` (where the check is
counted) and the whole read. (The loader alone: a full-size folder needs PaliGemma's tokenizer,
which is not here.) Run on the GPU machine: python3 benchmarks/load_check_gpu.py [--reps 3]."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from phyai_edge.adapters import checkpoint as ckpt
from phyai_edge.adapters.pi05 import builtin_adapter, save_native
from phyai_edge.adapters.pi05.config import full
from phyai_edge.adapters.pi05.model import PI05Model


def read(folder: Path, device: str, timings: dict[str, float]) -> PI05Model:
    model = PI05Model.skeleton(full())
    files = sorted(folder.glob("model*.safetensors"))
    ckpt.load_safetensors_strict(model, files, ckpt.regex_key_map([], []), device=device, dtype=None,
                                 expect_dtypes=model.precision_dtypes(torch.bfloat16), timings=timings)
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp()) / "full"
    t0 = time.perf_counter()
    # The full preset's seeded weights are drawn where they run (on the meta device they have no data).
    save_native(builtin_adapter("full", seed=0, device=args.device), folder, dtype=torch.bfloat16)
    torch.cuda.empty_cache()
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9
    print(f"wrote {folder} ({size:.2f} GB) in {time.perf_counter() - t0:.1f} s")
    real = ckpt._all_finite
    skip = lambda t: torch.ones((), dtype=torch.bool, device=t.device)  # noqa: E731
    runs: dict[str, list[tuple[float, float]]] = {"checked": [], "unchecked": []}
    read(folder, args.device, {})  # page cache warm for both
    for _ in range(args.reps):
        for name, fn in (("checked", real), ("unchecked", skip)):
            ckpt._all_finite = fn
            timings: dict[str, float] = {}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ad = read(folder, args.device, timings)
            torch.cuda.synchronize()
            runs[name].append((timings["read_s"], time.perf_counter() - t0))
            del ad
            torch.cuda.empty_cache()
    ckpt._all_finite = real
    print(f"{'loader':10s} {'read_s p50':>11s} {'load s p50':>11s}  (reps {args.reps}, {torch.cuda.get_device_name()})")
    for name, rows in runs.items():
        print(f"{name:10s} {statistics.median(r for r, _ in rows):11.3f} {statistics.median(w for _, w in rows):11.3f}")


if __name__ == "__main__":
    main()
