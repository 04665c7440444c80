"""How many robots at 50 Hz one GPU serves, against one process per robot; and RL rollout
samples/s against batch size.

Every robot runs PI0.5 control at `--hz` (50) with chunks of H = 50 actions and an execution
horizon s = 25: it asks for a new chunk every s ticks (0.5 s) and must have it before it runs out
of usable actions, so its RTC budget is min(s, H - s) ticks (500 ms; `--budget-ms` overrides).
A robot count passes when every robot's p99 chunk latency (request sent -> actions back, as the
robot measures it) is within the budget and no request was refused or failed.

    python benchmarks/serve_gpu.py robots --out runs/serve        # shared server, sweep robot counts
    python benchmarks/serve_gpu.py dedicated --out runs/serve     # one process (own engine) per robot
    python benchmarks/serve_gpu.py rollout --out runs/serve       # samples/s against batch size
    python benchmarks/serve_gpu.py all --out runs/serve           # the three, one report
    python benchmarks/serve_gpu.py all --tiny --device cpu --robots 2,4 --seconds 3   # plumbing check on a CPU

Model: --checkpoint DIR, or a full-size PI0.5 with seeded random weights made on the GPU (same
compute as the real one; actions are meaningless). Backend: --backend cudagraph (default on
CUDA) or eager; both take per-sample RTC (robots with different delays share a batch). The
simulated robots send one fixed delay estimate `--rtc-delay`, as a daemon with
`chunking.delay` set does.
Robots are torch-free client threads (`phyai_edge.serve.loadgen`) in several processes, on
the same host over TCP loopback; images are sent at --image-size (224: the model's size, so
the server skips resizing; pass 480x640 to include resizing).

Target (issue 7): >= 64 robots on one H200. Not run at the time of writing: see the report.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


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
    return Policy(adapter, make_engine(args.backend, adapter, device=args.device, dtype=args.dtype, seed=seed))


def budget_ms(args: argparse.Namespace) -> float:
    if args.budget_ms:
        return args.budget_ms
    return min(args.s, args.horizon - args.s) / args.hz * 1e3


def batch_sizes(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in args.batch_sizes.split(",")]


# -- shared server, many robots ---------------------------------------------------------------
def run_robots(args: argparse.Namespace, n_robots: int, policy: Any) -> dict[str, Any]:
    """One server, n robots for --seconds; per-robot p99 against the budget."""
    from phyai_edge.serve.loadgen import robots_process
    from phyai_edge.serve.scheduler import SchedulerConfig
    from phyai_edge.serve.server import LocalExecutor, PolicyServer

    period = args.s / args.hz
    budget = budget_ms(args)
    requests = max(4, int(args.seconds / period))
    sizes = batch_sizes(args)
    cfg = SchedulerConfig(max_batch=max(sizes), window_s=args.window_ms / 1e3, capacity=4 * n_robots + 16, per_robot=2)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    per_proc = max(1, args.robots_per_process)
    names = [f"robot-{i:03d}" for i in range(n_robots)]
    # Every robot sends its executing chunk's unexecuted rest (H - s actions) and one fixed d.
    rtc = None if args.rtc_mode == "none" else (args.rtc_mode, args.horizon - args.s, args.rtc_delay, args.s)
    with PolicyServer(LocalExecutor(policy, sizes, max(sizes)), "tcp://127.0.0.1:*", cfg, default_budget_ms=budget) as srv:
        start_at = time.time() + 5.0 + 0.05 * n_robots  # every robot connected before anyone starts
        procs = []
        for k in range(0, n_robots, per_proc):
            group = names[k:k + per_proc]
            procs.append(ctx.Process(target=robots_process, args=(srv.endpoint, group, requests, period, budget,
                                                                  args.image_hw, k, {}, start_at, out, rtc),
                                     daemon=True))
            procs[-1].start()
        results: dict[str, dict] = {}
        deadline = time.time() + args.seconds * 3 + 60 + 0.1 * n_robots
        while len(results) < n_robots and time.time() < deadline:
            try:
                kind, name, payload = out.get(timeout=1.0)
            except Exception:
                continue
            if kind == "done":
                results[name] = payload
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        report = srv.report()
    p99 = {n: percentile(r["latency_s"], 99) * 1e3 for n, r in results.items()}
    worst = max(p99.values(), default=float("nan"))
    errors = sum(len(r["errors"]) for r in results.values())
    refused = sum(r["refused"] for r in results.values())
    ok = len(results) == n_robots and errors == 0 and refused == 0 and worst <= budget
    all_lat = [x * 1e3 for r in results.values() for x in r["latency_s"]]
    return {
        "robots": n_robots, "pass": ok, "budget_ms": budget, "worst_robot_p99_ms": worst,
        "median_robot_p99_ms": statistics.median(p99.values()) if p99 else float("nan"),
        "p50_ms": percentile(all_lat, 50), "requests_per_robot": requests, "errors": errors, "refused": refused,
        "missing_robots": n_robots - len(results), "mean_batch": report["batch_size"]["mean"],
        "max_batch": report["batch_size"]["max"], "batches": report["batches"],
        "server_service_ms": report["service_estimate_ms"],
    }


def sweep_robots(args: argparse.Namespace) -> dict[str, Any]:
    policy = build_policy(args)
    warm(policy, args)
    rows = []
    for n in [int(x) for x in args.robots.split(",")]:
        say(f"shared server: {n} robots for {args.seconds:.0f} s")
        row = run_robots(args, n, policy)
        say(f"  worst p99 {row['worst_robot_p99_ms']:.1f} ms (budget {row['budget_ms']:.0f}), mean batch "
            f"{row['mean_batch']:.1f}, errors {row['errors']}, refused {row['refused']} -> "
            f"{'PASS' if row['pass'] else 'FAIL'}")
        rows.append(row)
        if not row["pass"] and args.stop_on_fail:
            break
    passing = [r["robots"] for r in rows if r["pass"]]
    return {"rows": rows, "max_robots_within_budget": max(passing, default=0)}


def warm(policy: Any, args: argparse.Namespace) -> None:
    """Capture / compile every batch size once before timing (the first call of a shape
    captures CUDA graphs and would otherwise land in some robot's p99)."""
    from phyai_edge.adapters.base import Observation
    from phyai_edge.engines.base import RTCRequest
    from phyai_edge.serve.batching import BatchItem, run_items

    rng = np.random.default_rng(0)
    h, w = args.image_hw
    obs = Observation({c: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for c in policy.camera_names},
                      rng.uniform(-1, 1, policy.state_dim).astype(np.float32), "pick up the cube")
    rtc = None
    if args.rtc_mode != "none":
        rtc = RTCRequest(args.rtc_mode, np.zeros((args.horizon - args.s, policy.action_dim), np.float32),
                         args.rtc_delay, args.s)
    for b in batch_sizes(args):
        say(f"warming batch {b}")
        for _ in range(2):
            run_items(policy, [BatchItem([obs], rtc)] * b, batch_sizes(args))


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
        lat: dict[int, list[float]] = {}
        errors: list[str] = []
        deadline = start_at + args.seconds * 3 + 60
        while len(lat) + len(errors) < n and time.time() < deadline:
            try:
                kind, i, payload = out.get(timeout=1.0)
            except Exception:
                continue
            if kind == "done":
                lat[i] = payload
            elif kind == "error":
                errors.append(payload)
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
    lines = [f"# serve_gpu: {res['config']['model']} on {res['config']['device']} ({res['config']['backend']}, "
             f"{res['config']['dtype']})", "",
             f"50 Hz control analogue: {res['config']['hz']} Hz, H = {res['config']['horizon']}, "
             f"s = {res['config']['s']}, budget {res['config']['budget_ms']:.0f} ms per chunk (p99, every robot).", ""]
    for key, title in (("robots", "Shared server"), ("dedicated", "One process per robot")):
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
    p.add_argument("--hz", type=float, default=50.0)
    p.add_argument("--horizon", type=int, default=50, help="H (the model's chunk length)")
    p.add_argument("--s", type=int, default=25, help="execution horizon: ticks between inferences")
    p.add_argument("--budget-ms", type=float, default=0.0, help="default: min(s, H - s) / hz")
    p.add_argument("--rtc-mode", default="guided-approx")
    p.add_argument("--rtc-delay", type=int, default=10, help="the fixed delay estimate robots send (ticks)")
    p.add_argument("--robots", default="16,32,48,64,80,96,128")
    p.add_argument("--dedicated", default="1,2,4,8,12,16")
    p.add_argument("--robots-per-process", type=int, default=16)
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="captured batch sizes the server pads to")
    p.add_argument("--window-ms", type=float, default=5.0)
    p.add_argument("--seconds", type=float, default=30.0, help="measured time per robot count")
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
        "backend": args.backend, "dtype": args.dtype, "hz": args.hz, "horizon": args.horizon, "s": args.s,
        "budget_ms": budget_ms(args), "rtc_mode": args.rtc_mode, "rtc_delay": args.rtc_delay,
        "image_size": args.image_size, "batch_sizes": args.batch_sizes, "window_ms": args.window_ms,
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
