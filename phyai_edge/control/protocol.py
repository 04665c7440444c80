"""The ZeroMQ wire format of the daemon: actions out, robot state and camera frames in.

`docs/protocol.md` is the normative description; this module is its Python implementation and
must stay in step with it (the C subscriber in `examples/` is written from the document alone).
Everything is little-endian. All `*_mono_ns` fields are CLOCK_MONOTONIC nanoseconds of the host
that wrote them, `*_wall_ns` fields are CLOCK_REALTIME nanoseconds (for hosts synchronised by
PTP or NTP). Only numpy and the standard library are imported here, so a controller can use it
without torch.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from enum import IntFlag

import numpy as np

VERSION = 1

# ---------------------------------------------------------------- actions (daemon -> controller)

ACTION_MAGIC = b"PHYA"
KIND_ACTION = 1
KIND_CHUNK = 2

# magic, version, kind, flags, session, seq, publish_mono_ns, publish_wall_ns, obs_mono_ns,
# chunk_id, index, rows, dim, reserved(2), instruction (a reserved u32 until the task channel)
_ACTION_HEADER = struct.Struct("<4sHHIIQqqqIHHHHI")
ACTION_HEADER_SIZE = _ACTION_HEADER.size  # 64


class Flag(IntFlag):
    """Bits of the action header's `flags` field. A controller must treat HOLD as authoritative."""

    HOLD = 1 << 0  # not a policy action: hold (the payload is the configured hold target)
    STALE = 1 << 1  # a camera or the robot state was older than its age limit
    ESTOP = 1 << 2  # the robot state stream reported an emergency stop
    CLAMPED = 1 << 3  # the action was clamped by a position or rate limit
    LATE = 1 << 4  # the clock missed one or more slots before this tick (their actions were skipped)
    NONFINITE = 1 << 5  # the policy produced NaN/Inf; a hold action was published instead
    INFER_FAIL = 1 << 6  # the last inference failed; running out the current chunk or holding
    SHUTDOWN = 1 << 7  # the last message before the daemon exits (always with HOLD)
    WARMUP = 1 << 8  # no chunk yet (start-up or after recovering from stale inputs)
    STARVED = 1 << 9  # the executing chunk ran out before the next one arrived
    CHUNK_START = 1 << 10  # first action published from a newly adopted chunk
    WORKER_DOWN = 1 << 11  # the inference worker process died; set until a restarted one is up and warmed
    PAUSED = 1 << 12  # an operator holds the robot through the task channel (always with HOLD)


@dataclass
class ActionHeader:
    seq: int
    publish_mono_ns: int
    publish_wall_ns: int
    obs_mono_ns: int
    chunk_id: int
    index: int
    rows: int
    dim: int
    flags: int = 0
    session: int = 0
    kind: int = KIND_ACTION
    version: int = VERSION
    # The instruction the chunk was computed with: 0 is model.prompt, n the n-th taken over the
    # task channel (`TaskReply.changes`); 0 for HOLD. Written where version 1 had reserved zeros.
    instruction: int = 0

    def pack(self) -> bytes:
        return _ACTION_HEADER.pack(
            ACTION_MAGIC,
            self.version,
            self.kind,
            int(self.flags),
            self.session,
            self.seq,
            self.publish_mono_ns,
            self.publish_wall_ns,
            self.obs_mono_ns,
            self.chunk_id,
            self.index,
            self.rows,
            self.dim,
            0,
            self.instruction,
        )

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> ActionHeader:
        if len(data) != ACTION_HEADER_SIZE:
            raise ValueError(f"action header: expected {ACTION_HEADER_SIZE} bytes, got {len(data)}")
        magic, version, kind, flags, session, seq, pm, pw, om, cid, idx, rows, dim, _, instruction = _ACTION_HEADER.unpack(
            data
        )
        if magic != ACTION_MAGIC:
            raise ValueError(f"action header: bad magic {magic!r}")
        if version != VERSION:
            raise ValueError(f"action header: unsupported version {version} (this reader speaks {VERSION})")
        return cls(seq, pm, pw, om, cid, idx, rows, dim, flags, session, kind, version, instruction)


def encode_actions(topic: bytes, header: ActionHeader, values: np.ndarray) -> list[bytes]:
    """Multipart [topic, header, payload]; payload is rows x dim float32, row-major."""
    payload = np.ascontiguousarray(values, dtype="<f4")
    if payload.size != header.rows * header.dim:
        raise ValueError(f"payload has {payload.size} values, header says {header.rows}x{header.dim}")
    return [topic, header.pack(), payload.tobytes()]


def decode_actions(frames: list[bytes]) -> tuple[bytes, ActionHeader, np.ndarray]:
    """Inverse of `encode_actions`: (topic, header, values of shape (rows, dim))."""
    if len(frames) != 3:
        raise ValueError(f"action message: expected 3 frames, got {len(frames)}")
    topic, raw_header, payload = frames
    header = ActionHeader.unpack(raw_header)
    values = np.frombuffer(payload, dtype="<f4")
    if values.size != header.rows * header.dim:
        raise ValueError(f"action payload: {values.size} floats, header says {header.rows}x{header.dim}")
    return bytes(topic), header, values.reshape(header.rows, header.dim)


# ---------------------------------------------------------------- robot state (controller -> daemon)

# Single-frame messages so that the daemon's SUB socket can use ZMQ_CONFLATE (which drops
# multipart messages): the magic doubles as the subscription prefix.
STATE_MAGIC = b"PHYS"
STATE_FLAG_ESTOP = 1 << 0
# magic, version, flags, seq, mono_ns, wall_ns, dim, reserved(2), reserved(4)
_STATE_HEADER = struct.Struct("<4sHHQqqHHI")
STATE_HEADER_SIZE = _STATE_HEADER.size  # 40


@dataclass
class StateMessage:
    values: np.ndarray
    seq: int
    mono_ns: int
    wall_ns: int = 0
    flags: int = 0

    def encode(self) -> bytes:
        values = np.ascontiguousarray(self.values, dtype="<f4")
        if values.ndim != 1:
            # Flattened, a (2, 7) array of two arms' joints reached the policy in whatever order
            # its rows happened to be; the sender says which value is which.
            raise ValueError(f"state message: values of shape {values.shape}; send one row (state_dim,)")
        head = _STATE_HEADER.pack(
            STATE_MAGIC, VERSION, self.flags, self.seq, self.mono_ns, self.wall_ns, values.size, 0, 0
        )
        return head + values.tobytes()

    @classmethod
    def decode(cls, data: bytes | memoryview) -> StateMessage:
        if len(data) < STATE_HEADER_SIZE:
            raise ValueError(f"state message: {len(data)} bytes is shorter than the {STATE_HEADER_SIZE}-byte header")
        magic, version, flags, seq, mono, wall, dim, _, _ = _STATE_HEADER.unpack_from(data)
        if magic != STATE_MAGIC:
            raise ValueError(f"state message: bad magic {bytes(magic)!r}")
        if version != VERSION:
            raise ValueError(f"state message: unsupported version {version}")
        if len(data) != STATE_HEADER_SIZE + 4 * dim:
            raise ValueError(f"state message: header says {dim} floats, payload has {len(data) - STATE_HEADER_SIZE} bytes")
        values = np.frombuffer(data, dtype="<f4", count=dim, offset=STATE_HEADER_SIZE).copy()
        return cls(values, seq, mono, wall, flags)


# ---------------------------------------------------------------- camera frames (simulator -> daemon)

FRAME_MAGIC = b"PHYF"
FRAME_NAME_BYTES = 24
PIXEL_RGB8 = 1
PIXEL_BGR8 = 2
PIXEL_GRAY8 = 3
_CHANNELS = {PIXEL_RGB8: 3, PIXEL_BGR8: 3, PIXEL_GRAY8: 1}
# magic, camera name (NUL padded), version, pixel format, seq, capture_mono_ns, capture_wall_ns, height, width
_FRAME_HEADER = struct.Struct(f"<4s{FRAME_NAME_BYTES}sHHQqqII")
FRAME_HEADER_SIZE = _FRAME_HEADER.size  # 64


def frame_topic(camera: str) -> bytes:
    """Subscription prefix for one camera: magic + NUL-padded name (so "top" never matches "top2")."""
    name = camera.encode("ascii")
    if len(name) > FRAME_NAME_BYTES:
        raise ValueError(f"camera name {camera!r} is longer than {FRAME_NAME_BYTES} bytes")
    return FRAME_MAGIC + name.ljust(FRAME_NAME_BYTES, b"\0")


@dataclass
class FrameMessage:
    camera: str
    image: np.ndarray  # uint8, HxWx3 (RGB or BGR per pixel_format) or HxW / HxWx1 for gray
    seq: int
    capture_mono_ns: int
    capture_wall_ns: int = 0
    pixel_format: int = PIXEL_RGB8

    def encode(self) -> bytes:
        image = np.ascontiguousarray(self.image, dtype=np.uint8)
        channels = _CHANNELS[self.pixel_format]
        height, width = image.shape[:2]
        if image.size != height * width * channels:
            raise ValueError(f"frame {self.camera}: shape {image.shape} does not match pixel format {self.pixel_format}")
        head = _FRAME_HEADER.pack(
            FRAME_MAGIC,
            self.camera.encode("ascii").ljust(FRAME_NAME_BYTES, b"\0"),
            VERSION,
            self.pixel_format,
            self.seq,
            self.capture_mono_ns,
            self.capture_wall_ns,
            height,
            width,
        )
        return head + image.tobytes()

    @classmethod
    def decode(cls, data: bytes | memoryview) -> FrameMessage:
        """Zero-copy where possible: the image is a read-only view over `data`."""
        if len(data) < FRAME_HEADER_SIZE:
            raise ValueError(f"frame message: {len(data)} bytes is shorter than the {FRAME_HEADER_SIZE}-byte header")
        magic, name, version, fmt, seq, mono, wall, height, width = _FRAME_HEADER.unpack_from(data)
        if magic != FRAME_MAGIC:
            raise ValueError(f"frame message: bad magic {bytes(magic)!r}")
        if version != VERSION:
            raise ValueError(f"frame message: unsupported version {version}")
        if fmt not in _CHANNELS:
            raise ValueError(f"frame message: unknown pixel format {fmt}")
        channels = _CHANNELS[fmt]
        expected = height * width * channels
        if len(data) != FRAME_HEADER_SIZE + expected:
            raise ValueError(f"frame message: {height}x{width}x{channels} needs {expected} bytes, got {len(data) - FRAME_HEADER_SIZE}")
        image = np.frombuffer(data, dtype=np.uint8, count=expected, offset=FRAME_HEADER_SIZE)
        shape = (height, width, channels)
        return cls(name.rstrip(b"\0").decode("ascii"), image.reshape(shape), seq, mono, wall, fmt)


# ---------------------------------------------------------------- task instruction (operator or planner -> daemon)

# One JSON object per message, UTF-8, on a REQ -> REP pair: the daemon's REP socket answers every
# request, in order. JSON, not a binary header: the text is the payload, and a planner in any
# language can write it.
TASK_MAX_BYTES = 16384


def encode_task_request(prompt: str | None = None, hold: bool | None = None) -> bytes:
    """A request: set the instruction to `prompt` and / or hold (True) or release (False) the
    robot; with neither, ask which instruction runs."""
    body: dict[str, object] = {"version": VERSION}
    if prompt is not None:
        body["prompt"] = prompt
    if hold is not None:
        body["hold"] = hold
    return json.dumps(body).encode("utf-8")


@dataclass
class TaskRequest:
    prompt: str | None = None  # None: keep the instruction
    hold: bool | None = None  # None: leave the hold as it is


def decode_task_request(data: bytes | memoryview) -> TaskRequest:
    """Inverse of `encode_task_request`."""
    if len(data) > TASK_MAX_BYTES:
        raise ValueError(f"task request: {len(data)} bytes is above the {TASK_MAX_BYTES}-byte limit")
    try:
        body = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"task request: not a UTF-8 JSON object ({exc})") from None
    if not isinstance(body, dict):
        raise ValueError(f"task request: expected a JSON object, got {type(body).__name__}")
    version = body.get("version", VERSION)
    if version != VERSION:
        raise ValueError(f"task request: unsupported version {version!r} (this daemon speaks {VERSION})")
    unknown = sorted(set(body) - {"version", "prompt", "hold"})
    if unknown:
        raise ValueError(f"task request: unknown field {unknown[0]!r} (known: prompt, hold, version)")
    prompt, hold = body.get("prompt"), body.get("hold")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"task request: prompt must be a string, got {type(prompt).__name__}")
    if hold is not None and not isinstance(hold, bool):
        raise ValueError(f"task request: hold must be true or false, got {json.dumps(hold)}")
    return TaskRequest(prompt, hold)


@dataclass
class TaskReply:
    """The daemon's answer. `prompt` is the instruction in effect after the request (the old one
    when it was refused); `changes` counts the instructions taken since start-up. `tokens` and
    `room`: the prompt tokens the asked-for instruction takes with any robot state, and the most
    the engine runs without new graphs or truncation (0 where unknown). `holding`: whether the
    robot is held (after the request)."""

    ok: bool
    prompt: str
    error: str = ""
    tokens: int = 0
    room: int = 0
    changes: int = 0
    holding: bool = False

    def encode(self) -> bytes:
        return json.dumps({"version": VERSION, "ok": self.ok, "prompt": self.prompt, "error": self.error,
                           "tokens": self.tokens, "room": self.room, "changes": self.changes,
                           "holding": self.holding}).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes | memoryview) -> TaskReply:
        try:
            body = json.loads(bytes(data).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"task reply: not a UTF-8 JSON object ({exc})") from None
        if not isinstance(body, dict) or not isinstance(body.get("ok"), bool) or not isinstance(body.get("prompt"), str):
            raise ValueError("task reply: expected an object with a boolean ok and a string prompt")
        if body.get("version", VERSION) != VERSION:
            raise ValueError(f"task reply: unsupported version {body.get('version')!r}")
        return cls(body["ok"], body["prompt"], str(body.get("error", "")), int(body.get("tokens", 0)),
                   int(body.get("room", 0)), int(body.get("changes", 0)), bool(body.get("holding", False)))
