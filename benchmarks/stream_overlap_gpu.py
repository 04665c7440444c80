"""Two batch-1 questions the notes of issue #3 left open, answered on the engine's own graphs.

1. Could the action expert's first flow step run behind the prefix? Layer i of the first step needs
   only layer i's prefix keys, so the step could start while the prefix still runs, on a second
   stream. Before building that, this measures whether the two even overlap on the GPU: the
   engine's captured prefix graph and a captured one-step solver graph (and the ten-step loop, and
   the vision graph) replayed on two streams at once, against one after the other. The buffers they
   share make the values meaningless; only the time is read. What the first step could hide is
   at most `prefix + step - both`.
2. Where `engine.run`'s time outside its stage events goes: a torch profiler trace of batch-1 calls,
   per call the host's time before the first GPU activity, the GPU's span, the holes in it, and the
   time after the last activity until the call returned.

    PYTHONPATH=$PWD python3 benchmarks/stream_overlap_gpu.py --json $OUT/overlap.json          # H200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

PROMPT = "pick up the cube"


def timed(fn: Callable[[], None], reps: int) -> float:
    """Median ms of `fn` between two events on the current stream, the device idle before each."""
    ms = []
    for _ in range(reps + 3):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms[3:])


def side_by_side(first: Any, second: Any, streams: tuple[Any, Any]) -> Callable[[], None]:
    """Replay two graphs on two streams that both wait for the current one, then join them."""
    main = torch.cuda.current_stream()

    def run() -> None:
        for s in streams:
            s.wait_stream(main)
        with torch.cuda.stream(streams[0]):
            first.replay()
        with torch.cuda.stream(streams[1]):
            second.replay()
        for s in streams:
            main.wait_stream(s)
    return run


def overlap(engine: Any, gs: Any, reps: int) -> list[dict[str, Any]]:
    solver = engine.adapter.solver
    loop, _ = engine._loop_graph(gs, "none", solver)
    one, _ = engine._loop_graph(gs, "none", replace(solver, num_steps=1))
    graphs = {"vision": gs.vision_graph, "prefix": gs.prefix_graph, "step 1": one, "loop (10 steps)": loop}
    if any(g is None for g in graphs.values()):
        raise SystemExit(f"a graph is missing (eager fallback?): {[k for k, g in graphs.items() if g is None]}")
    alone = {k: timed(g.replay, reps) for k, g in graphs.items()}
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    rows = []
    for a, b in (("prefix", "step 1"), ("prefix", "loop (10 steps)"), ("vision", "step 1"), ("vision", "prefix")):
        ga, gb = graphs[a], graphs[b]
        serial = timed(lambda ga=ga, gb=gb: (ga.replay(), gb.replay()), reps)
        both = timed(side_by_side(ga, gb, streams), reps)
        rows.append({"pair": f"{a} + {b}", "alone_ms": [alone[a], alone[b]], "serial_ms": serial, "two_streams_ms": both,
                     "hidden_ms": serial - both, "hidden_of_shorter": (serial - both) / min(alone[a], alone[b])})
    return rows


def trace_runs(engine: Any, x: Any, calls: int) -> dict[str, Any]:
    """Per call of `engine.run` (then a sync, as a caller waiting for its actions does): host ms to the
    first GPU activity, the GPU's span, holes over 5 us inside it, ms from the last activity to return."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(3):
        engine.run(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            with record_function(f"call{i}"):
                engine.run(x)
                torch.cuda.synchronize()
            time.sleep(0.002)  # a clear gap between calls on the GPU's timeline
    path = Path("/tmp/overlap_trace.json")
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    host = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e.get("ph") == "X" and e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("call"))
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e.get("name", "")) for e in events
                 if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    per_call = []
    for h0, h1 in host:
        inside = [g for g in gpu if h0 <= g[0] <= h1]
        if not inside:
            continue
        holes, end, biggest = 0.0, inside[0][1], (0.0, "")
        for g0, g1, name in inside[1:]:
            if g0 - end > 5.0:
                holes += g0 - end
                biggest = max(biggest, (g0 - end, name[:60]))
            end = max(end, g1)
        per_call.append({"host_before_gpu_ms": (inside[0][0] - h0) / 1e3, "gpu_span_ms": (end - inside[0][0]) / 1e3,
                         "holes_ms": holes / 1e3, "after_gpu_ms": (h1 - end) / 1e3, "call_ms": (h1 - h0) / 1e3,
                         "gpu_activities": len(inside), "biggest_hole": [biggest[0] / 1e3, biggest[1]]})
    keys = ("host_before_gpu_ms", "gpu_span_ms", "holes_ms", "after_gpu_ms", "call_ms", "gpu_activities")
    return {"calls": len(per_call), "median": {k: statistics.median(c[k] for c in per_call) for k in keys},
            "biggest_holes": sorted((c["biggest_hole"] for c in per_call), reverse=True)[:5]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (graphs on two streams)")
    from phyai_edge.adapters.base import Observation
    from phyai_edge.engines.policy import load_policy

    policy = load_policy(preset="full", backend="cudagraph", device="cuda", dtype="bfloat16")
    rng = np.random.default_rng(0)
    obs = Observation(images={n: rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for n in policy.camera_names},
                      state=np.zeros(policy.state_dim, np.float32), prompt=PROMPT, timestamp=time.monotonic())
    x = policy.adapter.preprocess([obs], device=policy.device)
    engine = policy.engine
    for _ in range(3):
        engine.run(x)
    torch.cuda.synchronize()
    sets = [gs for key, gs in engine._sets.items() if key[0] == 1]
    if len(sets) != 1:
        raise SystemExit(f"expected one batch-1 graph set, found {[k for k in engine._sets]}")
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "date": time.strftime("%Y-%m-%d"), "graph_set": list(sets[0].key)}
    out["trace"] = trace_runs(engine, x, args.calls)
    out["stages_ms"] = engine.last_stage_ms
    out["overlap"] = overlap(engine, sets[0], args.reps)
    print(f"{out['device']}, torch {out['torch']}, graph set (batch, views, prompt positions) {out['graph_set']}")
    print("\n| pair | alone ms | one after the other | two streams | hidden ms | of the shorter |")
    print("|---|---|---|---|---|---|")
    for r in out["overlap"]:
        print(f"| {r['pair']} | {r['alone_ms'][0]:.3f} / {r['alone_ms'][1]:.3f} | {r['serial_ms']:.3f} | "
              f"{r['two_streams_ms']:.3f} | {r['hidden_ms']:.3f} | {100 * r['hidden_of_shorter']:.0f}% |")
    t = out["trace"]
    print(f"\nengine.run under the profiler, {t['calls']} calls, medians: " +
          ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in t["median"].items()))
    print(f"last call's stages (ms): {json.dumps({k: round(v, 3) for k, v in out['stages_ms'].items()})}")
    print(f"biggest holes (ms, the activity after it): {t['biggest_holes']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
