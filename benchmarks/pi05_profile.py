"""Where a PI0.5 chunk's GPU time goes: kernel counts and the heaviest kernels per stage.

For each batch size: the cudagraph engine's stage times (graph replays, CUDA events), then each
stage run once eagerly on the same static buffers under `torch.profiler`: how many kernels it
launches, the sum of their device time against the stage's replay time (a replay that takes much
longer than its kernels' sum is launch- or gap-bound; one close to it is kernel-bound), and the
heaviest kernels. Then the attention call of each stage timed under every SDPA backend on its
real shapes, and optionally the denoise step under `torch.compile` (what inductor leaves).

    python benchmarks/pi05_profile.py --out runs/profile                 # full size, H200
    python benchmarks/pi05_profile.py --tiny --device cpu --out /tmp/p    # plumbing check

Writes profile.json and profile.md under --out. Seeded random weights (no checkpoint needed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import parity_lerobot as par
from graph_timing import replay_ms
from pi05_gpu import VALID_TOKENS, seeded_adapter, sync, time_engine

say = par.say


def profile_call(fn: Any, device: str, top: int = 12) -> dict[str, Any]:
    """One call of `fn` under the profiler (after one warm call): kernel count, summed kernel time,
    the call's own time (CUDA events), and the `top` kernels by total time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = (time.perf_counter() - t0) * 1e3
    cuda = device.startswith("cuda")
    want = DeviceType.CUDA if cuda else DeviceType.CPU
    per: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type != want:
            continue
        if not cuda and e.cpu_parent is not None:  # CPU: leaf ops only, as a stand-in for kernels
            continue
        per[e.name].append(e.time_range.elapsed_us())
    total = sum(sum(v) for v in per.values())
    rows = sorted(((k, len(v), sum(v)) for k, v in per.items()), key=lambda r: -r[2])
    return {"kernels": sum(len(v) for v in per.values()), "kernel_ms": total / 1e3, "wall_ms": wall,
            "top": [{"name": k[:110], "count": n, "ms": us / 1e3, "share": us / total if total else 0.0}
                    for k, n, us in rows[:top]]}


def synced_ms(fn: Any, reps: int = 30) -> float:
    """Median wall-clock milliseconds of `fn` to the end of a CUDA sync, after one warm call."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def host_breakdown(eng: Any, gs: Any, loop_graph: Any, x: Any, noise: torch.Tensor, reps: int = 30) -> dict[str, Any]:
    """Where a batch's `engine.run` spends its wall clock beyond the GPU's stage times (GPU only),
    each a median over `reps` synchronised calls: the whole `run`; the three graph replays alone
    (no input copies, no prompt-length check, no stage events); each graph's replay alone, as
    wall clock to the end of a sync, as the host time `replay()` takes to return (the launch) and
    as CUDA-event time (the GPU's own)."""

    median_ms = partial(synced_ms, reps=reps)

    graphs = {"vision": gs.vision_graph, "prefix": gs.prefix_graph, "loop": loop_graph}
    out: dict[str, Any] = {"run_ms": median_ms(lambda: eng.run(x, noise=noise)),
                           "three_replays_ms": median_ms(lambda: [g.replay() for g in graphs.values()])}
    for name, g in graphs.items():
        out[f"{name}_wall_ms"] = median_ms(g.replay)
        launch, gpu = [], []
        for _ in range(reps):
            torch.cuda.synchronize()
            a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            g.replay()
            launch.append((time.perf_counter() - t0) * 1e3)
            z.record()
            z.synchronize()
            gpu.append(a.elapsed_time(z))
        out[f"{name}_launch_ms"] = statistics.median(launch)
        out[f"{name}_gpu_ms"] = statistics.median(gpu)
    return out


def rtc_host_breakdown(eng: Any, gs: Any, x: Any, noise: torch.Tensor, modes: list[str], reps: int = 30) -> dict[str, Any]:
    """Per RTC solver mode (GPU only, medians over `reps` synchronised calls): `run` with the mode's
    guidance against `run` without; the mode's loop graph replayed alone against the unguided
    loop's (GPU time, CUDA events); and the host time `_load_host_values` (the RTC values) takes to return (no sync: the
    host work and the queueing of the copies)."""
    from pi05_gpu import rtc_guidance

    adapter = eng.adapter

    median_ms = partial(synced_ms, reps=reps)

    b = x.batch_size
    out: dict[str, Any] = {"run_unguided_ms": median_ms(lambda: eng.run(x, noise=noise))}
    def variant(mode: str) -> str:  # the loop `run` replays for these (full) inputs
        return "dense" if gs.kv_room is not None and mode != "guided" else ""

    base_loop = gs.loops[("none", adapter.solver, variant("none"))][0]
    out["loop_unguided_gpu_ms"] = replay_ms(base_loop, reps)
    for mode in modes:
        g = rtc_guidance(adapter, b, mode)
        eng.warmup(b, 3, VALID_TOKENS, modes=(mode,))
        out[f"run_{mode}_ms"] = median_ms(lambda g=g: eng.run(x, noise=noise, rtc=g))
        out[f"loop_{mode}_gpu_ms"] = replay_ms(gs.loops[(mode, adapter.solver, variant(mode))][0], reps)
        ts = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng._load_host_values(gs, None, g, adapter.solver, b)
            ts.append((time.perf_counter() - t0) * 1e3)
        out[f"load_rtc_{mode}_host_ms"] = statistics.median(ts)
    return out


def time_fn(fn: Any, device: str, reps: int = 20) -> float:
    """Median ms per call (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    sync(device)
    ms = []
    for _ in range(reps):
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms)


def sdpa_backends(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  device: str, grad: bool = False) -> dict[str, Any]:
    """The same attention under each SDPA backend (with its mask, and without one for scale);
    `grad`: also forward + backward with the mask for q, k and v (exact RTC guidance's VJP)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out: dict[str, Any] = {"q": list(q.shape), "k": list(k.shape),
                           "mask": list(mask.shape) if mask is not None else None}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue
        for label, m in (("mask", mask), ("no_mask", None)):
            try:
                with sdpa_kernel([backend]):
                    out[f"{name}_{label}_ms"] = time_fn(lambda m=m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                                                        device)
            except Exception as exc:  # a backend that refuses the shape: say why
                out[f"{name}_{label}_ms"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        if grad:
            leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
            dout = torch.randn_like(q)

            def fwd_bwd(leaves=leaves, dout=dout):
                with torch.enable_grad():  # the caller profiles under no_grad
                    o = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
                    return torch.autograd.grad(o, leaves, dout)

            try:
                with sdpa_kernel([backend]):
                    out[f"{name}_fwd_bwd_ms"] = time_fn(fwd_bwd, device)
            except Exception as exc:
                out[f"{name}_fwd_bwd_ms"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("runs/pi05_profile"))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--compile-step", action="store_true", help="also profile the denoise step under torch.compile")
    ap.add_argument("--triton-ops", action="store_true", help="the engine's fused Triton stages (default: the model's own)")
    ap.add_argument("--rtc-modes", default="",
                    help="comma-separated RTC solver modes (inpaint, guided-approx, guided) whose run / loop / "
                         "_load_host_values times join the host breakdown (GPU only)")
    ap.add_argument("--vjp", action="store_true",
                    help="also profile the denoise step with its vector-Jacobian product (exact RTC guidance)")
    ap.add_argument("--host-only", action="store_true",
                    help="only the stage times and the host breakdown of engine.run (no per-stage profiles)")
    args = ap.parse_args(argv)
    dev = args.device
    args.out.mkdir(parents=True, exist_ok=True)
    from phyai_edge.engines.cudagraph import CudaGraphEngine

    torch.backends.cuda.matmul.allow_tf32 = True
    adapter = seeded_adapter(dev, args.tiny)
    cfg = adapter.cfg
    eng = CudaGraphEngine(adapter, device=dev, dtype="bfloat16", triton_ops=args.triton_ops)
    module = eng.module
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
                           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "batches": {}}

    def dump() -> None:
        (args.out / "profile.json").write_text(json.dumps(res, indent=1, default=str))

    for b in (int(s) for s in args.batches.split(",")):
        x = par.model_inputs(par.make_inputs(b, 3, [VALID_TOKENS] * b, dev, seed=3, max_len=cfg.max_token_len,
                                             vocab=cfg.vocab_size))
        noise = torch.randn(b, adapter.chunk_size, adapter.model_action_dim, device=dev)
        eng.warmup(b, 3, VALID_TOKENS)
        timing = time_engine(eng, x, noise, None, dev, 3, 20 if b == 1 else 5)
        length = next(k[2] for k in eng._sets if k[:2] == (b, 3))
        gs = eng._sets[(b, 3, length)]
        kc, vc, pmask = gs.kv
        step = eng._stages["denoise_step"]
        mod = eng._table(adapter.solver)[0]
        tt = torch.full((b,), 1.0, device=dev)
        xt = gs.loop_bufs["noise"]
        entry: dict[str, Any] = {"prompt_positions": length, "engine_p50_ms": timing["p50"],
                                 "stages_p50_ms": timing["stages_p50"], "eager_profile": {}}
        loop_graph, _ = gs.loops.get(("none", adapter.solver, "dense" if gs.kv_room is not None else ""),
                                     (None, None))
        if dev.startswith("cuda") and loop_graph is not None:
            entry["host"] = h = host_breakdown(eng, gs, loop_graph, x, noise)
            say(f"batch {b} engine.run p50 {timing['p50']:.3f} ms, stages "
                + ", ".join(f"{k} {v:.3f}" for k, v in timing["stages_p50"].items()) + "; host: "
                + ", ".join(f"{k} {v:.3f}" for k, v in h.items()))
        if dev.startswith("cuda") and args.rtc_modes:
            entry["rtc_host"] = r = rtc_host_breakdown(eng, gs, x, noise, args.rtc_modes.split(","))
            say(f"batch {b} RTC host: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()))
        if args.host_only:
            res["batches"][str(b)] = entry
            dump()
            continue
        # The variants `run` picks for these inputs (every prompt token valid, every camera present):
        # the unmasked prefix and action expert where the engine has them for this batch.
        dense_prefix = eng._unmasked(b)[0]
        joined = {} if gs.kv_room is None else {"joined": gs.kv_room}
        entry["unmasked"] = {"prefix": dense_prefix, "expert": bool(joined)}
        for name, fn in (("embed_images", lambda gs=gs: eng._vision(gs)),
                         ("encode_prefix", partial(eng._prefix, gs, dense_prefix, eng._prefix_out(gs))),
                         ("denoise_step", partial(step, xt, tt, kc, vc, pmask, modulation=mod, **joined))):
            with torch.no_grad():
                entry["eager_profile"][name] = p = profile_call(fn, dev)
            say(f"batch {b} {name}: {p['kernels']} kernels, kernel sum {p['kernel_ms']:.3f} ms, "
                f"eager wall {p['wall_ms']:.3f} ms; top: "
                + "; ".join(f"{t['name'][:40]} x{t['count']} {t['ms']:.3f}" for t in p["top"][:5]))
        if args.vjp:
            # Exact RTC guidance's step: the velocity and its vector-Jacobian product for the noisy
            # actions, as the engine's guided loop takes it (the masked loop; layers/triton_grad.py).
            def vjp_step(xt=xt, tt=tt, kc=kc, vc=vc, pmask=pmask, mod=mod, step=step):
                with torch.enable_grad():
                    x_in = xt.detach().requires_grad_(True)
                    vel = step(x_in, tt, kc, vc, pmask, modulation=mod)
                    return torch.autograd.grad(vel, x_in, torch.ones_like(vel))

            entry["eager_profile"]["denoise_step_vjp"] = p = profile_call(vjp_step, dev, top=24)
            say(f"batch {b} denoise step + VJP: {p['kernels']} kernels, kernel sum {p['kernel_ms']:.3f} ms, "
                f"eager wall {p['wall_ms']:.3f} ms; top: "
                + "; ".join(f"{t['name'][:40]} x{t['count']} {t['ms']:.3f}" for t in p["top"][:8]))
        graph, _ = gs.loops.get(("none", adapter.solver, "dense" if joined else ""), (None, None))
        if graph is not None:
            entry["loop_replay_profile"] = p = profile_call(graph.replay, dev, top=8)
            say(f"batch {b} loop replay: {p['kernels']} kernels seen, kernel sum {p['kernel_ms']:.3f} ms, "
                f"wall {p['wall_ms']:.3f} ms")
        # The attention calls on their real shapes (the model's own folding of grouped heads).
        e, pc = cfg.expert, cfg.prefix
        with torch.no_grad():
            xin, cos, sin, emask = module.expert_inputs(xt, pmask)
            layer = module.expert_layers[0]
            q, k, v, _ = layer.project_kv(xin, cos, sin, mod[0][0][0])
            k_all, v_all = torch.cat([kc[0], k], dim=2), torch.cat([vc[0], v], dim=2)
            groups = e.num_heads // e.num_kv_heads
            qf = q.reshape(b, e.num_kv_heads, groups * q.shape[2], e.head_dim)
            entry["sdpa_expert"] = sdpa_backends(qf, k_all, v_all, emask, dev, grad=args.vjp)
            t = pmask.shape[1]
            gq = pc.num_heads // pc.num_kv_heads
            qp = torch.randn(b, pc.num_kv_heads, gq * t, pc.head_dim, device=dev, dtype=kc.dtype)
            entry["sdpa_prefix"] = sdpa_backends(qp, kc[0], vc[0], pmask[:, None, None, :], dev)
        say(f"batch {b} SDPA expert: {entry['sdpa_expert']}")
        say(f"batch {b} SDPA prefix: {entry['sdpa_prefix']}")
        res["batches"][str(b)] = entry
        dump()
        if args.compile_step:
            t0 = time.perf_counter()
            cstep = torch.compile(step, dynamic=False)
            with torch.no_grad():
                cstep(xt, tt, kc, vc, pmask, modulation=mod)
                entry["compiled_step_compile_s"] = time.perf_counter() - t0
                call = partial(cstep, xt, tt, kc, vc, pmask, modulation=mod)
                entry["compiled_step_profile"] = p = profile_call(call, dev, top=16)
                entry["compiled_step_ms"] = time_fn(call, dev)
            say(f"batch {b} compiled step: {p['kernels']} kernels, kernel sum {p['kernel_ms']:.3f} ms, "
                f"timed {entry['compiled_step_ms']:.3f} ms (compile {entry['compiled_step_compile_s']:.0f}s); top: "
                + "; ".join(f"{t['name'][:50]} x{t['count']} {t['ms']:.3f}" for t in p["top"][:8]))
        res["batches"][str(b)] = entry
        dump()
    lines = [f"device: {res['device']}, torch {res['torch']}, {res['date']}", "",
             "| batch | stage | replay p50 ms | eager kernels | kernel sum ms | eager wall ms |", "|---|---|---|---|---|---|"]
    for b, entry in res["batches"].items():
        for name, p in entry["eager_profile"].items():
            lines.append(f"| {b} | {name} | {entry['stages_p50_ms'].get(name, float('nan')):.3f} | {p['kernels']} | "
                         f"{p['kernel_ms']:.3f} | {p['wall_ms']:.3f} |")
    for b, entry in res["batches"].items():
        for name, p in entry["eager_profile"].items():
            lines += ["", f"batch {b} {name}, heaviest kernels:", "", "| kernel | count | ms | share |", "|---|---|---|---|"]
            lines += [f"| `{t['name']}` | {t['count']} | {t['ms']:.3f} | {t['share']:.0%} |" for t in p["top"]]
        if "compiled_step_profile" in entry:
            p = entry["compiled_step_profile"]
            lines += ["", f"batch {b} compiled denoise step: {p['kernels']} kernels, {entry['compiled_step_ms']:.3f} ms",
                      "", "| kernel | count | ms | share |", "|---|---|---|---|"]
            lines += [f"| `{t['name']}` | {t['count']} | {t['ms']:.3f} | {t['share']:.0%} |" for t in p["top"]]
    (args.out / "profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
