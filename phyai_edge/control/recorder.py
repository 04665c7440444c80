"""`--record DIR`: every inference's observation, request and result, for calibration and replay.

One `.npz` per inference, written by a background thread (the clock only enqueues; when the
queue is full the record is dropped and counted, never waited for). While the disk has less
than `min_free_bytes` free, records are skipped and counted: a robot computer whose disk fills
loses its journal, and every other service on it its writes. Layout in docs/daemon.md:
  meta.json                      daemon config source, policy shape, camera mapping
  obs_000001.npz                 image.<view> (uint8 HxWx3 RGB, cropped, rotated and mirrored
                                 as the policy saw it), state, timestamp, prompt,
                                 rtc_mode, prefix (or empty), delay_estimate, start_slot,
                                 actions (H x action_dim, empty on failure), delay (measured),
                                 error (string, "" on success), job_id, noise_seed (the chunk's
                                 noise came from (noise_seed, 0, job_id): engines/noise.py;
                                 empty: the engine's own stream)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from phyai_edge.control.log import worth_logging
from phyai_edge.control.worker import as_policy_frame

log = logging.getLogger("phyai_edge.control")


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still use on `directory`'s file system (the root-reserved
    blocks are not the daemon's to fill)."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


# Frames the queue may hold while the disk is slower than inference: 64 records of three 720p
# cameras held ~0.5 GB, the robot computer's memory, which on a Jetson the GPU's model shares.
MAX_PENDING_BYTES = 256 << 20


class Recorder:
    def __init__(self, directory: str | Path, meta: dict[str, Any], max_pending: int = 64,
                 min_free_bytes: int = 0, counter: Any = None, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        """`counter`: a labelled counter (`Metrics.records`) told each record's outcome
        (`metrics.RECORD_RESULTS`), or None. A record is dropped when the queue holds `max_pending`
        records, or frames of `max_pending_bytes` and more (one record is always taken)."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        _write_atomically(self.dir / "meta.json", lambda f: f.write(json.dumps(meta, indent=2, default=str).encode()))
        self._queue: queue.Queue[tuple[dict[str, Any], int]] = queue.Queue(maxsize=max_pending)
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0  # the queued records' frames
        self._bytes_lock = threading.Lock()
        self._closing = threading.Event()
        self._deadline = float("inf")  # time.monotonic() after which close() gives up on what is pending
        self.written = 0
        self.dropped = 0  # not queued (queue full, or after close) or left behind by close()
        self.failed = 0  # writes that raised (disk full, permissions)
        self.min_free_bytes = min_free_bytes
        self._counter = counter
        self.skipped_low_disk = 0  # not written: the disk had less than min_free_bytes free
        self._low_disk = False  # in a low-disk episode (logged at its start and its end)
        self._disk_too_full()  # a disk already below the floor is said at start-up, not at the first record
        self._thread = threading.Thread(target=self._run, name="recorder", daemon=True)
        self._thread.start()

    def add(self, record: dict[str, Any]) -> None:
        if self._closing.is_set():
            self._note("dropped")
            return
        # getattr: the clock thread calls this, and must not fail on what only the write would refuse.
        size = sum(getattr(img, "nbytes", 0) for img in record.get("images", {}).values())
        with self._bytes_lock:
            if self._pending_bytes and self._pending_bytes + size > self.max_pending_bytes:
                self._note("dropped")
                return
            try:
                self._queue.put_nowait((record, size))
            except queue.Full:
                self._note("dropped")
                return
            self._pending_bytes += size

    def _taken(self, size: int) -> None:
        with self._bytes_lock:
            self._pending_bytes -= size

    def _run(self) -> None:
        next_drop_log = 1  # drops are logged here at 1, 10, 100, ... (never on the clock thread)
        while True:
            if self.dropped >= next_drop_log:
                log.warning("record: %d records dropped so far (writing is slower than inference)", self.dropped)
                while self.dropped >= next_drop_log:
                    next_drop_log *= 10
            try:
                rec, size = self._queue.get(timeout=0.05)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            self._taken(size)
            if time.monotonic() > self._deadline:
                # close() stopped waiting: what is left is dropped, and counted as such.
                self._note("dropped")
                while True:
                    try:
                        self._taken(self._queue.get_nowait()[1])
                    except queue.Empty:
                        return
                    self._note("dropped")
            if self._disk_too_full():
                self._note("skipped_low_disk")
                continue
            try:
                arrays: dict[str, Any] = {}
                geometry = rec.pop("geometry", None) or {}
                for name, img in rec.pop("images").items():
                    if img is not None:
                        arrays[f"image.{name}"] = as_policy_frame(img, rec["bgr"].get(name, False), geometry.get(name))
                rec.pop("bgr")
                for key, value in rec.items():
                    arrays[key] = np.asarray(value if value is not None else np.zeros(0, np.float32))
                _write_atomically(self.dir / f"obs_{rec['job_id']:06d}.npz", lambda f, arrays=arrays: np.savez(f, **arrays))
                self._note("written")
            except Exception as exc:
                self._note("failed")
                if worth_logging(self.failed):  # a full disk fails every record: 1st, 10th, ...
                    log.error("record: writing failed (%s); %d so far", exc, self.failed)

    def _note(self, result: str) -> None:
        """One record's outcome: its count here (`written`, `dropped`, ...) and the counter's."""
        setattr(self, result, getattr(self, result) + 1)
        if self._counter is not None:
            self._counter.labels(result).inc()

    def _disk_too_full(self) -> bool:
        """Checked before each write: one statfs, on this thread (never the clock's)."""
        if not self.min_free_bytes:
            return False
        try:
            free = free_bytes(self.dir)
        except OSError:
            return False  # the write will fail and say why
        low = free < self.min_free_bytes
        if low and not self._low_disk:
            log.warning("record: %s has %s free, below the %s floor (--record-min-free-gb): records are skipped "
                        "until space is freed", self.dir, _gb(free), _gb(self.min_free_bytes))
        elif self._low_disk and not low:
            log.info("record: %s has %s free again: recording resumes (%d records skipped so far)", self.dir,
                     _gb(free), self.skipped_low_disk)
        self._low_disk = low
        return low

    def close(self, timeout_s: float = 5.0) -> None:
        """Writes what is pending for at most `timeout_s`, then drops (and counts) the rest. It put
        a None that waited up to `timeout_s` for room behind a full queue, joined for as long again,
        and lost whatever was still queued without counting it."""
        self._deadline = time.monotonic() + timeout_s
        self._closing.set()
        self._thread.join(timeout=timeout_s + 0.5)
        # A write still under way at exit leaves no file (see _write_atomically); count it as lost.
        lost = self._queue.qsize() + self._thread.is_alive()
        dropped = self.dropped + lost
        if lost and self._counter is not None:
            self._counter.labels("dropped").inc(lost)
        skipped = f", {self.skipped_low_disk} skipped (disk below the --record-min-free-gb floor)" \
            if self.skipped_low_disk else ""
        (log.warning if dropped or self.failed or skipped else log.info)(
            "record: %d observations written to %s, %d dropped, %d failed%s", self.written, self.dir, dropped,
            self.failed, skipped)


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def _write_atomically(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """`path` appears whole or not at all: written under a temporary name (which the readers'
    `obs_*.npz` does not match), then renamed. A process ended mid-write (SIGKILL, systemd's stop
    timeout, exit while this daemon thread writes) left a truncated `.npz` under the final name."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
