"""The daemon's TOML configuration: typed sections, validation that names the key, an embedded default.

Every error is a `ConfigError` whose message starts with the dotted key path, e.g.
`cameras.top.fps: expected a positive number, got "abc"`. Unknown keys are errors too (a typo
in a safety limit must not silently fall back to a default). Checks that need the loaded policy
(action width, camera views, chunk size) happen in `check_against_policy`.

The camera, state and ZeroMQ sections are reused by the multi-robot server and the simulator,
so `load_config` / `parse_config` and the section dataclasses are the public surface.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phyai_edge.control.geometry import FLIPS, ROTATIONS, FrameGeometry
from phyai_edge.engines import BACKEND_ALIASES, BACKENDS, backend_name
from phyai_edge.extras import BACKEND_NEEDS, backend_install_hint

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


# `CudaGraphEngine` keyword arguments the daemon's config may set (`model.engine_options`), each on /
# off; what each does: the options table of docs/gpu.md. Named here so the clock process never imports torch.
CUDAGRAPH_SWITCHES = ("triton_ops", "triton_gemm", "dense_prefix", "dense_expert", "early_step")


class ConfigError(ValueError):
    """A configuration problem; the message starts with the key path."""


CAMERA_SOURCES = ("synthetic", "v4l2", "gstreamer", "rtsp", "file", "zmq")
STATE_SOURCES = ("synthetic", "zmq")
RTC_MODES = ("none", "crossfade", "inpaint", "guided-approx", "guided")
HOLD_MODES = ("last", "state", "zero")
FRAME_CLOCKS = ("monotonic", "realtime", "receive")
WORKER_KINDS = ("process", "thread")


# ---------------------------------------------------------------- sections


@dataclass
class Limits:
    """Per-dimension bounds; each is None (no limit) or a tuple of action_dim floats after resolve."""

    action_min: float | tuple[float, ...] | None = None
    action_max: float | tuple[float, ...] | None = None
    max_rate: float | tuple[float, ...] | None = None  # robot units per second


@dataclass
class RobotConfig:
    name: str = "robot"
    control_hz: float = 50.0
    action_names: tuple[str, ...] = ()
    action_dim: int = 0  # 0: take the policy's
    state_dim: int = 0  # 0: take the policy's
    limits: Limits = field(default_factory=Limits)

    @property
    def period_s(self) -> float:
        return 1.0 / self.control_hz


@dataclass
class CameraConfig:
    name: str
    source: str = "synthetic"
    view: str = ""  # the policy's camera slot this feeds; "" means the camera's own name
    device: int | str = 0  # v4l2: index or /dev/videoN
    pipeline: str = ""  # gstreamer
    url: str = ""  # rtsp
    path: str = ""  # file
    loop: bool = True  # file: start again at the end
    endpoint: str = ""  # zmq
    topic: str = ""  # zmq: camera name in the frame header; "" means the camera's own name
    clock: str = "monotonic"  # zmq: which header time is the capture time
    width: int = 224
    height: int = 224
    fps: float = 30.0
    required: bool = True  # stale required camera -> HOLD; stale optional camera -> masked out
    max_age_ms: float = 0.0  # 0: safety.camera_max_age_ms
    # What the policy sees of the frame (geometry.py): a crop (x, y, width, height in the
    # configured width x height), then a clockwise rotation, then a mirror.
    crop: tuple[int, int, int, int] | None = None
    rotate: int = 0
    flip: str = ""

    @property
    def view_name(self) -> str:
        return self.view or self.name

    @property
    def geometry(self) -> FrameGeometry | None:
        """The crop / rotation / mirror to apply, or None when the frame is used as it comes."""
        g = FrameGeometry((self.height, self.width), self.crop, self.rotate, self.flip)
        return None if g.identity else g


@dataclass
class StateConfig:
    source: str = "synthetic"
    endpoint: str = "tcp://127.0.0.1:5556"
    clock: str = "monotonic"  # which header time is the sample time (or "receive")


@dataclass
class ModelConfig:
    adapter: str = "pi05"
    checkpoint: str = ""
    tokenizer: str = ""  # tokenizer.json / tokenizer.model (or their folder) when not in the checkpoint
    bundle: str = ""
    preset: str = "tiny"
    backend: str = "eager"
    device: str = "cpu"
    dtype: str = "float32"
    prompt: str = "pick up the cube"
    worker: str = "process"  # "process" keeps the policy's GIL and allocator away from the clock
    threads: int = 1  # torch intra-op threads in the worker (leave a core for the clock); 0: torch's default
    warmup: int = 1  # warm-up rounds before the clock starts (a chunk without RTC, one in the solver RTC mode)
    load_timeout_s: float = 600.0
    factory: str = ""  # "module:function" building the policy; "" means load_policy (tests use fakes)
    factory_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments for `factory`
    # The adapter's own options (its module's OPTIONS; PI0.5: prompt_state), checked when it loads.
    adapter_options: dict[str, Any] = field(default_factory=dict)
    # The cudagraph engine's switches (CUDAGRAPH_SWITCHES), e.g. {"early_step": False}; {}: its defaults.
    engine_options: dict[str, bool] = field(default_factory=dict)
    restart_backoff_s: float = 0.5  # first wait before restarting a dead worker process; doubles per failure
    restart_backoff_max_s: float = 30.0  # the longest wait between restart attempts (they never stop)
    inference_timeout_s: float = 10.0  # a process worker's inference taking longer: killed and restarted
    # Each chunk's noise comes from (noise_seed, its inference number) (`engines.noise`), so a
    # `--record` replays to the same actions in `phyai-edge eval`, and a restart repeats them.
    noise_seed: int = 0


@dataclass
class ChunkingConfig:
    mode: str = "guided-approx"
    horizon: int = 0  # H; 0: the policy's chunk size
    execution_horizon: int = 25  # s
    max_guidance_weight: float = 5.0
    delay: int = 0  # d estimate to use; 0: estimate from recent delays
    delay_initial: int = 3  # estimate before any inference was measured
    delay_window: int = 10  # recent delays the estimate looks at (it takes their maximum)
    crossfade_steps: int = 8


@dataclass
class PublishConfig:
    endpoint: str = "tcp://127.0.0.1:5555"
    bind: bool = True
    topic: str = "action"
    chunk_topic: str = "chunk"  # the whole-chunk topic; "" disables it
    sndhwm: int = 1000


@dataclass
class TaskConfig:
    """The instruction (the policy's prompt) set while the daemon runs: `phyai-edge task`, or any
    ZeroMQ REQ client (docs/protocol.md, section 4). Off unless `endpoint` is set."""

    endpoint: str = ""  # REP socket; "" is off (model.prompt runs for good)
    bind: bool = True
    # Instructions the engine keeps room for at warm-up, beside model.prompt (the longest of them,
    # with any robot state, sets the prompt tokens every chunk runs); with any_prompt = false the
    # only ones accepted.
    prompts: tuple[str, ...] = ()
    prompt_tokens: int = 0  # room, in prompt tokens (state included), kept for instructions not listed
    any_prompt: bool = True  # false: refuse an instruction that is not model.prompt or in prompts
    start_held: bool = False  # hold the robot (HOLD | PAUSED) from the start until an operator releases it


@dataclass
class SafetyConfig:
    camera_max_age_ms: float = 200.0
    state_max_age_ms: float = 100.0
    hold: str = "last"


@dataclass
class MetricsConfig:
    port: int = 0  # 0: off
    host: str = "127.0.0.1"


@dataclass
class ClockConfig:
    priority: int = 80  # SCHED_FIFO priority of the clock thread; 0: leave the scheduler alone
    cpus: tuple[int, ...] = ()  # CPU affinity of the clock thread; () leaves it
    mlock: bool = True
    spin_us: float = 150.0  # sleep until this close to the deadline, then spin
    switch_interval_us: float = 200.0  # Python's GIL switch interval while the daemon runs
    # A tick that publishes this long after its deadline is counted and described in the log (at
    # most one line per 10 s); 0: a quarter of the period.
    late_warning_ms: float = 0.0

    def late_limit_s(self, period_s: float) -> float:
        return self.late_warning_ms / 1000.0 if self.late_warning_ms > 0 else period_s / 4


@dataclass
class DaemonConfig:
    robot: RobotConfig = field(default_factory=RobotConfig)
    cameras: dict[str, CameraConfig] = field(default_factory=dict)
    state: StateConfig = field(default_factory=StateConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    clock: ClockConfig = field(default_factory=ClockConfig)
    source: str = "<embedded default>"

    def camera_max_age_s(self, cam: CameraConfig) -> float:
        return (cam.max_age_ms or self.safety.camera_max_age_ms) / 1000.0


# ---------------------------------------------------------------- reading with key paths


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


class _Section:
    """Reads one TOML table, remembering which keys were used so leftovers can be reported."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a table, got {_show(data)}")
        self.data = data
        self.path = path
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def _take(self, name: str) -> tuple[bool, Any]:
        self.used.add(name)
        if name in self.data:
            return True, self.data[name]
        return False, None

    def table(self, name: str) -> _Section:
        present, value = self._take(name)
        return _Section(value if present else {}, self.key(name))

    def string(self, name: str, default: str, choices: Sequence[str] | None = None) -> str:
        present, value = self._take(name)
        if not present:
            return default
        if not isinstance(value, str):
            raise ConfigError(f"{self.key(name)}: expected a string, got {_show(value)}")
        if choices is not None and value not in choices:
            raise ConfigError(f"{self.key(name)}: expected one of {', '.join(choices)}; got {_show(value)}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        present, value = self._take(name)
        if not present:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{self.key(name)}: expected true or false, got {_show(value)}")
        return value

    def number(self, name: str, default: float, *, positive: bool = False, minimum: float | None = None) -> float:
        present, value = self._take(name)
        if not present:
            return default
        return _number(value, self.key(name), positive=positive, minimum=minimum)

    def integer(self, name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
        present, value = self._take(name)
        if not present:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            expected = "an integer" if minimum is None else f"an integer >= {minimum}"
            raise ConfigError(f"{self.key(name)}: expected {expected}, got {_show(value)}")
        if minimum is not None and value < minimum:
            raise ConfigError(f"{self.key(name)}: expected an integer >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise ConfigError(f"{self.key(name)}: expected an integer <= {maximum}, got {value}")
        return value

    def scalar_or_list(self, name: str, *, positive: bool = False) -> float | tuple[float, ...] | None:
        present, value = self._take(name)
        if not present:
            return None
        if isinstance(value, list):
            if not value:
                raise ConfigError(f"{self.key(name)}: expected a number or a non-empty list of numbers, got []")
            return tuple(_number(v, f"{self.key(name)}[{i}]", positive=positive) for i, v in enumerate(value))
        return _number(value, self.key(name), positive=positive)

    def finish(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            known = ", ".join(sorted(self.used)) or "none"
            raise ConfigError(f"{self.key(unknown[0])}: unknown key (known keys here: {known})")


def _number(value: Any, key: str, *, positive: bool = False, minimum: float | None = None) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # NaN != NaN
    if ok and value in (float("inf"), float("-inf")):
        ok = False
    if ok and positive and value <= 0:
        ok = False
    if ok and minimum is not None and value < minimum:
        ok = False
    if not ok:
        what = "a positive number" if positive else ("a number" if minimum is None else f"a number >= {minimum}")
        raise ConfigError(f"{key}: expected {what}, got {_show(value)}")
    return float(value)


# ---------------------------------------------------------------- parsing


def _parse_robot(sec: _Section) -> RobotConfig:
    r = RobotConfig()
    r.name = sec.string("name", r.name)
    r.control_hz = sec.number("control_hz", r.control_hz, positive=True)
    if r.control_hz > MAX_CONTROL_HZ:
        raise ConfigError(f"robot.control_hz: {r.control_hz:g} Hz is above the {MAX_CONTROL_HZ:g} Hz this daemon can "
                          "keep (one Python tick, one message a period)")
    present, names = sec._take("action_names")
    if present:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"{sec.key('action_names')}: expected a list of strings, got {_show(names)}")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"{sec.key('action_names')}: {', '.join(map(repr, twice))} named more than once")
        r.action_names = tuple(names)
    r.action_dim = sec.integer("action_dim", r.action_dim, minimum=0)
    if r.action_names and r.action_dim and len(r.action_names) != r.action_dim:
        raise ConfigError(
            f"{sec.key('action_names')}: has {len(r.action_names)} names but robot.action_dim is {r.action_dim}"
        )
    if r.action_names and not r.action_dim:
        r.action_dim = len(r.action_names)
    r.state_dim = sec.integer("state_dim", r.state_dim, minimum=0)
    lim = sec.table("limits")
    r.limits = Limits(
        action_min=lim.scalar_or_list("action_min"),
        action_max=lim.scalar_or_list("action_max"),
        max_rate=lim.scalar_or_list("max_rate", positive=True),
    )
    lim.finish()
    for key in ("action_min", "action_max", "max_rate"):
        value = getattr(r.limits, key)
        if isinstance(value, tuple) and r.action_dim and len(value) != r.action_dim:
            raise ConfigError(f"robot.limits.{key}: has {len(value)} values but the robot has {r.action_dim} actions")
    lo, hi = r.limits.action_min, r.limits.action_max
    if lo is not None and hi is not None:
        los = lo if isinstance(lo, tuple) else (lo,)
        his = hi if isinstance(hi, tuple) else (hi,)
        if len(los) == len(his) or len(los) == 1 or len(his) == 1:
            n = max(len(los), len(his))
            for i in range(n):
                a, b = los[i % len(los)], his[i % len(his)]
                if a >= b:
                    raise ConfigError(f"robot.limits.action_min: must be below action_max (index {i}: {a} >= {b})")
    sec.finish()
    return r


def _parse_camera(name: str, sec: _Section) -> CameraConfig:
    c = CameraConfig(name=name)
    c.source = sec.string("source", c.source, CAMERA_SOURCES)
    c.view = sec.string("view", c.view)
    c.width = sec.integer("width", c.width, minimum=1)
    c.height = sec.integer("height", c.height, minimum=1)
    c.fps = sec.number("fps", c.fps, positive=True)
    c.required = sec.boolean("required", c.required)
    c.max_age_ms = sec.number("max_age_ms", c.max_age_ms, minimum=0)
    present, crop = sec._take("crop")
    if present:
        if (not isinstance(crop, list) or len(crop) != 4
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in crop)):
            raise ConfigError(f"{sec.key('crop')}: expected [x, y, width, height] in pixels of the configured "
                              f"{c.width}x{c.height} frame, got {_show(crop)}")
        c.crop = (crop[0], crop[1], crop[2], crop[3])
    present, rotate = sec._take("rotate")
    if present:
        if isinstance(rotate, bool) or rotate not in ROTATIONS:
            raise ConfigError(f"{sec.key('rotate')}: expected one of {', '.join(map(str, ROTATIONS))} "
                              f"(degrees, clockwise), got {_show(rotate)}")
        c.rotate = rotate
    c.flip = sec.string("flip", c.flip)
    if c.flip not in FLIPS:
        raise ConfigError(f"{sec.key('flip')}: expected \"horizontal\" (left and right swap), \"vertical\" or \"\" "
                          f"(none), got {_show(c.flip)}")
    try:
        _ = c.geometry
    except ValueError as exc:  # the crop outside the frame
        raise ConfigError(f"{sec.key('crop')}: {str(exc).removeprefix('crop: ')}") from None
    if c.source == "v4l2":
        present, dev = sec._take("device")
        if present:
            if isinstance(dev, bool) or not isinstance(dev, (int, str)) or (isinstance(dev, int) and dev < 0):
                raise ConfigError(f"{sec.key('device')}: expected a device index >= 0 or a path like /dev/video0, got {_show(dev)}")
            if isinstance(dev, str) and not dev.startswith("/"):
                # OpenCV opens a string as a path, relative to the working directory: "0" or
                # "video0" never named the camera, and the daemon retried it forever holding STALE.
                hint = f"device = {int(dev)}, a number" if dev.isdecimal() else f"\"/dev/{dev or 'video0'}\""
                raise ConfigError(f"{sec.key('device')}: {_show(dev)} is not a device path (OpenCV would open it "
                                  f"as a file); write {hint}, or a /dev/v4l/by-id/... path")
            c.device = dev
    elif c.source == "gstreamer":
        c.pipeline = sec.string("pipeline", "")
        if not c.pipeline:
            raise ConfigError(f"{sec.key('pipeline')}: required for source = \"gstreamer\" (a pipeline ending in appsink)")
    elif c.source == "rtsp":
        c.url = sec.string("url", "")
        if not c.url.startswith(("rtsp://", "rtsps://")):
            raise ConfigError(f"{sec.key('url')}: expected an rtsp:// URL, got {_show(c.url)}")
    elif c.source == "file":
        c.path = sec.string("path", "")
        if not c.path:
            raise ConfigError(f"{sec.key('path')}: required for source = \"file\" (a video file)")
        if not Path(c.path).is_file():  # as model.checkpoint is checked: found here, not at the first frame
            raise ConfigError(f"{sec.key('path')}: no file {c.path!r}")
        c.loop = sec.boolean("loop", c.loop)
    elif c.source == "zmq":
        c.endpoint = _endpoint(sec, "endpoint", "", required=True)
        c.topic = sec.string("topic", c.topic)
        c.clock = sec.string("clock", c.clock, FRAME_CLOCKS)
        try:
            from phyai_edge.control.protocol import frame_topic

            frame_topic(c.topic or name)
        except (ValueError, UnicodeEncodeError) as exc:
            raise ConfigError(f"{sec.key('topic')}: {exc}") from None
    for key, only in _SOURCE_KEYS.items():
        if key in sec.data and key not in sec.used:
            raise ConfigError(f"{sec.key(key)}: only used with source = \"{only}\"; this camera's source is "
                              f"\"{c.source}\"")
    sec.finish()
    return c


def _endpoint(sec: _Section, name: str, default: str, *, required: bool = False) -> str:
    value = sec.string(name, default)
    if required and not value:
        raise ConfigError(f"{sec.key(name)}: required (e.g. \"tcp://127.0.0.1:5556\" or \"ipc:///run/phyai/x\")")
    transport = value.partition("://")[0] if "://" in value else ""
    if value and transport not in ENDPOINT_TRANSPORTS:
        raise ConfigError(f"{sec.key(name)}: expected a ZeroMQ endpoint like tcp://host:port or ipc://path, got {_show(value)}")
    port = value.rsplit(":", 1)[-1] if transport == "tcp" else ""
    # isdecimal, not isdigit: "²" is a digit that int() refuses (a ValueError, not the key's error)
    if transport == "tcp" and (":" not in value.removeprefix("tcp://") or not (port.isdecimal() or port == "*")):
        raise ConfigError(f"{sec.key(name)}: a tcp endpoint needs a port (tcp://host:port), got {_show(value)}")
    if port.isdecimal() and not 1 <= int(port) <= 65535:
        # libzmq takes the number modulo 65536: tcp://...:99999 bound port 34463, without an error
        raise ConfigError(f"{sec.key(name)}: port {port} is outside 1..65535, got {_show(value)}")
    return value


# What the daemon's sockets talk over between processes (inproc: tests, one process).
ENDPOINT_TRANSPORTS = ("tcp", "ipc", "inproc")
# Keys of one camera source only: named as such when given to a camera of another source.
_SOURCE_KEYS = {"device": "v4l2", "pipeline": "gstreamer", "url": "rtsp", "path": "file", "loop": "file",
                "endpoint": "zmq", "topic": "zmq", "clock": "zmq"}
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}


def _tcp_address(endpoint: str) -> tuple[str, str] | None:
    """(host, port) of a tcp endpoint, localhost read as 127.0.0.1; None for other transports."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    return ("127.0.0.1" if host == "localhost" else host), port


_ANY_HOST = {"*", "0.0.0.0"}


def _same_socket(bound: str, other: str, *, other_bound: bool = True) -> bool:
    """Whether binding `other` too would collide with `bound` (`other_bound`), or connecting to
    `other` reaches `bound` on this machine. A wildcard bind takes the port on every interface;
    a connection reaches it only through loopback (another host's port of the same number is not
    this one)."""
    if bound == other:
        return True
    ta, tb = _tcp_address(bound), _tcp_address(other)
    if ta is None or tb is None or ta[1] != tb[1] or ta[1] == "*":
        return False
    if ta[0] == tb[0]:
        return True
    if other_bound:
        return bool(_ANY_HOST & {ta[0], tb[0]})
    return ta[0] in _ANY_HOST and tb[0].startswith("127.")


def parse_config(data: dict[str, Any], source: str = "<dict>") -> DaemonConfig:
    """Validate a parsed TOML document into a `DaemonConfig`."""
    root = _Section(data, "")
    cfg = DaemonConfig(source=source)
    cfg.robot = _parse_robot(root.table("robot"))

    cams = root.table("cameras")
    for name in list(cams.data):
        cams.used.add(name)
        if not name:
            raise ConfigError('cameras."": a camera needs a name, e.g. [cameras.top]')
        if not name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"cameras.{name}: camera names may use letters, digits, '_' and '-' only")
        cfg.cameras[name] = _parse_camera(name, _Section(cams.data[name], cams.key(name)))
    seen_views: dict[str, str] = {}
    for cam in cfg.cameras.values():
        if cam.view_name in seen_views:
            raise ConfigError(
                f"cameras.{cam.name}.view: view {cam.view_name!r} is fed by more than one camera "
                f"(also cameras.{seen_views[cam.view_name]})"
            )
        seen_views[cam.view_name] = cam.name

    st = root.table("state")
    state_source = st.string("source", "synthetic", STATE_SOURCES)
    cfg.state = StateConfig(
        source=state_source,
        endpoint=_endpoint(st, "endpoint", StateConfig.endpoint, required=state_source == "zmq"),
        clock=st.string("clock", "monotonic", ("monotonic", "realtime", "receive")),
    )
    st.finish()

    m = root.table("model")
    d = ModelConfig()
    cfg.model = ModelConfig(
        adapter=m.string("adapter", d.adapter),
        checkpoint=m.string("checkpoint", d.checkpoint),
        tokenizer=m.string("tokenizer", d.tokenizer),
        bundle=m.string("bundle", d.bundle),
        preset=m.string("preset", d.preset),
        backend=backend_name(m.string("backend", d.backend, (*BACKENDS, *BACKEND_ALIASES))),
        device=m.string("device", d.device),
        dtype=DTYPE_NAMES[m.string("dtype", d.dtype, tuple(DTYPE_NAMES))],
        prompt=m.string("prompt", d.prompt),
        worker=m.string("worker", d.worker, WORKER_KINDS),
        threads=m.integer("threads", d.threads, minimum=0),
        warmup=m.integer("warmup", d.warmup, minimum=0),
        load_timeout_s=m.number("load_timeout_s", d.load_timeout_s, positive=True),
        factory=m.string("factory", d.factory),
        restart_backoff_s=m.number("restart_backoff_s", d.restart_backoff_s, positive=True),
        restart_backoff_max_s=m.number("restart_backoff_max_s", d.restart_backoff_max_s, positive=True),
        inference_timeout_s=m.number("inference_timeout_s", d.inference_timeout_s, positive=True),
        noise_seed=m.integer("noise_seed", d.noise_seed, minimum=0, maximum=2**31 - 1),
    )
    present, fargs = m._take("factory_args")
    if present:
        if not isinstance(fargs, dict):
            raise ConfigError(f"model.factory_args: expected a table, got {_show(fargs)}")
        if not cfg.model.factory:
            raise ConfigError("model.factory_args: only meaningful with model.factory")
        cfg.model.factory_args = dict(fargs)
    present, aopts = m._take("adapter_options")
    if present:
        if not isinstance(aopts, dict) or any(isinstance(v, (dict, list)) for v in aopts.values()):
            raise ConfigError(f"model.adapter_options: expected a table of plain values, got {_show(aopts)}")
        if cfg.model.bundle or cfg.model.factory:
            # A bundle was exported with its options (phyai-edge export --adapter-option); a
            # factory builds its own policy.
            raise ConfigError("model.adapter_options: only used with model.checkpoint or model.preset, "
                              "not with model.bundle or model.factory")
        cfg.model.adapter_options = dict(aopts)
    present, eopts = m._take("engine_options")
    if present:
        if not isinstance(eopts, dict):
            raise ConfigError(f"model.engine_options: expected a table, got {_show(eopts)}")
        if cfg.model.backend != "cudagraph" or cfg.model.bundle or cfg.model.factory:
            raise ConfigError("model.engine_options: only for model.backend = \"cudagraph\" without model.bundle "
                              "or model.factory (a bundle's engine was fixed at export)")
        for name, value in eopts.items():
            if name not in CUDAGRAPH_SWITCHES:
                raise ConfigError(f"model.engine_options.{name}: unknown switch; the cudagraph engine's are "
                                  f"{', '.join(CUDAGRAPH_SWITCHES)}")
            if not isinstance(value, bool):
                raise ConfigError(f"model.engine_options.{name}: expected true or false, got {_show(value)}")
        cfg.model.engine_options = dict(eopts)
    if cfg.model.factory and ":" not in cfg.model.factory:
        raise ConfigError(f"model.factory: expected \"module:function\", got {_show(cfg.model.factory)}")
    if cfg.model.factory:
        # The top-level package only: finding it runs nothing, where a dotted module's parents would
        # be imported here, in the clock's process. A deeper typo still fails at start-up.
        top = cfg.model.factory.partition(":")[0].split(".")[0]
        if top and not _importable(top):
            raise ConfigError(f"model.factory: no module {top!r} can be imported here (is its package installed "
                              f"in this environment?), got {_show(cfg.model.factory)}")
    if cfg.model.restart_backoff_max_s < cfg.model.restart_backoff_s:
        raise ConfigError(
            f"model.restart_backoff_max_s: expected a number >= model.restart_backoff_s "
            f"({cfg.model.restart_backoff_s:g}), got {_show(cfg.model.restart_backoff_max_s)}"
        )
    if not _DEVICE.fullmatch(cfg.model.device):
        raise ConfigError(f"model.device: expected cpu, cuda or cuda:N, got {_show(cfg.model.device)}")
    if cfg.model.bundle:
        _check_bundle(cfg.model)
    elif not cfg.model.factory:
        # Building its engines from the checkpoint imports these (a bundle of that backend only runs
        # them: `_check_bundle`). As for a bundle: exit 2 here, not a worker that fails at load and
        # is restarted, loading the model each time.
        missing = [mod for mod in BACKEND_NEEDS.get(cfg.model.backend, ()) if not _importable(mod)]
        if missing:
            raise ConfigError(f"model.backend: {cfg.model.backend} needs {' and '.join(missing)}, not installed "
                              f"here ({_install_how(cfg.model.backend)})")
    if cfg.model.tokenizer:
        _check_tokenizer(cfg.model)
    m.finish()

    c = root.table("chunking")
    d2 = ChunkingConfig()
    cfg.chunking = ChunkingConfig(
        mode=c.string("mode", d2.mode, RTC_MODES),
        horizon=c.integer("horizon", d2.horizon, minimum=0),
        execution_horizon=c.integer("execution_horizon", d2.execution_horizon, minimum=1),
        max_guidance_weight=c.number("max_guidance_weight", d2.max_guidance_weight, positive=True),
        delay=c.integer("delay", d2.delay, minimum=0),
        delay_initial=c.integer("delay_initial", d2.delay_initial, minimum=0),
        delay_window=c.integer("delay_window", d2.delay_window, minimum=1),
        crossfade_steps=c.integer("crossfade_steps", d2.crossfade_steps, minimum=1),
    )
    if cfg.chunking.horizon:
        check_chunking(cfg.chunking, cfg.chunking.horizon, "chunking.horizon")
    c.finish()

    p = root.table("publish")
    d3 = PublishConfig()
    cfg.publish = PublishConfig(
        endpoint=_endpoint(p, "endpoint", d3.endpoint, required=True),
        bind=p.boolean("bind", d3.bind),
        topic=p.string("topic", d3.topic),
        chunk_topic=p.string("chunk_topic", d3.chunk_topic),
        sndhwm=p.integer("sndhwm", d3.sndhwm, minimum=1),
    )
    if not cfg.publish.topic:
        raise ConfigError("publish.topic: must not be empty")
    t, ct = cfg.publish.topic, cfg.publish.chunk_topic
    if ct and (t.startswith(ct) or ct.startswith(t)):
        # SUB filters by prefix: a subscriber to one topic would also receive the other.
        raise ConfigError(f"publish.chunk_topic: {ct!r} and publish.topic {t!r} must not be prefixes of each other")
    p.finish()

    s = root.table("safety")
    d4 = SafetyConfig()
    cfg.safety = SafetyConfig(
        camera_max_age_ms=s.number("camera_max_age_ms", d4.camera_max_age_ms, positive=True),
        state_max_age_ms=s.number("state_max_age_ms", d4.state_max_age_ms, positive=True),
        hold=s.string("hold", d4.hold, HOLD_MODES),
    )
    s.finish()
    for cam in cfg.cameras.values():
        # Frames 1 / fps apart with a shorter age limit: the newest frame goes stale before the next
        # one comes, on every frame, and the daemon holds STALE on those ticks (a required camera)
        # or runs without the view. Refused here rather than found on the robot.
        limit_s, period_s = cfg.camera_max_age_s(cam), 1.0 / cam.fps
        if limit_s < period_s:
            key = f"cameras.{cam.name}.max_age_ms" if cam.max_age_ms else "safety.camera_max_age_ms"
            raise ConfigError(
                f"{key}: {limit_s * 1e3:g} ms is shorter than cameras.{cam.name}'s frame period "
                f"({cam.fps:g} fps: {period_s * 1e3:.1f} ms), so every frame goes stale before the next arrives; "
                "allow the period plus the capture latency"
            )

    cfg.task = _parse_task(root.table("task"), cfg)

    mt = root.table("metrics")
    cfg.metrics = MetricsConfig(
        port=mt.integer("port", 0, minimum=0, maximum=65535),
        host=mt.string("host", "127.0.0.1"),
    )
    mt.finish()
    _check_sockets(cfg)

    ck = root.table("clock")
    d5 = ClockConfig()
    present, cpus = ck._take("cpus")
    cpu_tuple: tuple[int, ...] = ()
    if present:
        if not isinstance(cpus, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in cpus):
            raise ConfigError(f"clock.cpus: expected a list of CPU indices >= 0, got {_show(cpus)}")
        if len(set(cpus)) != len(cpus):
            raise ConfigError(f"clock.cpus: a CPU is listed more than once, got {_show(cpus)}")
        cpu_tuple = tuple(cpus)
    cfg.clock = ClockConfig(
        priority=ck.integer("priority", d5.priority, minimum=0, maximum=99),
        cpus=cpu_tuple,
        mlock=ck.boolean("mlock", d5.mlock),
        spin_us=ck.number("spin_us", d5.spin_us, minimum=0),
        switch_interval_us=ck.number("switch_interval_us", d5.switch_interval_us, positive=True),
        late_warning_ms=ck.number("late_warning_ms", d5.late_warning_ms, minimum=0),
    )
    ck.finish()

    root.finish()
    if not cfg.cameras:
        # Camera tables replace the default's synthetic camera rather than merging with it, so a
        # file without one would run a policy that sees nothing and holds on every tick.
        raise ConfigError("cameras: no camera is configured; add at least one [cameras.NAME] table "
                          "(its view names the policy's camera slot; see --print-default-config)")
    return cfg


def check_chunking(c: ChunkingConfig, horizon: int, source: str) -> None:
    """The chunking values against the horizon H the daemon runs (`source` names where H came
    from): each counts actions of one chunk, so none may reach past it."""
    if c.execution_horizon >= horizon:
        raise ConfigError(f"chunking.execution_horizon: must be below {source} ({c.execution_horizon} >= {horizon})")
    for key in ("delay", "delay_initial"):
        if getattr(c, key) >= horizon:
            raise ConfigError(f"chunking.{key}: {getattr(c, key)} slots is not below {source} ({horizon}): every "
                              "chunk would be over before it arrived")
    if c.crossfade_steps > horizon:
        raise ConfigError(f"chunking.crossfade_steps: {c.crossfade_steps} is longer than {source} ({horizon})")


def _check_sockets(cfg: DaemonConfig) -> None:
    """Sockets the daemon binds must not collide, and it must not subscribe to its own publisher."""
    t = cfg.task
    if t.endpoint and _same_socket(cfg.publish.endpoint, t.endpoint, other_bound=t.bind):
        raise ConfigError(f"task.endpoint: {t.endpoint!r} is publish.endpoint's socket too "
                          f"({cfg.publish.endpoint!r}); give the instruction socket its own")
    binds = [("publish.endpoint", cfg.publish.endpoint)] if cfg.publish.bind else []
    if cfg.task.endpoint and cfg.task.bind:
        binds.append(("task.endpoint", cfg.task.endpoint))
    if cfg.metrics.port:
        binds.append(("metrics.port", f"tcp://{cfg.metrics.host}:{cfg.metrics.port}"))
    for i, (key, endpoint) in enumerate(binds):
        for other, other_endpoint in binds[:i]:
            if _same_socket(endpoint, other_endpoint):
                raise ConfigError(f"{key}: {endpoint!r} is the address {other} binds ({other_endpoint!r})")
    subscribed = [("state.endpoint", cfg.state.endpoint)] if cfg.state.source == "zmq" else []
    subscribed += [(f"cameras.{c.name}.endpoint", c.endpoint) for c in cfg.cameras.values() if c.source == "zmq"]
    for key, endpoint in subscribed:
        if _same_socket(cfg.publish.endpoint, endpoint, other_bound=False):
            raise ConfigError(f"{key}: {endpoint!r} is publish.endpoint, the daemon's own action stream")


def _parse_task(sec: _Section, cfg: DaemonConfig) -> TaskConfig:
    d = TaskConfig()
    t = TaskConfig(endpoint=_endpoint(sec, "endpoint", d.endpoint), bind=sec.boolean("bind", d.bind),
                   prompt_tokens=sec.integer("prompt_tokens", d.prompt_tokens, minimum=0),
                   any_prompt=sec.boolean("any_prompt", d.any_prompt),
                   start_held=sec.boolean("start_held", d.start_held))
    present, prompts = sec._take("prompts")
    if present:
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise ConfigError(f"{sec.key('prompts')}: expected a list of strings, got {_show(prompts)}")
        for i, p in enumerate(prompts):
            problem = task_prompt_problem(p)
            if problem:
                raise ConfigError(f"{sec.key('prompts')}[{i}]: {problem}")
        t.prompts = tuple(prompts)
    # Empty is allowed there: the checkpoint's default prompt then runs.
    problem = task_prompt_problem(cfg.model.prompt) if cfg.model.prompt else ""
    if problem:
        raise ConfigError(f"model.prompt: {problem}")
    if not t.endpoint:
        unused = [k for k, v in (("prompts", t.prompts), ("prompt_tokens", t.prompt_tokens),
                                 ("any_prompt", not t.any_prompt), ("start_held", t.start_held)) if v]
        if unused:
            raise ConfigError(f"task.{unused[0]}: only used with task.endpoint (instructions taken at run time); "
                              "set the endpoint or remove it")
    sec.finish()
    return t


def task_prompt_problem(prompt: str) -> str:
    """What makes `prompt` unusable as an instruction ("" if nothing): the checks that need no
    tokenizer, made alike for the config and for an instruction sent at run time."""
    if not prompt.strip():
        return "the instruction is empty"
    if len(prompt) > MAX_PROMPT_CHARS:
        return f"the instruction has {len(prompt)} characters; at most {MAX_PROMPT_CHARS} are taken"
    bad = sorted({f"U+{ord(ch):04X}" for ch in prompt if ord(ch) < 32 or ord(ch) == 127})
    if bad:
        return f"the instruction holds control characters ({', '.join(bad)}); send one line of text"
    return ""


MAX_PROMPT_CHARS = 1000  # far above what a VLA's prompt window holds; the tokenizer check is the real limit
MAX_CONTROL_HZ = 1000.0  # above this a period is shorter than the clock's own tick work
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")  # what the worker can load onto; whether it exists is its check


def _importable(module: str) -> bool:
    """Whether a top-level module can be imported here, found without running it."""
    return importlib.util.find_spec(module) is not None


def _install_how(backend: str) -> str:
    how = backend_install_hint(backend)
    return f"JetPack's python3-libnvinfer, or {how}" if backend == "tensorrt" else str(how)


def _check_tokenizer(m: ModelConfig) -> None:
    if not m.checkpoint:
        raise ConfigError("model.tokenizer: only used with model.checkpoint (the built-in presets ship their own)")
    p = Path(m.tokenizer)
    names = ("tokenizer.json", "tokenizer.model")
    if not (p.is_file() or (p.is_dir() and any((p / n).is_file() for n in names))):
        raise ConfigError(f"model.tokenizer: {m.tokenizer!r} is neither a tokenizer file nor a folder holding "
                          f"{' or '.join(names)}")


def _check_bundle(m: ModelConfig) -> None:
    """Cheap checks of model.bundle at load time (the worker verifies every file's hash when it
    loads the bundle); no torch import here, this runs in the clock process."""
    if m.factory:
        raise ConfigError("model.bundle: set either model.bundle or model.factory, not both")
    p = Path(m.bundle)
    expected = "expected the folder written by `phyai-edge export --out DIR` (holding manifest.json)"
    if not p.is_dir():
        raise ConfigError(f"model.bundle: {m.bundle!r} is not a folder; {expected}")
    manifest = p / "manifest.json"
    if not manifest.is_file():
        raise ConfigError(f"model.bundle: {m.bundle!r} has no manifest.json, so it is not an engine bundle; {expected}")
    from phyai_edge.engines.bundle import BundleError, read_manifest, validation_problem  # no torch

    try:
        data = read_manifest(p)  # JSON, format, its seal (an edit after export), the fields loaders read
    except (OSError, BundleError) as exc:
        raise ConfigError(f"model.bundle: {exc}") from None
    problem = validation_problem(p, data)
    if problem:
        raise ConfigError(f"model.bundle: {problem}")
    sizes = data.get("batch_sizes")
    if data.get("backend") in ("onnxruntime", "tensorrt") and isinstance(sizes, list) and 1 not in sizes:
        # The daemon runs one observation a chunk; these engines take only the sizes exported.
        raise ConfigError(f"model.bundle: {m.bundle!r} was exported for batch sizes {sizes}, and the daemon runs "
                          "batch 1: re-export with --batch 1 (or 1,2,...)")
    # What the bundle's backend needs, checked here (exit 2, no restart under systemd) rather than
    # when the worker loads it (exit 1, five restarts each loading the model).
    backend = data.get("backend")
    if backend in ("cudagraph", "tensorrt") and not m.device.startswith("cuda"):
        raise ConfigError(f"model.device: a {backend} bundle runs on a CUDA device; set model.device = \"cuda\" "
                          f"(got {_show(m.device)})")
    # A bundle only runs its engines: the backend's runtime, whose module has the backend's name (no onnx).
    if backend in BACKEND_NEEDS and not _importable(backend):
        article = "an" if backend[0] in "aeiou" else "a"
        raise ConfigError(f"model.bundle: {m.bundle!r} is {article} {backend} bundle, and {backend} is not installed "
                          f"here ({_install_how(backend)})")


def load_config(path: str | Path | None = None) -> DaemonConfig:
    """Read and validate a TOML file; None gives the embedded default."""
    if path is None:
        return parse_config(tomllib.loads(DEFAULT_CONFIG_TOML), "<embedded default>")
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")  # what TOML is, whatever the locale says
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text, which TOML requires (byte {exc.start}: {exc.reason})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML ({exc})") from None
    return parse_config(data, str(p))


def named_instructions(cfg: DaemonConfig) -> list[tuple[str, str]]:
    """(config key, instruction) of every instruction the config names, which must each fit."""
    named = [("model.prompt", cfg.model.prompt)]
    if cfg.task.endpoint:
        named += [(f"task.prompts[{i}]", p) for i, p in enumerate(cfg.task.prompts)]
    return named


def check_against_policy(cfg: DaemonConfig, chunk_size: int, action_dim: int, state_dim: int, camera_names: Sequence[str]) -> None:
    """Checks that need the loaded policy. Fills in dims and H left at 0 ("take the policy's")."""
    r = cfg.robot
    if r.action_dim and r.action_dim != action_dim:
        raise ConfigError(f"robot.action_dim: the policy outputs {action_dim} actions, the config says {r.action_dim}")
    r.action_dim = action_dim
    if r.state_dim and r.state_dim != state_dim:
        raise ConfigError(f"robot.state_dim: the policy expects {state_dim} state values, the config says {r.state_dim}")
    r.state_dim = state_dim
    for key in ("action_min", "action_max", "max_rate"):
        value = getattr(r.limits, key)
        if isinstance(value, tuple) and len(value) != action_dim:
            raise ConfigError(f"robot.limits.{key}: has {len(value)} values but the policy outputs {action_dim} actions")
    if cfg.safety.hold == "state" and state_dim != action_dim:
        # Holding at the measured state means sending it as an action: only where they are one space.
        raise ConfigError(f"safety.hold: 'state' sends the measured state as the hold action, but the policy's "
                          f"state has {state_dim} values and its actions {action_dim}; use 'last' or 'zero'")
    for cam in cfg.cameras.values():
        if cam.view_name not in camera_names:
            raise ConfigError(
                f"cameras.{cam.name}.view: the policy has no camera {cam.view_name!r} (it expects {', '.join(camera_names)})"
            )
    ch = cfg.chunking
    if ch.horizon > chunk_size:
        raise ConfigError(f"chunking.horizon: {ch.horizon} is longer than the policy's chunk ({chunk_size})")
    source = "chunking.horizon" if ch.horizon else "the policy's chunk"
    ch.horizon = ch.horizon or chunk_size
    check_chunking(ch, ch.horizon, source)


# The default: the tiny PI0.5 (random seeded weights), one synthetic camera, synthetic state and a
# local endpoint, so that `phyai-edge run` works on a fresh machine. Printed by
# `phyai-edge run --print-default-config` as a starting point for a real robot.
DEFAULT_CONFIG_TOML = """\
# phyai-edge run: daemon configuration. Every key is optional; these are the defaults. Camera
# tables are the exception: a file needs at least one, and its tables replace [cameras.top] below.

[robot]
name = "robot"
control_hz = 50.0            # the fixed control period is 1 / control_hz
# action_names = ["waist", "shoulder", ...]   # optional; sets action_dim
action_dim = 0               # 0: the policy's action width
state_dim = 0                # 0: the policy's state width

[robot.limits]               # scalars apply to every dimension; lists give one value per action
# action_min = -3.2
# action_max = 3.2
# max_rate = 6.0             # robot units per second

[cameras.top]                # the table name is the camera's name
source = "synthetic"         # synthetic | v4l2 | gstreamer | rtsp | file | zmq
view = "top"                 # which of the policy's camera slots this feeds (top, left_wrist, right_wrist
                             # for PI0.5); slots with no camera are masked out
width = 224
height = 224
fps = 30.0
required = true              # false: a camera with no fresh frame is masked out instead of holding
                             # (when every camera is optional and none is fresh, the tick holds STALE)
max_age_ms = 0.0             # a frame older than this is stale; 0: safety.camera_max_age_ms
# device = 0                 # v4l2: index or a path; "/dev/v4l/by-id/usb-..." keeps naming the same
                             # camera after a replug, where its index may change
# pipeline = "..."           # gstreamer: a pipeline ending in appsink
# url = "rtsp://..."         # rtsp
# path = "clip.mp4"          # file; loop = true starts it again at the end
# endpoint = "tcp://127.0.0.1:5560"   # zmq: frames in docs/protocol.md format; topic = "" (the camera's
                             # name), clock = "monotonic" | "realtime" | "receive": which time is the capture's
# crop = [0, 0, 224, 224]    # what the policy sees, as it was trained: a crop (x, y, width, height of
# rotate = 180               # the width x height above), then a clockwise rotation (0 | 90 | 180 | 270),
# flip = "horizontal"        # then a mirror ("horizontal" | "vertical"); in the worker, off the clock

[state]
source = "synthetic"         # synthetic | zmq
# endpoint = "tcp://127.0.0.1:5556"   # zmq: the motor controller's joint-state PUB
clock = "monotonic"          # zmq: the sample's time from its header's monotonic_ns ("realtime": wall_ns,
                             # for a sender on another host with a synchronised clock; "receive": arrival)

[model]
adapter = "pi05"
preset = "tiny"              # tiny: random seeded weights, for trying the daemon out
checkpoint = ""              # a local checkpoint folder (safetensors)
tokenizer = ""               # the PaliGemma tokenizer.json / tokenizer.model, if not in the checkpoint folder
bundle = ""                  # or an engine bundle from `phyai-edge export` (then backend, preset and
                             # dtype come from its manifest; a checkpoint set too must be the one it was built from)
backend = "eager"            # eager | cudagraph | onnxruntime | tensorrt
device = "cpu"               # cpu | cuda | cuda:N
dtype = "float32"            # float32 | bfloat16 | float16 (or fp32 | bf16 | fp16)
prompt = "pick up the cube"
worker = "process"           # process | thread: where the policy runs
threads = 1                  # torch threads in the worker (leave a core for the clock); 0: torch's default
load_timeout_s = 600.0       # loading the policy may take this long (a full-size checkpoint, Triton's
                             # first compile); each warm-up inference too (graph capture). systemd's
                             # start timeout is extended to match
warmup = 1                   # warm-up rounds before the clock starts: a chunk without RTC and, in a
                             # solver RTC mode, one with it (graphs captured, kernels compiled); with
                             # one round and chunking.delay = 0, a second round times a chunk for the
                             # delay estimate (the first's time is mostly compiling and capturing)
restart_backoff_s = 0.5      # a dead worker process is restarted after this, doubling per failed attempt
restart_backoff_max_s = 30.0 # up to this; attempts never stop (the daemon holds meanwhile)
inference_timeout_s = 10.0   # an inference still running after this: the worker is hung, killed and restarted
noise_seed = 0               # each chunk's noise is drawn from (this, its inference number): a --record
                             # replays to the same actions in `phyai-edge eval`
# engine_options = { early_step = false }   # backend = "cudagraph": its switches (triton_ops, triton_gemm,
                             # dense_prefix, dense_expert, early_step; docs/gpu.md), each true / false
# adapter_options = { prompt_state = "padded" }   # the adapter's options (PI0.5: prompt_state = robot |
                             # padded | none; padded for a policy fine-tuned with LeRobot v0.4.x, none for
                             # openpi's discrete_state_input = False (pi05_libero); relative_actions =
                             # "6,-1,6,-1" for an openpi ALOHA policy trained on delta joints, "none" for absolute;
                             # robot_space = "aloha" for an openpi ALOHA policy on a robot in standard ALOHA space)

[chunking]
mode = "guided-approx"       # none | crossfade | inpaint | guided-approx | guided
horizon = 0                  # H; 0: the policy's chunk size
execution_horizon = 25       # s: actions run before the next inference starts
max_guidance_weight = 5.0    # beta (guided modes)
delay = 0                    # d; 0: the maximum of the last delay_window measured delays
delay_initial = 3
delay_window = 10
crossfade_steps = 8

[publish]
endpoint = "tcp://127.0.0.1:5555"
bind = true                  # the daemon binds its PUB; false: it connects to a proxy's XSUB
topic = "action"
chunk_topic = "chunk"        # whole remaining chunk on adoption; "" to disable
sndhwm = 1000                # messages queued per slow subscriber before ZeroMQ drops for it

[safety]
camera_max_age_ms = 200.0
state_max_age_ms = 100.0
hold = "last"                # last | state | zero: the payload of HOLD messages

[task]                       # the instruction (model.prompt) changed while the daemon runs: `phyai-edge task`
endpoint = ""                # a ZeroMQ REP endpoint, e.g. "tcp://127.0.0.1:5557"; "" is off
bind = true                  # the daemon binds its REP; false: it connects (to a broker's DEALER)
prompts = []                 # instructions the engine keeps room for at warm-up, beside model.prompt
prompt_tokens = 0            # room (prompt tokens, the state's included) for instructions not listed;
                             # a chunk's prefix costs more with more room. A longer one is refused, never
                             # truncated or captured inside the loop
any_prompt = true            # false: accept only model.prompt and the instructions in prompts
start_held = false           # true: HOLD | PAUSED from the start until `phyai-edge task --release`

[metrics]
port = 0                     # Prometheus on host:port; 0 is off
host = "127.0.0.1"

[clock]
priority = 80                # SCHED_FIFO priority of the clock thread; 0 leaves it
cpus = []                    # CPU affinity of the clock thread
mlock = true
spin_us = 150.0
switch_interval_us = 200.0
late_warning_ms = 0.0        # a tick published this late is logged (one line per 10 s); 0: period / 4
"""
