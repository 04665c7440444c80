"""cameras.NAME.crop / rotate / flip: what the policy sees of a frame (control/geometry.py), in the
worker, the warm-up and the recorder alike."""

from __future__ import annotations

import numpy as np
import pytest

from phyai_edge.control.config import ConfigError, parse_config
from phyai_edge.control.daemon import Daemon, warmup_frames
from phyai_edge.control.fakes import FakePolicy, run_ticks, test_config
from phyai_edge.control.geometry import FrameGeometry
from phyai_edge.control.recorder import Recorder
from phyai_edge.control.worker import as_policy_frame


def _image(h: int = 4, w: int = 6) -> np.ndarray:
    """Every pixel different, channels too: a transform that moves one pixel wrongly shows."""
    return np.arange(h * w * 3, dtype=np.uint8).reshape(h, w, 3)


@pytest.mark.parametrize("rotate, expected", [
    (90, lambda im: np.stack([im[::-1, c] for c in range(im.shape[1])])),  # the left column becomes the top row
    (180, lambda im: im[::-1, ::-1]),
    (270, lambda im: np.stack([im[:, c] for c in range(im.shape[1] - 1, -1, -1)])),
])
def test_rotations_are_clockwise_as_the_image_is_viewed(rotate, expected):
    im = _image()
    out = FrameGeometry((4, 6), rotate=rotate).apply(im)
    np.testing.assert_array_equal(out, expected(im))
    # 90 clockwise: what was the bottom-left pixel is now the top-left one
    if rotate == 90:
        np.testing.assert_array_equal(out[0, 0], im[-1, 0])


def test_crop_then_rotate_then_flip_without_copying_a_pixel():
    im = _image(8, 10)
    g = FrameGeometry((8, 10), crop=(2, 1, 5, 3), rotate=90, flip="horizontal")
    out = g.apply(im)
    cropped = im[1:4, 2:7]
    np.testing.assert_array_equal(out, np.rot90(cropped, k=-1)[:, ::-1])
    assert out.shape[:2] == g.output_size(8, 10) == (5, 3)
    assert np.shares_memory(out, im)
    np.testing.assert_array_equal(FrameGeometry((8, 10), flip="vertical").apply(im), im[::-1])


@pytest.mark.parametrize("size", [(8, 10), (16, 20), (480, 640), (7, 9), (3, 4)])
def test_a_frame_of_another_size_is_cropped_at_the_same_fractions(size):
    g = FrameGeometry((8, 10), crop=(2, 4, 6, 4), rotate=270)
    im = np.zeros((*size, 3), np.uint8)
    out = g.apply(im)
    assert out.shape[:2] == g.output_size(*size) and out.size > 0
    if size == (16, 20):  # exactly twice the configured size: exactly twice the rectangle
        assert out.shape[:2] == (12, 8)


def test_the_policy_gets_its_own_contiguous_rgb_copy_once():
    bgr = _image()
    bgr.setflags(write=False)  # frames are shared read-only views
    g = FrameGeometry((4, 6), rotate=90)
    out = as_policy_frame(bgr, True, g)
    assert out.flags.c_contiguous and out.flags.writeable and not np.shares_memory(out, bgr)
    np.testing.assert_array_equal(out, g.apply(bgr)[..., ::-1])
    mine = _image()  # writeable and contiguous, RGB, no geometry: nothing to copy
    assert as_policy_frame(mine, False, None) is mine


@pytest.mark.parametrize("camera, key", [
    ({"crop": [0, 0, 300, 10]}, "cameras.top.crop"),
    ({"width": 64, "height": 48, "crop": [60, 0, 8, 8]}, "cameras.top.crop"),
    ({"crop": [0, 0, 10]}, "cameras.top.crop"),
    ({"crop": [0, 0, 10.5, 10]}, "cameras.top.crop"),
    ({"rotate": 45}, "cameras.top.rotate"),
    ({"rotate": True}, "cameras.top.rotate"),
    ({"flip": "x"}, "cameras.top.flip"),
])
def test_a_geometry_mistake_names_its_key(camera, key):
    with pytest.raises(ConfigError) as err:
        parse_config({"cameras": {"top": camera}})
    assert str(err.value).startswith(f"{key}: "), err.value


def test_a_camera_without_geometry_is_used_as_it_comes():
    cam = parse_config({"cameras": {"top": {}}}).cameras["top"]
    assert cam.geometry is None
    cam = parse_config({"cameras": {"top": {"rotate": 0, "flip": "", "crop": [0, 0, 224, 224]}}}).cameras["top"]
    assert cam.geometry is not None  # a whole-frame crop is still a crop (of a frame delivered at another size)


class SeesFrames(FakePolicy):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.seen: list[np.ndarray] = []

    def infer(self, observations, rtc=None, noise=None):
        self.seen.append(observations[0].images["top"])
        return super().infer(observations, rtc, noise)


def test_the_daemon_s_policy_warm_up_and_recording_see_the_frame_as_configured(tmp_path):
    cfg = test_config(cameras={"top": {"source": "synthetic", "width": 64, "height": 48, "crop": [8, 4, 32, 24],
                                       "rotate": 90}}, model={"worker": "thread", "warmup": 1})
    assert warmup_frames(cfg, ["top"]) == {"top": (32, 24)}
    policy = SeesFrames(action_dim=6, state_dim=6, latency_s=0.005)
    d = Daemon(cfg, policy=policy, realtime=False, status_line=False, record_dir=str(tmp_path))
    run_ticks(d, 60, timeout_s=30)
    warm, live = policy.seen[0], policy.seen[-1]
    assert warm.shape == live.shape == (32, 24, 3)
    sources = d.cameras["top"]._frames  # the synthetic camera's precomputed frames
    g = cfg.cameras["top"].geometry
    assert any(np.array_equal(live, g.apply(f)) for f in sources)
    recorded = sorted(tmp_path.glob("obs_*.npz"))
    assert recorded
    with np.load(recorded[0]) as z:
        image = z["image.top"]
    assert image.shape == (32, 24, 3) and any(np.array_equal(image, g.apply(f)) for f in sources)


def test_the_recorder_writes_rgb_frames_as_the_policy_saw_them(tmp_path):
    rec = Recorder(tmp_path, {})
    bgr = _image(8, 10)
    g = FrameGeometry((8, 10), crop=(1, 1, 4, 6), rotate=180, flip="horizontal")
    rec.add({"job_id": 1, "images": {"top": bgr, "wrist": None}, "bgr": {"top": True}, "geometry": {"top": g},
             "state": np.zeros(2, np.float32)})
    rec.close()
    with np.load(tmp_path / "obs_000001.npz") as z:
        np.testing.assert_array_equal(z["image.top"], g.apply(bgr)[..., ::-1])
        assert "image.wrist" not in z
