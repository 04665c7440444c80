"""The subscriber examples, built from docs/protocol.md, against a running daemon."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from phyai_edge.control.daemon import Daemon
from phyai_edge.control.fakes import FakePolicy, test_config

ROOT = Path(__file__).resolve().parents[1]


def zmq_headers_present() -> bool:
    return any(Path(p, "zmq.h").exists() for p in ("/usr/include", "/usr/local/include"))


def start_daemon(n_ticks: int) -> tuple[Daemon, threading.Thread]:
    d = Daemon(test_config(), policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), realtime=False)
    d.setup()
    return d, threading.Thread(target=d.run, kwargs={"max_ticks": n_ticks}, daemon=True)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on this machine")
@pytest.mark.skipif(not zmq_headers_present(), reason="libzmq headers absent (apt-get install libzmq3-dev)")
def test_c_subscriber_compiles_and_sees_every_message(tmp_path):
    exe = tmp_path / "subscriber_c"
    subprocess.run(["cc", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(exe), str(ROOT / "examples/subscriber_c.c"), "-lzmq"],
                   check=True, capture_output=True, text=True)
    d, t = start_daemon(10_000)
    sub = subprocess.Popen([str(exe), d.publisher.endpoint, "60"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)  # let the SUB connect before the first tick
    t.start()
    try:
        out, _ = sub.communicate(timeout=30)
    finally:
        d.stop()
        t.join(5)
    assert sub.returncode == 0, out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("summary: received 60 gaps 0"), summary
    seqs = [int(line.split()[1]) for line in out.splitlines() if line.startswith("seq ")]
    assert seqs == list(range(seqs[0], seqs[0] + 60))


def test_pyzmq_subscriber_example_runs():
    d, t = start_daemon(10_000)
    sub = subprocess.Popen([sys.executable, str(ROOT / "examples/subscriber_pyzmq.py"), d.publisher.endpoint, "40"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(0.5)
    t.start()
    try:
        out, _ = sub.communicate(timeout=30)
    finally:
        d.stop()
        t.join(5)
    assert sub.returncode == 0, out
    lines = [ln for ln in out.splitlines() if ln.startswith("seq")]
    assert len(lines) == 40 and "lost" not in out


def test_the_task_client_example_sets_and_shows_the_instruction():
    """examples/task_client_pyzmq.py, written from protocol.md section 4, against the daemon's channel."""
    from phyai_edge.control.config import TaskConfig
    from phyai_edge.control.fakes import free_tcp_endpoint
    from phyai_edge.control.task import TaskChannel
    from phyai_edge.control.worker import PromptFit

    endpoint = free_tcp_endpoint()
    ch = TaskChannel(TaskConfig(endpoint=endpoint), "pick up the cube", lambda prompt: PromptFit(41, 64))
    ch.start()
    try:
        def example(*argv: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, str(ROOT / "examples/task_client_pyzmq.py"), endpoint, *argv],
                                  capture_output=True, text=True, timeout=60)

        taken = example("fold the towel")
        assert taken.returncode == 0 and "running: 'fold the towel' (1 change(s); 41 of 64 tokens)" in taken.stdout
        shown = example()
        assert shown.returncode == 0 and "running: 'fold the towel' (1 change(s))" in shown.stdout  # a query counts nothing
        held = example("--hold")
        assert held.returncode == 0 and ", held)" in held.stdout and ch.holding
        resumed = example("wipe the table", "--release")
        assert resumed.returncode == 0 and "running: 'wipe the table' (2 change(s)" in resumed.stdout
        assert not ch.holding
        refused = example("two\nlines")
        assert refused.returncode == 1 and "refused: the instruction holds control characters" in refused.stderr
    finally:
        ch.close()
