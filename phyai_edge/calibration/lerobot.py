"""Observations from a local LeRobot dataset folder (format v2.x or v3.0), never downloaded.

What is read: `meta/info.json` (features), the task strings (`meta/tasks.jsonl` or
`meta/tasks.parquet`), and the frame tables under `data/**.parquet` (needs `pyarrow`, an
optional dependency). Camera images come from, in order of preference: image bytes stored in
the parquet (features of dtype "image"), a path stored beside them, or the image-folder
layout LeRobot writes while recording, `images/<feature>/episode_NNNNNN/frame_NNNNNN.png`.
Video-only features would need a video decoder and are refused with that explanation.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from phyai_edge.adapters.base import Observation
from phyai_edge.extras import install_hint

IMAGE_PREFIX = "observation.images."
log = logging.getLogger(__name__)


def is_lerobot_dataset(folder: Path) -> bool:
    return (Path(folder) / "meta" / "info.json").exists()


def _decode(data: bytes) -> np.ndarray:
    try:
        from PIL import Image

        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    except ImportError:
        import cv2

        bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        if bgr is None:
            raise ValueError("could not decode an image in the dataset") from None
        return bgr[..., ::-1].copy()


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(f"reading a LeRobot dataset needs pyarrow: {install_hint('pyarrow')}") from exc
    return pq


def _tasks(root: Path) -> dict[int, str]:
    jsonl = root / "meta" / "tasks.jsonl"
    if jsonl.exists():
        out = {}
        for line in jsonl.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                out[int(d["task_index"])] = d["task"]
        return out
    pq_file = root / "meta" / "tasks.parquet"
    if pq_file.exists():
        table = _pyarrow().read_table(pq_file).to_pydict()
        names = table.get("task") or table.get("__index_level_0__") or []
        return {int(i): str(t) for i, t in zip(table["task_index"], names)}
    return {}


def read_lerobot(
    folder: str | Path,
    camera_names: list[str],
    limit: int = 64,
    camera_map: dict[str, str] | None = None,
) -> list[Observation]:
    """Up to `limit` observations spread evenly over the dataset's frames.

    camera_map: model camera name -> dataset camera (the part after "observation.images.").
    Without it, cameras are matched by name, and if no names match, by order.
    """
    root = Path(folder)
    info = json.loads((root / "meta" / "info.json").read_text())
    features: dict[str, dict[str, Any]] = info.get("features", {})
    ds_cams = [k[len(IMAGE_PREFIX):] for k, f in features.items()
               if k.startswith(IMAGE_PREFIX) and f.get("dtype") in ("image", "video")]
    if "observation.state" not in features:
        raise ValueError(f"{root}: meta/info.json has no observation.state feature")
    if camera_map is None:
        if set(camera_names) & set(ds_cams):
            camera_map = {c: c for c in camera_names if c in ds_cams}
        else:
            camera_map = dict(zip(camera_names, ds_cams))
    unknown = [d for d in camera_map.values() if d not in ds_cams]
    if unknown:
        raise ValueError(f"{root}: dataset has no cameras {unknown}; it has {ds_cams}")
    strangers = [c for c in camera_map if c not in camera_names]
    if strangers:
        raise ValueError(f"{root}: the camera map names cameras that are not model cameras: {strangers} "
                         f"(the model has {list(camera_names)})")
    if not camera_map:
        # Every camera absent: the vision tower would be calibrated on the absent cameras' blank images.
        raise ValueError(f"{root}: none of the model's cameras {list(camera_names)} maps onto the dataset's "
                         f"{ds_cams}; calibrate from a recording or a dataset with the policy's cameras")
    absent = [c for c in camera_names if c not in camera_map]
    if absent:
        log.warning("%s: model cameras %s have no dataset camera and are calibrated as absent (dataset: %s; "
                    "mapping used: %s)", root, absent, ds_cams, camera_map)
    files = sorted((root / "data").rglob("*.parquet"))
    if not files:
        raise ValueError(f"{root}: no parquet files under data/")
    pq = _pyarrow()
    tasks = _tasks(root)
    counts = [pq.ParquetFile(f).metadata.num_rows for f in files]
    total = sum(counts)
    wanted = sorted({int(i) for i in np.linspace(0, total - 1, num=min(limit, total))})
    out: list[Observation] = []
    start = 0
    for f, n in zip(files, counts):
        rows = [i - start for i in wanted if start <= i < start + n]
        start += n
        if not rows:
            continue
        table = pq.read_table(f).take(rows).to_pylist()
        for row in table:
            images: dict[str, np.ndarray | None] = {}
            for model_cam in camera_names:
                ds_cam = camera_map.get(model_cam)
                images[model_cam] = None if ds_cam is None else _image(root, info, features, ds_cam, row)
            task = tasks.get(int(row.get("task_index", -1)), "") if "task_index" in row else row.get("task", "")
            out.append(Observation(images, np.asarray(row["observation.state"], dtype=np.float32), str(task),
                                   float(row.get("timestamp", 0.0))))
    return out


def _image(root: Path, info: dict[str, Any], features: dict[str, Any], cam: str, row: dict[str, Any]) -> np.ndarray:
    key = IMAGE_PREFIX + cam
    cell = row.get(key)
    if isinstance(cell, dict):
        if cell.get("bytes"):
            return _decode(cell["bytes"])
        if cell.get("path"):
            p = Path(cell["path"])
            p = p if p.is_absolute() else root / p
            if p.exists():
                return _decode(p.read_bytes())
    ep, idx = int(row.get("episode_index", 0)), int(row.get("frame_index", 0))
    for ext in ("png", "jpg", "jpeg"):
        p = root / "images" / key / f"episode_{ep:06d}" / f"frame_{idx:06d}.{ext}"
        if p.exists():
            return _decode(p.read_bytes())
    if features[key].get("dtype") == "video":
        raise ValueError(f"{root}: camera {cam} is stored only as video; decode it to images/{key}/episode_*/"
                         "frame_*.png first (phyai-edge reads no video codecs), or record with phyai-edge run --record")
    raise ValueError(f"{root}: no image found for {key} in episode {ep} frame {idx}")
