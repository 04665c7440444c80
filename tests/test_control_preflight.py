"""`phyai-edge run --preflight`: the robot computer checked against a configuration, live."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import zmq

from phyai_edge.cli import main as cli
from phyai_edge.control.config import parse_config
from phyai_edge.control.fakes import free_tcp_endpoint
from phyai_edge.control.preflight import FAIL, OK, WARN, Check, exit_code, format_checks, run_preflight
from phyai_edge.control.protocol import STATE_FLAG_ESTOP, FrameMessage, StateMessage


class Sender:
    """A motor controller and a camera host: state at `state_hz`, frames of `size` at `fps`."""

    def __init__(self, fps: float = 30.0, state_hz: float = 200.0, size: tuple[int, int] = (48, 64),
                 estop: bool = False, state_dim: int = 6) -> None:
        self.ctx = zmq.Context()
        self.frames_at, self.state_at = free_tcp_endpoint(), free_tcp_endpoint()
        self.fps, self.state_hz, self.size, self.estop, self.state_dim = fps, state_hz, size, estop, state_dim
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sender:
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(2)
        self.ctx.destroy(linger=0)

    def _run(self) -> None:
        frames, state = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.PUB)
        frames.bind(self.frames_at)
        state.bind(self.state_at)
        image = np.zeros((*self.size, 3), np.uint8)
        next_frame = next_state = time.monotonic()
        seq = 0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_state:
                flags = STATE_FLAG_ESTOP if self.estop else 0
                state.send(StateMessage(np.zeros(self.state_dim, np.float32), seq, time.monotonic_ns(), flags=flags).encode())
                next_state += 1 / self.state_hz
            if now >= next_frame:
                frames.send(FrameMessage("top", image, seq, time.monotonic_ns()).encode())
                next_frame += 1 / self.fps
            seq += 1
            time.sleep(0.001)
        frames.close(0)
        state.close(0)


def _config(sender: Sender | None, **sections) -> object:
    frames = sender.frames_at if sender else free_tcp_endpoint()
    state = sender.state_at if sender else free_tcp_endpoint()
    data = {
        "cameras": {"top": {"source": "zmq", "endpoint": frames, "width": 64, "height": 48, "fps": 30.0}},
        "state": {"source": "zmq", "endpoint": state},
        "publish": {"endpoint": free_tcp_endpoint()},
        "clock": {"priority": 0, "mlock": False},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return parse_config(data, "<test>")


def _by_name(checks) -> dict:
    return {c.what.split(" (")[0]: c for c in checks}


def test_a_robot_that_sends_what_the_config_says_is_ready():
    with Sender() as s:
        checks = run_preflight(_config(s), seconds=1.5)
    got = _by_name(checks)
    assert {c.status for c in checks} == {OK}, checks
    assert exit_code(checks) == 0
    fps = float(got["camera top"].detail.split(" fps")[0])
    assert 15 <= fps <= 45  # 30 sent; wide: a loaded 2-core machine delays both threads
    assert "64x48" in got["camera top"].detail and "6 values" in got["state"].detail


def test_nothing_sending_fails_naming_what_the_daemon_would_do():
    checks = run_preflight(_config(None), seconds=0.5)
    got = _by_name(checks)
    assert got["camera top"].status == FAIL and "holds (STALE)" in got["camera top"].detail
    assert got["state"].status == FAIL and "is the motor controller publishing?" in got["state"].detail
    assert exit_code(checks) == 2


def test_an_optional_camera_without_frames_is_a_warning():
    cfg = _config(None, cameras={"top": {"source": "zmq", "endpoint": free_tcp_endpoint(), "required": False}})
    got = _by_name(run_preflight(cfg, seconds=0.3))
    assert got["camera top"].status == WARN and "masked" in got["camera top"].detail


def test_an_estop_a_slow_camera_and_a_frame_of_another_size_are_named():
    with Sender(fps=10.0, size=(96, 128), estop=True) as s:
        got = _by_name(run_preflight(_config(s), seconds=1.5))
    assert got["state"].status == FAIL and "e-stop" in got["state"].detail
    cam = got["camera top"]
    assert cam.status == WARN
    assert "below the configured 30 fps" in cam.detail and "delivered at 128x96, configured 64x48" in cam.detail


def test_a_state_of_the_wrong_width_is_refused_as_the_daemon_would():
    with Sender(state_dim=5) as s:
        got = _by_name(run_preflight(_config(s, robot={"state_dim": 6}), seconds=0.8))
    assert got["state"].status == FAIL and "refused" in got["state"].detail


def test_a_socket_already_bound_and_a_cpu_that_is_not_there_fail():
    endpoint = free_tcp_endpoint()
    ctx = zmq.Context()
    held = ctx.socket(zmq.PUB)
    held.bind(endpoint)  # another daemon
    try:
        cfg = _config(None, publish={"endpoint": endpoint}, clock={"cpus": [4095]})
        got = _by_name(run_preflight(cfg, seconds=0.2))
    finally:
        ctx.destroy(linger=0)
    assert got["publish.endpoint"].status == FAIL and "already running" in got["publish.endpoint"].detail
    assert got["clock.cpus"].status == FAIL and "[4095]" in got["clock.cpus"].detail


def test_model_files_and_the_gpu_are_checked(tmp_path):
    torch = pytest.importorskip("torch")
    (tmp_path / "empty").mkdir()
    cfg = _config(None, model={"checkpoint": str(tmp_path / "empty"), "device": "cuda"})
    got = _by_name(run_preflight(cfg, seconds=0.2))
    assert got["model.checkpoint"].status == FAIL and "no .safetensors" in got["model.checkpoint"].detail
    if not torch.cuda.is_available():
        assert got["model.device"].status == FAIL and "sees no CUDA device" in got["model.device"].detail


def test_the_command_prints_a_line_per_check_and_exits_by_the_worst(tmp_path, capsys, restored_logging):
    with Sender() as s:
        cfg_file = tmp_path / "robot.toml"
        cfg_file.write_text(f"""
[cameras.top]
source = "zmq"
endpoint = "{s.frames_at}"
width = 64
height = 48
[state]
source = "zmq"
endpoint = "{s.state_at}"
[publish]
endpoint = "{free_tcp_endpoint()}"
[clock]
priority = 0
mlock = false
""")
        rc = cli(["run", "--preflight", str(cfg_file), "--duration", "1", "--summary", str(tmp_path / "p.json")])
    out = capsys.readouterr()
    assert rc == 0, out
    assert out.out.splitlines()[0].startswith("OK    publish.endpoint")
    assert "ready" in out.err
    assert {c["status"] for c in json.loads((tmp_path / "p.json").read_text())} == {OK}
    (tmp_path / "bad.toml").write_text("[cameras.top]\nfps = -1\n")
    assert cli(["run", "--preflight", str(tmp_path / "bad.toml")]) == 2
    assert "cameras.top.fps" in capsys.readouterr().err


def test_a_v4l2_camera_that_is_not_there_is_named_by_its_device_node():
    cfg = _config(None, cameras={"top": {"source": "v4l2", "device": "/dev/video-phyai-test-absent"}})
    got = _by_name(run_preflight(cfg, seconds=0.3))
    assert got["camera top"].status == FAIL
    assert "/dev/video-phyai-test-absent does not exist" in got["camera top"].detail


def _jetson(root, lo: int, hi: int, now: int, node: str = "17000000.gpu") -> None:
    (root / "etc").mkdir(parents=True)
    (root / "etc/nv_tegra_release").write_text("# R36 (release), REVISION: 4.0\n")
    d = root / "sys/class/devfreq" / node
    d.mkdir(parents=True)
    (root / "sys/class/devfreq/15820000.nvdla0").mkdir()  # another devfreq device, not the GPU
    for name, value in (("min_freq", lo), ("max_freq", hi), ("cur_freq", now)):
        (d / name).write_text(f"{value}\n")


def test_a_jetson_whose_gpu_clock_floats_or_whose_power_mode_is_capped_is_warned(tmp_path):
    from phyai_edge.control.preflight import jetson_checks

    assert jetson_checks(tmp_path / "not-a-jetson") == []
    _jetson(tmp_path / "free", 306_000_000, 1_300_500_000, 612_000_000, node="17000000.ga10b")
    got = _by_name(jetson_checks(tmp_path / "free", lambda: "NV Power Mode: 30W\n2\n"))
    assert got["jetson.gpu_clock"].status == WARN and "min 306, max 1300, now 612 MHz" in got["jetson.gpu_clock"].detail
    assert got["jetson.power_mode"].status == WARN and got["jetson.power_mode"].detail.startswith("30W")
    _jetson(tmp_path / "locked", 1_300_500_000, 1_300_500_000, 1_300_500_000)
    got = _by_name(jetson_checks(tmp_path / "locked", lambda: "NV Power Mode: MAXN\n0\n"))
    assert got["jetson.gpu_clock"].status == OK and "locked (min 1300, max 1300" in got["jetson.gpu_clock"].detail
    assert got["jetson.power_mode"].status == OK
    assert _by_name(jetson_checks(tmp_path / "locked", lambda: None))["jetson.power_mode"].status == WARN


def test_info_says_a_jetson_s_clock_and_power_mode(monkeypatch, capsys):
    """`phyai-edge info` (and the bench JSON that embeds it) carries what Jetson timings depend on."""
    from phyai_edge.control import preflight
    from phyai_edge.control.preflight import Check

    monkeypatch.setattr(preflight, "jetson_checks", lambda: [Check("jetson.gpu_clock", WARN, "not locked"),
                                                             Check("jetson.power_mode", OK, "MAXN")])
    assert cli(["info"]) == 0
    out = capsys.readouterr().out
    assert "gpu_clock       warn: not locked" in out and "power_mode      ok: MAXN" in out
    assert cli(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["jetson"] == {"gpu_clock": "warn: not locked", "power_mode": "ok: MAXN"}


def _governors(root, by_cpu: dict[int, str]) -> None:
    for cpu, governor in by_cpu.items():
        d = root / f"sys/devices/system/cpu/cpu{cpu}/cpufreq"
        d.mkdir(parents=True)
        (d / "scaling_governor").write_text(f"{governor}\n")
    (root / "sys/devices/system/cpu/cpufreq").mkdir(exist_ok=True)  # not a CPU


def test_cpus_whose_clock_follows_their_load_are_warned(tmp_path):
    from phyai_edge.control.preflight import cpu_governor_checks

    assert cpu_governor_checks(tmp_path / "no-cpufreq") == []  # a VM or container: nothing to check
    _governors(tmp_path / "mixed", {0: "performance", 1: "schedutil", 2: "schedutil", 3: "schedutil", 6: "schedutil",
                                    10: "powersave"})
    (check,) = cpu_governor_checks(tmp_path / "mixed")
    assert check.what == "cpu.governor" and check.status == WARN
    assert check.detail.startswith("powersave on CPUs 10; schedutil on CPUs 1-3,6:")
    assert "cpupower frequency-set -g performance" in check.detail
    _governors(tmp_path / "fast", {i: "performance" for i in range(4)})
    assert cpu_governor_checks(tmp_path / "fast")[0].status == OK
    assert cpu_governor_checks(tmp_path / "fast")[0].detail == "performance on CPUs 0-3"


def test_info_says_the_cpu_governors(monkeypatch, capsys):
    from phyai_edge.control import preflight

    monkeypatch.setattr(preflight, "cpu_governors", lambda: {"schedutil": [0, 1, 2, 3]})
    assert cli(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cpu_governor"] == "schedutil on CPUs 0-3"
    monkeypatch.setattr(preflight, "cpu_governors", lambda: {})
    assert cli(["info"]) == 0
    assert "cpu_governor    not exposed" in capsys.readouterr().out


def test_a_long_label_gets_a_line_of_its_own_and_the_column_stays_narrow():
    """A GStreamer camera's name is its pipeline: the other lines keep a narrow label column."""
    long = "v4l2src device=/dev/video0 ! video/x-raw,width=640 ! videoconvert ! appsink"
    text = format_checks([Check("state", OK, "fresh"), Check(f"camera {long}", WARN, "slow"), Check("gpu", OK, "H200")])
    lines = text.splitlines()
    assert lines[0].startswith("OK    state") and len(lines[0]) < 50
    assert lines[1] == f"WARN  camera {long}" and lines[2].strip() == "slow"
    assert lines[3].startswith("OK    gpu") and lines[3].index("H200") == lines[0].index("fresh")
