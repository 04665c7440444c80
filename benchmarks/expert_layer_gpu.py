"""Does one persistent kernel per expert block beat the per-op kernels at batch 1?

One question, one run: PI0.5's action expert (18 adaptive Gemma blocks, width 1024, 8 query heads
on one KV head of 256, MLP 4096) at batch 1 (50 rows) over an 816-key cached prefix (the last 20
keys masked), seeded bf16 weights. For each variant of `fused_stacks.adaptive_block_stack`:
- the per-op kernels (`triton_expert_layer.set_enabled(False)`: the engine's path before);
- the persistent block (`layers/triton_expert_layer.py`) with its default tiling, other tilings
  and half the programs;
- the persistent kernel's phases launched one by one (same tiles, no barriers);
check the output against the float32 reference (relative L2 error, and the max abs difference
between the persistent launch and its phases launched one by one, expected 0: same tiles, same
order), then time the whole stack inside a CUDA graph (median of replays) and print a table;
then each phase alone (launched once per block), and a grid barrier against an empty kernel.

    python benchmarks/expert_layer_gpu.py --json runs/expert_layer.json           # on the GPU
    TRITON_INTERPRET=1 python benchmarks/expert_layer_gpu.py --device cpu --tiny  # plumbing check
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from graph_timing import time_calls  # benchmarks/ is on sys.path when this runs as a script

from phyai_edge.layers import fused_stacks
from phyai_edge.layers import triton_expert_layer as tel
from phyai_edge.layers.gemma import GemmaBlock
from phyai_edge.layers.rotary import rope_cos_sin
from phyai_edge.layers.triton_attention import kernel_key_mask, stack_attention
from phyai_edge.layers.triton_dispatch import tl, triton

FULL = {"depth": 18, "width": 1024, "mlp": 4096, "heads": 8, "kv": 1, "head_dim": 256, "t": 50, "prefix": 816}
TINY = {"depth": 2, "width": 64, "mlp": 128, "heads": 2, "kv": 1, "head_dim": 32, "t": 6, "prefix": 40}
MASKED = 20  # padded prefix keys (the trimmed prompt's tail)


def build(shape: dict[str, int], dtype: torch.dtype, dev: str, batch: int = 1) -> tuple[list[Any], tuple]:
    torch.manual_seed(0)
    w = shape["width"]
    blocks = []
    for _ in range(shape["depth"]):
        blk = GemmaBlock(w, shape["mlp"], shape["heads"], shape["kv"], shape["head_dim"], 1e-6, cond_dim=w)
        for p in blk.parameters():
            p.data.normal_(0, 0.02)
        blk.to(dev)  # before fusing: the fused projections are unregistered copies that .to() would not move
        blk.self_attn.to(dtype)  # the norms (and their modulation linears) stay float32, as the model keeps them
        blk.mlp.to(dtype)
        blk.self_attn.fuse()
        blk.mlp.fuse()
        blocks.append(blk.eval().requires_grad_(False))
    g = torch.Generator().manual_seed(1)
    t, p, d = shape["t"], shape["prefix"], shape["head_dim"]
    x = torch.randn(batch, t, w, generator=g).to(dev, dtype)
    cond = torch.randn(batch, w, generator=g).to(dev)
    with torch.no_grad():
        mods = [(b.input_layernorm.modulation(cond), b.post_attention_layernorm.modulation(cond)) for b in blocks]
        final = blocks[-1].post_attention_layernorm.modulation(cond * 0.5)
    positions = torch.arange(p - MASKED, p - MASKED + t, device=dev)[None].expand(batch, t)
    cos, sin = rope_cos_sin(positions, d, 10000.0, dtype)
    kv_shape = (shape["depth"], batch, shape["kv"], p, d)
    kc = torch.randn(*kv_shape, generator=g).to(dev, dtype)
    vc = torch.randn(*kv_shape, generator=g).to(dev, dtype)
    mask = torch.ones(batch, 1, 1, p + t, dtype=torch.bool, device=dev)
    mask[..., p - MASKED:p] = False
    return blocks, (x, cos, sin, kc, vc, mask, mods, final)


def reference(blocks: list[Any], args: tuple) -> torch.Tensor:
    """The stack in float32 on the reference ops (what every variant is judged against)."""
    blocks32 = [copy.deepcopy(b).float() for b in blocks]
    for b in blocks32:  # the fused projections are unregistered copies: fuse the float32 weights again
        b.self_attn.fuse()
        b.mlp.fuse()
    x, cos, sin, kc, vc, mask, mods, final = args
    f32 = [(tuple(m.float() for m in a), tuple(m.float() for m in b)) for a, b in mods]
    with torch.no_grad():
        return fused_stacks.adaptive_block_stack(blocks32, x.float(), cos.float(), sin.float(), kc.float(), vc.float(),
                                                 mask, f32, tuple(m.float() for m in final), 1e-6, "reference")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


if triton is not None:

    @triton.jit
    def _barrier_kernel(bar_ptr, rounds):
        """`rounds` grid barriers (`triton_expert_layer._grid_sync`) and nothing else."""
        for _ in range(rounds):
            tel._grid_sync(bar_ptr, tl.num_programs(0))

    @triton.jit
    def _empty_kernel(x_ptr):
        """A kernel that does nothing (a store no program makes): a graph node's floor."""
        pid = tl.program_id(0)
        tl.store(x_ptr + pid, 0, mask=pid < 0)


def barrier_costs(dev: str, rounds: int = 100) -> dict[str, float]:
    """Microseconds per grid barrier (one program per SM, `rounds` barriers in one kernel) and per
    empty kernel (`rounds` launches in one CUDA graph)."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    words = torch.zeros(2, dtype=torch.int32, device=dev)
    out: dict[str, float] = {}
    def call() -> None:
        _barrier_kernel[(sms,)](words, rounds, num_warps=4)
    out["barrier_us"] = time_calls([call], dev) / rounds
    dummy = torch.zeros(1, dtype=torch.int32, device=dev)
    out["empty_kernel_us"] = time_calls([lambda: _empty_kernel[(sms,)](dummy)] * rounds, dev)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes (a CPU plumbing check)")
    ap.add_argument("--json", default=None, help="write every number here")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    dev = args.device
    shape = TINY if args.tiny else FULL
    cuda = dev.startswith("cuda")
    res: dict[str, Any] = {"shape": shape, "device": torch.cuda.get_device_name() if cuda else "cpu",
                           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    blocks, stack_args = build(shape, torch.bfloat16, dev)
    truth = reference(blocks, stack_args)
    x, cos, sin, kc, vc, mask, mods, final = stack_args
    attend = stack_attention(mask, 1, "triton")
    key_mask = kernel_key_mask(mask, 1)

    def per_op() -> torch.Tensor:
        before = tel.set_enabled(False)
        try:
            return fused_stacks.adaptive_block_stack(blocks, x, cos, sin, kc, vc, mask, mods, final, 1e-6, "triton",
                                                     gemm_backend="triton", attend=attend)
        finally:
            tel.set_enabled(before)

    def persistent(**kw: Any):
        def call() -> torch.Tensor:
            return tel.persistent_block_stack(blocks, x, cos, sin, kc, vc, key_mask, mods, final, 1e-6, **kw)
        return call

    variants: list[tuple[str, Any]] = [("per-op kernels (before)", per_op)]
    if cuda:
        variants += [
            ("persistent (default tiles)", persistent()),
            ("persistent, 66 programs", persistent(programs=66)),
            ("persistent, 8 warps", persistent(tiles=tel.LayerTiles(warps=8))),
            ("persistent, 4 stages", persistent(tiles=tel.LayerTiles(stages=4))),
        ]
    variants.append(("phases one by one", persistent(persistent=False)))
    outs: dict[str, torch.Tensor] = {}
    rows = []
    for name, call in variants:
        try:
            with torch.no_grad():
                out = call()
                if cuda:
                    torch.cuda.synchronize()
                outs[name] = out.clone()
                err = rel(out, truth)
                us = time_calls([call], dev, replays=args.replays)
            r = {"us": us, "rel_err_vs_fp32": err, "finite": bool(torch.isfinite(out).all())}
        except Exception as exc:  # report, keep the rest
            r = {"failed": f"{type(exc).__name__}: {str(exc)[:400]}"}
        res[name] = r
        rows.append((name, r))
        print(name, r, flush=True)
    ref_name = "persistent (default tiles)" if cuda else None
    if ref_name in outs and "phases one by one" in outs:
        res["max_abs_persistent_vs_phases"] = float((outs[ref_name] - outs["phases one by one"]).abs().max())
    if "per-op kernels (before)" in outs and ref_name in outs:
        res["rel_persistent_vs_per_op"] = rel(outs[ref_name], outs["per-op kernels (before)"])
    names = ("A qkv+rope", "B attention", "C o_proj partials", "D residual+norm", "E gate/up+geglu",
             "F down partials", "G residual+norm")
    res["phase_us"] = {}
    for p, pname in enumerate(names):  # each phase alone, launched once per block (18 launches)
        try:
            with torch.no_grad():
                res["phase_us"][pname] = time_calls([persistent(persistent=False, phases=(p,))], dev,
                                                    replays=args.replays)
        except Exception as exc:
            res["phase_us"][pname] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    print("phases alone (us / stack):", res["phase_us"], flush=True)
    if cuda:
        res["barrier"] = barrier_costs(dev)
        print("barrier:", res["barrier"], flush=True)
    base = res["per-op kernels (before)"].get("us")
    print(f"\n{res['device']}, {shape['depth']} blocks, batch 1 ({shape['t']} rows), {shape['prefix']} prefix keys")
    print("| variant | us / stack | vs per-op | rel err vs fp32 |")
    print("|---|---|---|---|")
    for name, r in rows:
        if "us" in r:
            ratio = f"{base / r['us']:.2f}x" if base else ""
            print(f"| {name} | {r['us']:.1f} | {ratio} | {r['rel_err_vs_fp32']:.2e} |")
        else:
            print(f"| {name} | {r['failed']} | | |")
    for k in ("max_abs_persistent_vs_phases", "rel_persistent_vs_per_op"):
        if k in res:
            print(f"{k}: {res[k]:.3e}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
