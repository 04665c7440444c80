"""Host-side time of one multi-robot server batch, by phase, with the engine stubbed out.

The server's service time per batch is the engine's chunk plus everything around it: decoding
the robots' ZeroMQ messages, the noise and RTC guidance, the adapter's preprocess (images,
state -> prompt -> tokens, the copy to the engine's device), postprocess and the reply
encoding. This times each of those for a batch of B robots (one observation each, as
`phyai_edge.serve.loadgen` robots send: 3 cameras of uint8 HWC, a 14-value state, a prompt,
an RTC prefix), with a stub engine that returns the noise (so only host work is timed) or the
tiny preset's eager engine.

    python benchmarks/serve_host_overhead.py --threads 1               # CPU, stub engine
    python benchmarks/serve_host_overhead.py --threads 1 --engine tiny # CPU, the tiny model
    python benchmarks/serve_host_overhead.py --device cuda             # GPU: H2D and GPU work synced
    python benchmarks/serve_host_overhead.py --preprocess per-sample   # the per-sample reference path

Columns (median ms per batch over --iters runs):
- decode: wire.decode_request + request_item for the B messages (received through a ZeroMQ
  socket, so the frames are real zmq.Frames);
- noise+rtc: run_group's noise draws and RTC split, then Policy.rtc_guidance_per_sample;
- img host / h2d / img dev: the images' part of preprocess. On a GPU: staging the uint8 frames
  in pinned memory / the copy to the device / the conversion and resize there. On the CPU the
  frames are converted where they are (all in img host). The per-sample path does all image
  work in float32 on the host (img host) and copies floats (h2d);
- tokens: state -> prompt -> token ids (the tokenisation cache cleared before each phase
  unless --token-cache warm: moving robots rarely repeat a prompt);
- pre: adapter.preprocess as one call; engine: the stub (or tiny) engine; post:
  adapter.postprocess; reply: wire.encode_reply for the B replies;
- host: decode + noise+rtc + pre + post + reply; service: LocalExecutor.run plus the replies,
  end to end (engine included), what the server's service time measures;
- to-GPU MB: the image bytes a GPU run copies to the device per batch.
On CUDA every phase is bracketed by torch.cuda.synchronize, so GPU-side work is charged to the
phase that queued it. On a small shared CPU pass --threads 1: intra-op threads that wait on a
busy sibling core turn each elementwise op into milliseconds of barrier waits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from phyai_edge.adapters.base import ModelInputs
from phyai_edge.engines.base import EngineBase
from phyai_edge.engines.policy import Policy, load_policy
from phyai_edge.serve import wire
from phyai_edge.serve.batching import item_noise, run_items, split_rtc
from phyai_edge.serve.server import request_item

PHASES = ("decode", "noise+rtc", "img host", "tokens", "h2d", "img dev", "pre", "engine", "post", "reply",
          "host", "service")


class StubEngine(EngineBase):
    """Returns the noise as the chunk: the engine costs nothing, so what is left is host work."""

    backend = "stub"

    def run(self, inputs: ModelInputs, noise: torch.Tensor | None = None, rtc: Any = None) -> torch.Tensor:
        b = inputs.batch_size
        noise = self.sample_noise(b) if noise is None else noise.to(self.device, torch.float32)
        self._stage_ms = {}
        return noise.clone()


def build(args: argparse.Namespace) -> Policy:
    policy = load_policy(preset="tiny", backend="eager", device=args.device, dtype="float32", seed=0)
    if args.engine == "stub":
        policy = Policy(policy.adapter, StubEngine(policy.adapter, args.device, 0))
    if args.preprocess == "per-sample":
        if not hasattr(policy.adapter, "preprocess_per_sample"):
            raise SystemExit("this adapter has only one preprocess path")
        policy.adapter.preprocess = policy.adapter.preprocess_per_sample
    return policy


def robot_messages(policy: Policy, batch: int, hw: tuple[int, int], rtc_mode: str, seed: int) -> list[list[Any]]:
    """B infer requests as the robots send them, received back as zmq.Frame lists."""
    rng = np.random.default_rng(seed)
    a = policy.adapter
    ctx = zmq.Context.instance()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    addr = f"inproc://host-overhead-{seed}-{batch}-{hw[0]}x{hw[1]}"
    pull.bind(addr)
    push.connect(addr)
    out = []
    try:
        for i in range(batch):
            images = {c: rng.integers(0, 256, (*hw, 3), dtype=np.uint8) for c in a.camera_names}
            obs = wire.WireObservation(images, rng.uniform(-1, 1, a.state_dim).astype(np.float32), "pick up the cube")
            rtc = None
            if rtc_mode != "none":
                prefix = rng.uniform(-1, 1, (a.chunk_size - 25, a.action_dim)).astype(np.float32)
                rtc = wire.WireRTC(rtc_mode, prefix, 10, 25)
            push.send_multipart(wire.encode_request(wire.Request("infer", i, f"robot-{i:03d}", 480.0, [obs], rtc)))
            out.append(pull.recv_multipart(copy=False))
    finally:
        push.close(0)
        pull.close(0)
    return out


def measure(policy: Policy, frames: list[list[Any]], iters: int, warmup: int,
            warm_tokens: bool = False) -> dict[str, float]:
    a, dev = policy.adapter, torch.device(policy.device)
    cuda = dev.type == "cuda"
    batched = hasattr(a, "stage_images") and a.preprocess != getattr(a, "preprocess_per_sample", None)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def timed_once(name: str, fn: Callable[[], Any], into: dict[str, list[float]]) -> Any:
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        into.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
        return out

    def tokens(obs: list[Any]) -> Any:
        if hasattr(a, "prompt_tokens"):
            return a.prompt_tokens(obs)
        return [a._prompt_tokens(o, i) for i, o in enumerate(obs)]

    def noise_rtc(items: list[Any]) -> tuple[Any, Any]:
        rtcs, noises = [], []
        for it in items:
            rtcs.extend(split_rtc(it.rtc, it.size))
            noises.append(item_noise(policy, it))
        noise = torch.cat(noises)
        g = policy.rtc_guidance_per_sample(rtcs) if any(r is not None for r in rtcs) else None
        return noise, g

    def replies(items: list[Any], actions: np.ndarray, stage_ms: dict[str, float]) -> list[Any]:
        info = {"stage_ms": stage_ms, "batch": len(items), "queue_ms": 1.0, "server_ms": 2.0, "late": False}
        return [wire.encode_reply(wire.Reply(i, True, actions[i:i + 1], info=info)) for i in range(len(items))]

    def timed(name: str, fn: Callable[[], Any], into: dict[str, list[float]]) -> Any:
        if not warm_tokens and hasattr(a, "_token_cache"):
            # Robots' states move between requests, so their prompts rarely repeat: every
            # phase here tokenises as if the texts were new.
            a._token_cache.clear()
        return timed_once(name, fn, into)

    def one_batch() -> dict[str, list[float]]:
        t: dict[str, list[float]] = {}
        items = timed("decode", lambda: [request_item(wire.decode_request(f)) for f in frames], t)
        obs = [o for it in items for o in it.observations]
        noise, guidance = timed("noise+rtc", lambda: noise_rtc(items), t)
        if batched and dev.type != "cpu":
            staged = timed("img host", lambda: a.stage_images(obs, pin=cuda), t)
            on_dev = timed("h2d", lambda: staged.to(dev), t)
            timed("img dev", lambda: a.images_from_staged(on_dev), t)
            timed("tokens", lambda: tokens(obs), t)
        elif batched:  # on the CPU the frames are converted where they are: no staging, no copy
            timed("img host", lambda: a.images(obs, dev), t)
            timed("tokens", lambda: tokens(obs), t)
            t["h2d"] = t["img dev"] = [0.0]
        else:
            host_pre = timed("img host", lambda: a.preprocess_per_sample(obs, "cpu") if hasattr(
                a, "preprocess_per_sample") else a.preprocess(obs, "cpu"), t)
            timed("h2d", lambda: host_pre.to(dev), t)
            timed("tokens", lambda: tokens(obs), t)
            t["img host"][-1] -= t["tokens"][-1]  # the host pass above tokenised too
            t["img dev"] = [0.0]
        inputs = timed("pre", lambda: a.preprocess(obs, device=dev), t)
        chunk = timed("engine", lambda: policy.engine.run(inputs, noise=noise, rtc=guidance), t)
        actions = timed("post", lambda: policy.postprocess(chunk, inputs), t)
        timed("reply", lambda: replies(items, actions, {}), t)

        def service() -> None:
            res = run_items(policy, items)
            replies(items, np.concatenate([r.actions for r in res]), res[0].stage_ms)

        timed("service", service, t)
        t["host"] = [sum(t[p][-1] for p in ("decode", "noise+rtc", "pre", "post", "reply"))]
        return t

    times: dict[str, list[float]] = {}
    for k in range(warmup + iters):
        t = one_batch()
        if k >= warmup:
            for name, v in t.items():
                times.setdefault(name, []).extend(v)
    return {name: statistics.median(times[name]) for name in PHASES}


def image_bytes(policy: Policy, batch: int, hw: tuple[int, int], per_sample: bool) -> float:
    """Image bytes a GPU run copies to the device per batch (whatever device this run is on):
    float32 at the model's size on the per-sample path, the uint8 frames as sent on the batched
    one."""
    views = len(policy.camera_names)
    if per_sample:
        s = policy.adapter.cfg.vision.image_size
        return batch * views * 3 * s * s * 4
    return batch * views * hw[0] * hw[1] * 3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--engine", choices=["stub", "tiny"], default="stub")
    p.add_argument("--preprocess", choices=["default", "per-sample"], default="default",
                   help="per-sample: time the reference path (the one before batching) in this build")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--image-sizes", default="224x224,480x640", help="HxW of the frames robots send")
    p.add_argument("--rtc-mode", default="guided-approx", help="what the robots ask for ('none': no RTC)")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--token-cache", choices=["cold", "warm"], default="cold",
                   help="cold: clear the tokenisation cache before each pass (moving robots); warm: keep it")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    policy = build(args)
    a = policy.adapter
    per_sample = not hasattr(a, "stage_images") or args.preprocess == "per-sample"
    dev_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"# serve host overhead: {args.engine} engine on {args.device} ({dev_name}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} intra-op thread(s), preprocess {'per-sample' if per_sample else 'batched'}, "
          f"rtc {args.rtc_mode}, token cache {args.token_cache}, median of {args.iters}")
    head = ["image", "B", *PHASES, "to-GPU MB"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|")
    rows = []
    for size in args.image_sizes.split(","):
        hw = tuple(int(x) for x in size.lower().split("x"))
        for b in (int(x) for x in args.batches.split(",")):
            frames = robot_messages(policy, b, hw, args.rtc_mode, seed=b)
            ms = measure(policy, frames, args.iters, args.warmup, args.token_cache == "warm")
            mb = image_bytes(policy, b, hw, per_sample) / 1e6
            rows.append({"image": size, "batch": b, **ms, "to_gpu_mb": mb})
            print(f"| {size} | {b} | " + " | ".join(f"{ms[k]:.2f}" for k in PHASES) + f" | {mb:.1f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "device": dev_name, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
