"""ZeroMQ PUB of one action per tick (and, optionally, the whole chunk when one is adopted).

The publisher owns the sequence number: it increments by exactly one per action message, HOLD
messages included, so a controller can detect every lost message.
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np

from phyai_edge.control.protocol import KIND_CHUNK, ActionHeader, encode_actions


class ActionPublisher:
    def __init__(self, endpoint: str, topic: str, chunk_topic: str = "", bind: bool = True, sndhwm: int = 1000, context: Any = None) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = context or zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, sndhwm)
        self.sock.setsockopt(zmq.LINGER, 200)
        if bind:
            self.sock.bind(endpoint)
        else:
            self.sock.connect(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT) if bind else endpoint
        self.topic = topic.encode()
        self.chunk_topic = chunk_topic.encode()
        # A fresh session id tells subscribers that a restarted daemon's seq 0 is not a repeat.
        self.session = random.getrandbits(32)
        self.seq = 0
        self.chunks_sent = 0

    def publish(self, values: np.ndarray, flags: int, obs_time_s: float, chunk_id: int, index: int,
                instruction: int = 0) -> ActionHeader:
        header = ActionHeader(
            seq=self.seq,
            publish_mono_ns=time.monotonic_ns(),
            publish_wall_ns=time.time_ns(),
            obs_mono_ns=round(obs_time_s * 1e9) if obs_time_s else 0,
            chunk_id=chunk_id,
            index=index,
            rows=1,
            dim=values.shape[-1],
            flags=int(flags),
            session=self.session,
            instruction=instruction,
        )
        self.sock.send_multipart(encode_actions(self.topic, header, values), copy=True)
        self.seq += 1
        return header

    def publish_chunk(self, actions: np.ndarray, first_index: int, first_seq: int, obs_time_s: float, chunk_id: int,
                      flags: int = 0, instruction: int = 0) -> None:
        """Rows [first_index, H) of an adopted chunk; row 0 is the action published with `first_seq`."""
        if not self.chunk_topic:
            return
        rows = np.ascontiguousarray(actions[first_index:], dtype=np.float32)
        header = ActionHeader(
            seq=first_seq,
            publish_mono_ns=time.monotonic_ns(),
            publish_wall_ns=time.time_ns(),
            obs_mono_ns=round(obs_time_s * 1e9),
            chunk_id=chunk_id,
            index=first_index,
            rows=rows.shape[0],
            dim=rows.shape[1],
            flags=int(flags),
            session=self.session,
            kind=KIND_CHUNK,
            instruction=instruction,
        )
        self.sock.send_multipart(encode_actions(self.chunk_topic, header, rows), copy=True)
        self.chunks_sent += 1

    def close(self, linger_ms: int = 200) -> None:
        self.sock.close(linger_ms)
