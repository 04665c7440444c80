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
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from phyai_edge.control.geometry import FrameGeometry
from phyai_edge.control.log import configured_level, configured_to_stderr, setup_logging
from phyai_edge.control.rtc import SOLVER_MODES

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
    steps: int = 0  # the solver's flow steps per chunk; 0: the policy does not say
    device_name: str = ""  # the GPU's name ("NVIDIA H200") when the policy runs on CUDA; "": not known
    # Whether cameras declared absent are left out of the model rather than run masked
    # (`Policy.drops_cameras`, `Policy.set_absent_cameras`).
    drops_cameras: bool = False


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
    noise: np.ndarray | None = None  # (1, H, model_action_dim) float32; None: keyed noise, or the engine's stream
    # The chunk's noise is drawn in the worker from (noise_seed, 0, job_id) (`engines.noise`), so a
    # recording replays to the same actions; None (or a policy that does not say its noise width):
    # the engine's own stream.
    noise_seed: int | None = None
    warmup: bool = False  # warm-up jobs may take as long as loading (first-call compilation, graph capture)
    # Warm-up only: other instructions the engine keeps prompt room for (`task.prompts`), and room
    # in tokens for ones not listed (`task.prompt_tokens`), so an instruction set at run time runs
    # the graphs this warm-up captures.
    room_prompts: tuple[str, ...] = ()
    room_tokens: int = 0
    # Policy camera name -> the crop / rotation / mirror its frames take (cameras.NAME.crop,
    # rotate, flip), applied here in the worker like the BGR conversion: off the clock.
    geometry: dict[str, FrameGeometry] = field(default_factory=dict)


@dataclass
class JobResult:
    job_id: int
    actions: np.ndarray | None  # (H, action_dim) float32 or None on failure
    stage_ms: dict[str, float]
    infer_ms: float
    error: str | None = None
    noise_seed: int | None = None  # the chunk's noise came from (noise_seed, 0, job_id); None: not keyed


@dataclass(frozen=True)
class PromptFit:
    """Whether an instruction can run as the policy was warmed up (`Policy.prompt_fit`)."""

    tokens: int | None  # the most prompt tokens it takes with any robot state; None: the policy cannot say
    room: int | None  # the most the policy runs without building graphs or truncating; None: not known
    error: str | None = None  # the check itself failed (the tokenizer raised, the worker is down)
    most: int | None = None  # the most the model takes at all (more is truncated); None: not known

    @property
    def fits(self) -> bool:
        return self.error is None and (self.tokens is None or self.room is None or self.tokens <= self.room)

    def problem(self) -> str:
        """Why the instruction is refused ("" if it fits), in words for the operator."""
        if self.error is not None:
            return self.error
        if self.fits:
            return ""
        too_long = self.most is not None and self.tokens is not None and self.tokens > self.most
        hint = f"the model takes at most {self.most}: shorten it" if too_long else \
            "raise task.prompt_tokens or list it in task.prompts; on a remote policy, the server's " \
            "--prompt-tokens or --warm-prompt"
        return (f"the instruction takes up to {self.tokens} prompt tokens with some robot states, and the policy "
                f"runs {self.room} as it was warmed up ({hint})")


def _one_line(exc: BaseException) -> str:
    """An exception as its type and message, the form every error the worker reports takes."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def prompt_fit(policy: PolicyLike, prompt: str) -> PromptFit:
    """`PromptFit` of `prompt` for `policy` (a policy without `prompt_fit` cannot say: it fits)."""
    fit = getattr(policy, "prompt_fit", None)
    if fit is None:
        return PromptFit(None, None)
    try:
        tokens, room, most = fit(prompt)
    except Exception as exc:
        return PromptFit(None, None, _one_line(exc))
    return PromptFit(tokens, room, None, most)


def policy_info(policy: PolicyLike) -> PolicyInfo:
    # An engine policy's adapter carries its solver spec; a stand-in policy may have neither.
    solver = getattr(getattr(policy, "adapter", None), "solver", None)
    steps = getattr(solver, "num_steps", 0)
    return PolicyInfo(
        int(policy.chunk_size),
        int(policy.action_dim),
        int(policy.state_dim),
        tuple(policy.camera_names),
        type(policy).__name__,
        steps if isinstance(steps, int) and steps > 0 else 0,
        device_name(policy),
        bool(getattr(policy, "drops_cameras", False)),  # a stand-in policy drops none
    )


def device_name(policy: PolicyLike) -> str:
    """The name of the GPU the policy runs on ("NVIDIA H200", "Orin"), from torch where this
    process has already imported it (the worker that built the policy); "" for a policy off CUDA,
    one that names no device, or where torch is not loaded. Never imports torch itself: with the
    thread worker this runs in the daemon's own process."""
    device = getattr(policy, "device", None)
    kind = getattr(device, "type", None) or str(device).partition(":")[0]
    torch = sys.modules.get("torch")
    if kind != "cuda" or torch is None:
        return ""
    try:
        name = torch.cuda.get_device_name(device)
    except Exception:  # only a label: the policy runs without it
        return ""
    return name if isinstance(name, str) else ""


def run_job(policy: PolicyLike, job: Job) -> JobResult:
    """Turn a job into `Observation` / `RTCRequest`, run it, and check the result's shape."""
    from phyai_edge.adapters.base import Observation
    from phyai_edge.engines.base import SOLVER_RTC_MODES, RTCRequest

    t0 = time.perf_counter()
    try:
        if job.warmup:
            _prepare_warmup(policy, job)
            # A warm-up's time is what a live job of its kind will take (`Daemon.setup` seeds the
            # delay estimate from it), so the one-off setup above is not in it: the longest prompt
            # with any state takes a tokenisation per state bin (~12-20 ms, on the host).
            t0 = time.perf_counter()
        images = {name: None if img is None else as_policy_frame(img, job.bgr.get(name, False), job.geometry.get(name))
                  for name, img in job.images.items()}
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
        # A live job that makes the engine build graphs (a capture on a GPU, ~1 s at full size) met a
        # shape or RTC mode the warm-up did not run: the control loop holds meanwhile, so say so.
        built = getattr(policy, "graphs_built", None)
        noise, keyed = _job_noise(policy, job)
        res = policy.infer([obs], rtc=rtc) if noise is None else policy.infer([obs], rtc=rtc, noise=noise)
        actions = np.asarray(res.actions, dtype=np.float32)
        if actions.ndim != 3 or actions.shape[0] != 1:
            raise ValueError(f"policy returned actions of shape {actions.shape}, expected (1, H, action_dim)")
        stage_ms = {str(k): float(v) for k, v in dict(getattr(res, "stage_ms", {}) or {}).items()}
        took_ms = (time.perf_counter() - t0) * 1e3
        if not job.warmup and built is not None and policy.graphs_built != built:
            log.warning("inference %d met a shape or RTC mode the warm-up did not run: the engine built graphs "
                        "for it inside the control loop (%.0f ms)", job.job_id, took_ms)
        return JobResult(job.job_id, np.ascontiguousarray(actions[0]), stage_ms, took_ms,
                         noise_seed=job.noise_seed if keyed else None)
    except Exception as exc:
        detail = _one_line(exc)
        return JobResult(job.job_id, None, {}, (time.perf_counter() - t0) * 1e3, detail)


def _job_noise(policy: PolicyLike, job: Job) -> tuple[Any, bool]:
    """The job's noise for `policy.infer` (None: the engine's stream) and whether it is keyed."""
    width = getattr(policy, "model_action_dim", None)
    if job.noise is None and (job.noise_seed is None or not isinstance(width, int)):
        return None, False  # not asked for, or a policy of the caller's that does not say its noise's shape
    # Only here: a policy that takes noise imported torch already (and the process worker's clock
    # process never runs a job).
    import torch

    if job.noise is not None:
        return torch.from_numpy(np.ascontiguousarray(job.noise, dtype=np.float32)), False
    from phyai_edge.engines.noise import frame_noise

    return frame_noise(int(job.noise_seed or 0), 0, job.job_id, policy.chunk_size, int(width)), True


def _prepare_warmup(policy: PolicyLike, job: Job) -> None:
    """What a warm-up job sets on the policy before its inference."""
    fix_prompt = getattr(policy, "fix_prompt_positions", None)
    if fix_prompt is not None:
        # the warm-up's zero state must capture the graphs every live state will run
        fix_prompt([job.prompt, *job.room_prompts], at_least=job.room_tokens)
    absent = getattr(policy, "set_absent_cameras", None)
    if absent is not None:
        # A warm-up frame is None exactly for a policy camera with no source (`warmup_frames`):
        # never present, so the model may run without its slot (a camera that goes stale is
        # masked in its job, not declared here: its slot stays, and so do the graphs).
        absent([name for name, img in job.images.items() if img is None])


def as_policy_frame(image: np.ndarray, bgr: bool, geometry: FrameGeometry | None) -> np.ndarray:
    """A camera frame as the policy takes it: cropped, rotated and mirrored as configured, RGB,
    and the policy's own contiguous copy (frames are shared read-only views; a rotation or a
    colour swap is a strided view): at most one copy of the pixels."""
    if geometry is not None:
        image = geometry.apply(image)
    if bgr:
        image = image[..., ::-1]
    if image.flags.c_contiguous and image.flags.writeable:
        return image
    return np.array(image, order="C")


def make_warmup_job(info: PolicyInfo, prompt: str, size: int = 224, rtc_mode: str = "none",
                    execution_horizon: int = 0, delay: int = 0, max_guidance_weight: float = 5.0,
                    frames: Mapping[str, tuple[int, int] | None] | None = None) -> Job:
    """A job of blank frames and zero state. With a solver RTC mode it carries a zero prefix of
    the length the daemon sends in steady state (the chunk minus the execution horizon), so the
    engine meets that mode's solver path, and captures its graph, before the clock starts.
    `frames`: each policy camera's (height, width) as its source is configured, or None for a
    camera with no source (masked, as in every live job); None: `size` x `size` for all."""
    shapes = frames if frames is not None else {n: (size, size) for n in info.camera_names}
    images: dict[str, np.ndarray | None] = {
        n: None if shapes.get(n) is None else np.zeros((*shapes[n], 3), np.uint8) for n in info.camera_names
    }
    prefix = None
    if rtc_mode in SOLVER_MODES:
        rows = max(1, info.chunk_size - execution_horizon)
        prefix = np.zeros((rows, info.action_dim), np.float32)
        delay = min(max(delay, 0), rows)
    return Job(0, images, {}, np.zeros(info.state_dim, np.float32), prompt, time.monotonic(), rtc_mode=rtc_mode,
               prefix=prefix, delay=delay, execution_horizon=execution_horizon,
               max_guidance_weight=max_guidance_weight, warmup=True)


# ---------------------------------------------------------------- thread placement


class _JobSlot:
    """One inference at a time, handed over without blocking the clock: the clock thread submits
    a job and polls for its result; the worker's own thread takes the job and leaves the result."""

    def _init_slot(self) -> None:
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=1)
        self._result: JobResult | None = None
        self._busy = False

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


class ThreadWorker(_JobSlot):
    def __init__(self, spec: PolicySpec | None = None, policy: PolicyLike | None = None) -> None:
        self._spec = spec
        self._policy = policy
        self._init_slot()
        self._thread: threading.Thread | None = None
        self.info: PolicyInfo | None = None
        # The health interface ProcessWorker has (a thread cannot die on its own and be restarted).
        self.up = True
        self.down_reason: str | None = None
        self.deaths = 0
        self.restarts = 0
        self.restart_failures = 0
        self.restart_attempt = 0
        self.pid: int | None = None

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

    def check_prompt(self, prompt: str, timeout_s: float = 10.0) -> PromptFit:
        """`prompt_fit`, on the caller's thread (the policy's tokenizer may run beside an inference)."""
        assert self._policy is not None
        return prompt_fit(self._policy, prompt)

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


def _read_job(conn: Any, head: dict[str, Any]) -> Job:
    """The job whose header `head` was just received: its arrays follow on `conn`."""
    images: dict[str, np.ndarray | None] = {}
    for name, meta in head.pop("images").items():
        if meta is None:
            images[name] = None
        else:
            shape, dtype = meta
            images[name] = np.frombuffer(conn.recv_bytes(), dtype=dtype).reshape(shape)
    return Job(images=images, **head)


def _child_main(conn: Any, spec: PolicySpec, log_level: int | None = None, log_to_stderr: bool = False) -> None:
    """Worker process: build the policy, report its shape, then serve jobs until told to stop.
    `log_level`: the daemon's logging, set up here alike (a spawned process starts with none, so
    the engine's lines, captured graphs and bundle load times, were lost, and its warnings reached
    journald without a priority)."""
    if log_level is not None:
        setup_logging(log_level, log_to_stderr)
    try:
        policy = spec.build()
        conn.send(("ready", policy_info(policy)))
    except Exception as exc:
        conn.send(("error", _one_line(exc)))
        return
    while True:
        try:
            head = conn.recv()
            if head is None:
                return
            if isinstance(head, tuple) and head[0] == _PROMPT_FIT:
                conn.send(prompt_fit(policy, head[1]))
                continue
            job = _read_job(conn, head)
        except (EOFError, OSError):
            return
        res = run_job(policy, job)
        conn.send(res)


_PROMPT_FIT = "prompt_fit"  # the one message to the worker process that is not a job


@dataclass
class _PromptCheck:
    """A `check_prompt` waiting in the client thread's queue, answered through `done`."""

    prompt: str
    done: threading.Event = field(default_factory=threading.Event)
    fit: PromptFit | None = None

    def answer(self, fit: PromptFit) -> None:
        self.fit = fit
        self.done.set()


class WorkerHungError(RuntimeError):
    """An inference that outlived `ProcessWorker.job_timeout_s`: the process is alive but stuck."""


class ProcessWorker(_JobSlot):
    """The policy in a child process, restarted with backoff when that process dies.

    Death (OOM kill, a segfault in a driver, `kill -9`) is seen as end-of-file on the pipe while
    a job is in flight, or by the client thread checking the process between jobs. From then
    until a new process has loaded the policy and run its warm-up jobs, `up` is False and
    `down_reason` says why: the daemon starts no inference (it runs out the executing chunk and
    then holds). Restart attempts wait `backoff_s`, doubling up to `backoff_max_s`, and go on for
    as long as the daemon runs; every attempt and its outcome is logged. A job queued while the
    worker was down is answered with an error, never run late on a stale observation.
    """

    def __init__(self, spec: PolicySpec, backoff_s: float = 0.5, backoff_max_s: float = 30.0,
                 job_timeout_s: float = 10.0) -> None:
        self._spec = spec
        self._ctx = mp.get_context("spawn")
        self._conn: Any = None
        self._proc: Any = None
        self._init_slot()
        # Jobs (one at a time: `busy`) and prompt checks share the client thread's queue, in order.
        self._jobs: queue.Queue[Job | _PromptCheck | None] = queue.Queue()  # type: ignore[assignment]
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self.info: PolicyInfo | None = None
        self._timeout_s = 600.0
        self.backoff_s = backoff_s
        self.backoff_max_s = max(backoff_max_s, backoff_s)
        # A process that neither answers nor dies (a wedged driver call, a deadlock) is treated
        # like a dead one: killed and restarted, instead of leaving the robot holding for good.
        self.job_timeout_s = job_timeout_s
        # Run by a restarted process before it counts as up (the daemon sets them after its own warm-up).
        self.warmup_jobs: list[Job] = []
        # Health, written by the client thread, read by the clock thread (plain attributes: each
        # read sees a whole value; `up` is written last on the way up and first on the way down).
        self.up = False
        self.down_reason: str | None = None
        self.deaths = 0
        self.restarts = 0  # successful restarts
        self.restart_failures = 0
        self.restart_attempt = 0  # attempt number within the current outage (0 while up)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout_s: float = 600.0) -> PolicyInfo:
        self._timeout_s = timeout_s
        self.info = self._spawn()
        self.up = True
        self._thread = threading.Thread(target=self._run, name="inference-client", daemon=True)
        self._thread.start()
        return self.info

    def _spawn(self) -> PolicyInfo:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_child_main, args=(child, self._spec, configured_level(), configured_to_stderr()),
                                 name="phyai-edge-worker", daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        deadline = time.monotonic() + self._timeout_s
        while not parent.poll(0.2):  # end-of-file (the child died) also makes poll return True
            if self._closing.is_set():
                proc.kill()
                raise RuntimeError("the daemon is shutting down")
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"the policy did not load within {self._timeout_s:.0f} s")
        try:
            kind, payload = parent.recv()
        except EOFError:
            proc.join(1.0)
            raise RuntimeError(f"the worker process died while loading the policy ({_exit_text(proc.exitcode)})") from None
        if kind != "ready":
            proc.kill()
            raise RuntimeError(f"loading the policy failed: {payload}")
        return payload

    def run_sync(self, job: Job) -> JobResult:
        """Before the clock starts (warm-up): submit and wait, until `close` (a stop during start-up)."""
        self.submit(job)
        while True:
            res = self.poll()
            if res is not None:
                return res
            if self._closing.is_set():
                raise RuntimeError("the daemon is shutting down")
            time.sleep(0.002)

    def check_prompt(self, prompt: str, timeout_s: float = 10.0) -> PromptFit:
        """`prompt_fit` in the worker process, asked between jobs (after the inference in flight, if
        any). Blocks the caller (never the clock thread) up to `timeout_s`."""
        if not self.up:
            return PromptFit(None, None, f"cannot check the instruction: {self.down_reason or 'the inference worker is down'}")
        check = _PromptCheck(prompt)
        self._jobs.put(check)
        deadline = time.monotonic() + timeout_s
        while not check.done.wait(0.1):
            if self._closing.is_set():  # `close` during start-up: the client thread is gone
                return PromptFit(None, None, "the daemon is shutting down")
            if time.monotonic() > deadline:
                return PromptFit(None, None, f"the inference worker did not answer within {timeout_s:g} s")
        assert check.fit is not None
        return check.fit

    def close(self) -> None:
        """Fast: the child holds no state worth saving, so it is killed rather than joined."""
        self._closing.set()
        with contextlib.suppress(queue.Full):
            self._jobs.put_nowait(None)
        proc = self._proc
        if proc is not None and proc.is_alive():
            proc.kill()

    # -- client thread

    def _fit(self, prompt: str) -> PromptFit:
        """Ask the process; like a job, no answer within the job timeout is the process hanging."""
        self._conn.send((_PROMPT_FIT, prompt))
        if not self._conn.poll(self.job_timeout_s):
            raise WorkerHungError(f"no answer to a prompt check within {self.job_timeout_s:g} s")
        fit = self._conn.recv()
        if not isinstance(fit, PromptFit):
            raise EOFError(f"unexpected message from the worker: {type(fit).__name__}")
        return fit

    def _call(self, job: Job) -> JobResult:
        """Send one job and wait for its result. Any failure of the pipe is the process dying; no
        answer within the job timeout is the process hanging (warm-ups get the load timeout)."""
        timeout = self._timeout_s if job.warmup else self.job_timeout_s
        deadline = time.monotonic() + timeout
        self._send_within(job, timeout)
        # End-of-file also ends the wait, and recv() raises below.
        if not self._conn.poll(max(0.0, deadline - time.monotonic())):
            raise WorkerHungError(f"no result within {timeout:g} s")
        res = self._conn.recv()
        if not isinstance(res, JobResult):
            raise EOFError(f"unexpected message from the worker: {type(res).__name__}")
        return res

    def _send_within(self, job: Job, timeout: float) -> None:
        """Send a job; if that takes `timeout`, kill the process and raise WorkerHungError. A frozen
        process (SIGSTOP, a cgroup freezer) stops reading, and a job larger than the pipe's buffer
        (large camera frames) then blocks the send for good, where no result timeout is reached."""
        proc, stuck = self._proc, threading.Event()

        def kill() -> None:
            stuck.set()
            proc.kill()  # the blocked send then fails with a broken pipe

        timer = threading.Timer(timeout, kill)
        timer.daemon = True
        timer.start()
        try:
            _send_job(self._conn, job)
        except OSError:
            if not stuck.is_set():
                raise
        finally:
            timer.cancel()
        if stuck.is_set():
            raise WorkerHungError(f"the job could not be sent within {timeout:g} s")

    def _death_reason(self, exc: BaseException | None) -> str:
        proc = self._proc
        if isinstance(exc, WorkerHungError) and proc is not None:
            proc.kill()
            proc.join(1.0)
            return f"inference worker process {proc.pid} hung ({exc}); killed"
        if proc is not None:
            proc.join(1.0)  # reap it, so the exit code (signal) is known
            if proc.is_alive():  # the pipe broke but the process lives on: do not leave it half-working
                proc.kill()
                proc.join(1.0)
        code = proc.exitcode if proc is not None else None
        pid = proc.pid if proc is not None else None
        detail = f"; {type(exc).__name__}" if exc is not None and not isinstance(exc, EOFError) else ""
        return f"inference worker process {pid} died ({_exit_text(code)}{detail})"

    def _run(self) -> None:
        while not self._closing.is_set():
            try:
                job = self._jobs.get(timeout=0.1)
            except queue.Empty:
                proc = self._proc
                if proc is not None and not proc.is_alive() and not self._closing.is_set():
                    self._went_down(self._death_reason(None))  # died between jobs
                    if not self._restart():
                        return
                continue
            if job is None:
                return
            try:
                if isinstance(job, _PromptCheck):
                    job.answer(self._fit(job.prompt))
                    continue
                res = self._call(job)
            except Exception as exc:  # EOFError, BrokenPipeError, a half-written result...
                if self._closing.is_set():
                    if isinstance(job, _PromptCheck):
                        job.answer(PromptFit(None, None, "the daemon is shutting down"))
                    return
                reason = self._death_reason(exc)
                self._went_down(reason)  # `up` falls before the result is seen: no new job slips in
                if isinstance(job, _PromptCheck):
                    job.answer(PromptFit(None, None, reason))
                else:
                    self._result = JobResult(job.job_id, None, {}, 0.0, reason)
                if not self._restart():
                    return
                continue
            self._result = res

    def _went_down(self, reason: str) -> None:
        self.up = False
        self.down_reason = reason
        self.deaths += 1
        log.error("%s; the executing chunk runs out, then HOLD until a new worker is up", reason)

    def _restart(self) -> bool:
        """Start processes with backoff until one loads and warms up. False if closing first."""
        cause = self.down_reason or "inference worker down"
        delay = self.backoff_s
        t_down = time.monotonic()
        while True:
            self.restart_attempt += 1
            n = self.restart_attempt
            log.warning("inference worker: restart attempt %d in %.1f s", n, delay)
            if self._closing.wait(delay):
                return False
            try:
                info = self._spawn()
                if info != self.info:
                    raise RuntimeError(f"the restarted policy differs from the running one ({info} != {self.info})")
                for wj in self.warmup_jobs:
                    res = self._call(wj)
                    if res.error is not None:
                        raise RuntimeError(f"warm-up inference failed: {res.error}")
            except Exception as exc:
                if self._closing.is_set():
                    return False
                if self._proc is not None and self._proc.is_alive():
                    self._proc.kill()
                self.restart_failures += 1
                msg = str(exc) or type(exc).__name__
                self.down_reason = f"{cause}; restart attempt {n} failed: {msg}"
                delay = min(delay * 2, self.backoff_max_s)
                log.error("inference worker: restart attempt %d failed: %s", n, msg)
                continue
            # A job the daemon queued while the process was gone is answered, not run late; a
            # prompt check waits for the new process.
            checks = []
            while True:
                try:
                    stale = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if stale is None:
                    return False
                if isinstance(stale, _PromptCheck):
                    checks.append(stale)
                else:
                    self._result = JobResult(stale.job_id, None, {}, 0.0, f"{cause}; job dropped")
            for check in checks:
                self._jobs.put(check)
            self.restarts += 1
            self.restart_attempt = 0
            self.down_reason = None
            self.up = True
            log.warning(
                "inference worker: restarted (pid %d, attempt %d, %.1f s after it died); inference resumes",
                self._proc.pid, n, time.monotonic() - t_down,
            )
            return True


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
