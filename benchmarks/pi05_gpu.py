"""PI0.5 on one GPU: LeRobot 0.6.1 eager vs our cudagraph engine, in one run, on identical inputs.

One call does everything (the device lease is short): measures the GPU's two ceilings
(bf16 matmul rate, copy bandwidth), runs `parity_lerobot` (LeRobot's PI05Policy at full size,
saved as a LeRobot folder, loaded through our loader, fp32 and bf16 chunks compared), then
times LeRobot eager bf16 and our engine (batch 1, 8, 32; 1, 2, 3 views; RTC modes), prints
the per-stage table with each stage's floor from our own FLOP/byte count, and writes
results.json + results.md under --out.

    python benchmarks/pi05_gpu.py --out runs/gpu            # full size, needs lerobot==0.6.1
    python benchmarks/pi05_gpu.py --tiny --device cpu       # plumbing check on a CPU
    python benchmarks/pi05_gpu.py --fp8-only --out runs/fp8 # fp8 variants only (no LeRobot needed)
    python benchmarks/pi05_gpu.py --triton-only --out runs/triton  # fused Triton ops ablation only

fp8 (`CudaGraphEngine(fp8="expert"|"all")`, E4M3 weights and activations through torch._scaled_mm
on Ada / Hopper): timed at batch 1 and 32 beside the bf16 engine, accuracy against our eager fp32
on the same inputs and noise. Part of the full run (`--no-fp8` skips it); `--fp8-only` builds
seeded random full-size weights directly on the GPU instead of going through LeRobot, and measures
the bf16 baseline and the fp8 variants alone (a short device call).

Fused Triton ops for the prefix and the action expert (`CudaGraphEngine(triton_ops=True)`, `layers/triton_ops.py`,
`layers/triton_attention.py`; on by default on CUDA, so every other engine here sets `triton_ops=False`):
an ablation at batch 1 and 32: graphs + Triton ops, + the small-M Triton GEMMs for the action
expert (`triton_gemm=True`, `layers/triton_gemm.py`), + fp8 expert, + torch.compile, each beside the
bf16 engine and (with `--triton-only`) graphs + compile without them; accuracy vs eager fp32. Part of
the full run (`--no-triton` skips it); `--triton-only` runs it on seeded full-size weights alone
(combine with `--fp8-only` for both).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import parity_lerobot as par

say = par.say
VALID_TOKENS = 48


# -- ceilings and floors ---------------------------------------------------------------------
def measure_ceilings(device: str) -> dict[str, float]:
    """bf16 matmul TFLOP/s (8192^3, random data) and device copy GB/s (read + write)."""
    if not device.startswith("cuda"):
        return {"tflops": 790.0, "gbps": 4200.0, "measured": False}
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    x = torch.randn(1 << 30, device=device, dtype=torch.bfloat16)  # 2 GiB
    y = torch.empty_like(x)

    def timed(fn: Any, reps: int) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps / 1e3

    t_mm = timed(lambda: torch.mm(a, b), 10)
    t_cp = timed(lambda: y.copy_(x), 10)
    return {"tflops": 2 * n**3 / t_mm / 1e12, "gbps": 2 * x.numel() * 2 / t_cp / 1e9, "measured": True}


def stage_floors(cfg: Any, batch: int, views: int, valid_tokens: int, steps: int,
                 tflops: float, gbps: float) -> dict[str, dict[str, float]]:
    """Each stage's floor from the package's own FLOP and byte count (`roofline.costs`, the count
    `phyai-edge bench` prints floors with) over the ceilings measured in this run. Padding tokens
    count for nothing (the engine trims them)."""
    from phyai_edge.roofline.costs import stage_costs
    from phyai_edge.roofline.devices import measured_device
    from phyai_edge.roofline.predict import stage_floors as floors

    costs = stage_costs("pi05", cfg, batch=batch, views=views, prompt_tokens=valid_tokens, steps=steps)
    out: dict[str, dict[str, Any]] = {}
    for name, f in floors(costs, measured_device("measured", tflops, gbps), "bf16").items():
        out[name] = {"gflop": f.cost.flops / 1e9, "mbytes": f.cost.bytes / 1e6, "compute_ms": f.compute_s * 1e3,
                     "memory_ms": f.memory_s * 1e3, "floor_ms": f.time_s * 1e3, "bound": f.bound}
    out["total"] = {"floor_ms": sum(out[k]["floor_ms"] for k in ("embed_images", "encode_prefix", "solver_loop"))}
    return out


# -- timing helpers --------------------------------------------------------------------------
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_calls(fn: Any, device: str, warmup: int, reps: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    sync(device)
    ms = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        ms.append((time.perf_counter() - t0) * 1e3)
    ms.sort()
    return {"p50": statistics.median(ms), "p90": ms[min(len(ms) - 1, round(0.9 * (len(ms) - 1)))],
            "min": ms[0], "n": len(ms)}


def time_engine(engine: Any, inputs: Any, noise: torch.Tensor, rtc: Any, device: str, warmup: int,
                reps: int) -> dict[str, Any]:
    stages: dict[str, list[float]] = {}

    def call() -> None:
        engine.run(inputs, noise=noise, rtc=rtc)
        for k, v in engine.last_stage_ms.items():
            stages.setdefault(k, []).append(v)

    res = time_calls(call, device, warmup, reps)
    res["stages_p50"] = {k: statistics.median(v[warmup:] or v) for k, v in stages.items()}
    # The cudagraph engine's first flow step beside the prefix: its loop times the other steps.
    res["early_step"] = bool(getattr(engine, "last_early_step", False))
    return res


def rtc_guidance(adapter: Any, batch: int, mode: str) -> Any:
    from phyai_edge.engines.rtc import RTCGuidance, prefix_weights

    h, d = adapter.chunk_size, adapter.model_action_dim
    target = torch.randn(batch, h, d, generator=torch.Generator().manual_seed(5)) * 0.5
    dim_mask = torch.zeros(d)
    dim_mask[: adapter.action_dim] = 1.0
    return RTCGuidance(mode, target, prefix_weights(h, 5, 25), dim_mask, 5, 5.0)


# -- fp8 -------------------------------------------------------------------------------------
FP8_SCOPES = ("expert", "all")


def run_fp8(res: dict[str, Any], adapter: Any, dev: str, inputs_for: Any, noise_for: Any, eager32: Any,
            shapes: list[tuple[int, int]], budget_s: float, compile_b1: bool = False) -> None:
    """fp8 variants of the cudagraph engine: (batch, reps) in `shapes`, 3 views, each scope.
    Dynamic per-tensor activation scales, weight scales from each weight's amax (no calibration
    set: random weights). Results under res["fp8"]."""
    variants: list[tuple[str, dict[str, Any], list[tuple[int, int]]]] = [
        (scope, {"fp8": scope, "triton_ops": False}, shapes) for scope in FP8_SCOPES]
    if compile_b1:
        variants.append(("expert+compile", {"fp8": "expert", "compile": True, "triton_ops": False}, shapes[:1]))
    run_variants(res, "fp8", variants, adapter, dev, inputs_for, noise_for, eager32, budget_s)


def run_triton(res: dict[str, Any], adapter: Any, dev: str, inputs_for: Any, noise_for: Any, eager32: Any,
               shapes: list[tuple[int, int]], budget_s: float, compile: bool = True,
               compile_baseline: bool = False, fp8: bool = True, rtc_modes: tuple[str, ...] = (),
               fp8_scales: dict[str, dict[str, float]] | None = None, only: list[str] | None = None,
               rtc_batches: tuple[int, ...] = (1,)) -> None:
    """Fused Triton ops for the action expert (`CudaGraphEngine(triton_ops=True)`, `layers/triton_ops.py`)
    under the graphs: alone, with the expert's projections on the small-M Triton GEMMs
    (`triton_gemm=True`, `layers/triton_gemm.py`; the denoise step only), with fp8 expert linears,
    and under torch.compile, at each (batch, reps) in `shapes`. `compile_baseline` adds graphs + compile without Triton ops (the number to beat;
    the full run has it in its ablation). Cheap variants first: compile ones are budget-guarded.
    Results under res["triton"]; the path actually taken ("triton" or "reference") in *_info."""
    variants: list[tuple[str, dict[str, Any], list[tuple[int, int]]]] = [
        # The engine's default turns the GEMMs on with the Triton ops on CUDA: pinned here, so the
        # two rows are the ablation.
        ("triton", {"triton_ops": True, "triton_gemm": False}, shapes),
        ("triton+gemm", {"triton_ops": True, "triton_gemm": True}, shapes),
        # attention splits always merged by a second kernel, also where the default tiling merges
        # inside the split kernel (`triton_attention.set_inline_merge`): the same sums, same order
        ("triton+gemm, merge kernel", {"triton_ops": True, "triton_gemm": True, "_inline_merge": False,
                                       "_same_as": "triton+gemm"}, shapes),
        # programmatic dependent launch on (`triton_dispatch.set_pdl`): the same kernels in the
        # same order, so the chunk must be bit-identical to "triton+gemm"; only the time differs
        ("triton+gemm+PDL", {"triton_ops": True, "triton_gemm": True, "_pdl": True,
                             "_same_as": "triton+gemm"}, shapes),
        # the prefix's gate/up + GeGLU on cuBLAS + the GeGLU pass instead of the TMA GEMM that the
        # default routes it to from 4096 rows (`triton_gemm_tma.set_route`; "_tma": the routes on)
        ("triton+gemm, no TMA GeGLU", {"triton_ops": True, "triton_gemm": True, "_tma": ("qkv_rope", "linear")},
         shapes),
        # only the GeGLU on TMA: the prefix's QKV + RoPE and o_proj on cuBLAS (+ the RoPE kernel)
        ("triton+gemm, TMA GeGLU only", {"triton_ops": True, "triton_gemm": True, "_tma": ("geglu",)}, shapes),
        ("triton+gemm, no TMA", {"triton_ops": True, "triton_gemm": True, "_tma": ()}, shapes),
        # the prefix's gate/up + GeGLU below 16384 rows one program a tile, not warp-specialised
        # (the tiling before `triton_gemm_tma.GEGLU_MID`)
        ("triton+gemm, GeGLU tiles", {"triton_ops": True, "triton_gemm": True, "_geglu_tiles": True}, shapes),
        # the same, and at 26112 rows (batch 32) the persistent tiling warp-specialised too
        ("triton+gemm, GeGLU all WS", {"triton_ops": True, "triton_gemm": True, "_geglu_all_ws": True}, shapes),
        # every denoise step remakes its rotary tables and masks (no shared `step_context`): the
        # same arithmetic, so the chunk must be bit-identical to "triton+gemm"
        ("triton+gemm, no step context", {"triton_ops": True, "triton_gemm": True, "_no_context": True,
                                          "_same_as": "triton+gemm"}, shapes),
        # the prefix's attention always masked (`CudaGraphEngine(dense_prefix=False)`); the default
        # drops the mask for full batches (these inputs: 48 of 48 trimmed prompt tokens, 3 cameras)
        ("triton+gemm, masked prefix", {"triton_ops": True, "triton_gemm": True, "dense_prefix": False}, shapes),
        # the action expert's attention always masked, over the two-part keys (`dense_expert=False`); the
        # default, from batch 8, writes the step's keys into the cache's room and attends unmasked
        ("triton+gemm, masked expert", {"triton_ops": True, "triton_gemm": True, "dense_expert": False}, shapes),
        # prompts of one length always rounded up to the 16-token bucket (`EXACT_PROMPT_LENGTHS = 0`); the
        # default keeps a uniform batch's exact length from batch 8. The same with --prompt-tokens 48.
        ("triton+gemm, bucketed prompts", {"triton_ops": True, "triton_gemm": True, "_bucket_only": True}, shapes),
        # exact RTC guidance's VJP on the plain-torch references, forward and backward
        # (`triton_dispatch.set_kernel_backward(False)`); the default runs the kernels and their
        # backward (`layers/triton_grad.py`). Only the RTC rows differ.
        ("triton+gemm, reference VJP", {"triton_ops": True, "triton_gemm": True, "_kernel_backward": False,
                                        "_same_as": "triton+gemm"}, shapes),
        # the VJP's attention always as SDPA over the joined keys (its own fused backward), or always
        # on the split kernel and its backward (`triton_attention.GRAD_ON_KERNEL`); the default
        # chooses by shape
        ("triton+gemm, SDPA VJP attention", {"triton_ops": True, "triton_gemm": True, "_vjp_attention": False,
                                             "_same_as": "triton+gemm"}, shapes),
        ("triton+gemm, kernel VJP attention", {"triton_ops": True, "triton_gemm": True, "_vjp_attention": True,
                                               "_same_as": "triton+gemm"}, shapes),
        # the attention backward's tiling as the eleventh session left it: from batch 5 the dk / dv
        # programs over row ranges of at least 64 rows (`triton_grad.LARGE_GRAD.min_rows` 64); the
        # default gives each of them every row
        ("triton+gemm, previous VJP tiling", {"triton_ops": True, "triton_gemm": True, "_previous_vjp_tiling": True,
                                              "_same_as": "triton+gemm"}, shapes),
        # batch 1's adaptive norms as kernels of their own between the GEMMs
        # (`fused_stacks.set_fold_norms(False)`); the default folds them into the small-M GEMMs
        ("triton+gemm, norms unfolded", {"triton_ops": True, "triton_gemm": True, "_fold_norms": False}, shapes),
        # the residual-fold GEMM (o_proj / down with the residual and the next norm in the epilogue,
        # `triton_fold.RESIDUAL_CONFIG`) on other tilings than the plain linear's (64 x 32, split 4)
        ("triton+gemm, fold split 2", {"triton_ops": True, "triton_gemm": True,
                                       "_residual_config": (64, 32, 128, 4, 4, 2)}, shapes),
        ("triton+gemm, fold 64x16 split 4", {"triton_ops": True, "triton_gemm": True,
                                             "_residual_config": (64, 16, 128, 4, 4, 4)}, shapes),
        ("triton+gemm, fold 64x16 no split", {"triton_ops": True, "triton_gemm": True,
                                              "_residual_config": (64, 16, 128, 4, 4, 1)}, shapes),
        # timing only (its guided chunks are wrong): the attention backward replaced by zero gradients
        # (same allocations), so the guided chunk's drop against the default is that backward's cost
        # inside the replayed graph (the eager profile overstated it: 56 us a call at batch 8 against 48.6)
        ("triton+gemm, VJP attention stubbed (timing only)", {"triton_ops": True, "triton_gemm": True,
                                                               "_stub_vjp_attention": True, "_same_as": "triton+gemm"},
         shapes),
    ]
    if fp8:
        variants.append(("triton+fp8 expert", {"triton_ops": True, "triton_gemm": False, "fp8": "expert"}, shapes))
    for scope in ("prefix", "all") if fp8_scales else ():
        # static activation scales from a calibration pass (`calibrate_fp8`): no amax pass per call
        variants.append((f"triton+fp8 {scope} static", {"triton_ops": True, "fp8": scope, "fp8_scales": fp8_scales,
                                                        "fp8_activations": "static"}, shapes))
    if compile:
        if compile_baseline:
            variants.append(("compile", {"compile": True, "triton_ops": False}, shapes[:1]))
        variants.append(("triton+compile", {"triton_ops": True, "triton_gemm": False, "compile": True}, shapes[:1]))
        if compile_baseline:
            variants.append(("compile", {"compile": True, "triton_ops": False}, shapes[1:]))
        variants.append(("triton+compile", {"triton_ops": True, "triton_gemm": False, "compile": True}, shapes[1:]))
    if only:
        unknown = set(only) - {name for name, _, _ in variants}
        if unknown:
            raise SystemExit(f"--variants: unknown {sorted(unknown)}; known: {[n for n, _, _ in variants]}")
        variants = [v for v in variants if v[0] in only]
    run_variants(res, "triton", variants, adapter, dev, inputs_for, noise_for, eager32, budget_s, rtc_modes,
                 rtc_batches)


def calibrate_fp8(adapter: Any, eager32: Any, inputs_for: Any, noise_for: Any, batch: int = 4,
                  seed: int = 11) -> dict[str, dict[str, float]]:
    """Static fp8 scales (`calibration.fp8`): every linear's input and weight amax over one eager
    fp32 chunk of `batch` synthetic observations drawn with their own seed (the accuracy inputs use
    seed 6: the scales are not fitted to what they are judged on)."""
    from phyai_edge.calibration.fp8 import collect_amax, scales_from_amax

    x, n = par.model_inputs(inputs_for(batch, 3, seed=seed)), noise_for(batch)
    return scales_from_amax(collect_amax(adapter.module, lambda: eager32.run(x, noise=n)))


def _geglu_rule(tiles_below_persistent: bool, all_ws: bool) -> Any:
    """A replacement for `triton_gemm_tma.geglu_config` (None: keep the module's): one program a
    tile below `PERSISTENT_FROM_ROWS` (the earlier rule), or warp specialization at every size."""
    if not (tiles_below_persistent or all_ws):
        return None
    import dataclasses

    from phyai_edge.layers import triton_gemm_tma as tma

    default = tma.geglu_config

    def rule(rows: int, device: Any) -> Any:
        cfg = default(rows, device)
        if tiles_below_persistent and rows < tma.PERSISTENT_FROM_ROWS:
            return tma.GEGLU_TILES
        return dataclasses.replace(cfg, warp_specialize=True) if all_ws else cfg

    return rule


def run_variants(res: dict[str, Any], section: str, variants: list[tuple[str, dict[str, Any], list[tuple[int, int]]]],
                 adapter: Any, dev: str, inputs_for: Any, noise_for: Any, eager32: Any, budget_s: float,
                 rtc_modes: tuple[str, ...] = (), rtc_batches: tuple[int, ...] = (1,)) -> None:
    """Cudagraph engine variants (name, engine options, [(batch, reps)]), 3 views: p50 and stages
    beside the bf16 engine's, accuracy vs eager fp32 on the accuracy inputs (seed 6). Results under
    res[section]; errors are recorded, not raised. `rtc_modes`: at the batches in `rtc_batches`, each RTC
    solver mode's p50 and its overhead over the same engine's unguided chunk (exact guidance also
    against eager fp32's)."""
    from phyai_edge.engines import cudagraph
    from phyai_edge.engines.cudagraph import CudaGraphEngine
    from phyai_edge.layers import triton_attention as attn_mod
    from phyai_edge.layers import triton_fold as fold_mod
    from phyai_edge.layers import triton_gemm as gemm_mod
    from phyai_edge.layers import triton_gemm_tma as tma_mod
    from phyai_edge.layers import triton_grad as grad_mod
    from phyai_edge.layers.fp8 import fp8_linears
    from phyai_edge.layers.fused_stacks import set_fold_norms
    from phyai_edge.layers.triton_attention import set_inline_merge
    from phyai_edge.layers.triton_dispatch import set_kernel_backward, set_pdl
    from phyai_edge.layers.triton_gemm_tma import set_route

    out = res.setdefault(section, {})
    refs: dict[Any, Any] = {}  # eager fp32 chunks by batch, and by (batch, RTC mode)
    chunks: dict[tuple[str, int], Any] = {}
    for name, kw, shapes in variants:
        if not shapes:
            continue
        kw = dict(kw)
        pdl, same_as, inline = kw.pop("_pdl", False), kw.pop("_same_as", None), kw.pop("_inline_merge", True)
        tma_routes = kw.pop("_tma", None)  # None: the module's default routes
        no_context = kw.pop("_no_context", False)
        bucket_only = kw.pop("_bucket_only", False)
        kernel_backward = kw.pop("_kernel_backward", True)
        grad_on_kernel = kw.pop("_vjp_attention", None)
        previous_vjp_tiling = kw.pop("_previous_vjp_tiling", False)
        stub_vjp_attention = kw.pop("_stub_vjp_attention", False)
        fold_norms = kw.pop("_fold_norms", True)
        residual_config = kw.pop("_residual_config", None)
        geglu_rule = _geglu_rule(kw.pop("_geglu_tiles", False), kw.pop("_geglu_all_ws", False))
        if time.perf_counter() - par.T0 > budget_s:
            out.setdefault(name, f"skipped (budget: {time.perf_counter() - par.T0:.0f}s elapsed)")
            continue
        pdl_before = set_pdl(pdl)  # the kernels are launched and captured with these settings
        fold_before = set_fold_norms(fold_norms)
        residual_before = fold_mod.RESIDUAL_CONFIG
        if residual_config is not None:
            fold_mod.RESIDUAL_CONFIG = gemm_mod.GemmConfig(*residual_config)
        backward_before = set_kernel_backward(kernel_backward)
        attn_grad_before, attn_mod.GRAD_ON_KERNEL = attn_mod.GRAD_ON_KERNEL, grad_on_kernel
        merge_before = set_inline_merge(inline)
        tma_before = ({} if tma_routes is None else
                      {op: set_route(op, op in tma_routes) for op in ("geglu", "qkv_rope", "linear")})
        large_before = grad_mod.LARGE_GRAD
        if previous_vjp_tiling:
            grad_mod.LARGE_GRAD = dataclasses.replace(large_before, min_rows=64)
        attn_grad_fn_before = grad_mod.split_attention_grad
        if stub_vjp_attention:
            grad_mod.split_attention_grad = lambda q, kc, kn, vc, vn, *rest, **kw: (
                torch.zeros_like(q), torch.zeros_like(kn), torch.zeros_like(vn))
        geglu_before = tma_mod.geglu_config
        if geglu_rule is not None:
            tma_mod.geglu_config = geglu_rule
        exact_before = cudagraph.EXACT_PROMPT_LENGTHS
        if bucket_only:
            cudagraph.EXACT_PROMPT_LENGTHS = 0
        try:
            t0 = time.perf_counter()
            eng = CudaGraphEngine(copy.deepcopy(adapter), device=dev, dtype="bfloat16", **kw)
            if no_context:
                eng._stages.pop("step_context", None)
            info = {"options": kw, "pdl": pdl, "inline_merge": inline, "tma_routes": "default" if tma_routes is None else list(tma_routes), "build_s": time.perf_counter() - t0, "triton_path": eng.triton_ops,
                    "fp8_linears": eng.fp8_linears,
                    "fp8_paths": sorted({m.backend for m in fp8_linears(eng.module)})}
            out[f"{name}_info"] = info
            say(f"{section} {name}: {info}")
            for b, reps in shapes:
                if time.perf_counter() - par.T0 > budget_s:
                    out[f"{name}_b{b}"] = f"skipped (budget: {time.perf_counter() - par.T0:.0f}s elapsed)"
                    continue
                x, n = par.model_inputs(inputs_for(b, 3)), noise_for(b)
                t0 = time.perf_counter()
                eng.warmup(b, 3, VALID_TOKENS)
                cap = time.perf_counter() - t0
                r = time_engine(eng, x, n, None, dev, 3, reps)
                r["samples_per_s"], r["capture_s"] = b / r["p50"] * 1e3, cap
                xa, na = par.model_inputs(inputs_for(b, 3, seed=6)), noise_for(b)
                if b not in refs:
                    refs[b] = eager32.run(xa, noise=na)
                got = eng.run(xa, noise=na)
                r["vs_eager_fp32"] = par.err(got, refs[b])
                chunks[(name, b)] = got.detach().cpu()
                if same_as and (same_as, b) in chunks:  # expected 0.0: same kernels, same order
                    r[f"max_abs_diff_vs_{same_as}"] = float((chunks[(same_as, b)] - chunks[(name, b)]).abs().max())
                base = res.get("ours", {}).get(f"b{b}_v3")
                if base:
                    r["speedup_vs_bf16"] = base["p50"] / r["p50"]
                out[f"{name}_b{b}"] = r
                say(f"{section} {name} batch {b}: p50 {r['p50']:.2f} ms, {r['samples_per_s']:.1f} samples/s, "
                    f"stages {r['stages_p50']}, vs eager fp32 {r['vs_eager_fp32']} (build+capture {cap:.1f}s)")
                for mode in rtc_modes if b in rtc_batches else ():
                    if time.perf_counter() - par.T0 > budget_s:
                        break
                    g = rtc_guidance(adapter, b, mode)
                    t0 = time.perf_counter()
                    eng.warmup(b, 3, VALID_TOKENS, modes=(mode,))
                    rr = time_engine(eng, x, n, g, dev, 3, reps)
                    rr["overhead"], rr["capture_s"] = rr["p50"] / r["p50"] - 1.0, time.perf_counter() - t0
                    if mode == "guided":  # the VJP's path judged against eager fp32's exact guidance
                        if (b, mode) not in refs:
                            refs[(b, mode)] = eager32.run(xa, noise=na, rtc=g)
                        rr["vs_eager_fp32"] = par.err(eng.run(xa, noise=na, rtc=g), refs[(b, mode)])
                    r.setdefault("rtc", {})[mode] = rr
                    say(f"{section} {name} batch {b} RTC {mode}: p50 {rr['p50']:.2f} ms, "
                        f"overhead {100 * rr['overhead']:+.1f}% (capture {rr['capture_s']:.0f}s)")
            del eng
        except Exception as exc:  # report, keep the rest of the run
            out[name] = f"failed: {type(exc).__name__}: {exc}"
            say(f"{section} {name} failed: {exc}")
        finally:
            set_pdl(pdl_before)
            set_fold_norms(fold_before)
            fold_mod.RESIDUAL_CONFIG = residual_before
            set_kernel_backward(backward_before)
            attn_mod.GRAD_ON_KERNEL = attn_grad_before
            set_inline_merge(merge_before)
            for op, on in tma_before.items():
                set_route(op, on)
            tma_mod.geglu_config = geglu_before
            grad_mod.LARGE_GRAD = large_before
            grad_mod.split_attention_grad = attn_grad_fn_before
            cudagraph.EXACT_PROMPT_LENGTHS = exact_before
        sync(dev)
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()


def _rtc_err(rr: dict[str, Any], key: str) -> str:
    e = rr.get("vs_eager_fp32")
    return f"{e[key]:.2e}" if isinstance(e, dict) else ""


def render_fp8(res: dict[str, Any]) -> list[str]:
    return render_variants(res, "fp8", "fp8 variant")


def render_variants(res: dict[str, Any], section: str, title: str) -> list[str]:
    f = res.get(section)
    if not f:
        return []
    out = ["", f"| {title} | batch | p50 ms | samples/s | vs bf16 engine | vision / prefix / step ms | "
           "vs eager fp32 max abs / scale | rel L2 |", "|---|---|---|---|---|---|---|---|"]
    for key, r in f.items():
        if key.endswith("_info"):
            continue
        if not isinstance(r, dict):
            out.append(f"| {key} | | {r} | | | | | |")
            continue
        name, b = key.rsplit("_b", 1)
        st = r.get("stages_p50", {})
        e = r["vs_eager_fp32"]
        speedup = f"{r['speedup_vs_bf16']:.2f}x" if "speedup_vs_bf16" in r else "-"  # no bf16 engine at this batch
        out.append(f"| {name} | {b} | {r['p50']:.2f} | {r['samples_per_s']:.1f} | "
                   f"{speedup} | {st.get('embed_images', float('nan')):.2f} / "
                   f"{st.get('encode_prefix', float('nan')):.2f} / {st.get('denoise_step', float('nan')):.3f} | "
                   f"{e['max_abs_over_scale']:.2e} | {e['rel_l2']:.2e} |")
    same = [f"{k}: {r[d]:.3g}" for k, r in f.items() if isinstance(r, dict)
            for d in r if d.startswith("max_abs_diff_vs_")]
    if same:
        out += ["", "Chunk difference against the variant it must reproduce (max abs): " + ", ".join(same)]
    for key, r in f.items():
        if isinstance(r, dict) and r.get("rtc"):
            out += [f"| {key.rsplit('_b', 1)[0]} + RTC {mode} | {key.rsplit('_b', 1)[1]} | {rr['p50']:.2f} | | "
                    f"{100 * rr['overhead']:+.1f}% vs unguided | | {_rtc_err(rr, 'max_abs_over_scale')} | "
                    f"{_rtc_err(rr, 'rel_l2')} |" for mode, rr in r["rtc"].items()]
    paths = {k[: -len("_info")]: v.get("triton_path") for k, v in f.items() if k.endswith("_info")}
    if any(paths.values()):
        out.append("")
        out.append("Triton ops path taken: " + ", ".join(f"{k}: {v}" for k, v in paths.items() if v))
    return out


def seeded_adapter(dev: str, tiny: bool, seed: int = 0) -> Any:
    """Our adapter with seeded random weights drawn on `dev` (full size in seconds on a GPU; no
    LeRobot): the same init as `adapters.pi05.builtin.seeded_model`, but on the device."""
    from phyai_edge.adapters.pi05 import PI05Adapter, builtin_adapter
    from phyai_edge.adapters.pi05.builtin import seeded_model_on
    from phyai_edge.adapters.pi05.config import preset

    adapter = builtin_adapter("tiny", seed=seed)
    if tiny:
        return adapter
    cfg = preset("full")
    return PI05Adapter(cfg, seeded_model_on(dev, cfg, seed), adapter.tokenizer, adapter.io)  # the tiny one's tokenizer and robot I/O


def main_seeded(args: argparse.Namespace) -> int:
    """The bf16 engine and its fp8 variants (`--fp8-only`) and / or its Triton-ops variants
    (`--triton-only`) on seeded full-size weights: one short device call."""
    from phyai_edge.engines.cudagraph import CudaGraphEngine
    from phyai_edge.engines.eager import EagerEngine

    dev = args.device
    only = "+".join(m for m, on in (("fp8", args.fp8_only), ("triton", args.triton_only)) if on)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "mode": f"{only}-only",
                           "device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
                           "torch": torch.__version__, "command": " ".join(sys.argv)}

    def dump() -> None:
        (args.out / "results.json").write_text(json.dumps(res, indent=1, default=str))

    res["ceilings"] = measure_ceilings(dev)
    adapter = seeded_adapter(dev, args.tiny)
    cfg = adapter.cfg
    say(f"seeded {'tiny' if args.tiny else 'full'} adapter on {dev}")
    full = not args.tiny
    reps1, reps32 = (50, 10) if full else (3, 2)
    # float32 matmuls stay IEEE here: the eager float32 reference is then float32 arithmetic, and a
    # bf16 engine captures its own graphs with TF32 (`cudagraph.float32_matmuls_in_tf32`), as the
    # product runs them. Until the fourteenth session this script turned TF32 on for everything.
    torch.backends.cudnn.allow_tf32 = True

    def inputs_for(b: int, v: int, seed: int = 3) -> dict[str, torch.Tensor]:
        return par.make_inputs(b, v, [VALID_TOKENS] * b, dev, seed=seed, max_len=cfg.max_token_len,
                               vocab=cfg.vocab_size)

    def noise_for(b: int) -> torch.Tensor:
        return torch.randn(b, adapter.chunk_size, adapter.model_action_dim,
                           generator=torch.Generator().manual_seed(4)).to(dev)

    res["ours"] = {}
    bf16 = CudaGraphEngine(copy.deepcopy(adapter), device=dev, dtype="bfloat16", triton_ops=False)
    eager32 = EagerEngine(adapter, device=dev, dtype="float32")
    res["accuracy"] = {}
    for b, reps in ((1, reps1), (32, reps32)):
        x, n = par.model_inputs(inputs_for(b, 3)), noise_for(b)
        bf16.warmup(b, 3, VALID_TOKENS)
        r = time_engine(bf16, x, n, None, dev, 3, reps)
        r["samples_per_s"] = b / r["p50"] * 1e3
        res["ours"][f"b{b}_v3"] = r
        xa, na = par.model_inputs(inputs_for(b, 3, seed=6)), noise_for(b)
        res["accuracy"][f"b{b}_bf16_cudagraph_vs_eager_fp32"] = par.err(bf16.run(xa, noise=na),
                                                                         eager32.run(xa, noise=na))
        say(f"bf16 cudagraph batch {b}: p50 {r['p50']:.2f} ms, stages {r['stages_p50']}")
        dump()
    del bf16
    sync(dev)
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    if args.fp8_only:
        run_fp8(res, adapter, dev, inputs_for, noise_for, eager32, [(1, reps1), (32, reps32)], args.budget_s,
                compile_b1=not args.no_compile)
        dump()
    if args.triton_only:
        scales = calibrate_fp8(adapter, eager32, inputs_for, noise_for) if args.fp8_static else None
        if scales:  # for serve_gpu.py --fp8-scales: the same seeded weights
            from phyai_edge.calibration.fp8 import save_scales

            save_scales(args.out / "fp8_scales.safetensors", scales, {"source": "pi05_gpu.py --fp8-static", "seed": 0})
        shapes = [(b, reps1 if b == 1 else max(reps32, 320 // b) if full else reps32) for b in args.batches]
        run_triton(res, adapter, dev, inputs_for, noise_for, eager32, shapes, args.budget_s,
                   compile=not args.no_compile, compile_baseline=not args.no_compile_baseline, fp8=not args.no_fp8,
                   rtc_modes=() if args.no_rtc else tuple(args.rtc_modes.split(",")), fp8_scales=scales,
                   only=[v.strip() for v in args.variants.split(";")] if args.variants else None,
                   rtc_batches=tuple(args.rtc_batches))
        dump()
    c = res["ceilings"]
    lines = [f"device: {res['device']}, torch {res['torch']} ({only}-only run, seeded random weights, {'tiny' if args.tiny else 'full size'})",
             f"ceilings: bf16 matmul {c['tflops']:.0f} TFLOP/s, copy {c['gbps']:.0f} GB/s", "",
             "| bf16 engine | batch | p50 ms | samples/s | vs eager fp32 max abs / scale | rel L2 |",
             "|---|---|---|---|---|---|"]
    for key, r in res["ours"].items():
        b = key[1:].split("_")[0]
        e = res["accuracy"][f"b{b}_bf16_cudagraph_vs_eager_fp32"]
        lines.append(f"| cudagraph bf16 | {b} | {r['p50']:.2f} | {r['samples_per_s']:.1f} | "
                     f"{e['max_abs_over_scale']:.2e} | {e['rel_l2']:.2e} |")
    lines += render_fp8(res)
    lines += render_variants(res, "triton", "Triton ops variant")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0


# -- the run ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small sizes: plumbing check (CPU is fine)")
    ap.add_argument("--out", type=Path, default=Path("runs/pi05_gpu"))
    ap.add_argument("--budget-s", type=float, default=470.0, help="skip optional parts past this many seconds")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    ap.add_argument("--no-fp8", action="store_true", help="skip the fp8 variants")
    ap.add_argument("--fp8-static", action="store_true",
                    help="with --triton-only: also the prefix / all-projection fp8 engines with static activation "
                         "scales calibrated on one eager chunk")
    ap.add_argument("--no-rtc", action="store_true", help="with --triton-only: skip the RTC-mode timings")
    ap.add_argument("--rtc-modes", default="inpaint,guided-approx,guided",
                    help="with --triton-only: the RTC modes timed (comma-separated)")
    ap.add_argument("--rtc-batches", type=lambda v: [int(x) for x in v.split(",")], default=[1],
                    help="with --triton-only: the batches that get RTC-mode timings (default 1)")
    ap.add_argument("--fp8-only", action="store_true",
                    help="only the bf16 engine and its fp8 variants, on seeded weights (no LeRobot)")
    ap.add_argument("--no-triton", action="store_true", help="skip the fused Triton ops variants")
    ap.add_argument("--no-compile-baseline", action="store_true",
                    help="--triton-only: skip graphs + compile without the Triton ops (a number an earlier run has)")
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 32],
                    help="with --triton-only: the batch sizes of the Triton variants (default 1,32)")
    ap.add_argument("--variants", default=None,
                    help="with --triton-only: semicolon-separated Triton variant names to run (names hold commas; "
                         "default: all)")
    ap.add_argument("--triton-only", action="store_true",
                    help="only the bf16 engine and its Triton-ops variants, on seeded weights (no LeRobot)")
    ap.add_argument("--prompt-tokens", type=int, default=VALID_TOKENS,
                    help=f"valid prompt tokens of every sample (default {VALID_TOKENS}: a multiple of the 16-token bucket)")
    args = ap.parse_args(argv)
    dev = args.device
    args.out.mkdir(parents=True, exist_ok=True)
    globals()["VALID_TOKENS"] = args.prompt_tokens  # read at call time by the functions above
    if args.fp8_only or args.triton_only:
        return main_seeded(args)
    if args.tiny:
        par.patch_tiny()
    from phyai_edge.engines.cudagraph import CudaGraphEngine
    from phyai_edge.engines.eager import EagerEngine

    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if dev.startswith("cuda")
                           else "cpu", "torch": torch.__version__, "command": " ".join(sys.argv)}
    try:
        import transformers

        res["transformers"] = transformers.__version__
    except ImportError:
        pass

    def dump() -> None:
        (args.out / "results.json").write_text(json.dumps(res, indent=1, default=str))

    res["ceilings"] = ceil = measure_ceilings(dev)
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    say(f"ceilings: {ceil}")
    with tempfile.TemporaryDirectory() as tmp:
        state = par.run_parity(dev, Path(tmp) / "lerobot_pi05", 0, args.tiny)
    res["parity"] = state["report"]
    dump()
    res["parity"]["bf16"] = par.bf16_parity(state, dev)
    say(f"bf16 parity: {json.dumps(res['parity']['bf16'])}")
    dump()
    adapter, policy = state["adapter"], state["lerobot"]
    cfg = adapter.cfg
    vocab, max_len = cfg.vocab_size, cfg.max_token_len
    # timings under the runtime's own settings: float32 matmuls IEEE in the process (a bf16 engine
    # captures its graphs with TF32 itself), cuDNN's TF32 convolutions (torch's default)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True
    full = not args.tiny
    reps1, reps8, reps32 = (50, 20, 10) if full else (3, 2, 2)

    def inputs_for(b: int, v: int, seed: int = 3) -> dict[str, torch.Tensor]:
        return par.make_inputs(b, v, [VALID_TOKENS] * b, dev, seed=seed, max_len=max_len, vocab=vocab)

    def noise_for(b: int) -> torch.Tensor:
        return torch.randn(b, adapter.chunk_size, adapter.model_action_dim,
                           generator=torch.Generator().manual_seed(4)).to(dev)

    # LeRobot eager, bf16 (bf16_parity left it in its own bf16 configuration)
    res["lerobot"] = {}
    for b, warm, reps in ((1, 1, 5 if full else 2), (8, 1, 3 if full else 1), (32, 1, 3 if full else 1)):
        x, n = inputs_for(b, 3), noise_for(b)
        r = time_calls(lambda x=x, n=n, pol=policy: par.lerobot_chunk(pol, x, n), dev, warm, reps)
        r["samples_per_s"] = b / r["p50"] * 1e3
        res["lerobot"][f"b{b}_v3"] = r
        say(f"LeRobot eager bf16 batch {b}: p50 {r['p50']:.1f} ms, {r['samples_per_s']:.1f} samples/s")
        dump()
    del policy, state["lerobot"]
    sync(dev)
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()

    # Our engine, bf16, as `phyai-edge run` builds it: the defaults (on CUDA: graphs, fused layers,
    # the Triton ops and the small-M Triton GEMMs); what each part buys is in the ablation below
    fast = CudaGraphEngine(copy.deepcopy(adapter), device=dev, dtype="bfloat16")
    res["ours_info"] = {"triton_path": fast.triton_ops}
    res["ours"] = {}
    shapes = [(1, 3, reps1), (1, 2, reps1), (1, 1, reps1), (8, 3, reps8), (32, 3, reps32)]
    for b, v, reps in shapes:
        x, n = par.model_inputs(inputs_for(b, v)), noise_for(b)
        t0 = time.perf_counter()
        fast.warmup(b, v, VALID_TOKENS)
        cap = time.perf_counter() - t0
        r = time_engine(fast, x, n, None, dev, 3, reps)
        r["samples_per_s"] = b / r["p50"] * 1e3
        r["capture_s"] = cap
        res["ours"][f"b{b}_v{v}"] = r
        say(f"ours cudagraph bf16 batch {b} views {v}: p50 {r['p50']:.2f} ms p90 {r['p90']:.2f}, "
            f"{r['samples_per_s']:.1f} samples/s, stages {r['stages_p50']} (capture {cap:.1f}s)")
        dump()

    # Accuracy: bf16 cudagraph vs our eager fp32 (same inputs and noise), batch 1 and 8
    eager32 = EagerEngine(adapter, device=dev, dtype="float32")
    res["accuracy"] = {}
    for b in (1, 8):
        x, n = par.model_inputs(inputs_for(b, 3, seed=6)), noise_for(b)
        ref = eager32.run(x, noise=n)
        res["accuracy"][f"b{b}_bf16_cudagraph_vs_eager_fp32"] = par.err(fast.run(x, noise=n), ref)
    # RTC: overhead of each solver mode over the unguided chunk, and guided correctness
    res["rtc"] = {}
    for b in (1, 8):
        x, n = par.model_inputs(inputs_for(b, 3)), noise_for(b)
        base = res["ours"][f"b{b}_v3"]["p50"]
        for mode in ("inpaint", "guided-approx", "guided"):
            g = rtc_guidance(adapter, b, mode)
            fast.warmup(b, 3, VALID_TOKENS, modes=(mode,))
            r = time_engine(fast, x, n, g, dev, 3, reps1 if b == 1 else reps8)
            r["overhead"] = r["p50"] / base - 1.0
            res["rtc"][f"b{b}_{mode}"] = r
            say(f"RTC {mode} batch {b}: p50 {r['p50']:.2f} ms, overhead {100 * r['overhead']:.1f}%")
        g = rtc_guidance(adapter, b, "guided")
        res["accuracy"][f"b{b}_guided_bf16_cudagraph_vs_eager_fp32"] = par.err(fast.run(x, noise=n, rtc=g),
                                                                               eager32.run(x, noise=n, rtc=g))
        dump()
    say(f"accuracy: {json.dumps(res['accuracy'])}")

    # fp8 (E4M3) expert-only and everywhere, batch 1 and 32, accuracy vs eager fp32
    if not args.no_fp8:
        run_fp8(res, adapter, dev, inputs_for, noise_for, eager32, [(1, reps1), (32, reps32)],
                args.budget_s - 120)
        dump()

    # Fused Triton ops for the action expert (graphs + triton_ops, + fp8, + compile), batch 1 and 32
    if not args.no_triton:
        run_triton(res, adapter, dev, inputs_for, noise_for, eager32, [(1, reps1), (32, reps32)],
                   args.budget_s - 120, compile=not args.no_compile)
        dump()

    # What each change bought: eager bf16 (ours), graphs alone, and the full engine
    res["ablation"] = {}
    plain = CudaGraphEngine(copy.deepcopy(adapter), device=dev, dtype="bfloat16", triton_ops=False, fuse=False, trim_prompt=False,
                            modulation_tables=False)
    no_triton = CudaGraphEngine(copy.deepcopy(adapter), device=dev, dtype="bfloat16", triton_ops=False)
    for b, reps in ((1, reps1), (32, reps32)):
        x, n = par.model_inputs(inputs_for(b, 3)), noise_for(b)
        for label, eng in (("graphs_only", plain), ("graphs_fused_no_triton", no_triton)):
            eng.warmup(b, 3, VALID_TOKENS)
            r = time_engine(eng, x, n, None, dev, 3, reps)
            res["ablation"][f"b{b}_{label}"] = r
            say(f"{label} batch {b}: p50 {r['p50']:.2f} ms, {r['stages_p50']}")
    del plain, no_triton
    eager16 = EagerEngine(copy.deepcopy(adapter), device=dev, dtype="bfloat16")
    x, n = par.model_inputs(inputs_for(1, 3)), noise_for(1)
    res["ablation"]["b1_ours_eager_bf16"] = r = time_engine(eager16, x, n, None, dev, 2, 10 if full else 2)
    say(f"ours eager bf16 batch 1: p50 {r['p50']:.1f} ms")
    del eager16
    dump()

    # Optional: torch.compile underneath the same graphs (compile time is long: budget-guarded)
    elapsed = time.perf_counter() - par.T0
    if not args.no_compile and elapsed < args.budget_s - 150:
        try:
            comp = CudaGraphEngine(copy.deepcopy(adapter), device=dev, dtype="bfloat16", compile=True,
                                   triton_ops=False)
            for b, reps in ((1, reps1), (32, reps32)):
                if time.perf_counter() - par.T0 > args.budget_s:
                    break
                x, n = par.model_inputs(inputs_for(b, 3)), noise_for(b)
                t0 = time.perf_counter()
                comp.warmup(b, 3, VALID_TOKENS)
                cap = time.perf_counter() - t0
                r = time_engine(comp, x, n, None, dev, 3, reps)
                r["samples_per_s"], r["compile_and_capture_s"] = b / r["p50"] * 1e3, cap
                ref = eager32.run(x, noise=n)
                r["vs_eager_fp32"] = par.err(comp.run(x, noise=n), ref)
                res["ablation"][f"b{b}_compiled"] = r
                say(f"compiled + graphs batch {b}: p50 {r['p50']:.2f} ms, {r['stages_p50']} "
                    f"(compile+capture {cap:.0f}s)")
                dump()
        except Exception as exc:  # report, keep the rest of the run
            res["ablation"]["compile_error"] = f"{type(exc).__name__}: {exc}"
            say(f"compile variant failed: {exc}")
    else:
        res["ablation"]["compiled"] = f"skipped ({elapsed:.0f}s elapsed)"

    # Floors and the per-stage table
    steps = adapter.solver.num_steps
    table = []
    for key in ("b1_v3", "b32_v3"):
        b = int(key[1:].split("_")[0])
        fl = stage_floors(cfg, b, 3, VALID_TOKENS, steps, ceil["tflops"], ceil["gbps"])
        res.setdefault("floors", {})[key] = fl
        st = res["ours"][key]["stages_p50"]
        early = res["ours"][key].get("early_step", False)
        for stage in ("embed_images", "encode_prefix", "denoise_step", "solver_loop"):
            m = st.get(stage, float("nan"))
            f = dict(fl[stage])
            label = stage
            if early and stage == "solver_loop" and steps > 1:  # the other steps: their floor
                f["floor_ms"] *= (steps - 1) / steps
                label = f"solver_loop (steps 2-{steps})"
            elif early and stage == "encode_prefix":
                label = "encode_prefix (+ step 1 beside it)"
            table.append(f"| {b} | {label} | {m:.3f} | {f['floor_ms']:.3f} | {f['bound']} | {f['floor_ms'] / m:.0%} |")
        m = res["ours"][key]["p50"]
        table.append(f"| {b} | whole chunk (wall clock) | {m:.3f} | {fl['total']['floor_ms']:.3f} | | "
                     f"{fl['total']['floor_ms'] / m:.0%} |")
    res["stage_table"] = table
    dump()
    lines = render(res)
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0 if res["parity"]["fp32_pass"] else 1


def render(res: dict[str, Any]) -> list[str]:
    c, lr, ours = res["ceilings"], res["lerobot"], res["ours"]
    p = res["parity"]
    out = [f"device: {res['device']}, torch {res['torch']}, transformers {res.get('transformers')}",
           f"ceilings measured: bf16 matmul {c['tflops']:.0f} TFLOP/s, copy {c['gbps']:.0f} GB/s",
           "", "| batch | views | LeRobot eager bf16 p50 ms | ours cudagraph bf16 p50 ms | p90 ms | speed-up | "
           "ours samples/s |", "|---|---|---|---|---|---|---|"]
    for key, r in ours.items():
        b, v = key[1:].split("_v")
        base = lr.get(f"b{b}_v3") if v == "3" else None
        out.append(f"| {b} | {v} | {base['p50']:.1f} |" if base else f"| {b} | {v} | |")
        speedup = f"{base['p50'] / r['p50']:.1f}x" if base else ""
        out[-1] += f" {r['p50']:.2f} | {r['p90']:.2f} | {speedup} | {r['samples_per_s']:.1f} |"
    out += ["", "| batch | stage | measured p50 ms | floor ms | bound | floor / measured |", "|---|---|---|---|---|---|"]
    out += res["stage_table"]
    out += ["", "| RTC mode | batch | p50 ms | overhead vs unguided |", "|---|---|---|---|"]
    for key, r in res["rtc"].items():
        b, mode = key[1:].split("_", 1)
        out.append(f"| {mode} | {b} | {r['p50']:.2f} | {100 * r['overhead']:+.1f}% |")
    out += ["", "| accuracy | max abs / scale | rel L2 |", "|---|---|---|"]
    rows = {"fp32 eager vs LeRobot fp32": p["fp32_eager_vs_lerobot_fp32"],
            "fp32 cudagraph vs LeRobot fp32": p["fp32_cudagraph_vs_lerobot_fp32"],
            **{k.replace("_", " "): v for k, v in p["bf16"].items()},
            **{k.replace("_", " "): v for k, v in res["accuracy"].items()}}
    for name, e in rows.items():
        out.append(f"| {name} | {e['max_abs_over_scale']:.2e} | {e['rel_l2']:.2e} |")
    out += render_fp8(res)
    out += render_variants(res, "triton", "Triton ops variant")
    out += ["", "| ablation | p50 ms | stages p50 ms |", "|---|---|---|"]
    for key, r in res["ablation"].items():
        if isinstance(r, dict):
            st = ", ".join(f"{k} {v:.2f}" for k, v in r.get("stages_p50", {}).items())
            out.append(f"| {key} | {r['p50']:.2f} | {st} |")
        else:
            out.append(f"| {key} | {r} | |")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
