"""`phyai-edge serve`: one engine on one GPU serving many robot daemons over ZeroMQ."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from phyai_edge.commands.common import (
    adapter_options,
    add_adapter_option_argument,
    check_at_least,
    check_finite,
    check_positive,
    check_seconds,
    fail,
)
from phyai_edge.control.log import LOG_LEVELS, setup_logging
from phyai_edge.extras import with_install_hint

HELP = "one engine on one GPU serving many robot daemons over ZeroMQ"
DESCRIPTION = """Serve one policy to many robots. Robot daemons connect with a ZeroMQ DEALER
(`phyai_edge.serve.client.RemotePolicy`, selected in the daemon config with
model.factory = "phyai_edge.serve.client:remote_policy") and use the server as their engine;
their clocks, RTC queues and safety stay on the robot. Requests that arrive within the batching
window run as one engine call, earliest deadline first, at most one per robot per batch before
any robot gets a second, and a batch stops growing where its expected service time (learned per
padded batch size) would make its most urgent request late; when the queue is full new requests
are refused at once. Engines with captured shapes (cudagraph, TensorRT, ONNX bundles) pad each
batch to one of --batch-sizes and run every size once at start-up (--warm-prompt, --warm-rtc),
so no robot's request waits for a capture.

Examples:
  phyai-edge serve                                              # tiny built-in model on CPU, tcp://127.0.0.1:5570
  phyai-edge serve --checkpoint ~/ckpt/pi05 --device cuda --dtype bfloat16 --backend cudagraph \\
      --bind tcp://*:5570 --max-batch 64 --warm-prompt "pick up the cube" --report-s 10
  phyai-edge serve --ray --replicas 4 --checkpoint ~/ckpt/pi05 --device cuda   # Ray Serve replicas behind one front
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bind", default="tcp://127.0.0.1:5570", help="ZeroMQ endpoint the ROUTER binds")
    p.add_argument("--adapter", default="pi05", help="model adapter")
    p.add_argument("--checkpoint", help="checkpoint folder (LeRobot, openpi or native)")
    add_adapter_option_argument(p)
    p.add_argument("--preset", default="tiny", help="built-in size without a checkpoint")
    p.add_argument("--engine", help="exported engine bundle folder (overrides --backend)")
    p.add_argument("--backend", default="eager", help="eager | cudagraph | onnxruntime | tensorrt")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--seed", type=int, default=0, help="seed of the engine's noise generator")
    p.add_argument("--max-batch", type=int, default=16, help="observations per engine call at most")
    p.add_argument("--batch-sizes", default="auto",
                   help="batch sizes to pad to: a list (e.g. 1,2,4,8,16), 'any' (no padding), or 'auto': a "
                        "bundle's exported sizes; for cudagraph 1,2,4,8,12,16,20,24,28,32,40,48,56,64 up to "
                        "--max-batch; any size for eager")
    p.add_argument("--no-warm", action="store_true",
                   help="skip running every batch size at start-up (first calls then capture inside robots' requests)")
    p.add_argument("--warm-prompt", action="append", default=None,
                   help="a prompt the robots send (repeatable): the warm-up runs one observation per prompt, "
                        "since the cudagraph engine keeps graphs per prompt-length bucket")
    p.add_argument("--prompt-tokens", type=int, default=0, metavar="N",
                   help="also keep room for prompts of up to N tokens (PI0.5: the state's included) that no "
                        "--warm-prompt gives, so a robot's new instruction runs the warmed graphs instead of "
                        "capturing inside its request; every batch runs the room (0: the warmed prompts' only)")
    p.add_argument("--absent-camera", action="append", default=[], metavar="NAME",
                   help="a model camera no robot has (repeatable): the model runs without its slot instead of "
                        "masked (PI0.5: the same actions, about a third less vision and prefix per camera left out)")
    p.add_argument("--warm-rtc", default="none,guided-approx",
                   help="RTC modes the robots send, warmed per batch size (comma list; 'none': no solver RTC)")
    p.add_argument("--window-ms", type=float, default=5.0, help="how long a batch waits for more requests")
    p.add_argument("--queue", type=int, default=128, help="queued requests at most (then refuse: back-pressure)")
    p.add_argument("--per-robot", type=int, default=2, help="queued requests per robot at most")
    p.add_argument("--budget-ms", type=float, default=500.0, help="deadline for requests that carry no budget")
    p.add_argument("--workers", type=int, default=1, help="--ray: inference threads, at least one per replica (a local engine runs "
                   "one batch at a time, so one thread)")
    p.add_argument("--report-s", type=float, default=10.0, help="log the per-robot latency table this often (0: never)")
    p.add_argument("--forget-robot-s", type=float, default=600.0, metavar="S",
                   help="a robot that sends no request this long leaves the per-robot table (a daemon restarted "
                        "under its pid-based name is a new robot)")
    p.add_argument("--heartbeat-s", type=float, default=5.0, metavar="S",
                   help="ZeroMQ heartbeat interval: a robot connection that answers nothing for 3 intervals (a robot "
                        "that hung or lost power) is closed (0: never)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: until SIGINT/SIGTERM)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--ray", action="store_true", help="run the engine as a Ray Serve deployment")
    p.add_argument("--replicas", type=int, default=1, help="--ray: deployment replicas")
    p.add_argument("--gpus-per-replica", type=float, default=None,
                   help="--ray: GPUs per replica (default: 1 with --device cuda, else 0; Ray hides the GPUs from "
                        "a replica given none)")
    p.add_argument("--ray-address", default=None, help="--ray: an existing cluster (default: start a local one)")
    p.add_argument("--json-report", action="store_true", help="print the final report as JSON (the log then goes to stderr)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="lowest level logged")


def main(args: argparse.Namespace) -> int:
    check_seconds("serve", "--duration", args.duration)
    check_at_least("serve", ("--max-batch", args.max_batch, 1), ("--queue", args.queue, 1),
                   ("--per-robot", args.per_robot, 1), ("--workers", args.workers, 1), ("--replicas", args.replicas, 1),
                   ("--report-s", args.report_s, 0),
                   ("--threads", args.threads, 0), ("--prompt-tokens", args.prompt_tokens, 0))
    check_positive("serve", ("--budget-ms", args.budget_ms), ("--forget-robot-s", args.forget_robot_s))
    # An endless window closed batches only at each request's deadline less the service time (every
    # robot waited nearly its whole budget); 0 GPUs is a replica on CPU, the default without cuda.
    check_finite("serve", ("--window-ms", args.window_ms, 0, "milliseconds"),
                 ("--gpus-per-replica", args.gpus_per_replica, 0, ""),
                 ("--heartbeat-s", args.heartbeat_s, 0, "seconds"))
    try:
        # Now, not after loading the model: an unknown RTC mode was not even looked at where
        # nothing is warmed (eager, --no-warm, --ray).
        parse_batch_sizes(args.batch_sizes)
        warm_modes(args.warm_rtc)
    except ValueError as exc:
        fail("serve", str(exc))
    # The daemon's log lines (journald priorities under systemd, where a server runs for good);
    # stdout carries the JSON report where one is asked for.
    setup_logging(getattr(logging, args.log_level.upper()), to_stderr=args.json_report)
    from phyai_edge.serve.scheduler import SchedulerConfig
    from phyai_edge.serve.server import LocalExecutor, PolicyServer
    from phyai_edge.serve.stats import format_report

    load_kwargs: dict[str, Any] = {"adapter": args.adapter, "checkpoint": args.checkpoint, "preset": args.preset,
                                   "backend": args.backend, "device": args.device, "dtype": args.dtype,
                                   "bundle": args.engine, "seed": args.seed,
                                   "adapter_options": adapter_options("serve", args),
                                   "absent_cameras": list(args.absent_camera)}
    if args.prompt_tokens < 0:
        print(f"phyai-edge serve: --prompt-tokens must be >= 0, got {args.prompt_tokens}", file=sys.stderr)
        return 2
    if args.prompt_tokens and (args.ray or args.no_warm):
        # The room is kept by the warm-up, which only the local engine runs.
        print("phyai-edge serve: --prompt-tokens is kept by the start-up warm-up, which --ray and --no-warm skip",
              file=sys.stderr)
        return 2
    workers = args.workers
    policy = None
    if args.ray:
        try:
            from phyai_edge.serve.ray_deployment import RayExecutor
        except ImportError as exc:
            fail("serve", with_install_hint(exc))

        sizes = batch_sizes_for(args.batch_sizes, args.backend if not args.engine else None, None, args.max_batch)
        max_batch = min(args.max_batch, max(sizes)) if sizes else args.max_batch
        gpus = args.gpus_per_replica
        if gpus is None:
            gpus = 1.0 if str(args.device).startswith("cuda") else 0.0
        executor: Any = RayExecutor.deploy(load_kwargs, replicas=args.replicas, gpus_per_replica=gpus,
                                           batch_sizes=sizes, max_batch=max_batch, address=args.ray_address,
                                           threads=args.threads)
        workers = max(workers, args.replicas)  # one batch in flight per replica
    else:
        import torch

        from phyai_edge.commands.common import load_policy_or_fail

        if args.threads:
            torch.set_num_threads(args.threads)
        policy = load_policy_or_fail("serve", **load_kwargs)
        sizes = batch_sizes_for(args.batch_sizes, getattr(policy.engine, "backend", ""), policy.engine, args.max_batch)
        max_batch = min(args.max_batch, max(sizes)) if sizes else args.max_batch
        executor = LocalExecutor(policy, sizes, max_batch, args.prompt_tokens)
    cfg = SchedulerConfig(max_batch=max_batch, window_s=args.window_ms / 1e3, capacity=args.queue,
                          per_robot=args.per_robot, batch_sizes=tuple(sizes) if sizes else None)
    server = PolicyServer(executor, args.bind, cfg, default_budget_ms=args.budget_ms, workers=workers,
                          report_s=args.report_s, forget_robot_s=args.forget_robot_s, heartbeat_s=args.heartbeat_s)
    if policy is not None and sizes and not args.no_warm:
        obs, rtcs = warm_inputs(policy, args.warm_prompt, args.warm_rtc)
        t0 = time.perf_counter()
        times = server.warm_up(obs, rtcs)
        logging.getLogger("phyai_edge.serve").info(
            "warmed batch sizes %s with %d prompt(s) and RTC %s in %.1f s; service ms %s", sizes, len(obs),
            args.warm_rtc, time.perf_counter() - t0, {b: round(t * 1e3, 1) for b, t in times.items()})
    done = threading.Event()

    def stop(signum: int, frame: Any) -> None:
        done.set()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        server.start()
    except RuntimeError as exc:
        print(f"phyai-edge serve: {exc}", file=sys.stderr)
        return 2
    print(f"serving on {server.endpoint}", flush=True, file=sys.stderr if args.json_report else sys.stdout)
    done.wait(args.duration if args.duration > 0 else None)
    server.stop()
    if hasattr(executor, "shutdown"):
        executor.shutdown()
    rep = server.report()
    print(json.dumps(rep, indent=2) if args.json_report else format_report(rep), flush=True)
    return 0


def batch_sizes_for(spec: str | None, backend: str | None, engine: Any, max_batch: int) -> list[int] | None:
    """--batch-sizes -> the sizes the server pads to (None: any size). 'auto': an engine built
    for fixed sizes (an ONNX or TensorRT bundle) keeps its own; cudagraph captures whatever it
    meets, so it gets the serving default (each size captured once, at start-up); eager takes
    any size and padding would only waste work."""
    from phyai_edge.serve.scheduler import serving_batch_sizes

    try:
        sizes = parse_batch_sizes(spec)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if not isinstance(sizes, str):  # a list, or None for 'any'
        return sizes
    fixed = getattr(engine, "batch_sizes", None)
    if fixed:
        return sorted(fixed)
    if backend == "cudagraph":
        return serving_batch_sizes(max_batch)
    return None


def parse_batch_sizes(spec: str | None) -> list[int] | str | None:
    """--batch-sizes -> its sizes, "auto", or None ('any'); ValueError naming the flag."""
    spec = (spec or "auto").strip().lower()
    if spec == "any":
        return None
    if spec == "auto":
        return spec
    try:
        sizes = sorted({int(x) for x in spec.split(",")})
    except ValueError:
        raise ValueError(f"--batch-sizes: expected a comma list of integers, 'auto' or 'any', got {spec!r}") from None
    if sizes[0] < 1:
        raise ValueError(f"--batch-sizes: sizes must be >= 1, got {sizes}")
    return sizes


def warm_modes(modes: str) -> list[str]:
    """--warm-rtc -> its RTC modes; ValueError naming the flag and the unknown mode."""
    from phyai_edge.engines.base import RTC_MODES

    out = [m.strip() for m in modes.split(",") if m.strip()]
    for mode in out:
        if mode not in RTC_MODES:
            raise ValueError(f"--warm-rtc: unknown mode {mode!r}; expected some of {RTC_MODES}")
    return out


def warm_inputs(policy: Any, prompts: Sequence[str] | None, modes: str) -> tuple[list[Any], list[Any]]:
    """Warm-up observations (synthetic frames and state, one per prompt) and RTC requests
    (one per mode; the prefix is the rest of a chunk after half of it ran)."""
    import numpy as np

    from phyai_edge.calibration.dataset import synthetic_observations
    from phyai_edge.engines.base import RTCRequest

    base = synthetic_observations(policy.adapter, 1)[0]
    absent = getattr(policy, "absent_cameras", ())
    if absent:  # as the robots send them: the warm-up captures the view count they run
        base = dataclasses.replace(base, images={n: None if n in absent else img for n, img in base.images.items()})
    obs = [base] if not prompts else [dataclasses.replace(base, prompt=p) for p in prompts]
    h = int(policy.chunk_size)
    rtcs: list[Any] = []
    try:
        checked = warm_modes(modes)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    for mode in checked:
        rtcs.append(None if mode in ("none", "crossfade") else
                    RTCRequest(mode, np.zeros((h - h // 2, policy.action_dim), np.float32), 0, h // 2))  # type: ignore[arg-type]
    return obs, rtcs or [None]
