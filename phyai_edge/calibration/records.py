"""The on-disk format of recorded observations (`phyai-edge run --record DIR`).

    DIR/meta.json        {"format": "phyai-edge/record/1", "camera_names": [...], "state_dim": N}
    DIR/samples.jsonl    one JSON object per observation:
                         {"index": 0, "timestamp": 12.5, "prompt": "...", "state": [...],
                          "frames": "frames/000000.npz", "cameras": ["top", ...]}
    DIR/frames/NNNNNN.npz  one uint8 HWC array per camera present, keyed by camera name

npz keeps frames lossless and needs nothing beyond numpy; a camera missing at that instant
is simply absent from the file (and from "cameras"), which the adapter masks out. Appending
a line per sample makes a recording readable even if the daemon is killed mid-run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from phyai_edge.adapters.base import Observation

RECORD_FORMAT = "phyai-edge/record/1"


class RecordWriter:
    """Append observations to a recording folder. Not thread-safe: one writer per folder."""

    def __init__(self, folder: str | Path, camera_names: list[str], state_dim: int) -> None:
        self.folder = Path(folder)
        (self.folder / "frames").mkdir(parents=True, exist_ok=True)
        meta = self.folder / "meta.json"
        if meta.exists():
            old = json.loads(meta.read_text())
            if old.get("camera_names") != list(camera_names) or old.get("state_dim") != state_dim:
                raise ValueError(f"{self.folder} already holds a recording for cameras {old.get('camera_names')} "
                                 f"and state_dim {old.get('state_dim')}; record into a new folder")
        else:
            meta.write_text(json.dumps({"format": RECORD_FORMAT, "camera_names": list(camera_names),
                                        "state_dim": state_dim}, indent=2))
        self._samples = (self.folder / "samples.jsonl").open("a")
        self.index = sum(1 for _ in (self.folder / "samples.jsonl").open())

    def write(self, obs: Observation) -> int:
        frames = {k: np.asarray(v) for k, v in obs.images.items() if v is not None}
        rel = f"frames/{self.index:06d}.npz"
        np.savez(self.folder / rel, **frames)
        line: dict[str, Any] = {"index": self.index, "timestamp": float(obs.timestamp), "prompt": obs.prompt,
                                "state": np.asarray(obs.state, dtype=np.float32).tolist(), "frames": rel,
                                "cameras": sorted(frames)}
        self._samples.write(json.dumps(line) + "\n")
        self._samples.flush()
        self.index += 1
        return self.index - 1

    def close(self) -> None:
        self._samples.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_recording(folder: Path) -> bool:
    meta = Path(folder) / "meta.json"
    if not meta.exists():
        return False
    try:
        return json.loads(meta.read_text()).get("format") == RECORD_FORMAT
    except json.JSONDecodeError:
        return False


def read_records(folder: str | Path, limit: int | None = None) -> list[Observation]:
    folder = Path(folder)
    if not is_recording(folder):
        raise ValueError(f"{folder} is not a phyai-edge recording (no meta.json with format {RECORD_FORMAT!r})")
    meta = json.loads((folder / "meta.json").read_text())
    out: list[Observation] = []
    with (folder / "samples.jsonl").open() as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            try:
                s = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut short by a killed recorder ends the recording
            with np.load(folder / s["frames"]) as z:
                images = {name: (z[name] if name in z.files else None) for name in meta["camera_names"]}
            state = np.asarray(s["state"], dtype=np.float32)
            if state.shape[0] != meta["state_dim"]:
                raise ValueError(f"{folder}/samples.jsonl line {n + 1}: state has {state.shape[0]} values, "
                                 f"meta.json says {meta['state_dim']}")
            out.append(Observation(images, state, s.get("prompt", ""), float(s.get("timestamp", 0.0))))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"{folder} holds no samples")
    return out
