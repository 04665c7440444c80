"""`phyai-edge listen` as a robot engineer leaves it running: across a daemon restart, with the
chunk topic, printing every action for hours."""

from __future__ import annotations

import gc
import json
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from phyai_edge.cli import main as cli
from phyai_edge.control import listener as listener_module
from phyai_edge.control.daemon import Daemon
from phyai_edge.control.fakes import FakePolicy, free_tcp_endpoint, test_config


@pytest.fixture
def restored_process() -> Iterator[None]:
    """`listen` installs SIGINT / SIGTERM handlers and freezes the collector: put both back."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in handlers.items():
        signal.signal(s, h)
    gc.unfreeze()


def _daemons(endpoint: str, runs: int, seconds: float, gap_s: float = 0.3, dim: int = 6) -> threading.Thread:
    """`runs` daemons one after another on `endpoint` (a restarted service), `seconds` each."""

    def serve() -> None:
        time.sleep(0.5)  # the listener subscribes first
        for _ in range(runs):
            d = Daemon(test_config(publish={"endpoint": endpoint}),
                       policy=FakePolicy(action_dim=dim, state_dim=dim, latency_s=0.01), realtime=False)
            d.setup()
            t = threading.Thread(target=d.run, daemon=True)
            t.start()
            d.wait_started(10)
            time.sleep(seconds)
            d.stop()
            t.join(5)
            time.sleep(gap_s)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_recording_across_a_daemon_restart_tells_the_sessions_apart_and_keeps_the_chunks(tmp_path, restored_process):
    """A restarted daemon's seq starts again at 0; the recording had no session, so the restart
    read as repeated sequence numbers. The chunk messages' rows were dropped (the help promised
    every payload)."""
    endpoint = free_tcp_endpoint()
    served = _daemons(endpoint, runs=2, seconds=1.0)
    record, summary = tmp_path / "actions.npz", tmp_path / "summary.json"
    rc = cli(["listen", "--endpoint", endpoint, "--chunk-topic", "chunk", "--duration", "3.5", "--quiet",
              "--record", str(record), "--json", str(summary)])
    served.join(10)
    assert rc == 0
    assert summary.read_text().endswith("}\n")  # a text file's last line ends
    stats = json.loads(summary.read_text())
    assert stats["sessions"] == 2 and stats["repeats"] == 0 and stats["gaps"] == 0, stats
    rec = np.load(record)
    sessions = list(dict.fromkeys(rec["session"].tolist()))
    assert len(sessions) == 2
    firsts = []
    for session in sessions:
        seq = rec["seq"][(rec["session"] == session) & (rec["kind"] == 1)].astype(np.int64)
        assert (np.diff(seq) == 1).all()
        firsts.append(int(seq[0]))
    # The restarted daemon's first messages went out before the SUB had rejoined: said, not hidden.
    assert stats["restart_missed"] == firsts[1], (stats, firsts)
    kind = rec["kind"]
    assert rec["actions"].shape == ((kind == 1).sum(), 6)
    assert (kind == 2).any() and rec["chunk_rows"].shape == (rec["rows"][kind == 2].sum(), 6)
    # Row 0 of each chunk message is the CHUNK_START action that went out with the same seq.
    first_chunk = int(np.flatnonzero(kind == 2)[0])
    same = np.flatnonzero((kind == 1) & (rec["seq"] == rec["seq"][first_chunk])
                          & (rec["session"] == rec["session"][first_chunk]))[0]
    np.testing.assert_allclose(rec["chunk_rows"][0], rec["actions"][int((kind[:same] == 1).sum())], atol=1e-6)


def test_printing_every_action_keeps_no_backlog_and_labels_chunk_messages(monkeypatch, capsys, restored_process):
    """`--print` kept every message for the whole run (a listener left open for hours grew
    without bound), and printed chunk messages as actions with the CHUNK_START action's seq."""
    made: list[Any] = []

    class Kept(listener_module.Listener):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(listener_module, "Listener", Kept)
    endpoint = free_tcp_endpoint()
    served = _daemons(endpoint, runs=1, seconds=3.0, dim=14)  # ALOHA's 14 values: numpy wrapped them over two lines
    rc = cli(["listen", "--endpoint", endpoint, "--chunk-topic", "chunk", "--print", "--count", "80", "--quiet"])
    served.join(10)
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    assert all(line.startswith(("seq ", "chunk ")) for line in out), [ln for ln in out if not ln.startswith("seq ")][:3]
    actions = [line for line in out if line.startswith("seq ")]
    chunks = [line for line in out if line.startswith("chunk ")]
    assert len(actions) >= 80 and chunks and all(" rows from seq " in line for line in chunks), out[:20]
    seqs = [int(line.split()[1]) for line in actions]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "an action printed twice"
    assert len(made) == 1 and len(made[0].messages) < 20, "printed messages are still held"


def test_a_late_join_misses_nothing_and_a_restart_counts_what_it_sent_before_the_rejoin():
    from phyai_edge.control.listener import Listener
    from phyai_edge.control.protocol import ActionHeader, encode_actions

    lis = Listener(free_tcp_endpoint())
    try:
        for k, (session, seq) in enumerate([(7, 40), (7, 41), (9, 3), (9, 4), (9, 6), (9, 6)]):
            header = ActionHeader(seq, 1, 1, 0, 0, 0, 1, 2, session=session)
            lis.handle(encode_actions(b"action", header, np.zeros((1, 2), np.float32)), 10 + k, 10 + k)
    finally:
        lis.close()
    st = lis.stats.summary()
    assert (st["sessions"], st["restart_missed"], st["gaps"], st["repeats"]) == (2, 3, 1, 1), st


def test_a_silent_stream_exits_1(capsys, restored_process):
    """Nothing published there: the listener exited 0, so a script could not tell a dead stream
    from a healthy one."""
    endpoint = free_tcp_endpoint()
    assert cli(["listen", "--endpoint", endpoint, "--duration", "0.3", "--quiet"]) == 1
    assert f"phyai-edge listen: no message arrived from {endpoint}" in capsys.readouterr().err


def test_duration_0_stops_at_the_daemon_s_shutdown_as_the_help_says(restored_process):
    """`--duration 0` is "no limit", as leaving it out is, which stops at SHUTDOWN: it ran on
    after the daemon had said goodbye, until Ctrl-C."""
    import os

    endpoint = free_tcp_endpoint()
    served = _daemons(endpoint, runs=1, seconds=1.0)
    # Ctrl-C, in case it runs on: the listener's own handler stops it (it must run in the main thread).
    ctrl_c = threading.Timer(10.0, os.kill, (os.getpid(), signal.SIGINT))
    ctrl_c.start()
    t0 = time.monotonic()
    try:
        rc = cli(["listen", "--endpoint", endpoint, "--duration", "0", "--quiet"])
    finally:
        ctrl_c.cancel()
    served.join(10)
    assert rc == 0 and time.monotonic() - t0 < 8.0, "listen --duration 0 ran on after the daemon's SHUTDOWN"


def test_json_to_stdout_is_one_json_object_with_the_per_second_lines_on_stderr(capsys, restored_process):
    """`--json -` without --quiet printed the per-second lines on stdout before the summary: not
    JSON (`... --json - | jq` failed)."""
    endpoint = free_tcp_endpoint()
    served = _daemons(endpoint, runs=1, seconds=2.5)
    rc = cli(["listen", "--endpoint", endpoint, "--duration", "2.5", "--json", "-"])
    served.join(10)
    assert rc == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["received"] > 0
    assert " msg/s " in err


def _feed(lis: Any, messages: list[tuple[int, int, int]]) -> None:
    """(session, seq, receive time in ns) -> what the listener's socket would hand it."""
    from phyai_edge.control.protocol import ActionHeader, encode_actions

    for session, seq, t_ns in messages:
        header = ActionHeader(seq, 1, 1, 0, 0, 0, 1, 2, session=session)
        lis.handle(encode_actions(b"action", header, np.zeros((1, 2), np.float32)), t_ns, t_ns)


def test_the_rate_across_a_daemon_restart_is_the_sessions_own():
    """A daemon restarted after 5 s down: the outage was one 'interval', and a 50 Hz stream read
    as ~3 Hz over a few seconds."""
    from phyai_edge.control.listener import Listener

    ms = 1_000_000
    lis = Listener(free_tcp_endpoint())
    try:
        before = [(7, k, k * 20 * ms) for k in range(100)]
        after = [(9, k, 5000 * ms + 2000 * ms + k * 20 * ms) for k in range(100)]
        _feed(lis, before + after)
    finally:
        lis.close()
    st = lis.stats.summary()
    assert st["sessions"] == 2
    assert st["rate_hz"] == pytest.approx(50.0)
    assert st["interval_ms"]["max"] == pytest.approx(20.0)


def test_a_listener_left_running_keeps_a_window_of_latencies_and_the_run_s_maxima(monkeypatch):
    from phyai_edge.control import listener as listener_mod
    from phyai_edge.control.listener import Listener

    monkeypatch.setattr(listener_mod, "WINDOW", 16)
    lis = Listener(free_tcp_endpoint())
    try:
        # One slow arrival early on, then many on time: the percentiles follow the recent ones,
        # the maxima remember the slow one.
        t0 = 1_000_000_000
        times = [t0, t0 + 500_000_000, *(t0 + 500_000_000 + k * 20_000_000 for k in range(1, 200))]
        _feed(lis, [(1, k, t) for k, t in enumerate(times)])
    finally:
        lis.close()
    st = lis.stats
    assert st.latency_ns.samples().size == 16 and st.interval_ns.samples().size == 16
    s = st.summary()
    assert s["received"] == 201 and s["gaps"] == 0
    assert s["interval_ms"]["p99"] == pytest.approx(20.0) and s["interval_ms"]["max"] == pytest.approx(500.0)
    assert s["rate_hz"] == pytest.approx(50.0)
