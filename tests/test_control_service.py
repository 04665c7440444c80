"""The daemon as a service: a real `phyai-edge run` process with the tiny PI0.5 in a worker process.

SIGTERM publishes HOLD | SHUTDOWN within one period and exits; sd_notify READY / WATCHDOG /
STOPPING arrive on $NOTIFY_SOCKET; logs carry journald priority prefixes under JOURNAL_STREAM.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from phyai_edge.control.config import DEFAULT_CONFIG_TOML
from phyai_edge.control.listener import Listener
from phyai_edge.control.notify import Notifier
from phyai_edge.control.protocol import Flag
from phyai_edge.control.state import SyntheticState

pytest.importorskip("phyai_edge.engines.policy")


def recv_notify(sock: socket.socket, want: str, timeout: float, seen: list[str]) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        sock.settimeout(max(0.01, end - time.monotonic()))
        try:
            msg = sock.recv(4096).decode()
        except TimeoutError:
            break
        seen.extend(msg.split("\n"))
        if want in msg.split("\n"):
            return True
    return want in seen


def test_sigterm_publishes_hold_within_one_period_and_notifies_systemd(tmp_path):
    endpoint = f"ipc://{tmp_path}/actions"
    cfg = tmp_path / "robot.toml"
    cfg.write_text(DEFAULT_CONFIG_TOML.replace('endpoint = "tcp://127.0.0.1:5555"', f'endpoint = "{endpoint}"'))
    notify_path = str(tmp_path / "notify.sock")
    nsock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    nsock.bind(notify_path)
    # systemd names the stdout it connected to the journal in JOURNAL_STREAM: this pipe here.
    out_r, out_w = os.pipe()
    st = os.fstat(out_w)
    env = {**os.environ, "NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "200000",
           "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    env.pop("WATCHDOG_PID", None)
    lis = Listener(endpoint, "action", keep=True)
    proc = subprocess.Popen([sys.executable, "-m", "phyai_edge", "run", "--config", str(cfg)], env=env,
                            stdout=out_w, stderr=subprocess.STDOUT, text=True)
    os.close(out_w)
    proc_stdout = os.fdopen(out_r)
    seen: list[str] = []
    try:
        assert recv_notify(nsock, "READY=1", 120, seen), f"no READY=1; got {seen}"
        end = time.monotonic() + 60
        while time.monotonic() < end and sum(1 for h, _ in lis.messages if not h.flags & Flag.HOLD) < 20:
            lis.poll(0.05)
        assert recv_notify(nsock, "WATCHDOG=1", 2, seen), f"no WATCHDOG=1 while ticks are on time; got {seen}"
        t_term = time.monotonic_ns()
        proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + 5
        while time.monotonic() < end and not any(h.flags & Flag.SHUTDOWN for h, _ in lis.messages):
            lis.poll(0.05)
        rc = proc.wait(10)
        t_exit = time.monotonic_ns()
        stopping = recv_notify(nsock, "STOPPING=1", 1.0, seen)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc_stdout.read()
        proc_stdout.close()
        lis.close()
        nsock.close()
    assert rc == 0, out
    final = [h for h, _ in lis.messages if h.flags & Flag.SHUTDOWN]
    assert len(final) == 1 and final[0].flags & Flag.HOLD
    assert final[0].seq == lis.messages[-1][0].seq  # nothing after it
    period_ms = 20.0
    term_to_hold_ms = (final[0].publish_mono_ns - t_term) / 1e6
    exit_ms = (t_exit - t_term) / 1e6
    print(f"SIGTERM -> HOLD {term_to_hold_ms:.1f} ms, -> exit {exit_ms:.1f} ms")
    # The clock's select() wakes on the signal, so HOLD goes out at once, not at the next tick.
    assert term_to_hold_ms <= period_ms, f"HOLD {term_to_hold_ms:.1f} ms after SIGTERM"
    # Exit measured by this (unprivileged, loaded) test process's wait(): allow it one more period.
    assert exit_ms <= 2 * period_ms, f"exit took {exit_ms:.1f} ms"
    seqs = [h.seq for h, _ in lis.messages if h.kind == 1]
    assert seqs == list(range(seqs[0], seqs[-1] + 1))
    assert stopping, seen
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert lines and all(ln.startswith("<") and ln[1] in "234567" and ln[2] == ">" for ln in lines), out[:2000]
    assert any("READY" in s or s.startswith("STATUS=") for s in seen)


def test_daemon_import_path_stays_light():
    """The clock process (process worker) must not import torch, OpenCV or prometheus."""
    code = (
        "import sys; import phyai_edge.control.daemon, phyai_edge.commands.run, phyai_edge.control.listener; "
        "bad = [m for m in ('torch', 'cv2', 'prometheus_client', 'transformers') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"imported on the robot-side path: {out}"


class StallingState(SyntheticState):
    """State whose read holds the clock thread: once (`stall_once`), or on every tick (`stall_every`)."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.stall_once = 0.0
        self.stall_every = 0.0

    def latest(self):
        stall, self.stall_once = self.stall_once, 0.0
        time.sleep(stall or self.stall_every)
        return super().latest()


def test_one_late_tick_does_not_cost_the_watchdog_but_a_loop_that_keeps_overrunning_does():
    """systemd kills the service when two WATCHDOG=1 are WATCHDOG_USEC apart. One missed deadline
    (a stall of a few periods) must not get there; a clock that keeps missing them must."""
    from test_control_daemon import Running

    from phyai_edge.control.daemon import Daemon
    from phyai_edge.control.fakes import FakePolicy, test_config

    name = f"@phyai-edge-wd-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name[1:])
    sock.settimeout(0.1)
    timeout_s = 1.0
    pings: list[float] = []
    done = threading.Event()

    def receive() -> None:
        while not done.is_set():
            try:
                msg = sock.recv(65536).decode()
            except TimeoutError:
                continue
            if "WATCHDOG=1" in msg.split("\n"):
                pings.append(time.monotonic())

    rx = threading.Thread(target=receive, daemon=True)
    rx.start()
    state = StallingState(6)
    notifier = Notifier({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": str(round(timeout_s * 1e6))})
    run = Running(Daemon(test_config(), policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), state=state,
                         realtime=False, notifier=notifier))
    try:
        d = run.daemon
        run.wait_for(lambda: len(pings) >= 3, 10, "watchdog pings")
        state.stall_once = 0.07  # 3.5 periods at 50 Hz: one tick wakes late, 2 or 3 slots are skipped
        run.wait_for(lambda: d.stats.missed_slots >= 2, 5, "the missed slots")
        t_stall = time.monotonic()
        time.sleep(3 * timeout_s)
        single = [b - a for a, b in itertools.pairwise(pings) if b > t_stall - timeout_s]
        state.stall_every = 0.03  # every tick now overruns its period
        t_overrun = time.monotonic()
        time.sleep(3 * timeout_s)
        overrun = [p for p in pings if p > t_overrun + 0.5 * timeout_s]
    finally:
        state.stall_every = 0.0
        run.stop()
        done.set()
        rx.join(2)
        sock.close()
    assert d.stats.missed_slots >= 2
    assert single and max(single) < timeout_s, f"ping gaps around one late tick: {single}"
    assert not overrun, f"pinged while every tick overran: {[round(p - t_overrun, 2) for p in overrun]}"


def test_start_up_extends_systemds_start_timeout_to_the_load_timeouts(tmp_path, monkeypatch):
    """A full-size load plus warm-up (Triton compiles, graph capture) may take minutes past the
    unit's TimeoutStartSec=; before the load starts the daemon sends EXTEND_TIMEOUT_USEC covering
    what its own `model.load_timeout_s` allows (the load and each warm-up inference)."""
    import argparse
    import logging

    from phyai_edge.commands import run as run_cmd
    from phyai_edge.control import daemon as daemon_mod

    name = f"@phyai-edge-start-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name[1:])
    sock.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", name)
    cfg = tmp_path / "robot.toml"
    assert 'mode = "guided-approx"' in DEFAULT_CONFIG_TOML  # a solver mode: two warm-up inferences per round
    assert "load_timeout_s = 600.0 " in DEFAULT_CONFIG_TOML and "warmup = 1 " in DEFAULT_CONFIG_TOML
    cfg.write_text(DEFAULT_CONFIG_TOML.replace("load_timeout_s = 600.0 ", "load_timeout_s = 400.0 ", 1)
                   .replace("warmup = 1 ", "warmup = 2 ", 1))
    seen_at_setup: list[str] = []

    class FakeDaemon:
        def __init__(self, cfg, **kwargs):
            self.cfg = cfg

        def install_signal_handlers(self):
            pass

        def setup(self):
            with contextlib.suppress(BlockingIOError):
                while True:
                    seen_at_setup.extend(sock.recv(65536).decode().split("\n"))
            raise daemon_mod.StartupInterruptedError("stopped during start-up")

        def shutdown(self):
            pass

    monkeypatch.setattr(daemon_mod, "Daemon", FakeDaemon)
    root = logging.getLogger("phyai_edge")
    handlers, level, propagate = list(root.handlers), root.level, root.propagate
    args = argparse.Namespace(print_default_config=False, check_config=None, preflight=None, log_level="warning",
                              config=str(cfg), record=None, record_min_free_gb=2.0, no_realtime=True, duration=None,
                                  summary=None)
    try:
        assert run_cmd.main(args) == 0
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        root.propagate = propagate
        sock.close()
    extend = [f for f in seen_at_setup if f.startswith("EXTEND_TIMEOUT_USEC=")]
    assert extend, seen_at_setup
    # The load and 2 warm-up rounds of 2 inferences, each allowed 400 s.
    assert int(extend[0].split("=", 1)[1]) >= 400e6 * (1 + 2 * 2)
    assert any(f.startswith("STATUS=starting") for f in seen_at_setup), seen_at_setup


def journal_pipe(env_value: str | None = None) -> tuple[int, int, str]:
    """A pipe standing in for systemd's journal stream, and the JOURNAL_STREAM naming it."""
    r, w = os.pipe()
    st = os.fstat(w)
    return r, w, env_value if env_value is not None else f"{st.st_dev}:{st.st_ino}"


def run_logging(code: str, journal_stream: str | None) -> tuple[str, str]:
    """`code` after setup_logging() in a fresh interpreter whose stdout is a pipe; (stdout, stderr)."""
    r, w, value = journal_pipe(journal_stream)
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    env["JOURNAL_STREAM"] = value
    prog = ("import logging, threading; from phyai_edge.control.log import setup_logging; setup_logging(); "
            "log = logging.getLogger('phyai_edge.control'); " + code)
    proc = subprocess.Popen([sys.executable, "-c", prog], env=env, stdout=w, stderr=subprocess.PIPE, text=True)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    err = proc.stderr.read()
    proc.wait(30)
    proc.stderr.close()
    return out, err


def test_priority_prefixes_only_when_stdout_is_the_journal_stream():
    """JOURNAL_STREAM is inherited by everything a service starts (a shell, tmux, a script that
    redirects to a file); only a stdout whose device:inode it names is the journal."""
    out, _ = run_logging("log.warning('hold: stale state')", None)
    assert out == "<4>hold: stale state\n", out
    out, _ = run_logging("log.warning('hold: stale state')", "8:1234")
    assert not out.startswith("<") and "WARNING hold: stale state" in out and out[:4].isdigit(), out


def test_uncaught_tracebacks_under_journald_are_one_entry_with_a_priority():
    """Python prints an uncaught traceback on stderr, one journal entry per line at priority info
    (`journalctl -p warning` shows none of it); under journald each is one line with <2> / <3>."""
    code = ("t = threading.Thread(target=lambda: 1 / 0, name='camera-top'); t.start(); t.join(); "
            "raise RuntimeError('the clock loop broke')")
    out, err = run_logging(code, None)
    lines = out.splitlines()
    assert err == "", err
    assert len(lines) == 2, out
    assert lines[0].startswith("<3>thread camera-top died: uncaught ZeroDivisionError") and "Traceback" in lines[0]
    assert lines[1].startswith("<2>uncaught RuntimeError: the clock loop broke") and "Traceback" in lines[1]


def test_a_multi_line_status_stays_one_status_field():
    """A worker's load error (torch's CUDA errors span several lines) ends up in STATUS=: its lines
    must not become fields of their own (systemd would show only the first, the rest dropped)."""
    name = f"@phyai-edge-status-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name[1:])
    sock.settimeout(2)
    n = Notifier({"NOTIFY_SOCKET": name})
    text = "HOLDING, WORKER DOWN: RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be reported later\n"
    try:
        assert n.status(text + "| seq 12")
        got = sock.recv(65536).decode()
        assert n.ready("up\nREADY=0")
        got_ready = sock.recv(65536).decode()
    finally:
        n.close()
        sock.close()
    assert got == "STATUS=HOLDING, WORKER DOWN: RuntimeError: CUDA error: out of memory | CUDA kernel errors might be " \
                  "reported later | | seq 12", got
    assert got_ready == "READY=1\nSTATUS=up | READY=0", got_ready


def test_summary_on_stdout_is_json_alone(tmp_path):
    """`run --summary -` writes the summary's JSON on stdout, where the log lines also went (the
    daemon's and its worker process's): piped to jq it did not parse. The log now goes to stderr."""
    import json

    cfg = tmp_path / "robot.toml"
    cfg.write_text(DEFAULT_CONFIG_TOML.replace('endpoint = "tcp://127.0.0.1:5555"', f'endpoint = "ipc://{tmp_path}/a"'))
    env = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "NOTIFY_SOCKET")}
    res = subprocess.run([sys.executable, "-m", "phyai_edge", "run", "--config", str(cfg), "--duration", "1",
                          "--no-realtime", "--summary", "-"], env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(res.stdout)
    assert summary["ticks"] > 0
    assert "stopped:" in res.stderr


def test_the_worker_process_logs_where_the_daemon_does(restored_logging):
    """A process worker repeats the daemon's logging set-up, stream included (with `--summary -`
    its lines would otherwise land in the JSON on stdout)."""
    import logging

    from phyai_edge.control import log as log_mod
    from phyai_edge.control import worker

    handler = log_mod.setup_logging(logging.INFO, to_stderr=True)
    assert handler.stream is sys.stderr and log_mod.configured_to_stderr()
    seen: list[tuple] = []

    class Ctx:
        def Pipe(self, duplex):  # noqa: N802  (multiprocessing's names)
            return None, None

        def Process(self, target, args, **kwargs):  # noqa: N802
            seen.append(args)
            raise RuntimeError("not started in this test")

    w = worker.ProcessWorker.__new__(worker.ProcessWorker)
    w._ctx, w._spec = Ctx(), None
    with pytest.raises(RuntimeError, match="not started"):
        w._spawn()
    assert seen and seen[0][2:] == (logging.INFO, True)
