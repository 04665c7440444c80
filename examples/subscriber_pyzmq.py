"""Minimal motor-controller side of docs/protocol.md in plain pyzmq (no phyai_edge import).

    python examples/subscriber_pyzmq.py [tcp://127.0.0.1:5555] [count]
"""

import struct
import sys
import time

import numpy as np
import zmq

HEADER = struct.Struct("<4sHHIIQqqqIHHHHI")  # 64 bytes, see docs/protocol.md section 1
HOLD, SHUTDOWN = 0x001, 0x080
# A silent stream means HOLD too (protocol.md section 1): a daemon killed without its SHUTDOWN
# message, or a cable pulled, sends nothing at all. A few control periods (5 at 50 Hz).
SILENT_MS = 100

endpoint = sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:5555"
count = int(sys.argv[2]) if len(sys.argv) > 2 else 500

sock = zmq.Context().socket(zmq.SUB)
sock.setsockopt(zmq.RCVTIMEO, SILENT_MS)
sock.connect(endpoint)
sock.setsockopt(zmq.SUBSCRIBE, b"action")

last_seq, session = None, None
received, silent = 0, False
while received < count:
    try:
        topic, header, payload = sock.recv_multipart()
    except zmq.Again:
        if not silent and session is not None:
            print(f"no message for {SILENT_MS} ms: HOLD (the daemon stopped or the link is down)", flush=True)
            silent = True
        # A real controller would hold the motors here until messages come again.
        continue
    silent = False
    received += 1
    now = time.monotonic_ns()
    magic, version, kind, flags, sess, seq, pub_mono, _, _, chunk_id, index, rows, dim, _, _ = HEADER.unpack(header)
    if magic != b"PHYA" or version != 1:
        raise SystemExit(f"unknown message: magic {magic!r} version {version}")
    if sess != session:
        session, last_seq = sess, None  # a (re)started daemon
    if last_seq is not None and seq != last_seq + 1:
        print(f"lost {seq - last_seq - 1} message(s) before seq {seq}")
    last_seq = seq
    action = np.frombuffer(payload, dtype="<f4", count=dim)
    what = "HOLD" if flags & HOLD else f"chunk {chunk_id}[{index}]"
    print(f"seq {seq:6d} {what:14s} latency {(now - pub_mono) / 1e3:7.1f} us  action[:4] {np.round(action[:4], 3)}")
    # A real controller would send `action` to the motors unless HOLD is set.
    if flags & SHUTDOWN:
        break
