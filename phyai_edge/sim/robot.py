"""The simulated robot process: its own 50 Hz clock, physics and cameras, talking ZeroMQ to the daemon.

Per control step (period T = 1 / control_hz, absolute deadlines on CLOCK_MONOTONIC):
  1. drain the action SUB socket; check every message's sequence number; apply the newest
     action unless it is flagged HOLD / ESTOP / SHUTDOWN, in which case the last applied target
     is held (the robot's own last target, not the HOLD payload: that is the daemon's guess);
  2. step the physics one period (10 MuJoCo substeps of 2 ms);
  3. publish the 14 joint values on the state endpoint (the daemon's `state.endpoint`);
  4. render each ZeroMQ camera of the daemon's config at its own rate (every `every` steps, from
     its fps) and publish it with its capture time (the time of the physics state it shows, the
     same for every camera of one step) and a per-camera sequence.
The wire formats are `phyai_edge.control.protocol` (docs/protocol.md); that module needs only
numpy, so the daemon's torch side is never imported here.

SIGUSR1 stops the camera stream (the PUB sockets are closed, as if the camera process died) and
SIGUSR2 starts it again; SIGINT / SIGTERM end the run. Everything received and applied is kept
in a `SimLog` (saved as .npz) so a test or `phyai-edge sim --report` can check it afterwards.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from phyai_edge.control.protocol import (
    ActionHeader,
    Flag,
    FrameMessage,
    StateMessage,
    decode_actions,
)
from phyai_edge.sim.aloha import JOINT_NAMES, AlohaSim, RenderSettings

log = logging.getLogger("phyai_edge.sim")

# Flags after which the robot must not move to the payload.
NO_MOTION = Flag.HOLD | Flag.ESTOP | Flag.SHUTDOWN


@dataclass
class CameraStream:
    """One simulated camera: which MuJoCo camera, at what size, under which topic, on which PUB."""

    name: str  # the topic name in the frame header (the daemon's `topic`, or its camera name)
    mujoco_camera: str
    endpoint: str
    width: int = 640
    height: int = 480
    seq: int = 0
    every: int = 0  # render every N control steps (its fps); 0: SimSettings.render_every


@dataclass
class SimSettings:
    state_endpoint: str = "tcp://127.0.0.1:5556"
    action_endpoint: str = "tcp://127.0.0.1:5555"
    action_topic: str = "action"
    action_bind: bool = False  # True when the daemon connects its PUB to us (publish.bind = false)
    cameras: list[CameraStream] = field(default_factory=list)
    control_hz: float = 50.0
    render_every: int = 2  # 25 fps frames at 50 Hz control: rendering is the expensive part
    # (a camera's own `every` wins)
    task: str = "transfer_cube"
    seed: int = 0
    render: RenderSettings = field(default_factory=RenderSettings)
    duration_s: float = 0.0  # 0: until a signal
    report_every_s: float = 5.0
    camera_max_age_ms: float = 0.0  # the daemon's limit, from its config: recorded for the report
    # No action message for this many periods is a HOLD (docs/protocol.md: a silent stream); 0: off.
    silent_hold_periods: float = 5.0
    # Scripted camera outages (start_s, length_s) after the first step, for demos and recordings.
    camera_outages: list[tuple[float, float]] = field(default_factory=list)


class SimLog:
    """Columns of what happened, in plain lists while running, as arrays in the .npz."""

    def __init__(self) -> None:
        # one row per control step
        self.step_ns: list[int] = []  # monotonic ns at the step's start (its deadline or later)
        self.step_ms: list[float] = []  # work time of the step (without the sleep)
        self.target: list[np.ndarray] = []  # what the actuators were driven to during the step
        self.joints: list[np.ndarray] = []  # state published after the step
        self.applied_seq: list[int] = []  # seq of the action applied at this step; -1: none new
        self.hold: list[bool] = []  # holding the last target: the daemon said HOLD, or no action yet
        # one row per action message received
        self.rx_seq: list[int] = []
        self.rx_session: list[int] = []
        self.rx_flags: list[int] = []
        self.rx_chunk: list[int] = []
        self.rx_index: list[int] = []
        self.rx_publish_ns: list[int] = []
        self.rx_obs_ns: list[int] = []
        self.rx_recv_ns: list[int] = []
        self.rx_step: list[int] = []
        self.rx_payload: list[np.ndarray] = []
        # one row per frame published
        self.frame_camera: list[str] = []
        self.frame_seq: list[int] = []
        self.frame_capture_ns: list[int] = []
        self.frame_sent_ns: list[int] = []
        self.frame_render_ms: list[float] = []
        # events: ("camera_stop" | "camera_start" | ..., monotonic ns)
        self.events: list[tuple[str, int]] = []

    def save(self, path: str, meta: dict[str, Any]) -> None:
        with open(path, "wb") as f:  # a file object: savez would append ".npz" to a bare name
            self._savez(f, meta)

    def _savez(self, f: Any, meta: dict[str, Any]) -> None:
        import json

        def arr(values: list[Any], dtype: Any, shape: tuple[int, ...] = ()) -> np.ndarray:
            return np.asarray(values, dtype=dtype) if values else np.zeros((0, *shape), dtype=dtype)

        np.savez_compressed(
            f,
            step_ns=arr(self.step_ns, np.int64),
            step_ms=arr(self.step_ms, np.float32),
            target=arr(self.target, np.float32, (14,)),
            joints=arr(self.joints, np.float32, (14,)),
            applied_seq=arr(self.applied_seq, np.int64),
            hold=arr(self.hold, bool),
            rx_seq=arr(self.rx_seq, np.int64),
            rx_session=arr(self.rx_session, np.int64),
            rx_flags=arr(self.rx_flags, np.int64),
            rx_chunk=arr(self.rx_chunk, np.int64),
            rx_index=arr(self.rx_index, np.int64),
            rx_publish_ns=arr(self.rx_publish_ns, np.int64),
            rx_obs_ns=arr(self.rx_obs_ns, np.int64),
            rx_recv_ns=arr(self.rx_recv_ns, np.int64),
            rx_step=arr(self.rx_step, np.int64),
            rx_payload=arr(self.rx_payload, np.float32, (14,)),
            frame_camera=arr(self.frame_camera, str),
            frame_seq=arr(self.frame_seq, np.int64),
            frame_capture_ns=arr(self.frame_capture_ns, np.int64),
            frame_sent_ns=arr(self.frame_sent_ns, np.int64),
            frame_render_ms=arr(self.frame_render_ms, np.float32),
            event_kind=arr([e[0] for e in self.events], str),
            event_ns=arr([e[1] for e in self.events], np.int64),
            meta=np.asarray(json.dumps(meta)),
        )


class SeqChecker:
    """Sequence numbers per daemon session: counts gaps (lost messages) and repeats."""

    def __init__(self) -> None:
        self.session: int | None = None
        self.last: int | None = None
        self.gaps = 0
        self.lost = 0
        self.repeats = 0
        self.sessions = 0

    def stale(self, header: ActionHeader) -> bool:
        """Not newer than the last seq of its session: a repeat or an older message."""
        return header.session == self.session and self.last is not None and header.seq <= self.last

    def check(self, header: ActionHeader) -> str | None:
        """Returns a message describing a problem, or None when this seq follows the last."""
        if header.session != self.session:
            # A new daemon (or the first message we hear): its first seq is where we start.
            self.session, self.last = header.session, header.seq
            self.sessions += 1
            return None
        assert self.last is not None
        expected = self.last + 1
        self.last = max(self.last, header.seq)
        if header.seq == expected:
            return None
        if header.seq < expected:
            self.repeats += 1
            return f"seq {header.seq} repeated or out of order (expected {expected})"
        self.gaps += 1
        self.lost += header.seq - expected
        return f"seq gap: expected {expected}, got {header.seq} ({header.seq - expected} lost)"


class SimRobot:
    def __init__(self, settings: SimSettings, log_data: bool = True, context: Any = None) -> None:
        import zmq

        self.s = settings
        self._zmq = zmq
        self._ctx = context or zmq.Context.instance()
        self.sim = AlohaSim(settings.task, 1.0 / settings.control_hz, settings.render, settings.seed)
        self.log = SimLog() if log_data else None
        self.seq = SeqChecker()
        self.state_seq = 0
        self.steps = 0  # control steps completed: what a summary after a failed loop reports
        self.received = 0
        self.applied = 0
        self.superseded = 0  # received but replaced by a newer one before the step applied it
        self.hold_steps = 0  # steps held because of HOLD / ESTOP / SHUTDOWN, or before any action
        self.idle_steps = 0
        self.stale_dropped = 0  # repeated or older seqs of the session: received, never applied
        self.late_steps = 0
        self.hold_flags_seen = 0
        self._stop = False
        self._camera_wanted = True
        self._camera_pubs: dict[str, Any] = {}
        # Bounded: with status lines off (--report-every 0) nothing would ever clear them.
        self._recent_latency_ms: deque[float] = deque(maxlen=4096)
        self._recent_render_ms: deque[float] = deque(maxlen=4096)
        self.last_flags = 0
        self._pending: list[tuple[ActionHeader, np.ndarray]] = []
        self._last_rx_ns: int | None = None  # arrival of the newest well-formed action message
        self._sub: Any = None
        self._state_pub: Any = None
        missing = [c.mujoco_camera for c in settings.cameras if c.mujoco_camera not in self.sim.camera_names()]
        if missing:
            raise ValueError(
                f"camera {missing[0]!r} is not in the ALOHA scene (it has {', '.join(self.sim.camera_names())})"
            )

    # ------------------------------------------------------------ sockets

    def open(self) -> None:
        zmq = self._zmq
        self._state_pub = self._ctx.socket(zmq.PUB)
        self._state_pub.setsockopt(zmq.LINGER, 0)
        # A small queue: the daemon conflates anyway, and a backlog would only add age.
        self._state_pub.setsockopt(zmq.SNDHWM, 10)
        self._state_pub.bind(self.s.state_endpoint)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.s.action_topic.encode())
        if self.s.action_bind:
            self._sub.bind(self.s.action_endpoint)
        else:
            self._sub.connect(self.s.action_endpoint)
        self._open_cameras()

    def _open_cameras(self) -> None:
        zmq = self._zmq
        for endpoint in sorted({c.endpoint for c in self.s.cameras}):
            sock = self._ctx.socket(zmq.PUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 2)  # never queue old frames behind new ones
            # Rebinding right after a close can race the old socket's teardown in the I/O thread.
            for attempt in range(50):
                try:
                    sock.bind(endpoint)
                    break
                except zmq.ZMQError:
                    if attempt == 49:
                        sock.close(0)
                        raise
                    time.sleep(0.02)
            self._camera_pubs[endpoint] = sock

    def _close_cameras(self) -> None:
        for sock in self._camera_pubs.values():
            sock.close(0)
        self._camera_pubs.clear()

    def close(self) -> None:
        self._close_cameras()
        for sock in (self._sub, self._state_pub):
            if sock is not None:
                sock.close(0)
        self._sub = self._state_pub = None
        self.sim.close()

    # ------------------------------------------------------------ control

    def stop(self) -> None:
        self._stop = True

    def camera_off(self) -> None:
        self._camera_wanted = False

    def camera_on(self) -> None:
        self._camera_wanted = True

    def install_signal_handlers(self) -> None:
        # Handlers only set flags; the loop acts on them between steps (sockets are not signal-safe).
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGUSR1, lambda *_: self.camera_off())
        signal.signal(signal.SIGUSR2, lambda *_: self.camera_on())

    def _event(self, kind: str, detail: str = "") -> None:
        now = time.monotonic_ns()
        if self.log is not None:
            self.log.events.append((kind, now))
        log.info("%s%s", kind.replace("_", " "), f" ({detail})" if detail else "")

    def _drain(self, step: int) -> None:
        """Receive every waiting action message, stamp its arrival, check its seq, keep it pending."""
        zmq = self._zmq
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            recv_ns = time.monotonic_ns()
            try:
                _, header, values = decode_actions(frames)
            except ValueError as exc:
                log.warning("bad action message: %s", exc)
                continue
            if header.rows != 1 or header.dim != 14:
                log.warning("action seq %d: %dx%d values, the ALOHA needs 1x14; ignored", header.seq, header.rows, header.dim)
                continue
            # A repeated or older message is logged and counted but never applied: it would move
            # the arm back to a command the daemon has already replaced.
            stale = self.seq.stale(header)
            problem = self.seq.check(header)
            if problem:
                log.warning("%s%s", problem, "; not applied" if stale else "")
            self.received += 1
            self._last_rx_ns = recv_ns
            if header.flags & Flag.HOLD:
                self.hold_flags_seen += 1
            if stale:
                self.stale_dropped += 1
            else:
                self._pending.append((header, values[0]))
            self._recent_latency_ms.append((recv_ns - header.publish_mono_ns) / 1e6)
            lg = self.log
            if lg is not None:
                lg.rx_seq.append(header.seq)
                lg.rx_session.append(header.session)
                lg.rx_flags.append(int(header.flags))
                lg.rx_chunk.append(header.chunk_id)
                lg.rx_index.append(header.index)
                lg.rx_publish_ns.append(header.publish_mono_ns)
                lg.rx_obs_ns.append(header.obs_mono_ns)
                lg.rx_recv_ns.append(recv_ns)
                lg.rx_step.append(step)
                lg.rx_payload.append(np.array(values[0], dtype=np.float32))

    def _wait_until(self, deadline_ns: int, step: int) -> None:
        """Sleep to the deadline on the action socket, so arrivals are stamped when they happen
        (not at the next step): the log then separates transport from waiting for our clock."""
        zmq = self._zmq
        while True:
            self._drain(step)
            remaining_ms = (deadline_ns - time.monotonic_ns()) / 1e6
            if remaining_ms <= 0:
                return
            # zmq's poll timeout is whole milliseconds; sleep the sub-millisecond rest plainly.
            if remaining_ms < 1.0:
                time.sleep(remaining_ms / 1e3)
                continue
            self._sub.poll(int(remaining_ms), zmq.POLLIN)

    def _take_newest(self) -> tuple[ActionHeader, np.ndarray] | None:
        if not self._pending:
            return None
        self.superseded += len(self._pending) - 1
        newest = self._pending[-1]
        self._pending.clear()
        return newest

    def _publish_frames(self, step: int = 0) -> None:
        """Render and publish the cameras due at `step`."""
        # The capture time is when the physics was in the state the image shows (like a camera's
        # exposure), so rendering and encoding count towards the frame's age. Read once for all
        # cameras: they show the same state, and a camera rendered after another would otherwise
        # look younger by the other's render time. Both clocks are read together: a daemon with
        # `clock = "realtime"` must see the same age.
        capture_ns, capture_wall_ns = time.monotonic_ns(), time.time_ns()
        for cam in self.s.cameras:
            sock = self._camera_pubs.get(cam.endpoint)
            if sock is None or step % (cam.every or self.s.render_every):
                continue
            t0 = time.perf_counter()
            image = self.sim.render(cam.mujoco_camera, cam.width, cam.height)
            render_ms = (time.perf_counter() - t0) * 1e3
            msg = FrameMessage(cam.name, image, cam.seq, capture_ns, capture_wall_ns)
            sock.send(msg.encode(), copy=False)
            sent_ns = time.monotonic_ns()
            self._recent_render_ms.append(render_ms)
            if self.log is not None:
                self.log.frame_camera.append(cam.name)
                self.log.frame_seq.append(cam.seq)
                self.log.frame_capture_ns.append(capture_ns)
                self.log.frame_sent_ns.append(sent_ns)
                self.log.frame_render_ms.append(render_ms)
            cam.seq += 1

    def run(self, on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
        """The control loop; returns the summary. `on_step(step)` runs after each step (tests)."""
        s = self.s
        if self._sub is None:
            self.open()
        period_ns = round(1e9 / s.control_hz)
        target = self.sim.target.astype(np.float32)
        holding = True  # until the first motion action: keep the start pose
        start_ns = time.monotonic_ns()
        next_ns = start_ns
        end_ns = start_ns + round(s.duration_s * 1e9) if s.duration_s else None
        last_report_ns = start_ns
        outages = sorted((start_ns + round(a * 1e9), start_ns + round((a + b) * 1e9)) for a, b in s.camera_outages)
        cameras_live = True
        step = 0
        log.info(
            "sim: %s at %g Hz, state on %s, actions from %s, cameras: %s",
            s.task, s.control_hz, s.state_endpoint, s.action_endpoint,
            ", ".join(f"{c.name} every {c.every or s.render_every} steps" for c in s.cameras) or "none",
        )
        while not self._stop and (end_ns is None or next_ns < end_ns):
            self._wait_until(next_ns, step)
            t_step = time.monotonic_ns()
            if t_step - next_ns > period_ns:
                # Overran by more than a period: do not run the missed steps back to back (a real
                # robot cannot either); realign the grid and count it.
                self.late_steps += 1
                next_ns = t_step
            next_ns += period_ns

            # Scripted outages and signals both end up here, between steps.
            wanted = self._camera_wanted and not any(a <= t_step < b for a, b in outages)
            if wanted != cameras_live:
                if wanted:
                    self._open_cameras()
                    self._event("camera_start", "frames flowing again")
                else:
                    self._close_cameras()
                    self._event("camera_stop", "PUB sockets closed")
                cameras_live = wanted

            self._drain(step)
            newest = self._take_newest()
            applied_seq = -1
            if newest is not None:
                header, values = newest
                self.last_flags = int(header.flags)
                was_holding = holding
                if not header.flags & NO_MOTION and np.isfinite(values).all():
                    target = np.asarray(values, dtype=np.float32)
                    applied_seq = header.seq
                    holding = False
                    self.applied += 1
                else:
                    holding = True
                if holding != was_holding:
                    # Transitions only: one line per HOLD episode, with the seq that caused it.
                    lag_ms = (time.monotonic_ns() - header.publish_mono_ns) / 1e6
                    if holding:
                        self._event("hold_start", f"seq {header.seq} {flag_names(header.flags)}, published {lag_ms:.1f} ms ago")
                    else:
                        self._event("hold_end", f"seq {header.seq} chunk {header.chunk_id} index {header.index}, "
                                    f"published {lag_ms:.1f} ms ago")
            silent_ns = round(s.silent_hold_periods * period_ns)
            if not holding and silent_ns and self._last_rx_ns is not None and t_step - self._last_rx_ns > silent_ns:
                # A silent stream is a HOLD (docs/protocol.md). The target stays as it is anyway;
                # this makes the HOLD visible (events, status line, log) until the next action.
                holding = True
                self._event("hold_start", f"no action message for {(t_step - self._last_rx_ns) / 1e6:.0f} ms")
            if holding:
                self.hold_steps += 1
            elif applied_seq < 0:
                # No new action this step although the daemon is not holding: its clock and ours
                # drifted by a period's phase (the next step takes two). The target stays.
                self.idle_steps += 1
            self.sim.step(target)
            joints = self.sim.joint_state()
            self._state_pub.send(StateMessage(joints, self.state_seq, time.monotonic_ns(), time.time_ns()).encode())
            self.state_seq += 1
            if cameras_live:
                self._publish_frames(step)
            work_ms = (time.monotonic_ns() - t_step) / 1e6
            lg = self.log
            if lg is not None:
                lg.step_ns.append(t_step)
                lg.step_ms.append(work_ms)
                lg.target.append(target.copy())
                lg.joints.append(joints)
                lg.applied_seq.append(applied_seq)
                lg.hold.append(holding)
            step += 1
            self.steps = step
            if on_step is not None:
                on_step(step)
            if s.report_every_s and t_step - last_report_ns >= s.report_every_s * 1e9:
                self._report(step, (t_step - last_report_ns) / 1e9)
                last_report_ns = t_step
        return self.summary(step, (time.monotonic_ns() - start_ns) / 1e9)

    def _report(self, step: int, window_s: float) -> None:
        lat = np.asarray(self._recent_latency_ms) if self._recent_latency_ms else np.full(1, np.nan)
        ren = np.asarray(self._recent_render_ms) if self._recent_render_ms else np.full(1, np.nan)
        log.info(
            "step %d: %d actions in %.1f s, applied %d, %d steps in HOLD, gaps %d, last flags %s, "
            "transport p50 %.2f ms p99 %.2f ms, render p50 %.1f ms, late steps %d",
            step, len(self._recent_latency_ms), window_s, self.applied, self.hold_steps, self.seq.gaps,
            flag_names(self.last_flags) or "-", np.percentile(lat, 50), np.percentile(lat, 99),
            np.percentile(ren, 50), self.late_steps,
        )
        self._recent_latency_ms.clear()
        self._recent_render_ms.clear()

    def summary(self, steps: int, elapsed_s: float) -> dict[str, Any]:
        return {
            "steps": steps,
            "elapsed_s": elapsed_s,
            "rate_hz": steps / elapsed_s if elapsed_s > 0 else float("nan"),
            "late_steps": self.late_steps,
            "received": self.received,
            "applied": self.applied,
            "superseded": self.superseded,
            "hold_steps": self.hold_steps,
            "idle_steps": self.idle_steps,
            "hold_messages": self.hold_flags_seen,
            "seq_gaps": self.seq.gaps,
            "seq_lost": self.seq.lost,
            "seq_repeats": self.seq.repeats,
            "stale_dropped": self.stale_dropped,
            "sessions": self.seq.sessions,
            "frames": sum(c.seq for c in self.s.cameras),
        }


def _connectable(endpoint: str) -> str:
    """A bind endpoint as a peer connects to it: tcp://*:5555 -> tcp://127.0.0.1:5555."""
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:").replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")


def settings_from_config(cfg: Any, **overrides: Any) -> SimSettings:
    """The robot side of a daemon config: the sim binds what the daemon connects to, and back.

    Every `zmq` camera becomes a rendered MuJoCo camera named by its `topic` (or its own name),
    at the configured size, rendered at its configured fps (rounded to whole control steps).
    Raises ValueError for a robot the simulated ALOHA is not (14 joint targets, 14 state values).
    """
    # Either mismatch ran silently: the sim refused every action (a warning per message) and the
    # daemon every state message, so the loop held for good.
    r = cfg.robot
    for key, value in (("action_dim", r.action_dim), ("state_dim", r.state_dim)):
        if value and value != len(JOINT_NAMES):
            raise ValueError(f"robot.{key}: {value}, but the simulated ALOHA has {len(JOINT_NAMES)} joints "
                             "(0 or 14; the config's robot is not the ALOHA)")
    # The daemon binds its PUB by default and we connect; with publish.bind = false it connects
    # to us and we bind the same address.
    action_endpoint = _connectable(cfg.publish.endpoint) if cfg.publish.bind else cfg.publish.endpoint
    hz = cfg.robot.control_hz
    cams = [
        CameraStream(c.topic or c.name, c.topic or c.name, c.endpoint, c.width, c.height,
                     every=max(1, round(hz / c.fps)))
        for c in cfg.cameras.values()
        if c.source == "zmq"
    ]
    render_every = min((c.every for c in cams), default=1)  # the fastest camera's, as the log's meta records
    if cfg.state.source != "zmq":
        log.warning("the config's state.source is %r: the daemon will not read the sim's joints", cfg.state.source)
    settings = SimSettings(
        state_endpoint=cfg.state.endpoint,
        action_endpoint=action_endpoint,
        action_topic=cfg.publish.topic,
        action_bind=not cfg.publish.bind,
        cameras=cams,
        control_hz=hz,
        render_every=render_every,
        camera_max_age_ms=max((cfg.camera_max_age_s(c) * 1e3 for c in cfg.cameras.values() if c.source == "zmq"),
                              default=0.0),
    )
    for key, value in overrides.items():
        if value is not None:
            setattr(settings, key, value)
    return settings


def flag_names(flags: int) -> str:
    return "|".join(f.name for f in Flag if flags & f and f.name)
