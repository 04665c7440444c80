"""`RemotePolicy`: a robot daemon's engine that lives on a `phyai-edge serve` machine.

It has the `Policy.infer(observations, rtc=None, noise=None)` signature the daemon drives, and
imports only numpy and pyzmq (no torch, no model code) so it can run on a robot computer that
has neither. The robot's clock, RTC queue and safety checks stay on the robot: a slow, busy
or unreachable server shows up as an exception from `infer` (the daemon keeps executing its
current chunk and flags the miss), never as a blocked clock.

Daemon hook: `model.factory = "phyai_edge.serve.client:remote_policy"` with the endpoint in
`PHYAI_EDGE_SERVE_ENDPOINT` (or passed as the `endpoint` keyword); see docs/scenarios.md.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from phyai_edge.serve import wire

log = logging.getLogger("phyai_edge.serve.client")

ENDPOINT_ENV = "PHYAI_EDGE_SERVE_ENDPOINT"
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5570"


class ServeError(RuntimeError):
    """The server answered with an error; `code` is one of the `wire.ERR_*` values."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"serve: {code}: {message}")
        self.code = code
        self.message = message


class ServerBusyError(ServeError):
    """Back-pressure: the server (or this robot's share of it) is full. Retry after a tick."""


@dataclass
class RemoteResult:
    """Duck-types `engines.base.InferenceResult` without torch: `chunk` is always None."""

    actions: np.ndarray  # (B, H, action_dim) float32, robot units
    stage_ms: dict[str, float] = field(default_factory=dict)
    batch: int = 0
    late: bool = False
    chunk: Any = None


def _array(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, without importing torch
        x = x.detach().cpu().numpy()
    return np.asarray(x)


class RemotePolicy:
    """One robot's connection (ZeroMQ DEALER) to the server's ROUTER.

    timeout_s: how long `infer` waits for its answer before raising TimeoutError; a late
        answer that arrives afterwards is discarded by request id. Each request tells the
        server so (`wait_ms`): one still queued when this robot has stopped waiting is not
        run but answered `expired` (discarded here like any late answer).
    budget_ms: the default time until this robot needs a chunk (its RTC budget: roughly
        (H - s) control periods); the server schedules earliest deadline first from it.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        robot: str | None = None,
        timeout_s: float = 2.0,
        budget_ms: float | None = None,
        connect_timeout_s: float = 10.0,
        context: zmq.Context | None = None,
    ) -> None:
        # Each becomes a poll in milliseconds (Inf, NaN: an OverflowError or ValueError from every
        # call, not a wait), and timeout_s each request's wait_ms, which the server refuses unless
        # positive and finite. A client that could wait forever would block the robot's worker.
        for name, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
        self.endpoint = endpoint
        self.robot = robot or f"robot-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.timeout_s = timeout_s
        self.budget_ms = budget_ms
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Queue only on a live connection: a request must never reach a restarted server
        # seconds late with an observation that is long stale.
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.connect(endpoint)
        self._closed = False
        try:
            info = self._call(wire.Request("hello", next(self._ids), self.robot), connect_timeout_s).info["model"]
        except BaseException:
            self.close()
            raise
        self.model_info: dict[str, Any] = info
        self.chunk_size = int(info["chunk_size"])
        self.action_dim = int(info["action_dim"])
        self.state_dim = int(info["state_dim"])
        self.camera_names = list(info["camera_names"])
        self.model_action_dim = int(info["model_action_dim"])

    # -- the Policy interface --------------------------------------------------------------
    def infer(self, observations: Any, rtc: Any = None, noise: Any = None, budget_ms: float | None = None) -> RemoteResult:
        """observations: one or a list of objects with images / state / prompt / timestamp
        (`adapters.base.Observation`); rtc: an object with mode / prefix / delay /
        execution_horizon / max_guidance_weight (`engines.base.RTCRequest`) or None; noise:
        (B, H, model_action_dim) array or tensor, or None for the server's seeded draws."""
        obs = list(observations) if isinstance(observations, (list, tuple)) else [observations]
        wrtc = None
        if rtc is not None:
            wrtc = wire.WireRTC(str(rtc.mode), _array(rtc.prefix).astype(np.float32), int(rtc.delay),
                                int(rtc.execution_horizon), float(getattr(rtc, "max_guidance_weight", 5.0)))
        nz = None if noise is None else _array(noise).astype(np.float32)
        budget = budget_ms if budget_ms is not None else self.budget_ms
        # wait_ms: the time _call really waits, so the server drops the request once nobody reads the answer.
        req = wire.Request("infer", next(self._ids), self.robot, budget, obs, wrtc, nz, wait_ms=self.timeout_s * 1e3)
        t0 = time.perf_counter()
        rep = self._call(req, self.timeout_s)
        roundtrip = (time.perf_counter() - t0) * 1e3
        if rep.actions is None:
            raise ServeError(wire.ERR_INFERENCE, "reply carried no actions")
        stage_ms = {str(k): float(v) for k, v in dict(rep.info.get("stage_ms", {})).items()}
        stage_ms.update({"server_queue": float(rep.info.get("queue_ms", 0.0)),
                         "server_total": float(rep.info.get("server_ms", 0.0)), "roundtrip": roundtrip,
                         "total": roundtrip})
        return RemoteResult(np.array(rep.actions, dtype=np.float32), stage_ms, int(rep.info.get("batch", 0)),
                            bool(rep.info.get("late", False)))

    def prompt_fit(self, prompt: str) -> tuple[int | None, int | None, int | None]:
        """`Policy.prompt_fit` of the server's policy: (the most prompt tokens `prompt` takes with
        any robot state, the most the server's engine runs as its warm-up left it, the most the
        model takes at all), each None where the server cannot say. A server that cannot check
        instructions (an older one, or one whose executor holds no policy) gives all None and a
        log line; any other failure raises, as `infer` does."""
        try:
            rep = self._call(wire.Request("prompt_fit", next(self._ids), self.robot, prompt=prompt), self.timeout_s)
        except ServeError as exc:
            # An older server knows no such type: it refuses it naming the field (wire.WireError's
            # convention), which no valid request from this client draws from a newer one.
            if exc.code != wire.ERR_BAD_REQUEST or not exc.message.startswith("type:"):
                raise
            log.warning("the server at %s cannot check instructions (it predates prompt_fit: %s); "
                        "this one is not checked", self.endpoint, exc.message)
            return None, None, None
        unchecked = rep.info.get("unchecked")
        if unchecked:
            log.warning("the server at %s cannot check instructions: %s; this one is not checked",
                        self.endpoint, unchecked)
        return wire.decode_prompt_fit(rep)

    def server_stats(self) -> dict[str, Any]:
        return self._call(wire.Request("stats", next(self._ids), self.robot), self.timeout_s).info["report"]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close(0)

    def __enter__(self) -> RemotePolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport -------------------------------------------------------------------------
    def _call(self, req: wire.Request, timeout_s: float) -> wire.Reply:
        with self._lock:
            if self._closed:
                raise RuntimeError("RemotePolicy is closed")
            deadline = time.monotonic() + timeout_s
            frames = wire.encode_request(req)
            no_connection = f"serve: no connection to {self.endpoint} within {timeout_s:.1f} s"
            if not self._sock.poll(max(1, int(timeout_s * 1e3)), zmq.POLLOUT):
                raise ConnectionError(no_connection)
            try:
                # Not blocking: a connection lost between the poll and the send would otherwise
                # hold the robot's worker here with no timeout at all (IMMEDIATE queues nothing).
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise ConnectionError(no_connection) from None
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self._sock.poll(max(1, int(left * 1e3)), zmq.POLLIN):
                    raise TimeoutError(f"serve: no answer from {self.endpoint} to request {req.req_id} "
                                       f"within {timeout_s * 1e3:.0f} ms")
                rep = wire.decode_reply(self._sock.recv_multipart(copy=False))
                if rep.req_id != req.req_id:
                    continue  # the late answer to a request that already timed out
                if not rep.ok:
                    cls = ServerBusyError if rep.error in (wire.ERR_OVERLOADED, wire.ERR_ROBOT_LIMIT) else ServeError
                    raise cls(rep.error, rep.message)
                return rep


def remote_policy(endpoint: str | None = None, robot: str | None = None, timeout_s: float = 2.0,
                  budget_ms: float | None = None, **_load_policy_kwargs: Any) -> RemotePolicy:
    """Factory for the daemon's `model.factory` hook. The daemon passes its `load_policy`
    keywords (adapter, checkpoint, device, ...); they describe the server's model, not this
    client, so they are ignored here."""
    ep = endpoint or os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT
    return RemotePolicy(ep, robot=robot or os.environ.get("PHYAI_EDGE_ROBOT") or None, timeout_s=timeout_s,
                        budget_ms=budget_ms)
