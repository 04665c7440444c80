"""The inference worker process dies (SIGKILL here; OOM kills and driver segfaults look the same).

The clock keeps publishing; the executing chunk runs to its end, then HOLD | WORKER_DOWN; the
worker is restarted with backoff; once a new one is up and warmed, policy actions resume. A
subscriber sees every sequence number exactly once throughout; sd_notify STATUS and the
Prometheus counters say what happened. Assertions are on events with generous timeouts, so a
loaded 2-core machine only makes the tests slower, not flaky.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import time
import urllib.request
import uuid

import pytest
from test_control_daemon import Running

from phyai_edge.control.daemon import Daemon
from phyai_edge.control.fakes import test_config
from phyai_edge.control.notify import Notifier
from phyai_edge.control.protocol import Flag


class Captured(logging.Handler):
    """The daemon's log lines (phyai_edge loggers may not propagate to pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def daemon_log():
    h = Captured()
    lg = logging.getLogger("phyai_edge.control")
    old = lg.level
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    yield h
    lg.removeHandler(h)
    lg.setLevel(old)


def notify_socket() -> tuple[socket.socket, Notifier]:
    name = f"@phyai-edge-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name[1:])
    s.setblocking(False)
    return s, Notifier({"NOTIFY_SOCKET": name})


def drain_status(sock: socket.socket, into: list[str]) -> None:
    while True:
        try:
            msg = sock.recv(65536).decode()
        except BlockingIOError:
            return
        into.extend(line[len("STATUS="):] for line in msg.split("\n") if line.startswith("STATUS="))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def policy_actions(run: Running, after: int = 0) -> list:
    return [h for h, _ in run.actions()[after:] if not h.flags & Flag.HOLD]


def test_sigkilled_worker_runs_out_the_chunk_holds_restarts_and_resumes(daemon_log):
    """Tiny PI0.5 in a process worker; SIGKILL its PID mid-run."""
    pytest.importorskip("phyai_edge.engines.policy")
    port = free_port()
    # Backoff 1.5 s > one chunk (H = 50 slots at 50 Hz = 1 s): the chunk surely runs out before a
    # new worker can be up, so the HOLD is certain, not a race.
    cfg = test_config(
        cameras={"top": {"source": "synthetic", "width": 64, "height": 64}},
        model={"worker": "process", "preset": "tiny", "threads": 1, "warmup": 1, "load_timeout_s": 120,
               "restart_backoff_s": 1.5},
        chunking={"mode": "inpaint", "execution_horizon": 10},
        metrics={"port": port},
    )
    nsock, notifier = notify_socket()
    run = Running(Daemon(cfg, realtime=False, notifier=notifier))
    statuses: list[str] = []
    try:
        d = run.daemon
        H = d.queue.horizon
        run.wait_for(lambda: d.stats.adopted >= 3 and len(policy_actions(run)) >= 30, 60, "3 chunks from the first worker")
        old_pid = d.worker.pid
        assert old_pid and old_pid != os.getpid()
        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.time()
        n_kill = len(run.actions())

        run.wait_for(lambda: any(h.flags & Flag.HOLD and h.flags & Flag.WORKER_DOWN for h, _ in run.actions()[n_kill:]),
                     20, "HOLD | WORKER_DOWN after the chunk ran out")
        drain_status(nsock, statuses)
        run.wait_for(lambda: d.worker.up and len(policy_actions(run, n_kill)) > 0 and any(
            h.flags & Flag.CHUNK_START and not h.flags & Flag.WORKER_DOWN for h in policy_actions(run, n_kill)
            if h.chunk_id > 0), 60, "policy actions from the restarted worker")
        # Run on a little to see the restarted worker keep going (more than one new chunk).
        n_resume = len(run.actions())
        run.wait_for(lambda: len(policy_actions(run, n_resume)) >= 2 * cfg.chunking.execution_horizon, 20,
                     "steady policy actions after the restart")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        time.sleep(0.1)
        drain_status(nsock, statuses)
        run.stop()
    finally:
        nsock.close()
        if run.thread.is_alive():
            run.daemon.stop()

    acts = run.actions()
    # 1. Every sequence number exactly once, from 0, across the death and the restart.
    seqs = [h.seq for h, _ in acts]
    assert seqs == list(range(len(seqs))), "gap or repeat in sequence numbers"
    assert run.listener.stats.gaps == 0 and run.listener.stats.repeats == 0 and run.listener.stats.nonfinite == 0

    # 2. The chunk executing at the kill ran to its last index before the first worker HOLD.
    i_hold = next(i for i in range(n_kill, len(acts))
                  if acts[i][0].flags & Flag.HOLD and acts[i][0].flags & Flag.WORKER_DOWN)
    last = acts[i_hold - 1][0]
    assert not last.flags & Flag.HOLD and last.index == H - 1, f"chunk did not run to its end: {last}"
    assert all(not h.flags & Flag.HOLD and h.chunk_id == last.chunk_id for h, _ in acts[n_kill:i_hold]
               if h.flags & Flag.WORKER_DOWN), "actions while down come from the executing chunk only"

    # 3. HOLD | STARVED | WORKER_DOWN until the new worker is up, then HOLD | STARVED while its
    # first inference runs (a few slots), then its chunk; no WORKER_DOWN after it is up.
    i_back = next(i for i in range(i_hold, len(acts)) if not acts[i][0].flags & Flag.HOLD)
    holds = [h.flags for h, _ in acts[i_hold:i_back]]
    assert all(f & Flag.HOLD and f & Flag.STARVED for f in holds)
    n_down = sum(1 for f in holds if f & Flag.WORKER_DOWN)
    assert n_down >= 5 and all(f & Flag.WORKER_DOWN for f in holds[:n_down]), "WORKER_DOWN is one run"
    first_new = acts[i_back][0]
    assert first_new.flags & Flag.CHUNK_START and first_new.chunk_id > last.chunk_id
    assert not any(h.flags & Flag.WORKER_DOWN for h, _ in acts[i_back:])

    # 4. Counted, logged, restarted once, a different process.
    st = d.stats
    assert st.worker_deaths == 1 and st.worker_restarts == 1, d.summary()
    assert st.holds.get("worker_down", 0) == n_down
    assert d.worker.pid not in (None, old_pid)
    assert d.summary()["worker"] == {"deaths": 1, "restarts": 1, "restart_failures": 0}
    lines = daemon_log.lines
    assert sum(f"process {old_pid} died (killed by SIGKILL" in ln for ln in lines) >= 1, lines
    assert sum(ln.startswith("HOLD: the executing chunk ran out") for ln in lines) == 1, "HOLD logged once"
    assert any("restart attempt 1 in 1.5 s" in ln for ln in lines)
    assert any("inference worker: restarted" in ln for ln in lines)

    # 5. systemd STATUS said so while down, and stopped saying so once back.
    down = [i for i, s in enumerate(statuses) if "WORKER DOWN" in s]
    assert down, statuses
    assert any("killed by SIGKILL" in statuses[i] for i in down)
    assert any("WORKER DOWN" not in s and "worker restarts 1" in s for s in statuses[down[-1] + 1:]), statuses

    # 6. Prometheus.
    assert 'phyai_worker_restarts_total{result="ok"} 1.0' in metrics, metrics
    assert "phyai_worker_deaths_total 1.0" in metrics
    assert "phyai_worker_up 1.0" in metrics
    assert 'phyai_hold_ticks_total{reason="worker_down"}' in metrics
    # The worker's process series follow the restarted process, not the killed one.
    rss = re.search(r"^phyai_worker_process_resident_memory_bytes (\S+)", metrics, re.M)
    started = re.search(r"^phyai_worker_process_start_time_seconds (\S+)", metrics, re.M)
    assert rss and float(rss[1]) > 0 and started, metrics
    assert float(started[1]) > killed_at - 0.05


def test_restarts_that_keep_failing_keep_holding_then_recover(tmp_path, daemon_log):
    """While the policy cannot load, attempts back off and the daemon holds; never a policy action."""
    blocker = tmp_path / "refuse-loading"
    cfg = test_config(
        model={"worker": "process", "warmup": 1, "factory": "phyai_edge.control.fakes:make_fake_policy",
               "factory_args": {"latency_s": 0.01, "refuse_if_exists": str(blocker)},
               "restart_backoff_s": 0.2, "restart_backoff_max_s": 0.8},
        chunking={"mode": "none", "execution_horizon": 10},
    )
    run = Running(Daemon(cfg, realtime=False))
    try:
        d = run.daemon
        run.wait_for(lambda: d.stats.adopted >= 2, 20, "chunks from the first worker")
        blocker.touch()  # from now on, a new worker process fails to load the policy
        old_pid = d.worker.pid
        os.kill(old_pid, signal.SIGKILL)
        run.wait_for(lambda: d.worker.restart_failures >= 4, 30, "four failed restart attempts")
        n_fail = len(run.actions())
        assert not d.worker.up and "restart attempt" in (d.worker.down_reason or "")
        assert "fake load failure" in d.worker.down_reason
        assert "WORKER DOWN" in d.render_status() and "fake load failure" in d.render_status()
        run.wait_for(lambda: len(run.actions()) >= n_fail + 10, 10, "ticks while failing")
        blocker.unlink()
        run.wait_for(lambda: any(not h.flags & Flag.HOLD for h, _ in run.actions()[n_fail:]), 30, "recovery")
        run.stop()
    finally:
        if run.thread.is_alive():
            run.daemon.stop()
    acts = run.actions()
    seqs = [h.seq for h, _ in acts]
    assert seqs == list(range(len(seqs))) and run.listener.stats.gaps == 0
    i_hold = next(i for i, (h, _) in enumerate(acts) if h.flags & Flag.HOLD and h.flags & Flag.WORKER_DOWN)
    i_back = next(i for i in range(i_hold, len(acts)) if not acts[i][0].flags & Flag.HOLD)
    holds = [h.flags for h, _ in acts[i_hold:i_back]]
    n_down = sum(1 for f in holds if f & Flag.WORKER_DOWN)
    assert all(f & Flag.HOLD for f in holds) and all(f & Flag.WORKER_DOWN for f in holds[:n_down])
    assert i_hold + n_down > n_fail + 10, "held with WORKER_DOWN through the failed attempts"
    assert d.stats.worker_restarts == 1 and d.stats.worker_restart_failures >= 4
    # Each attempt logged; the waits grew and stayed bounded by restart_backoff_max_s.
    waits = [float(m.group(1)) for ln in daemon_log.lines if (m := re.fullmatch(r".*restart attempt \d+ in ([\d.]+) s", ln))]
    assert waits[:4] == [0.2, 0.4, 0.8, 0.8] and max(waits) == 0.8, waits
    assert sum(re.search(r"restart attempt \d+ failed: .*fake load failure", ln) is not None for ln in daemon_log.lines) >= 4


def test_a_hung_worker_is_killed_after_the_inference_timeout_and_restarted(tmp_path, daemon_log):
    """A worker that neither answers nor dies would hold the robot for good; after
    `model.inference_timeout_s` it is killed and restarted like a dead one."""
    hang = tmp_path / "hang"
    cfg = test_config(
        model={"worker": "process", "warmup": 1, "factory": "phyai_edge.control.fakes:make_fake_policy",
               "factory_args": {"latency_s": 0.01, "hang_if_exists": str(hang)},
               "restart_backoff_s": 0.2, "inference_timeout_s": 1.0},
        chunking={"mode": "none", "execution_horizon": 10},
    )
    run = Running(Daemon(cfg, realtime=False))
    try:
        d = run.daemon
        run.wait_for(lambda: d.stats.adopted >= 2, 20, "chunks from the first worker")
        old_pid = d.worker.pid
        hang.touch()  # the next inference never returns; the process stays alive
        run.wait_for(lambda: d.worker.deaths >= 1, 20, "the hung worker noticed")
        assert "hung (no result within 1 s); killed" in (d.worker.down_reason or ""), d.worker.down_reason
        hang.unlink()
        _runs_again_on_a_new_worker(run)
    finally:
        if run.thread.is_alive():
            run.daemon.stop()
    _replaced_without_a_gap(run, old_pid, daemon_log)


def _runs_again_on_a_new_worker(run: Running) -> None:
    """After a hung worker was killed: a new one comes up and policy actions resume; then stop."""
    d = run.daemon
    run.wait_for(lambda: d.worker.up and d.worker.restarts >= 1, 30, "a new worker")
    n = len(run.actions())
    run.wait_for(lambda: any(not h.flags & Flag.HOLD for h, _ in run.actions()[n:]), 20, "policy actions again")
    run.stop()


def _replaced_without_a_gap(run: Running, old_pid: int, daemon_log: Captured) -> None:
    seqs = [h.seq for h, _ in run.actions()]
    assert seqs == list(range(len(seqs))) and run.listener.stats.gaps == 0
    assert run.daemon.worker.pid != old_pid
    assert any(f"process {old_pid} hung" in ln for ln in daemon_log.lines), daemon_log.lines


def test_a_frozen_worker_is_killed_even_when_the_job_cannot_be_sent(daemon_log):
    """A worker process frozen between jobs (SIGSTOP, a cgroup freezer) stops reading its pipe: a
    job bigger than the pipe's buffer (a 512x512 frame is 786 kB) then blocks in the send, before
    any wait for a result. The inference timeout must still kill and restart it."""
    cfg = test_config(
        cameras={"top": {"source": "synthetic", "width": 512, "height": 512}},
        model={"worker": "process", "warmup": 1, "factory": "phyai_edge.control.fakes:make_fake_policy",
               "factory_args": {"latency_s": 0.01}, "restart_backoff_s": 0.2, "inference_timeout_s": 1.0},
        chunking={"mode": "none", "execution_horizon": 20},
    )
    run = Running(Daemon(cfg, realtime=False))
    d = run.daemon
    old_pid = d.worker.pid
    try:
        run.wait_for(lambda: d.stats.adopted >= 2, 20, "chunks from the first worker")
        # Freeze it while it waits for its next job (a result was just collected; the next job is
        # due only after a dozen more actions), so the next job meets a process that reads nothing.
        run.wait_for(lambda: not d.worker.busy and d.queue.current is not None and d.queue.current.index < 8, 20,
                     "an idle worker")
        os.kill(old_pid, signal.SIGSTOP)
        run.wait_for(lambda: d.worker.deaths >= 1, 20, "the frozen worker noticed")
        assert "hung" in (d.worker.down_reason or ""), d.worker.down_reason
        _runs_again_on_a_new_worker(run)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(old_pid, signal.SIGKILL)
        if run.thread.is_alive():
            run.daemon.stop()
    _replaced_without_a_gap(run, old_pid, daemon_log)


@pytest.mark.parametrize("phase", ["loading", "warm-up"])
def test_a_stop_during_start_up_ends_it_at_once(tmp_path, phase):
    """systemd's stop (SIGTERM) can come while the policy loads or warms up, minutes at full size
    (checkpoint, compilation, graph capture). `stop` then closes the worker and `setup` raises at
    once, instead of the service waiting out the load and running the clock only to stop it."""
    import threading

    from phyai_edge.control.daemon import StartupInterruptedError

    hang = tmp_path / "hang"
    if phase == "warm-up":
        hang.touch()  # the warm-up inference never returns
    cfg = test_config(
        model={"worker": "process", "warmup": 1, "factory": "phyai_edge.control.fakes:make_fake_policy",
               "factory_args": {"latency_s": 0.01, "hang_if_exists": str(hang),
                                "load_s": 60.0 if phase == "loading" else 0.0}},
    )
    d = Daemon(cfg, realtime=False)
    outcome: list[BaseException | None] = []

    def setup() -> None:
        try:
            d.setup()
            outcome.append(None)
        except BaseException as exc:  # the test reads what setup raised
            outcome.append(exc)

    t = threading.Thread(target=setup, daemon=True)
    t.start()
    # Loading: the process is started (a pid) and sleeping in the factory. Warm-up: the policy
    # loaded (info set) and the first warm-up inference hangs.
    ready = (lambda: d.worker is not None and d.worker.pid is not None) if phase == "loading" else (
        lambda: d.info is not None)
    end = time.monotonic() + 30
    while not ready() and time.monotonic() < end:
        time.sleep(0.05)
    assert ready(), f"never reached {phase}"
    time.sleep(0.3)
    t0 = time.monotonic()
    d.stop()
    t.join(10)
    took = time.monotonic() - t0
    d.shutdown()
    assert not t.is_alive(), f"setup still running {took:.1f} s after stop() during {phase}"
    assert len(outcome) == 1 and isinstance(outcome[0], StartupInterruptedError), outcome
    assert took < 5, took


def test_the_worker_process_logs_as_the_daemon_does(capfd):
    """A spawned worker starts with no logging: the engine's INFO lines (bundle load, graph
    captures) were dropped. It now repeats the daemon's setup, so they reach the same stream."""
    from phyai_edge.control import log as daemon_log_mod
    from phyai_edge.control.worker import PolicySpec, ProcessWorker

    root = logging.getLogger("phyai_edge")
    saved = (list(root.handlers), root.level, root.propagate, list(daemon_log_mod._CONFIGURED))
    daemon_log_mod.setup_logging(logging.INFO)
    try:
        w = ProcessWorker(PolicySpec("phyai_edge.control.fakes:make_fake_policy",
                                     {"announce": "captured the loop (from the worker)"}))
        w.start(60)
        w.close()
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
        root.propagate = saved[2]
        daemon_log_mod._CONFIGURED[:] = saved[3]
    assert "captured the loop (from the worker)" in capfd.readouterr().out

