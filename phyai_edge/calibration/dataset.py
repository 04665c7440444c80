"""A calibration set: observations to push through the model, from any of three sources."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from phyai_edge.adapters.base import Adapter, Observation

PROMPTS = ("pick up the cube", "fold the towel", "open the drawer", "put the cup on the plate",
           "hand the block to the other arm", "push the button")


@dataclass
class CalibrationSet:
    observations: list[Observation]
    source: str

    def split(self, holdout: int) -> tuple[list[Observation], list[Observation]]:
        """(calibration, held-out): held-out samples are never used to choose scales."""
        holdout = min(holdout, max(len(self.observations) - 1, 0))
        if holdout == 0:
            return list(self.observations), []
        return self.observations[:-holdout], self.observations[-holdout:]


def synthetic_observations(adapter: Adapter, n: int, seed: int = 0, size: tuple[int, int] = (240, 320)) -> list[Observation]:
    """Smooth random images (low-frequency noise upsampled, closer to camera statistics than
    white noise), states spread over the normalised range, and varied prompts."""
    rng = np.random.default_rng(seed)
    cams = list(getattr(adapter, "camera_names", ["cam"]))
    state_dim = int(getattr(adapter, "state_dim", 0) or adapter.action_dim)
    io = getattr(adapter, "io", None)
    out = []
    for i in range(n):
        images = {}
        for c in cams:
            coarse = rng.uniform(0, 255, (size[0] // 16, size[1] // 16, 3))
            img = np.kron(coarse, np.ones((16, 16, 1))) + rng.normal(0, 12, (size[0], size[1], 3))
            images[c] = np.clip(img, 0, 255).astype(np.uint8)
        z = rng.uniform(-1, 1, state_dim).astype(np.float32)
        state = io.state_stats.unnormalize(z) if io is not None else z
        out.append(Observation(images, state.astype(np.float32), PROMPTS[i % len(PROMPTS)], float(i)))
    return out


def load_calibration_set(source: str | Path, adapter: Adapter, limit: int = 64, seed: int = 0,
                         camera_map: dict[str, str] | None = None) -> CalibrationSet:
    """`source` is "synthetic", a `phyai-edge run --record` folder, or a LeRobot dataset folder."""
    from phyai_edge.calibration.lerobot import is_lerobot_dataset, read_lerobot
    from phyai_edge.calibration.records import is_recording, read_records

    if str(source) == "synthetic":
        return CalibrationSet(synthetic_observations(adapter, limit, seed), "synthetic")
    folder = Path(source)
    if not folder.is_dir():
        raise FileNotFoundError(f"calibration source not found: {folder} (give a folder or 'synthetic')")
    if is_recording(folder):
        obs = read_records(folder, list(adapter.camera_names), spread=limit)
        kind = "recording"
    elif is_lerobot_dataset(folder):
        obs = read_lerobot(folder, list(adapter.camera_names), limit=limit, camera_map=camera_map)
        kind = "lerobot"
    else:
        raise ValueError(f"{folder} is neither a phyai-edge recording (meta.json + obs_*.npz) nor a LeRobot dataset "
                         "(meta/info.json); use 'synthetic' to calibrate without data")
    if len(obs) > limit:
        # Spread the picks over the whole recording: neighbouring frames are nearly identical.
        obs = [obs[int(i)] for i in np.linspace(0, len(obs) - 1, num=limit)]
    return CalibrationSet(obs, f"{kind}:{folder}")
