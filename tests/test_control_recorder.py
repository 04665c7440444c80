"""`--record`: files appear whole or not at all; close() is bounded and says what it left."""

from __future__ import annotations

import os
import threading
import time

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


def test_a_slow_disk_holds_a_bounded_amount_of_frames(tmp_path, monkeypatch):
    """64 queued records of three 720p cameras held ~0.5 GB of frames while the disk lagged; the
    queue now also stops at `max_pending_bytes` of frames (a record bigger than that alone still
    goes in), and what it held is given back as records are taken."""
    disk = SlowDisk(monkeypatch)
    frame = 6 * 8 * 3  # bytes of one _record's frame
    rec = Recorder(tmp_path, {}, max_pending_bytes=3 * frame)
    try:
        rec.add(_record(1))
        assert disk.writing.wait(10)  # record 1 is being written: out of the queue
        for i in range(2, 7):
            rec.add(_record(i))
        assert rec._queue.qsize() == 3 and rec.dropped == 2 and rec._pending_bytes == 3 * frame
    finally:
        disk.go.set()
    rec.close()
    assert rec.written == 4 and rec.dropped == 2 and rec._pending_bytes == 0
    big = Recorder(tmp_path / "big", {}, max_pending_bytes=frame // 2)
    big.add(_record(7))  # larger than the cap, into an empty queue
    big.close()
    assert big.written == 1 and big.dropped == 0


class Disk:
    """`free_bytes` as the test says: the free space a real disk would report."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, free: int) -> None:
        self.free = free
        monkeypatch.setattr(recorder_mod, "free_bytes", lambda directory: self.free)


def _settle(rec: Recorder, written: int, skipped: int) -> None:
    deadline = time.monotonic() + 10
    while (rec.written, rec.skipped_low_disk) != (written, skipped) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (rec.written, rec.skipped_low_disk) == (written, skipped)


def test_records_are_skipped_below_the_disk_floor_and_resume_above_it(tmp_path, monkeypatch, caplog):
    """With no floor a long recording filled the robot computer's disk (~1 GB a minute with three
    720p cameras). Below the floor each record is skipped and counted; one line says when it
    starts and one when it ends, not one per record."""
    disk = Disk(monkeypatch, free=10 * 10**9)
    with caplog.at_level("INFO", logger="phyai_edge.control"):
        rec = Recorder(tmp_path, {}, min_free_bytes=2 * 10**9)
        rec.add(_record(1))
        _settle(rec, written=1, skipped=0)
        disk.free = 1 * 10**9
        for i in (2, 3, 4):
            rec.add(_record(i))
        _settle(rec, written=1, skipped=3)
        disk.free = 5 * 10**9
        rec.add(_record(5))
        _settle(rec, written=2, skipped=3)
        rec.close()
    assert sorted(p.name for p in tmp_path.glob("obs_*")) == ["obs_000001.npz", "obs_000005.npz"]
    low = [m for m in caplog.messages if "below the 2.0 GB floor" in m]
    assert len(low) == 1 and "1.0 GB free" in low[0]
    assert sum("recording resumes (3 records skipped so far)" in m for m in caplog.messages) == 1
    assert (f"record: 2 observations written to {tmp_path}, 0 dropped, 0 failed, 3 skipped "
            "(disk below the --record-min-free-gb floor)") in caplog.messages


def test_a_disk_already_below_the_floor_is_said_at_start(tmp_path, monkeypatch, caplog):
    Disk(monkeypatch, free=10**8)
    with caplog.at_level("WARNING", logger="phyai_edge.control"):
        rec = Recorder(tmp_path, {}, min_free_bytes=10**9)
    assert any("0.1 GB free, below the 1.0 GB floor" in m and "records are skipped" in m for m in caplog.messages)
    rec.add(_record(1))
    _settle(rec, written=0, skipped=1)
    rec.close()
    # one line for the episode: the first skipped record does not say it again
    assert sum("below the 1.0 GB floor" in m for m in caplog.messages) == 1


def test_no_floor_never_asks_the_disk(tmp_path, monkeypatch):
    def refuse(directory):
        raise AssertionError("statfs with no floor")

    monkeypatch.setattr(recorder_mod, "free_bytes", refuse)
    rec = Recorder(tmp_path, {})
    rec.add(_record(1))
    _settle(rec, written=1, skipped=0)
    rec.close()


def test_free_bytes_reads_the_real_file_system(tmp_path):
    st = os.statvfs(tmp_path)
    assert recorder_mod.free_bytes(tmp_path) == st.f_bavail * st.f_frsize > 0


class Counted:
    """A labelled counter as prometheus-client's: what each label was incremented by."""

    def __init__(self) -> None:
        self.counts: dict[str, float] = {}

    def labels(self, result: str) -> Counted:
        self._label = result
        return self

    def inc(self, amount: float = 1.0) -> None:
        self.counts[self._label] = self.counts.get(self._label, 0.0) + amount


def test_each_record_s_outcome_reaches_the_metrics(tmp_path, monkeypatch):
    """A recording that stopped reaching the disk was only in the log; a dashboard now sees
    phyai_record_observations{result} grow by written, skipped_low_disk, dropped and failed."""
    disk = Disk(monkeypatch, free=10 * 10**9)
    counter = Counted()
    rec = Recorder(tmp_path, {}, min_free_bytes=10**9, counter=counter)
    rec.add(_record(1))
    _settle(rec, written=1, skipped=0)
    disk.free = 10**8
    rec.add(_record(2))
    _settle(rec, written=1, skipped=1)
    disk.free = 10 * 10**9
    bad = _record(3)
    bad["images"] = {"top": "not an image"}  # the write raises: counted as failed
    rec.add(bad)
    deadline = time.monotonic() + 10
    while rec.failed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    rec.close()
    rec.add(_record(4))  # after close: dropped
    assert counter.counts == {"written": 1, "skipped_low_disk": 1, "failed": 1, "dropped": 1}
    assert (rec.written, rec.skipped_low_disk, rec.failed, rec.dropped) == (1, 1, 1, 1)
