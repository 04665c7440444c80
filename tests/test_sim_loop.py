"""The closed loop: `phyai-edge run` (tiny PI0.5) drives `phyai-edge sim` (MuJoCo ALOHA), two processes.

The test steers by events it sees on the daemon's action stream (its own SUB socket), never by
sleeping for a guessed time: policy actions flowing -> stop the sim's camera stream (SIGUSR1)
-> the daemon publishes HOLD | STALE -> restart the stream (SIGUSR2) -> policy actions again.
Afterwards the sim's own log is checked: contiguous sequence numbers, joints that follow the
commands, a HOLD within the camera age limit that the sim really held, and recovery.
"""

from __future__ import annotations

import importlib.util
import signal
import time
from pathlib import Path

import pytest
import zmq

# find_spec, not importorskip: importing mujoco at collection would fix its GL backend before
# the sim code sets MUJOCO_GL=egl for tests that render in this process.
if importlib.util.find_spec("mujoco") is None or importlib.util.find_spec("gym_aloha") is None:
    pytest.skip("needs the `sim` extra (gym-aloha, mujoco)", allow_module_level=True)

from phyai_edge.control.protocol import Flag, decode_actions
from phyai_edge.roofline.sources import parse_bench
from phyai_edge.sim import launch
from phyai_edge.sim.report import analyse, load_log, outages, plot_run, roofline_bench

# Generous on a loaded 2-core machine: the tiny model, the clock, the sim and its renderer share
# two cores. The limits bound how long the checks wait, not how fast things must be.
CAMERA_MAX_AGE_MS = 300.0
STATE_MAX_AGE_MS = 300.0
START_TIMEOUT_S = 180.0
EVENT_TIMEOUT_S = 60.0


class ActionWatcher:
    """The test's own subscriber to the daemon's actions."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"action")
        self.sock.connect(endpoint)

    def wait_for(self, predicate, count: int, timeout: float, procs) -> int:
        """Receive until `count` messages satisfied `predicate(flags)`; returns the last seq."""
        end = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < end:
            for p in procs:
                assert p.poll() is None, f"{p.args[3]} exited early with {p.returncode}"
            if self.sock.poll(100):
                _, header, _ = decode_actions(self.sock.recv_multipart())
                if predicate(header.flags):
                    seen += 1
                    if seen >= count:
                        return header.seq
        raise AssertionError(f"waited {timeout:.0f} s for {count} matching actions, saw {seen}")

    def close(self) -> None:
        self.sock.close(0)


def _tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "(no log)"


@pytest.mark.slow
def test_daemon_drives_the_sim_and_holds_when_the_camera_dies(tmp_path: Path) -> None:
    cfg = tmp_path / "loop.toml"
    ports = launch.loop_config(
        cfg,
        safety={"camera_max_age_ms": CAMERA_MAX_AGE_MS, "state_max_age_ms": STATE_MAX_AGE_MS},
        cameras={"top": {"max_age_ms": CAMERA_MAX_AGE_MS}},
        clock={"priority": 0, "mlock": False},
        metrics={"port": 0},
    )
    daemon_log, sim_log, run_log = tmp_path / "daemon.log", tmp_path / "sim.log", tmp_path / "run.npz"
    watcher = ActionWatcher(f"tcp://127.0.0.1:{ports['action']}")
    daemon = launch.start("run", ["--config", str(cfg), "--no-realtime"], daemon_log)
    sim = launch.start("sim", ["--config", str(cfg), "--log", str(run_log), "--report-every", "2"], sim_log)
    procs = (daemon, sim)
    try:
        try:
            is_motion = lambda f: not f & Flag.HOLD  # noqa: E731
            # 1. The policy drives the arms (the model loads first, so allow for a slow start).
            watcher.wait_for(is_motion, 150, START_TIMEOUT_S, procs)
            # 2. The camera stream dies: the daemon must stop acting on its old frames.
            sim.send_signal(signal.SIGUSR1)
            watcher.wait_for(lambda f: f & Flag.HOLD and f & Flag.STALE, 1, EVENT_TIMEOUT_S, procs)
            # Stay in HOLD long enough to see the arms stand still.
            watcher.wait_for(lambda f: f & Flag.HOLD, 60, EVENT_TIMEOUT_S, procs)
            # 3. The stream comes back: policy actions again.
            sim.send_signal(signal.SIGUSR2)
            watcher.wait_for(is_motion, 50, EVENT_TIMEOUT_S, procs)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- daemon:\n{_tail(daemon_log)}\n--- sim:\n{_tail(sim_log)}") from None
        assert launch.stop(sim) == 0, _tail(sim_log)
    finally:
        watcher.close()
        launch.stop(sim)
        launch.stop(daemon)

    run = load_log(run_log)
    r = analyse(run)
    seq, loop, t = r["sequence"], r["closed_loop"], r["timing"]
    context = f"\n--- sim:\n{_tail(sim_log)}\n--- daemon:\n{_tail(daemon_log)}"

    # Every action the sim received (and so every one it applied) has the next sequence number.
    assert seq["sessions"] == 1, context
    assert seq["contiguous"], f"gaps {seq['gaps']} lost {seq['lost']} repeats {seq['repeats']}{context}"
    assert seq["applied"] >= 60 and seq["applied_increasing"] and seq["applied_all_received"], seq
    assert seq["last_seq"] - seq["first_seq"] + 1 == seq["received"]

    # The loop is closed: the stiff joints moved and followed the commanded targets.
    assert loop["moving_joints"] >= 4, loop
    assert loop["median_corr_moving"] > 0.8, loop

    # One outage: HOLD | STALE within the age limit of the last frame, no motion command after
    # it (a period of slack for the tick grid plus scheduling on a loaded machine), the sim held
    # its target and the arms came to rest, then policy actions resumed.
    assert len(r["outages"]) == 1, r["outages"]
    o = outages(run, slack_ms=150.0)[0]
    assert o["restart_s"] is not None
    assert o["hold_after_last_frame_ms"] is not None, o
    assert o["hold_after_last_frame_ms"] <= CAMERA_MAX_AGE_MS + 150.0, o
    assert o["motion_after_limit"] == 0, o
    assert o["target_changes_during_hold"] == 0, o
    assert o["joint_step_settled_p50_rad"] is not None
    assert o["joint_step_settled_p50_rad"] < 0.25 * loop["driven_joint_step_p50_rad"], (o, loop)
    assert o["resumed_after_restart_ms"] is not None, o
    # Frames really flowed and were used: the daemon's observations carry our frames' times.
    assert t["frames"] > 50 and t["chunks"] >= 3, t

    # The report's products: a chart, and stage times the roofline reads as a measured point.
    plot_run(run, r, tmp_path / "run.png")
    assert (tmp_path / "run.png").stat().st_size > 10_000
    measured = parse_bench(roofline_bench(r))[0]
    assert {"camera_age", "transport", "inference"} <= set(measured.stages_s), measured.stages_s
    assert 0 < measured.stages_s["camera_age"] < 1.0 and measured.stages_s["transport"] < 1.0

