"""Observations recorded by the daemon (`phyai-edge run --record DIR`), read for calibration.

The format is the daemon's (phyai_edge/control/recorder.py, docs/daemon.md): `meta.json` plus
one `obs_NNNNNN.npz` per inference holding `image.<view>` (uint8 HxWx3 RGB; absent when that
camera had no frame), `state`, `timestamp`, `prompt` and the inference's request and result.
Only the observation part is read here, and only of inferences that succeeded: a frame with an
`error` (the daemon got no actions for it, often because of the observation itself, such as a
NaN state) and a file that cannot be read (a write cut short) are skipped with a warning, as
`phyai-edge eval` skips them.
"""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path

import numpy as np

from phyai_edge.adapters.base import Observation

IMAGE_KEY = "image."
log = logging.getLogger(__name__)


def is_recording(folder: Path) -> bool:
    folder = Path(folder)
    return (folder / "meta.json").exists() and next(folder.glob("obs_*.npz"), None) is not None


def _inference_failed(z: np.lib.npyio.NpzFile) -> bool:
    return "error" in z.files and bool(str(z["error"]))


# What reading one damaged record raises (cut short, empty, a member missing, not an npz).
UNREADABLE = (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile)


def read_records(folder: str | Path, camera_names: list[str] | None = None, limit: int | None = None,
                 spread: int | None = None) -> list[Observation]:
    """Observations in recording order. camera_names: the model's cameras; a recorded view
    the model does not have is an error (it would be silently dropped otherwise), a model
    camera missing from a record becomes an absent camera. limit: stop after this many;
    spread: at most this many, evenly spread over the usable records, and only their frames are
    read (a long recording decoded whole does not fit in memory: an hour at 3 inferences a
    second with three 640 x 480 cameras is 30 GB of pixels)."""
    folder = Path(folder)
    files = sorted(folder.glob("obs_*.npz"))
    if not files:
        raise ValueError(f"{folder} holds no obs_*.npz records (written by `phyai-edge run --record`)")
    out: list[Observation] = []
    failed: list[str] = []
    unreadable: list[str] = []
    picked = files
    if spread is not None:
        # Screened by the error field alone: np.load reads an archive's members only when asked.
        usable = []
        for f in files:
            try:
                with np.load(f, allow_pickle=False) as z:
                    if _inference_failed(z):
                        failed.append(f.name)
                        continue
            except UNREADABLE as exc:
                unreadable.append(f"{f.name} ({type(exc).__name__})")
                continue
            usable.append(f)
        if len(usable) > spread:
            usable = [usable[int(i)] for i in np.linspace(0, len(usable) - 1, num=spread)]
        picked = usable
    for f in picked:
        try:
            with np.load(f, allow_pickle=False) as z:
                if _inference_failed(z):
                    failed.append(f.name)
                    continue
                views = {k[len(IMAGE_KEY):]: z[k] for k in z.files if k.startswith(IMAGE_KEY)}
                state = np.asarray(z["state"], dtype=np.float32).reshape(-1)
                prompt = str(z["prompt"]) if "prompt" in z.files else ""
                ts = float(z["timestamp"]) if "timestamp" in z.files else 0.0
        except UNREADABLE as exc:
            unreadable.append(f"{f.name} ({type(exc).__name__})")
            continue
        names = camera_names if camera_names is not None else sorted(views)
        unknown = set(views) - set(names)
        if unknown:
            raise ValueError(f"{f.name}: recorded cameras {sorted(unknown)} are not model cameras {names}")
        images: dict[str, np.ndarray | None] = {n: views.get(n) for n in names}
        out.append(Observation(images, state, prompt, ts))
        if limit is not None and len(out) >= limit:
            break
    if failed:
        log.warning("%s: left out %d frame(s) whose inference failed (error recorded): %s", folder, len(failed),
                    ", ".join(failed[:5]) + (" ..." if len(failed) > 5 else ""))
    if unreadable:
        log.warning("%s: left out %d unreadable record(s): %s", folder, len(unreadable),
                    ", ".join(unreadable[:5]) + (" ..." if len(unreadable) > 5 else ""))
    if not out:
        raise ValueError(f"{folder}: none of its {len(files)} records is usable ({len(failed)} failed inferences, "
                         f"{len(unreadable)} unreadable)")
    return out
