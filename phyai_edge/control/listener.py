"""What a subscriber sees: rate, sequence gaps and repeats, publish-to-receive latency, flags.

Used by `phyai-edge listen`, the jitter benchmark and the tests. Latency uses the header's
CLOCK_MONOTONIC publish time, so it is meaningful when the subscriber runs on the daemon's host
(pass --wall for hosts synchronised by PTP, using the CLOCK_REALTIME field).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from phyai_edge.control.clock import LatenessLog
from phyai_edge.control.protocol import KIND_ACTION, Flag, decode_actions

# Messages whose latency and interval the percentiles and the rate are over: 87 min at 50 Hz.
WINDOW = 1 << 18


@dataclass
class ListenStats:
    received: int = 0
    chunks: int = 0
    gaps: int = 0  # messages missing between consecutive sequence numbers
    repeats: int = 0  # sequence numbers seen again (or going backwards) within a session
    sessions: int = 0
    # Messages a restarted daemon sent before this subscriber heard it: seq starts at 0, and a SUB
    # rejoins a new PUB only on its next reconnect. Not gaps (no session was seen to skip them), but
    # lost to a controller all the same; a subscriber that joins a running daemon counts none.
    restart_missed: int = 0
    bad: int = 0
    first_seq: int = -1
    last_seq: int = -1
    flags: dict[str, int] = field(default_factory=dict)
    # The last WINDOW messages' latency and arrival interval (a listener left running for days kept
    # every one: ~330 MB a day at 50 Hz); the maxima are the whole run's.
    latency_ns: LatenessLog = field(default_factory=lambda: LatenessLog(WINDOW))
    interval_ns: LatenessLog = field(default_factory=lambda: LatenessLog(WINDOW))
    latency_max_ns: int | None = None
    interval_max_ns: int | None = None
    nonfinite: int = 0

    def summary(self) -> dict[str, Any]:
        lat = self.latency_ns.samples().astype(np.float64) / 1e3
        iv = self.interval_ns.samples().astype(np.float64) / 1e6
        nan = float("nan")

        def pct(a: np.ndarray, q: float) -> float:
            return float(np.percentile(a, q)) if a.size else float("nan")

        return {
            "received": self.received,
            "chunks": self.chunks,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "gaps": self.gaps,
            "repeats": self.repeats,
            "sessions": self.sessions,
            "restart_missed": self.restart_missed,
            "bad_messages": self.bad,
            "nonfinite_payloads": self.nonfinite,
            "rate_hz": (1e3 / float(np.mean(iv))) if iv.size else nan,
            "interval_ms": {"p50": pct(iv, 50), "p99": pct(iv, 99),
                            "max": self.interval_max_ns / 1e6 if self.interval_max_ns is not None else nan},
            "latency_us": {"p50": pct(lat, 50), "p99": pct(lat, 99),
                           "max": self.latency_max_ns / 1e3 if self.latency_max_ns is not None else nan},
            "flags": dict(self.flags),
        }


class Listener:
    """Subscribe to an action endpoint; `poll(timeout_s)` handles what arrived."""

    def __init__(self, endpoint: str, topic: str = "action", chunk_topic: str = "", wall_clock: bool = False,
                 keep: bool = False, context: Any = None, priority: int = 0) -> None:
        import zmq

        self._zmq = zmq
        if context is None and priority > 0:
            from phyai_edge.control.clock import fifo_permitted

            # ZeroMQ's I/O thread receives for us: a real-time subscriber needs it real-time too.
            context = zmq.Context()
            if fifo_permitted(priority):
                context.set(zmq.THREAD_SCHED_POLICY, os.SCHED_FIFO)
                context.set(zmq.THREAD_PRIORITY, priority)
        self.ctx = context or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 100000)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if chunk_topic:
            self.sock.setsockopt(zmq.SUBSCRIBE, chunk_topic.encode())
        self.sock.connect(endpoint)
        self.wall = wall_clock
        self.stats = ListenStats()
        self.keep = keep
        self.messages: list[tuple[Any, np.ndarray]] = []  # (header, values) when keep=True
        self._session: int | None = None
        self._last_recv_ns = 0

    def poll(self, timeout_s: float) -> int:
        """Receive everything that arrives within `timeout_s` (at least one wait). Returns count."""
        zmq = self._zmq
        n = 0
        if not self.sock.poll(int(timeout_s * 1000)):
            return 0
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            recv_mono, recv_wall = time.monotonic_ns(), time.time_ns()
            n += 1
            self.handle(frames, recv_mono, recv_wall)

    def handle(self, frames: list[bytes], recv_mono: int, recv_wall: int) -> None:
        st = self.stats
        try:
            _, h, values = decode_actions(frames)
        except ValueError:
            st.bad += 1
            return
        if self.keep:
            self.messages.append((h, values.copy()))
        if h.kind != KIND_ACTION:
            st.chunks += 1
            return
        st.received += 1
        if not np.isfinite(values).all():
            st.nonfinite += 1
        if self._session != h.session:
            if self._session is not None:
                st.restart_missed += h.seq
                # The gap across a restart is the outage, not the daemon's period: the rate and
                # the intervals are the sessions' own.
                self._last_recv_ns = 0
            self._session = h.session
            st.sessions += 1
            st.first_seq = h.seq if st.first_seq < 0 else st.first_seq
            st.last_seq = h.seq
        elif h.seq <= st.last_seq:
            st.repeats += 1  # and last_seq stays: the numbers after it are not gaps
        else:
            st.gaps += h.seq - st.last_seq - 1
            st.last_seq = h.seq
        if self._last_recv_ns:
            interval = recv_mono - self._last_recv_ns
            st.interval_ns.add(interval)
            st.interval_max_ns = interval if st.interval_max_ns is None else max(st.interval_max_ns, interval)
        self._last_recv_ns = recv_mono
        latency = (recv_wall - h.publish_wall_ns) if self.wall else (recv_mono - h.publish_mono_ns)
        st.latency_ns.add(latency)
        st.latency_max_ns = latency if st.latency_max_ns is None else max(st.latency_max_ns, latency)
        for f in Flag:
            if h.flags & f:
                st.flags[f.name] = st.flags.get(f.name, 0) + 1

    def close(self) -> None:
        self.sock.close(0)
