"""A server that runs for weeks while robots come and go: what it keeps per robot stays bounded,
and a robot that restarts starts afresh.

- the per-robot stats table forgets robots idle `forget_robot_s`, as requests arrive, not only when
  a report is made (a server with `report_s` 0 kept a row for every robot name it ever saw);
- a connection whose robot hung or lost power without closing it is dropped after missed ZeroMQ
  heartbeats (one was held for good, an open file each, until the file limit refused new robots);
- a robot name longer than `wire.MAX_ROBOT_NAME_CHARS` is refused (a 1 MB name was kept, per
  request, for as long as its row);
- a robot that reconnects under its old name gets nothing from its previous life: no RTC prefix
  (the server keeps none) and no answer to its old connection's request.

Time is injected where the server lets it be (the stats clock); the heartbeat test waits on a real
socket, with an interval of 50 ms and seconds of slack.
"""

from __future__ import annotations

import socket
import struct
import time

import numpy as np
import pytest
import zmq

from phyai_edge.serve import wire
from phyai_edge.serve.client import RemotePolicy
from phyai_edge.serve.scheduler import SchedulerConfig
from phyai_edge.serve.server import LocalExecutor, PolicyServer
from phyai_edge.serve.stats import ServerStats


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _refused_request(robot: str, req_id: int = 1) -> list:
    """An infer request that decodes but is refused before the scheduler (an unknown RTC mode):
    its robot gets a row in the stats, and no model runs."""
    obs = wire.WireObservation({}, np.zeros(14, np.float32), "go")
    rtc = wire.WireRTC("sideways", np.zeros((1, 14), np.float32), 0, 1)
    return wire.encode_request(wire.Request("infer", req_id, robot, 100.0, [obs], rtc))


# -- the per-robot stats table --------------------------------------------------------------
def test_robots_idle_past_forget_s_leave_the_table_as_requests_arrive():
    """2000 robots each send a few requests and leave; with no report ever made the table holds
    only the robots seen within `forget_s`, and a robot that keeps asking is never forgotten."""
    clock = FakeClock()
    st = ServerStats(forget_s=60.0, clock=clock)
    for i in range(2000):
        for _ in range(3):
            st.arrived(f"robot-{i}")
            st.answered(f"robot-{i}", True, 10.0, 1.0, False)
        st.arrived("steady")  # one robot that stays for the whole run
        clock.t += 1.0  # a new robot every second
    # 2000 s of churn: the 61 robots seen in the last 60 s (at most 60 s ago), and the steady one.
    assert len(st.robots) == 62
    assert "steady" in st.robots and "robot-1999" in st.robots and "robot-1938" not in st.robots
    clock.t += 61.0
    st.arrived("late-comer")
    assert list(st.robots) == ["late-comer"]


def test_a_robot_answered_after_it_was_forgotten_is_forgotten_again():
    """A row remade by an answer (its robot forgotten while the request waited) is seen at that
    moment, so it leaves in turn; one made with no time would have been kept for good."""
    clock = FakeClock()
    st = ServerStats(forget_s=10.0, clock=clock)
    st.arrived("a")
    clock.t += 11.0
    st.arrived("b")  # forgets a
    st.answered("a", True, 5.0, 1.0, False)
    assert set(st.robots) == {"a", "b"}
    clock.t += 11.0
    st.arrived("c")
    assert list(st.robots) == ["c"]


def test_a_server_that_never_reports_forgets_the_robots_that_left(tiny_policy):
    """`report_s` 0 and no `stats` request: robots were forgotten only inside `report()`, so this
    server kept a row for every robot name it ever saw."""
    clock = FakeClock()
    srv = PolicyServer(LocalExecutor(tiny_policy), "tcp://127.0.0.1:*", SchedulerConfig(), report_s=0.0,
                       forget_robot_s=30.0)
    srv.stats.clock = clock
    srv.start()
    ctx = zmq.Context.instance()
    try:
        for i in range(50):  # a robot a second, each with a connection of its own, gone after one request
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(srv.endpoint)
            d.send_multipart(_refused_request(f"robot-{i}"))
            assert d.poll(10_000), "no answer"
            assert wire.decode_reply(d.recv_multipart()).error == wire.ERR_BAD_REQUEST
            d.close(0)
            clock.t += 1.0
        assert len(srv.stats.robots) == 31  # the last 30 s, and the robot that just left
    finally:
        srv.stop()


# -- connections of robots that hung or lost power ------------------------------------------
class SilentPeer:
    """A robot computer that hung (or lost power) with its connection open: a TCP peer that
    completes the ZeroMQ handshake as a DEALER and then never sends or reads another byte, so it
    answers no heartbeat. Its kernel keeps the TCP connection up; only the server can end it."""

    def __init__(self, endpoint: str) -> None:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=5.0)
        # ZMTP 3.1 greeting: signature, version 3.1, mechanism NULL, as-server 0, filler.
        greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
        prop_name, prop_value = b"Socket-Type", b"DEALER"
        ready = b"\x05READY" + bytes([len(prop_name)]) + prop_name + struct.pack(">I", len(prop_value)) + prop_value
        self.sock.sendall(greeting + bytes([0x04, len(ready)]) + ready)  # a short command frame

    def closed_by_server_within(self, seconds: float) -> bool:
        """Whether the server ends the connection within `seconds` (what it sends is read and dropped)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                if not self.sock.recv(4096):
                    return True
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True
        return False

    def close(self) -> None:
        self.sock.close()


def _server_connections(port: int) -> int:
    """Established TCP connections the server accepted on `port` (Linux)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(1 for r in rows if int(r[1].rsplit(":", 1)[1], 16) == port and r[3] == "01")


def test_a_connection_whose_robot_hung_is_dropped_after_missed_heartbeats(tiny_policy):
    srv = PolicyServer(LocalExecutor(tiny_policy), "tcp://127.0.0.1:*", SchedulerConfig(), heartbeat_s=0.05).start()
    peers = [SilentPeer(srv.endpoint) for _ in range(3)]
    try:
        # Three missed intervals (150 ms) close it; the rest is slack for a loaded machine.
        assert all(p.closed_by_server_within(10.0) for p in peers), "the server kept a dead robot's connection"
    finally:
        for p in peers:
            p.close()
        srv.stop()


def test_an_idle_robot_keeps_its_connection_through_the_heartbeats(tiny_policy):
    """Its ZeroMQ I/O thread answers every heartbeat by itself, however long the robot sends nothing.
    (0.2 s intervals, dropped after 0.6 s: room for a loaded 2-core CI machine to schedule the
    I/O threads late without the test calling that a dead robot.)"""
    srv = PolicyServer(LocalExecutor(tiny_policy), "tcp://127.0.0.1:*", SchedulerConfig(), heartbeat_s=0.2).start()
    port = int(srv.endpoint.rsplit(":", 1)[1])
    try:
        with RemotePolicy(srv.endpoint, robot="idle", timeout_s=10.0) as remote:
            events = remote._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            time.sleep(2.0)  # 10 heartbeat intervals
            assert not events.poll(0), "an idle, live robot lost its connection"
            if _server_connections_supported():
                assert _server_connections(port) == 1
            assert remote.server_stats()["batches"] == 0
            remote._sock.disable_monitor()
            events.close(0)
    finally:
        srv.stop()


def _server_connections_supported() -> bool:
    try:
        with open("/proc/net/tcp"):
            return True
    except OSError:
        return False


def test_heartbeat_s_is_checked():
    with pytest.raises(ValueError, match="heartbeat_s"):
        PolicyServer(LocalExecutor(None), "tcp://127.0.0.1:*", heartbeat_s=float("nan"))
    with pytest.raises(ValueError, match="forget_s"):
        ServerStats(forget_s=0.0)


# -- malformed requests ---------------------------------------------------------------------
def test_a_robot_name_past_the_limit_is_refused_and_leaves_no_row(tiny_policy):
    longest = "r" * wire.MAX_ROBOT_NAME_CHARS
    assert wire.decode_request(wire.encode_request(wire.Request("hello", 1, longest))).robot == longest
    with pytest.raises(wire.WireError, match=r"robot: a name of 257 characters; at most 256"):
        wire.decode_request(wire.encode_request(wire.Request("hello", 1, longest + "r")))
    srv = PolicyServer(LocalExecutor(tiny_policy), "tcp://127.0.0.1:*", SchedulerConfig()).start()
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(srv.endpoint)
    try:
        for i in range(3):  # each a name of a megabyte: kept, per request, as long as its row
            d.send_multipart(_refused_request(f"{i}" + "x" * (1 << 20), i))
            assert d.poll(10_000)
            rep = wire.decode_reply(d.recv_multipart())
            assert rep.error == wire.ERR_BAD_REQUEST and rep.message.startswith("robot: a name of"), rep.message
        assert srv.stats.robots == {}
    finally:
        d.close(0)
        srv.stop()


# -- a robot that restarts ------------------------------------------------------------------
def test_a_robot_that_restarts_under_its_name_gets_nothing_from_its_previous_life(tiny_policy, make_obs, noise_for):
    """The server keeps no RTC state: the first chunk of a restarted robot (no executing chunk, so
    no prefix) is exactly a fresh robot's, whatever its previous life sent; and the answer to the
    request its previous life had in flight goes to that life's connection, not to the new one."""
    obs = make_obs(tiny_policy.adapter, size=(24, 32), seed=1)
    noise = noise_for(tiny_policy.adapter, 1, seed=2)
    fresh = tiny_policy.infer([obs], noise=noise).actions
    srv = PolicyServer(LocalExecutor(tiny_policy), "tcp://127.0.0.1:*", SchedulerConfig(max_batch=4, window_s=0.0))
    srv.start()
    ctx = zmq.Context.instance()
    wobs = wire.WireObservation(obs.images, obs.state, obs.prompt)
    prefix = np.random.default_rng(3).uniform(-1, 1, (30, 14)).astype(np.float32)
    rtc = wire.WireRTC("guided-approx", prefix, 4, 25)
    try:
        with RemotePolicy(srv.endpoint, robot="arm-3", timeout_s=60.0) as life1:
            life1.infer([obs], rtc=rtc)
            # Dies with a request in flight (a chunk continuing the one it executed).
            life1._sock.send_multipart(wire.encode_request(wire.Request("infer", 77, "arm-3", 500.0, [wobs], rtc)))
            deadline = time.monotonic() + 30
            while srv.stats.robots["arm-3"].requests < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
        life2 = ctx.socket(zmq.DEALER)
        life2.setsockopt(zmq.LINGER, 0)
        life2.connect(srv.endpoint)
        life2.send_multipart(wire.encode_request(wire.Request("hello", 1, "arm-3")))
        assert life2.poll(10_000) and wire.decode_reply(life2.recv_multipart()).req_id == 1
        while srv.stats.robots["arm-3"].served < 2 and time.monotonic() < deadline:  # life 1's last chunk ran
            time.sleep(0.005)
        assert srv.stats.robots["arm-3"].served == 2
        # Its own request ids start again at 1, as a restarted RemotePolicy's do.
        life2.send_multipart(wire.encode_request(wire.Request("infer", 2, "arm-3", 500.0, [wobs], None, noise.numpy())))
        assert life2.poll(60_000)
        rep = wire.decode_reply(life2.recv_multipart())
        assert rep.ok and rep.req_id == 2
        np.testing.assert_array_equal(rep.actions, fresh)
        assert not life2.poll(300), "the restarted robot received an answer meant for its previous life"
        life2.close(0)
    finally:
        srv.stop()


# -- the command line -----------------------------------------------------------------------
def test_serve_passes_its_forget_and_heartbeat_flags_to_the_server(monkeypatch, tiny_policy):
    from phyai_edge.cli import main as cli
    from phyai_edge.commands import common
    from phyai_edge.serve import server

    seen: dict = {}

    class MadeError(Exception):
        pass

    def made(*args, **kwargs):
        seen.update(kwargs)
        raise MadeError

    monkeypatch.setattr(common, "load_policy_or_fail", lambda *a, **k: tiny_policy)
    monkeypatch.setattr(server, "PolicyServer", made)
    with pytest.raises(MadeError):
        cli(["serve", "--forget-robot-s", "120", "--heartbeat-s", "2.5", "--log-level", "warning"])
    assert (seen["forget_robot_s"], seen["heartbeat_s"]) == (120.0, 2.5)
    seen.clear()
    with pytest.raises(MadeError):
        cli(["serve", "--log-level", "warning"])
    assert (seen["forget_robot_s"], seen["heartbeat_s"]) == (600.0, 5.0)


@pytest.mark.parametrize(("flags", "says"), [
    (["--forget-robot-s", "0"], "--forget-robot-s 0: expected a finite number > 0"),
    (["--heartbeat-s", "-1"], "--heartbeat-s -1: expected a finite number of seconds >= 0"),
    (["--heartbeat-s", "inf"], "--heartbeat-s inf: expected a finite number of seconds >= 0"),
])
def test_serve_refuses_bad_forget_and_heartbeat_flags_in_one_line(capsys, flags, says):
    from phyai_edge.cli import main as cli

    with pytest.raises(SystemExit) as exc:
        cli(["serve", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith(f"phyai-edge serve: {says}"), err


def test_a_report_summarises_outside_the_stats_lock(monkeypatch):
    """The inference threads count every answer under the stats lock; a report that sorted every
    robot's latency windows under it (~0.6 ms a robot with full windows) held their replies back."""
    from phyai_edge.serve import stats as stats_mod

    s = ServerStats()
    for k in range(3):
        s.arrived(f"r{k}")
        s.answered(f"r{k}", True, 10.0 + k, 1.0, False)
    held: list[bool] = []
    summary = stats_mod.RobotStats.summary

    def watched(self, now=None):
        held.append(s._lock.locked())
        return summary(self, now)

    monkeypatch.setattr(stats_mod.RobotStats, "summary", watched)
    rep = s.report()
    assert held == [False, False, False]
    assert rep["robots"]["r2"]["latency_ms"] == {"p50": 12.0, "p99": 12.0, "max": 12.0}
    # The report's copies are its own: counting goes on in the live rows.
    s.answered("r0", True, 99.0, 1.0, False)
    assert rep["robots"]["r0"]["served"] == 1 and s.report()["robots"]["r0"]["latency_ms"]["max"] == 99.0
