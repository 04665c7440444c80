"""The async inference worker: the clock submits a job and polls for the result; it never waits.

Two placements behind one interface (`submit`, `poll`, `busy`, `close`):
- `ProcessWorker` (default) runs the policy in a child process started with `spawn`, so the
  policy's Python (preprocessing, tokenising, engine glue) never holds the clock process's GIL
  and torch is never imported into it. Images cross a pipe as raw buffers, sent by a helper
  thread that spends its time in blocking writes (GIL released).
- `ThreadWorker` runs it on a thread of the daemon process (tests, and quick experiments).

The daemon never knows which backend runs: the worker builds the policy from a `PolicySpec`
(`load_policy` keyword arguments, or a "module:function" factory) and only calls `infer`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing as mp
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

log = logging.getLogger("phyai_edge.control")


class PolicyLike(Protocol):
    """What the daemon needs from `phyai_edge.engines.policy.Policy`."""

    chunk_size: int
    action_dim: int
    state_dim: int
    camera_names: list[str]

    def infer(self, observations: list[Any], rtc: Any = None, noise: Any = None) -> Any: ...


@dataclass(frozen=True)
class PolicyInfo:
    chunk_size: int
    action_dim: int
    state_dim: int
    camera_names: tuple[str, ...]
    description: str = ""


@dataclass(frozen=True)
class PolicySpec:
    """How to build the policy inside the worker. Picklable (it crosses to the child process)."""

    factory: str = "phyai_edge.engines.policy:load_policy"
    kwargs: dict[str, Any] = field(default_factory=dict)
    threads: int = 0  # torch.set_num_threads in the worker; 0 leaves torch's default

    def build(self) -> PolicyLike:
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        module_name, _, func_name = self.factory.partition(":")
        factory = getattr(importlib.import_module(module_name), func_name)
        return factory(**self.kwargs)


@dataclass
class Job:
    job_id: int
    images: dict[str, np.ndarray | None]  # policy camera name -> HxWx3 uint8 (or None: masked)
    bgr: dict[str, bool]  # which images are BGR (converted to RGB in the worker, off the clock)
    state: np.ndarray
    prompt: str
    timestamp: float
    rtc_mode: str = "none"
    prefix: np.ndarray | None = None
    delay: int = 0
    execution_horizon: int = 0
    max_guidance_weight: float = 5.0


@dataclass
class JobResult:
    job_id: int
    actions: np.ndarray | None  # (H, action_dim) float32 or None on failure
    stage_ms: dict[str, float]
    infer_ms: float
    error: str | None = None


def policy_info(policy: PolicyLike) -> PolicyInfo:
    return PolicyInfo(
        int(policy.chunk_size),
        int(policy.action_dim),
        int(policy.state_dim),
        tuple(policy.camera_names),
        type(policy).__name__,
    )


def run_job(policy: PolicyLike, job: Job) -> JobResult:
    """Turn a job into `Observation` / `RTCRequest`, run it, and check the result's shape."""
    from phyai_edge.adapters.base import Observation
    from phyai_edge.engines.base import SOLVER_RTC_MODES, RTCRequest

    t0 = time.perf_counter()
    try:
        images = {}
        for name, img in job.images.items():
            if img is not None and job.bgr.get(name):
                img = np.ascontiguousarray(img[..., ::-1])
            elif img is not None and not img.flags.writeable:
                img = img.copy()  # frames are shared read-only views; the policy gets its own
            images[name] = img
        obs = Observation(images=images, state=job.state, prompt=job.prompt, timestamp=job.timestamp)
        rtc = None
        if job.prefix is not None and job.rtc_mode in SOLVER_RTC_MODES:
            rtc = RTCRequest(
                mode=job.rtc_mode,  # type: ignore[arg-type]
                prefix=job.prefix,
                delay=job.delay,
                execution_horizon=job.execution_horizon,
                max_guidance_weight=job.max_guidance_weight,
            )
        res = policy.infer([obs], rtc=rtc)
        actions = np.asarray(res.actions, dtype=np.float32)
        if actions.ndim != 3 or actions.shape[0] != 1:
            raise ValueError(f"policy returned actions of shape {actions.shape}, expected (1, H, action_dim)")
        stage_ms = {str(k): float(v) for k, v in dict(getattr(res, "stage_ms", {}) or {}).items()}
        return JobResult(job.job_id, np.ascontiguousarray(actions[0]), stage_ms, (time.perf_counter() - t0) * 1e3)
    except Exception as exc:
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return JobResult(job.job_id, None, {}, (time.perf_counter() - t0) * 1e3, detail)


def make_warmup_job(info: PolicyInfo, prompt: str, size: int = 224) -> Job:
    images: dict[str, np.ndarray | None] = {n: np.zeros((size, size, 3), np.uint8) for n in info.camera_names}
    return Job(0, images, {}, np.zeros(info.state_dim, np.float32), prompt, time.monotonic())


# ---------------------------------------------------------------- thread placement


class ThreadWorker:
    def __init__(self, spec: PolicySpec | None = None, policy: PolicyLike | None = None) -> None:
        self._spec = spec
        self._policy = policy
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=1)
        self._result: JobResult | None = None
        self._busy = False
        self._thread: threading.Thread | None = None
        self.info: PolicyInfo | None = None

    def start(self, timeout_s: float = 600.0) -> PolicyInfo:
        # Import what run_job needs now, not on the first job while the clock is running.
        import phyai_edge.adapters.base
        import phyai_edge.engines.base  # noqa: F401

        if self._policy is None:
            assert self._spec is not None
            self._policy = self._spec.build()
        self.info = policy_info(self._policy)
        self._thread = threading.Thread(target=self._run, name="inference", daemon=True)
        self._thread.start()
        return self.info

    def run_sync(self, job: Job) -> JobResult:
        assert self._policy is not None
        return run_job(self._policy, job)

    @property
    def busy(self) -> bool:
        return self._busy

    def submit(self, job: Job) -> None:
        if self._busy:
            raise RuntimeError("worker is busy: one inference at a time")
        self._busy = True
        self._jobs.put_nowait(job)

    def poll(self) -> JobResult | None:
        res = self._result
        if res is not None:
            self._result = None
            self._busy = False
        return res

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._jobs.put_nowait(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            assert self._policy is not None
            self._result = run_job(self._policy, job)


# ---------------------------------------------------------------- process placement


def _send_job(conn: Any, job: Job) -> None:
    """Small pickled header, then each array as a raw buffer (no pickling of pixel data)."""
    arrays: list[np.ndarray] = []
    meta_images = {}
    for name, img in job.images.items():
        if img is None:
            meta_images[name] = None
        else:
            img = np.ascontiguousarray(img)
            meta_images[name] = (img.shape, str(img.dtype))
            arrays.append(img)
    head = {k: v for k, v in job.__dict__.items() if k != "images"}
    head["images"] = meta_images
    conn.send(head)
    for a in arrays:
        conn.send_bytes(memoryview(a).cast("B"))


def _recv_job(conn: Any) -> Job | None:
    head = conn.recv()
    if head is None:
        return None
    images: dict[str, np.ndarray | None] = {}
    for name, meta in head.pop("images").items():
        if meta is None:
            images[name] = None
        else:
            shape, dtype = meta
            images[name] = np.frombuffer(conn.recv_bytes(), dtype=dtype).reshape(shape)
    return Job(images=images, **head)


def _child_main(conn: Any, spec: PolicySpec) -> None:
    """Worker process: build the policy, report its shape, then serve jobs until told to stop."""
    try:
        policy = spec.build()
        conn.send(("ready", policy_info(policy)))
    except Exception as exc:
        conn.send(("error", "".join(traceback.format_exception_only(type(exc), exc)).strip()))
        return
    while True:
        try:
            job = _recv_job(conn)
        except (EOFError, OSError):
            return
        if job is None:
            return
        res = run_job(policy, job)
        conn.send(res)


class ProcessWorker:
    def __init__(self, spec: PolicySpec) -> None:
        self._spec = spec
        self._ctx = mp.get_context("spawn")
        self._conn: Any = None
        self._proc: Any = None
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=1)
        self._result: JobResult | None = None
        self._busy = False
        self._thread: threading.Thread | None = None
        self.info: PolicyInfo | None = None
        self._timeout_s = 600.0
        self.restarts = 0

    def start(self, timeout_s: float = 600.0) -> PolicyInfo:
        self._timeout_s = timeout_s
        self.info = self._spawn()
        self._thread = threading.Thread(target=self._run, name="inference-client", daemon=True)
        self._thread.start()
        return self.info

    def _spawn(self) -> PolicyInfo:
        parent, child = self._ctx.Pipe(duplex=True)
        self._proc = self._ctx.Process(target=_child_main, args=(child, self._spec), name="phyai-edge-worker", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        if not parent.poll(self._timeout_s):
            self._proc.kill()
            raise TimeoutError(f"the policy did not load within {self._timeout_s:.0f} s")
        try:
            kind, payload = parent.recv()
        except EOFError:
            raise RuntimeError(f"the worker process died while loading the policy (exit code {self._proc.exitcode})") from None
        if kind != "ready":
            raise RuntimeError(f"loading the policy failed: {payload}")
        return payload

    def run_sync(self, job: Job) -> JobResult:
        """Before the clock starts (warm-up): submit and wait."""
        self.submit(job)
        while True:
            res = self.poll()
            if res is not None:
                return res
            time.sleep(0.002)

    @property
    def busy(self) -> bool:
        return self._busy

    def submit(self, job: Job) -> None:
        if self._busy:
            raise RuntimeError("worker is busy: one inference at a time")
        self._busy = True
        self._jobs.put_nowait(job)

    def poll(self) -> JobResult | None:
        res = self._result
        if res is not None:
            self._result = None
            self._busy = False
        return res

    def close(self) -> None:
        """Fast: the child holds no state worth saving, so it is killed rather than joined."""
        with contextlib.suppress(queue.Full):
            self._jobs.put_nowait(None)
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                _send_job(self._conn, job)
                res = self._conn.recv()
            except (EOFError, OSError) as exc:
                code = self._proc.exitcode if self._proc is not None else None
                self._result = JobResult(job.job_id, None, {}, 0.0, f"worker process died ({exc!r}, exit code {code})")
                self.restarts += 1
                log.error("inference worker died (exit code %s); restarting it", code)
                try:
                    self._spawn()
                except Exception as exc2:
                    log.error("inference worker restart failed: %s; no more inferences", exc2)
                    return
                continue
            self._result = res
