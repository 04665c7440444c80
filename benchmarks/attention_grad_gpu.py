"""The action expert's attention under exact RTC guidance: forward + backward, which kernel and
which tiling, at each batch.

One question, one run. For PI0.5's expert attention (50 queries x 8 heads on one KV head over 816
cached prefix keys, a few of them masked, and the step's own 50 keys; head size 256) at batch 1, 2,
4, 8, 16 and 32, time inside CUDA graphs (how the engine replays a guided step):
- "sdpa": SDPA over the keys joined by copies, forward and backward by autograd (cuDNN on Hopper);
- "kernel": the split kernel's forward and its backward (`triton_grad.split_attention_grad`) with the
  tiling `triton_grad.grad_config` chooses for the shape, through autograd as the engine calls it;
- the backward launch alone for that tiling ("default") and every tiling of a sweep
  (`triton_grad.GradConfig`; `--focus`: a short one around the rule's two tilings; `--kv-focus`: the
  dk / dv programs' key blocks, row blocks and row ranges around both; `--latency-focus`: the large
  tiling's pipeline depth, key blocks and dq key ranges), each checked against fp32 autograd first.
Every gradient is checked against the fp32 reference (q, the new keys, the new values; relative
Frobenius error). Prints one table per shape and the rule it suggests for
`triton_attention.GRAD_KERNEL_MAX_HEADS`.

`--cold` cycles each timed call through copies of its inputs that together fill the L2 twice over,
so keys and rows come from memory as in a guided step, where the 18 layers' inputs and weights pass
through L2 between two calls; without it every call re-reads one set, cached after the first. (At
batch 8 cold cost the backward ~1 us: 41.6 -> 42.5, H200, 2026-12-04; inside the replayed guided loop
it costs ~48.6, `pi05_gpu.py`'s stubbed-backward variant.)
`--engine-layout` hands the backward dO and the new values as the strided views the engine's guided
step passes instead of contiguous tensors (in the step the kernel measured slower than here at batch
8). `--fwd-bwd-only` times just "sdpa" and "kernel", which older trees also have, so one call can time
an older checkout beside this one (PYTHONPATH=old_tree).

    python benchmarks/attention_grad_gpu.py --json runs/attention_grad.json        # on the GPU
    TRITON_INTERPRET=1 python benchmarks/attention_grad_gpu.py --device cpu --tiny   # plumbing check
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import l2_bytes, time_calls  # benchmarks/ is on sys.path when this runs as a script

from phyai_edge.layers import triton_attention as ta
from phyai_edge.layers.attention import attention_ref

BATCHES = (1, 2, 4, 8, 16, 32)
CALLS = 10  # calls per captured graph


def sweep(tiny: bool, focus: bool = False, kv_focus: bool = False, latency_focus: bool = False) -> list[Any]:
    from phyai_edge.layers.triton_dispatch import NO_SPLIT
    from phyai_edge.layers.triton_grad import LARGE_GRAD, GradConfig

    if tiny:
        return [GradConfig(block_n=16, min_keys=16, min_rows=16), GradConfig(block_m=32, kv_block_m=32)]
    out = []
    if latency_focus:
        # the dq programs walk every key in sequence; read from memory (not L2) each key block waits
        # longer, which deeper pipelines, narrower key blocks or more programs (key ranges) could hide
        for stages, bn, min_keys in itertools.product((2, 3, 4, 5), (16, 32), (NO_SPLIT, 256)):
            out.append(replace(LARGE_GRAD, stages=stages, block_n=bn, min_keys=min_keys))
        return out
    if kv_focus:
        # the step's own keys' programs (dk / dv), which earlier sweeps left at 16 keys a block: each
        # block re-reads its rows' q, dO and O and recomputes delta, so fewer, wider blocks read less
        for base in (GradConfig(), LARGE_GRAD):
            for kbn, kbm, min_rows in itertools.product((16, 32, 64), (32, 64), (64, 128, NO_SPLIT)):
                out.append(replace(base, kv_block_n=kbn, kv_block_m=kbm, min_rows=min_rows))
        return out
    if focus:
        # around the two tilings `grad_config` chooses between: the small one's range sizes and dk / dv
        # blocks; the large ones with and without dq key ranges (min_keys NO_SPLIT: one range)
        for kbm, min_keys, min_rows in itertools.product((16, 32), (64, 128), (32, 128)):
            out.append(GradConfig(kv_block_m=kbm, min_keys=min_keys, min_rows=min_rows))
        out.append(GradConfig(min_keys=NO_SPLIT))
        for bm, bn, warps, stages in ((64, 64, 4, 2), (64, 32, 4, 3), (64, 32, 4, 2), (128, 32, 8, 3)):
            for min_keys in (128, NO_SPLIT):
                out.append(GradConfig(block_m=bm, block_n=bn, warps=warps, stages=stages, kv_block_m=64,
                                      min_keys=min_keys))
        return out
    # 64 rows on 4 warps is one warpgroup (Hopper's wgmma takes 64 rows a warpgroup) but holds a 64 x 256
    # float32 accumulator in 128 registers a thread; 128 rows on 8 warps, two such warpgroups
    for bm, bn, warps, stages in itertools.product((16, 32, 64, 128), (32, 64), (4, 8), (1, 2, 3)):
        if (bm == 128 and (warps == 4 or bn == 64)) or (bm == 64 and bn == 64 and stages == 3):  # the last: smem
            continue
        out.append(GradConfig(block_m=bm, block_n=bn, warps=warps, stages=stages, kv_block_m=min(bm, 64)))
    for min_keys, min_rows, kbm in itertools.product((64, 256), (32, 128), (16, 64)):
        out.append(GradConfig(min_keys=min_keys, min_rows=min_rows, kv_block_m=kbm))
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm())


def engine_layout(dout: torch.Tensor, vn: torch.Tensor, hq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same values in the layouts the guided step hands the backward: dO the (B, Hq, Tq, D) view of
    the o-projection's (B, Tq, Hq, D) input gradient, the new values a view of the packed QKV output
    (token stride (Hq + 2) x D), as `triton_ops.qkv_rope` leaves them."""
    b, d = dout.shape[0], dout.shape[3]
    dout_view = dout.transpose(1, 2).contiguous().transpose(1, 2)
    packed = torch.zeros(b, vn.shape[2], (hq + 2) * d, dtype=vn.dtype, device=vn.device)
    packed[..., (hq + 1) * d:] = vn[:, 0]
    return dout_view, packed[..., (hq + 1) * d:].reshape(b, vn.shape[2], 1, d).transpose(1, 2)


def make_case(b: int, device: torch.device, dtype: torch.dtype, tiny: bool, engine_views: bool,
              seed: int) -> dict[str, torch.Tensor]:
    hq, tq, n1, n2, d = (4, 5, 60, 5, 32) if tiny else (8, 50, 816, 50, 256)
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, hq, tq, d, generator=g).to(device, dtype) for _ in range(2))
    kc, vc = (torch.randn(b, 1, n1, d, generator=g).to(device, dtype) for _ in range(2))
    kn, vn = (torch.randn(b, 1, n2, d, generator=g).to(device, dtype) for _ in range(2))
    if engine_views:
        dout, vn = engine_layout(dout, vn, hq)
    return {"q": q, "dout": dout, "kc": kc, "vc": vc, "kn": kn, "vn": vn}


def case_sets(b: int, device: torch.device, dtype: torch.dtype, tiny: bool, engine_views: bool,
              cold: bool) -> list[dict[str, torch.Tensor]]:
    """One set of inputs (every call reads the same ones: after the first they sit in L2), or with
    `cold` enough sets that together they fill the L2 twice over, one a call, so each call reads its
    keys and rows from memory as each of the expert's 18 layers does in a guided step (the layers'
    weights pass through L2 in between)."""
    first = make_case(b, device, dtype, tiny, engine_views, seed=b)
    if not cold:
        return [first]
    per_set = sum(t.numel() * t.element_size() for t in first.values()) * 2  # + the forward's out, dq, dk, dv
    n = max(CALLS, min(64, -(-2 * l2_bytes(device.type) // per_set)))
    return [first] + [make_case(b, device, dtype, tiny, engine_views, seed=1000 * b + i) for i in range(1, n)]


def run_batch(b: int, device: torch.device, dtype: torch.dtype, configs: list[Any], fwd_bwd_only: bool,
              tiny: bool, engine_views: bool = False, cold: bool = False) -> dict[str, Any]:
    hq, tq, n1, n2, d = (4, 5, 60, 5, 32) if tiny else (8, 50, 816, 50, 256)
    sets = case_sets(b, device, dtype, tiny, engine_views, cold)
    mask = torch.ones(b, 1, 1, n1 + n2, dtype=torch.bool, device=device)
    mask[:, ..., n1 - max(n1 // 20, 1):n1] = False  # a few padded prompt keys, as a trimmed prompt leaves
    key_mask = ta.kernel_key_mask(mask, b)
    c0 = sets[0]
    leaves32 = [c0[n].float().requires_grad_(True) for n in ("q", "kn", "vn")]
    with torch.enable_grad():
        out32 = attention_ref(leaves32[0], torch.cat([c0["kc"].float(), leaves32[1]], 2),
                              torch.cat([c0["vc"].float(), leaves32[2]], 2), mask)
        ref = torch.autograd.grad(out32, leaves32, c0["dout"].float())
    leaves = [[c[n].clone().requires_grad_(True) for n in ("q", "kn", "vn")] for c in sets]

    def fwd_bwd(on_kernel: bool, i: int) -> Any:
        c, lv = sets[i], leaves[i]

        def call() -> tuple[torch.Tensor, ...]:
            before, ta.GRAD_ON_KERNEL = ta.GRAD_ON_KERNEL, on_kernel
            try:
                with torch.enable_grad():
                    o = ta.attention_split(lv[0], (c["kc"], lv[1]), (c["vc"], lv[2]), mask, backend="triton",
                                           key_mask=key_mask)
                    return torch.autograd.grad(o, lv, c["dout"])
            finally:
                ta.GRAD_ON_KERNEL = before
        return call

    rows: list[dict[str, Any]] = []

    def timed(label: str, make: Any, extra: dict[str, Any] | None = None) -> None:
        """`make(i)`: the call on input set i; set 0 is checked, then every set's call is timed."""
        row: dict[str, Any] = {"variant": label, **(extra or {})}
        try:
            grads = make(0)()
            row["rel_err"] = max(rel(gr, r) for gr, r in zip(grads, ref))
            if not math.isfinite(row["rel_err"]) or row["rel_err"] > 3e-2:
                row["error"] = f"wrong result: relative error {row['rel_err']:.2e}"
            else:
                calls = [make(i) for i in range(len(sets))] if cold else [make(0)] * CALLS
                row["us"] = time_calls(calls, device.type, replays=15)
        except Exception as exc:  # a tiling the GPU cannot run (shared memory, registers): recorded, skipped
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        rows.append(row)

    timed("sdpa (joined keys), fwd+bwd", lambda i: fwd_bwd(False, i))
    timed("kernel, fwd+bwd", lambda i: fwd_bwd(True, i))
    if not fwd_bwd_only:
        from phyai_edge.layers import triton_grad as tg
        from phyai_edge.layers.triton_dispatch import Tickets, _sm_count

        rows_ = hq * tq
        fwd = []  # each set's forward output and log-sum-exp, as the guided step's forward leaves them
        for c in sets:
            lse = torch.empty(b, rows_, dtype=torch.float32, device=device)
            out = ta._split_attention_triton(c["q"].reshape(b, 1, rows_, d), (c["kc"], c["kn"]), (c["vc"], c["vn"]),
                                             key_mask, d ** -0.5, None, tq, lse_out=lse).transpose(1, 2)
            fwd.append((out, lse))
        tickets = Tickets(device)
        sms = _sm_count(device)
        default = tg.grad_config(rows_, b, sms)  # the rule's choice for this shape
        for i, cfg in enumerate([default, *configs]):
            def bwd(j: int, cfg: Any = cfg) -> Any:
                c, (out, lse) = sets[j], fwd[j]
                return lambda: tg.split_attention_grad(c["q"], c["kc"], c["kn"], c["vc"], c["vn"], key_mask, out, lse,
                                                       c["dout"], d ** -0.5, tickets, cfg)

            plan = tg.plan_grad(rows_, n1 + n2, n2, b, sms, cfg)
            timed("backward, default" if i == 0 else "backward", bwd, {"config": cfg.__dict__, "plan": plan})
    sweep_rows = [r for r in rows if r["variant"] == "backward" and "us" in r]
    best = min(sweep_rows, key=lambda r: r["us"]) if sweep_rows else None
    # the backward's matmul FLOPs: dq recomputes scores, dp and ds k over every key; dk / dv recompute
    # scores and dp and form p^T dO and ds^T q over the step's own keys
    bwd_flops = 2 * d * b * (3 * hq * tq * (n1 + n2) + 4 * hq * tq * n2)
    for r in rows:
        if r["variant"].startswith("backward") and "us" in r:
            r["tflops"] = bwd_flops / (r["us"] * 1e-6) / 1e12
    return {"batch": b, "sets": len(sets), "rows": rows, "best": best}


def print_batch(res: dict[str, Any]) -> None:
    print(f"\nexpert attention, batch {res['batch']}" + (f" ({res['sets']} input sets, cycled)" if res["sets"] > 1 else ""))
    print(f"  {'variant':34s} {'us':>9s} {'rel err':>9s}  config / plan (dq ranges, keys, dk-dv ranges, rows)")
    swept = [r for r in res["rows"] if r["variant"] == "backward"]
    # a short sweep (a focus) is printed whole; a long one by its best
    shown = [r for r in res["rows"] if r["variant"] != "backward"] + (
        swept if len(swept) <= 16 else [res["best"]] if res["best"] else [])
    for r in shown:
        us = f"{r['us']:9.1f}" if "us" in r else f"{'-':>9s}"
        err = f"{r['rel_err']:9.2e}" if "rel_err" in r else f"{'-':>9s}"
        label = "backward, best of sweep" if r is res["best"] and len(swept) > 16 else r["variant"]
        cfg = r.get("config")
        tail = r.get("error", "") or (f"{cfg} {r.get('plan')}" if cfg else "")
        tf = f" ({r['tflops']:.0f} TFLOP/s)" if "tflops" in r else ""
        print(f"  {label:34s} {us} {err}  {tail}{tf}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes and two tilings: plumbing check")
    p.add_argument("--batches", default=None, help="comma-separated batches (default 1,2,4,8,16,32)")
    p.add_argument("--fwd-bwd-only", action="store_true", help="only SDPA and the kernel through autograd")
    p.add_argument("--no-sweep", action="store_true", help="the rule's tiling only")
    p.add_argument("--focus", action="store_true", help="a short sweep around the tilings the rule chooses")
    p.add_argument("--kv-focus", action="store_true",
                   help="a sweep of the dk / dv programs' blocks and row ranges around both tilings")
    p.add_argument("--latency-focus", action="store_true",
                   help="a sweep of the large tiling's dq pipeline depth, key blocks and key ranges (use with --cold)")
    p.add_argument("--cold", action="store_true",
                   help="each call on its own copy of the inputs, together twice the L2: read from memory")
    p.add_argument("--block-m", default=None, help="comma-separated: sweep only tilings with these dq block rows")
    p.add_argument("--engine-layout", action="store_true",
                   help="dO and the new values as the strided views the guided step passes (not contiguous)")
    p.add_argument("--json", type=Path, help="write every timing here")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    batches = tuple(int(x) for x in args.batches.split(",")) if args.batches else ((1, 2) if args.tiny else BATCHES)
    configs = [] if (args.no_sweep or args.fwd_bwd_only) else sweep(args.tiny, args.focus, args.kv_focus, args.latency_focus)
    if args.block_m:
        keep = {int(x) for x in args.block_m.split(",")}
        configs = [c for c in configs if c.block_m in keep]
    t0 = time.perf_counter()
    results = []
    meta = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    for b in batches:
        res = run_batch(b, device, dtype, configs, args.fwd_bwd_only, args.tiny, args.engine_layout, args.cold)
        print_batch(res)
        sys.stdout.flush()
        results.append(res)
        if args.json:  # after every batch, so a run cut short by a time limit keeps what it measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    # the rule the numbers give: the kernel's forward + backward against SDPA's, per batch
    print("\nfwd+bwd, kernel vs sdpa (us):")
    for res in results:
        t = {r["variant"].split(",")[0]: r.get("us") for r in res["rows"] if "fwd+bwd" in r["variant"]}
        k, s = t.get("kernel"), t.get("sdpa (joined keys)")
        if k and s:
            print(f"  batch {res['batch']:3d}: kernel {k:8.1f}  sdpa {s:8.1f}  -> {'kernel' if k < s else 'sdpa'}"
                  f" ({s / k:.2f}x)")
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
