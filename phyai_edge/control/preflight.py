"""`phyai-edge run --preflight FILE`: is this robot computer ready for the daemon? Before the
service starts, on the robot, with the real devices.

`--check-config` reads the file; this opens what it names, for a few seconds, as the daemon would:
every camera (frames arriving, their rate, size and age against the limits the daemon holds them
to), the state stream (rate, width, e-stop), the sockets the daemon binds (a daemon already
running holds them), the real-time settings the clock asks for, and what the model needs on disk
and the GPU it names. The policy itself is not loaded (minutes at full size): start the daemon for
that. Each check is ok, warn (the daemon runs, but not as configured) or fail (it would not run,
or would hold on every tick).
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phyai_edge.control.config import CameraConfig, DaemonConfig

OK, WARN, FAIL = "ok", "warn", "fail"
POLL_S = 0.002  # faster than any camera or state stream the daemon reads, so no sample is missed
# Stale at this share of the polls or more is a failure: the daemon holds, and drops its chunk, on
# as many ticks (a robot that stops every few ticks); fewer is a warning.
STALE_SHARE_FAIL = 0.05


@dataclass
class Check:
    what: str
    status: str  # OK | WARN | FAIL
    detail: str


@dataclass
class _Stream:
    """What a newest-sample source showed while it was polled."""

    samples: int = 0  # distinct samples seen
    first_s: float = 0.0  # their capture (or sample) times
    last_s: float = 0.0
    ages_ms: list[float] | None = None
    shape: tuple[int, ...] = ()
    estop: bool = False
    error: str = ""
    polls: int = 0  # polls that found a sample
    stale_polls: int = 0  # of them, those whose newest sample was older than the limit
    oldest_ms: float = 0.0  # the oldest the newest sample got at a poll

    def poll(self, age_ms: float, limit_ms: float) -> None:
        """The newest sample's age at one poll, as the daemon checks it on every tick: between
        samples too, not only when one arrives."""
        self.polls += 1
        self.stale_polls += age_ms > limit_ms
        self.oldest_ms = max(self.oldest_ms, age_ms)

    @property
    def stale_share(self) -> float:
        return self.stale_polls / self.polls if self.polls else 0.0

    def see(self, t: float, now: float, shape: tuple[int, ...]) -> None:
        if self.samples == 0:
            self.first_s, self.ages_ms = t, []
        self.samples += 1
        self.last_s, self.shape = t, shape
        assert self.ages_ms is not None
        self.ages_ms.append((now - t) * 1e3)

    @property
    def rate_hz(self) -> float:
        span = self.last_s - self.first_s
        return (self.samples - 1) / span if self.samples > 1 and span > 0 else 0.0


def run_preflight(cfg: DaemonConfig, seconds: float = 3.0, context: Any = None) -> list[Check]:
    """Every check, in the order the daemon meets them at start-up."""
    import zmq

    ctx = context or zmq.Context()
    try:
        checks = [*_model_checks(cfg), *jetson_checks(), *cpu_governor_checks(), *_realtime_checks(cfg),
                  *_socket_checks(cfg, ctx)]
        checks += _stream_checks(cfg, seconds, ctx)
    finally:
        if context is None:
            ctx.destroy(linger=0)
    return checks


# ---------------------------------------------------------------- model files and GPU


def _model_checks(cfg: DaemonConfig) -> list[Check]:
    m = cfg.model
    out = []
    if m.checkpoint:
        p = Path(m.checkpoint)
        weights = sorted(p.glob("*.safetensors")) + sorted(p.glob("*/*.safetensors")) if p.is_dir() else []
        if not p.is_dir():
            out.append(Check("model.checkpoint", FAIL, f"{m.checkpoint} is not a folder"))
        elif not weights:  # an openpi JAX folder (params/, Orbax) too: convert it to PyTorch first
            out.append(Check("model.checkpoint", FAIL, f"{m.checkpoint} holds no .safetensors weights"))
        else:
            size = sum(f.stat().st_size for f in weights) / 1e9
            out.append(Check("model.checkpoint", OK, f"{m.checkpoint}: {len(weights)} weight file(s), {size:.2f} GB"))
    if m.bundle:
        out.append(Check("model.bundle", OK, f"{m.bundle}: an engine bundle (its files' hashes are checked when it loads)"))
    if m.device.startswith("cuda") and not m.factory:
        out.append(_cuda_check(m.device))
    return out


def _cuda_check(device: str) -> Check:
    try:
        import torch  # a one-shot command: the daemon's clock process never imports it
    except ImportError:
        return Check("model.device", FAIL, f"{device}: torch is not installed")
    if not torch.cuda.is_available():
        return Check("model.device", FAIL, f"{device}: torch {torch.__version__} sees no CUDA device "
                     "(a CPU build of torch, or the driver is not loaded; `phyai-edge info` says more)")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return Check("model.device", FAIL, f"{device}: only {torch.cuda.device_count()} CUDA device(s)")
    free, total = torch.cuda.mem_get_info(index)
    return Check("model.device", OK, f"{device}: {torch.cuda.get_device_name(index)}, "
                 f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free")


# ---------------------------------------------------------------- Jetson power mode and clocks

# Tegra GPUs' devfreq nodes: ga10b (Orin, JetPack 5), "gpu" (Orin, JetPack 6), gv11b (Xavier).
_TEGRA_GPU_NAMES = ("gpu", "ga10b", "gv11b", "gp10b")


def jetson_checks(root: Path = Path("/"), nvpmodel: Any = None) -> list[Check]:
    """On a Jetson: whether the GPU clock is locked (`jetson_clocks`) and the power mode. Under
    DVFS the GPU clock follows the load, so a chunk after the daemon's idle gap between inferences
    starts slow, and latency varies chunk to chunk; a capped power mode (15 / 30 / 50 W) lowers
    the ceiling the roofline's Orin numbers assume (the module's full clock). `root` and
    `nvpmodel` (a callable giving `nvpmodel -q`'s output or None) are for tests. Nothing here was
    run on a Jetson: the paths are JetPack's documented sysfs layout."""
    if not (root / "etc/nv_tegra_release").exists():
        return []
    out = []
    nodes = [p for p in sorted((root / "sys/class/devfreq").glob("*"))
             if any(name in p.name.lower() for name in _TEGRA_GPU_NAMES)]
    if not nodes:
        out.append(Check("jetson.gpu_clock", WARN, "no GPU devfreq node under /sys/class/devfreq: clock not checked"))
    for node in nodes[:1]:
        try:
            lo, hi, now = (int((node / f).read_text().split()[0]) for f in ("min_freq", "max_freq", "cur_freq"))
        except (OSError, ValueError, IndexError) as exc:
            out.append(Check("jetson.gpu_clock", WARN, f"{node}: cannot read the clock ({exc})"))
            continue
        mhz = f"min {lo / 1e6:.0f}, max {hi / 1e6:.0f}, now {now / 1e6:.0f} MHz"
        if lo < hi:
            out.append(Check("jetson.gpu_clock", WARN, f"not locked ({mhz}): the clock follows the load, so a chunk "
                             "after the idle gap starts slow; `sudo jetson_clocks` locks it at max (a boot-time unit "
                             "keeps it)"))
        else:
            out.append(Check("jetson.gpu_clock", OK, f"locked ({mhz})"))
    query = (nvpmodel or _nvpmodel_query)()
    if query is None:
        out.append(Check("jetson.power_mode", WARN, "`nvpmodel -q` did not answer: power mode not checked"))
    else:
        mode = next((line.split(":", 1)[1].strip() for line in query.splitlines() if "Power Mode" in line), "")
        if not mode:
            out.append(Check("jetson.power_mode", WARN, f"`nvpmodel -q` said {query.strip()!r}: power mode not read"))
        elif "MAXN" in mode.upper():
            out.append(Check("jetson.power_mode", OK, mode))
        else:
            out.append(Check("jetson.power_mode", WARN, f"{mode}: a capped mode lowers the GPU clock ceiling "
                             "(`sudo nvpmodel -m 0` is MAXN on AGX Orin; check `nvpmodel -p --verbose`)"))
    return out


def cpu_governor_checks(root: Path = Path("/")) -> list[Check]:
    """Whether every CPU runs the `performance` frequency governor. Under `powersave` /
    `schedutil` / `ondemand` a core's clock follows its load, so the worker's host work (frames,
    prompt, launches) and the clock thread's wake-up run slower after the daemon's idle gap between
    chunks. No check where the kernel exposes no cpufreq (most VMs and containers). `root` is for
    tests."""
    found = cpu_governors(root)
    if not found:
        return []
    others = {g: cpus for g, cpus in found.items() if g != "performance"}
    if not others:
        return [Check("cpu.governor", OK, describe_governors(found))]
    said = describe_governors(others)
    return [Check("cpu.governor", WARN, f"{said}: a core's clock follows its load, so host work after the idle gap "
                  "between chunks runs slower; `sudo cpupower frequency-set -g performance` (a boot-time unit keeps "
                  "it; on a Jetson, `jetson_clocks`)")]


def cpu_governors(root: Path = Path("/")) -> dict[str, list[int]]:
    """Each cpufreq governor in use -> the CPUs on it; empty where the kernel exposes none."""
    found: dict[str, list[int]] = {}
    for path in sorted((root / "sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_governor")):
        try:
            found.setdefault(path.read_text().strip(), []).append(int(path.parent.parent.name[3:]))
        except (OSError, ValueError):
            continue
    return found


def describe_governors(found: dict[str, list[int]]) -> str:
    """{"schedutil": [1, 2, 3, 6]} -> "schedutil on CPUs 1-3,6"."""
    return "; ".join(f"{g} on CPUs {_cpu_list(cpus)}" for g, cpus in sorted(found.items()))


def _cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 6] -> "0-3,6"."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _nvpmodel_query() -> str | None:
    import shutil
    import subprocess

    exe = shutil.which("nvpmodel")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, "-q"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None


# ---------------------------------------------------------------- real time


def _realtime_checks(cfg: DaemonConfig) -> list[Check]:
    from phyai_edge.control.clock import fifo_permitted

    c = cfg.clock
    out = []
    if not sys.platform.startswith("linux"):
        return [Check("clock", WARN, "not Linux: no SCHED_FIFO, affinity or mlockall")]
    if c.priority:
        if fifo_permitted(c.priority):
            out.append(Check("clock.priority", OK, f"SCHED_FIFO {c.priority} permitted"))
        else:
            out.append(Check("clock.priority", WARN, f"SCHED_FIFO {c.priority} not permitted for this user: the clock "
                             "runs at normal priority (the unit's LimitRTPRIO=, or rtprio in "
                             "/etc/security/limits.conf; systemd/INSTALL.md)"))
    if c.cpus:
        allowed = os.sched_getaffinity(0)
        missing = sorted(set(c.cpus) - allowed)
        out.append(Check("clock.cpus", FAIL if missing else OK,
                         f"CPUs {missing} are not available to this process (allowed: {sorted(allowed)})" if missing
                         else f"CPUs {list(c.cpus)} available"))
    if c.mlock:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft == resource.RLIM_INFINITY or _has_capability(CAP_IPC_LOCK):
            out.append(Check("clock.mlock", OK, "memory can be locked"))
        else:
            out.append(Check("clock.mlock", WARN, f"RLIMIT_MEMLOCK is {soft // 1024} KiB: mlockall will fail and pages may "
                             "be swapped out under load (the unit's LimitMEMLOCK=infinity)"))
    return out


CAP_IPC_LOCK = 14  # linux/capability.h: lock memory past RLIMIT_MEMLOCK


def _has_capability(bit: int, status: str = "/proc/self/status") -> bool:
    """Whether this process holds a capability, from CapEff. Being root is not enough: a container
    (Docker's default set) or a unit's CapabilityBoundingSet= drops CAP_IPC_LOCK, and mlockall
    then fails for root too."""
    try:
        with open(status) as f:
            line = next((ln for ln in f if ln.startswith("CapEff:")), "")
    except OSError:
        return False
    return bool(line) and bool(int(line.split()[1], 16) >> bit & 1)


# ---------------------------------------------------------------- sockets


def _socket_checks(cfg: DaemonConfig, ctx: Any) -> list[Check]:
    import zmq

    out = []
    binds = [("publish.endpoint", cfg.publish.endpoint, cfg.publish.bind, zmq.PUB)]
    if cfg.task.endpoint:
        binds.append(("task.endpoint", cfg.task.endpoint, cfg.task.bind, zmq.REP))
    for key, endpoint, bind, kind in binds:
        if not bind:
            out.append(Check(key, OK, f"{endpoint}: connects (a peer binds it; not checked)"))
            continue
        if ipc_listening(endpoint):
            out.append(Check(key, FAIL, f"{endpoint}: a process is listening on it (is a daemon already running?)"))
            continue
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            hint = " (is a daemon already running?)" if exc.errno == zmq.EADDRINUSE else ""
            out.append(Check(key, FAIL, f"{endpoint}: {exc}{hint}"))
        else:
            out.append(Check(key, OK, f"{endpoint}: free"))
        finally:
            sock.close()
    if cfg.metrics.port:
        out.append(_metrics_port_check(cfg.metrics.host, cfg.metrics.port))
    return out


def ipc_listening(endpoint: str) -> bool:
    """Whether a process listens on an ipc:// endpoint's path. Asked before the bind test, which
    must not run then: libzmq's bind unlinks the path first (a file a crashed process left), so
    the test bound a running daemon's endpoint, reported it free, and took it over: controllers
    that connected afterwards reached the test's closed socket, never the daemon. An abstract
    name (@...) has no file, and its bind fails as a TCP port's does."""
    path = endpoint.removeprefix("ipc://") if endpoint.startswith("ipc://") else ""
    if not path or path == "*" or path.startswith("@") or not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False  # refused: a file left behind, which the daemon's bind replaces
    return True


def _metrics_port_check(host: str, port: int) -> Check:
    from phyai_edge.control.metrics import listen_problem

    problem = listen_problem(host, port)
    return Check("metrics.port", FAIL, problem) if problem else Check("metrics.port", OK, f"{host}:{port}: free")


# ---------------------------------------------------------------- cameras and state


def _stream_checks(cfg: DaemonConfig, seconds: float, ctx: Any) -> list[Check]:
    """Open every camera and the state stream as the daemon does, poll them together for
    `seconds`, then judge each."""
    from phyai_edge.control.cameras import make_camera
    from phyai_edge.control.state import make_state

    cams: dict[str, Any] = {}
    seen = {name: _Stream() for name in cfg.cameras}
    for name, c in cfg.cameras.items():
        try:
            cams[name] = make_camera(c, ctx)
            cams[name].start()
        except Exception as exc:
            seen[name].error = f"{type(exc).__name__}: {exc}"
            cams.pop(name, None)
    state_seen = _Stream()
    state = None
    if cfg.state.source == "synthetic":
        state_seen.error = "synthetic"  # nothing to open: a test source, not a robot
    try:
        if not state_seen.error:
            state = make_state(cfg.state, cfg.robot.state_dim, ctx)
            state.start()
    except Exception as exc:
        state_seen.error = f"{type(exc).__name__}: {exc}"
        state = None
    last: dict[str, float] = {}
    cam_limits_ms = {name: cfg.camera_max_age_s(c) * 1e3 for name, c in cfg.cameras.items()}
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            now = time.monotonic()
            for name, cam in cams.items():
                fr = cam.latest()
                if fr is not None:
                    seen[name].poll((now - fr.capture_s) * 1e3, cam_limits_ms[name])
                if fr is not None and last.get(name) != fr.capture_s:
                    last[name] = fr.capture_s
                    seen[name].see(fr.capture_s, now, fr.image.shape)
            if state is not None:
                sample = state.latest()
                if sample is not None:
                    state_seen.poll((now - sample.time_s) * 1e3, cfg.safety.state_max_age_ms)
                if sample is not None and last.get("\0state") != sample.time_s:
                    last["\0state"] = sample.time_s
                    state_seen.see(sample.time_s, now, sample.values.shape)
                    state_seen.estop = state_seen.estop or sample.estop
            time.sleep(POLL_S)
    finally:
        for cam in cams.values():
            cam.stop()
        if state is not None:
            state.stop()
    checks = [_judge_camera(cfg, cfg.cameras[name], seen[name], cams.get(name), seconds) for name in cfg.cameras]
    checks.append(_judge_state(cfg, state_seen, state, seconds))
    return checks


def _judge_camera(cfg: DaemonConfig, c: CameraConfig, s: _Stream, cam: Any, seconds: float) -> Check:
    where = cam.describe() if cam is not None else c.source
    what = f"camera {c.name} ({where})"
    if s.error:
        return Check(what, FAIL, f"cannot open: {s.error}")
    limit_ms = cfg.camera_max_age_s(c) * 1e3
    if s.samples == 0:
        consequence = "the daemon holds (STALE) on every tick" if c.required else "the policy runs without it (masked)"
        cause = _no_frame_cause(c, cam)
        return Check(what, FAIL if c.required else WARN, f"no frame in {seconds:g} s{cause}: {consequence}")
    assert s.ages_ms is not None
    age_p50, age_max = statistics.median(s.ages_ms), max(s.ages_ms)
    height, width = s.shape[:2]
    size = f"{width}x{height}"
    geometry = c.geometry
    if geometry is not None:
        oh, ow = geometry.output_size(height, width)
        size += f" -> {ow}x{oh} (crop / rotate / flip)"
    text = (f"{s.rate_hz:.1f} fps (configured {c.fps:g}), {size}, age p50 {age_p50:.0f} ms, max {age_max:.0f} ms "
            f"(limit {limit_ms:.0f} ms)")
    problems = []
    if age_p50 > limit_ms:
        problems.append((FAIL, "frames are older than the limit when they arrive: the daemon holds (STALE)"))
    elif s.stale_share >= STALE_SHARE_FAIL:
        # An optional camera gone stale is masked, not held for: the policy runs without it.
        problems.append((FAIL if c.required else WARN, _stale_between(s, "frame", "a frame", c.required)))
    elif age_max > limit_ms:
        problems.append((WARN, "some frames arrive older than the limit: expect STALE holds"))
    elif s.stale_polls:
        problems.append((WARN, _stale_between(s, "frame", "a frame", c.required)))
    if s.samples > 1 and s.rate_hz < 0.8 * c.fps:
        problems.append((WARN, f"below the configured {c.fps:g} fps"))
    if (height, width) != (c.height, c.width):
        problems.append((WARN, f"delivered at {size.split(' ')[0]}, configured {c.width}x{c.height} "
                               "(the policy resizes any size; a crop scales with it)"))
    if not problems:
        return Check(what, OK, text)
    status = FAIL if any(p[0] == FAIL for p in problems) else WARN
    return Check(what, status, text + "; " + "; ".join(p[1] for p in problems))


def _no_frame_cause(c: CameraConfig, cam: Any) -> str:
    """Why a camera gave nothing, where it can be told: a V4L2 node missing or not ours to open,
    or an OpenCV source that never opened (the log lines above say what OpenCV reported)."""
    if c.source == "v4l2":
        node = c.device if isinstance(c.device, str) else f"/dev/video{c.device}"
        if not os.path.exists(node):
            return f" ({node} does not exist: unplugged, or another index; `v4l2-ctl --list-devices` lists them)"
        if not os.access(node, os.R_OK | os.W_OK):
            return f" ({node} is not readable and writable by this user: add it to group video)"
    if getattr(cam, "connected", True) is False:
        return f" (never opened; {getattr(cam, 'reconnects', 0)} reopen attempt(s), see the log lines above)"
    return ""


def _judge_state(cfg: DaemonConfig, s: _Stream, state: Any, seconds: float) -> Check:
    what = f"state ({state.describe() if state is not None else cfg.state.source})"
    if s.error == "synthetic":
        return Check(what, WARN, "a synthetic test source: set [state] source = \"zmq\" for a robot")
    if s.error:
        return Check(what, FAIL, f"cannot open: {s.error}")
    bad = getattr(state, "bad_messages", 0)
    if s.samples == 0:
        why = f"{bad} message(s) refused (see the log lines above)" if bad else "is the motor controller publishing?"
        return Check(what, FAIL, f"no state in {seconds:g} s: {why}; the daemon holds (STALE) on every tick")
    assert s.ages_ms is not None
    limit_ms = cfg.safety.state_max_age_ms
    age_p50, age_max = statistics.median(s.ages_ms), max(s.ages_ms)
    # 0: the policy's width, which only the daemon learns; any width was taken here.
    width = "" if cfg.robot.state_dim else " (robot.state_dim is unset: not checked against the policy)"
    text = (f"{s.rate_hz:.0f} Hz, {s.shape[0]} values{width}, age p50 {age_p50:.1f} ms, max {age_max:.1f} ms "
            f"(limit {limit_ms:g} ms)")
    if s.estop:
        return Check(what, FAIL, text + "; the e-stop bit is set: the daemon holds (ESTOP)")
    if age_p50 > limit_ms:
        return Check(what, FAIL, text + "; samples are older than the limit when they arrive: the daemon holds (STALE)")
    if s.stale_share >= STALE_SHARE_FAIL:
        return Check(what, FAIL, text + "; " + _stale_between(s, "sample", "a sample", True))
    if s.stale_polls:
        return Check(what, WARN, text + "; " + _stale_between(s, "sample", "a sample", True))
    if s.samples > 1 and s.rate_hz < cfg.robot.control_hz:
        return Check(what, WARN, text + f"; slower than the {cfg.robot.control_hz:g} Hz control rate: ticks reuse samples")
    if bad:
        return Check(what, WARN, text + f"; {bad} message(s) refused")
    return Check(what, OK, text)


def _stale_between(s: _Stream, noun: str, one: str, required: bool) -> str:
    """A stream whose readings arrive fresh but too far apart: the daemon checks the newest one's
    age on every tick, so it holds between them (this passed as ok or as a rate warning)."""
    every = f" ({one} every {1e3 / s.rate_hz:.0f} ms)" if s.rate_hz > 0 else ""
    if not required:
        consequence = "the policy runs without it (masked) on as many ticks"
    elif s.stale_share >= STALE_SHARE_FAIL:
        consequence = "the daemon holds (STALE) on as many ticks, dropping its chunk each time"
    else:
        consequence = "expect STALE holds"
    return (f"between {noun}s the newest one grows older than the limit{every}, up to {s.oldest_ms:.0f} ms, "
            f"at {s.stale_share:.0%} of the polls: {consequence}")


LABEL_WIDTH = 28  # a longer label (a GStreamer pipeline names its camera) gets a line of its own


def format_checks(checks: list[Check]) -> str:
    width = min(max((len(c.what) for c in checks), default=0), LABEL_WIDTH)
    lines = []
    for c in checks:
        if len(c.what) > width:
            lines.append(f"{c.status.upper():<5} {c.what}\n{'':<5} {'':<{width}}  {c.detail}")
        else:
            lines.append(f"{c.status.upper():<5} {c.what:<{width}}  {c.detail}")
    return "\n".join(lines)


def exit_code(checks: list[Check]) -> int:
    """0 all ok, 1 warnings only, 2 a failure."""
    statuses = {c.status for c in checks}
    return 2 if FAIL in statuses else 1 if WARN in statuses else 0
