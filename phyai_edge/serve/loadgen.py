"""Simulated robot daemons for the server: each one a fixed-rate inference loop over a
`RemotePolicy`, as a robot's worker would run it (one request every `period_s`, i.e. every
s control ticks). Torch-free, so hundreds of them start quickly in a few processes.

Used by the robots test (8 robots, one killed mid-run) and by `benchmarks/serve_gpu.py`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from phyai_edge.serve import wire
from phyai_edge.serve.client import RemotePolicy


@dataclass
class RobotRun:
    name: str
    answered: int = 0
    refused: int = 0
    errors: list[str] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)  # wall-clock send time of each answered request
    late: int = 0  # answers that arrived after the robot's budget

    def as_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def robot_loop(endpoint: str, name: str, requests: int, period_s: float, budget_ms: float,
               image_hw: tuple[int, int] = (24, 32), seed: int = 0, die_at: int = -1, start_at: float = 0.0,
               timeout_s: float = 30.0, ready: Any = None, rtc: tuple[str, int, int, int] | None = None) -> RobotRun:
    """Run one robot: `requests` inferences, one per `period_s` (fixed-rate, not back-to-back,
    like a daemon that starts the next inference after s ticks). die_at >= 0: send that request
    and then SIGKILL this process with it in flight (a robot computer losing power).
    rtc: (mode, prefix length, delay, s) to send an RTC request with a random prefix each time."""
    rng = np.random.default_rng(seed)
    run = RobotRun(name)
    remote = RemotePolicy(endpoint, robot=name, timeout_s=timeout_s, budget_ms=budget_ms, connect_timeout_s=timeout_s)
    if ready is not None:
        ready()
    if start_at:
        time.sleep(max(0.0, start_at - time.time()))
    # Images are made once per robot: the server cares about bytes and shapes, not content.
    images = {c: rng.integers(0, 256, (*image_hw, 3), dtype=np.uint8) for c in remote.camera_names}
    next_t = time.perf_counter() + rng.uniform(0, period_s)  # robots are not phase-locked
    for k in range(requests):
        time.sleep(max(0.0, next_t - time.perf_counter()))
        next_t += period_s
        obs = wire.WireObservation(images, rng.uniform(-1, 1, remote.state_dim).astype(np.float32), "pick up the cube")
        if k == die_at:
            req = wire.Request("infer", 1_000_000 + k, name, budget_ms, [obs])
            remote._sock.send_multipart(wire.encode_request(req))
            time.sleep(0.01)  # let ZeroMQ's I/O thread put it on the wire
            os.kill(os.getpid(), signal.SIGKILL)
        req_rtc = None
        if rtc is not None:
            mode, n, d, s = rtc
            req_rtc = wire.WireRTC(mode, rng.uniform(-1, 1, (n, remote.action_dim)).astype(np.float32), d, s)
        t0, sent = time.perf_counter(), time.time()
        try:
            res = remote.infer(obs, rtc=req_rtc)
            if res.actions.shape != (1, remote.chunk_size, remote.action_dim) or not np.isfinite(res.actions).all():
                raise ValueError(f"bad actions: shape {res.actions.shape}")
            dt = time.perf_counter() - t0
            run.answered += 1
            run.latency_s.append(dt)
            run.sent_at.append(sent)
            run.late += int(dt * 1e3 > budget_ms)
        except Exception as exc:
            if getattr(exc, "code", "") in (wire.ERR_OVERLOADED, wire.ERR_ROBOT_LIMIT):
                run.refused += 1
            else:
                run.errors.append(f"{type(exc).__name__}: {exc}")
    remote.close()
    return run


def robots_process(endpoint: str, names: list[str], requests: int, period_s: float, budget_ms: float,
                   image_hw: tuple[int, int], seed: int, die_at: dict[str, int], start_at: float, out: Any,
                   rtc: tuple[str, int, int, int] | None = None) -> None:
    """Several robots in one process, one thread each (they spend their time in ZeroMQ waits,
    GIL released); results go to `out` (a multiprocessing queue) as ("done", name, dict)."""
    def one(i: int, name: str) -> None:
        try:
            r = robot_loop(endpoint, name, requests, period_s, budget_ms, image_hw, seed + i, die_at.get(name, -1),
                           start_at, ready=lambda: out.put(("ready", name, None)), rtc=rtc)
            out.put(("done", name, r.as_dict()))
        except Exception as exc:
            out.put(("done", name, RobotRun(name, errors=[f"{type(exc).__name__}: {exc}"]).as_dict()))

    threads = [threading.Thread(target=one, args=(i, n), daemon=True) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
