"""The simulated robot's parts, without the daemon: physics and camera, HOLD handling, sequence
checks, and the ALOHA deployment config."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from phyai_edge.control.config import check_against_policy, load_config, parse_config
from phyai_edge.control.protocol import ActionHeader, Flag, encode_actions
from phyai_edge.sim import launch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ALOHA = launch.ALOHA_CONFIG


def test_aloha_config_fits_the_tiny_pi05_and_the_sim() -> None:
    cfg = load_config(ALOHA)
    # The built-in tiny PI0.5: H = 50, 14 actions, 14 state values, three camera slots.
    check_against_policy(cfg, 50, 14, 14, ["top", "left_wrist", "right_wrist"])
    assert cfg.robot.action_dim == 14 and cfg.robot.state_dim == 14
    assert [c.source for c in cfg.cameras.values()] == ["zmq"]
    from phyai_edge.sim.robot import settings_from_config

    s = settings_from_config(cfg)
    assert s.render_every == 2  # 25 fps frames at 50 Hz
    assert s.state_endpoint == cfg.state.endpoint
    assert s.action_endpoint == cfg.publish.endpoint and not s.action_bind
    assert [(c.name, c.mujoco_camera, c.width, c.height) for c in s.cameras] == [("top", "top", 640, 480)]
    assert s.camera_max_age_ms == 250.0


def test_loop_config_moves_ports_and_stays_valid(tmp_path: Path) -> None:
    path = tmp_path / "loop.toml"
    ports = launch.loop_config(path, safety={"camera_max_age_ms": 300.0}, clock={"priority": 0})
    data = tomllib.loads(path.read_text())
    assert data["publish"]["endpoint"] == f"tcp://127.0.0.1:{ports['action']}"
    assert data["cameras"]["top"]["endpoint"] == f"tcp://127.0.0.1:{ports['camera']}"
    assert data["safety"]["camera_max_age_ms"] == 300.0
    assert data["robot"]["limits"]["max_rate"] == 3.0  # nested tables survive the round trip
    cfg = parse_config(data)
    assert cfg.state.endpoint == f"tcp://127.0.0.1:{ports['state']}"


def test_seq_checker_counts_gaps_repeats_and_sessions() -> None:
    from phyai_edge.sim.robot import SeqChecker

    def h(seq: int, session: int = 7) -> ActionHeader:
        return ActionHeader(seq, 0, 0, 0, 0, 0, 1, 14, session=session)

    c = SeqChecker()
    assert c.check(h(5)) is None  # the first message we hear sets the start
    assert c.check(h(6)) is None
    assert "gap" in c.check(h(9))
    assert "repeated" in c.check(h(9))
    assert c.check(h(0, session=8)) is None  # a restarted daemon starts again
    assert (c.gaps, c.lost, c.repeats, c.sessions) == (1, 2, 1, 2)


needs_sim = pytest.mark.skipif(
    importlib.util.find_spec("mujoco") is None or importlib.util.find_spec("gym_aloha") is None,
    reason="needs the `sim` extra (gym-aloha, mujoco)",
)


@needs_sim
def test_physics_follows_a_target_and_the_camera_renders() -> None:
    from phyai_edge.sim.aloha import AlohaSim

    sim = AlohaSim("transfer_cube", seed=0)
    try:
        q0 = sim.joint_state()
        assert q0.shape == (14,) and q0.dtype == np.float32
        target = q0.copy()
        target[[1, 8]] += 0.4  # both shoulders
        for _ in range(50):  # one second
            sim.step(target)
        q = sim.joint_state()
        assert abs(q[1] - target[1]) < 0.05 and abs(q[8] - target[8]) < 0.05
        assert abs(q[0] - q0[0]) < 0.01  # the waist was told to stay
        image = sim.render("top", 320, 240)
        assert image.shape == (240, 320, 3) and image.dtype == np.uint8
        assert image.std() > 5  # a scene, not a blank buffer
        with pytest.raises(ValueError, match="14 values"):
            sim.step(np.zeros(7))
    finally:
        sim.close()


@needs_sim
def test_sim_applies_the_newest_action_and_holds_its_own_target_on_hold(tmp_path: Path) -> None:
    """A stand-in daemon publishes motion, then HOLD with a different payload, then SHUTDOWN:
    the sim must keep the last motion target through HOLD and log contiguous sequence numbers."""
    daemon = _StandIn()
    robot, start = daemon.robot, daemon.start
    try:
        daemon.join()
        motion = start.copy()
        for k in range(25):
            motion = start.copy()
            motion[1] += 0.01 * k
            daemon.send(motion)
        last_motion = motion.copy()
        for _ in range(25):
            daemon.send(np.full(14, 0.5, np.float32), Flag.HOLD | Flag.STALE)  # a payload the sim must ignore
        daemon.send(np.zeros(14, np.float32), Flag.HOLD | Flag.SHUTDOWN)
        time.sleep(0.1)
    finally:
        daemon.close()

    lg = robot.log
    rx_flags = np.asarray(lg.rx_flags)
    assert np.all(np.diff(lg.rx_seq) == 1), "received seqs are not contiguous"
    first_hold = int(np.flatnonzero((rx_flags & Flag.STALE) != 0)[0])
    hold_step = lg.rx_step[first_hold]
    targets = np.asarray(lg.target)
    np.testing.assert_allclose(targets[hold_step:], np.broadcast_to(last_motion, targets[hold_step:].shape))
    assert all(lg.hold[hold_step:])
    applied = [s for s in lg.applied_seq if s >= 0]
    assert applied == sorted(applied) and len(applied) >= 10
    assert robot.seq.gaps == 0 and robot.seq.repeats == 0


@needs_sim
def test_frame_capture_times_on_both_clocks_are_taken_before_rendering() -> None:
    """The frame's capture time is the physics state it shows, on the monotonic and the realtime
    clock alike: a daemon with `clock = "realtime"` (another host) must see render time as age."""
    from phyai_edge.control.protocol import FrameMessage
    from phyai_edge.sim.robot import CameraStream, SimRobot, SimSettings

    cam = CameraStream("top", "top", "tcp://127.0.0.1:1", 64, 48)
    robot = SimRobot(SimSettings(cameras=[cam], report_every_s=0))
    rendered: list[tuple[int, int]] = []
    sent: list[bytes] = []

    def render(camera: str, width: int, height: int) -> np.ndarray:
        rendered.append((time.monotonic_ns(), time.time_ns()))
        return np.zeros((height, width, 3), np.uint8)

    class Socket:
        def send(self, data: bytes, copy: bool = True) -> None:
            sent.append(bytes(data))

    robot.sim.render = render  # type: ignore[method-assign]
    robot._camera_pubs[cam.endpoint] = Socket()
    try:
        robot._publish_frames()
    finally:
        robot._camera_pubs.clear()
        robot.close()
    frame = FrameMessage.decode(sent[0])
    assert frame.image.shape == (48, 64, 3) and frame.seq == 0
    render_mono, render_wall = rendered[0]
    assert frame.capture_mono_ns <= render_mono
    assert frame.capture_wall_ns <= render_wall, "the realtime capture time was read after rendering"


class _StandIn:
    """A stand-in daemon: a PUB the sim connects to, the sim running in a thread."""

    def __init__(self) -> None:
        import zmq

        from phyai_edge.sim.robot import SimRobot, SimSettings

        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        settings = SimSettings(
            state_endpoint=f"tcp://127.0.0.1:{launch.free_port()}",
            action_endpoint=f"tcp://127.0.0.1:{port}",
            cameras=[],
            report_every_s=0,
            duration_s=60.0,
        )
        self.robot = SimRobot(settings, context=self.ctx)
        self.robot.open()
        self.thread = threading.Thread(target=self.robot.run, daemon=True)
        self.thread.start()
        self.start = self.robot.sim.target.astype(np.float32)
        self.seq = 0

    def send(self, values: np.ndarray, flags: int = 0, seq: int | None = None) -> None:
        seq = self.seq if seq is None else seq
        now = time.monotonic_ns()
        header = ActionHeader(seq, now, time.time_ns(), now, 1, seq % 50, 1, 14, flags, 42)
        self.pub.send_multipart(encode_actions(b"action", header, values[None]))
        self.seq = max(self.seq, seq + 1)
        time.sleep(0.02)

    def join(self) -> None:
        """Until the SUB has joined (ZeroMQ drops messages before that), hold the start pose."""
        deadline = time.monotonic() + 20
        while self.robot.received == 0 and time.monotonic() < deadline:
            self.send(self.start, Flag.HOLD | Flag.WARMUP)
        assert self.robot.received > 0, "the sim never received an action"

    def wait(self, condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
            time.sleep(0.01)

    def steps(self) -> int:
        return len(self.robot.log.step_ns)

    def close(self) -> None:
        self.robot.stop()
        self.thread.join(10)
        self.robot.close()
        self.pub.close(0)
        self.ctx.term()


@needs_sim
def test_sim_never_applies_a_repeated_or_older_action() -> None:
    """Within one daemon session an action whose seq is not newer than the last one received is
    logged and counted, never applied: it would move the arm back to an older command."""
    d = _StandIn()
    try:
        d.join()
        newer = d.start.copy()
        newer[1] += 0.1
        d.send(newer)
        last = d.seq - 1
        d.wait(lambda: d.robot.applied >= 1, "the motion action to be applied")
        older = d.start.copy()
        older[1] += 0.3
        received = d.robot.received
        d.send(older, seq=last - 1)  # out of order
        d.send(older, seq=last)  # a repeat
        d.wait(lambda: d.robot.received == received + 2, "the two stale messages")
        steps = d.steps()
        d.wait(lambda: d.steps() >= steps + 3, "three more steps")
    finally:
        d.close()
    targets = np.asarray(d.robot.log.target)
    assert not np.any(np.isclose(targets[:, 1], older[1])), "an older action was applied"
    np.testing.assert_allclose(targets[-1], newer)
    assert d.robot.seq.repeats == 2
    assert d.robot.log.applied_seq.count(last) == 1 and max(d.robot.log.applied_seq) == last


@needs_sim
def test_sim_treats_a_silent_action_stream_as_hold() -> None:
    """docs/protocol.md: a controller treats a silent stream (no message for a few periods) as
    HOLD. The sim keeps its last target, and says it is holding, until the next policy action."""
    d = _StandIn()

    def applied_steps() -> list[int]:
        return [i for i, s in enumerate(list(d.robot.log.applied_seq)) if s >= 0]

    def held_after_motion() -> bool:
        a = applied_steps()
        return bool(a) and any(list(d.robot.log.hold)[a[0] + 1 :])

    try:
        d.join()
        motion = d.start.copy()
        motion[8] += 0.1
        d.send(motion)
        d.wait(lambda: len(applied_steps()) >= 1, "the motion action to be applied")
        # The daemon falls silent (a crash without its SHUTDOWN message).
        d.wait(held_after_motion, "the sim to hold on a silent stream", timeout=10.0)
        motion2 = motion.copy()
        motion2[8] += 0.1
        d.send(motion2)
        d.wait(lambda: len(applied_steps()) >= 2, "the next motion action to be applied")
    finally:
        d.close()
    lg = d.robot.log
    a0, a1 = applied_steps()
    np.testing.assert_allclose(np.asarray(lg.target[a0:a1]), np.broadcast_to(motion, (a1 - a0, 14)))
    assert not lg.hold[a0] and any(lg.hold[a0:a1]) and not lg.hold[a1]
    kinds = [k for k, _ in lg.events]
    assert kinds == ["hold_end", "hold_start", "hold_end"], kinds


def test_roofline_bench_keeps_the_worker_time_outside_the_model_stages() -> None:
    """`phyai-edge roofline --metrics` books the worker's whole-job time minus its stages as
    transport; the bench the sim report writes from the same histograms must not drop it, or the
    loop's L would be shorter than the daemon's own inference."""
    from phyai_edge.roofline.sources import parse_bench
    from phyai_edge.sim.report import roofline_bench

    def ms(p50: float, p90: float) -> dict[str, float]:
        return {"n": 20, "p50_ms": p50, "p90_ms": p90}

    result = {
        "meta": {"control_hz": 50.0},
        "timing": {"camera_age_at_inference": ms(30.0, 50.0), "transport": ms(0.3, 1.0), "chunk_delay": ms(40.0, 60.0)},
        "daemon_inference": {
            "inference": ms(35.0, 47.0), "preprocess": ms(3.0, 4.0), "embed_images": ms(4.0, 8.0),
            "encode_prefix": ms(7.0, 9.0), "solver_loop": ms(15.0, 19.0), "denoise_step": ms(1.5, 1.9),
            "postprocess": ms(0.5, 0.9),
        },
    }
    bench = roofline_bench(result)
    for stat, (whole, parts, camera, transport) in {"p50": (35.0, 29.5, 30.0, 0.3), "p90": (47.0, 40.9, 50.0, 1.0)}.items():
        m = parse_bench(bench, stat=stat)[0]
        st = m.stage_times()
        assert st.camera_age_s == pytest.approx(camera / 1e3)
        assert st.transport_s == pytest.approx((transport + whole - parts) / 1e3)
        model = st.preprocess_s + st.vision_s + st.prefix_s + st.denoise_step_s * st.steps + st.postprocess_s
        assert model + st.transport_s - transport / 1e3 == pytest.approx(whole / 1e3)


def test_roofline_of_the_loop_reports_camera_age_as_staleness() -> None:
    """The loop's camera age reaches the roofline as camera_age_s, which is staleness: the daemon's
    d counts from the inference's start, so L and d are the worker's stages and transport alone,
    and the frame's age comes back in the observation's age when the chunk's first action runs."""
    from phyai_edge.roofline.model import RobotParams, analyze
    from phyai_edge.roofline.sources import parse_bench
    from phyai_edge.sim.report import roofline_bench

    ms = lambda v: {"n": 20, "p50_ms": v, "p90_ms": v}  # noqa: E731
    result = {"meta": {"control_hz": 50.0},
              "timing": {"camera_age_at_inference": ms(52.0), "transport": ms(1.0), "chunk_delay": ms(40.0)}}
    (m,) = parse_bench(roofline_bench(result))
    st = m.stage_times()
    assert st.camera_age_s == pytest.approx(0.052)
    r = analyze(st, RobotParams.from_rates(50.0, 50))
    assert r.latency_s == pytest.approx(0.041)  # the measured chunk delay + transport, no camera age
    assert r.delay_ticks == 3 and r.observation_age_s == pytest.approx(0.052 + 3 * 0.020)


def test_report_frame_rate_is_per_camera_and_leaves_out_outages() -> None:
    """Two cameras at 25 fps with a 1 s outage: the report's frame rate is 25 Hz, not the frames
    of both cameras over the whole span (outage included)."""
    from phyai_edge.sim.report import SimRun, timing

    t = np.concatenate([np.arange(0, 25), np.arange(50, 75)]) * 40_000_000  # 0-1 s, 2-3 s
    frames = np.repeat(t, 2) + np.tile([0, 5_000_000], t.size)
    i64 = lambda *v: np.asarray(v, np.int64)  # noqa: E731
    data = {
        "step_ns": np.arange(0, 4_000_000_000, 20_000_000, dtype=np.int64), "step_ms": np.ones(200, np.float32),
        "applied_seq": np.full(200, -1, np.int64), "rx_seq": i64(), "rx_recv_ns": i64(), "rx_publish_ns": i64(),
        "rx_flags": i64(), "rx_chunk": i64(), "rx_obs_ns": i64(), "rx_index": i64(),
        "frame_camera": np.tile(np.asarray(["top", "left_wrist"]), t.size), "frame_capture_ns": frames,
        "frame_sent_ns": frames + 1_000_000, "frame_render_ms": np.full(frames.size, 0.5, np.float32),
        "event_kind": np.asarray(["camera_stop", "camera_start"]), "event_ns": i64(1_000_000_000, 2_000_000_000),
    }
    out = timing(SimRun(data, {"control_hz": 50.0}))
    assert out["frames"] == 100
    assert out["frame_rate_hz"] == pytest.approx(25.0)


@needs_sim
def test_a_loop_that_fails_still_saves_its_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the loop logged before it died is what explains the failure: `--log` keeps it (with
    the error in its meta), and the command exits 1 instead of raising past the save."""
    from phyai_edge.cli import main as cli
    from phyai_edge.sim import robot as robot_mod
    from phyai_edge.sim.report import load_log

    def dies(self, on_step=None):
        self.log.step_ns.extend([1, 2, 3])  # three steps logged, then the failure
        self.steps = 3
        raise RuntimeError("physics diverged")

    monkeypatch.setattr(robot_mod.SimRobot, "run", dies)
    path, cfg = tmp_path / "run.npz", tmp_path / "loop.toml"
    launch.loop_config(cfg)  # free ports
    rc = cli(["sim", "--config", str(cfg), "--log", str(path), "--duration", "1"])
    assert rc == 1 and path.exists()
    run = load_log(str(path))
    assert run.meta["error"] == "RuntimeError: physics diverged" and run.meta["summary"]["steps"] == 3


@needs_sim
def test_a_loop_that_fails_without_a_log_still_counts_its_steps(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The summary of a failed loop took its step count from the log, so without --log a run that
    failed after minutes said 0 steps at 0 Hz."""
    import json

    from phyai_edge.cli import main as cli
    from phyai_edge.sim.aloha import AlohaSim

    step = AlohaSim.step
    calls: list[int] = []

    def diverges(self: AlohaSim, target: np.ndarray) -> None:
        calls.append(1)
        if len(calls) > 5:
            raise RuntimeError("physics diverged")
        step(self, target)

    monkeypatch.setattr(AlohaSim, "step", diverges)
    cfg, summary = tmp_path / "loop.toml", tmp_path / "summary.json"
    launch.loop_config(cfg)  # free ports
    rc = cli(["sim", "--config", str(cfg), "--duration", "2", "--report-every", "0", "--summary", str(summary)])
    assert rc == 1 and json.loads(summary.read_text())["steps"] == 5


# As the daemon's prometheus-client writes it (labels sorted, values escaped).
MODEL_INFO = ('# HELP phyai_model_info The model the daemon runs\n# TYPE phyai_model_info gauge\n'
              'phyai_model_info{adapter="pi05",backend="cudagraph",bundle="C:\\\\e \\"x\\"\\nq",device="cuda",'
              'dtype="bfloat16",horizon="50",preset="full",steps="5",views="3"} 1.0\n')


def test_report_reads_the_model_info_line_and_unescapes_it() -> None:
    from phyai_edge.sim.report import daemon_model

    labels = daemon_model("phyai_inference_seconds_count 3.0\n" + MODEL_INFO)
    assert labels["bundle"] == 'C:\\e "x"\nq'
    assert labels["preset"] == "full" and labels["views"] == "3" and labels["dtype"] == "bfloat16"
    # An escaped backslash before an n is a backslash and an n, not a line break.
    assert daemon_model('phyai_model_info{bundle="a\\\\nb"} 1.0') == {"bundle": "a\\nb"}
    assert daemon_model("phyai_inference_seconds_count 3.0\n") == {}


def test_report_metrics_round_trip_through_the_daemon_s_metrics() -> None:
    """Label values with a quote, a backslash and a line break survive prometheus-client's
    escaping and the report's parser."""
    pytest.importorskip("prometheus_client")
    from phyai_edge.control.metrics import Metrics
    from phyai_edge.sim.launch import fetch_metrics, free_port
    from phyai_edge.sim.report import daemon_model

    port = free_port()
    labels = {"adapter": "pi05", "bundle": 'a "b" \\c\nd \\n', "views": "2"}
    assert Metrics().serve("127.0.0.1", port, labels)
    text = fetch_metrics(port)
    assert 'bundle="a \\"b\\" \\\\c\\nd \\\\n"' in text
    assert daemon_model(text) == labels


def test_roofline_bench_takes_the_model_from_the_daemon_metrics(tmp_path: Path) -> None:
    """With phyai_model_info in the captured metrics the roofline document names the model that
    ran (not the tiny CPU default), and `phyai-edge roofline --bench` reads it back: views,
    precision, preset, device, backend, steps, horizon. The solver's steps also split the
    worker's time (denoise_step x steps) when only per-step times were reported."""
    import json

    from phyai_edge.roofline.sources import load_bench
    from phyai_edge.sim.report import daemon_inference, daemon_model, roofline_bench

    def ms(p50: float) -> dict[str, float]:
        return {"n": 20, "p50_ms": p50, "p90_ms": p50}

    result = {
        "meta": {"control_hz": 50.0},
        "timing": {"camera_age_at_inference": ms(30.0), "transport": ms(0.5), "chunk_delay": ms(40.0)},
        "daemon_inference": {"inference": ms(20.0), "embed_images": ms(4.0), "encode_prefix": ms(6.0),
                             "denoise_step": ms(1.0)},
    }
    assert daemon_inference(MODEL_INFO) == {}
    bench = roofline_bench({**result, "daemon_model": daemon_model(MODEL_INFO)})
    assert {k: bench[k] for k in ("adapter", "preset", "device", "backend", "dtype", "views", "steps", "horizon")} == {
        "adapter": "pi05", "preset": "full", "device": "cuda", "backend": "cudagraph", "dtype": "bfloat16",
        "views": 3, "steps": 5, "horizon": 50}
    # 20 ms whole minus 4 + 6 + 5 x 1 ms: 5 ms outside the model's stages, booked as transport.
    assert bench["stages"]["transport"]["p50_ms"] == pytest.approx(0.5 + 5.0)
    (tmp_path / "loop.json").write_text(json.dumps(bench))
    (m,) = load_bench(tmp_path / "loop.json")
    assert (m.views, m.precision, m.preset, m.device, m.backend, m.steps, m.horizon) == (
        3, "bf16", "full", "cuda", "cudagraph", 5, 50)
    assert m.calibratable

    # Without the metrics: the defaults as before, and no dtype or views the daemon did not give.
    bench = roofline_bench(result)
    assert (bench["preset"], bench["device"], bench["horizon"]) == ("tiny", "cpu (phyai-edge sim closed loop)", 50)
    assert not {"dtype", "views", "steps", "backend"} & set(bench)
    assert bench["stages"]["transport"]["p50_ms"] == pytest.approx(0.5)  # 20 - (4 + 6 + 10 x 1)


def test_report_analysis_keeps_the_model_info(monkeypatch: pytest.MonkeyPatch) -> None:
    """`phyai-edge sim --report --metrics-file` (analyse) carries the model info to the roofline
    document; the parts of the analysis that need a whole log are stubbed out here."""
    from phyai_edge.sim import report

    for part in ("sequence_check", "timing", "holds", "outages", "closed_loop"):
        monkeypatch.setattr(report, part, lambda run: {})
    run = report.SimRun({"step_ns": np.zeros(0, np.int64)}, {"control_hz": 50.0})
    assert report.analyse(run, MODEL_INFO)["daemon_model"]["preset"] == "full"
    assert "daemon_model" not in report.analyse(run, "phyai_inference_seconds_count 0.0\n")
    assert "daemon_model" not in report.analyse(run)


def test_roofline_bench_names_the_gpu_and_an_fp8_bundle(tmp_path: Path) -> None:
    """The daemon's gpu label names the device the roofline looks up where device is only
    "cuda", and an fp8 bundle's precision label wins over its bfloat16 dtype."""
    import json

    from phyai_edge.roofline.sources import load_bench
    from phyai_edge.sim.report import daemon_model, roofline_bench

    info = MODEL_INFO.replace('device="cuda",', 'device="cuda",gpu="NVIDIA H200",precision="fp8",')
    result = {"meta": {"control_hz": 50.0}, "timing": {"camera_age_at_inference": {"p50_ms": 30.0},
                                                       "transport": {"p50_ms": 0.5}, "chunk_delay": {"p50_ms": 40.0}}}
    bench = roofline_bench({**result, "daemon_model": daemon_model(info)})
    assert (bench["device"], bench["gpu"], bench["dtype"], bench["precision"]) == ("cuda", "NVIDIA H200", "bfloat16", "fp8")
    (tmp_path / "loop.json").write_text(json.dumps(bench))
    (m,) = load_bench(tmp_path / "loop.json")
    assert (m.device, m.precision, m.calibratable) == ("NVIDIA H200", "fp8", True)


def test_roofline_bench_takes_the_rate_and_s_from_the_daemon(tmp_path: Path) -> None:
    """The daemon's rate_hz and exec_horizon labels go into the roofline document, and `phyai-edge
    roofline --bench` reads them back as the run's rate and s; without them the sim's control rate
    and no s (the roofline leaves it free)."""
    import json

    from phyai_edge.roofline.sources import load_bench
    from phyai_edge.sim.report import daemon_model, roofline_bench

    info = MODEL_INFO.replace('horizon="50",', 'exec_horizon="20",horizon="50",rate_hz="30",')
    result = {"meta": {"control_hz": 50.0}, "timing": {"camera_age_at_inference": {"p50_ms": 30.0},
                                                       "transport": {"p50_ms": 0.5}, "chunk_delay": {"p50_ms": 40.0}}}
    bench = roofline_bench({**result, "daemon_model": daemon_model(info)})
    assert (bench["rate_hz"], bench["exec_horizon"], bench["horizon"]) == (30.0, 20, 50)
    (tmp_path / "loop.json").write_text(json.dumps(bench))
    (m,) = load_bench(tmp_path / "loop.json")
    assert (m.rate_hz, m.exec_horizon, m.horizon) == (30.0, 20, 50)

    bench = roofline_bench({**result, "daemon_model": daemon_model(MODEL_INFO)})
    assert bench["rate_hz"] == 50.0 and "exec_horizon" not in bench
    (tmp_path / "old.json").write_text(json.dumps(bench))
    (m,) = load_bench(tmp_path / "old.json")
    assert (m.rate_hz, m.exec_horizon) == (50.0, None)


@needs_sim
@pytest.mark.parametrize("hz", [30.0, 60.0, 200.0, 1000.0])
def test_physics_time_advances_one_control_period_per_step(hz: float) -> None:
    """The physics ran whole 2 ms substeps, rounded: 4% slow at 60 Hz, 20% at 200 Hz, and twice as
    fast as the robot's clock at 1000 Hz. A second of steps must be a second of physics."""
    from phyai_edge.sim.aloha import AlohaSim

    sim = AlohaSim("transfer_cube", control_dt=1.0 / hz)
    try:
        assert sim.model.opt.timestep <= 0.002 + 1e-12
        for _ in range(round(hz)):
            sim.step(sim.target)
        assert sim.sim_time == pytest.approx(1.0, abs=1e-9)
    finally:
        sim.close()


@needs_sim
def test_cameras_render_at_their_own_fps_with_the_step_s_capture_time() -> None:
    """Two cameras at 25 and 10 fps (50 Hz control): each renders at its own rate (both rendered at
    25 fps before), and both frames of one step carry the time of the physics state they show
    (the second camera's was read after the first one's render, so it looked that much younger)."""
    from phyai_edge.control.protocol import FrameMessage
    from phyai_edge.sim.robot import SimRobot, settings_from_config

    cfg = parse_config(_two_cameras())
    s = settings_from_config(cfg, report_every_s=0)
    assert [(c.name, c.every) for c in s.cameras] == [("top", 2), ("left_wrist", 5)]
    robot = SimRobot(s)
    renders: list[int] = []
    sent: list[bytes] = []

    def render(camera: str, width: int, height: int) -> np.ndarray:
        renders.append(time.monotonic_ns())
        time.sleep(0.01)
        return np.zeros((height, width, 3), np.uint8)

    class Socket:
        def send(self, data: bytes, copy: bool = True) -> None:
            sent.append(bytes(data))

    robot.sim.render = render  # type: ignore[method-assign]
    for cam in s.cameras:
        robot._camera_pubs[cam.endpoint] = Socket()
    try:
        for step in range(10):
            robot._publish_frames(step)
    finally:
        robot._camera_pubs.clear()
        robot.close()
    frames = [FrameMessage.decode(b) for b in sent]
    assert [f.camera for f in frames].count("top") == 5 and [f.camera for f in frames].count("left_wrist") == 2
    top0, wrist0 = frames[0], frames[1]  # step 0: both cameras
    assert (top0.camera, wrist0.camera) == ("top", "left_wrist")
    assert wrist0.capture_mono_ns == top0.capture_mono_ns <= renders[0]
    assert wrist0.capture_wall_ns == top0.capture_wall_ns


def _two_cameras() -> dict:
    data = tomllib.loads(ALOHA.read_text())
    data["cameras"]["wrist"] = {"source": "zmq", "view": "left_wrist", "endpoint": "tcp://127.0.0.1:5561",
                                "topic": "left_wrist", "width": 64, "height": 48, "fps": 10.0, "max_age_ms": 300.0}
    data["cameras"]["top"].update(width=64, height=48)
    return data


@pytest.mark.parametrize(("key", "robot"), [
    ("action_dim", {"action_names": [f"j{i}" for i in range(7)], "limits": {"action_min": -1.0, "action_max": 1.0}}),
    ("state_dim", {"state_dim": 7}),
])
def test_a_config_whose_robot_is_not_the_aloha_is_refused(key: str, robot: dict) -> None:
    """The sim accepted a 7-joint config without a word, then refused every action (a warning per
    message) while the daemon refused every state message: the loop held for good."""
    from phyai_edge.sim.robot import settings_from_config

    data = tomllib.loads(ALOHA.read_text())
    data["robot"].update(robot)
    with pytest.raises(ValueError, match=f"robot.{key}: 7, but the simulated ALOHA has 14 joints"):
        settings_from_config(parse_config(data))


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str | None, str]:
    from phyai_edge.cli import main as cli

    try:
        rc: int | str | None = cli(["sim", *args])
    except SystemExit as exc:  # `fail` and argparse end the command this way
        rc = exc.code
    return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize(("args", "says"), [
    (["--render-every", "0"], "--render-every 0: expected an integer >= 1"),  # a modulo by zero in the loop
    (["--render-every", "-2"], "--render-every -2: expected an integer >= 1"),  # rendered every step
    (["--samples", "-1"], "--samples -1: expected an integer >= 0"),  # a traceback from the GL context
    (["--report-every", "-1"], "--report-every -1: expected a number >= 0"),  # a status line every step
    (["--report-every", "nan"], "--report-every nan: expected a number >= 0"),  # never one
    (["--seed", "-1"], "--seed -1: expected an integer >= 0"),  # numpy's line, naming no flag
    (["--seed", str(2**32)], f"--seed {2**32}: expected an integer <= {2**32 - 1}"),
])
def test_a_flag_out_of_range_is_refused_in_one_line(capsys: pytest.CaptureFixture[str], args: list[str],
                                                    says: str) -> None:
    rc, err = _cli(["--duration", "1", *args], capsys)
    assert rc == 2 and err.startswith(f"phyai-edge sim: {says}"), err
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize(("args", "says"), [
    (["--size", "0x240"], "argument --size: expected a width and height >= 1, got '0x240'"),  # empty frames
    (["--size", "320"], "argument --size: expected WxH like 640x480, got '320'"),
    (["--camera-outage", "nan:1"], "argument --camera-outage: expected finite START >= 0 and LENGTH > 0"),
    (["--camera-outage", "1:inf"], "argument --camera-outage: expected finite START >= 0 and LENGTH > 0"),
])
def test_a_bad_size_or_outage_is_a_usage_error(capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    """A NaN or infinite outage killed the loop on its first step (a traceback turning it into ns)."""
    rc, err = _cli(["--duration", "1", *args], capsys)
    assert rc == 2 and err.splitlines()[-1].startswith(f"phyai-edge sim: error: {says}"), err


def test_paths_that_cannot_be_written_or_read_are_refused_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A --log or --summary in a missing folder failed after the whole run, with a traceback and the
    run's log lost; a --report that is no log and a missing --metrics-file ended in tracebacks."""
    missing = tmp_path / "no" / "run.npz"
    for flag in ("--log", "--summary"):
        rc, err = _cli(["--duration", "1", flag, str(missing)], capsys)
        assert rc == 2 and err == f"phyai-edge sim: {flag} {missing}: the folder {missing.parent} does not exist"
    not_a_log = tmp_path / "run.npz"
    not_a_log.write_text("hello")
    rc, err = _cli(["--report", str(not_a_log)], capsys)
    assert rc == 2 and err == f"phyai-edge sim: --report {not_a_log}: not a run's log (the .npz `phyai-edge sim --log` saves)"
    np.savez(not_a_log, step_ns=np.zeros(0, np.int64))  # an .npz, but not a sim log (no meta)
    rc, err = _cli(["--report", str(not_a_log)], capsys)
    assert rc == 2 and "not a run's log" in err and len(err.splitlines()) == 1, err
    for flag in ("--plot", "--roofline-json"):
        rc, err = _cli(["--report", str(not_a_log), flag, str(missing)], capsys)
        assert rc == 2 and err == f"phyai-edge sim: {flag} {missing}: the folder {missing.parent} does not exist"
    from phyai_edge.sim.robot import SimLog

    log = tmp_path / "empty.npz"
    SimLog().save(str(log), {"control_hz": 50.0})
    rc, err = _cli(["--report", str(log), "--metrics-file", str(tmp_path / "metrics.txt")], capsys)
    assert rc == 2 and err == f"phyai-edge sim: --metrics-file {tmp_path / 'metrics.txt'}: cannot read it (No such file or directory)"


def test_report_matches_applied_actions_to_their_own_daemon_session() -> None:
    """A daemon restarted 10 s into a run numbers its actions from 0 again. Each applied action's
    wait for the sim's step was taken against the last session's message with that seq: the first
    session's waits came out near -10 s (p50 -5 s)."""
    from phyai_edge.sim.report import SimRun, timing

    ms = 1_000_000
    publish = np.concatenate([np.arange(10), 500 + np.arange(10)]).astype(np.int64) * 20 * ms
    received = publish + 1 * ms
    i64 = lambda v: np.asarray(v, np.int64)  # noqa: E731
    data = {
        "step_ns": received + 5 * ms, "step_ms": np.ones(20, np.float32), "applied_seq": i64(list(range(10)) * 2),
        "rx_seq": i64(list(range(10)) * 2), "rx_session": i64([1] * 10 + [2] * 10), "rx_step": i64(range(20)),
        "rx_recv_ns": received, "rx_publish_ns": publish, "rx_flags": i64([0] * 20), "rx_chunk": i64([1] * 20),
        "rx_obs_ns": i64([0] * 20), "rx_index": i64([0] * 20), "frame_capture_ns": i64([]),
    }
    out = timing(SimRun(data, {"control_hz": 50.0}))
    assert out["wait_for_step"]["n"] == 20
    assert out["wait_for_step"]["min_ms"] == pytest.approx(5.0) and out["wait_for_step"]["max_ms"] == pytest.approx(5.0)
    assert out["publish_to_apply"]["min_ms"] == pytest.approx(6.0)


def test_ctrl_c_while_the_cameras_are_timed_stops_the_sim_without_a_traceback(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The signal handlers went in after the start-up render timing, so a Ctrl-C there raised
    KeyboardInterrupt through the command."""
    import json
    import os
    import signal

    from phyai_edge.cli import main as cli
    from phyai_edge.sim.aloha import AlohaSim

    def interrupted(self: AlohaSim, *args: object, **kwargs: object) -> float:
        os.kill(os.getpid(), signal.SIGINT)
        return 0.001

    monkeypatch.setattr(AlohaSim, "time_render", interrupted)
    cfg, summary = tmp_path / "loop.toml", tmp_path / "summary.json"
    launch.loop_config(cfg)
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)  # what the sim takes over
    old = {sig: signal.getsignal(sig) for sig in signals}
    try:
        rc = cli(["sim", "--config", str(cfg), "--duration", "5", "--report-every", "0", "--summary", str(summary)])
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    assert rc == 0 and json.loads(summary.read_text())["steps"] == 0
