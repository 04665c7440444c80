"""Where the multi-robot server's time per batch goes, against `run_items` alone on the same
batches, with simulated robots (`phyai_edge.serve.loadgen`) as `benchmarks/serve_gpu.py` runs
them (3 cameras, a 14-value state that moves, a prompt, a `guided-approx` RTC prefix).

    PYTHONPATH=. python benchmarks/serve_phases.py --robots 16 --seconds 10          # tiny, CPU
    PYTHONPATH=. python benchmarks/serve_phases.py --backend eager --robots 16
    PYTHONPATH=. python benchmarks/serve_phases.py --device cuda --preset full --robots 48

It prints:
- the server's own per-batch phases by padded size (`ServerStats.report()["by_size"]`): the
  wait before a batch formed, its service time and, inside it, preprocess, RTC guidance plus
  engine, postprocess, the batcher around them and the reply encoding; intake (decode and
  admission) per request on the I/O thread;
- the same batches (the same requests, in the same groups) run again through `run_items`
  alone after the robots stopped, one after another in a quiet process: the server's time
  minus this is what serving adds (I/O thread, GIL, scheduling), per padded size;
- the engine shapes first met while serving, i.e. after the warm-up: on a GPU each is a
  CUDA-graph capture (two warm-up passes and a capture of three graphs, ~1 s at full size)
  inside some robot's request. `--warm robots` warms every prompt bucket the robots' states
  reach; `--warm one` warms one observation per batch size, as `serve_gpu.py` did.
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
import torch
from serve_gpu import collect, prompt_classes  # benchmarks/ is on sys.path when this runs as a script

from phyai_edge.adapters.base import Observation
from phyai_edge.engines.base import RTCRequest
from phyai_edge.engines.policy import load_policy
from phyai_edge.serve.batching import BatchItem, ItemResult, run_items, warm_up
from phyai_edge.serve.loadgen import robots_process
from phyai_edge.serve.scheduler import DEFAULT_BATCH_SIZES, SchedulerConfig, serving_batch_sizes
from phyai_edge.serve.server import LocalExecutor, PolicyServer


class RecordingExecutor(LocalExecutor):
    """The local executor, keeping each batch's items and its service time for the replay."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[tuple[list[BatchItem], float]] = []

    def run(self, items: list[BatchItem]) -> list[ItemResult]:
        t0 = time.perf_counter()
        out = super().run(items)
        self.batches.append((items, time.perf_counter() - t0))
        return out


def engine_shapes(policy: Any) -> set[Any]:
    """The shapes the engine holds graphs (or static buffers) for; empty for an engine without."""
    e = policy.engine
    return set(getattr(e, "_sets", {})) | set(getattr(e, "_stage_sets", {}))


def robot_observations(policy: Any, n: int, hw: tuple[int, int], seed: int = 0) -> list[Observation]:
    """Observations like loadgen's robots send: random frames, states uniform in [-1, 1]."""
    rng = np.random.default_rng(seed)
    images = {c: rng.integers(0, 256, (*hw, 3), dtype=np.uint8) for c in policy.camera_names}
    return [Observation(images, rng.uniform(-1, 1, policy.state_dim).astype(np.float32), "pick up the cube")
            for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--backend", default="cudagraph", help="cudagraph runs its static-buffer code eagerly on a CPU")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--robots", type=int, default=16)
    p.add_argument("--period-s", type=float, default=0.5, help="one request per robot this often")
    p.add_argument("--budget-ms", type=float, default=500.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)))
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--window-ms", type=float, default=5.0)
    p.add_argument("--image-size", default="224x224")
    p.add_argument("--warm", choices=["one", "robots"], default="one",
                   help="one: one observation per batch size; robots: one per prompt bucket the robots reach")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    hw = tuple(int(x) for x in args.image_size.lower().split("x"))
    policy = load_policy(preset=args.preset, backend=args.backend, device=args.device, dtype=args.dtype, seed=0)
    sizes = serving_batch_sizes(args.max_batch, [int(x) for x in args.batch_sizes.split(",")])
    rtc_prefix = np.zeros((policy.chunk_size - 25, policy.action_dim), np.float32)
    rtc = RTCRequest("guided-approx", rtc_prefix, 10, 25)
    warm_obs = prompt_classes(policy, hw) if args.warm == "robots" else robot_observations(policy, 1, hw)
    seeds = warm_up(policy, sizes, warm_obs, [rtc])
    shapes_before = engine_shapes(policy)
    executor = RecordingExecutor(policy, sizes, args.max_batch)
    cfg = SchedulerConfig(max_batch=args.max_batch, window_s=args.window_ms / 1e3, capacity=4 * args.robots + 16,
                          per_robot=2, batch_sizes=tuple(sizes))
    requests = max(4, int(args.seconds / args.period_s))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    names = [f"robot-{i:03d}" for i in range(args.robots)]
    with PolicyServer(executor, "tcp://127.0.0.1:*", cfg, default_budget_ms=args.budget_ms) as srv:
        for size, s in seeds.items():
            srv.sched.record_service(size, s)
        start_at = time.time() + 3.0 + 0.05 * args.robots
        procs = [ctx.Process(target=robots_process, args=(srv.endpoint, names[k:k + 16], requests, args.period_s,
                                                          args.budget_ms, hw, k, {}, start_at, out,
                                                          ("guided-approx", policy.chunk_size - 25, 10, 25)),
                             daemon=True) for k in range(0, args.robots, 16)]
        for proc in procs:
            proc.start()
        done, _ = collect(out, args.robots, time.time() + args.seconds * 4 + 60)
        for proc in procs:
            proc.join(5)
        report = srv.report()
    new_shapes = sorted(engine_shapes(policy) - shapes_before, key=str)

    # The same batches again, alone: same requests, same grouping and padding, nothing else running.
    alone: dict[int, list[tuple[float, float]]] = {}
    for items, served_s in executor.batches:
        t0 = time.perf_counter()
        res = run_items(policy, items, sizes, args.max_batch)
        alone.setdefault(max(r.batch for r in res), []).append((served_s * 1e3, (time.perf_counter() - t0) * 1e3))
    lat = [x * 1e3 for r in done.values() for x in r["latency_s"]]
    print(f"# serve phases: {args.preset} {args.backend} on {args.device}, {torch.get_num_threads()} thread(s), "
          f"{args.robots} robots every {args.period_s} s for {args.seconds:.0f} s, sizes {sizes}, warm {args.warm}")
    print(f"requests answered {len(lat)}, p50 {np.percentile(lat, 50):.1f} ms, p99 {np.percentile(lat, 99):.1f} ms, "
          f"intake {report['intake_ms_per_request']:.2f} ms per request, reruns {report['reruns']}, "
          f"engine shapes first met while serving: {len(new_shapes)} {new_shapes}")
    print("| padded | batches | real obs | wait | service | pre | rtc+engine | post | batcher | reply "
          "| run_items alone | server - alone |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for size, b in report["by_size"].items():
        pairs = alone.get(size, [])
        a_med = statistics.median(a for _, a in pairs) if pairs else float("nan")
        diff = statistics.median(s - a for s, a in pairs) if pairs else float("nan")
        rows.append({"padded": size, **b, "alone_ms": a_med, "server_minus_alone_ms": diff})
        print(f"| {size} | {b['batches']} | {b['observations']:.1f} | {b['wait_ms']:.1f} | {b['service_ms']:.1f} | "
              f"{b['preprocess_ms']:.1f} | {b['engine_ms']:.1f} | {b['postprocess_ms']:.1f} | {b['batcher_ms']:.1f} | "
              f"{b['reply_ms']:.2f} | {a_med:.1f} | {diff:+.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows, "new_shapes": [str(s) for s in new_shapes],
                                               "p50_ms": float(np.percentile(lat, 50)),
                                               "p99_ms": float(np.percentile(lat, 99))}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
