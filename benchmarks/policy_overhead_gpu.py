"""Where a daemon chunk's time goes around the engine: `Policy.infer` against `engine.run` alone.

On the H200 (2026-12-05, RESULTS.md eighteenth session, call 4) the daemon's worker timed a full-size
chunk at 19.1-20.9 ms while `pi05_gpu.py` times the engine at 15.2 ms with its inputs already on the
device. This builds the policy as the daemon does (`load_policy`: seeded full-size PI0.5, cudagraph,
bf16, the daemon's prompt room kept for any state), and for each frame layout times, side by side:

- `policy.infer(observation)` as the worker calls it (a moving state, so the prompt's text changes
  every call as on a robot), wall time to the actions on the host; per RTC mode (`--rtc`): none,
  and the daemon's default guided-approx with its steady-state prefix (H - s rows, s = 25, d = 3),
  each once with the noise drawn by the engine and once given from the host as the worker does in
  tests (`--host-noise`);
- its own stage times (`preprocess`, the engine's stages, `postprocess`);
- `engine.run` alone on the same call's inputs, prepared beforehand (what `pi05_gpu.py` times);
- one `policy.infer` under cProfile (host time per function, waits included).

Frame layouts: `1+2 masked` (one 224x224 camera, the other two without a source: the daemon's
synthetic default), `3 x 224`, `3 x 640x480` (cameras as they come, resized on the device).

    PYTHONPATH=$PWD python3 benchmarks/policy_overhead_gpu.py --json $OUT/policy_overhead.json   # H200
    PYTHONPATH=. python benchmarks/policy_overhead_gpu.py --device cpu --tiny --reps 3            # plumbing
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pi05_gpu import sync

PROMPT = "pick up the cube"
LAYOUTS = {"1+2 masked": [(224, 224), None, None], "3 x 224": [(224, 224)] * 3, "3 x 640x480": [(480, 640)] * 3}


def observation(policy: Any, shapes: list[tuple[int, int] | None], i: int) -> Any:
    from phyai_edge.adapters.base import Observation

    rng = np.random.default_rng(i)
    images = {name: None if hw is None else rng.integers(0, 256, (*hw, 3), dtype=np.uint8)
              for name, hw in zip(policy.camera_names, shapes)}
    state = (0.3 * np.sin(0.1 * i + np.arange(policy.state_dim))).astype(np.float32)  # a robot moving
    return Observation(images=images, state=state, prompt=PROMPT, timestamp=time.monotonic())


def rtc_request(policy: Any, mode: str) -> Any:
    """The daemon's steady-state request in `mode` (None for none): the executing chunk's last H - s
    actions as the prefix, s = 25 (ChunkingConfig's default), d = 3."""
    if mode == "none":
        return None
    from phyai_edge.engines.base import RTCRequest

    h = policy.adapter.chunk_size
    s = min(25, h - 1)
    prefix = np.random.default_rng(1).normal(size=(h - s, policy.action_dim)).astype(np.float32)
    return RTCRequest(mode=mode, prefix=prefix, delay=min(3, s), execution_horizon=s)  # type: ignore[arg-type]


def chunk_difference(policy: Any, shapes: list[tuple[int, int] | None], missing: list[str]) -> dict[str, float]:
    """The chunk with `missing` cameras left out against the chunk with their slots masked, on the
    same observation and noise (the policy has them declared absent on entry, and again on exit)."""
    o = observation(policy, shapes, 99)
    a = policy.adapter
    noise = torch.randn(1, a.chunk_size, a.model_action_dim, generator=torch.Generator().manual_seed(5))
    left_out = policy.infer(o, noise=noise).chunk.float().cpu()
    policy.set_absent_cameras([])
    masked = policy.infer(o, noise=noise).chunk.float().cpu()
    policy.set_absent_cameras(missing)
    diff = float((left_out - masked).abs().max())
    return {"max_abs": diff, "max_abs_over_scale": diff / max(float(masked.abs().max()), 1e-12)}


def measure(policy: Any, shapes: list[tuple[int, int] | None], device: str, reps: int, rtc_mode: str = "none",
            host_noise: bool = False, gap_s: float = 0.0) -> dict[str, Any]:
    obs = [observation(policy, shapes, i) for i in range(reps + 3)]
    rtc = rtc_request(policy, rtc_mode)
    a = policy.adapter
    noise = torch.randn(1, a.chunk_size, a.model_action_dim) if host_noise else None  # a CPU tensor, as the worker's

    def infer(o: Any) -> Any:
        return policy.infer(o, rtc=rtc, noise=noise)

    first = []  # a capture, then the first replays of freshly captured graphs
    for o in obs[:3]:
        sync(device)
        t0 = time.perf_counter()
        infer(o)
        first.append(round((time.perf_counter() - t0) * 1e3, 3))
    walls, stages = [], []
    for o in obs[3:]:
        sync(device)
        if gap_s:
            time.sleep(gap_s)  # idle between chunks, as the daemon is (one chunk per execution horizon)
        t0 = time.perf_counter()
        res = infer(o)
        walls.append((time.perf_counter() - t0) * 1e3)  # postprocess copied the actions: the device is done
        stages.append(res.stage_ms)
    inputs = [policy.adapter.preprocess([o], device=policy.device) for o in obs[3:]]
    if policy.absent_cameras:  # as policy.infer hands them to the engine
        inputs = [policy.adapter.drop_cameras(x, policy.absent_cameras) for x in inputs]
    guidance = policy.rtc_guidance(rtc, 1) if rtc is not None else None
    engine_walls = []
    for x in inputs:
        sync(device)
        t0 = time.perf_counter()
        policy.engine.run(x, rtc=guidance)
        sync(device)
        engine_walls.append((time.perf_counter() - t0) * 1e3)
    prof = cProfile.Profile()
    sync(device)
    prof.enable()
    infer(obs[3])
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(16)
    # preprocessing alone (host time before the first graph), 20 calls, by cumulative time
    pre = cProfile.Profile()
    sync(device)
    pre.enable()
    for o in obs[3:23]:
        policy.adapter.preprocess([o], device=policy.device)
    pre.disable()
    sync(device)
    buf.write("\npreprocess alone, 20 calls:\n")
    pstats.Stats(pre, stream=buf).sort_stats("cumtime").print_stats(14)
    keys = sorted({k for s in stages for k in s})
    return {"first_calls_ms": first, "infer_ms": statistics.median(walls), "engine_run_ms": statistics.median(engine_walls),
            "stage_ms": {k: statistics.median(s.get(k, 0.0) for s in stages) for k in keys},
            "profile": buf.getvalue()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny preset in float32 (plumbing on a CPU)")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {list(LAYOUTS)}")
    p.add_argument("--rtc", default="none,guided-approx", help="comma-separated RTC modes (none, guided-approx, guided)")
    p.add_argument("--host-noise", action="store_true", help="also time each case with noise given from the host")
    p.add_argument("--gap-s", type=float, default=0.0,
                   help="also time each case with the host and GPU idle this long before each call (the daemon at "
                        "50 Hz with s = 25 runs a chunk every 0.5 s)")
    p.add_argument("--no-absent", action="store_true",
                   help="layouts with missing cameras: only run their slots masked, not also left out")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    from phyai_edge.engines.policy import load_policy

    dev = args.device
    policy = load_policy(preset="tiny" if args.tiny else "full", backend="cudagraph", device=dev,
                         dtype="float32" if args.tiny else "bfloat16")
    policy.fix_prompt_positions(PROMPT)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
                           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "layouts": {}}
    rows = []
    modes = [m.strip() for m in args.rtc.split(",") if m.strip()]
    for name in (n.strip() for n in args.layouts.split(",") if n.strip()):
        if name not in LAYOUTS:
            raise SystemExit(f"--layouts: unknown {name!r}; expected some of {list(LAYOUTS)}")
        shapes = LAYOUTS[name][: len(policy.camera_names)]
        missing = [n for n, hw in zip(policy.camera_names, shapes) if hw is None]
        # A layout with cameras missing runs twice: their slots masked, then left out as the daemon
        # leaves out cameras without a source (`Policy.set_absent_cameras`).
        for absent in ([], missing) if missing and not args.no_absent else ([],):
            policy.set_absent_cameras(absent)
            if absent:
                out.setdefault("absent_vs_masked", {})[name] = chunk_difference(policy, shapes, missing)
            for mode in modes:
                for host_noise, gap in [(False, 0.0)] + [(True, 0.0)] * args.host_noise + [(False, args.gap_s)] * (args.gap_s > 0):
                    case = (f"{name}{', absent' if absent else ''}, {mode}" + (", host noise" if host_noise else "")
                            + (f", {gap:g} s idle" if gap else ""))
                    r = measure(policy, shapes, dev, args.reps, mode, host_noise, gap)
                    out["layouts"][case] = r
                    st = r["stage_ms"]
                    model = sum(st.get(k, 0.0) for k in ("embed_images", "encode_prefix", "solver_loop"))
                    rows.append(f"| {case} | {r['infer_ms']:.3f} | {r['engine_run_ms']:.3f} | {st.get('preprocess', 0):.3f} | "
                                f"{model:.3f} ({st.get('embed_images', 0):.2f} / {st.get('encode_prefix', 0):.2f} / "
                                f"{st.get('denoise_step', 0):.3f}) | {st.get('postprocess', 0):.3f} | "
                                f"{r['infer_ms'] - r['engine_run_ms']:.3f} |")
                    print(f"{case}: first three calls {r['first_calls_ms']} ms; one policy.infer under cProfile\n"
                          f"{r['profile']}")
        policy.set_absent_cameras([])
    for name, d in out.get("absent_vs_masked", {}).items():
        print(f"{name}: chunks with the missing cameras left out vs masked, same inputs and noise: max abs "
              f"{d['max_abs']:.3e} ({d['max_abs_over_scale']:.2e} of the chunk's scale)")
    print("| frames, RTC | policy.infer ms | engine.run alone ms | preprocess | model stages (vision / prefix / step) | "
          "postprocess | infer - run |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
