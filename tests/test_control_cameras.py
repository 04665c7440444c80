"""Camera sources: OpenCV reconnect with backoff, video files, the synthetic source."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from phyai_edge.control.cameras import OpenCVCamera, SyntheticCamera
from phyai_edge.control.config import CameraConfig


class FlakyCapture:
    """Opens on the 2nd try, delivers `frames` frames, then its reads fail (unplugged)."""

    opens = 0

    def __init__(self, frames: int) -> None:
        FlakyCapture.opens += 1
        self.ok = FlakyCapture.opens >= 2
        self.left = frames

    def isOpened(self) -> bool:  # noqa: N802 - OpenCV's name
        return self.ok

    def read(self):
        time.sleep(0.002)
        if self.left <= 0:
            return False, None
        self.left -= 1
        return True, np.zeros((4, 4, 3), np.uint8)

    def set(self, *args) -> bool:
        return True

    def release(self) -> None:
        pass


def test_opencv_camera_reconnects_with_backoff():
    FlakyCapture.opens = 0
    cam = OpenCVCamera(CameraConfig("top", source="v4l2"), open_capture=lambda cfg: FlakyCapture(5), backoff_s=(0.01, 0.04))
    cam.start()
    try:
        end = time.monotonic() + 5
        while FlakyCapture.opens < 4 and time.monotonic() < end:
            time.sleep(0.01)
        assert FlakyCapture.opens >= 4, "did not keep reconnecting"
        fr = cam.latest()
        assert fr is not None and fr.bgr and fr.seq >= 5
        # Seq keeps growing across reconnects: each reconnect delivered new frames.
        seq = fr.seq
        end = time.monotonic() + 5
        while cam.latest().seq == seq and time.monotonic() < end:
            time.sleep(0.01)
        assert cam.latest().seq > seq
        assert cam.reconnects >= 3
    finally:
        cam.stop()


def test_video_file_source_loops_at_its_fps(tmp_path):
    cv2 = pytest.importorskip("cv2")
    path = str(tmp_path / "clip.avi")
    w = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 25, (32, 24))
    for i in range(5):
        w.write(np.full((24, 32, 3), i * 40, np.uint8))
    w.release()
    cam = OpenCVCamera(CameraConfig("top", source="file", path=path, fps=50.0))
    got = threading.Event()
    cam.start()
    try:
        end = time.monotonic() + 5
        while time.monotonic() < end and not got.is_set():
            fr = cam.latest()
            if fr is not None and fr.seq >= 12:  # more frames than the file has: it looped
                got.set()
            time.sleep(0.01)
        assert got.is_set(), "file did not loop"
        fr = cam.latest()
        assert fr.image.shape == (24, 32, 3) and time.monotonic() - fr.capture_s < 0.5
    finally:
        cam.stop()


def test_synthetic_camera_ticks_on_its_fps_grid_and_can_die():
    cam = SyntheticCamera(CameraConfig("top", width=8, height=6, fps=100.0))
    a = cam.latest()
    assert a.image.shape == (6, 8, 3) and a.image.dtype == np.uint8 and not a.image.flags.writeable
    time.sleep(0.03)
    b = cam.latest()
    assert b.seq > a.seq and b.capture_s > a.capture_s
    cam.alive = False
    time.sleep(0.03)
    assert cam.latest() is b
