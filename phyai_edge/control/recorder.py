"""`--record DIR`: every inference's observation, request and result, for calibration and replay.

One `.npz` per inference, written by a background thread (the clock only enqueues; when the
queue is full the record is dropped and counted, never waited for). Layout in docs/daemon.md:
  meta.json                      daemon config source, policy shape, camera mapping
  obs_000001.npz                 image.<view> (uint8 HxWx3 RGB), state, timestamp, prompt,
                                 rtc_mode, prefix (or empty), delay_estimate, start_slot,
                                 actions (H x action_dim, empty on failure), delay (measured),
                                 error (string, "" on success)
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("phyai_edge.control")


class Recorder:
    def __init__(self, directory: str | Path, meta: dict[str, Any], max_pending: int = 64) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=max_pending)
        self.written = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="recorder", daemon=True)
        self._thread.start()

    def add(self, record: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            rec = self._queue.get()
            if rec is None:
                return
            try:
                arrays: dict[str, Any] = {}
                for name, img in rec.pop("images").items():
                    if img is not None:
                        arrays[f"image.{name}"] = img[..., ::-1] if rec["bgr"].get(name) else img
                rec.pop("bgr")
                for key, value in rec.items():
                    arrays[key] = np.asarray(value if value is not None else np.zeros(0, np.float32))
                np.savez(self.dir / f"obs_{rec['job_id']:06d}.npz", **arrays)
                self.written += 1
            except Exception as exc:
                log.error("record: writing failed (%s)", exc)

    def close(self, timeout_s: float = 5.0) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout=timeout_s)
