"""The subscriber examples as a controller copies them: a daemon that goes silent without its
SHUTDOWN message (killed, out of memory, a cable pulled) must read as HOLD (protocol.md, section 1)."""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from phyai_edge.control.fakes import free_tcp_endpoint
from phyai_edge.control.protocol import ActionHeader, Flag, encode_actions

ROOT = Path(__file__).resolve().parents[1]
SILENT_LINE = "no message for 100 ms: HOLD"


def _c_example(tmp_path: Path) -> list[str]:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) on this machine")
    if not any(Path(p, "zmq.h").exists() for p in ("/usr/include", "/usr/local/include")):
        pytest.skip("libzmq headers absent (apt-get install libzmq3-dev)")
    exe = tmp_path / "subscriber_c"
    subprocess.run(["cc", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(exe), str(ROOT / "examples/subscriber_c.c"),
                    "-lzmq"], check=True, capture_output=True, text=True)
    line_buffered = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []
    return [*line_buffered, str(exe)]


class _Daemon:
    """Action messages as the daemon publishes them, one every 20 ms while asked."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.bind(endpoint)
        self.seq = 0

    def send(self, flags: int = 0) -> None:
        header = ActionHeader(self.seq, time.monotonic_ns(), time.time_ns(), 0, 1, self.seq % 50, 1, 6, flags=flags,
                              session=1234)
        self.sock.send_multipart(encode_actions(b"action", header, np.full((1, 6), 0.25, np.float32)))
        self.seq += 1
        time.sleep(0.02)

    def close(self) -> None:
        self.ctx.destroy(linger=200)


@pytest.mark.parametrize("example", ["python", "c"])
def test_a_daemon_gone_silent_without_shutdown_reads_as_hold(example, tmp_path):
    """The examples blocked in their receive for ever: a controller built on them kept its last
    command while the daemon was gone. They must say HOLD after a few silent periods, once, and
    take the stream up again when it comes back."""
    command = [sys.executable, str(ROOT / "examples/subscriber_pyzmq.py")] if example == "python" else _c_example(tmp_path)
    endpoint = free_tcp_endpoint()
    daemon = _Daemon(endpoint)
    proc = subprocess.Popen([*command, endpoint, "100000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []
    reader = threading.Thread(target=lambda: [lines.put(line.rstrip("\n")) for line in proc.stdout], daemon=True)
    reader.start()

    def heard(prefix: str, keep_sending: bool, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if keep_sending:
                daemon.send()
            try:
                while True:
                    seen.append(lines.get_nowait())
                    if seen[-1].startswith(prefix):
                        return True
            except queue.Empty:
                time.sleep(0 if keep_sending else 0.02)
        return False

    try:
        assert heard("seq", keep_sending=True, timeout_s=30), seen  # the SUB has joined
        for _ in range(5):
            daemon.send()
        assert heard(SILENT_LINE, keep_sending=False, timeout_s=5), seen
        time.sleep(0.5)  # still silent: said once, not once per timeout
        for _ in range(5):
            daemon.send()
        daemon.send(Flag.HOLD | Flag.SHUTDOWN)
        proc.wait(timeout=20)
        reader.join(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        daemon.close()
    while not lines.empty():
        seen.append(lines.get_nowait())
    assert proc.returncode == 0, seen
    assert sum(line.startswith(SILENT_LINE) for line in seen) == 1, seen
    after = seen[[line.startswith(SILENT_LINE) for line in seen].index(True) + 1:]
    assert sum(line.startswith("seq") for line in after) == 6, seen
    if example == "c":
        assert seen[-1].startswith("summary: received") and " gaps 0 " in seen[-1], seen[-1]
        # the silent episode counts as a HOLD, as the header says (it was left out), beside SHUTDOWN's
        assert " holds 2 " in seen[-1], seen[-1]
