"""Observation -> model inputs: images, state, prompt; and postprocessing back to robot units."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from phyai_edge.adapters.base import Observation
from phyai_edge.adapters.normalization import NormStats
from phyai_edge.adapters.pi05.preprocess import (
    discretize_state,
    image_to_float_chw,
    resize_with_pad,
)

S = 224


# -- images ------------------------------------------------------------------------------
def test_landscape_uint8_is_letterboxed(tiny_adapter):
    """480x640 uint8 HWC -> 224x224: scaled to 168x224, 28 pad rows top and bottom at -1."""
    img = np.full((480, 640, 3), 200, np.uint8)
    img[:, :, 1] = 50
    obs = Observation({"top": img}, np.zeros(14, np.float32), "go")
    x = tiny_adapter.preprocess([obs]).tensors["images"]
    assert x.shape == (1, 3, 3, S, S) and x.dtype == torch.float32
    v = x[0, 0]
    assert torch.equal(v[:, :28], torch.full((3, 28, S), -1.0))
    assert torch.equal(v[:, 196:], torch.full((3, 28, S), -1.0))
    # a constant image stays constant under bilinear resizing: 200/255*2-1 and 50/255*2-1
    assert torch.allclose(v[0, 28:196], torch.tensor(200 / 255 * 2 - 1), atol=1e-6)
    assert torch.allclose(v[1, 28:196], torch.tensor(50 / 255 * 2 - 1), atol=1e-6)


def test_portrait_pads_columns_and_odd_remainder():
    img = torch.rand(3, 300, 100)
    out = resize_with_pad(img, S)
    rw = int(100 / (300 / S))  # 74
    left = (S - rw) // 2
    assert out.shape == (3, S, S)
    assert torch.equal(out[:, :, :left], torch.zeros(3, S, left))
    assert torch.equal(out[:, :, left + rw :], torch.zeros(3, S, S - rw - left))
    assert (out[:, :, left : left + rw] > 0).float().mean() > 0.99
    assert out.min() >= 0 and out.max() <= 1


def test_square_image_passes_through():
    img = torch.rand(3, S, S)
    assert torch.equal(resize_with_pad(img, S), img)


def test_float_chw_and_hwc_and_uint8_agree():
    rng = np.random.default_rng(0)
    u8 = rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)
    f_chw = (u8.astype(np.float32) / 255).transpose(2, 0, 1)
    f_hwc = u8.astype(np.float32) / 255
    a = image_to_float_chw(u8, "c")
    assert a.shape == (3, 60, 80)
    assert torch.allclose(a, torch.from_numpy(f_chw), atol=1e-7)
    assert torch.allclose(image_to_float_chw(f_chw, "c"), a, atol=1e-7)
    assert torch.allclose(image_to_float_chw(f_hwc, "c"), a, atol=1e-7)
    assert torch.allclose(image_to_float_chw(torch.from_numpy(f_chw), "c"), a, atol=1e-7)


def test_grayscale_is_replicated():
    g = np.arange(12, dtype=np.uint8).reshape(3, 4, 1) * 20
    out = image_to_float_chw(g, "gray")
    assert out.shape == (3, 3, 4)
    assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])
    assert torch.allclose(out[0], torch.from_numpy(g[..., 0] / 255.0).float())
    assert image_to_float_chw(np.full((1, 5, 5), 0.5, np.float32), "gray").shape == (3, 5, 5)


@pytest.mark.parametrize(
    ("img", "match"),
    [
        (np.zeros((10, 10), np.uint8), "3-D"),
        (np.zeros((10, 10, 4), np.uint8), "1 or 3 channels"),
        (np.zeros((10, 10, 3), np.int32), "unsupported image dtype"),
        (np.zeros((10, 10, 3), np.uint16), "unsupported image dtype"),
        (np.zeros((5, 10, 10), np.float32), "1 or 3 channels"),
        (np.full((3, 10, 10), 255.0, np.float32), r"\[0, 1\]"),
        (np.full((3, 10, 10), -0.5, np.float32), r"\[0, 1\]"),
        (np.full((3, 10, 10), np.nan, np.float32), "NaN"),
    ],
)
def test_bad_images_name_the_camera(tiny_adapter, img, match):
    obs = Observation({"left_wrist": img, "top": np.zeros((10, 10, 3), np.uint8)}, np.zeros(14), "go")
    with pytest.raises(ValueError, match=match) as err:
        tiny_adapter.preprocess([obs])
    assert "'left_wrist'" in str(err.value)


@pytest.mark.parametrize("how", ["none", "absent"])
def test_missing_camera_is_masked(tiny_adapter, make_obs, how):
    obs = make_obs(tiny_adapter)
    if how == "none":
        obs.images = {**obs.images, "right_wrist": None}
    else:
        obs.images = {k: v for k, v in obs.images.items() if k != "right_wrist"}
    t = tiny_adapter.preprocess([obs]).tensors
    assert t["image_mask"].tolist() == [[True, True, False]]
    assert torch.equal(t["images"][0, 2], torch.full((3, S, S), -1.0))
    assert t["images"][0, 0].min() >= -1 and t["images"][0, 0].max() <= 1


def test_all_cameras_missing_is_an_error(tiny_adapter):
    obs = Observation({"top": None}, np.zeros(14), "go")
    with pytest.raises(ValueError, match="every camera is missing"):
        tiny_adapter.preprocess([obs])


def test_unknown_camera_is_an_error(tiny_adapter, make_obs):
    obs = make_obs(tiny_adapter)
    obs.images = {**obs.images, "wrist_cam": np.zeros((8, 8, 3), np.uint8)}
    with pytest.raises(ValueError, match="unknown cameras \\['wrist_cam'\\]"):
        tiny_adapter.preprocess([obs])


def test_empty_batch_is_an_error(tiny_adapter):
    with pytest.raises(ValueError, match="at least one"):
        tiny_adapter.preprocess([])


# -- state and prompt --------------------------------------------------------------------
def _prompt_of(adapter, obs, monkeypatch):
    seen = []
    real = adapter.tokenizer

    class Rec:
        vocab_size = real.vocab_size

        def __call__(self, text, max_len):
            seen.append(text)
            return real(text, max_len)

    monkeypatch.setattr(adapter, "tokenizer", Rec())
    adapter.preprocess([obs])
    return seen[0]


def _expected_bins(norm):
    """Bin k covers [-1 + k/128, -1 + (k+1)/128); 1 and above give 255, and anything below -1
    gives -1: the reference digitises the normalised state unclipped (LeRobot
    policies/pi05/processor_pi05.py: np.digitize(...) - 1; openpi models/tokenizer.py, the
    same), so a state under its q01 reads "-1" in the prompt the checkpoint was trained on."""
    x = np.asarray(norm, np.float64)
    return np.where(x < -1.0, -1, np.minimum(np.floor((x + 1.0) * 128.0), 255)).astype(int)


def test_quantile_state_bins_and_exact_prompt(tiny_adapter, monkeypatch):
    io = tiny_adapter.io
    io.state_dim = 4
    tiny_adapter.state_dim = 4
    io.state_stats = NormStats("quantile", q01=[0, 0, -2, 10], q99=[2, 4, 2, 20])
    state = np.array([1.0, -100.0, 2.5, 15.5], np.float32)  # normalised: 0, below -1, above 1, 0.1
    obs = Observation({"top": np.zeros((8, 8, 3), np.uint8)}, state, "  pick_up the\ncube ")
    prompt = _prompt_of(tiny_adapter, obs, monkeypatch)
    norm = 2 * (state - np.array([0, 0, -2, 10])) / np.array([2, 4, 4, 10]) - 1
    bins = _expected_bins(norm)
    assert bins.tolist() == [128, -1, 255, 140]
    assert prompt == "Task: pick up the cube, State: 128 -1 255 140;\nAction: "


def test_mean_std_state(tiny_adapter, monkeypatch):
    io = tiny_adapter.io
    io.state_dim = tiny_adapter.state_dim = 3
    io.state_stats = NormStats("mean_std", mean=[1, 2, 3], std=[2, 0.5, 1])
    state = np.array([2.0, 1.75, 3.0], np.float32)  # z = 0.5, -0.5, 0
    prompt = _prompt_of(tiny_adapter, Observation({"top": np.zeros((4, 4, 3), np.uint8)}, state, "go"), monkeypatch)
    assert prompt == f"Task: go, State: {' '.join(map(str, _expected_bins([0.5, -0.5, 0.0])))};\nAction: "
    assert prompt == "Task: go, State: 192 64 128;\nAction: "


def test_discretize_matches_the_reference_bins():
    """Only the top saturates (at 255); below -1 is the reference's -1, not bin 0."""
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(-1, 1, 2000), [-1.0, 0.0, 0.999, 1.0, -1.0001, 1.0001, -50, 50]])
    x = x.astype(np.float32)
    got = discretize_state(x)
    assert got.min() == -1 and got.max() == 255
    np.testing.assert_array_equal(got, _expected_bins(x))
    assert discretize_state(np.array([-3.0, -1.0, 3.0])).tolist() == [-1, 0, 255]
    assert discretize_state(np.array([-np.inf, np.inf])).tolist() == [-1, 255]


def test_pad_state_in_prompt(tiny_adapter, make_obs, monkeypatch):
    """With the flag, the state is written padded to the action width (32 values, pads at bin
    128); without it (LeRobot, openpi PI0.5) only the robot's values."""
    obs = make_obs(tiny_adapter, prompt="stack")
    plain = _prompt_of(tiny_adapter, obs, monkeypatch)
    tiny_adapter.io.pad_state_in_prompt = True
    padded = _prompt_of(tiny_adapter, obs, monkeypatch)
    lr_vals = plain.split("State: ")[1].split(";")[0].split()
    op_vals = padded.split("State: ")[1].split(";")[0].split()
    assert len(lr_vals) == 14 and len(op_vals) == 32
    assert op_vals[:14] == lr_vals and op_vals[14:] == ["128"] * 18


@pytest.mark.parametrize(("state", "match"), [(np.zeros(13), "state has 13 values"),
                                              (np.r_[np.zeros(13), np.nan], "NaN"),
                                              (np.r_[np.zeros(13), np.inf], "NaN or Inf")])
def test_bad_state(tiny_adapter, state, match):
    obs = Observation({"top": np.zeros((4, 4, 3), np.uint8)}, state, "go")
    with pytest.raises(ValueError, match=match):
        tiny_adapter.preprocess([obs])


def test_default_prompt_and_empty_prompt(tiny_adapter, monkeypatch):
    obs = Observation({"top": np.zeros((4, 4, 3), np.uint8)}, np.zeros(14), "")
    assert _prompt_of(tiny_adapter, obs, monkeypatch).startswith("Task: pick up the cube, State: ")
    tiny_adapter.io.default_prompt = ""
    with pytest.raises(ValueError, match="empty prompt"):
        tiny_adapter.preprocess([obs])


def test_long_prompt_is_truncated_with_one_warning(tiny_adapter, caplog):
    obs = Observation({"top": np.zeros((4, 4, 3), np.uint8)}, np.zeros(14), "pick up the red cube " * 40)
    with caplog.at_level(logging.WARNING):
        t = tiny_adapter.preprocess([obs, obs]).tensors
    assert t["tokens"].shape == (2, tiny_adapter.cfg.max_token_len)
    assert t["token_mask"].all()
    assert sum("truncated" in r.message for r in caplog.records) == 1


def test_batch_layout(tiny_adapter, make_obs):
    t = tiny_adapter.preprocess([make_obs(tiny_adapter, seed=0), make_obs(tiny_adapter, seed=1, prompt="x")]).tensors
    assert t["images"].shape == (2, 3, 3, S, S)
    assert t["tokens"].dtype == torch.int64 and t["token_mask"].dtype == torch.bool
    n0, n1 = t["token_mask"].sum(1).tolist()
    assert n0 > n1  # different prompt lengths, each right-padded
    assert t["token_mask"][1, :n1].all() and not t["token_mask"][1, n1:].any()


# -- normalisation and postprocess -----------------------------------------------------
def test_norm_stats_formulas():
    q = NormStats("quantile", q01=[-2, 0], q99=[2, 10])
    np.testing.assert_allclose(q.normalize(np.array([[-2, 0], [2, 10], [0, 5]])), [[-1, -1], [1, 1], [0, 0]], atol=1e-6)
    x = np.random.default_rng(0).normal(size=(5, 2)).astype(np.float32)
    np.testing.assert_allclose(q.unnormalize(q.normalize(x)), x, atol=1e-5)
    m = NormStats("mean_std", mean=[1, -1], std=[2, 4])
    np.testing.assert_allclose(m.normalize(np.array([3, 3])), [1, 1], atol=1e-6)
    np.testing.assert_allclose(m.unnormalize(m.normalize(x)), x, atol=1e-5)
    with pytest.raises(ValueError, match="last dimension 2"):
        q.normalize(np.zeros(3))
    with pytest.raises(ValueError, match="q01 and q99"):
        NormStats("quantile", q01=[0])
    with pytest.raises(ValueError, match="mean and std"):
        NormStats("mean_std", mean=[0])
    assert NormStats.from_json(q.to_json()).to_json() == q.to_json()


def test_openpi_statistics_use_openpi_epsilon():
    """openpi (transforms.Normalize / Unnormalize) adds 1e-6 to every quantile spread, both ways;
    LeRobot (NormalizerProcessorStep) divides by the spread, by 1e-8 only where it is 0. The prompt
    bins follow: a joint that never moved in openpi's data, reported 2e-7 off, reads 53 there."""
    q01, q99 = np.array([0.25, -1.0, 0.0]), np.array([0.25, 1.0, 1e-4])
    state = np.array([0.25 + 2e-7, 0.3, 5e-5], np.float32)
    openpi = NormStats("quantile", q01=q01, q99=q99, convention="openpi")
    want = (state - q01) / (q99 - q01 + 1e-6) * 2.0 - 1.0  # openpi's formula, in float64
    np.testing.assert_allclose(openpi.normalize(state), want, rtol=1e-6, atol=1e-6)
    assert discretize_state(openpi.normalize(state)).tolist() == _expected_bins(want).tolist() == [53, 166, 126]
    lerobot = NormStats("quantile", q01=q01, q99=q99)
    assert discretize_state(lerobot.normalize(state)).tolist() == [255, 166, 128]
    a = np.array([-1.0, 0.5, 1.0], np.float32)
    np.testing.assert_allclose(openpi.unnormalize(a), (a + 1.0) / 2.0 * (q99 - q01 + 1e-6) + q01, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(openpi.unnormalize(openpi.normalize(state)), state, atol=1e-6)
    # kept through a native folder's JSON; LeRobot's JSON stays as it was
    assert NormStats.from_json(openpi.to_json()).convention == "openpi"
    assert "convention" not in lerobot.to_json()
    with pytest.raises(ValueError, match="convention 'jax'"):
        NormStats("quantile", q01=q01, q99=q99, convention="jax")


def test_lerobot_mean_std_unnormalize_adds_no_epsilon():
    """LeRobot un-normalises MEAN_STD as `x * std + mean` (the epsilon only divides): bit for bit,
    which an epsilon of 1e-8 still changes in float32 for a small std or a zero mean."""
    m = NormStats("mean_std", mean=[0.0, 0.0, 1.0], std=[0.01, 0.0, 3.0])
    x = np.array([0.7, -1.3, 0.2], np.float32)
    assert np.array_equal(m.unnormalize(x), x * m.std + m.mean)
    assert m.unnormalize(x)[1] == 0.0  # a dim that never moved: its mean, exactly


def test_postprocess_unnormalizes_and_drops_padding(tiny_adapter):
    io = tiny_adapter.io
    io.action_stats = NormStats("quantile", q01=np.arange(14) - 5.0, q99=np.arange(14) + 5.0)
    chunk = torch.rand(2, 50, 32) * 2 - 1
    out = tiny_adapter.postprocess(chunk)
    assert out.shape == (2, 50, 14) and out.dtype == np.float32
    want = (chunk[..., :14].numpy() + 1) / 2 * 10 + (np.arange(14) - 5.0)
    np.testing.assert_allclose(out, want, atol=1e-5)
    back = tiny_adapter.normalize_actions(out)
    assert back.shape == (2, 50, 32) and torch.equal(back[..., 14:], torch.zeros(2, 50, 18))
    assert torch.allclose(back[..., :14], chunk[..., :14], atol=1e-5)


def _textured(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A camera-like frame with fine detail (stripes of one to three pixels plus noise): what
    aliasing shows on when a 640 x 480 frame is shrunk to 224 x 168."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = 128 + 90 * np.sin(xx * 2.1) * np.cos(yy * 1.3)
    img = base[..., None] + rng.normal(0, 20, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def test_antialiased_resize_is_what_openpi_feeds_its_checkpoints():
    """openpi resizes with PIL's BILINEAR (antialiased on a downscale) and hands the model the
    uint8 result. `resize_antialias` reproduces it to a level or two; the plain bilinear resize
    (LeRobot's) is far from it on a detailed frame, which is why the choice follows the checkpoint."""
    Image = pytest.importorskip("PIL.Image", reason="Pillow (the test extra's matplotlib brings it) is openpi's resize")

    frame = _textured(480, 640)
    rh, rw, top, left = 168, 224, 28, 0
    pil = np.asarray(Image.fromarray(frame).resize((rw, rh), resample=Image.BILINEAR)).astype(np.float32)
    chw = image_to_float_chw(frame, "top")
    for antialias, bound in ((True, 2.0), (False, None)):
        ours = resize_with_pad(chw, S, antialias)[:, top:top + rh, left:left + rw].permute(1, 2, 0).numpy() * 255
        diff = np.abs(ours - pil)
        if bound is not None:
            assert diff.max() <= bound, diff.max()
        else:
            assert diff.max() > 10 * 2.0, diff.max()  # aliasing: the reason the flag exists
