"""Observation -> PI0.5 inputs: images resized with padding to the model's size in [-1, 1],
state normalised and written into the prompt as 256-bin integers, prompt tokenised.

The per-image path (`image_to_float_chw` -> `to_model_range`) takes any supported image and
defines the values. `images_to_model` gives the same values faster for the common case, 3-channel
uint8 HWC frames:
- for a GPU (any non-CPU device) the batch's frames are stacked as uint8 in page-locked memory (a
  quarter of the float32 bytes, and for frames at the model's size the only host copy), cross
  in one asynchronous copy and are converted and resized there, a whole batch per kernel;
- on the CPU each frame is converted straight into its slot of the output with the per-image
  path's arithmetic and no batch-sized temporaries (which on the host cost fresh pages).
Other images in a batch (float, grayscale) go the per-image way and join it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


def _float_is_hwc(shape: tuple[int, ...]) -> bool:
    """A float image is CHW unless its first axis cannot be channels and its last can."""
    return shape[0] not in (1, 3) and shape[-1] in (1, 3)


def image_problem(img: np.ndarray | torch.Tensor, size: int | None = None) -> str | None:
    """Why preprocessing cannot take `img` (None if it can): the per-image path's rules, which a
    server checks before an image joins a batch (where a failure would cost its neighbours a
    rerun each). `size`: the model's input side, which the image must keep a row and a column of
    when fitted into it."""
    shape = tuple(np.shape(img))
    is_np = isinstance(img, np.ndarray)
    if len(shape) != 3 or 0 in shape:
        return f"an image of shape {shape}, expected a 3-D image (HWC or CHW) with pixels"
    if img.dtype == (np.uint8 if is_np else torch.uint8):
        if shape[-1] not in (1, 3):
            return f"uint8 images must be HWC with 1 or 3 channels, got {shape}"
        h, w = shape[0], shape[1]
    elif np.issubdtype(img.dtype, np.floating) if is_np else img.is_floating_point():
        c, h, w = (shape[2], shape[0], shape[1]) if _float_is_hwc(shape) else shape
        if c not in (1, 3):
            return f"float images must be CHW with 1 or 3 channels, got {shape}"
        if not (np.isfinite(img).all() if is_np else torch.isfinite(img).all()):
            return "image has NaN or Inf values"
        lo, hi = float(img.min()), float(img.max())
        if lo < -1e-3 or hi > 1.0 + 1e-3:
            return f"float images must lie in [0, 1], got range [{lo:.3g}, {hi:.3g}]"
    else:
        return f"unsupported image dtype {img.dtype} (use uint8 HWC or float CHW)"
    if size is not None and 0 in fit(h, w, size)[:2]:
        return f"a {h} x {w} image keeps no row or column at the model's {size} x {size} input"
    return None


def image_to_float_chw(img: np.ndarray | torch.Tensor, name: str) -> torch.Tensor:
    """uint8 HWC (as cameras give it) or float CHW/HWC in [0, 1] -> float32 CHW in [0, 1]."""
    problem = image_problem(img)
    if problem is not None:
        raise ValueError(f"camera {name!r}: {problem}")
    # A copy: camera buffers are often read-only views, and torch must not alias them.
    t = torch.from_numpy(np.array(img, copy=True)) if isinstance(img, np.ndarray) else img
    if t.dtype == torch.uint8:
        t = t.permute(2, 0, 1).float() / 255.0
    else:
        t = (t.permute(2, 0, 1) if _float_is_hwc(tuple(t.shape)) else t).float()
    if t.shape[0] == 1:
        t = t.expand(3, -1, -1)
    return t


def fit(h: int, w: int, size: int) -> tuple[int, int, int, int]:
    """Where an h x w image lands in the size x size input: (rows, cols, top, left)."""
    ratio = max(w / size, h / size)
    rh, rw = int(h / ratio), int(w / ratio)
    return rh, rw, (size - rh) // 2, (size - rw) // 2


def resize_with_pad(img: torch.Tensor, size: int, antialias: bool = False) -> torch.Tensor:
    """float (C, H, W) or (N, C, H, W) in [0, 1] -> (..., C, size, size): aspect kept, bilinear,
    centred black padding. `antialias`: a downscale averages over the whole footprint of each
    output pixel (PIL's BILINEAR, openpi's resize) instead of sampling four neighbours (LeRobot's);
    `RobotIO.resize_antialias` says which one a checkpoint was trained with."""
    h, w = img.shape[-2:]
    if (h, w) == (size, size):
        return img
    rh, rw, top, left = fit(h, w, size)
    batch = img if img.ndim == 4 else img[None]
    out = F.interpolate(batch, size=(rh, rw), mode="bilinear", align_corners=False, antialias=antialias).clamp(0.0, 1.0)
    if img.ndim == 3:
        out = out[0]
    return F.pad(out, (left, size - rw - left, top, size - rh - top), value=0.0)


def to_model_range(img01: torch.Tensor, size: int, antialias: bool = False) -> torch.Tensor:
    """The per-image path's last step: [0, 1] image at any size -> (3, size, size) in [-1, 1]."""
    return resize_with_pad(img01, size, antialias) * 2.0 - 1.0


# uint8 -> float exactly as `image_to_float_chw` computes it on the CPU (float32(v) / 255), and
# that followed by `* 2 - 1`. The batched path looks values up in these instead of recomputing
# them so that every device gives the per-image path's bits: CUDA divides by a scalar through
# a multiply by its reciprocal, which can round differently.
_UNIT = torch.arange(256, dtype=torch.uint8).float() / 255.0
_SIGNED = _UNIT * 2.0 - 1.0
_LUTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def _lut(kind: str, device: torch.device) -> torch.Tensor:
    key = (kind, device)
    if key not in _LUTS:
        _LUTS[key] = (_UNIT if kind == "unit" else _SIGNED).to(device)
    return _LUTS[key]


def is_fast_frame(img: object) -> bool:
    """A frame the batched path takes: a 3-channel uint8 HWC numpy array (what cameras and the
    serve wire give); everything else takes the per-image path."""
    return isinstance(img, np.ndarray) and img.dtype == np.uint8 and img.ndim == 3 and img.shape[-1] == 3


@dataclass
class StagedImages:
    """A batch's camera frames, gathered but not yet converted.

    Slot b * views + v is observation b's camera v. `groups` holds the uint8 frames, one
    (n, H, W, 3) stack per frame size with the (n,) slots it fills; `ready` holds frames the
    per-image path already made into (3, size, size) model inputs; slots in neither are
    missing cameras (`present` False), which the model sees as -1 everywhere.
    """

    batch: int
    views: int
    size: int
    present: torch.Tensor  # (batch, views) bool
    groups: list[tuple[torch.Tensor, torch.Tensor]]
    ready: list[tuple[int, torch.Tensor]]
    antialias: bool = False  # how the groups' frames are resized (`resize_with_pad`)

    @property
    def device(self) -> torch.device:
        return self.present.device

    @property
    def dense(self) -> bool:
        """Every slot is one uint8 frame of a single size, in slot order (no scatter needed)."""
        return not self.ready and len(self.groups) == 1 and self.groups[0][1].shape[0] == self.batch * self.views

    def to(self, device: torch.device | str) -> StagedImages:
        """Copy to `device`; from pinned memory the copies are asynchronous (the frames are
        converted on the same stream, so nothing waits for them here)."""
        device = torch.device(device)

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=t.is_pinned())

        return StagedImages(self.batch, self.views, self.size, move(self.present),
                            [(move(s), move(f)) for s, f in self.groups], [(i, move(t)) for i, t in self.ready],
                            self.antialias)


def stage_images(per_obs: Sequence[Sequence[Any]], names: Sequence[str], size: int,
                 pin: bool = False, antialias: bool = False) -> StagedImages:
    """The first step of the device path (see `images_to_model`): uint8 HWC 3-channel frames
    are stacked by size (into page-locked memory with `pin`, so the copy to a GPU is one
    asynchronous DMA); the rest go through the per-image path here."""
    batch, views = len(per_obs), len(names)
    present = np.zeros((batch, views), dtype=bool)
    by_size: dict[tuple[int, int], tuple[list[int], list[np.ndarray]]] = {}
    ready: list[tuple[int, torch.Tensor]] = []
    for b, images in enumerate(per_obs):
        for v, img in enumerate(images):
            if img is None:
                continue
            present[b, v] = True
            slot = b * views + v
            if is_fast_frame(img):
                slots, frames = by_size.setdefault(img.shape[:2], ([], []))
                slots.append(slot)
                frames.append(img)
            else:
                ready.append((slot, to_model_range(image_to_float_chw(img, names[v]), size, antialias)))
    groups = []
    for (h, w), (slots, frames) in by_size.items():
        # One copy out of the camera (or ZeroMQ) buffers; torch then owns the memory.
        stack = torch.empty((len(frames), h, w, 3), dtype=torch.uint8, pin_memory=pin)
        np.stack(frames, out=stack.numpy())
        index = torch.tensor(slots, dtype=torch.int64)
        groups.append((index.pin_memory() if pin else index, stack))
    mask = torch.from_numpy(present)
    return StagedImages(batch, views, size, mask.pin_memory() if pin else mask, groups, ready, antialias)


def frames_to_model(frames: torch.Tensor, size: int, antialias: bool = False) -> torch.Tensor:
    """(n, H, W, 3) uint8 on any device -> (n, 3, size, size) float32 in [-1, 1] on it, equal
    to the per-image path frame by frame (bit for bit but where a GPU resizes: its bilinear
    kernel rounds its own way)."""
    n, h, w, _ = frames.shape
    if (h, w) == (size, size):
        # The per-image path adds no resize here: one lookup gives its final values, read in
        # CHW order so the result is already the model's layout.
        idx = frames.permute(0, 3, 1, 2).contiguous().view(-1).int()
        return torch.index_select(_lut("signed", frames.device), 0, idx).view(n, 3, size, size)
    # In HWC order, then a CHW view: the same channels-last strides the per-image path hands
    # to interpolate, so the same resize kernel runs. Its output keeps those strides; the
    # model's layout is contiguous CHW.
    unit = torch.index_select(_lut("unit", frames.device), 0, frames.reshape(-1).int())
    return to_model_range(unit.view(n, h, w, 3).permute(0, 3, 1, 2), size, antialias).contiguous()


def frame_into(img: np.ndarray, out: torch.Tensor, antialias: bool = False) -> None:
    """One uint8 HWC 3-channel frame -> its (3, size, size) slot `out` of a CPU batch, with the
    per-image path's operations in its order (so its bits), minus most of its temporaries: the
    arithmetic runs in place, and the padding is written as its final value (0 * 2 - 1)."""
    size = out.shape[-1]
    # A copy of the bytes (a quarter of what the float output costs): torch wraps no read-only
    # buffer, and camera and ZeroMQ frames often are.
    chw = torch.from_numpy(np.array(img, copy=True)).permute(2, 0, 1)
    h, w = chw.shape[-2:]
    if (h, w) == (size, size):
        out.copy_(chw)
        out.div_(255.0).mul_(2.0).sub_(1.0)
        return
    rh, rw, top, left = fit(h, w, size)
    # Channels-last strides (float() keeps them), as the per-image path hands them to interpolate.
    unit = chw.float().div_(255.0)
    inner = F.interpolate(unit[None], size=(rh, rw), mode="bilinear", align_corners=False,
                          antialias=antialias)[0].clamp_(0.0, 1.0)
    out.fill_(-1.0)
    dst = out[:, top:top + rh, left:left + rw]
    torch.mul(inner, 2.0, out=dst)
    dst.sub_(1.0)


def images_to_model(per_obs: Sequence[Sequence[Any]], names: Sequence[str], size: int,
                    device: torch.device, antialias: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """per_obs[b][v]: observation b's image for camera names[v], or None -> (B, V, 3, size,
    size) float32 images and the (B, V) bool mask of present cameras, on `device`. Missing
    cameras are -1 everywhere. Raises what the per-image path raises, naming the camera."""
    if device.type != "cpu":
        staged = stage_images(per_obs, names, size, pin=device.type == "cuda", antialias=antialias).to(device)
        return images_from_staged(staged), staged.present
    batch, views = len(per_obs), len(names)
    out = torch.empty(batch, views, 3, size, size)
    present = np.zeros((batch, views), dtype=bool)
    for b, images in enumerate(per_obs):
        for v, img in enumerate(images):
            if img is None:
                out[b, v].fill_(-1.0)
            elif is_fast_frame(img):
                frame_into(img, out[b, v], antialias)
            else:
                out[b, v] = to_model_range(image_to_float_chw(img, names[v]), size, antialias)
            present[b, v] = img is not None
    return out, torch.from_numpy(present)


def images_from_staged(staged: StagedImages) -> torch.Tensor:
    """Staged frames -> (batch, views, 3, size, size) float32 model inputs on their device."""
    b, v, s = staged.batch, staged.views, staged.size
    if staged.dense:
        return frames_to_model(staged.groups[0][1], s, staged.antialias).view(b, v, 3, s, s)
    out = torch.full((b * v, 3, s, s), -1.0, device=staged.device)
    for slots, frames in staged.groups:
        out.index_copy_(0, slots, frames_to_model(frames, s, staged.antialias))
    for slot, img in staged.ready:
        out[slot] = img
    return out.view(b, v, 3, s, s)


def discretize_state(state_norm: np.ndarray, bins: int = 256) -> np.ndarray:
    """Normalised state -> integer bins: [-1, 1) in 0..bins-1, 1 and above bins-1, and below -1
    the value -1. That last is not clipped to 0 because the references do not clip (LeRobot's
    policies/pi05/processor_pi05.py and openpi's models/tokenizer.py bin with the same edges and
    no clamp): they write "-1" for a state under its q01, about 1 % of the training frames per
    dimension, so checkpoints saw it."""
    edges = np.linspace(-1.0, 1.0, bins + 1)[:-1]
    return np.digitize(state_norm, bins=edges) - 1


def clean_task(task: str) -> str:
    """The instruction as the references write it into the prompt: stripped, `_` and newlines as spaces."""
    return task.strip().replace("_", " ").replace("\n", " ")


def format_prompt(task: str, state_bins: np.ndarray) -> str:
    return f"Task: {clean_task(task)}, State: {' '.join(str(int(b)) for b in state_bins)};\nAction: "


def stateless_prompt(task: str) -> tuple[str, str]:
    """The prompt of a policy trained without its state in the prompt (openpi's
    `discrete_state_input=False`, e.g. pi05_libero): the bare instruction, then the answer marker
    "\\n" as pieces to tokenise apart, as openpi's PaligemmaTokenizer does (`encode(task) +
    encode("\\n")`)."""
    return clean_task(task), "\n"
