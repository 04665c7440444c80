"""A camera's crop, rotation and mirror, as the policy was trained to see it.

A robot's camera is rarely mounted as the one that recorded the training data: a wrist camera
upside down, a scene camera that sees more than the trained field of view. `cameras.NAME.crop`,
`rotate` and `flip` fix that in the daemon, applied in that order. They run in the inference
worker, off the clock (the clock thread only hands the newest frame over), and the recorder
applies them too, so a recording holds what the model saw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROTATIONS = (0, 90, 180, 270)  # degrees, clockwise as the image is viewed
FLIPS = ("", "horizontal", "vertical")  # horizontal: left and right swap


@dataclass(frozen=True)
class FrameGeometry:
    """`crop` is (x, y, width, height) in the pixels of a `frame_size` (height, width) frame, the
    camera's configured size; a frame delivered at another size is cropped at the same fraction
    of its width and height, so the field of view stays the one configured."""

    frame_size: tuple[int, int]
    crop: tuple[int, int, int, int] | None = None
    rotate: int = 0
    flip: str = ""

    def __post_init__(self) -> None:
        if self.rotate not in ROTATIONS:
            raise ValueError(f"rotate: expected one of {', '.join(map(str, ROTATIONS))}, got {self.rotate}")
        if self.flip not in FLIPS:
            raise ValueError(f"flip: expected \"horizontal\", \"vertical\" or \"\", got {self.flip!r}")
        if self.crop is not None:
            x, y, w, h = self.crop
            fh, fw = self.frame_size
            if min(x, y) < 0 or w <= 0 or h <= 0 or x + w > fw or y + h > fh:
                raise ValueError(f"crop: ({x}, {y}, {w}, {h}) is not inside the {fw}x{fh} frame "
                                 "(x, y, width, height)")

    @property
    def identity(self) -> bool:
        return self.crop is None and self.rotate == 0 and not self.flip

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of what `apply` makes of a height x width frame."""
        if self.crop is not None:
            y0, y1, x0, x1 = self._crop_bounds(height, width)
            height, width = y1 - y0, x1 - x0
        return (width, height) if self.rotate in (90, 270) else (height, width)

    def apply(self, image: np.ndarray) -> np.ndarray:
        """The frame as the policy should see it: a view where numpy allows (no pixels copied);
        callers that need contiguous memory copy once, after any colour conversion."""
        if self.crop is not None:
            y0, y1, x0, x1 = self._crop_bounds(image.shape[0], image.shape[1])
            image = image[y0:y1, x0:x1]
        if self.rotate:
            image = np.rot90(image, k=-self.rotate // 90, axes=(0, 1))  # k < 0: clockwise
        if self.flip == "horizontal":
            image = image[:, ::-1]
        elif self.flip == "vertical":
            image = image[::-1]
        return image

    def _crop_bounds(self, height: int, width: int) -> tuple[int, int, int, int]:
        assert self.crop is not None
        x, y, w, h = self.crop
        fh, fw = self.frame_size
        if (height, width) == (fh, fw):
            return y, y + h, x, x + w
        sy, sx = height / fh, width / fw
        y0, x0 = min(round(y * sy), height - 1), min(round(x * sx), width - 1)
        return y0, max(y0 + 1, min(height, round((y + h) * sy))), x0, max(x0 + 1, min(width, round((x + w) * sx)))
