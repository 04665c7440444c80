"""`--record`: files appear whole or not at all; close() is bounded and says what it left."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from phyai_edge.control import recorder as recorder_mod
from phyai_edge.control.recorder import Recorder


def _record(job_id: int) -> dict:
    return {"job_id": job_id, "images": {"top": np.full((6, 8, 3), job_id, np.uint8)}, "bgr": {"top": False},
            "state": np.zeros(4, np.float32), "timestamp": 1.0, "prompt": "p", "rtc_mode": "none", "prefix": None,
            "delay_estimate": 0, "start_slot": job_id, "actions": np.zeros((2, 4), np.float32), "delay": 1, "error": ""}


class SlowDisk:
    """np.savez that writes a first piece, then waits for `go` before writing the file for real."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real = np.savez
        self.writing = threading.Event()
        self.go = threading.Event()
        monkeypatch.setattr(recorder_mod.np, "savez", self)

    def __call__(self, target, **arrays) -> None:
        f = open(target, "wb") if isinstance(target, (str, os.PathLike)) else target  # noqa: SIM115 - closed below
        f.write(b"PK\x03\x04 half of an npz")
        f.flush()
        self.writing.set()
        self.go.wait(30)
        f.seek(0)
        f.truncate()
        self.real(f, **arrays)
        if f is not target:
            f.close()


def test_a_record_file_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """Written straight to obs_NNNNNN.npz, a process ended mid-write (SIGKILL, systemd's stop
    timeout, exit while the recorder's daemon thread writes) left a truncated file under the name
    replay and calibration read."""
    disk = SlowDisk(monkeypatch)
    rec = Recorder(tmp_path, {"cameras": {"top": "top"}})
    rec.add(_record(1))
    try:
        assert disk.writing.wait(10)
        assert sorted(p.name for p in tmp_path.glob("obs_*.npz")) == []  # mid-write: nothing under the name
    finally:
        disk.go.set()
    rec.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "obs_000001.npz"]
    with np.load(tmp_path / "obs_000001.npz") as z:
        assert z["image.top"].shape == (6, 8, 3) and int(z["start_slot"]) == 1
    assert rec.written == 1 and rec.dropped == 0


def test_close_stops_waiting_for_a_stuck_disk_and_says_what_it_left(tmp_path, monkeypatch, caplog):
    """close() gave a stuck disk its timeout twice over and lost what was still queued without a
    word; it now waits once and reports the records it leaves (one mid-write, two queued)."""
    disk = SlowDisk(monkeypatch)
    rec = Recorder(tmp_path, {})
    for i in (1, 2, 3):
        rec.add(_record(i))
    try:
        assert disk.writing.wait(10)
        with caplog.at_level("INFO", logger="phyai_edge.control"):
            rec.close(timeout_s=0.05)
        assert f"record: 0 observations written to {tmp_path}, 3 dropped, 0 failed" in caplog.messages
        rec.add(_record(4))  # after close: dropped at once, never queued
        assert rec.dropped == 1 and rec._queue.qsize() == 2
    finally:
        disk.go.set()
    rec._thread.join(10)
    # The write under way finished (whole); the two left in the queue were not written, and counted.
    assert rec.written == 1 and rec.dropped == 3
    assert sorted(p.name for p in tmp_path.glob("obs_*")) == ["obs_000001.npz"]
