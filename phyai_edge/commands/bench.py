"""`phyai-edge bench`: per-stage latency of a model on a backend and device."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from phyai_edge.commands.common import adapter_options, add_adapter_option_argument

HELP = "time a model's stages on a backend and device"
DESCRIPTION = """Time each stage of a model (preprocess, vision, prefix, one denoise step, the whole
solver loop, postprocess) on synthetic inputs and print median and p90 latency and samples/s,
with each model stage's floor on the GPU (its peak FLOPs and bandwidth) beside it. A floor is the
task's (the valid prompt tokens, time tables computed once), not the engine's: an engine that does
more work (eager attends to all 200 padded tokens) reaches a smaller fraction of it. A preset without
--checkpoint times seeded random weights (the full one drawn on the device: timing only).

Examples:
  phyai-edge bench --preset tiny --device cpu
  phyai-edge bench --preset full --device cuda --dtype bfloat16 --backend cudagraph --views 3 --batch 1
  phyai-edge bench --preset full --device cuda --dtype bfloat16 --backend cudagraph --fp8 expert
  phyai-edge bench --engine engines/pi05-orin            # an exported bundle
  phyai-edge bench --preset full --device meta           # structure and parameter count only
  phyai-edge bench --checkpoint ~/ckpt/pi05 --device meta   # a checkpoint's, its weights not read
"""

STAGE_ORDER = ["preprocess", "embed_images", "encode_prefix", "denoise_step", "solver_loop", "postprocess", "total"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapter", default="pi05", help="model adapter (default: pi05)")
    p.add_argument("--preset", default="tiny", help="built-in size when no checkpoint is given: tiny | full")
    p.add_argument("--checkpoint", help="checkpoint folder (LeRobot, openpi or native)")
    add_adapter_option_argument(p)
    p.add_argument("--tokenizer", help="tokenizer.json / tokenizer.model (or folder), if not in the checkpoint")
    p.add_argument("--engine", help="an exported engine bundle folder (overrides --backend)")
    p.add_argument("--backend", default="eager", help="eager | cudagraph | onnxruntime | tensorrt")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | meta (structure only)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--batch", type=int, default=1, help="observations per call")
    p.add_argument("--views", type=int, default=None, help="cameras with images (default: all the model has)")
    p.add_argument("--steps", type=int, default=None, help="flow steps (default: the model's)")
    p.add_argument("--prompt-tokens", type=int, default=48, help="valid prompt tokens per sample (rest is padding)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    p.add_argument("--iters", type=int, default=20, help="timed calls")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default, or 0: torch's own choice)")
    p.add_argument("--fp8", choices=["expert", "prefix", "all"], default=None,
                   help="cudagraph backend: run these linears in fp8 E4M3 (torch._scaled_mm on Ada/Hopper, "
                   "the plain-torch reference path elsewhere); default: none")
    p.add_argument("--fp8-scales", default=None, metavar="FILE",
                   help="calibrated fp8 scales (.safetensors from `phyai-edge export --precision fp8`); "
                   "default: weight amax, dynamic activation scales")
    p.add_argument("--triton-ops", action=argparse.BooleanOptionalAction, default=None,
                   help="cudagraph backend: norms, residuals, RoPE, GeGLU and attention of the prefix and the action "
                   "expert as fused Triton kernels (layers/triton_ops.py, layers/triton_attention.py); default: on "
                   "on a CUDA device with triton installed; --triton-ops on a CPU takes their reference path")
    p.add_argument("--triton-gemm", action=argparse.BooleanOptionalAction, default=None,
                   help="cudagraph backend, with the Triton ops: the action expert's projections on small-M Triton "
                   "GEMMs with RoPE / GeGLU fused in (layers/triton_gemm.py; calls of <= 64 rows, i.e. batch 1); "
                   "default: on wherever the Triton ops run on a CUDA device")
    p.add_argument("--early-step", action=argparse.BooleanOptionalAction, default=None,
                   help="cudagraph backend, with the Triton ops: the first flow step on a second CUDA stream beside "
                   "the prefix (batches up to 8), the same chunk; default: on. Measured faster on Hopper (-2 to -3%% "
                   "a chunk); where the prefix already fills the GPU it can be slower: compare --no-early-step "
                   "on yours (daemon: model.engine_options = { early_step = false })")
    p.add_argument("--rtc", default="none", choices=("none", "inpaint", "guided-approx", "guided"),
                   help="time every chunk with this Real-Time Chunking mode, as the daemon's chunks after the first "
                   "run: the rest of a previous chunk (half of it) as the prefix, d = 2 (guided: exact guidance, "
                   "a backward pass every flow step; the daemon's default is guided-approx); default: none")
    p.add_argument("--floor-device", default=None, metavar="NAME",
                   help="print each model stage's floor on this device (its peak FLOPs and bandwidth from the "
                   "roofline's device table, e.g. h200, orin, rtx-4090) beside the measured time; default: the "
                   "GPU the run is on, when the table knows it; 'none': no floors")
    p.add_argument("--json", action="store_true", help="print one JSON object (input to `phyai-edge roofline`)")


# d for `--rtc`: at 50 Hz a 15-30 ms chunk is 1-2 slots late. Timing does not depend on it.
BENCH_RTC_DELAY = 2


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def run_bench(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    from phyai_edge.adapters.base import ModelInputs, Observation, SolverSpec
    from phyai_edge.commands.common import (
        LOAD_ERRORS,
        check_at_least,
        check_device,
        fail,
        load_policy_or_fail,
    )
    from phyai_edge.extras import with_install_hint

    check_device("bench", args.device, allow_meta=True)
    # --views 0 timed every camera (`args.views or all`), a negative --prompt-tokens or --threads
    # was a traceback; a prompt has at least one token (its BOS).
    check_at_least("bench", ("--batch", args.batch, 1), ("--iters", args.iters, 1), ("--warmup", args.warmup, 0),
                   ("--steps", args.steps, 1), ("--views", args.views, 1), ("--prompt-tokens", args.prompt_tokens, 1),
                   ("--threads", args.threads, 0))
    if args.floor_device and args.floor_device.lower() != "none":
        from phyai_edge.roofline.devices import find_device

        try:  # before the run, not after it
            find_device(args.floor_device)
        except ValueError as exc:
            fail("bench", f"--floor-device: {exc}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "meta":
        from phyai_edge.adapters import load_adapter

        if args.engine:  # it counted the preset's parameters instead, as if they were the bundle's
            fail("bench", "--device meta counts a checkpoint's or preset's parameters, not an engine bundle's: "
                 "leave out --engine")
        try:  # the checkpoint's structure, read without its weights (it counted the preset's)
            adapter = load_adapter(args.adapter, adapter_options("bench", args) or None, checkpoint=args.checkpoint,
                                   preset_name=args.preset, device="meta", tokenizer=args.tokenizer)
        except LOAD_ERRORS as exc:
            fail("bench", with_install_hint(exc))
        n = sum(p.numel() for p in adapter.module.parameters())
        parts = {name: sum(p.numel() for p in m.parameters()) for name, m in adapter.module.named_children()}
        return {"adapter": args.adapter, "preset": args.preset if not args.checkpoint else "checkpoint",
                "device": "meta", "params": n, "params_by_part": parts}

    fp8 = getattr(args, "fp8", None)
    options = {}
    # `fail`, not SystemExit(text): a usage error is exit 2 with the command's name, as every other here.
    if fp8 is not None or getattr(args, "fp8_scales", None):
        if args.engine:
            fail("bench", "--fp8 / --fp8-scales do not apply to a bundle: its fp8 setting was fixed at export")
        if args.backend != "cudagraph":
            fail("bench", f"--fp8 / --fp8-scales need --backend cudagraph (got --backend {args.backend})")
        options = {"fp8": fp8 or "expert", "fp8_scales": args.fp8_scales}
    if getattr(args, "triton_ops", None) is not None:
        if args.engine:
            fail("bench", "--triton-ops does not apply to a bundle (it is a cudagraph engine option)")
        if args.backend != "cudagraph":
            fail("bench", f"--triton-ops needs --backend cudagraph (got --backend {args.backend})")
        options["triton_ops"] = args.triton_ops
    for flag, name in (("--triton-gemm", "triton_gemm"), ("--early-step", "early_step")):
        if getattr(args, name, None) is not None:
            if args.engine or args.backend != "cudagraph":
                fail("bench", f"{flag} is a cudagraph engine option: it needs --backend cudagraph and no --engine")
            options[name] = getattr(args, name)
    policy = load_policy_or_fail("bench", adapter=args.adapter, checkpoint=args.checkpoint, preset=args.preset,
                                 backend=args.backend, device=args.device, dtype=args.dtype, bundle=args.engine,
                                 tokenizer=args.tokenizer, engine_options=options,
                                 adapter_options=adapter_options("bench", args))
    adapter = policy.adapter
    fixed = getattr(policy.engine, "batch_sizes", None)
    if fixed and args.batch not in fixed:  # said here, not as the engine's traceback at the first call
        fail("bench", f"--batch {args.batch}: the engine bundle {args.engine} was exported for batch sizes "
             f"{', '.join(map(str, sorted(fixed)))}; re-export with --batch {args.batch} to time it")
    if args.steps:
        adapter.solver = SolverSpec(args.steps)
    cams = policy.camera_names
    views = args.views or len(cams)
    if not 1 <= views <= len(cams):
        fail("bench", f"--views {views}: expected 1 to {len(cams)} for this model (its cameras: {', '.join(cams)})")
    rng = np.random.default_rng(0)
    obs = [
        Observation(images={c: (rng.integers(0, 256, (480, 640, 3), dtype=np.uint8) if i < views else None)
                            for i, c in enumerate(cams)},
                    state=rng.uniform(-1, 1, policy.state_dim).astype(np.float32), prompt="pick up the cube")
        for _ in range(args.batch)
    ]
    base = adapter.preprocess(obs, device=policy.device)
    inputs, n_valid = base, None
    if "tokens" in base.tensors and "token_mask" in base.tensors:
        # A fixed number of valid prompt tokens, as a real prompt of that length would give
        # (models with a tokenised prompt; others run on their preprocessed observation as is).
        tokens = base.tensors["tokens"].clone()
        max_len = tokens.shape[1]
        n_valid = min(args.prompt_tokens, max_len)
        tokens[:, :n_valid] = torch.randint(4, getattr(getattr(adapter, "tokenizer", None), "vocab_size", 256),
                                            (args.batch, n_valid))
        tokens[:, n_valid:] = 0
        mask = torch.zeros_like(base.tensors["token_mask"])
        mask[:, :n_valid] = True
        inputs = ModelInputs({**base.tensors, "tokens": tokens.to(policy.device),
                              "token_mask": mask.to(policy.device)}, args.batch)
    rtc_mode = getattr(args, "rtc", "none")
    rtc_request = None
    if rtc_mode != "none":
        from phyai_edge.engines.base import RTCRequest

        # As the daemon's chunks after the first: the executing chunk's rest after s = H / 2 actions
        # ran (a chunk this policy made), d actions of it fixed while the new one is computed.
        s = policy.chunk_size // 2
        previous = policy.postprocess(policy.engine.run(inputs), base)
        rtc_request = RTCRequest(rtc_mode, np.asarray(previous)[:, s:], min(BENCH_RTC_DELAY, s), s)  # type: ignore[arg-type]
    states = base.extras.get("states")
    samples: dict[str, list[float]] = {}
    for i in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        adapter.preprocess(obs, device=policy.device)
        t1 = time.perf_counter()
        # the guidance is made on the host every call, as `Policy.infer` makes it: engine time
        guidance = None if rtc_request is None else policy.rtc_guidance(rtc_request, args.batch, states)
        chunk = policy.engine.run(inputs, rtc=guidance)
        t2 = time.perf_counter()
        policy.postprocess(chunk, base)  # `base` keeps preprocess's extras (the states a relative policy adds back)
        t3 = time.perf_counter()
        if i < args.warmup:
            continue
        row = {"preprocess": (t1 - t0) * 1e3, **policy.engine.last_stage_ms, "postprocess": (t3 - t2) * 1e3,
               "engine": (t2 - t1) * 1e3, "total": (t3 - t0) * 1e3}
        for k, v in row.items():
            samples.setdefault(k, []).append(v)
    stages = {k: {"p50_ms": statistics.median(v), "p90_ms": _percentile(v, 90)} for k, v in samples.items()}
    from phyai_edge.commands.info import collect

    info = collect()
    gpu = info["gpus"][0]["name"] if info["gpus"] and args.device != "cpu" else None
    # The cudagraph engine's first flow step beside the prefix (`early_step`): the loop times the
    # other steps, so its floor is theirs.
    early = bool(getattr(policy.engine, "last_early_step", False))
    steps = adapter.solver.num_steps
    loop_steps = steps - 1 if early and steps > 1 else steps
    # A bundle's precision is its manifest's, whatever --dtype says (the roofline reads "precision" first),
    # and so are its floors: an fp32 bundle's were taken at --dtype's bf16 peak.
    manifest = getattr(policy, "manifest", None) or {}
    precisions = set((manifest.get("precision") or {}).values())
    dtype = manifest.get("dtype", args.dtype)
    floor_device, floors, floor_note = _floors(args, adapter, views, n_valid, gpu, getattr(policy.engine, "fp8", None),
                                               loop_steps, dtype)
    return {
        "adapter": args.adapter, "preset": args.preset if not args.checkpoint else "checkpoint",
        "backend": getattr(policy.engine, "backend", args.backend), "device": args.device,
        "dtype": dtype, "bundle": args.engine,
        "precision": precisions.pop() if len(precisions) == 1 else None,
        "fp8": getattr(policy.engine, "fp8", None), "fp8_linears": getattr(policy.engine, "fp8_linears", 0),
        "triton_ops": getattr(policy.engine, "triton_ops", None),
        "triton_gemm": getattr(policy.engine, "triton_gemm", None),
        "batch": args.batch, "views": views, "steps": adapter.solver.num_steps, "prompt_tokens": n_valid,
        "iters": args.iters, "stages": stages, "early_step": early, "rtc": rtc_mode,
        "samples_per_s": args.batch / (stages["engine"]["p50_ms"] / 1e3),
        "torch": info["torch"], "gpu": gpu,
        "floor_device": floor_device, "floors": floors, "floor_note": floor_note,
    }


def _floors(args: argparse.Namespace, adapter: Any, views: int, prompt_tokens: int | None, gpu: str | None,
            fp8: str | None, loop_steps: int, dtype: str) -> tuple[str | None, dict[str, dict[str, float | str]], str]:
    """(device name, {stage: floor_ms, bound}, note): each model stage's floor from the adapter's
    FLOP / byte count (`roofline.costs`) at the device's peaks, the solver loop's for the
    `loop_steps` steps it timed; empty, with the reason, where there is no floor to print (no
    device, no cost model, a precision the table has no peak for). `dtype`: what the engine computes
    in (a bundle's, from its manifest)."""
    from phyai_edge.roofline.costs import stage_costs
    from phyai_edge.roofline.devices import find_device
    from phyai_edge.roofline.predict import stage_floors
    from phyai_edge.roofline.sources import DTYPE_PRECISIONS

    name = args.floor_device or gpu
    if name is None or name.lower() == "none":
        return None, {}, "no floor device (a CUDA run uses its GPU; or --floor-device NAME)"
    try:
        device = find_device(name)
    except ValueError as exc:
        return name, {}, str(exc)
    precision = DTYPE_PRECISIONS.get(dtype)
    if precision is None or fp8:
        why = f"fp8 {fp8} mixes precisions" if fp8 else f"the table has no {dtype} peak"
        return device.name, {}, f"no floors: {why}"
    try:
        costs = stage_costs(args.adapter, adapter.cfg, batch=args.batch, views=views, prompt_tokens=prompt_tokens,
                            steps=loop_steps, precision=precision)
        floors = stage_floors(costs, device, precision)
    except (ValueError, AttributeError) as exc:  # no cost model for this adapter, or no peak for it
        return device.name, {}, f"no floors: {exc}"
    return device.name, {s: {"floor_ms": f.time_s * 1e3, "bound": f.bound} for s, f in floors.items()}, (
        f"peaks from the device table: {device.peak_flops(precision) / 1e12:.0f} TFLOP/s {precision}, "
        f"{device.bandwidth_gbs:.0f} GB/s; the task's work (valid prompt tokens, time tables once), "
        "whatever this engine does")


def main(args: argparse.Namespace) -> int:
    result = run_bench(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if result["device"] == "meta":
        what = f"checkpoint {args.checkpoint}" if args.checkpoint else f"preset {result['preset']}"
        print(f"{result['adapter']} {what}: {result['params']:,} parameters")
        for name, n in result["params_by_part"].items():
            print(f"  {name:<18}{n:>15,}")
        return 0
    fp8 = f", fp8 {result['fp8']} ({result['fp8_linears']} linears)" if result.get("fp8") else ""
    fp8 += f", Triton ops ({result['triton_ops']} path)" if result.get("triton_ops") else ""
    fp8 += ", small-M Triton GEMMs" if result.get("triton_gemm") else ""
    print(f"{result['adapter']} {result['preset']} on {result['device']} ({result['backend']}, {result['dtype']}{fp8}), "
          f"batch {result['batch']}, {result['views']} views, {result['steps']} steps, "
          + (f"{result['prompt_tokens']} prompt tokens, " if result["prompt_tokens"] is not None else "")
          + (f"RTC {result['rtc']}, " if result.get("rtc", "none") != "none" else "")
          + f"{result['iters']} iterations")
    floors = result.get("floors") or {}
    head = f"{'stage':<16}{'p50 ms':>10}{'p90 ms':>10}"
    print(head + (f"{'floor ms':>11}{'bound':>9}{'floor/p50':>11}" if floors else ""))
    # PI0.5's stages in their order; another model's stages (its own names) after them.
    others = [n for n in result["stages"] if n not in STAGE_ORDER and n not in ("engine", "total")]
    for name in [*STAGE_ORDER[:-1], *others, "engine", "total"]:
        if name in result["stages"]:
            s = result["stages"][name]
            line = f"{name:<16}{s['p50_ms']:>10.2f}{s['p90_ms']:>10.2f}"
            if name in floors:
                f = floors[name]
                line += f"{f['floor_ms']:>11.3f}{f['bound']:>9}{f['floor_ms'] / s['p50_ms']:>11.0%}"
            print(line)
    print(f"samples/s (engine p50): {result['samples_per_s']:.1f}")
    if result.get("early_step"):
        print(f"the first flow step ran beside the prefix (early_step): encode_prefix holds what of it did not "
              f"overlap; solver_loop and its floor are the other {result['steps'] - 1} steps")
    if result.get("floor_device"):  # the peaks used, or why there are no floors
        print(f"floors on {result['floor_device']}: {result['floor_note']}")
    sys.stdout.flush()
    return 0
