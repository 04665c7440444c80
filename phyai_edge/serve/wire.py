"""The serve wire format: one ZeroMQ multipart message per request or reply.

Frame 0 is a UTF-8 JSON header; frames 1.. are raw array buffers that the header points at by
index (`{"buf": i, "shape": [...], "dtype": "uint8"}`), so images cross without a copy into
JSON or pickle. Only numpy and json are imported here: the robot side (`RemotePolicy`) needs
neither torch nor the model code.

Request (client -> server), header:
    {"v": 1, "type": "infer", "id": 7, "robot": "arm-3", "budget_ms": 480.0, "wait_ms": 1000.0,
     "obs": [{"images": {"top": ARRAY | null, ...}, "state": ARRAY, "prompt": "...", "timestamp": 0.0}],
     "rtc": null | {"mode": "guided-approx", "prefix": ARRAY, "delay": 4, "execution_horizon": 25,
                    "max_guidance_weight": 5.0},
     "noise": null | ARRAY}
    {"v": 1, "type": "hello", "id": 0, "robot": "arm-3"}  -> model description
    {"v": 1, "type": "stats", "id": 0, "robot": "arm-3"}  -> per-robot latency report
    {"v": 1, "type": "prompt_fit", "id": 0, "robot": "arm-3", "prompt": "wipe the table"}
        -> {"tokens": 66, "room": 128, "most": 200}
Reply (server -> client), header:
    {"v": 1, "id": 7, "ok": true, "actions": ARRAY, "stage_ms": {...}, "batch": 4, ...}
    {"v": 1, "id": 7, "ok": false, "error": "overloaded", "message": "..."}

`budget_ms` is relative (time until the robot needs the chunk), never an absolute clock
reading: robot and server clocks are not synchronised. The server turns it into a deadline on
its own monotonic clock at arrival.

`wait_ms` (optional; absent or null: no limit) is how long the client will wait for this
answer, also relative. The server does not run a request still queued that long after its
arrival (the client has given up on it: running it would only make every other robot later)
and answers it `expired` instead; a request already running is not stopped. The server's clock
starts at arrival, after the client's, so it never expires a request the client still awaits.
A client that does not send it (older ones) gets no expiry.

`prompt_fit` asks whether an instruction runs as the server's engine was warmed up, before a
robot's daemon takes it (`Policy.prompt_fit`): `tokens` is the most prompt tokens the
instruction takes with any robot state, `room` the most the engine runs without capturing graphs
or truncating (fixed by the server's warm-up), `most` the most the model takes at all. Each is
an integer or null (not known); all three are null, with `unchecked` saying why, where the
server holds no policy to ask (Ray replicas). It is answered apart from the inference batches.
An older server answers it `bad_request` with a message naming the `type` field: a client takes
that as "this server cannot check instructions".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

VERSION = 1
# Error codes a reply may carry; clients map them to exceptions.
ERR_OVERLOADED = "overloaded"  # the server's queue is full: back off and retry, or use the last chunk
ERR_ROBOT_LIMIT = "robot_limit"  # this robot already has its share of requests queued
ERR_BAD_REQUEST = "bad_request"  # the request could not be decoded or validated
ERR_INFERENCE = "inference_failed"  # the engine raised; the message says why
ERR_SHUTDOWN = "shutting_down"
# The request was still queued `wait_ms` after it arrived: its client stopped waiting, so it was
# not run. Every request gets one reply; a client that timed out discards this one by id.
ERR_EXPIRED = "expired"
# Far above what a VLA's prompt window holds (PI0.5: 200 tokens); `prompt_fit` tokenises its
# prompt once per state bin (257 times for PI0.5), so a longer one would only occupy the server.
MAX_CHECK_PROMPT_CHARS = 4096
# Refused before decoding, so one oversized message cannot hold the intake thread (a 16 MB header
# of 200,000 observations took it 3.6 s) or have the server preprocess a giant camera frame (the
# bytes have arrived by then: ZeroMQ holds the message). A header carries names, shapes and
# prompts (~1 KB an observation); the largest array is a 4K uint8 frame (25 MB) with room to spare.
MAX_HEADER_BYTES = 4 << 20
MAX_ARRAY_BYTES = 64 << 20
# A robot's name keys its row in the server's per-robot table (kept until it has been idle
# `--forget-robot-s`) and its line in every report: a name of a header's size (a client bug)
# would be held that long per request. A daemon's default name is ~20 characters.
MAX_ROBOT_NAME_CHARS = 256


class WireError(ValueError):
    """A message that does not follow the format above; the text names the field."""


class _Packer:
    """Collects arrays into frames while a header is being built."""

    def __init__(self) -> None:
        self.frames: list[memoryview | bytes] = []

    def array(self, arr: Any, dtype: Any = None) -> dict[str, Any]:
        a = np.ascontiguousarray(arr if dtype is None else np.asarray(arr, dtype=dtype))
        self.frames.append(memoryview(a).cast("B") if a.size else b"")
        return {"buf": len(self.frames), "shape": list(a.shape), "dtype": a.dtype.str}


def _unpack(ref: Any, frames: list[Any], what: str) -> np.ndarray:
    if not isinstance(ref, dict) or "buf" not in ref:
        raise WireError(f"{what}: expected an array reference, got {type(ref).__name__}")
    i = ref["buf"]
    if not isinstance(i, int) or not 1 <= i < len(frames):
        raise WireError(f"{what}: buffer index {i!r} out of range (message has {len(frames) - 1} buffers)")
    try:
        dtype = np.dtype(ref["dtype"])
        shape = tuple(int(s) for s in ref["shape"])
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"{what}: bad shape or dtype in {ref!r}: {exc}") from None
    if any(s < 0 for s in shape):
        # Two negative sizes multiply to a positive byte count; reshape would then raise.
        raise WireError(f"{what}: bad shape {list(shape)}: sizes must be >= 0")
    if dtype.kind not in "biuf":
        # Object arrays would unpickle; dates, strings and complex numbers would be cast to float32
        # somewhere downstream without a word.
        raise WireError(f"{what}: dtype {dtype.str!r} is not accepted (bool, integer or float arrays only)")
    buf = frames[i]
    data = buf.buffer if hasattr(buf, "buffer") else buf  # zmq.Frame or bytes
    expected = math.prod(shape) * dtype.itemsize  # Python integers: numpy's int64 product wraps
    if expected > MAX_ARRAY_BYTES:
        raise WireError(f"{what}: shape {list(shape)} of {dtype} is {expected} bytes; at most {MAX_ARRAY_BYTES} "
                        "an array (send camera frames at the size the model needs)")
    if len(data) != expected:
        raise WireError(f"{what}: buffer has {len(data)} bytes, shape {shape} of {dtype} needs {expected}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _header(frames: list[Any]) -> dict[str, Any]:
    if not frames:
        raise WireError("empty message")
    raw = frames[0].bytes if hasattr(frames[0], "bytes") else bytes(frames[0])
    if len(raw) > MAX_HEADER_BYTES:
        raise WireError(f"header is {len(raw)} bytes; at most {MAX_HEADER_BYTES}")
    try:
        head = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"header is not JSON: {exc}") from None
    if not isinstance(head, dict):
        raise WireError("header must be a JSON object")
    if head.get("v") != VERSION:
        raise WireError(f"wire version {head.get('v')!r} not supported (this side speaks {VERSION})")
    return head


def _integer(value: Any, what: str, *, not_negative: bool = False) -> int:
    """A JSON integer (or an integral float); anything else is a WireError naming the field.
    Header scalars are checked so rather than passed to int(): its ValueError or TypeError
    would say nothing about which field was wrong."""
    if isinstance(value, float) and value.is_integer():  # False for inf and NaN
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"{what}: expected an integer, got {value!r}")
    return _at_least_zero(value, what) if not_negative else value


def _number(value: Any, what: str, *, not_negative: bool = False) -> float:
    """A finite JSON number (not a bool); anything else is a WireError naming the field."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    try:
        ok = ok and math.isfinite(value)
    except OverflowError:  # an integer beyond float range
        ok = False
    if not ok:
        raise WireError(f"{what}: expected a finite number, got {value!r}")
    return _at_least_zero(float(value), what) if not_negative else float(value)


def _at_least_zero(value: Any, what: str) -> Any:
    if value < 0:
        raise WireError(f"{what}: expected a value >= 0, got {value!r}")
    return value


def _positive_ms(value: Any, what: str) -> float | None:
    """An optional positive number of milliseconds (None stays None); anything else is a
    WireError naming the field."""
    if value is None:
        return None
    ms = _number(value, what)
    if ms <= 0:
        raise WireError(f"{what}: expected a positive number of milliseconds or null, got {ms!r}")
    return ms


def _finish(head: dict[str, Any], packer: _Packer) -> list[Any]:
    return [json.dumps(head, separators=(",", ":")).encode(), *packer.frames]


# -- requests ------------------------------------------------------------------------------
@dataclass
class WireObservation:
    """A decoded observation, torch-free; the server turns it into `adapters.base.Observation`."""

    images: dict[str, np.ndarray | None]
    state: np.ndarray
    prompt: str
    timestamp: float = 0.0


@dataclass
class WireRTC:
    mode: str
    prefix: np.ndarray
    delay: int
    execution_horizon: int
    max_guidance_weight: float = 5.0


@dataclass
class Request:
    kind: str  # "infer" | "hello" | "stats" | "prompt_fit"
    req_id: int
    robot: str
    budget_ms: float | None = None
    observations: list[WireObservation] = field(default_factory=list)
    rtc: WireRTC | None = None
    noise: np.ndarray | None = None
    wait_ms: float | None = None  # how long the client waits for the answer (None: no limit)
    prompt: str | None = None  # prompt_fit: the instruction to check


def encode_request(req: Request) -> list[Any]:
    """Request -> frames. Observations may be any object with images/state/prompt/timestamp."""
    p = _Packer()
    head: dict[str, Any] = {"v": VERSION, "type": req.kind, "id": int(req.req_id), "robot": req.robot}
    if req.kind == "prompt_fit":
        head["prompt"] = req.prompt
    if req.kind == "infer":
        head["budget_ms"] = None if req.budget_ms is None else float(req.budget_ms)
        if req.wait_ms is not None:  # absent, not null, when unset: the header an older client sends
            head["wait_ms"] = float(req.wait_ms)
        obs = []
        for o in req.observations:
            images = {str(k): (None if v is None else p.array(v)) for k, v in dict(o.images).items()}
            obs.append({"images": images, "state": p.array(o.state, np.float32), "prompt": str(o.prompt),
                        "timestamp": float(getattr(o, "timestamp", 0.0))})
        head["obs"] = obs
        if req.rtc is not None:
            r = req.rtc
            head["rtc"] = {"mode": str(r.mode), "prefix": p.array(r.prefix, np.float32), "delay": int(r.delay),
                           "execution_horizon": int(r.execution_horizon),
                           "max_guidance_weight": float(r.max_guidance_weight)}
        else:
            head["rtc"] = None
        head["noise"] = None if req.noise is None else p.array(req.noise, np.float32)
    return _finish(head, p)


def decode_request(frames: list[Any], max_observations: int | None = None) -> Request:
    """`max_observations`: the most one request may carry (the server's largest batch), refused
    before any of them is decoded."""
    head = _header(frames)
    kind = head.get("type")
    if kind not in ("infer", "hello", "stats", "prompt_fit"):
        raise WireError(f"type: unknown request type {kind!r}; expected infer, hello, stats or prompt_fit")
    req_id, robot = head.get("id"), head.get("robot")
    if not isinstance(req_id, int) or isinstance(req_id, bool):
        raise WireError(f"id: expected an integer, got {req_id!r}")
    if not isinstance(robot, str) or not robot:
        raise WireError(f"robot: expected a non-empty name, got {robot!r}")
    if len(robot) > MAX_ROBOT_NAME_CHARS:
        raise WireError(f"robot: a name of {len(robot)} characters; at most {MAX_ROBOT_NAME_CHARS}")
    req = Request(kind, req_id, robot)
    if kind == "prompt_fit":
        prompt = head.get("prompt")
        if not isinstance(prompt, str):
            raise WireError(f"prompt: expected a string, got {prompt!r}")
        if len(prompt) > MAX_CHECK_PROMPT_CHARS:
            raise WireError(f"prompt: {len(prompt)} characters; at most {MAX_CHECK_PROMPT_CHARS} are checked")
        req.prompt = prompt
    if kind != "infer":
        return req
    req.budget_ms = _positive_ms(head.get("budget_ms"), "budget_ms")
    req.wait_ms = _positive_ms(head.get("wait_ms"), "wait_ms")
    raw_obs = head.get("obs")
    if not isinstance(raw_obs, list) or not raw_obs:
        raise WireError("obs: expected a non-empty list of observations")
    if max_observations is not None and len(raw_obs) > max_observations:
        raise WireError(f"obs: {len(raw_obs)} observations; this server runs at most {max_observations} a request")
    for j, o in enumerate(raw_obs):
        if not isinstance(o, dict) or not isinstance(o.get("images"), dict):
            raise WireError(f"obs[{j}].images: expected an object of camera name -> array or null")
        prompt = o.get("prompt", "")
        if not isinstance(prompt, str):
            raise WireError(f"obs[{j}].prompt: expected a string")
        if len(prompt) > MAX_CHECK_PROMPT_CHARS:  # a model takes a few hundred tokens; this is text
            raise WireError(f"obs[{j}].prompt: {len(prompt)} characters; at most {MAX_CHECK_PROMPT_CHARS}")
        images = {str(k): (None if v is None else _unpack(v, frames, f"obs[{j}].images.{k}"))
                  for k, v in o["images"].items()}
        state = _unpack(o.get("state"), frames, f"obs[{j}].state")
        timestamp = _number(o.get("timestamp", 0.0), f"obs[{j}].timestamp")
        req.observations.append(WireObservation(images, state, prompt, timestamp))
    rtc = head.get("rtc")
    if rtc is not None:
        if not isinstance(rtc, dict):
            raise WireError("rtc: expected an object or null")
        missing = [k for k in ("mode", "prefix", "delay", "execution_horizon") if k not in rtc]
        if missing:
            raise WireError(f"rtc.{missing[0]}: missing")
        if not isinstance(rtc["mode"], str):
            raise WireError(f"rtc.mode: expected a string, got {rtc['mode']!r}")
        req.rtc = WireRTC(rtc["mode"], _unpack(rtc["prefix"], frames, "rtc.prefix"),
                          _integer(rtc["delay"], "rtc.delay", not_negative=True),
                          _integer(rtc["execution_horizon"], "rtc.execution_horizon", not_negative=True),
                          _number(rtc.get("max_guidance_weight", 5.0), "rtc.max_guidance_weight", not_negative=True))
    if head.get("noise") is not None:
        req.noise = _unpack(head["noise"], frames, "noise")
    return req


# -- replies -------------------------------------------------------------------------------
@dataclass
class Reply:
    req_id: int
    ok: bool
    actions: np.ndarray | None = None  # (B, H, A) float32
    error: str = ""
    message: str = ""
    info: dict[str, Any] = field(default_factory=dict)  # stage_ms, batch, queue_ms, model description


def encode_reply(rep: Reply) -> list[Any]:
    p = _Packer()
    head: dict[str, Any] = {"v": VERSION, "id": int(rep.req_id), "ok": bool(rep.ok), **rep.info}
    if rep.ok and rep.actions is not None:
        head["actions"] = p.array(rep.actions, np.float32)
    if not rep.ok:
        head["error"], head["message"] = rep.error, rep.message
    return _finish(head, p)


def decode_reply(frames: list[Any]) -> Reply:
    head = _header(frames)
    req_id = head.pop("id", None)
    if not isinstance(req_id, int) or isinstance(req_id, bool):
        raise WireError(f"id: expected an integer, got {req_id!r}")
    ok = bool(head.pop("ok", False))
    head.pop("v", None)
    actions = _unpack(head.pop("actions"), frames, "actions") if "actions" in head else None
    error, message = str(head.pop("error", "")), str(head.pop("message", ""))
    return Reply(req_id, ok, actions, error, message, head)


def prompt_fit_info(tokens: int | None, room: int | None, most: int | None, unchecked: str = "") -> dict[str, Any]:
    """A `prompt_fit` reply's fields; `unchecked`: why the server cannot say (then all are None)."""
    info: dict[str, Any] = {"tokens": tokens, "room": room, "most": most}
    if unchecked:
        info["unchecked"] = unchecked
    return info


def decode_prompt_fit(rep: Reply) -> tuple[int | None, int | None, int | None]:
    """A `prompt_fit` reply -> (tokens, room, most), each a count or None."""
    fit = []
    for key in ("tokens", "room", "most"):
        value = rep.info.get(key)
        if value is not None:
            value = _integer(value, key)
            if value < 0:
                raise WireError(f"{key}: expected a count of tokens or null, got {value!r}")
        fit.append(value)
    return fit[0], fit[1], fit[2]
