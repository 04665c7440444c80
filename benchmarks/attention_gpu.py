"""Which attention kernel, and which tiling of it, for PI0.5's attention shapes on one GPU.

One question, one run: for the action expert's attention (50 queries x 8 heads on one KV head,
over the cached prefix and the step's own keys) at batch 1, 8 and 32, and the prefix's own
attention at batch 1, 8 and 32, time
- SDPA as the model calls it (`layers.attention.attention` over the concatenated keys: cuDNN's
  flash kernel on Hopper), the concatenation included;
- the split-KV Triton kernel (`layers.triton_attention`) with its default tiling, and every tiling
  of a small sweep (query rows and keys per block, warps, pipeline stages, fewest keys per split);
each inside a CUDA graph of 20 calls (how the engine runs them: no launch gaps), median of the
replays. Every tiling's output is checked against the fp32 reference before it is timed. Prints one
table per shape and the best tiling; `--json` keeps everything.

    python benchmarks/attention_gpu.py --json runs/attention.json        # on the GPU
    TRITON_INTERPRET=1 python benchmarks/attention_gpu.py --device cpu --tiny   # plumbing check
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from graph_timing import time_calls  # benchmarks/ is on sys.path when this runs as a script

from phyai_edge.layers import triton_attention as ta
from phyai_edge.layers.attention import attention, attention_ref, attention_unmasked
from phyai_edge.layers.triton_dispatch import set_pdl

# (name, batch, query heads, query tokens, keys in the cached part, keys in the own part)
FULL_SHAPES = [
    ("expert b1", 1, 8, 50, 816, 50),
    ("expert b8", 8, 8, 50, 816, 50),
    ("expert b32", 32, 8, 50, 816, 50),
    ("prefix b1", 1, 8, 816, 816, 0),
    ("prefix b8", 8, 8, 816, 816, 0),
    ("prefix b32", 32, 8, 816, 816, 0),
]
# Batch sizes a multi-robot server runs between those (only with --shapes).
EXTRA_SHAPES = [
    ("expert b16", 16, 8, 50, 816, 50),
    ("expert b24", 24, 8, 50, 816, 50),
    ("expert b64", 64, 8, 50, 816, 50),
    ("prefix b2", 2, 8, 816, 816, 0),
    ("prefix b4", 4, 8, 816, 816, 0),
]
CALLS = 20  # calls per captured graph
TINY_SHAPES = [("expert b1", 1, 4, 5, 60, 5), ("expert b2", 2, 4, 5, 60, 5)]


def sweep_configs(tiny: bool, big_blocks: bool = False) -> list[ta.SplitConfig]:
    """The first sweep: 16-64 query rows per block. `big_blocks`: 64- and 128-row blocks only (two
    warpgroups of wgmma for 128 rows), for the shapes with many query blocks (batch 8 and 32)."""
    if tiny:
        return [ta.SplitConfig(16, 16, 2, 1, 16), ta.SplitConfig(32, 32, 4, 2, 32)]
    if big_blocks:
        grid = itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2), (64,))
    else:
        grid = itertools.product((16, 32, 64), (32, 64), (4, 8), (1, 2), (64, 128))
    # splits merged in the split kernel only for 16-row blocks, as the default tilings do
    return [ta.SplitConfig(bm, bn, warps, stages, min_keys, inline_merge=bm <= 16)
            for bm, bn, warps, stages, min_keys in grid]


def parse_configs(spec: str) -> list[ta.SplitConfig]:
    """'bm,bn,warps,stages,min_keys[,inline[,ws[,tma[,kr]]]];...' -> tilings (inline: 1 merges in the
    split kernel; a min_keys above the key count forces one split, so no merge at all; ws: 1
    warp-specialises the key loops; tma: 1 loads the key / value tiles by TMA descriptors, Hopper;
    kr: 1 computes each key block transposed, `SplitConfig.keys_as_rows`)."""
    out = []
    for part in filter(None, (x.strip() for x in spec.split(";"))):
        v = [int(x) for x in part.split(",")]
        if len(v) not in (5, 6, 7, 8, 9):
            raise ValueError(f"--configs entry {part!r}: want bm,bn,warps,stages,min_keys[,inline[,ws[,tma[,kr]]]]")
        out.append(ta.SplitConfig(*v[:5], inline_merge=bool(v[5]) if len(v) >= 6 else v[0] <= 16,
                                  warp_specialize=len(v) >= 7 and bool(v[6]), tma=len(v) >= 8 and bool(v[7]),
                                  keys_as_rows=len(v) == 9 and bool(v[8])))
    return out


def run_shape(shape: tuple, configs: list[ta.SplitConfig], device: torch.device, dtype: torch.dtype,
              dense: bool = False) -> dict[str, Any]:
    name, b, hq, tq, n1, n2 = shape
    d = 256 if device.type == "cuda" else 32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, tq, d, generator=g).to(device, dtype)
    k = torch.randn(b, 1, n1 + n2, d, generator=g).to(device, dtype)
    v = torch.randn(b, 1, n1 + n2, d, generator=g).to(device, dtype)
    mask = torch.ones(b, 1, 1, n1 + n2, dtype=torch.bool, device=device)
    mask[:, ..., n1 - max(n1 // 20, 1):n1] = False  # a few padded prefix keys, as a trimmed prompt leaves
    kp = (k[:, :, :n1].contiguous(), k[:, :, n1:].contiguous())
    vp = (v[:, :, :n1].contiguous(), v[:, :, n1:].contiguous())
    ref = attention_ref(q.float(), k.float(), v.float(), mask)
    key_mask = ta.kernel_key_mask(mask, b)
    sms = ta._sm_count(device)

    def sdpa() -> torch.Tensor:
        kk = kp[0] if n2 == 0 else torch.cat(kp, dim=2)
        vv = vp[0] if n2 == 0 else torch.cat(vp, dim=2)
        return attention(q, kk, vv, mask)

    rows = []

    def rel(out: torch.Tensor) -> float:
        return float((out.float() - ref).norm() / ref.norm())

    out = sdpa()
    rows.append({"variant": "sdpa (model path)", "us": time_calls([sdpa] * CALLS, device.type, replays=15), "rel_err": rel(out)})
    if dense:
        # Every key valid (a batch with no prompt padding, every camera present) and the keys
        # already in one buffer (a KV cache with room for the step's own keys): SDPA with no mask,
        # cuDNN first (`attention_unmasked`), against the same reference on the unmasked keys.
        k_all, v_all = k.contiguous(), v.contiguous()
        ref_dense = attention_ref(q.float(), k.float(), v.float(), torch.ones_like(mask))

        def sdpa_dense() -> torch.Tensor:
            return attention_unmasked(q, k_all, v_all)

        d_err = float((sdpa_dense().float() - ref_dense).norm() / ref_dense.norm())
        rows.append({"variant": "sdpa, no mask, keys in one buffer", "rel_err": d_err,
                     "us": time_calls([sdpa_dense] * CALLS, device.type, replays=15)})
        rows += masked_one_buffer(q, k_all, v_all, mask, ref, device)
    default = ta.default_config(hq * tq, b, sms)
    # The default tiling three ways: as it is, with any splits always merged by a second kernel,
    # and with programmatic dependent launch; then the sweep.
    labelled = [("split, default", default, False),
                ("split, default, merge kernel", replace(default, inline_merge=False), False),
                ("split, default, PDL", default, True)]
    for label, cfg, pdl in labelled + [(None, c, False) for c in configs]:
        splits, _ = ta.plan_splits(hq * tq, n1 + n2, b, sms, cfg.block_m, cfg.block_n, cfg.min_keys)

        def call(cfg: ta.SplitConfig = cfg) -> torch.Tensor:
            return ta.attention_split(q, kp, vp, mask, backend="triton", key_mask=key_mask, config=cfg)

        row: dict[str, Any] = {"variant": label or "split", "config": cfg.__dict__, "splits": splits}
        before = set_pdl(pdl)
        try:
            row["rel_err"] = rel(call())
            if not math.isfinite(row["rel_err"]) or row["rel_err"] > 2e-2:
                row["error"] = f"wrong result: relative error {row['rel_err']:.2e}"
            else:
                row["us"] = time_calls([call] * CALLS, device.type, replays=15)
        except Exception as exc:  # a tiling the GPU cannot run (shared memory, registers): recorded, skipped
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        finally:
            set_pdl(before)
        rows.append(row)
    timed = [r for r in rows if r["variant"] == "split" and "us" in r]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    return {"shape": name, "batch": b, "rows_per_kv_head": hq * tq, "keys": n1 + n2,
            "rows": rows, "best": best}


def masked_one_buffer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, ref: torch.Tensor,
                      device: torch.device) -> list[dict[str, Any]]:
    """The keys in one buffer with some of them padded (a batch whose prompts do not fill their
    bucket): SDPA on the folded queries (one KV head) with the key mask as a boolean mask and as an
    additive bias (0 / -inf, (B, 1, 1, keys) broadcast over the rows), under each backend that
    might take it. Would the one-buffer path serve padded batches too?"""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, hq, tq, d = q.shape
    qf = q.reshape(b, 1, hq * tq, d)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    rows = []
    for backend in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION"):
        for label, m in (("bool mask", mask), ("bias", bias)):
            def call(m: torch.Tensor = m, backend: str = backend) -> torch.Tensor:
                with sdpa_kernel([getattr(SDPBackend, backend)]):
                    return F.scaled_dot_product_attention(qf, k, v, attn_mask=m).reshape(b, hq, tq, d)

            row: dict[str, Any] = {"variant": f"sdpa {backend.split('_')[0].lower()}, {label}, keys in one buffer"}
            try:
                out = call()
                row["rel_err"] = float((out.float() - ref).norm() / ref.norm())
                if not math.isfinite(row["rel_err"]) or row["rel_err"] > 2e-2:
                    row["error"] = f"wrong result: relative error {row['rel_err']:.2e}"
                else:
                    row["us"] = time_calls([call] * CALLS, device.type, replays=15)
            except Exception as exc:  # a backend that refuses the mask or the shape
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            rows.append(row)
    return rows


def vision_backends(device: torch.device, dtype: torch.dtype, batches: tuple[int, ...] = (1, 8, 32)) -> list[dict]:
    """SigLIP's attention (batch x 3 images, 16 heads of 72, 256 patches, no mask) under each SDPA
    backend, in CUDA graphs: which kernel the vision tower should prefer (its head size is not one
    the split kernel takes)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, tokens, d = (16, 256, 72) if device.type == "cuda" else (2, 16, 8)
    rows = []
    for b in batches:
        g = torch.Generator().manual_seed(b)
        q, k, v = (torch.randn(3 * b, heads, tokens, d, generator=g).to(device, dtype) for _ in range(3))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
            row: dict[str, Any] = {"batch": b, "backend": name}
            try:
                with sdpa_kernel([getattr(SDPBackend, name)]):
                    out = F.scaled_dot_product_attention(q, k, v)
                    row["rel_err"] = float((out.float() - ref).norm() / ref.norm())
                    row["us"] = time_calls([lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v)] * CALLS, device.type,
                                           replays=15)
            except Exception as exc:  # a backend that refuses the shape
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
            rows.append(row)
            print(f"| vision b{b} | {name} | " + (f"{row['us']:.1f} us | {row['rel_err']:.1e} |" if "us" in row
                                                   else f"- | {row['error']} |"), flush=True)
    return rows


def print_shape(res: dict[str, Any]) -> None:
    rows = res["rows"]
    sdpa = rows[0]["us"]
    print(f"\n## {res['shape']}: {res['rows_per_kv_head']} query rows per KV head, {res['keys']} keys")
    print("| variant | tiling (bm, bn, warps, stages, min keys) | splits | us | vs SDPA | rel err |")
    print("|---|---|---|---|---|---|")
    fixed = [r for r in rows if r["variant"] != "split"]  # SDPA and the default tiling's rows
    shown = fixed + sorted((r for r in rows if r["variant"] == "split" and "us" in r), key=lambda r: r["us"])[:5]
    default = next(r for r in rows if r["variant"] == "split, default")
    if "us" not in default:
        print(f"(default tiling failed: {default.get('error')})")
    for r in shown:
        cfg = r.get("config")
        tiling = ", ".join(str(x) for x in cfg.values()) if cfg else "-"
        us = r.get("us")
        print(f"| {r['variant']} | {tiling} | {r.get('splits', '-')} | "
              f"{us:.1f} | {sdpa / us:.2f}x | {r['rel_err']:.1e} |" if us else
              f"| {r['variant']} | {tiling} | - | - | - | {r.get('error', '')} |")
    failed = [r for r in rows if "error" in r]
    if failed:
        print(f"({len(failed)} tilings could not run or were wrong; first: {failed[0]['error']})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes and two tilings: plumbing check")
    p.add_argument("--json", type=Path, help="write every timing here")
    p.add_argument("--default-only", action="store_true", help="SDPA against the default tiling alone (no sweep)")
    p.add_argument("--big-blocks", action="store_true", help="sweep 64- and 128-row blocks instead of 16-64")
    p.add_argument("--shapes", default=None, help="comma-separated shape names to run (e.g. 'expert b32,prefix b32')")
    p.add_argument("--configs", default=None,
                   help="time these tilings instead of a sweep: 'bm,bn,warps,stages,min_keys[,inline[,ws[,tma[,kr]]]];...'")
    p.add_argument("--dense", action="store_true",
                   help="also SDPA with no mask on keys already in one buffer (every key valid; cuDNN first)")
    p.add_argument("--vision", action="store_true",
                   help="only SigLIP's attention under each SDPA backend (batch 1, 8, 32 x 3 images)")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.vision:
        rows = vision_backends(device, dtype)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"vision": rows}, indent=1))
        return
    shapes = TINY_SHAPES if args.tiny else FULL_SHAPES
    if args.shapes:
        known = shapes if args.tiny else shapes + EXTRA_SHAPES
        wanted = [x.strip() for x in args.shapes.split(",")]
        unknown = sorted(set(wanted) - {sh[0] for sh in known})
        if unknown:
            p.error(f"--shapes: unknown {unknown}; choose from {[sh[0] for sh in known]}")
        shapes = [sh for sh in known if sh[0] in wanted]
    if args.configs:
        configs = parse_configs(args.configs)
    else:
        configs = [] if args.default_only else sweep_configs(args.tiny, args.big_blocks)
    t0 = time.perf_counter()
    results = []
    for shape in shapes:
        res = run_shape(shape, configs, device, dtype, args.dense)
        print_shape(res)
        results.append(res)
    print(f"\n{len(configs)} tilings x {len(shapes)} shapes in {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
        args.json.write_text(json.dumps({**meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
