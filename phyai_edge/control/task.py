"""The instruction the daemon runs, and the socket that changes it while the robot runs.

A VLA policy is conditioned on a text instruction (PI0.5's prompt). `model.prompt` is the one the
daemon starts with; with `task.endpoint` set, an operator or a task planner sends another over a
ZeroMQ REQ socket (`phyai-edge task`, docs/protocol.md section 4) and the next chunk runs it.

Every request is answered. An instruction is taken only if it runs as the policy was warmed up:
the worker checks its prompt tokens, with any robot state, against the room the engine keeps
(`Policy.prompt_fit`), so a new instruction never truncates and never captures graphs inside the
control loop. The check, and the socket, live on this module's own thread: the clock thread only
reads `current` and `holding`.

The same socket holds the robot (`"hold": true`): the daemon publishes HOLD | PAUSED, runs no
inference and forgets the executing chunk, as for stale inputs, until `"hold": false` (which may
come with the instruction to resume on). An operator's pause, without stopping the daemon or
losing its warm engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from phyai_edge.control.config import TaskConfig, task_prompt_problem
from phyai_edge.control.metrics import Metrics
from phyai_edge.control.protocol import TASK_MAX_BYTES, TaskReply, decode_task_request, encode_task_request
from phyai_edge.control.worker import PromptFit

log = logging.getLogger("phyai_edge.control.task")

POLL_MS = 100  # how often the thread looks at `close` while no request comes


class TaskChannel:
    """`current`: (changes so far, the instruction), replaced whole by this thread and read by
    the clock thread without a lock (one attribute: each read sees one whole pair); `holding`
    likewise, and `holds`, the holds taken so far: a hold released within one control period is
    gone from `holding` before the clock reads it, and the count still shows it."""

    def __init__(self, cfg: TaskConfig, initial: str, check: Callable[[str], PromptFit], context: Any = None,
                 metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self.check = check
        self.metrics = metrics or Metrics()
        self.current: tuple[int, str] = (0, initial)
        self.holding = cfg.start_held
        self.holds = int(cfg.start_held)
        self.metrics.task_holding.set(int(self.holding))
        # Declared instructions: the only ones taken with any_prompt = false.
        self.declared = frozenset((initial, *cfg.prompts))
        self.refused = 0
        self._context = context
        self._socket: Any = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    @property
    def prompt(self) -> str:
        return self.current[1]

    @property
    def changes(self) -> int:
        return self.current[0]

    def start(self) -> None:
        """Open the REP socket (a bind or connect failure raises here, at start-up) and serve it."""
        import zmq

        ctx = self._context or zmq.Context.instance()
        sock = ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        # Far above a valid request (TASK_MAX_BYTES, refused with a reply), so those still get
        # their error; a peer sending more is cut off before its message takes the memory.
        sock.setsockopt(zmq.MAXMSGSIZE, 64 * TASK_MAX_BYTES)
        try:
            if self.cfg.bind:
                sock.bind(self.cfg.endpoint)
            else:
                sock.connect(self.cfg.endpoint)
        except Exception:
            sock.close()
            raise
        self._socket = sock
        self._thread = threading.Thread(target=self._serve, name="task", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(2.0)
            if self._thread.is_alive():
                # Still in a worker check: a ZeroMQ socket must not be closed under the thread
                # using it; the daemon's context.destroy at shutdown closes it.
                return
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def describe(self) -> str:
        which = "any instruction that fits" if self.cfg.any_prompt else f"{len(self.declared)} declared instructions"
        return f"{'bound' if self.cfg.bind else 'connected'} at {self.cfg.endpoint} ({which})"

    def _serve(self) -> None:
        import zmq

        sock = self._socket
        try:
            while not self._closing.is_set():
                if not sock.poll(POLL_MS):
                    continue
                # The whole message, however many frames: a REP socket that read one frame of
                # two could not send its reply, and the thread (with every later request) died.
                frames = sock.recv_multipart()
                try:
                    if len(frames) != 1:
                        reply = self._refuse(f"a task request is one frame of JSON, got {len(frames)} frames",
                                             self.prompt, self.changes)
                    else:
                        reply = self.handle(frames[0])
                except Exception as exc:  # never leave the REQ peer without an answer
                    log.exception("task request failed")
                    reply = TaskReply(False, self.prompt, f"internal error: {exc}", changes=self.changes)
                sock.send(reply.encode())
        except zmq.ZMQError:
            if not self._closing.is_set():  # the socket closed under a shutdown: nothing to answer
                raise

    def handle(self, data: bytes) -> TaskReply:
        """One request -> its reply. The instruction is taken where it is acceptable, then the
        hold set: a refused instruction leaves the hold as it was (one request, one outcome)."""
        changes, prompt = self.current
        try:
            req = decode_task_request(data)
        except ValueError as exc:
            return self._refuse(str(exc), prompt, changes)
        if req.prompt is None and req.hold is None:
            self.metrics.task_requests.labels("query").inc()
            return TaskReply(True, prompt, changes=changes, holding=self.holding)
        tokens = room = 0
        if req.prompt is not None and req.prompt != prompt:
            asked = req.prompt
            problem = task_prompt_problem(asked)
            if not problem and not self.cfg.any_prompt and asked not in self.declared:
                problem = "not a declared instruction (task.any_prompt = false: model.prompt or one of task.prompts)"
            if problem:
                return self._refuse(problem, prompt, changes)
            fit = self.check(asked)
            tokens, room = fit.tokens or 0, fit.room or 0
            if not fit.fits:
                return self._refuse(fit.problem(), prompt, changes, tokens, room)
            changes, prompt = changes + 1, asked
            self.current = (changes, prompt)
            self.metrics.task_requests.labels("taken").inc()
            self.metrics.task_instruction.set(changes)
            log.info("task: now %r (%s): the next chunk runs it", prompt,
                     f"{tokens} of {room} prompt tokens" if tokens and room else "prompt length not checked")
        elif req.prompt is not None:
            self.metrics.task_requests.labels("unchanged").inc()
        if req.hold is not None and req.hold != self.holding:
            if req.hold:
                self.holds += 1  # before `holding`: the clock never sees the hold without its count
            self.holding = req.hold
            self.metrics.task_requests.labels("hold" if req.hold else "release").inc()
            self.metrics.task_holding.set(int(req.hold))
            if req.hold:
                log.warning("task: robot held by the operator (HOLD | PAUSED)")
            else:
                log.info("task: hold released: a fresh chunk starts")
        return TaskReply(True, prompt, tokens=tokens, room=room, changes=changes, holding=self.holding)

    def _refuse(self, why: str, prompt: str, changes: int, tokens: int = 0, room: int = 0) -> TaskReply:
        self.refused += 1
        self.metrics.task_requests.labels("refused").inc()
        log.warning("task: instruction refused: %s; still %r", why, prompt)
        return TaskReply(False, prompt, why, tokens, room, changes, self.holding)


def request_instruction(endpoint: str, prompt: str | None = None, timeout_s: float = 10.0, context: Any = None,
                        hold: bool | None = None) -> TaskReply:
    """A client's side: ask the daemon at `endpoint` to run `prompt` and / or to hold (True) or
    release (False) the robot (neither: only ask which instruction runs) and return its reply.
    TimeoutError if none comes within `timeout_s` (the daemon answers after the worker's check,
    which waits for the inference in flight)."""
    import zmq

    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ValueError(f"endpoint {endpoint!r}: {exc} (expected tcp://host:port or ipc://path)") from None
        sock.send(encode_task_request(prompt, hold))
        if not sock.poll(round(timeout_s * 1000)):
            raise TimeoutError(f"no answer from {endpoint} within {timeout_s:g} s (is the daemon running with task.endpoint?)")
        return TaskReply.decode(sock.recv())
    finally:
        sock.close()
