"""Robot state sources: the motor controller's joint-state stream over ZeroMQ, or a synthetic one.

Both are polled on the clock thread (`latest()` never blocks). The ZeroMQ SUB uses ZMQ_CONFLATE,
so however fast the controller publishes, one receive gives the newest sample.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from phyai_edge.control.config import StateConfig
from phyai_edge.control.log import worth_logging

log = logging.getLogger("phyai_edge.control")

# A reading this old on arrival is past any sane age limit: its time is almost surely on another
# clock than the one `clock` names, and every reading will count as stale.
ARRIVAL_AGE_WARN_S = 1.0


def arrival_age_hint(key: str, clock: str, mono_field: str, mono_ns: int, wall_field: str, wall_ns: int) -> str:
    """The likely cause of readings that are old on arrival, and the setting (`key`) that fixes it.
    Without it the daemon held STALE on every tick and said only which input was stale."""
    field, stamp = (mono_field, mono_ns) if clock == "monotonic" else (wall_field, wall_ns)
    if stamp == 0:
        cause = f"the sender leaves {field} at 0"
    elif clock == "monotonic":
        cause = "the sender is on another host, whose CLOCK_MONOTONIC is not this one's"
    else:
        cause = "the hosts' CLOCK_REALTIME disagree (PTP or NTP not synchronised)"
    other = 'set it to "realtime" (hosts synchronised by PTP/NTP) or "receive"' if clock == "monotonic" else 'set it to "receive"'
    return f"{cause}? Fix the sender, or {other} ({key} = {clock!r} now)"


@dataclass(frozen=True)
class StateSample:
    values: np.ndarray  # float32 (state_dim,)
    time_s: float  # time.monotonic() seconds of the sample
    seq: int
    estop: bool = False


class StateSource(Protocol):
    def start(self) -> None: ...

    def latest(self) -> StateSample | None: ...

    def stop(self) -> None: ...

    def describe(self) -> str: ...


class SyntheticState:
    """Slow sinusoids, sampled at 500 Hz on demand. `alive = False` freezes it (tests: stale state)."""

    def __init__(self, dim: int, rate_hz: float = 500.0) -> None:
        self.dim = dim
        self.rate_hz = rate_hz
        self.alive = True
        self.estop = False
        self._last: StateSample | None = None
        self._phase = np.arange(dim, dtype=np.float64) * 0.7

    def start(self) -> None:
        pass

    def latest(self) -> StateSample | None:
        if self.alive:
            k = int(time.monotonic() * self.rate_hz)
            if self._last is None or self._last.seq != k or self._last.estop != self.estop:
                t = k / self.rate_hz
                values = (0.3 * np.sin(2 * math.pi * 0.2 * t + self._phase)).astype(np.float32)
                self._last = StateSample(values, t, k, self.estop)
        return self._last

    def stop(self) -> None:
        pass

    def describe(self) -> str:
        return f"synthetic ({self.dim} values)"


class ZmqState:
    def __init__(self, cfg: StateConfig, dim: int, context: Any = None) -> None:
        import zmq

        self._zmq = zmq
        self.cfg = cfg
        self.dim = dim
        self._ctx = context or zmq.Context.instance()
        self._sock: Any = None
        self._last: StateSample | None = None
        self.bad_messages = 0
        self.old_on_arrival = 0  # samples already older than ARRIVAL_AGE_WARN_S when they arrived

    def start(self) -> None:
        from phyai_edge.control.protocol import STATE_MAGIC

        zmq = self._zmq
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.CONFLATE, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, STATE_MAGIC)
        sock.connect(self.cfg.endpoint)
        self._sock = sock

    def latest(self) -> StateSample | None:
        from phyai_edge.control.protocol import STATE_FLAG_ESTOP, StateMessage

        zmq = self._zmq
        while self._sock is not None:
            try:
                raw = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            recv_s = time.monotonic()
            msg = None
            try:
                msg = StateMessage.decode(raw.buffer)
                if self.dim and msg.values.size != self.dim:  # 0: any width (`--preflight` before the policy says)
                    raise ValueError(f"{msg.values.size} values, the policy expects {self.dim}")
                if not np.isfinite(msg.values).all():
                    raise ValueError("non-finite values (NaN or Inf)")
            except ValueError as exc:
                self.bad_messages += 1
                if self.bad_messages in (1, 10, 100) or self.bad_messages % 1000 == 0:
                    log.warning("state: bad message (%s); %d so far", exc, self.bad_messages)
                if msg is not None and msg.flags & STATE_FLAG_ESTOP and self._last is not None:
                    # The values are unusable, the e-stop is not: hold now, not when the last good
                    # sample ages out (and as an e-stop, not as stale state).
                    self._last = replace(self._last, estop=True)
                continue
            if self.cfg.clock == "monotonic":
                t = msg.mono_ns / 1e9
            elif self.cfg.clock == "realtime":
                t = recv_s - (time.time_ns() - msg.wall_ns) / 1e9
            else:
                t = recv_s
            # Never later than its arrival: a sender whose clock runs ahead (another host, not
            # synchronised) would otherwise keep its last sample fresh long after its stream stopped.
            t = min(t, recv_s)
            if recv_s - t > ARRIVAL_AGE_WARN_S:
                self.old_on_arrival += 1
                if worth_logging(self.old_on_arrival):
                    log.warning("state: sample %d was %.1f s old on arrival (%d so far): %s", msg.seq, recv_s - t,
                                self.old_on_arrival, arrival_age_hint("state.clock", self.cfg.clock, "mono_ns",
                                                                      msg.mono_ns, "wall_ns", msg.wall_ns))
            self._last = StateSample(msg.values, t, msg.seq, bool(msg.flags & STATE_FLAG_ESTOP))
        return self._last

    def stop(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def describe(self) -> str:
        return f"zmq {self.cfg.endpoint}"


def make_state(cfg: StateConfig, dim: int, context: Any = None) -> StateSource:
    if cfg.source == "synthetic":
        return SyntheticState(dim)
    return ZmqState(cfg, dim, context)
