"""Prometheus metrics on localhost (prometheus-client, the `metrics` extra), or nothing.

The clock thread updates these every tick, so the no-op stand-in matters: without the package,
or with `metrics.port = 0`, every update is an empty method call.
"""

from __future__ import annotations

import importlib.util
import logging
import socket
from collections.abc import Callable, Mapping

from phyai_edge.extras import install_hint

log = logging.getLogger("phyai_edge.control")

# Tick lateness spans tens of microseconds (healthy) to whole periods (overrun).
LATENESS_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 0.1)
STAGE_BUCKETS = (1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


# Every `reason` label `phyai_hold_ticks` takes (the daemon's `_count_hold`).
HOLD_REASONS = ("warmup", "starved", "stale", "estop", "paused", "worker_down", "nonfinite", "shutdown")
# Every `limit` label `phyai_clamped_actions` takes (`ActionGuard.last_clamps`).
CLAMP_LIMITS = ("position", "rate")

class _Nop:
    def labels(self, *args: object, **kwargs: object) -> _Nop:
        return self

    def observe(self, value: float) -> None:
        pass

    def inc(self, amount: float = 1.0) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def info(self, labels: dict[str, str]) -> None:
        pass


class Metrics:
    def __init__(self) -> None:
        nop = _Nop()
        self.enabled = False
        self.tick_lateness = nop
        self.stage_seconds = nop
        self.inference_seconds = nop
        self.rtc_delay = nop
        self.holds = nop
        self.clamped = nop
        self.missed_ticks = nop
        self.late_ticks = nop
        self.nonfinite = nop
        self.inference_failures = nop
        self.seq = nop
        self.published = nop
        self.action_obs_age = nop
        self.since_policy_action = nop
        self.worker_restarts = nop
        self.worker_deaths = nop
        self.worker_up = nop
        self.model_info = nop
        self.task_requests = nop
        self.task_holding = nop
        self.task_instruction = nop
        self.records = nop

    def serve(
        self, host: str, port: int, model: Mapping[str, str] | None = None,
        worker_pid: Callable[[], int | None] | None = None,
    ) -> bool:
        """Start the HTTP endpoint. Returns False (after one log line) when that is not possible.
        `model`: the labels of phyai_model_info (which model runs), set before the first scrape.
        `worker_pid`: the inference worker's process id (None while it is down), whose memory and
        CPU are exported as phyai_worker_process_*; the model's memory lives there, not here."""
        try:
            import prometheus_client as pc
        except ImportError:
            log.error("metrics: prometheus-client is not installed (%s)", install_hint("prometheus_client"))
            return False
        registry = pc.CollectorRegistry()
        self.tick_lateness = pc.Histogram(
            "phyai_tick_lateness_seconds", "Publish time minus the tick's deadline", buckets=LATENESS_BUCKETS, registry=registry
        )
        self.stage_seconds = pc.Histogram(
            "phyai_inference_stage_seconds", "Inference time per stage", ["stage"], buckets=STAGE_BUCKETS, registry=registry
        )
        self.inference_seconds = pc.Histogram(
            "phyai_inference_seconds", "Whole inference as the worker measured it", buckets=STAGE_BUCKETS, registry=registry
        )
        self.rtc_delay = pc.Gauge("phyai_rtc_delay_ticks", "Measured delay d of the last adopted chunk", registry=registry)
        self.holds = pc.Counter("phyai_hold_ticks", "Ticks published with HOLD, by reason", ["reason"], registry=registry)
        for reason in HOLD_REASONS:  # every series from the first scrape: increase() sees the first event
            self.holds.labels(reason)
        self.clamped = pc.Counter("phyai_clamped_actions", "Actions changed by a limit: position (action_min / "
                                  "action_max) or rate (max_rate)", ["limit"], registry=registry)
        for limit in CLAMP_LIMITS:
            self.clamped.labels(limit)
        self.missed_ticks = pc.Counter("phyai_missed_ticks", "Clock slots skipped after an overrun", registry=registry)
        self.late_ticks = pc.Counter("phyai_late_ticks", "Ticks published later than clock.late_warning_ms after their "
                                     "deadline", registry=registry)
        self.nonfinite = pc.Counter("phyai_nonfinite_actions", "Non-finite actions replaced by HOLD", registry=registry)
        self.inference_failures = pc.Counter(
            "phyai_inference_failures", "Inferences that failed: raised, or returned a chunk that was rejected", registry=registry
        )
        self.seq = pc.Gauge("phyai_published_seq", "Sequence number of the last published action", registry=registry)
        self.published = pc.Counter("phyai_published_actions", "Action messages published, HOLD included",
                                    registry=registry)
        self.action_obs_age = pc.Gauge(
            "phyai_action_observation_age_seconds",
            "Age of the observation behind the last policy action, when it was published", registry=registry,
        )
        self.since_policy_action = pc.Gauge(
            "phyai_seconds_since_policy_action", "Time since the last policy (not HOLD) action was published "
            "(before the first, since publishing began); grows while the daemon holds", registry=registry,
        )
        self.worker_restarts = pc.Counter(
            "phyai_worker_restarts", "Inference worker processes restarted, by outcome: ok, failed", ["result"],
            registry=registry,
        )
        for result in ("ok", "failed"):  # every series from the first scrape, as the holds'
            self.worker_restarts.labels(result)
        self.worker_deaths = pc.Counter("phyai_worker_deaths", "Inference worker processes that died", registry=registry)
        self.worker_up = pc.Gauge("phyai_worker_up", "1 while the inference worker is up, 0 while it is down", registry=registry)
        self.worker_up.set(1)
        self.task_requests = pc.Counter(
            "phyai_task_requests", "Instruction requests (task.endpoint), by result: " + ", ".join(TASK_RESULTS),
            ["result"], registry=registry,
        )
        for result in TASK_RESULTS:
            self.task_requests.labels(result)
        # States, for a dashboard's "held" light and "which instruction" panel (the counter above has events).
        self.task_holding = pc.Gauge("phyai_task_holding", "1 while an operator holds the robot (HOLD | PAUSED)",
                                     registry=registry)
        self.task_instruction = pc.Gauge(
            "phyai_task_instruction", "The instruction taken last: 0 is model.prompt, n the n-th over the task channel",
            registry=registry,
        )
        # `--record`: a recording that stopped reaching the disk (full, slow, below its floor) is
        # otherwise only in the log.
        self.records = pc.Counter("phyai_record_observations", "--record: inferences by what became of their "
                                  "record: " + ", ".join(RECORD_RESULTS), ["result"], registry=registry)
        for result in RECORD_RESULTS:
            self.records.labels(result)
        # The standard process_* series (resident memory, CPU seconds, open files, start time) of the
        # daemon, and the same of the worker process under phyai_worker_process_*: a leak or a
        # runaway thread shows there first. A pid that is gone reads as no samples, not an error.
        pc.ProcessCollector(registry=registry)
        if worker_pid is not None:
            pc.ProcessCollector(namespace="phyai_worker", pid=lambda: worker_pid() or -1, registry=registry)
        # An info gauge, phyai_model_info{adapter="pi05",preset="full",...} 1: which model runs,
        # for readers of these metrics (`phyai-edge roofline --metrics`, `phyai-edge sim --report`). The daemon
        # starts the endpoint once the policy is loaded; prometheus-client escapes the values.
        if model:  # no labels: no line (a bare info line would say nothing)
            self.model_info = pc.Info(
                "phyai_model", "The model the daemon runs (labels; those it does not know are left out)",
                registry=registry,
            )
            self.model_info.info(dict(model))
        try:
            pc.start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            log.error("metrics: cannot listen on %s:%d (%s)", host, port, exc.strerror)
            self.__init__()  # type: ignore[misc]
            return False
        self.enabled = True
        log.info("metrics: Prometheus on http://%s:%d/metrics", host, port)
        return True


# What became of a `--record` record (`Recorder`): written, or why not.
RECORD_RESULTS = ("written", "dropped", "failed", "skipped_low_disk")
# What a task-channel request came to (`TaskChannel.handle`): one series each from the first scrape.
TASK_RESULTS = ("taken", "unchanged", "query", "refused", "hold", "release")


def listen_problem(host: str, port: int) -> str | None:
    """Why the metrics endpoint could not start at host:port (None if it can): prometheus-client
    missing, a host that does not resolve, an address in use. Binds as the server does: the
    address family `host` resolves to, and SO_REUSEADDR (http.server's allow_reuse_address);
    without it, connections a daemon stopped a moment ago left in TIME_WAIT (a Prometheus scrape)
    would fail the check though the daemon starts fine."""
    if importlib.util.find_spec("prometheus_client") is None:
        return f"prometheus-client is not installed ({install_hint('prometheus_client')}), or set metrics.port = 0"
    where = f"{host}:{port}"
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        return f"{where}: {exc.strerror}"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            return f"{where}: {exc.strerror}"
    return None
