"""The action expert's GEMMs at batch 1, 8 and 32: cuBLAS (+ the separate Triton epilogue kernel)
against the small-M Triton GEMMs of `layers/triton_gemm.py` over a small sweep of tile configs.

One device call. For each expert shape (fused QKV + RoPE 2560 x 1024, o_proj 1024 x 2048, fused
gate/up + GeGLU 8192 x 1024, down 1024 x 4096) at M = 50, 400, 1600 rows (batch 1, 8, 32 x 50
tokens), bf16:

1. correctness: every Triton config's output against the reference (`F.linear` + the reference
   epilogue), max abs error, and both paths' max abs error against float32 math on the same
   bf16 inputs;
2. time: the cuBLAS path as the engine runs it today (`F.linear`, then `triton_ops.qkv_rope` /
   `triton_ops.geglu` as their own kernels), `F.linear` alone, and each Triton config; median
   microseconds per call, achieved TB/s of weight bytes (N x K x 2 / time), speed-up against the
   cuBLAS path;
3. the best config per shape, and the `triton_gemm.CONFIGS` entry it suggests.

How a call is timed (GPU): several copies of the weight, together more than twice the L2 cache,
are called in turn inside one captured CUDA graph (as the expert's 18 layers stream 620 MB of
weights, a layer's weights are never in L2 when it starts); the graph is replayed 20 times, each
replay timed with CUDA events; median replay / copies. In-graph time is what a denoise step pays,
launch gaps between kernels included.

    PYTHONPATH=$PWD python3 benchmarks/gemm_gpu.py --json $OUT/gemm.json       # H200, ~5 min
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gemm_gpu.py --device cpu --tiny   # plumbing

On a CPU (`--device cpu`, Triton's interpreter, which `--device cpu` turns on if it is not set)
tiny shapes, two configs per op, perf_counter timings: a plumbing check only, the numbers mean
nothing. Not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from graph_timing import l2_bytes, time_calls  # benchmarks/ is on sys.path when this runs as a script

T0 = time.perf_counter()
TOKENS = 50  # the expert's rows per sample (the action chunk)


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# -- shapes and sweeps -----------------------------------------------------------------------------------
PARTS = ("expert", "prefix", "vision")
# rows per sample of each part: the action chunk; 3 x 256 image tokens + 48 prompt tokens; 3 images
PART_TOKENS = {"expert": TOKENS, "prefix": 816, "vision": 768}


def expert_shapes(tiny: bool, part: str = "expert") -> list[dict[str, Any]]:
    """One layer's projections (full size: PI0.5's; tiny: the tiny preset's). `n` is the weight's
    row count, `k` its column count. expert / prefix: the Gemma layers (fused QKV + RoPE, o_proj,
    fused gate/up + GeGLU, down); vision: SigLIP's fc1 with its bias and GELU."""
    if part == "vision":
        width, mlp = (32, 64) if tiny else (1152, 4304)
        return [{"name": "fc1+gelu", "op": "gelu", "n": mlp, "k": width, "bias": True}]
    if tiny:
        heads, kv_heads, head_dim, width, mlp = 2, 1, 16, 32, 64
    elif part == "prefix":
        heads, kv_heads, head_dim, width, mlp = 8, 1, 256, 2048, 16384
    else:
        heads, kv_heads, head_dim, width, mlp = 8, 1, 256, 1024, 4096
    return [
        {"name": "qkv+rope", "op": "qkv_rope", "n": (heads + 2 * kv_heads) * head_dim, "k": width,
         "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim},
        {"name": "o_proj", "op": "linear", "n": width, "k": heads * head_dim},
        {"name": "gate_up+geglu", "op": "geglu", "n": 2 * mlp, "k": width},
        {"name": "down", "op": "linear", "n": width, "k": mlp},
    ]


def sweep(op: str, rows: int, n: int, tiny: bool) -> list[Any]:
    """The default config for (op, rows, n) (`triton_gemm.default_config`; n as `shape_class`
    reads it) first, then candidate tilings (block_m, block_n, block_k, warps, stages, split_k)
    around it: a hand-picked few, not a grid (each config is a compile, ~1 s)."""
    from phyai_edge.layers.triton_gemm import GemmConfig, default_config

    if tiny:
        picks = [(16, 16, 32, 4, 2, 1 if op == "gelu" else 2)]
    elif rows <= 64:
        picks = {
            "linear": [(64, 32, 128, 4, 4, 1), (64, 32, 128, 4, 4, 2), (64, 32, 128, 4, 4, 8), (64, 64, 128, 4, 4, 4),
                       (64, 16, 128, 4, 4, 4), (64, 32, 256, 4, 3, 4), (64, 32, 64, 4, 5, 4), (32, 32, 128, 4, 4, 4),
                       (16, 32, 128, 4, 4, 4), (64, 64, 64, 4, 4, 8), (64, 32, 128, 8, 4, 4)],
            # split K (the tile's last split adds the partials and runs the epilogue) for more programs
            "geglu": [(64, 32, 128, 4, 3, 2), (64, 32, 128, 4, 4, 2), (64, 32, 64, 4, 4, 2), (64, 32, 128, 4, 3, 4),
                      (64, 16, 128, 4, 4, 2), (64, 64, 128, 4, 3, 2), (64, 64, 128, 4, 3, 4), (64, 32, 256, 4, 3, 1),
                      (64, 16, 128, 4, 4, 1)],
            "qkv_rope": [(64, 16, 128, 4, 4, 2), (64, 16, 128, 4, 3, 2), (64, 16, 64, 4, 4, 2), (64, 16, 128, 4, 4, 4),
                         (64, 16, 64, 4, 5, 4), (64, 32, 128, 4, 4, 2), (64, 32, 128, 4, 4, 4), (64, 16, 256, 4, 3, 1),
                         (64, 16, 64, 4, 5, 1)],
        }[op]
    elif rows > 2048:  # compute-bound: Hopper-sized tiles, grouped for L2 reuse (the 7th field)
        picks = {
            "linear": [(128, 256, 64, 8, 3, 1, 8), (128, 128, 64, 8, 4, 1, 8), (128, 128, 64, 4, 4, 1, 8),
                       (256, 128, 64, 8, 3, 1, 8), (128, 256, 64, 8, 4, 1, 8)],
            "gelu": [(128, 256, 64, 8, 3, 1, 8), (128, 128, 64, 8, 4, 1, 8), (128, 128, 64, 4, 4, 1, 8),
                     (256, 128, 64, 8, 3, 1, 8), (128, 64, 64, 4, 4, 1, 8)],
            "geglu": [(128, 128, 64, 8, 3, 1, 8), (128, 128, 64, 8, 4, 1, 8), (128, 64, 64, 4, 4, 1, 8),
                      (128, 64, 64, 8, 4, 1, 8), (256, 64, 64, 8, 3, 1, 8), (64, 128, 64, 4, 4, 1, 8),
                      (128, 128, 32, 8, 5, 1, 8), (128, 128, 64, 8, 3, 1, 16)],
            "qkv_rope": [(128, 128, 64, 8, 3, 1, 8), (128, 64, 64, 4, 4, 1, 8), (128, 64, 64, 8, 4, 1, 8),
                         (256, 64, 64, 8, 3, 1, 8), (64, 128, 64, 4, 4, 1, 8)],
        }[op]
    else:
        picks = {
            "gelu": [(64, 64, 64, 4, 4, 1), (64, 128, 64, 4, 3, 1), (128, 64, 64, 4, 3, 1), (128, 128, 64, 8, 3, 1, 4),
                     (128, 256, 64, 8, 3, 1, 4)],
            "linear": [(64, 64, 64, 4, 4, 1), (64, 128, 64, 4, 3, 1), (128, 64, 64, 4, 3, 1), (128, 128, 64, 8, 3, 1),
                       (128, 128, 32, 4, 4, 1), (64, 64, 64, 4, 4, 2), (128, 64, 64, 8, 3, 2), (64, 256, 64, 8, 3, 1)],
            "geglu": [(64, 64, 64, 4, 3, 1), (64, 32, 64, 4, 4, 1), (128, 64, 64, 8, 3, 1), (128, 32, 64, 4, 3, 1),
                      (64, 128, 64, 8, 3, 1), (128, 64, 32, 4, 4, 1)],
            "qkv_rope": [(64, 64, 64, 4, 3, 1), (64, 32, 64, 4, 4, 1), (128, 64, 64, 8, 3, 1), (128, 32, 64, 4, 3, 1),
                         (64, 128, 64, 8, 3, 1), (128, 128, 64, 8, 3, 1)],
        }[op]
    out = [default_config(op, rows, n)]
    for pick in picks:
        cfg = GemmConfig(*pick)
        if cfg not in out:
            out.append(cfg)
    return out


def parse_tma_configs(text: str) -> list[Any]:
    """`--tma-configs`: tilings separated by ';', each "block_m,block_n,block_k,warps,stages,group_m,
    programs[,flags]" with programs "sms" (one per SM), "tiles" (one per tile) or a number, and
    flags any of f (flatten), s (subtile), w (warp_specialize)."""
    from phyai_edge.layers.triton_gemm_tma import TmaConfig

    out = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        f = [x.strip() for x in item.split(",")]
        if len(f) not in (7, 8):
            raise SystemExit(f"--tma-configs: {item!r} needs 7 or 8 fields (see --help)")
        p = f[6]
        sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4
        programs = None if p == "tiles" else sms if p == "sms" else int(p)
        flags = f[7] if len(f) == 8 else ""
        if set(flags) - set("fsw"):
            raise SystemExit(f"--tma-configs: unknown flags in {item!r} (f, s, w)")
        out.append(TmaConfig(*(int(x) for x in f[:6]), programs=programs, flatten="f" in flags,
                             subtile="s" in flags, warp_specialize="w" in flags))
    return out


def tma_sweep(op: str, rows: int, override: list[Any] | None = None) -> list[Any]:
    """TMA GEMM tilings (`layers/triton_gemm_tma.py`): (block_m, block_n, block_k, warps, stages,
    group_m, persistent programs or None). geglu's block_n counts H columns (two accumulators).
    `override` (from `--tma-configs`) replaces the built-in picks."""
    from phyai_edge.layers.triton_gemm_tma import TmaConfig

    if override:
        return override
    if not torch.cuda.is_available():  # the interpreter's plumbing check: one tile-per-program, one persistent
        return [TmaConfig(16, 16, 16, 4, 2, 2), TmaConfig(16, 16, 16, 4, 2, 2, programs=4, flatten=op == "qkv_rope")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # (..., programs, flatten, subtile): the persistent tilings as one pipelined (tile, k) loop, the
    # store in two halves (a fourth stage then fits in shared memory), k 32 with deeper pipelines
    picks = {
        "geglu": [(128, 128, 64, 8, 3, 16, sms), (128, 128, 64, 8, 3, 16, sms, True),
                  (128, 128, 64, 8, 3, 16, sms, True, True), (128, 128, 64, 8, 4, 16, sms, True, True),
                  (128, 128, 64, 8, 4, 16, sms, False, True), (128, 128, 32, 8, 6, 16, sms, True, True),
                  (128, 128, 64, 8, 3, 8, sms, True, True), (128, 128, 64, 8, 3, 8, None),
                  (128, 128, 64, 8, 4, 8, None, False, True)],
        "linear": [(128, 128, 64, 4, 4, 8, None), (128, 128, 64, 4, 4, 8, sms), (128, 128, 64, 4, 4, 8, sms, True),
                   (128, 256, 64, 8, 3, 8, sms), (128, 256, 64, 8, 3, 8, sms, True, True),
                   (128, 256, 64, 8, 4, 8, sms, True, True)],
        # one head (256 columns) a tile; block_n is unused
        "qkv_rope": [(128, 256, 64, 8, 3, 8, sms, True), (128, 256, 64, 8, 3, 8, sms), (128, 256, 64, 8, 4, 8, sms, True),
                     (128, 256, 64, 8, 3, 16, sms, True), (128, 256, 64, 8, 3, 8, None), (64, 256, 64, 4, 3, 8, sms, True)],
    }[op]
    if rows < 4096:  # the action expert's batch 8-64 (400-3200 rows): smaller tiles for more programs
        picks = {
            "geglu": [(128, 128, 64, 8, 3, 8, None), (64, 128, 64, 4, 3, 8, None), (128, 64, 64, 4, 4, 8, None),
                      (64, 64, 64, 4, 4, 8, None), (64, 128, 64, 4, 3, 8, sms), (128, 64, 64, 4, 4, 8, sms)],
            "linear": [(128, 128, 64, 4, 4, 8, None), (64, 128, 64, 4, 4, 8, None), (128, 64, 64, 4, 4, 8, None),
                       (128, 256, 64, 8, 3, 8, sms, True, True), (64, 256, 64, 4, 3, 8, sms, True, True)],
            "qkv_rope": [(128, 256, 64, 8, 3, 8, None), (64, 256, 64, 4, 3, 8, None), (128, 256, 64, 8, 3, 8, sms, True),
                         (64, 256, 64, 4, 3, 8, sms, True), (128, 256, 64, 8, 4, 8, None)],
        }[op]
    return [TmaConfig(*p) for p in picks]


# -- timing --------------------------------------------------------------------------------------------------
def max_abs(a: Any, b: Any) -> float:
    if isinstance(a, (tuple, list)):
        return max(max_abs(x, y) for x, y in zip(a, b))
    return float((a.float() - b.float()).abs().max())


# -- one shape at one M ------------------------------------------------------------------------------------------
def run_shape(shape: dict[str, Any], rows: int, device: str, tiny: bool, deadline: float, tma: bool = False,
              no_sweep: bool = False, tma_configs: list[Any] | None = None) -> dict[str, Any]:
    from phyai_edge.layers import triton_gemm as tg
    from phyai_edge.layers import triton_ops
    from phyai_edge.layers.rotary import rope_cos_sin
    from phyai_edge.layers.triton_dispatch import Tickets

    op, n, k = shape["op"], shape["n"], shape["k"]
    batch = max(1, rows // shape.get("tokens", TOKENS))
    t = rows // batch
    dt = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(rows * 7 + n)
    h = torch.randn(batch, t, k, generator=g).to(device, dt)
    w0 = (torch.randn(n, k, generator=g) * k**-0.5).to(device, dt)
    wbytes = n * k * w0.element_size()
    copies = 1 if not device.startswith("cuda") else max(2, min(48, -(-2 * l2_bytes(device) // wbytes)))
    weights = [w0] + [w0.clone() for _ in range(copies - 1)]
    n_class = n // 2 if op == "geglu" else n  # what shape_class reads: geglu's H, the others' N
    res: dict[str, Any] = {"shape": shape["name"], "op": op, "rows": rows, "n": n, "k": k, "weight_mb": wbytes / 1e6,
                           "copies": copies, "class": tg.shape_class(op, rows, n_class)}
    triton_epi = "triton" if triton_ops.triton_status(device)[0] else "reference"
    # split-K tilings' tickets, shared by the calls as a stack shares them (no zero-fill per call)
    tickets = Tickets(torch.device(device))
    if op == "qkv_rope":
        hq, hkv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
        positions = torch.arange(t, device=device)[None, :] + 800 + torch.arange(batch, device=device)[:, None]
        cos, sin = rope_cos_sin(positions, d, 10000.0, dt)

        def cublas(w: torch.Tensor) -> Any:
            return triton_ops.qkv_rope(F.linear(h, w), cos, sin, hq, hkv, d, triton_epi)

        def triton_fn(w: torch.Tensor, cfg: Any) -> Any:
            return tg.linear_qkv_rope(h, w, cos, sin, hq, hkv, d, "triton", config=cfg, tickets=tickets)

        ref = tg.linear_qkv_rope_ref(h, w0, cos, sin, hq, hkv, d)
        exact = tg.linear_qkv_rope_ref(h.float(), w0.float(), cos.float(), sin.float(), hq, hkv, d)
    elif op == "gelu":
        bias = (torch.randn(n, generator=g) * 0.1).to(device, dt) if shape.get("bias") else None

        def cublas(w: torch.Tensor) -> Any:  # SigLIP's path: the GEMM adds the bias, then the GELU kernel
            return triton_ops.bias_gelu(F.linear(h, w, bias), None, triton_epi)

        def triton_fn(w: torch.Tensor, cfg: Any) -> Any:
            return tg.linear_gelu(h, w, "triton", bias=bias, config=cfg)

        ref = tg.linear_gelu_ref(h, w0, bias)
        exact = tg.linear_gelu_ref(h.float(), w0.float(), None if bias is None else bias.float())
    elif op == "geglu":
        def cublas(w: torch.Tensor) -> Any:
            return triton_ops.geglu(F.linear(h, w), triton_epi)

        def triton_fn(w: torch.Tensor, cfg: Any) -> Any:
            return tg.linear_geglu(h, w, "triton", config=cfg, tickets=tickets)

        ref = tg.linear_geglu_ref(h, w0)
        exact = tg.linear_geglu_ref(h.float(), w0.float())
    else:
        def cublas(w: torch.Tensor) -> Any:
            return F.linear(h, w)

        def triton_fn(w: torch.Tensor, cfg: Any) -> Any:
            return tg.linear(h, w, "triton", config=cfg)

        ref = tg.linear_ref(h, w0)
        exact = F.linear(h.float(), w0.float())
    res["cublas_path_err_vs_fp32"] = max_abs(cublas(w0), exact)
    res["variants"] = variants = []

    def record(name: str, us: float, err: float | None = None, cfg: Any = None) -> None:
        row = {"variant": name, "us": us, "tb_s": wbytes / (us * 1e-6) / 1e12,
               "tflop_s": 2 * h.numel() // k * n * k / (us * 1e-6) / 1e12, "max_abs_err_vs_ref": err}
        if cfg is not None:
            row["config"] = dataclasses.asdict(cfg)
        variants.append(row)

    record("cuBLAS path" + (" + epilogue kernel" if op != "linear" else ""),
           time_calls([lambda w=w: cublas(w) for w in weights], device))
    if op != "linear":
        record("F.linear alone", time_calls([lambda w=w: F.linear(h, w) for w in weights], device))
    if op == "gelu" and device.startswith("cuda") and bias is not None:
        # cuBLASLt's GELU epilogue (tanh form on CUDA): one kernel, no Triton
        h2 = h.reshape(-1, k)

        def lt(w: torch.Tensor) -> Any:
            return torch._addmm_activation(bias, h2, w.t(), use_gelu=True)

        try:
            record("cuBLASLt bias+GELU epilogue", time_calls([lambda w=w: lt(w) for w in weights], device),
                   max_abs(lt(w0).view_as(ref), ref))
        except Exception as exc:  # a torch build without the Lt path
            variants.append({"variant": "cuBLASLt bias+GELU epilogue", "error": f"{type(exc).__name__}: {exc}"[:160]})
    if tma and op in ("geglu", "linear", "qkv_rope"):
        from phyai_edge.layers import triton_gemm_tma as tma_mod

        if op == "qkv_rope":
            def tma_fn(h: torch.Tensor, w: torch.Tensor, backend: str, config: Any) -> Any:
                return tma_mod.linear_qkv_rope(h, w, cos, sin, hq, hkv, d, backend, config=config)
        else:
            tma_fn = tma_mod.linear_geglu if op == "geglu" else tma_mod.linear
        for cfg in tma_sweep(op, rows, tma_configs):
            name = f"tma {cfg.label()}"
            if time.perf_counter() > deadline:
                variants.append({"variant": name, "skipped": "budget"})
                continue
            try:
                err = max_abs(tma_fn(h, w0, "triton", config=cfg), ref)
                record(name, time_calls([lambda w=w, c=cfg: tma_fn(h, w, "triton", config=c) for w in weights],
                                        device), err)
            except Exception as exc:  # shared memory / registers the GPU refuses: record, go on
                variants.append({"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
    for i, cfg in enumerate([] if no_sweep else sweep(op, rows, n_class, tiny)):
        name = f"triton {cfg.label()}" + (" (default)" if i == 0 else "")
        if time.perf_counter() > deadline:
            variants.append({"variant": name, "skipped": "budget"})
            continue
        try:
            out = triton_fn(w0, cfg)
            err = max_abs(out, ref)
            if i == 0:
                res["triton_err_vs_fp32"] = max_abs(out, exact)
            record(name, time_calls([lambda w=w, c=cfg: triton_fn(w, c) for w in weights], device), err, cfg)
        except Exception as exc:  # a config the GPU refuses (shared memory, registers): record, go on
            variants.append({"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
    base = variants[0]["us"]
    for v in variants:
        if "us" in v:
            v["speedup"] = base / v["us"]
    timed = [v for v in variants if v["variant"].startswith("triton") and "us" in v]
    if timed:
        res["best"] = min(timed, key=lambda v: v["us"])
    del weights
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return res


def render(results: list[dict[str, Any]]) -> list[str]:
    lines = ["| shape | M | variant | us | weight TB/s | TFLOP/s | vs cuBLAS path | max abs err vs ref |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for v in r["variants"]:
            if "us" not in v:
                lines.append(f"| {r['shape']} | {r['rows']} | {v['variant']} | {v.get('error') or v.get('skipped')} "
                             "| | | | |")
                continue
            err = v["max_abs_err_vs_ref"]
            lines.append(f"| {r['shape']} | {r['rows']} | {v['variant']} | {v['us']:.2f} | {v['tb_s']:.3g} | "
                         f"{v['tflop_s']:.0f} | {v['speedup']:.2f}x | {'' if err is None else f'{err:.3g}'} |")
    lines += ["", "| shape | M | shape class | cuBLAS path us | best Triton | us | TB/s | speed-up | "
              "err vs fp32: cuBLAS path / Triton |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b = r.get("best")
        if not b:
            continue
        lines.append(f"| {r['shape']} | {r['rows']} | {r['class']} | {r['variants'][0]['us']:.2f} | "
                     f"{b['variant'].removeprefix('triton ')} | {b['us']:.2f} | {b['tb_s']:.3g} | {b['speedup']:.2f}x | "
                     f"{r['cublas_path_err_vs_fp32']:.3g} / {r.get('triton_err_vs_fp32', float('nan')):.3g} |")
    lines += ["", "Suggested `triton_gemm.CONFIGS` entries (best per shape class; the expert's shapes only):"]
    seen: dict[str, dict[str, Any]] = {}
    for r in results:
        b = r.get("best")
        if b and (r["class"] not in seen or b["us"] < seen[r["class"]]["us"]):
            seen[r["class"]] = b
    for cls, b in seen.items():
        c = b["config"]
        lines.append(f'    "{cls}": _cfg({c["block_m"]}, {c["block_n"]}, {c["block_k"]}, warps={c["num_warps"]}, '
                     f'stages={c["num_stages"]}, split={c["split_k"]}, group={c["group_m"]}),')
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny-preset shapes, two configs per op (plumbing check)")
    ap.add_argument("--rows", default=None, help="comma-separated M values (default 50,400,1600; tiny 50,100)")
    ap.add_argument("--json", type=Path, default=None, help="write every number here")
    ap.add_argument("--budget-s", type=float, default=500.0, help="skip the remaining Triton configs past this")
    ap.add_argument("--part", choices=PARTS, default="expert",
                    help="whose layer: the action expert (rows = batch x 50), the prefix (batch x 816: Gemma 2B "
                         "over 3 x 256 image + 48 prompt tokens) or SigLIP (batch x 768: fc1 + GELU)")
    ap.add_argument("--tma", action="store_true",
                    help="also time the TMA GEMMs (layers/triton_gemm_tma.py) for geglu, linear and qkv_rope")
    ap.add_argument("--tma-configs", default=None,
                    help="with --tma: the TMA tilings to time instead of the built-in picks, ';'-separated "
                         "'block_m,block_n,block_k,warps,stages,group_m,programs[,flags]' (programs: sms, tiles or "
                         "a number; flags: f flatten, s subtile, w warp_specialize)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the pointer-based Triton GEMM sweep")
    ap.add_argument("--ops", default=None, help="comma-separated ops to run (linear, gelu, geglu, qkv_rope; default all)")
    args = ap.parse_args(argv)
    dev = args.device
    if not dev.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    from phyai_edge.layers import triton_dispatch

    ok, why = triton_dispatch.triton_status(dev)
    if not ok:
        print(f"Triton kernels cannot run on {dev}: {why}", file=sys.stderr)
        return 2
    import triton

    rows_list = [int(s) for s in (args.rows or ("50,100" if args.tiny else "50,400,1600")).split(",")]
    info = {"date": time.strftime("%Y-%m-%d"), "part": args.part, "device": torch.cuda.get_device_name(dev) if dev.startswith("cuda")
            else "cpu (Triton interpreter)", "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join(sys.argv), "l2_bytes": l2_bytes(dev), "tiny": args.tiny}
    say(f"{info}")
    deadline = T0 + args.budget_s
    tma_configs = parse_tma_configs(args.tma_configs) if args.tma_configs else None
    results = []
    for rows in rows_list:
        for shape in expert_shapes(args.tiny, args.part):
            if args.ops and shape["op"] not in args.ops.split(","):
                continue
            shape = {**shape, "tokens": PART_TOKENS[args.part] if not args.tiny else TOKENS}
            r = run_shape(shape, rows, dev, args.tiny, deadline, args.tma, args.no_sweep, tma_configs)
            results.append(r)
            b = r.get("best", {})
            say(f"{shape['name']} M={rows}: cuBLAS path {r['variants'][0]['us']:.2f} us, best Triton "
                f"{b.get('variant', '-')} {b.get('us', float('nan')):.2f} us ({b.get('tb_s', float('nan')):.2f} TB/s), "
                f"max abs err {b.get('max_abs_err_vs_ref')}")
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"info": info, "results": results}, indent=1, default=str))
    print("\n".join(render(results)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
