"""Observation -> PI0.5 inputs: images resized with padding to the model's size in [-1, 1],
state normalised and written into the prompt as 256-bin integers, prompt tokenised."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def image_to_float_chw(img: np.ndarray | torch.Tensor, name: str) -> torch.Tensor:
    """uint8 HWC (as cameras give it) or float CHW/HWC in [0, 1] -> float32 CHW in [0, 1]."""
    # A copy: camera buffers are often read-only views, and torch must not alias them.
    t = torch.from_numpy(np.array(img, copy=True)) if isinstance(img, np.ndarray) else img
    if t.ndim != 3:
        raise ValueError(f"camera {name!r}: expected a 3-D image (HWC or CHW), got shape {tuple(t.shape)}")
    if t.dtype == torch.uint8:
        if t.shape[-1] not in (1, 3):
            raise ValueError(f"camera {name!r}: uint8 images must be HWC with 1 or 3 channels, got {tuple(t.shape)}")
        t = t.permute(2, 0, 1).float() / 255.0
    elif t.is_floating_point():
        if t.shape[0] not in (1, 3) and t.shape[-1] in (1, 3):
            t = t.permute(2, 0, 1)
        if t.shape[0] not in (1, 3):
            raise ValueError(f"camera {name!r}: float images must be CHW with 1 or 3 channels, got {tuple(t.shape)}")
        t = t.float()
        if not torch.isfinite(t).all():
            raise ValueError(f"camera {name!r}: image has NaN or Inf values")
        lo, hi = float(t.min()), float(t.max())
        if lo < -1e-3 or hi > 1.0 + 1e-3:
            raise ValueError(f"camera {name!r}: float images must lie in [0, 1], got range [{lo:.3g}, {hi:.3g}]")
    else:
        raise ValueError(f"camera {name!r}: unsupported image dtype {t.dtype} (use uint8 HWC or float CHW)")
    if t.shape[0] == 1:
        t = t.expand(3, -1, -1)
    return t


def resize_with_pad(img: torch.Tensor, size: int) -> torch.Tensor:
    """float CHW in [0, 1] -> (3, size, size): aspect kept, bilinear, centred black padding."""
    _, h, w = img.shape
    if (h, w) == (size, size):
        return img
    ratio = max(w / size, h / size)
    rh, rw = int(h / ratio), int(w / ratio)
    out = F.interpolate(img[None], size=(rh, rw), mode="bilinear", align_corners=False)[0].clamp(0.0, 1.0)
    top, left = (size - rh) // 2, (size - rw) // 2
    return F.pad(out, (left, size - rw - left, top, size - rh - top), value=0.0)


def discretize_state(state_norm: np.ndarray, bins: int = 256) -> np.ndarray:
    """Normalised state in [-1, 1] -> integer bins 0..bins-1; values outside saturate."""
    edges = np.linspace(-1.0, 1.0, bins + 1)[:-1]
    return np.clip(np.digitize(state_norm, bins=edges) - 1, 0, bins - 1)


def format_prompt(task: str, state_bins: np.ndarray) -> str:
    cleaned = task.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {cleaned}, State: {' '.join(str(int(b)) for b in state_bins)};\nAction: "
