"""The control daemon: one fixed-period loop that publishes an action every tick, whatever happens.

Per tick, on the clock thread (nothing here blocks or allocates much):
  1. wait for the slot's absolute deadline; skip (and count) slots missed by an overrun;
  2. read the newest camera frames and robot state; check their ages and the e-stop bit;
  3. collect a finished inference, if any, and let the chunk queue adopt it at the measured delay;
  4. start the next inference when s actions of the executing chunk have run (or at once when a
     new instruction arrived, task.py);
  5. pick the action (or a HOLD), clamp it, publish it with the next sequence number.
The policy runs in the worker (worker.py); the daemon neither waits for it nor knows its backend.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from phyai_edge.control.cameras import CameraSource, make_camera
from phyai_edge.control.clock import (
    LatenessLog,
    LateTicks,
    PeriodicClock,
    fifo_permitted,
    promote_threads,
    realtime_refused,
    setup_realtime,
)
from phyai_edge.control.config import ConfigError, DaemonConfig, check_against_policy, named_instructions
from phyai_edge.control.log import worth_logging
from phyai_edge.control.metrics import Metrics, listen_problem
from phyai_edge.control.notify import Notifier
from phyai_edge.control.protocol import Flag
from phyai_edge.control.publisher import ActionPublisher
from phyai_edge.control.rtc import SOLVER_MODES, ChunkQueue, DelayEstimator
from phyai_edge.control.safety import ActionGuard
from phyai_edge.control.state import StateSource, make_state
from phyai_edge.control.task import TaskChannel
from phyai_edge.control.worker import (
    Job,
    JobResult,
    PolicyInfo,
    PolicyLike,
    PolicySpec,
    ProcessWorker,
    ThreadWorker,
    make_warmup_job,
)
from phyai_edge.engines.bundle import bundle_precision  # torch-free: only JSON

log = logging.getLogger("phyai_edge.control")


@dataclass
class _Inflight:
    job: Job
    start_slot: int
    obs_time_s: float
    delay_estimate: int
    valid: bool = True  # False once inputs went stale: the result will be discarded
    instruction: int = 0  # the task channel's count of the instruction the job runs


# Inferences whose delay and times the summary and the status line keep (the lateness log keeps
# its last 2**18 ticks likewise).
STATS_WINDOW = 4096


@dataclass
class DaemonStats:
    ticks: int = 0
    published: int = 0
    missed_slots: int = 0
    inferences: int = 0
    adopted: int = 0
    failures: int = 0
    nonfinite_chunks: int = 0
    stale_results: int = 0  # results that arrived too late to use (delay >= H) or after a reset
    worker_deaths: int = 0  # inference worker processes that died
    worker_restarts: int = 0  # ... and were replaced by a loaded, warmed one
    worker_restart_failures: int = 0
    # The last STATS_WINDOW inferences only: lists appended per inference grew for the life of the
    # daemon (~340 B an inference with PI0.5's seven stages: ~58 MB a day at 50 Hz, s = 25;
    # `benchmarks/daemon_resources.py --collect 172800`).
    delays: deque[int] = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    infer_ms: deque[float] = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    stage_ms: dict[str, deque[float]] = field(default_factory=dict)
    holds: dict[str, int] = field(default_factory=dict)
    lateness: LatenessLog = field(default_factory=lambda: LatenessLog(1 << 18))
    wake_lateness: LatenessLog = field(default_factory=lambda: LatenessLog(1 << 18))
    stop_to_final_ms: float = float("nan")

    def hold(self, reason: str) -> None:
        self.holds[reason] = self.holds.get(reason, 0) + 1


def policy_spec_from_config(cfg: DaemonConfig) -> PolicySpec:
    m = cfg.model
    if m.factory:
        return PolicySpec(m.factory, dict(m.factory_args), m.threads)
    if m.bundle:
        # What load_policy(bundle=...) calls; a checkpoint given too is compared with the bundle's.
        kwargs = {"bundle": m.bundle, "device": m.device, "checkpoint": m.checkpoint or None}
        return PolicySpec("phyai_edge.engines.policy:load_bundle_policy", kwargs, m.threads)
    kwargs = {
        "adapter": m.adapter,
        "checkpoint": m.checkpoint or None,
        "preset": m.preset,
        "backend": m.backend,
        "device": m.device,
        "dtype": m.dtype,
        "bundle": m.bundle or None,
        "tokenizer": m.tokenizer or None,
        "adapter_options": dict(m.adapter_options) or None,
        "engine_options": dict(m.engine_options) or None,
    }
    return PolicySpec("phyai_edge.engines.policy:load_policy", kwargs, m.threads)


def recorded_model(cfg: DaemonConfig) -> dict[str, Any]:
    """What a recording says of the model that made its chunks (meta.json's `model`)."""
    m = cfg.model

    def path(p: str) -> str:
        return str(Path(p).expanduser().resolve()) if p else ""

    rec = {"adapter": m.adapter, "checkpoint": path(m.checkpoint), "tokenizer": path(m.tokenizer),
           "bundle": path(m.bundle), "preset": m.preset, "adapter_options": dict(m.adapter_options),
           "factory": m.factory, "backend": m.backend, "device": m.device, "dtype": m.dtype}
    if m.bundle:
        # A bundle's engine, dtype and precision are its manifest's, not the config's defaults
        # (an int8 ONNX bundle's recording said eager float32).
        manifest = _bundle_manifest(m.bundle)
        rec.update({k: manifest[k] for k in ("backend", "dtype") if isinstance(manifest.get(k), str)})
        if precision := bundle_precision(manifest):
            rec["precision"] = precision
    return rec


def warmup_inferences_per_round(mode: str) -> int:
    """A warm-up round (`Daemon.setup`): a chunk without RTC and, in a solver RTC mode, one with it."""
    return 2 if mode in SOLVER_MODES else 1


def warmup_rounds(cfg: DaemonConfig) -> int:
    """The warm-up rounds `Daemon.setup` runs: `model.warmup`, and where the delay is estimated
    (`chunking.delay` 0) from a single one, a second to time. The first round of a fresh engine
    compiles kernels and captures graphs (8.8 s for the full-size cudagraph engine on an H200,
    against 16 ms a chunk after it), so it says nothing of what a chunk will cost."""
    extra = cfg.model.warmup == 1 and not cfg.chunking.delay
    return cfg.model.warmup + int(extra)


def warmup_frames(cfg: DaemonConfig, camera_names: Sequence[str]) -> dict[str, tuple[int, int] | None] | None:
    """(height, width) of the frames the policy gets from the camera feeding each policy camera as
    configured (after its crop and rotation), None for a policy camera no source feeds (masked in
    every live job); None where no policy camera has a source (`make_warmup_job` then gives them
    all blank frames)."""
    by_view = {c.view_name: c.geometry.output_size(c.height, c.width) if c.geometry else (c.height, c.width)
               for c in cfg.cameras.values()}
    frames = {n: by_view.get(n) for n in camera_names}
    return frames if any(v is not None for v in frames.values()) else None


_MODEL_KEYS = ("adapter", "preset", "backend", "device", "dtype")


def model_info_labels(cfg: DaemonConfig, info: PolicyInfo) -> dict[str, str]:
    """The labels of `phyai_model_info`: which model this daemon runs, as far as it knows without
    torch. Adapter, preset, backend, device and dtype are the config's `model` section, but where
    it does not decide them: with `model.factory`, the factory's keyword arguments of those names;
    with `model.bundle`, the bundle's manifest.json (plain JSON, as the config check reads it) for
    all but the device, and precision ("fp8", "int8") where its weights are quantised. Views (the
    cameras the model runs: the policy's, less those no source feeds where the policy leaves them
    out, `PolicyInfo.drops_cameras`; otherwise it runs them masked), steps (its solver's, when it
    says) and gpu (the GPU's name, which the worker asked torch for) come from the loaded policy;
    horizon is the H the daemon runs, `chunking.horizon` (the policy's chunk size unless set
    lower). The robot side the roofline needs besides H comes from the config: rate_hz
    (`robot.control_hz`) and exec_horizon (`chunking.execution_horizon`, the s of d <= s <= H - d,
    which every RTC mode keeps, so the mode is not a label). A label not known is left out."""
    m = cfg.model
    named: dict[str, Any]
    if m.factory:
        named = {k: m.factory_args.get(k) for k in _MODEL_KEYS}
    elif m.bundle:
        manifest = _bundle_manifest(m.bundle)
        adapter = manifest.get("adapter")
        adapter = adapter if isinstance(adapter, dict) else {}
        named = {"adapter": adapter.get("name"), "preset": adapter.get("preset"), "backend": manifest.get("backend"),
                 "device": m.device, "dtype": manifest.get("dtype"), "precision": bundle_precision(manifest),
                 "bundle": m.bundle}
    else:
        named = {k: getattr(m, k) for k in _MODEL_KEYS}
    labels = {k: v for k, v in named.items() if isinstance(v, str) and v}
    if info.device_name:
        labels["gpu"] = info.device_name
    views = len(info.camera_names)
    if info.drops_cameras:  # policy cameras with no source are left out of the model, not run masked
        frames = warmup_frames(cfg, info.camera_names)
        views -= sum(v is None for v in (frames or {}).values())
    labels["views"] = str(views)
    # H as the roofline means it: the actions of a chunk the daemon executes from (RTC's d <= s <= H - d).
    labels["horizon"] = str(cfg.chunking.horizon or info.chunk_size)
    if info.steps:
        labels["steps"] = str(info.steps)
    # Named as the roofline's bench documents name them (`phyai-edge sim --report` writes rate_hz).
    labels["rate_hz"] = _number(cfg.robot.control_hz)
    labels["exec_horizon"] = str(cfg.chunking.execution_horizon)
    return labels


def _number(value: float) -> str:
    """A label value for a number: "50" for 50.0, all of its digits where %g would round it."""
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))


def _bundle_manifest(bundle: str) -> dict[str, Any]:
    """An engine bundle's manifest.json; {} when it cannot be read (the labels it gives are left out)."""
    try:
        data = json.loads((Path(bundle) / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


_T = TypeVar("_T")
# An instruction's check waits for the inference in flight (one chunk) and a tokenizer pass.
TASK_CHECK_TIMEOUT_S = 5.0


class StartupInterruptedError(Exception):
    """`stop` (SIGTERM, SIGINT) arrived while `setup` was loading or warming up the policy."""


class Daemon:
    def __init__(
        self,
        cfg: DaemonConfig,
        *,
        policy: PolicyLike | None = None,
        cameras: dict[str, CameraSource] | None = None,
        state: StateSource | None = None,
        record_dir: str | None = None,
        record_min_free_gb: float = 0.0,
        realtime: bool = True,
        status_line: bool | None = None,
        notifier: Notifier | None = None,
        context: Any = None,
    ) -> None:
        self.cfg = cfg
        self._policy = policy
        self._cameras_override = cameras
        self._state_override = state
        self.record_dir = record_dir
        self.record_min_free_gb = record_min_free_gb
        self.realtime = realtime
        self.status_line_wanted = status_line
        self.notifier = notifier or Notifier()
        import zmq

        # Our own context, terminated at shutdown: term() is what waits (up to the linger) for the
        # final HOLD to leave the socket before the process exits.
        self._own_context = context is None
        self.context = context if context is not None else zmq.Context()
        if self._own_context and realtime and fifo_permitted(cfg.clock.priority):
            # ZeroMQ's I/O thread is what really writes our messages to the socket: it must not
            # wait behind inference for a CPU. libzmq applies this when it starts the thread
            # (first socket); we only ask when the probe shows SCHED_FIFO is allowed, because
            # libzmq aborts if setting it fails.
            self.context.set(zmq.THREAD_SCHED_POLICY, os.SCHED_FIFO)
            self.context.set(zmq.THREAD_PRIORITY, cfg.clock.priority)
        self.stats = DaemonStats()
        self.metrics = Metrics()
        self._stop = threading.Event()
        self._stop_requested_ns = 0
        self._started = threading.Event()
        self._wakeup_fd: int | None = None
        self.info: PolicyInfo | None = None
        self.worker: Any = None
        self.cameras: dict[str, CameraSource] = {}
        self.state: StateSource | None = None
        self.publisher: ActionPublisher | None = None
        self.recorder: Any = None
        self.task: TaskChannel | None = None
        # Policy camera -> its crop / rotation / mirror (applied in the worker), for the cameras that have one.
        self.geometry = {c.view_name: c.geometry for c in cfg.cameras.values() if c.geometry is not None}
        self._job_changes = 0  # the instruction count (`TaskChannel.changes`) of the last job started
        self._holds_seen = 0  # the operator holds (`TaskChannel.holds`) the clock has acted on
        self._holds_logged: dict[str, int] = {}  # holds that dropped a chunk, by reason (`worth_logging`)
        self._status: Any = None
        self.late_ticks = LateTicks(round(cfg.clock.late_limit_s(cfg.robot.period_s) * 1e9))

    # ------------------------------------------------------------ setup

    def setup(self) -> None:
        cfg = self.cfg
        t0 = time.monotonic()
        p = cfg.publish
        # Bound before the model loads: an endpoint already in use then fails in a second, not after
        # minutes of loading and warming (nothing is published until the clock runs).
        self.publisher = _zmq_opened(
            "publish.endpoint", lambda: ActionPublisher(p.endpoint, p.topic, p.chunk_topic, p.bind, p.sndhwm, self.context),
            p.endpoint if p.bind else None,
        )
        # Likewise the metrics endpoint (it starts once the policy says which model runs): taken
        # by another daemon, Prometheus would go on scraping that one and describe it as this one.
        if cfg.metrics.port and (problem := listen_problem(cfg.metrics.host, cfg.metrics.port)):
            raise ConfigError(f"metrics.port: {problem}")
        if self._policy is not None:
            self.worker = ThreadWorker(policy=self._policy)
        elif cfg.model.worker == "thread":
            self.worker = ThreadWorker(spec=policy_spec_from_config(cfg))
        else:
            self.worker = ProcessWorker(policy_spec_from_config(cfg), cfg.model.restart_backoff_s,
                                        cfg.model.restart_backoff_max_s, cfg.model.inference_timeout_s)
        info = self._unless_stopped(lambda: self.worker.start(cfg.model.load_timeout_s))
        self.info = info
        log.info(
            "policy: %s, H=%d, %d actions, %d state values, cameras %s (%s worker, loaded in %.1f s)",
            info.description, info.chunk_size, info.action_dim, info.state_dim, ", ".join(info.camera_names),
            type(self.worker).__name__.replace("Worker", "").lower(), time.monotonic() - t0,
        )
        if cfg.model.bundle and not cfg.model.factory:
            log.info("model: engine bundle %s (backend, preset and dtype from its manifest)", cfg.model.bundle)
        check_against_policy(cfg, info.chunk_size, info.action_dim, info.state_dim, info.camera_names)
        missing = [n for n in info.camera_names if n not in {c.view_name for c in cfg.cameras.values()}]
        if missing:
            log.info("policy cameras with no source (masked out): %s", ", ".join(missing))

        ch = cfg.chunking
        self.delays = DelayEstimator(ch.delay, ch.delay_initial, ch.delay_window)
        self.queue = ChunkQueue(ch.mode, ch.horizon, ch.execution_horizon, ch.crossfade_steps, self.delays)
        self.guard = ActionGuard(info.action_dim, cfg.robot.limits, cfg.robot.period_s, cfg.safety.hold)

        # Each warm-up round runs a chunk as the first one goes (no executing chunk, no RTC) and, in a
        # solver RTC mode, one as every later one goes: an engine that captures a graph per RTC mode
        # (cudagraph) would otherwise capture the second on the second chunk, inside the control loop.
        # Its frames are the cameras' configured sizes, and missing where a policy camera has no
        # source, as the live jobs' will be.
        frames = warmup_frames(cfg, info.camera_names)
        rounds = [make_warmup_job(info, cfg.model.prompt, frames=frames)]
        if warmup_inferences_per_round(ch.mode) == 2:
            rounds.append(make_warmup_job(info, cfg.model.prompt, rtc_mode=ch.mode,
                                          execution_horizon=ch.execution_horizon, delay=ch.delay or ch.delay_initial,
                                          max_guidance_weight=ch.max_guidance_weight, frames=frames))
        # Keyed noise as every live job draws it (a host tensor copied in, not the engine's draw).
        rounds = [replace(job, noise_seed=cfg.model.noise_seed) for job in rounds]
        if cfg.task.endpoint:
            # Room for the instructions that may come at run time: the graphs captured now serve them.
            rounds = [replace(job, room_prompts=cfg.task.prompts, room_tokens=cfg.task.prompt_tokens) for job in rounds]
        n_rounds = warmup_rounds(cfg)
        for i in range(n_rounds):
            took = []
            for job in rounds:
                res = self._unless_stopped(lambda job=job: self.worker.run_sync(job))
                if res.error:
                    raise RuntimeError(f"warm-up inference failed (RTC {job.rtc_mode}): {res.error}")
                took.append(res.infer_ms)
            log.info("warm-up inference %d: %s", i + 1, ", ".join(
                f"{ms:.1f} ms ({'no RTC' if job.prefix is None else job.rtc_mode})" for job, ms in zip(rounds, took)))
            if i == n_rounds - 1 and i > 0 and not ch.delay:
                # Start the delay estimate from what inference really costs here (the slower mode:
                # exact guidance runs a backward pass too; not the first round, which captured), plus
                # a slot of margin.
                self.delays.initial = max(ch.delay_initial, math.ceil(max(took) / 1e3 / cfg.robot.period_s) + 1)
                log.info("delay: the first chunks assume %d slots (from %.1f ms an inference, one slot of margin, "
                         "chunking.delay_initial %d at least) until delays are measured",
                         self.delays.initial, max(took), ch.delay_initial)
        # A restarted worker process runs these before it counts as up (at least one round: it proves
        # the new process can infer before the daemon relies on it).
        self.worker.warmup_jobs = rounds * max(1, cfg.model.warmup)
        self._check_instructions()
        if ch.execution_horizon < self.delays.estimate():
            log.warning(
                "chunking.execution_horizon (%d) is below the expected delay (%d slots): inference will "
                "run back to back", ch.execution_horizon, self.delays.estimate()
            )

        self.cameras = self._cameras_override if self._cameras_override is not None else {
            name: make_camera(c, self.context) for name, c in cfg.cameras.items()
        }
        for name, cam in self.cameras.items():
            _zmq_opened(f"cameras.{name}.endpoint", cam.start)
            log.info("camera %s -> %s: %s", name, cfg.cameras[name].view_name if name in cfg.cameras else name, cam.describe())
        self.state = self._state_override or make_state(cfg.state, info.state_dim, self.context)
        _zmq_opened("state.endpoint", self.state.start)
        log.info("state: %s", self.state.describe())
        log.info(
            "publishing on %s (topic %r%s), %g Hz, RTC %s (H=%d, s=%d)",
            self.publisher.endpoint, p.topic, f", chunks on {p.chunk_topic!r}" if p.chunk_topic else "",
            cfg.robot.control_hz, ch.mode, ch.horizon, ch.execution_horizon,
        )
        worker = self.worker
        if cfg.metrics.port:
            # A ThreadWorker's model lives in this process: its memory is in process_* already.
            worker_pid = (lambda: worker.pid) if isinstance(worker, ProcessWorker) else None
            if not self.metrics.serve(cfg.metrics.host, cfg.metrics.port, model_info_labels(cfg, info), worker_pid):
                raise ConfigError(f"metrics.port: could not listen on {cfg.metrics.host}:{cfg.metrics.port} "
                                  "(the line above says why)")
        if cfg.task.endpoint:
            self.task = TaskChannel(cfg.task, cfg.model.prompt, lambda prompt: worker.check_prompt(prompt, TASK_CHECK_TIMEOUT_S),
                                    self.context, self.metrics)
            _zmq_opened("task.endpoint", self.task.start, cfg.task.endpoint if cfg.task.bind else None)
            log.info("task: instructions taken at run time, %s", self.task.describe())
        if self.record_dir:
            from phyai_edge.control.recorder import Recorder

            meta = {
                "config": cfg.source,
                "policy": info.__dict__,
                "cameras": {n: c.view_name for n, c in cfg.cameras.items()},
                "control_hz": cfg.robot.control_hz,
                "rtc_mode": ch.mode,
                "horizon": ch.horizon,
                "execution_horizon": ch.execution_horizon,
                "max_guidance_weight": ch.max_guidance_weight,  # beta: what `phyai-edge eval` replays with
                # each obs file says the seed its chunk's noise came from (null: the engine's stream)
                "noise_seed": cfg.model.noise_seed,
                # How the policy ran them, for a replay to run them alike (`phyai-edge eval`): the
                # cameras no source feeds (left out where the policy can) and the prompt room kept
                # at warm-up (the prompt length every chunk ran; bf16 results depend on it).
                "absent_cameras": missing,
                "prompt_room": {"prompts": [cfg.model.prompt, *cfg.task.prompts], "tokens": cfg.task.prompt_tokens},
                # Which model made the chunks (`phyai-edge eval` replays through it unless told
                # otherwise), its paths made absolute: the daemon's working directory is not eval's.
                "model": recorded_model(cfg),
            }
            self.recorder = Recorder(self.record_dir, meta, min_free_bytes=round(self.record_min_free_gb * 1e9),
                                     counter=self.metrics.records)
            log.info("recording observations to %s (each chunk's noise from model.noise_seed %d and its inference "
                     "number: `phyai-edge eval %s` replays them)", self.record_dir, cfg.model.noise_seed, self.record_dir)

    def _check_instructions(self) -> None:
        """Every instruction the config names must run as the policy was warmed up: one the model
        would truncate is a configuration error here, not a robot doing something else later."""
        cfg = self.cfg
        room = None
        for key, prompt in named_instructions(cfg):
            fit = self._unless_stopped(lambda prompt=prompt: self.worker.check_prompt(prompt, cfg.model.load_timeout_s))
            if fit.error is not None:
                raise RuntimeError(f"{key}: the instruction could not be checked: {fit.error}")
            if not fit.fits:
                raise ConfigError(f"{key}: {fit.problem().removeprefix('the instruction ')}")
            room = fit.room
        if cfg.task.endpoint and room is not None and cfg.task.prompt_tokens > room:
            raise ConfigError(f"task.prompt_tokens: {cfg.task.prompt_tokens} is more than the policy takes ({room})")

    # ------------------------------------------------------------ control

    def stop(self) -> None:
        """Thread-safe and signal-safe: the next tick publishes HOLD | SHUTDOWN and the loop ends.
        Before the clock has started (loading, warm-up: minutes at full size) it also closes the
        worker, which ends the wait in `setup` at once: systemd's stop must not wait out a load."""
        if not self._stop.is_set():
            self._stop_requested_ns = time.monotonic_ns()
        self._stop.set()
        if not self._started.is_set() and self.worker is not None:
            self.worker.close()

    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: Any) -> None:
            self.stop()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        # The C-level handler writes a byte here; the clock's select() wakes on it at once.
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._wakeup_fd = r

    def wait_started(self, timeout: float | None = None) -> bool:
        return self._started.wait(timeout)

    def run(self, duration_s: float | None = None, max_ticks: int | None = None) -> DaemonStats:
        if self.publisher is None:
            self.setup()
        cfg = self.cfg
        old_switch = sys.getswitchinterval()
        # A short GIL switch interval bounds how long a helper thread can keep the clock waiting.
        sys.setswitchinterval(cfg.clock.switch_interval_us / 1e6)
        if self.realtime:
            for line in setup_realtime(cfg.clock.priority, cfg.clock.cpus, cfg.clock.mlock):
                # a loop that is not real-time is the operator's to fix: shown by `journalctl -p warning`
                (log.warning if realtime_refused(line) else log.info)(line)
            if cfg.clock.priority > 1 and fifo_permitted(cfg.clock.priority):
                helpers = promote_threads(("inference-client", "camera-"), max(1, cfg.clock.priority - 10))
                if helpers:
                    log.info("helper threads %s: SCHED_FIFO priority %d", ", ".join(helpers), max(1, cfg.clock.priority - 10))
        if self.status_line_wanted or (self.status_line_wanted is None and _status_line_default()):
            from phyai_edge.control.log import _StatusAwareHandler
            from phyai_edge.control.status import StatusLine

            _StatusAwareHandler.clear_line = True  # log lines first erase the status line
            self._status = StatusLine(self.render_status)
            self._status.start()
        # Move everything allocated during start-up out of the collector's reach: a full
        # collection walking it would otherwise land in some tick as a multi-millisecond stall.
        gc.collect()
        gc.freeze()
        clock = PeriodicClock(cfg.robot.period_s, cfg.clock.spin_us / 1e6)
        self.clock = clock
        clock.start()
        end_ns = clock.start_ns + round(duration_s * 1e9) if duration_s else None
        self.notifier.ready(f"publishing at {cfg.robot.control_hz:g} Hz on {self.publisher.endpoint}")
        self._started.set()
        log.info("running")
        try:
            self._loop(clock, end_ns, max_ticks)
        finally:
            sys.setswitchinterval(old_switch)
            self.shutdown()
        return self.stats

    def _loop(self, clock: PeriodicClock, end_ns: int | None, max_ticks: int | None) -> None:
        cfg, st, pub, guard, q = self.cfg, self.stats, self.publisher, self.guard, self.queue
        assert pub is not None and self.state is not None
        state_age = cfg.safety.state_max_age_ms / 1000.0
        cam_ages = {name: cfg.camera_max_age_s(cfg.cameras[name]) if name in cfg.cameras else cfg.safety.camera_max_age_ms / 1000
                    for name in self.cameras}
        required = {name: cfg.cameras[name].required if name in cfg.cameras else True for name in self.cameras}
        views = {name: cfg.cameras[name].view_name if name in cfg.cameras else name for name in self.cameras}
        inflight: _Inflight | None = None
        infer_failed = False
        adopted_now = False
        next_job_id = 1
        last_watchdog_ns = 0
        watchdog_missed = 0
        last_status_ns = 0
        wd_ns = round(self.notifier.watchdog_interval_s * 1e9)
        m = self.metrics
        worker = self.worker
        seen = _WorkerSeen()
        worker_hold_logged = False
        blocked_before = False  # the last tick held for stale inputs, an e-stop or an operator
        starved_before = False  # the last tick held because the executing chunk had run out
        # When the last policy (not HOLD) action went out, monotonic s; before the first, when
        # publishing began: a daemon that never acts (stale inputs, held from the start, no worker)
        # must show its time without one growing, not 0.
        last_policy_s = clock.start_ns / 1e9
        late_ticks = self.late_ticks

        while True:
            tick = clock.wait(self._wakeup_fd)
            if tick.interrupted and not self._stop.is_set():
                continue  # a signal that is not a stop request (or its handler has not run yet)
            now_s = tick.wake_ns / 1e9
            flags = 0
            was_starved, starved_before = starved_before, False
            stop = self._stop.is_set() or (end_ns is not None and tick.wake_ns >= end_ns) or (
                max_ticks is not None and st.ticks >= max_ticks
            )
            if tick.slots_advanced > 1:
                missed = tick.slots_advanced - 1
                st.missed_slots += missed
                m.missed_ticks.inc(missed)
                q.skip(missed)
                flags |= Flag.LATE

            sample = self.state.latest()
            state_values = sample.values if sample is not None else None

            if stop:
                # The same rule as every hold: a state older than its limit is not where the robot is.
                state_fresh = sample is not None and now_s - sample.time_s <= state_age
                payload, extra = guard.finalize(guard.hold_target(state_values if state_fresh else None))
                pub.publish(payload, flags | extra | Flag.HOLD | Flag.SHUTDOWN, 0.0, 0, 0)
                st.published += 1
                self._count_hold("shutdown")
                if self._stop_requested_ns:
                    st.stop_to_final_ms = (time.monotonic_ns() - self._stop_requested_ns) / 1e6
                break

            # -- inputs and their ages
            frames = {}
            stale: list[str] = []
            for name, cam in self.cameras.items():
                fr = cam.latest()
                if fr is None or now_s - fr.capture_s > cam_ages[name]:
                    if required[name]:
                        stale.append(f"camera {name}")
                    fr = None
                frames[views[name]] = fr
            if self.cameras and not stale and all(fr is None for fr in frames.values()):
                stale.append("every camera")  # all optional, all silent: the policy would run blind
            if sample is None or now_s - sample.time_s > state_age:
                stale.append("state")
            estop = sample is not None and sample.estop
            # An operator's hold (task.py), also one released before this tick read it: each hold
            # taken holds at least one tick, dropping the executing chunk, as the operator was told.
            paused = False
            if self.task is not None:
                holds = self.task.holds
                paused = self.task.holding or holds != self._holds_seen
                self._holds_seen = holds

            # -- the worker's health (a dead worker process is restarted by its client thread)
            worker_up = worker.up
            if (worker_up, worker.restart_attempt, worker.deaths) != seen.key:
                self._worker_changed(seen, worker_up)
                worker_hold_logged = worker_hold_logged and not worker_up
            if not worker_up:
                flags |= Flag.WORKER_DOWN

            # -- a finished inference
            started_job = new_task = False  # what this tick did, for a late tick's log line
            res = self.worker.poll()
            if res is not None:
                assert inflight is not None
                if stale or estop or paused:
                    inflight.valid = False  # this tick holds and drops the executing chunk: never adopt one now
                infer_failed = self._collect(res, inflight, tick.slot, infer_failed)
                adopted_now = q.current is not None and q.current.chunk_id == inflight.job.job_id and q.current.index == tick.slot - inflight.start_slot
                inflight = None

            started = None  # the chunk whose first action this tick publishes
            instruction = 0  # the chunk's instruction (task.py's count); 0 for HOLD
            if stale or estop or paused:
                # Do not act on old inputs (nor while an operator holds the robot): hold, forget the
                # executing chunk (its timing no longer matches the robot), and drop whatever is in
                # flight. Recovery starts a fresh chunk.
                reason = "estop" if estop else "stale" if stale else "paused"  # the first, for logs and counts
                # Every reason that holds goes out, so a controller can tell an e-stop from a state
                # stream that has died since (ESTOP | STALE).
                flags |= (Flag.HOLD | (Flag.ESTOP if estop else 0) | (Flag.STALE if stale else 0)
                          | (Flag.PAUSED if paused else 0))
                # Logged where it stops the policy, and where a hold begins before any chunk ran (a
                # state or camera stream that never arrives at start-up held silently).
                # One count an episode: an inference this hold already dropped stays in flight
                # until it returns, and counted every tick (ten "holds" for one operator hold).
                if q.current is not None or (inflight is not None and inflight.valid) or not blocked_before:
                    # Inputs that flap (a state stream just slower than its age limit) would log this
                    # on every recovery: the 1st, 10th, 100th, ... such hold (the metrics count each).
                    self._holds_logged[reason] = n = self._holds_logged.get(reason, 0) + 1
                    if worth_logging(n):
                        why = (", ".join(self._staleness(stale, sample, now_s))
                               or ("e-stop from the state stream" if estop else "the task channel"))
                        log.warning("HOLD: %s (%s)%s", reason, why, f"; {n} such holds so far" if n > 1 else "")
                q.reset()
                if inflight is not None:
                    inflight.valid = False
                # A stale state is not where the robot is now: hold at the last action instead.
                payload = guard.hold_target(None if "state" in stale else state_values)
                obs_t, chunk_id, index = 0.0, 0, 0
                self._count_hold(reason)
                blocked_before = True
            else:
                blocked_before = False
                # A new instruction starts a chunk at once rather than after s actions: RTC joins it
                # to the executing chunk's remaining actions as it joins any other.
                new_task = self.task is not None and self.task.changes != self._job_changes
                if inflight is None and worker_up and not self.worker.busy and (q.wants_inference() or new_task):
                    assert sample is not None
                    inflight = self._start_inference(next_job_id, tick.slot, frames, sample, now_s)
                    next_job_id += 1
                    started_job = True
                nxt = q.next_action()
                if nxt is None:
                    reason = "starved" if q.current is not None else "warmup"
                    flags |= Flag.HOLD | (Flag.STARVED if q.current is not None else Flag.WARMUP)
                    if not worker_up:
                        reason = "worker_down"
                        if not worker_hold_logged:
                            log.error("HOLD: the executing chunk ran out and the %s", worker.down_reason or "inference worker is down")
                            worker_hold_logged = True
                    elif reason == "starved" and not was_starved:
                        # A slow or hung inference: the robot holds from here until it returns or
                        # model.inference_timeout_s ends it; said when it begins, not only in metrics.
                        self._holds_logged["starved"] = n = self._holds_logged.get("starved", 0) + 1
                        if worth_logging(n):
                            waited = (f"; the inference in flight started {tick.slot - inflight.start_slot} ticks ago"
                                      if inflight is not None else "")
                            log.warning("HOLD: starved: the executing chunk ran out before the next one arrived%s%s",
                                        waited, f"; {n} such holds so far" if n > 1 else "")
                    starved_before = reason == "starved"
                    payload = guard.hold_target(state_values)
                    obs_t, chunk_id, index = 0.0, 0, 0
                    self._count_hold(reason)
                else:
                    payload, chunk = nxt
                    obs_t, chunk_id, index = chunk.obs_time_s, chunk.chunk_id, chunk.index - 1
                    instruction = chunk.instruction
                    if adopted_now:
                        flags |= Flag.CHUNK_START
                        started = chunk
            adopted_now = False
            if infer_failed:
                flags |= Flag.INFER_FAIL

            out, extra = guard.finalize(payload)
            if extra & Flag.NONFINITE:
                self._count_hold("nonfinite")
                m.nonfinite.inc()
            for limit in guard.last_clamps:
                m.clamped.labels(limit).inc()
            header = pub.publish(out, flags | extra, obs_t, chunk_id, index, instruction)
            if started is not None:
                # Right after its CHUNK_START action (protocol.md): row 0 is the action just sent.
                pub.publish_chunk(started.actions, index, header.seq, obs_t, chunk_id, instruction=instruction)
            st.published += 1
            st.ticks += 1
            late = header.publish_mono_ns - tick.deadline_ns
            st.lateness.add(late)
            missed_ns = (tick.slots_advanced - 1) * clock.period_ns  # a stall of whole periods: late too
            if late > late_ticks.limit_ns or missed_ns:
                m.late_ticks.inc()
                line = late_ticks.note(tick, header.publish_mono_ns,
                                       _tick_work(res is not None, started_job, new_task, started is not None, flags, tick),
                                       missed_ns)
                if line is not None:
                    log.warning(line)
            st.wake_lateness.add(tick.lateness_ns)
            m.tick_lateness.observe(late / 1e9)
            m.seq.set(header.seq)
            m.published.inc()
            sent_s = header.publish_mono_ns / 1e9
            if not header.flags & Flag.HOLD and obs_t > 0:
                last_policy_s = sent_s
                m.action_obs_age.set(sent_s - obs_t)
            m.since_policy_action.set(sent_s - last_policy_s)

            # -- service duties, rate-limited so they cost nothing most ticks
            if wd_ns and tick.wake_ns - last_watchdog_ns >= wd_ns:
                # Ping only while the clock keeps its deadlines: a stalled or overrunning loop
                # lets systemd's watchdog restart the service.
                if clock.missed == watchdog_missed:
                    self.notifier.watchdog()
                watchdog_missed = clock.missed
                last_watchdog_ns = tick.wake_ns
            if self.notifier.enabled and tick.wake_ns - last_status_ns >= 5 * 10**9:
                self.notifier.status(self.render_status())
                last_status_ns = tick.wake_ns

    def _worker_changed(self, seen: _WorkerSeen, up: bool) -> None:
        """Worker health moved (died, a restart attempt, back up): count it, and tell systemd now."""
        st, m, w = self.stats, self.metrics, self.worker
        if w.deaths > seen.deaths:
            m.worker_deaths.inc(w.deaths - seen.deaths)
        if w.restarts > seen.restarts:
            m.worker_restarts.labels("ok").inc(w.restarts - seen.restarts)
        if w.restart_failures > seen.failures:
            m.worker_restarts.labels("failed").inc(w.restart_failures - seen.failures)
        st.worker_deaths, st.worker_restarts, st.worker_restart_failures = w.deaths, w.restarts, w.restart_failures
        seen.deaths, seen.restarts, seen.failures = w.deaths, w.restarts, w.restart_failures
        seen.key = (up, w.restart_attempt, w.deaths)
        m.worker_up.set(1 if up else 0)
        if self.notifier.enabled:
            self.notifier.status(self.render_status())

    def _start_inference(self, job_id: int, slot: int, frames: dict[str, Any], sample: Any, now_s: float) -> _Inflight:
        assert self.info is not None
        cfg, q = self.cfg, self.queue
        plan = q.plan(slot)
        images = {name: (frames[name].image if frames.get(name) is not None else None) for name in self.info.camera_names}
        bgr = {name: frames[name].bgr for name in self.info.camera_names if frames.get(name) is not None}
        times = [fr.capture_s for fr in frames.values() if fr is not None] + [sample.time_s]
        obs_time = min(times)
        mode = cfg.chunking.mode
        prompt = cfg.model.prompt
        if self.task is not None:
            self._job_changes, prompt = self.task.current
        job = Job(
            job_id=job_id,
            images=images,
            bgr=bgr,
            state=sample.values,
            prompt=prompt,
            timestamp=obs_time,
            rtc_mode=mode,
            # as the limits will publish them: RTC continues what the robot is really commanded
            prefix=self.guard.preview(plan.prefix) if mode in SOLVER_MODES and plan.prefix is not None else None,
            delay=plan.delay,
            execution_horizon=cfg.chunking.execution_horizon,
            max_guidance_weight=cfg.chunking.max_guidance_weight,
            geometry=self.geometry,
            noise_seed=cfg.model.noise_seed,
        )
        self.worker.submit(job)
        self.stats.inferences += 1
        return _Inflight(job, slot, obs_time, plan.delay, instruction=self._job_changes)

    def _collect(self, res: JobResult, inflight: _Inflight, slot: int, infer_failed: bool) -> bool:
        """Adopt a finished chunk (or note the failure). Returns the new INFER_FAIL state."""
        st, m = self.stats, self.metrics
        delay = slot - inflight.start_slot
        # A chunk that does not fit the robot is a failed inference: adopting it would put rows of
        # the wrong width on the chunk topic and leave the guard replacing every action.
        error = res.error if res.error is not None else self._chunk_shape_error(res.actions)
        if self.recorder is not None:
            job = inflight.job
            self.recorder.add({
                "job_id": job.job_id, "images": job.images, "bgr": job.bgr, "geometry": job.geometry, "state": job.state,
                "timestamp": job.timestamp, "prompt": job.prompt, "rtc_mode": job.rtc_mode,
                "prefix": job.prefix, "delay_estimate": job.delay, "start_slot": inflight.start_slot,
                "actions": res.actions, "delay": delay, "error": error or "", "noise_seed": res.noise_seed,
            })
        if error is not None:
            st.failures += 1
            m.inference_failures.inc()
            if not infer_failed or st.failures % 100 == 0:
                log.error("inference failed (%d so far): %s; running out the current chunk", st.failures, error)
            return True
        assert res.actions is not None
        st.infer_ms.append(res.infer_ms)
        m.inference_seconds.observe(res.infer_ms / 1e3)
        for stage, ms in res.stage_ms.items():
            window = st.stage_ms.get(stage)
            if window is None:
                window = st.stage_ms[stage] = deque(maxlen=STATS_WINDOW)
            window.append(ms)
            m.stage_seconds.labels(stage).observe(ms / 1e3)
        if not inflight.valid:
            st.stale_results += 1
            return infer_failed
        if not np.isfinite(res.actions).all():
            st.nonfinite_chunks += 1
            st.failures += 1
            m.inference_failures.inc()  # phyai_nonfinite_actions is for the guard acting, not for this
            log.error("inference returned non-finite actions; chunk rejected")
            return True
        taken = self.queue.adopt(res.actions, inflight.job.job_id, inflight.start_slot, slot, inflight.obs_time_s,
                                 inflight.instruction)
        st.delays.append(delay)
        if taken is None:
            st.stale_results += 1
            log.warning("chunk arrived after %d slots, longer than the horizon; dropped", delay)
            return infer_failed
        m.rtc_delay.set(delay)  # the gauge is the last adopted chunk's d
        st.adopted += 1
        if infer_failed:
            log.info("inference recovered")
        return False

    def _staleness(self, stale: list[str], sample: Any, now_s: float) -> list[str]:
        """Each stale input with its age, or that nothing has come yet (the usual first-robot
        mistake: an endpoint no sender publishes on), for the HOLD log line."""
        out = []
        for item in stale:
            if item == "state":
                out.append("state: nothing received yet" if sample is None
                           else f"state: last sample {now_s - sample.time_s:.2f} s old")
            elif item.startswith("camera ") and item[7:] in self.cameras:
                fr = self.cameras[item[7:]].latest()
                out.append(f"{item}: no frame yet" if fr is None else f"{item}: last frame {now_s - fr.capture_s:.2f} s old")
            else:
                out.append(item)
        return out

    def _count_hold(self, reason: str) -> None:
        """One HOLD tick, in the summary and in Prometheus alike."""
        self.stats.hold(reason)
        self.metrics.holds.labels(reason).inc()

    def _unless_stopped(self, step: Callable[[], _T]) -> _T:
        """A start-up step (load, warm-up inference). `stop` closes the worker, which ends a process
        worker's step with an error: that, or a step that ends after the stop (a thread worker's
        load cannot be cut short), is a StartupInterruptedError."""
        try:
            out = step()
        except Exception:
            if self._stop.is_set():
                raise StartupInterruptedError("stopped during start-up") from None
            raise
        if self._stop.is_set():
            raise StartupInterruptedError("stopped during start-up")
        return out

    def _chunk_shape_error(self, actions: np.ndarray | None) -> str | None:
        """Why a worker's chunk cannot run on this robot, or None if it can."""
        assert self.info is not None
        width = self.info.action_dim
        if actions is None or actions.ndim != 2 or actions.shape[0] == 0 or actions.shape[1] != width:
            shape = None if actions is None else actions.shape
            return f"the policy returned a chunk of shape {shape}, expected (rows, {width})"
        # Fewer rows than H: the chunk could run out before the next inference is asked for (at s),
        # and RTC's prefix and delay assume H rows.
        if actions.shape[0] < self.queue.horizon:
            return (f"the policy returned a chunk of {actions.shape[0]} rows, fewer than chunking.horizon "
                    f"({self.queue.horizon})")
        return None

    def render_status(self) -> str:
        st = self.stats
        q = getattr(self, "queue", None)
        cur = q.current if q is not None else None
        # The newest ticks: once the log has wrapped (2**18 ticks, 87 min at 50 Hz) the end of its
        # storage holds ticks from a whole log ago.
        lat = st.lateness.recent(500)
        p99 = float(np.percentile(lat, 99)) / 1e6 if lat.size else float("nan")
        # "-" until there is one (systemd's STATUS= showed "d -1 infer nan ms" before the first chunk)
        infer = f"{st.infer_ms[-1]:.1f}" if st.infer_ms else "-"
        holds = sum(st.holds.values())
        seq = self.publisher.seq if self.publisher is not None else 0
        chunk = f"{cur.chunk_id}@{cur.index}" if cur is not None else "-"
        delay = q.last_delay if q is not None and q.last_delay >= 0 else "-"
        text = (
            f"seq {seq} chunk {chunk} d {delay} infer {infer} ms "
            f"late p99 {p99:.2f} ms missed {st.missed_slots} holds {holds} fails {st.failures}"
        )
        w = self.worker
        if w is not None and not getattr(w, "up", True):
            attempt = getattr(w, "restart_attempt", 0)
            text = f"HOLDING, WORKER DOWN (restart attempt {attempt}): {getattr(w, 'down_reason', '')} | " + text
        elif st.worker_restarts:
            text += f" worker restarts {st.worker_restarts}"
        if self.task is not None and self.task.changes:
            text += f" instructions {self.task.changes}"
        return text

    def shutdown(self) -> None:
        """Fast teardown: the last HOLD is already out; nothing here may take long."""
        self.notifier.stopping()
        if self._status is not None:
            self._status.stop()
        if self.task is not None:
            self.task.close()
        if self.worker is not None:
            self.worker.close()
        for cam in self.cameras.values():
            cam.stop()
        if self.state is not None:
            self.state.stop()
        if self.publisher is not None:
            self.publisher.close(linger_ms=max(10, round(self.cfg.robot.period_s * 1000)))
        if self.recorder is not None:
            self.recorder.close()
        if self._own_context:
            # destroy, not term: term waits for every socket to close, and one left open by a
            # failed bind or connect in setup() (kept alive by the error's traceback) would hang
            # it for good. The publisher is already closed, so its final HOLD still gets its linger.
            self.context.destroy(linger=0)
        self.notifier.close()

    def summary(self) -> dict[str, Any]:
        st = self.stats
        lat = st.lateness.summary_ms()
        return {
            "ticks": st.ticks,
            "published": st.published,
            "missed_slots": st.missed_slots,
            "lateness_ms": lat,
            "wake_lateness_ms": st.wake_lateness.summary_ms(),
            "inferences": st.inferences,
            "adopted": st.adopted,
            "failures": st.failures,
            "nonfinite_chunks": st.nonfinite_chunks,
            "stale_results": st.stale_results,
            "worker": {"deaths": st.worker_deaths, "restarts": st.worker_restarts,
                       "restart_failures": st.worker_restart_failures},
            "delay_ticks": {"min": min(st.delays, default=-1), "max": max(st.delays, default=-1),
                            "mean": float(np.mean(st.delays)) if st.delays else float("nan")},
            "infer_ms_p50": float(np.percentile(st.infer_ms, 50)) if st.infer_ms else float("nan"),
            "holds": dict(st.holds),
            "clamped": {"position": self.guard.counters.clamped_limit, "rate": self.guard.counters.clamped_rate},
            "nonfinite_actions": self.guard.counters.nonfinite,
            "stop_to_final_ms": st.stop_to_final_ms,
            # Ticks published later than clock.late_warning_ms: how many, and the worst of them.
            "late_ticks": self.late_ticks.summary(),
            # The instruction at the end and how it got there (None without task.endpoint).
            "task": None if self.task is None else {"prompt": self.task.prompt, "changes": self.task.changes,
                                                    "refused": self.task.refused},
            # --record: what did not reach the disk (None without recording).
            "recorder": None if self.recorder is None else {"dropped": self.recorder.dropped,
                                                            "failed": self.recorder.failed,
                                                            "skipped_low_disk": self.recorder.skipped_low_disk},
        }


def _tick_work(collected: bool, started_job: bool, new_task: bool, chunk_sent: bool, flags: int, tick: Any) -> str:
    """What one tick did besides publishing its action, for a late tick's log line."""
    parts = []
    if tick.slots_advanced > 1:
        parts.append(f"{tick.slots_advanced - 1} slot(s) missed before it")
    if collected:
        parts.append("collected an inference result")
    if chunk_sent:
        parts.append("adopted a chunk and published it")
    if started_job:
        parts.append("started an inference for a new instruction" if new_task else "started an inference")
    if flags & Flag.HOLD:
        parts.append("published a HOLD")
    return ", ".join(parts)


@dataclass
class _WorkerSeen:
    """What the clock thread last saw of the worker's health (to act on changes only)."""

    key: tuple[bool, int, int] = (True, 0, 0)
    deaths: int = 0
    restarts: int = 0
    failures: int = 0


def _zmq_opened(key: str, open_socket: Callable[[], Any], binds: str | None = None) -> Any:
    """Run a ZeroMQ bind or connect; ZeroMQ's refusal ("Invalid argument (addr=...)") becomes a
    configuration error that names the key holding the endpoint. `binds`: the endpoint the call
    binds, refused where another process listens on it as an ipc:// path: libzmq's bind unlinks
    the path first, so a second daemon took the first one's controllers over without an error
    (a TCP port in use fails the bind itself)."""
    import zmq

    from phyai_edge.control.preflight import ipc_listening

    if binds and ipc_listening(binds):
        raise ConfigError(f"{key}: {binds}: a process is listening on it (is a daemon already running?)")
    try:
        return open_socket()
    except zmq.ZMQError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def _status_line_default() -> bool:
    from phyai_edge.control.status import StatusLine

    return StatusLine.wanted()
