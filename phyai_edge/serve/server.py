"""The multi-robot server: one engine, many robot daemons, ZeroMQ ROUTER on the server side.

Threads:
- the intake thread owns the ROUTER socket: it decodes requests, answers `hello` and `stats`
  at once, turns each `infer` budget into a deadline (and its `wait_ms` into an expiry) and
  hands it to the `Scheduler` (which may reject it at once: back-pressure), answers the
  requests that expired in the queue (`expired`: not run, their robot stopped waiting), and
  sends every reply the workers produce;
- the check thread answers `prompt_fit` (`Policy.prompt_fit`: it tokenises the instruction once
  per state bin, tens of milliseconds that would hold up every robot's intake), beside the
  batches rather than queued behind them, and wakes the intake thread as the workers do;
- `workers` inference threads take batches from the scheduler and run them on the executor
  (one for a local engine; one per replica for Ray Serve), then queue the replies and wake the
  intake thread through an inproc socket (ZeroMQ sockets are not shared between threads).
  Expired requests a worker's `next_batch` finds it answers too.
  An executor says how many batches it may run at once (`concurrency`; a local engine: one,
  see `LocalExecutor`), and the server starts no more workers than that.

`stop` answers queued requests `shutting_down`, lets a batch already running finish, and stops the
intake thread last, so that the robots of that batch get its answers.

A robot that disconnects disturbs no other: replies to a peer that is gone are dropped by the
ROUTER (ROUTER_MANDATORY off) and sends never block (a peer that stops reading only loses its
own replies once its high-water mark is reached); its queued requests still run in their
batch, and its stats show it idle.

What the server keeps per robot, for a server that runs for weeks while robots come and go:
- no RTC or session state: every `infer` request carries its own observations, RTC prefix and
  delay (the robot's daemon keeps its executing chunk; a restarted daemon has none, so its first
  request carries no prefix), and a reply goes back to the connection that asked (a robot that
  reconnects is a new ZeroMQ peer: replies to its old connection are dropped);
- its share of the queue (`Scheduler`), only while it has requests queued;
- its row in the stats, forgotten once the robot has sent nothing for `forget_robot_s`;
- its connection: closed by the robot, or, for a robot that hung or lost power without closing
  it, dropped once it has answered no ZeroMQ heartbeat for `HEARTBEAT_MISSES` intervals
  (`heartbeat_s`). Without heartbeats such a connection is held for good (its TCP peer never
  closes it), an open file each, until the server's file limit refuses every new robot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
import zmq

from phyai_edge.adapters.base import Observation
from phyai_edge.engines.base import RTC_MODES, RTCRequest
from phyai_edge.serve import wire
from phyai_edge.serve.batching import BatchItem, ItemResult, group_key, run_items, warm_up
from phyai_edge.serve.scheduler import Pending, Scheduler, SchedulerConfig, pad_size
from phyai_edge.serve.stats import FORGET_ROBOT_S, BatchRecord, ServerStats, format_report

log = logging.getLogger("phyai_edge.serve")

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5570"
# Instruction checks waiting for the check thread; more are refused `overloaded`. A daemon asks
# once per instruction sent to it, so a longer queue would only be a client in a loop.
CHECKS_QUEUED = 16
# How often the ROUTER pings each connection (ZMTP heartbeats: a live peer's ZeroMQ I/O thread
# answers by itself, whatever its application does), and after how many intervals without any
# traffic back it drops the connection. The same time is sent to the robots as the heartbeat TTL,
# so a robot's socket also drops (and reconnects) a connection to a server that went silent.
HEARTBEAT_S = 5.0
HEARTBEAT_MISSES = 3


class Executor(Protocol):
    """Runs a list of requests as few engine calls as it can."""

    def describe(self) -> dict[str, Any]: ...

    def run(self, items: list[BatchItem]) -> list[ItemResult]: ...


def describe_policy(policy: Any) -> dict[str, Any]:
    """What a robot needs to know about the model behind the server (the `hello` reply)."""
    a = policy.adapter
    return {
        "adapter": getattr(a, "name", ""), "chunk_size": int(policy.chunk_size), "action_dim": int(policy.action_dim),
        "state_dim": int(policy.state_dim), "camera_names": list(policy.camera_names),
        "model_action_dim": int(a.model_action_dim), "backend": getattr(policy.engine, "backend", ""),
        "device": str(policy.device), "per_sample_rtc": bool(getattr(policy, "per_sample_rtc", True)),
        # cameras the server runs the model without (`serve --absent-camera`; a robot that sends one anyway
        # gets it used, at the cost of graphs of another view count)
        "absent_cameras": sorted(getattr(policy, "absent_cameras", ())),
    }


class LocalExecutor:
    """The engine in this process. It runs one batch at a time: an engine is not safe to call
    from two threads at once (the cudagraph and TensorRT engines copy every call's inputs into
    static buffers per batch size that their captured graphs read, and all of them draw noise
    from one generator), and two batches on one GPU would only share it, each taking longer."""

    # Batches the server may hand it at once: the server starts no more inference threads.
    concurrency = 1

    def __init__(self, policy: Any, batch_sizes: Sequence[int] | None = None, max_batch: int | None = None,
                 prompt_tokens: int = 0) -> None:
        self.policy = policy
        self.batch_sizes = list(batch_sizes) if batch_sizes else None
        self.max_batch = max_batch
        # Room kept for prompts the warm-up did not run (`serve --prompt-tokens`): any prompt within
        # it, with any state, runs the graphs the warm-up captured.
        self.prompt_tokens = prompt_tokens
        self._lock = threading.Lock()  # for callers other than the server (which runs one worker)
        self._warmed = False
        # Batches that made the engine build graphs after the warm-up (each a capture on a GPU, ~1 s
        # at full size, while every robot in the batch waits): a shape, prompt length or RTC mode
        # the warm-up did not run.
        self.graphs_built_serving = 0

    def describe(self) -> dict[str, Any]:
        return describe_policy(self.policy)

    def run(self, items: list[BatchItem]) -> list[ItemResult]:
        with self._lock:
            before = getattr(self.policy, "graphs_built", None)
            t0 = time.perf_counter()
            results = run_items(self.policy, items, self.batch_sizes, self.max_batch, strict_prompts=True)
            if self._warmed and before is not None and self.policy.graphs_built != before:
                self.graphs_built_serving += 1
                log.warning("a batch of %d met a shape, prompt length or RTC mode the warm-up did not run: the engine "
                            "built graphs for it while its robots waited (%.0f ms); warm with the robots' prompts "
                            "and RTC modes (--warm-prompt, --warm-rtc, --prompt-tokens)",
                            sum(len(it.observations) for it in items), (time.perf_counter() - t0) * 1e3)
            return results

    def warm_up(self, observations: Sequence[Observation],
                rtcs: Sequence[RTCRequest | None] = (None,)) -> dict[int, float]:
        """Every captured batch size once per observation and RTC request (see
        `batching.warm_up`), with room kept for the observations' prompts with any robot state,
        and for `prompt_tokens` (`Policy.fix_prompt_positions`); nothing to do for an engine that
        takes any size."""
        if not self.batch_sizes:
            return {}
        fix_prompt = getattr(self.policy, "fix_prompt_positions", None)
        if fix_prompt is not None and observations:
            # the robots send these prompts with states of their own: one prompt length for them all
            fix_prompt([o.prompt for o in observations], at_least=self.prompt_tokens)
        # Every size a batch of up to max_batch observations can be padded to, and no larger.
        top = pad_size(min(self.max_batch or max(self.batch_sizes), max(self.batch_sizes)), self.batch_sizes)
        times = warm_up(self.policy, [b for b in self.batch_sizes if b <= top], observations, rtcs)
        self._warmed = True
        return times


def request_item(req: wire.Request, tag: Any = None) -> BatchItem:
    """Decoded wire request -> what the batcher runs. Images stay views of their ZeroMQ frames
    (each image is a frame of its own, so a view keeps only that frame alive), made read-only:
    preprocess reads each once, into the device staging buffer or its slot of the batch, so a
    copy here would only double the bytes the host moves. The small arrays are copied."""
    obs = [Observation(images={k: None if v is None else _read_only(v) for k, v in o.images.items()},
                       state=np.array(o.state, dtype=np.float32), prompt=o.prompt, timestamp=o.timestamp)
           for o in req.observations]
    rtc = None
    if req.rtc is not None:
        r = req.rtc
        if r.mode not in RTC_MODES:
            raise wire.WireError(f"rtc.mode: unknown mode {r.mode!r}; expected one of {RTC_MODES}")
        rtc = RTCRequest(r.mode, np.array(r.prefix, dtype=np.float32), r.delay, r.execution_horizon,  # type: ignore[arg-type]
                         r.max_guidance_weight)
    noise = None if req.noise is None else torch.from_numpy(np.array(req.noise, dtype=np.float32))
    return BatchItem(obs, rtc, noise, tag)


class PolicyServer:
    def __init__(
        self,
        executor: Executor,
        endpoint: str = DEFAULT_ENDPOINT,
        scheduler: SchedulerConfig | None = None,
        default_budget_ms: float = 500.0,
        workers: int = 1,
        report_s: float = 0.0,
        context: zmq.Context | None = None,
        forget_robot_s: float = FORGET_ROBOT_S,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        """forget_robot_s: a robot that sent no request this long leaves the per-robot stats.
        heartbeat_s: ZeroMQ heartbeat interval of the robots' connections; one that answers
        nothing for `HEARTBEAT_MISSES` intervals is dropped (0: never)."""
        if not (math.isfinite(heartbeat_s) and heartbeat_s >= 0):
            raise ValueError(f"heartbeat_s must be a finite number of seconds >= 0, got {heartbeat_s!r}")
        self.executor = executor
        self.bind_endpoint = endpoint
        cfg = scheduler or SchedulerConfig()
        if cfg.batch_sizes is None and getattr(executor, "batch_sizes", None):
            # The latency rule prices a batch at the size the executor pads it to.
            cfg = dataclasses.replace(cfg, batch_sizes=tuple(executor.batch_sizes))
        self.sched = Scheduler(cfg)
        self.default_budget_s = default_budget_ms / 1e3
        self.workers = max(1, workers)
        most = getattr(executor, "concurrency", None)
        if most is not None and self.workers > most:
            # A further worker would form its batch while the engine still runs the last one and
            # then wait for it: the latency rule prices a batch as starting when it forms, and
            # would learn the wait as service time. Ray replicas each run their own batch.
            log.warning("%s runs %d batch(es) at a time: using %d worker(s), not %d",
                        type(executor).__name__, most, most, self.workers)
            self.workers = most
        self.report_s = report_s
        self.stats = ServerStats(forget_robot_s)
        self.heartbeat_s = heartbeat_s
        self.ctx = context or zmq.Context.instance()
        self.endpoint = ""
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._checks: queue.Queue[tuple[bytes, wire.Request]] = queue.Queue(CHECKS_QUEUED)
        self._stop = threading.Event()  # the workers and the check thread
        # The intake thread's own, set after the others stopped: it sends the replies they made last.
        self._io_stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._wake_addr = f"inproc://phyai-serve-wake-{id(self)}"
        self._model = executor.describe()
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> PolicyServer:
        io = threading.Thread(target=self._io_loop, name="serve-io", daemon=True)
        self._threads.append(io)
        io.start()
        self._ready.wait(10.0)
        if self._error is not None:
            raise RuntimeError(f"cannot bind {self.bind_endpoint}: {self._error}") from self._error
        loops = [(self._check_loop, "serve-checks")]
        loops += [(self._worker_loop, f"serve-worker-{i}") for i in range(self.workers)]
        for loop, name in loops:
            t = threading.Thread(target=loop, name=name, daemon=True)
            self._threads.append(t)
            t.start()
        log.info("serving %s on %s (%d worker(s), max batch %d, window %.1f ms, queue %d)",
                 self._model.get("adapter", "?"), self.endpoint, self.workers, self.sched.cfg.max_batch,
                 self.sched.cfg.window_s * 1e3, self.sched.cfg.capacity)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        # Close intake first so queued robots hear "shutting down" before the socket goes (those
        # already past their expiry hear `expired`, as they would have while serving).
        self._answer_expired(self.sched.take_expired())
        for p in self.sched.close():
            self.stats.rejected(p.robot)  # counted, so the final report's columns add up
            self._reply_error(p.payload[0], p.req_id, wire.ERR_SHUTDOWN, "server is shutting down")
        # A batch still running finishes and its robots get its answers (they wait for them), as
        # does a check in progress: the intake thread, which sends them, stops only after.
        self._stop.set()
        io, others = self._threads[:1], self._threads[1:]  # start() starts the intake thread first
        for t in others:
            t.join(timeout)
        self._io_stop.set()
        for t in io:
            t.join(timeout)
        self._threads.clear()
        self._answer_checks_at_shutdown()  # where no intake thread ran to do it (never started)

    def _answer_checks_at_shutdown(self) -> None:
        """Checks still queued hear that the server is shutting down."""
        while True:
            try:
                ident, req = self._checks.get_nowait()
            except queue.Empty:
                return
            self._reply_error(ident, req.req_id, wire.ERR_SHUTDOWN, "server is shutting down")

    def __enter__(self) -> PolicyServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def warm_up(self, observations: Sequence[Observation],
                rtcs: Sequence[RTCRequest | None] = (None,)) -> dict[int, float]:
        """Before `start`: run the executor's batch sizes once (no capture lands on a robot's
        request) and take their times as the latency rule's first estimates."""
        fn = getattr(self.executor, "warm_up", None)
        times: dict[int, float] = fn(observations, rtcs) if fn is not None else {}
        for size, seconds in times.items():
            self.sched.record_service(size, seconds)
        return times

    def report(self) -> dict[str, Any]:
        rep = self.stats.report()
        rep["queued"] = len(self.sched)
        # The latency rule's learned service time per padded batch size.
        rep["service_estimate_ms"] = {b: s * 1e3 for b, s in self.sched.service_estimates().items()}
        built = getattr(self.executor, "graphs_built_serving", None)
        if built is not None:
            rep["graphs_built_serving"] = built
        return rep

    def serve_forever(self) -> None:
        try:
            while not self._stop.wait(1.0):
                pass
        finally:
            self.stop()

    # -- intake thread ---------------------------------------------------------------------
    def _io_loop(self) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        wake = self.ctx.socket(zmq.PULL)
        try:
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # unroutable replies (robot gone) are dropped
            router.setsockopt(zmq.SNDHWM, 64)
            router.setsockopt(zmq.RCVHWM, 1000)
            if self.heartbeat_s > 0:
                ivl = max(1, round(self.heartbeat_s * 1e3))
                router.setsockopt(zmq.HEARTBEAT_IVL, ivl)
                router.setsockopt(zmq.HEARTBEAT_TIMEOUT, ivl * HEARTBEAT_MISSES)
                # ZeroMQ sends the TTL in deciseconds, at most 6553.5 s.
                router.setsockopt(zmq.HEARTBEAT_TTL, min(ivl * HEARTBEAT_MISSES, 6_553_500))
            router.bind(self.bind_endpoint)
            self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            wake.bind(self._wake_addr)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            router.close(0)
            wake.close(0)
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        next_report = time.monotonic() + self.report_s if self.report_s > 0 else float("inf")
        try:
            while not self._io_stop.is_set():
                events = dict(poller.poll(100))
                if router in events:
                    for _ in range(1000):  # drain, but keep sending replies under a flood
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_message(frames)
                if wake in events:
                    while True:
                        try:
                            wake.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                # Expired while the workers were busy (a worker's next_batch answers the rest).
                self._answer_expired(self.sched.take_expired())
                self._flush(router)
                if time.monotonic() >= next_report:
                    log.info("%s", format_report(self.report()))
                    next_report = time.monotonic() + self.report_s
            # This thread alone queues checks, and the check thread has stopped: what is left waits for nobody.
            self._answer_checks_at_shutdown()
            self._flush(router)
        finally:
            router.close(0)
            wake.close(0)

    def _flush(self, router: zmq.Socket) -> None:
        while True:
            try:
                ident, frames = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                router.send_multipart([ident, *frames], zmq.NOBLOCK)
            except zmq.Again:
                pass  # that robot stopped reading; dropping its reply keeps the others moving
            except zmq.ZMQError as exc:
                log.debug("reply dropped: %s", exc)

    def _reply(self, ident: bytes, rep: wire.Reply) -> None:
        self._outbox.put((ident, wire.encode_reply(rep)))

    def _reply_error(self, ident: bytes, req_id: int, code: str, message: str) -> None:
        self._reply(ident, wire.Reply(req_id, False, error=code, message=message))

    def _answer_expired(self, gone: list[Pending]) -> None:
        """Answer requests the scheduler did not run because their client stopped waiting (its
        RemotePolicy discards the reply by id): every request still gets one reply."""
        for p in gone:
            self.stats.expired(p.robot)
            waited = ((p.expiry or p.arrival) - p.arrival) * 1e3
            self._reply_error(p.payload[0], p.req_id, wire.ERR_EXPIRED,
                              f"not run: still queued when its client stopped waiting (wait_ms {waited:.0f})")

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        ident, body = frames[0].bytes, frames[1:]
        arrival = time.monotonic()
        try:
            req = wire.decode_request(body, max_observations=self.sched.limit)
        except wire.WireError as exc:
            self._reply_error(ident, _peek_id(body), wire.ERR_BAD_REQUEST, str(exc))
            return
        except Exception as exc:
            # A message the decoder did not foresee: refuse it like any bad request. An exception
            # escaping here would end this thread, and with it intake and replies for every robot.
            log.exception("could not decode a request")
            self._reply_error(ident, _peek_id(body), wire.ERR_BAD_REQUEST, f"{type(exc).__name__}: {exc}")
            return
        if req.kind == "hello":
            self._reply(ident, wire.Reply(req.req_id, True, info={"model": self._model}))
            return
        if req.kind == "stats":
            self._reply(ident, wire.Reply(req.req_id, True, info={"report": self.report()}))
            return
        if req.kind == "prompt_fit":
            try:
                self._checks.put_nowait((ident, req))
            except queue.Full:
                self._reply_error(ident, req.req_id, wire.ERR_OVERLOADED,
                                  f"{CHECKS_QUEUED} instruction checks already queued; retry")
            return
        self.stats.arrived(req.robot)
        try:
            item = request_item(req)
        except Exception as exc:  # whatever the request's contents raise: refused, as at decode_request above
            self.stats.rejected(req.robot)
            self._reply_error(ident, req.req_id, wire.ERR_BAD_REQUEST,
                              str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}")
            return
        budget = req.budget_ms / 1e3 if req.budget_ms is not None else self.default_budget_s
        # The client started waiting before it sent: from arrival, the server never expires a
        # request its client still waits for.
        expiry = arrival + req.wait_ms / 1e3 if req.wait_ms is not None else None
        key = group_key(item.rtc, bool(self._model.get("per_sample_rtc", True)))
        p = Pending(req.robot, req.req_id, item.size, arrival + budget, key, (ident, item), arrival, expiry)
        code = self.sched.submit(p)
        self.stats.intake((time.monotonic() - arrival) * 1e3)
        if code is not None:
            self.stats.rejected(req.robot)
            self._reply_error(ident, req.req_id, code, _reject_message(code, self.sched, p.size))

    # -- check thread ----------------------------------------------------------------------
    def _wake_socket(self) -> Any:
        """A PUSH to the intake thread's wake-up socket, for a thread that queues replies."""
        wake = self.ctx.socket(zmq.PUSH)
        wake.setsockopt(zmq.LINGER, 0)
        wake.connect(self._wake_addr)
        return wake

    def _check_loop(self) -> None:
        wake = self._wake_socket()
        try:
            while not self._stop.is_set():
                try:
                    ident, req = self._checks.get(timeout=0.2)
                except queue.Empty:
                    continue
                self._reply(ident, self._prompt_fit(req))
                with contextlib.suppress(zmq.Again):
                    wake.send(b"", zmq.NOBLOCK)
        finally:
            wake.close(0)

    def _prompt_fit(self, req: wire.Request) -> wire.Reply:
        """The executor's policy's `prompt_fit`, run beside whatever batch the workers run. It
        tokenises (a Hugging Face tokenizer encodes through a shared borrow, SentencePiece through
        a const method: both may run beside the batch's own tokenising, and the adapter's token
        cache is not touched) and reads the room the warm-up fixed (an int written only before
        `start`). It runs no torch and touches none of what makes the engine single-threaded
        (`LocalExecutor`: static input buffers, the noise generator); the batch only shares the
        GIL with it while it tokenises."""
        fit = getattr(getattr(self.executor, "policy", None), "prompt_fit", None)
        if fit is None:
            why = f"its executor ({type(self.executor).__name__}) holds no policy here to count tokens with"
            return wire.Reply(req.req_id, True, info=wire.prompt_fit_info(None, None, None, unchecked=why))
        assert req.prompt is not None  # decode_request checked it
        try:
            tokens, room, most = fit(req.prompt)
        except ValueError as exc:  # the adapter refuses the prompt itself (empty, with no default prompt)
            return wire.Reply(req.req_id, False, error=wire.ERR_BAD_REQUEST, message=f"prompt: {exc}")
        except Exception as exc:
            log.exception("prompt_fit failed")
            return wire.Reply(req.req_id, False, error=wire.ERR_INFERENCE, message=f"{type(exc).__name__}: {exc}")
        return wire.Reply(req.req_id, True, info=wire.prompt_fit_info(tokens, room, most))

    # -- inference threads -----------------------------------------------------------------
    def _worker_loop(self) -> None:
        wake = self._wake_socket()
        try:
            while not self._stop.is_set():
                batch = self.sched.next_batch(timeout=0.2)
                gone = self.sched.take_expired()  # next_batch returns early when some expired
                self._answer_expired(gone)
                if batch:
                    self._run_batch(batch)
                if batch or gone:
                    # Again: the intake thread already has wake-ups pending.
                    with contextlib.suppress(zmq.Again):
                        wake.send(b"", zmq.NOBLOCK)
        finally:
            wake.close(0)

    def _run_batch(self, batch: list[Pending]) -> None:
        t0 = time.monotonic()
        try:
            results = self.executor.run([p.payload[1] for p in batch])
        except Exception as exc:  # the executor itself failed (e.g. a Ray replica died)
            log.exception("batch of %d failed", len(batch))
            results = [ItemResult(None, error=f"{type(exc).__name__}: {exc}") for _ in batch]
        if len(results) != len(batch):
            # Paired by position below: a short list left its last robots without any reply (they
            # waited out their timeout), a long one gave a robot another's actions. Trust none.
            log.error("the executor answered %d request(s) for a batch of %d", len(results), len(batch))
            results = [ItemResult(None, error=f"the executor answered {len(results)} request(s) for a batch of "
                                             f"{len(batch)}") for _ in batch]
        done = time.monotonic()
        record = batch_record(batch, results, t0, done)
        if record.calls == 1 and not record.reruns:
            # Learn only from a batch that was one engine call: that is what the estimate prices.
            self.sched.record_service(record.padded, done - t0)
        for p, r in zip(batch, results):
            ident = p.payload[0]
            latency_ms, queue_ms = (done - p.arrival) * 1e3, (t0 - p.arrival) * 1e3
            missed = done > p.deadline
            # Never an OK reply with NaN or Inf a robot could act on (the daemon refuses such a chunk
            # in its own loop; here extreme RTC weights made them).
            finite = r.actions is not None and bool(np.isfinite(r.actions).all())
            self.stats.answered(p.robot, finite, latency_ms, queue_ms, missed)
            if r.actions is None:
                self._reply_error(ident, p.req_id, wire.ERR_BAD_REQUEST if r.bad_request else wire.ERR_INFERENCE,
                                  r.error)
                continue
            if not finite:
                self._reply_error(ident, p.req_id, wire.ERR_INFERENCE, "the policy's actions hold NaN or Inf values")
                continue
            info = {"stage_ms": r.stage_ms, "batch": r.batch, "queue_ms": queue_ms, "server_ms": latency_ms,
                    "late": missed}
            self._reply(ident, wire.Reply(p.req_id, True, np.asarray(r.actions, dtype=np.float32), info=info))
        record.reply_ms = (time.monotonic() - done) * 1e3
        self.stats.batch(max((r.batch for r in results), default=len(batch)), record)


def batch_record(batch: list[Pending], results: list[ItemResult], t0: float, done: float) -> BatchRecord:
    """Where one batch's time went, from the stage times its engine calls reported."""
    calls = {id(r.stage_ms): r for r in results if r.actions is not None}  # one stage_ms dict per call
    rec = BatchRecord(observations=sum(p.size for p in batch), padded=sum(r.batch for r in calls.values()),
                      calls=len(calls), wait_ms=(t0 - min(p.arrival for p in batch)) * 1e3,
                      service_ms=(done - t0) * 1e3, reruns=sum(r.rerun for r in results))
    for r in calls.values():
        ms = r.stage_ms
        pre, post = ms.get("preprocess", 0.0), ms.get("postprocess", 0.0)
        rec.preprocess_ms += pre
        rec.postprocess_ms += post
        rec.engine_ms += ms.get("total", pre + post) - pre - post
    return rec


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


def _peek_id(body: list[Any]) -> int:
    """Best-effort request id for an error reply to a message that failed to decode."""
    try:
        import json

        raw = body[0].bytes
        if len(raw) > wire.MAX_HEADER_BYTES:
            return -1  # refused for its size: not parsed here either
        v = json.loads(raw).get("id", -1)
        return v if isinstance(v, int) and not isinstance(v, bool) else -1
    except Exception:
        return -1


def _reject_message(code: str, sched: Scheduler, size: int) -> str:
    cfg = sched.cfg
    if code == wire.ERR_BAD_REQUEST:
        return (f"obs: {size} observations in one request; this server runs at most {sched.limit} per engine call "
                f"(--max-batch, --batch-sizes): send fewer per request")
    if code == wire.ERR_OVERLOADED:
        return (f"server at capacity ({cfg.capacity} queued requests); keep executing the current chunk and retry")
    if code == wire.ERR_ROBOT_LIMIT:
        return f"this robot already has {cfg.per_robot} requests queued; wait for their answers"
    return "server is shutting down"
