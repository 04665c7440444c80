"""`phyai-edge run --preflight` against what the daemon really does: its endpoints while one runs,
stream ages as every tick sees them, and the metrics port after a daemon stopped."""

from __future__ import annotations

import socket
import time

import numpy as np
import zmq
from test_control_preflight import Sender, _by_name, _config

from phyai_edge.control.fakes import free_tcp_endpoint
from phyai_edge.control.preflight import FAIL, OK, WARN, _socket_checks, run_preflight


def test_preflight_beside_a_running_daemon_on_ipc_fails_and_leaves_its_endpoint_working(tmp_path):
    """libzmq's ipc bind unlinks the path first: the bind test succeeded on a running daemon's
    endpoint ("free") and took it over, so controllers that connected later heard nothing."""
    endpoint = f"ipc://{tmp_path}/actions"
    ctx = zmq.Context()
    try:
        daemon = ctx.socket(zmq.PUB)
        daemon.bind(endpoint)
        got = _by_name(_socket_checks(_config(None, publish={"endpoint": endpoint}), ctx))
        check = got["publish.endpoint"]
        assert check.status == FAIL and "already running" in check.detail, check
        controller = ctx.socket(zmq.SUB)
        controller.setsockopt(zmq.SUBSCRIBE, b"")
        controller.connect(endpoint)
        heard = False
        end = time.monotonic() + 5
        while not heard and time.monotonic() < end:
            daemon.send(b"action")
            heard = controller.poll(50) != 0
        assert heard, "a controller connecting after the preflight no longer reaches the daemon"
    finally:
        ctx.destroy(linger=0)


def test_an_ipc_endpoint_free_or_left_behind_by_a_crash_is_ok(tmp_path):
    ctx = zmq.Context()
    try:
        free = f"ipc://{tmp_path}/free"
        assert _by_name(_socket_checks(_config(None, publish={"endpoint": free}), ctx))["publish.endpoint"].status == OK
        left = tmp_path / "left"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
            dead.bind(str(left))  # the file stays, nothing listens: a daemon that crashed
        got = _by_name(_socket_checks(_config(None, publish={"endpoint": f"ipc://{left}"}), ctx))
        assert got["publish.endpoint"].status == OK, got["publish.endpoint"]
    finally:
        ctx.destroy(linger=0)


def test_a_stream_fresh_on_arrival_but_slower_than_its_age_limit_fails():
    """Frames at 4 fps against a 200 ms limit and state at 8 Hz against 100 ms arrive fresh, so
    preflight said ok (camera) and 'ticks reuse samples' (state), while the daemon, which checks
    the newest reading's age on every tick, held STALE on about a fifth of them."""
    with Sender(fps=4.0, state_hz=8.0) as s:
        # the configured fps left at its 30: a 4 fps limit under 250 ms is refused by the config itself
        got = _by_name(run_preflight(_config(s), seconds=2.0))
    for name in ("camera top", "state"):
        check = got[name]
        assert check.status == FAIL, check
        assert "grows older than the limit" in check.detail and "holds (STALE)" in check.detail, check


def test_an_optional_camera_between_frames_is_masked_not_held_for():
    with Sender(fps=4.0) as s:
        optional = {"source": "zmq", "endpoint": s.frames_at, "width": 64, "height": 48, "required": False}
        got = _by_name(run_preflight(_config(s, cameras={"top": optional}), seconds=1.5))
    check = got["camera top"]
    assert check.status == WARN and "masked" in check.detail and "holds" not in check.detail, check


def test_a_stream_with_room_under_its_limit_passes():
    with Sender(fps=10.0, state_hz=100.0) as s:
        got = _by_name(run_preflight(_config(s, cameras={"top": {"fps": 10.0}}), seconds=1.0))
    for name in ("camera top", "state"):
        assert got[name].status == OK, got[name]


def _time_wait_port() -> int:
    """A port whose listener closed after closing a connection first (as the metrics server does
    after a scrape): it keeps the connection in TIME_WAIT for a minute."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()
            client.recv(1)  # the server's FIN
    return port


def test_the_metrics_port_of_a_daemon_stopped_a_moment_ago_is_free():
    port = _time_wait_port()
    ctx = zmq.Context()
    try:
        got = _by_name(_socket_checks(_config(None, metrics={"port": port}), ctx))
        assert got["metrics.port"].status == OK, got["metrics.port"]
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen(1)
            busy = held.getsockname()[1]
            got = _by_name(_socket_checks(_config(None, metrics={"port": busy}), ctx))
            assert got["metrics.port"].status == FAIL and "in use" in got["metrics.port"].detail
    finally:
        ctx.destroy(linger=0)


def test_a_state_width_left_to_the_policy_is_said_to_be_unchecked():
    with Sender(state_dim=5) as s:
        got = _by_name(run_preflight(_config(s), seconds=0.5))
        named = _by_name(run_preflight(_config(s, robot={"state_dim": 5}), seconds=0.5))
    assert got["state"].status == OK and "not checked against the policy" in got["state"].detail
    assert named["state"].status == OK and "not checked" not in named["state"].detail


def test_an_occasional_stale_reading_is_a_warning_not_a_failure():
    from phyai_edge.control.preflight import _judge_state, _Stream

    s = _Stream()
    for k in range(100):
        s.see(k * 0.005, k * 0.005 + 0.001, (6,))
    for k in range(200):
        s.poll(150.0 if k == 0 else 2.0, 100.0)
    check = _judge_state(_config(None, robot={"state_dim": 6}), s, None, 1.0)
    assert check.status == WARN and "expect STALE holds" in check.detail, check
    assert np.isclose(s.stale_share, 0.005)


def test_free_tcp_endpoints_still_bind():
    ctx = zmq.Context()
    try:
        got = _by_name(_socket_checks(_config(None, publish={"endpoint": free_tcp_endpoint()}), ctx))
        assert got["publish.endpoint"].status == OK
    finally:
        ctx.destroy(linger=0)


def test_mlock_is_judged_by_the_capability_not_by_being_root(tmp_path):
    """Root without CAP_IPC_LOCK (a container's default set, a unit's bounding set) cannot lock past
    RLIMIT_MEMLOCK, and the daemon's mlockall then failed where preflight had said ok."""
    from phyai_edge.control.preflight import CAP_IPC_LOCK, _has_capability

    status = tmp_path / "status"
    status.write_text("Name:\tpython\nCapEff:\t00000000a80425fb\n")  # Docker's default: no bit 14
    assert not _has_capability(CAP_IPC_LOCK, str(status))
    status.write_text("Name:\tpython\nCapEff:\t000001ffffffffff\n")  # all of them
    assert _has_capability(CAP_IPC_LOCK, str(status))
    assert not _has_capability(CAP_IPC_LOCK, str(tmp_path / "missing"))
