"""Would the action expert's batch-1 step be faster with each block's weights already in L2?

One question, one run. At batch 1 the expert's GEMMs run at a third of the GPU's copy rate (50 rows:
each weight byte is read once from memory, and the kernels are short enough that ramp-up and memory
latency dominate). Two earlier tries at pulling weights into L2 early were slower (the next kernel's
programs prefetching under PDL; idle programs of the persistent block): both took SM slots from the
running kernel. This asks first what L2-resident weights would buy at all, then tries a prefetcher
that holds few SMs. On PI0.5's expert stack (`expert_layer_gpu.build`: 18 blocks, batch 1, 816
cached keys, seeded bf16 weights), the engine's per-op kernels (`fused_stacks.adaptive_block_stack`
with the small-M GEMMs), timed inside a CUDA graph:
- "cold": the 18 blocks (620 MB of weights: each block's come from memory, as in the engine);
- "warm bound": one block's weights and keys 18 times (33 MB, which stay in L2 between blocks): the
  most any prefetching could give (not the same arithmetic, so no error column);
- "cold + side-stream prefetch, N programs": a second captured stream, forked at each block's start,
  issues `prefetch.global.L2::evict_last` for the next block's weights and cached keys from N
  programs while the block runs (its output compared with "cold"'s, expected identical: prefetches
  change no value a kernel reads).

Measured on the H200 (2026-12-04, RESULTS.md thirteenth session call 4): cold 811.4 us, warm bound
754.2 (1.08x), prefetching 883-934 (slower, identical output).

    PYTHONPATH=$PWD python3 benchmarks/l2_prefetch_gpu.py --json $OUT/l2_prefetch.json   # on the GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from expert_layer_gpu import FULL, build  # benchmarks/ is on sys.path when this runs as a script
from graph_timing import time_calls

from phyai_edge.layers import fused_stacks
from phyai_edge.layers.triton_attention import stack_attention
from phyai_edge.layers.triton_dispatch import tl, triton

LINE = 128  # bytes an L2 prefetch brings


if triton is not None:

    @triton.jit
    def _prefetch_l2_kernel(ptr, lines, LINES: tl.constexpr, LINE_BYTES: tl.constexpr):  # noqa: N803  (Triton constexprs)
        """Asks L2 for `lines` lines of LINE_BYTES from ptr (a uint8 view), LINES at a time per program;
        fire and forget: no registers wait on the data."""
        start = tl.program_id(0) * LINES
        step = tl.num_programs(0) * LINES
        for first in range(start, lines, step):
            at = tl.minimum(first + tl.arange(0, LINES), lines - 1).to(tl.int64) * LINE_BYTES
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                      [ptr + at], dtype=tl.int32, is_pure=False, pack=1)


def block_tensors(block: Any, kc: torch.Tensor, vc: torch.Tensor, i: int) -> list[torch.Tensor]:
    """What block i reads that is not an activation: its four projections' weights and its cached keys
    and values."""
    return [block.self_attn.qkv_proj.weight, block.self_attn.o_proj.weight, block.mlp.gate_up.weight,
            block.mlp.down_proj.weight, kc[i], vc[i]]


class SidePrefetch:
    """Wraps `fused_stacks._qkv` (called once per block, first) so that each block's start forks a side
    stream that prefetches the next block's tensors; the stack's caller joins it at the end."""

    def __init__(self, blocks: list[Any], kc: torch.Tensor, vc: torch.Tensor, programs: int) -> None:
        self.index = {id(b.self_attn): i for i, b in enumerate(blocks)}
        self.tensors = [block_tensors(b, kc, vc, i) for i, b in enumerate(blocks)]
        self.programs = programs
        self.side = torch.cuda.Stream()
        self.original = fused_stacks._qkv

    def qkv(self, attn: Any, *args: Any, **kw: Any) -> Any:
        i = self.index[id(attn)]
        if i + 1 < len(self.tensors):
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                for t in self.tensors[i + 1]:
                    lines = t.numel() * t.element_size() // LINE
                    _prefetch_l2_kernel[(self.programs,)](t.view(torch.uint8).view(-1), lines, LINES=256, LINE_BYTES=LINE,
                                                          num_warps=4)
        return self.original(attn, *args, **kw)

    def __enter__(self) -> SidePrefetch:
        fused_stacks._qkv = self.qkv
        return self

    def __exit__(self, *exc: Any) -> None:
        fused_stacks._qkv = self.original
        torch.cuda.current_stream().wait_stream(self.side)  # join: a capture must end on one stream


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", default="4,8,16,32", help="comma-separated prefetcher sizes")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = "cuda"
    blocks, (x, cos, sin, kc, vc, mask, mods, final) = build(FULL, torch.bfloat16, dev)
    attend = stack_attention(mask, 1, "triton")
    depth = len(blocks)

    def stack(bl: list[Any], k: torch.Tensor, v: torch.Tensor, md: list[Any]) -> torch.Tensor:
        return fused_stacks.adaptive_block_stack(bl, x, cos, sin, k, v, mask, md, final, 1e-6, "triton",
                                                 gemm_backend="triton", attend=attend)

    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
                           "command": " ".join(sys.argv)}
    rows = []
    with torch.no_grad():
        cold = lambda: stack(blocks, kc, vc, mods)  # noqa: E731
        ref = cold().clone()
        rows.append(("cold (the engine's)", time_calls([cold], dev, replays=args.replays), 0.0))
        one_k = kc[:1].expand(depth, *kc.shape[1:])
        one_v = vc[:1].expand(depth, *vc.shape[1:])
        warm = lambda: stack([blocks[0]] * depth, one_k, one_v, [mods[0]] * depth)  # noqa: E731
        rows.append(("warm bound (one block's weights x18)", time_calls([warm], dev, replays=args.replays), None))
        for n in (int(p) for p in args.programs.split(",")):
            pf = SidePrefetch(blocks, kc, vc, n)

            def prefetched(pf: SidePrefetch = pf) -> torch.Tensor:
                with pf:
                    return cold()
            try:
                diff = float((prefetched() - ref).abs().max())
                rows.append((f"cold + side-stream prefetch, {n} programs",
                             time_calls([prefetched], dev, replays=args.replays), diff))
            except Exception as exc:  # report, keep the rest
                rows.append((f"cold + side-stream prefetch, {n} programs: {type(exc).__name__}: {exc}"[:200],
                             float("nan"), None))
    base = rows[0][1]
    print(f"\n{res['device']}, torch {res['torch']}, triton {res['triton']}: expert stack, batch 1, {depth} blocks")
    print("| variant | us / stack | vs cold | max abs diff vs cold |")
    print("|---|---|---|---|")
    for name, us, diff in rows:
        print(f"| {name} | {us:.1f} | {base / us:.2f}x | {'-' if diff is None else f'{diff:.1e}'} |")
    res["rows"] = [{"variant": n, "us": us, "max_abs_diff_vs_cold": d} for n, us, d in rows]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
