"""How many robots at 50 Hz one GPU serves, against one process per robot; and RL rollout
samples/s against batch size.

Every robot runs PI0.5 control at `--hz` (50) with chunks of H = 50 actions and an execution
horizon s = 25: it asks for a new chunk every s ticks (0.5 s) and must have it before it runs out
of usable actions, so its RTC budget is min(s, H - s) ticks (500 ms; `--budget-ms` overrides).
A robot count passes when every robot's p99 chunk latency (request sent -> actions back, as the
robot measures it) is within the budget and no request was refused or failed. Requests sent in
the first --warmup-s seconds are left out of the latency statistics (robots start at random
phases, but the first batches still see start-up bursts); --seconds is the measured time after
it. A robot sends 2 requests a second, so with fewer than ~100 measured requests its p99 is its
worst request: the report gives the measured request count and the p99 pooled over all robots
beside the per-robot worst.

    python benchmarks/serve_gpu.py robots --out runs/serve        # shared server, sweep robot counts
    python benchmarks/serve_gpu.py dedicated --out runs/serve     # one process (own engine) per robot
    python benchmarks/serve_gpu.py rollout --out runs/serve       # samples/s against batch size
    python benchmarks/serve_gpu.py all --out runs/serve           # the three, one report
    python benchmarks/serve_gpu.py all --tiny --device cpu --robots 2,4 --seconds 3   # plumbing check on a CPU
    python benchmarks/serve_gpu.py robots --robots 32,48,64 --seconds 15 --out runs/serve   # the H200 re-run

Model: --checkpoint DIR, or a full-size PI0.5 with seeded random weights made on the GPU (same
compute as the real one; actions are meaningless). Backend: --backend cudagraph (default on
CUDA) or eager; both take per-sample RTC (robots with different delays share a batch). The
simulated robots send one fixed delay estimate `--rtc-delay`, as a daemon with
`chunking.delay` set does.
Robots are torch-free client threads (`phyai_edge.serve.loadgen`) in several processes, on
the same host over TCP loopback; images are sent at --image-size (224: the model's size, so
the server skips resizing; pass 480x640 to include resizing).

Warm-up: as `phyai-edge serve` does it, every captured batch size runs before any robot starts,
with prompt room kept for the robots' prompt with any state, without RTC and in --rtc-mode (the
cudagraph engine keeps graphs per batch size, prompt length and RTC mode; a shape first met while
serving is a capture of ~1 s inside some robot's request). The
report counts the graphs the engine built while robots ran (`captures_while_serving`, expected 0) and
gives the server's own per-batch phases by padded size (`by_size`: service, preprocess, RTC +
engine, postprocess, batcher) beside the engine's time.

Target (issue 7): >= 64 robots on one H200; see benchmarks/RESULTS.md for the runs.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from phyai_edge.serve.scheduler import DEFAULT_BATCH_SIZES
from phyai_edge.serve.stats import percentile as nearest_rank


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def percentile(xs: list[float], q: float) -> float:
    """The server's nearest-rank percentile (`serve.stats.percentile`), NaN for no samples."""
    return nearest_rank(xs, q) if xs else float("nan")


# -- model -----------------------------------------------------------------------------------
def build_policy(args: argparse.Namespace, seed: int = 0) -> Any:
    """The policy every scenario runs: a checkpoint, the tiny preset, or full size with seeded
    random weights initialised directly on the device (a 3B-parameter fp32 init on the CPU would
    take minutes of the device lease)."""

    from phyai_edge.adapters.pi05.adapter import PI05Adapter
    from phyai_edge.adapters.pi05.builtin import builtin_adapter, seeded_model_on
    from phyai_edge.adapters.pi05.config import preset
    from phyai_edge.engines import make_engine
    from phyai_edge.engines.policy import Policy, load_policy

    if args.checkpoint or args.tiny:
        return load_policy(checkpoint=args.checkpoint, preset="tiny" if args.tiny else "full", backend=args.backend,
                           device=args.device, dtype=args.dtype, seed=seed)
    shell = builtin_adapter(args.random_preset if args.random_preset != "full" else "full")  # tokenizer, robot I/O
    cfg = preset(args.random_preset)
    adapter = PI05Adapter(cfg, seeded_model_on(args.device, cfg, seed), shell.tokenizer, shell.io)
    opts: dict[str, Any] = {}
    if args.fp8:  # static scales from a calibration file; the fused Triton ops stay on
        opts = {"fp8": args.fp8, "fp8_scales": args.fp8_scales, "fp8_activations": "static" if args.fp8_scales
                else None, "triton_ops": True}
    return Policy(adapter, make_engine(args.backend, adapter, device=args.device, dtype=args.dtype, seed=seed, **opts))


def budget_ms(args: argparse.Namespace) -> float:
    if args.budget_ms:
        return args.budget_ms
    return min(args.s, args.horizon - args.s) / args.hz * 1e3


def batch_sizes(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in args.batch_sizes.split(",")]


# -- shared server, many robots ---------------------------------------------------------------
def collect(out: Any, want: int, deadline: float) -> tuple[dict[Any, Any], list[Any]]:
    """Read the worker processes' ("done" | "error", key, payload) messages from `out` until `want`
    have reported or `deadline` (time.time()) passes: the done payloads by key, and the errors."""
    done: dict[Any, Any] = {}
    errors: list[Any] = []
    while len(done) + len(errors) < want and time.time() < deadline:
        try:
            kind, key, payload = out.get(timeout=1.0)
        except Exception:  # queue.Empty: nothing this second; look at the clock again
            continue
        if kind == "done":
            done[key] = payload
        elif kind == "error":
            errors.append(payload)
    return done, errors


def run_robots(args: argparse.Namespace, n_robots: int, policy: Any, seeds: dict[int, float]) -> dict[str, Any]:
    """One server, n robots for --warmup-s + --seconds; statistics over the requests sent after
    the warm-up; per-robot p99 and pooled p99 against the budget."""
    from phyai_edge.serve.loadgen import robots_process
    from phyai_edge.serve.scheduler import SchedulerConfig
    from phyai_edge.serve.server import LocalExecutor, PolicyServer

    period = args.s / args.hz
    budget = budget_ms(args)
    requests = max(4, math.ceil((args.warmup_s + args.seconds) / period))
    sizes = batch_sizes(args)
    cfg = SchedulerConfig(max_batch=max(sizes), window_s=args.window_ms / 1e3, capacity=4 * n_robots + 16, per_robot=2,
                          batch_sizes=tuple(sizes))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    per_proc = max(1, args.robots_per_process)
    names = [f"robot-{i:03d}" for i in range(n_robots)]
    # Every robot sends its executing chunk's unexecuted rest (H - s actions) and one fixed d.
    rtc = None if args.rtc_mode == "none" else (args.rtc_mode, args.horizon - args.s, args.rtc_delay, args.s)
    # Counted by the engine (`Policy.graphs_built`), not from its INFO log lines: with logging
    # unconfigured those never reach a handler.
    built_before = policy.graphs_built
    try:
        with PolicyServer(LocalExecutor(policy, sizes, max(sizes)), "tcp://127.0.0.1:*", cfg,
                          default_budget_ms=budget) as srv:
            for size, sec in seeds.items():  # the warm-up's times: the latency rule's first estimates
                srv.sched.record_service(size, sec)
            start_at = time.time() + 5.0 + 0.05 * n_robots  # every robot connected before anyone starts
            procs = []
            for k in range(0, n_robots, per_proc):
                group = names[k:k + per_proc]
                procs.append(ctx.Process(target=robots_process, args=(srv.endpoint, group, requests, period, budget,
                                                                      args.image_hw, k, {}, start_at, out, rtc),
                                         daemon=True))
                procs[-1].start()
            results, _ = collect(out, n_robots, time.time() + (args.warmup_s + args.seconds) * 3 + 60 + 0.1 * n_robots)
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
            report = srv.report()
    finally:
        built_after = policy.graphs_built
    captures = None if built_before is None or built_after is None else built_after - built_before
    measured_from = start_at + args.warmup_s
    lat = {n: [x * 1e3 for x, t in zip(r["latency_s"], r["sent_at"]) if t >= measured_from] for n, r in results.items()}
    p99 = {n: percentile(v, 99) for n, v in lat.items() if v}
    worst = max(p99.values(), default=float("nan"))
    pooled = [x for v in lat.values() for x in v]
    errors = sum(len(r["errors"]) for r in results.values())
    refused = sum(r["refused"] for r in results.values())
    ok = len(results) == n_robots and errors == 0 and refused == 0 and worst <= budget
    by_size = report["by_size"]
    batches = sum(b["batches"] for b in by_size.values())
    return {
        "robots": n_robots, "pass": ok, "budget_ms": budget, "worst_robot_p99_ms": worst,
        "median_robot_p99_ms": statistics.median(p99.values()) if p99 else float("nan"),
        "pooled_p99_ms": percentile(pooled, 99), "p50_ms": percentile(pooled, 50), "max_ms": max(pooled, default=float("nan")),
        "late": sum(x > budget for x in pooled), "measured_requests": len(pooled),
        "measured_per_robot": min((len(v) for v in lat.values()), default=0), "requests_per_robot": requests,
        "warmup_s": args.warmup_s, "errors": errors, "refused": refused, "missing_robots": n_robots - len(results),
        "mean_batch": report["batch_size"]["mean"], "max_batch": report["batch_size"]["max"],
        "mean_observations": report["observations_per_batch"]["mean"], "batches": report["batches"],
        "mean_service_ms": sum(b["service_ms"] * b["batches"] for b in by_size.values()) / batches if batches else 0.0,
        "reruns": report["reruns"], "captures_while_serving": captures,
        "by_size": by_size, "service_estimate_ms": report["service_estimate_ms"],
    }


def sweep_robots(args: argparse.Namespace) -> dict[str, Any]:
    policy = build_policy(args)
    seeds = warm(policy, args)
    rows = []
    for n in [int(x) for x in args.robots.split(",")]:
        say(f"shared server: {n} robots for {args.warmup_s:.0f} + {args.seconds:.0f} s")
        row = run_robots(args, n, policy, seeds)
        say(f"  {row['measured_requests']} requests measured: worst robot p99 {row['worst_robot_p99_ms']:.1f} ms, "
            f"pooled p99 {row['pooled_p99_ms']:.1f}, p50 {row['p50_ms']:.1f} (budget {row['budget_ms']:.0f}), "
            f"{row['late']} late; mean batch {row['mean_observations']:.1f} padded to {row['mean_batch']:.1f}, "
            f"{row['mean_service_ms']:.1f} ms; captures while serving {row['captures_while_serving']}, "
            f"errors {row['errors']}, refused {row['refused']} -> {'PASS' if row['pass'] else 'FAIL'}")
        for size, b in row["by_size"].items():
            say(f"    batch {size:>3}: {b['batches']:>4} runs, {b['observations']:.1f} real, service {b['service_ms']:.1f} ms "
                f"(pre {b['preprocess_ms']:.1f}, rtc+engine {b['engine_ms']:.1f}, post {b['postprocess_ms']:.1f}, "
                f"batcher {b['batcher_ms']:.1f}), waited {b['wait_ms']:.1f}")
        rows.append(row)
        # Each count as it finishes: a run cut short by a device time limit keeps what it measured.
        (Path(args.out) / "robots_partial.json").write_text(json.dumps(rows, indent=2, default=float))
        if not row["pass"] and args.stop_on_fail:
            break
    passing = [r["robots"] for r in rows if r["pass"]]
    return {"rows": rows, "max_robots_within_budget": max(passing, default=0)}


def prompt_classes(policy: Any, hw: tuple[int, int], draws: int = 4096, seed: int = 123) -> list[Any]:
    """Robot-like observations (loadgen's: random frames, states uniform in [-1, 1], its
    prompt), one per prompt bucket their batches can be trimmed to: the engine trims a batch to
    its longest valid prompt rounded up to `token_bucket`, so with prompts of 51-65 tokens a
    batch runs at 64 or, when one robot's state tokenises long, 80 positions, each its own
    graphs. The first returned is the most common class."""
    from phyai_edge.adapters.base import Observation

    rng = np.random.default_rng(seed)
    images = {c: rng.integers(0, 256, (*hw, 3), dtype=np.uint8) for c in policy.camera_names}
    obs = [Observation(images, rng.uniform(-1, 1, policy.state_dim).astype(np.float32), "pick up the cube")
           for _ in range(draws)]
    a, e = policy.adapter, policy.engine
    bucket = int(getattr(e, "token_bucket", 0) or 0) if getattr(e, "trim_prompt", False) else 0
    if not hasattr(a, "prompt_tokens") or bucket <= 0:
        return obs[:1]  # the engine's shapes do not depend on the prompt's length
    _, mask = a.prompt_tokens(obs)
    valid = np.asarray(mask).sum(axis=1)
    classes: dict[int, list[int]] = {}
    for i, v in enumerate(valid):
        classes.setdefault(math.ceil(int(v) / bucket), []).append(i)
    ordered = sorted(classes.values(), key=len, reverse=True)
    return [obs[max(members, key=lambda i: valid[i])] for members in ordered]


def warm(policy: Any, args: argparse.Namespace) -> dict[int, float]:
    """Capture / compile every batch size before timing, as `phyai-edge serve` warms up
    (`LocalExecutor.warm_up`: room kept for the robots' prompt with any state first, so every batch
    of any states runs the graphs captured here), without RTC (a robot's first request) and in
    --rtc-mode; a first call at a shape captures CUDA graphs and would otherwise land in some
    robot's p99. Returns the seconds per batch size (the scheduler's first estimates). Without the
    room, batches of identical warm-up observations would take exact-length graph sets that live
    batches of mixed lengths never run (RESULTS.md, twenty-third session)."""
    from phyai_edge.engines.base import RTCRequest
    from phyai_edge.serve.server import LocalExecutor

    obs = prompt_classes(policy, args.image_hw)
    if getattr(policy, "fix_prompt_positions", None) is not None:
        obs = obs[:1]  # the room covers every class: one bucket
    rtcs: list[Any] = [None]
    if args.rtc_mode != "none":
        rtcs.append(RTCRequest(args.rtc_mode, np.zeros((args.horizon - args.s, policy.action_dim), np.float32),
                               args.rtc_delay, args.s))
    # The eager engine captures nothing: one size primes its first-call costs; the latency
    # rule learns the others' times as it runs them.
    sizes = batch_sizes(args) if args.backend != "eager" else batch_sizes(args)[:1]
    say(f"warming batch sizes {sizes} x {len(obs)} prompt bucket(s) x RTC {[r.mode if r else 'none' for r in rtcs]}")
    t0 = time.perf_counter()
    seeds = LocalExecutor(policy, sizes, max(sizes)).warm_up(obs, rtcs)
    say(f"  warm in {time.perf_counter() - t0:.1f} s; ms per batch: "
        + ", ".join(f"{b}: {t * 1e3:.1f}" for b, t in seeds.items()))
    return seeds


# -- one process per robot -------------------------------------------------------------------
def dedicated_child(args: argparse.Namespace, index: int, start_at: float, requests: int, out: Any) -> None:
    """One robot with its own engine in its own process (its own CUDA context), batch 1."""
    try:
        from phyai_edge.adapters.base import Observation

        policy = build_policy(args, seed=index)
        rng = np.random.default_rng(index)
        h, w = args.image_hw
        images = {c: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for c in policy.camera_names}
        obs = Observation(images, rng.uniform(-1, 1, policy.state_dim).astype(np.float32), "pick up the cube")
        for _ in range(3):
            policy.infer([obs])
        out.put(("ready", index, None))
        time.sleep(max(0.0, start_at - time.time()))
        period = args.s / args.hz
        lat = []
        next_t = time.perf_counter() + rng.uniform(0, period)
        for _ in range(requests):
            time.sleep(max(0.0, next_t - time.perf_counter()))
            next_t += period
            t0 = time.perf_counter()
            policy.infer([obs])
            lat.append(time.perf_counter() - t0)
        out.put(("done", index, lat))
    except Exception as exc:  # out of GPU memory is the expected way this baseline ends
        out.put(("error", index, f"{type(exc).__name__}: {exc}"))


def sweep_dedicated(args: argparse.Namespace) -> dict[str, Any]:
    budget = budget_ms(args)
    period = args.s / args.hz
    requests = max(4, int(args.seconds / period))
    rows = []
    ctx = mp.get_context("spawn")
    for n in [int(x) for x in args.dedicated.split(",")]:
        say(f"one process per robot: {n} processes")
        out = ctx.Queue()
        start_at = time.time() + args.load_s * max(1, n / 4) + 10
        procs = [ctx.Process(target=dedicated_child, args=(args, i, start_at, requests, out), daemon=True)
                 for i in range(n)]
        for p in procs:
            p.start()
        lat, errors = collect(out, n, start_at + args.seconds * 3 + 60)
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        p99 = [percentile(v, 99) * 1e3 for v in lat.values()]
        worst = max(p99, default=float("nan"))
        ok = len(lat) == n and not errors and worst <= budget
        rows.append({"robots": n, "pass": ok, "worst_robot_p99_ms": worst, "errors": errors[:3], "budget_ms": budget})
        say(f"  worst p99 {worst:.1f} ms, {len(errors)} failed -> {'PASS' if ok else 'FAIL'}")
        if not ok and args.stop_on_fail:
            break
    passing = [r["robots"] for r in rows if r["pass"]]
    return {"rows": rows, "max_robots_within_budget": max(passing, default=0)}


# -- rollout samples/s ------------------------------------------------------------------------
def sweep_rollout(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from phyai_edge.adapters.base import Observation
    from phyai_edge.serve.rollout import RolloutChunks, RolloutPolicy

    policy = build_policy(args)
    rows = []
    rng = np.random.default_rng(0)
    h, w = args.image_hw
    for b in [int(x) for x in args.rollout_batches.split(",")]:
        runner = RolloutPolicy(policy, batch_sizes=[b])
        obs = [Observation({c: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for c in policy.camera_names},
                           rng.uniform(-1, 1, policy.state_dim).astype(np.float32), "pick up the cube") for _ in range(b)]
        chunks = RolloutChunks(b, mode=args.rtc_mode if args.rtc_mode != "none" else "none", execution_horizon=args.s)
        chunks.update(runner.act(obs).actions)
        for _ in range(args.s):
            chunks.next_actions()
        reqs = chunks.requests(args.rtc_delay)
        for _ in range(2):
            runner.act(obs, rtc=reqs)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times = []
        for _ in range(args.rollout_iters):
            t0 = time.perf_counter()
            runner.act(obs, rtc=reqs)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        rows.append({"batch": b, "median_ms": med * 1e3, "samples_per_s": b / med})
        say(f"rollout batch {b}: {med * 1e3:.1f} ms, {b / med:.1f} samples/s")
    return {"rows": rows}


def markdown(res: dict[str, Any]) -> str:
    fp8 = f", fp8 {res['config']['fp8']}" if res["config"].get("fp8") else ""
    lines = [f"# serve_gpu: {res['config']['model']} on {res['config']['device']} ({res['config']['backend']}, "
             f"{res['config']['dtype']}{fp8})", "",
             f"50 Hz control analogue: {res['config']['hz']} Hz, H = {res['config']['horizon']}, "
             f"s = {res['config']['s']}, budget {res['config']['budget_ms']:.0f} ms per chunk (p99, every robot).", ""]
    if "robots" in res:
        lines += [f"## Shared server: max {res['robots']['max_robots_within_budget']} robots within budget", "",
                  f"Statistics over requests sent after the first {res['config']['warmup_s']:.0f} s.", "",
                  "| robots | requests | worst robot p99 ms | median robot p99 ms | pooled p99 ms | p50 ms | late "
                  "| mean batch (padded) | service ms | captures | pass |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:--:|"]
        lines += [f"| {r['robots']} | {r['measured_requests']} | {r['worst_robot_p99_ms']:.1f} | "
                  f"{r['median_robot_p99_ms']:.1f} | {r['pooled_p99_ms']:.1f} | {r['p50_ms']:.1f} | {r['late']} | "
                  f"{r['mean_observations']:.1f} ({r['mean_batch']:.1f}) | {r['mean_service_ms']:.1f} | "
                  f"{r['captures_while_serving']} | {'yes' if r['pass'] else 'no'} |" for r in res["robots"]["rows"]]
        lines.append("")
    for key, title in (("dedicated", "One process per robot"),):
        if key in res:
            lines += [f"## {title}: max {res[key]['max_robots_within_budget']} robots within budget", "",
                      "| robots | worst robot p99 ms | pass |", "|---:|---:|:--:|"]
            lines += [f"| {r['robots']} | {r['worst_robot_p99_ms']:.1f} | {'yes' if r['pass'] else 'no'} |"
                      for r in res[key]["rows"]]
            lines.append("")
    if "rollout" in res:
        lines += ["## Rollout API", "", "| batch | ms | samples/s |", "|---:|---:|---:|"]
        lines += [f"| {r['batch']} | {r['median_ms']:.1f} | {r['samples_per_s']:.1f} |" for r in res["rollout"]["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["robots", "dedicated", "rollout", "all"])
    p.add_argument("--out", default="runs/serve_gpu")
    p.add_argument("--checkpoint")
    p.add_argument("--tiny", action="store_true", help="the tiny preset (plumbing check)")
    p.add_argument("--random-preset", default="full", help="size of the seeded random model without --checkpoint")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default=None, help="cudagraph (default on CUDA) or eager")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) or float32")
    p.add_argument("--fp8", choices=["expert", "prefix", "all"], default=None,
                   help="the cudagraph engine's fp8 scope (seeded full-size model only)")
    p.add_argument("--fp8-scales", default=None,
                   help="static activation scales (a calibration JSON, e.g. pi05_gpu.py --fp8-static)")
    p.add_argument("--hz", type=float, default=50.0)
    p.add_argument("--horizon", type=int, default=50, help="H (the model's chunk length)")
    p.add_argument("--s", type=int, default=25, help="execution horizon: ticks between inferences")
    p.add_argument("--budget-ms", type=float, default=0.0, help="default: min(s, H - s) / hz")
    p.add_argument("--rtc-mode", default="guided-approx")
    p.add_argument("--rtc-delay", type=int, default=10, help="the fixed delay estimate robots send (ticks)")
    p.add_argument("--robots", default="16,32,48,64,80,96,128")
    p.add_argument("--dedicated", default="1,2,4,8,12,16")
    p.add_argument("--robots-per-process", type=int, default=16)
    p.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)),
                   help="captured batch sizes the server pads to (default: the server's)")
    p.add_argument("--window-ms", type=float, default=5.0)
    p.add_argument("--seconds", type=float, default=30.0, help="measured time per robot count (after --warmup-s)")
    p.add_argument("--warmup-s", type=float, default=2.0,
                   help="requests sent in the first seconds of each robot count are left out of the statistics")
    p.add_argument("--load-s", type=float, default=30.0, help="expected model load time per dedicated process")
    p.add_argument("--image-size", default="224x224", help="HxW of the images robots send")
    p.add_argument("--rollout-batches", default="1,2,4,8,16,32,64,128")
    p.add_argument("--rollout-iters", type=int, default=10)
    p.add_argument("--stop-on-fail", action="store_true", help="stop a sweep at its first failing count")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.backend = args.backend or ("cudagraph" if cuda else "eager")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.image_hw = tuple(int(x) for x in args.image_size.lower().split("x"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"config": {
        "model": args.checkpoint or ("tiny" if args.tiny else "full (seeded random weights)"), "device": args.device,
        "backend": args.backend, "dtype": args.dtype, "fp8": args.fp8, "fp8_scales": args.fp8_scales, "hz": args.hz, "horizon": args.horizon, "s": args.s,
        "budget_ms": budget_ms(args), "rtc_mode": args.rtc_mode, "rtc_delay": args.rtc_delay,
        "image_size": args.image_size, "batch_sizes": args.batch_sizes, "window_ms": args.window_ms,
        "warmup_s": args.warmup_s, "seconds": args.seconds,
    }}
    if cuda:
        import torch

        res["config"]["gpu"] = torch.cuda.get_device_name(0)
    if args.what in ("robots", "all"):
        res["robots"] = sweep_robots(args)
    if args.what in ("dedicated", "all"):
        res["dedicated"] = sweep_dedicated(args)
    if args.what in ("rollout", "all"):
        res["rollout"] = sweep_rollout(args)
    (out / "results.json").write_text(json.dumps(res, indent=2, default=float))
    (out / "results.md").write_text(markdown(res))
    print(markdown(res))
    if "robots" in res:
        n = res["robots"]["max_robots_within_budget"]
        say(f"shared server: {n} robots within budget (target >= 64): {'MET' if n >= 64 else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
