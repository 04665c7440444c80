"""`robot_space = "aloha"`: openpi's ALOHA policies were trained in openpi's own joint space
(`AlohaInputs` / `AlohaOutputs` with `adapt_to_pi`), robots and gym-aloha report the standard
one. The conversion's numbers are checked against values worked out by hand from openpi's
definitions (the Aloha runtime's gripper ranges, Interbotix's linkage), and its place in the
adapter against openpi's transform order: state converted before normalising and before the
relative offsets, the chunk converted back after them, an RTC prefix the other way first."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch
from helpers.ckpt import write_openpi

from phyai_edge.adapters import load_adapter
from phyai_edge.adapters.base import Observation
from phyai_edge.adapters.checkpoint import CheckpointError
from phyai_edge.adapters.normalization import NormStats
from phyai_edge.adapters.pi05 import builtin_adapter, load_bundle_adapter, save_bundle_checkpoint
from phyai_edge.adapters.pi05.loaders import NATIVE_MANIFEST, load_pi05, save_native
from phyai_edge.adapters.pi05.robot_space import AlohaSpace, check_robot_space

FLIPPED = [1, 2, 8, 9]  # each arm's shoulder and elbow
GRIPPERS = [6, 13]
ALOHA_MASK = (True,) * 6 + (False,) + (True,) * 6 + (False,)


def _servo(finger_m: float) -> float:
    """The servo angle for a finger position, by the law of cosines on Interbotix's linkage
    (horn 0.022 m, link 0.036 m), normalised over 0.5476 .. 1.6296 rad."""
    r, link = 0.022, 0.036
    angle = math.asin((r * r + finger_m * finger_m - link * link) / (2 * r * finger_m))
    return (angle - 0.5476) / (1.6296 - 0.5476)


def test_the_state_conversion_by_hand():
    space = AlohaSpace()
    state = np.arange(1, 15, dtype=np.float32) / 10
    state[GRIPPERS] = [1.0, 0.0]  # open (0.058 m), closed (0.01844 m)
    got = space.state_to_model(state)
    want = state.astype(np.float64).copy()
    want[FLIPPED] *= -1
    # fully open: the linkage is at a right angle (0.022^2 + 0.058^2 - 0.036^2 = 2 * 0.022 * 0.058)
    want[6] = (math.pi / 2 - 0.5476) / 1.082
    want[13] = _servo(0.01844)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert got.dtype == np.float32 and abs(want[13] - (-1.0801)) < 1e-3
    assert abs(_servo(0.01844 + 0.5 * 0.03956) - space.state_to_model(np.full(14, 0.5, np.float32))[6]) < 1e-6


def test_the_action_conversion_by_hand_and_its_inverse():
    space = AlohaSpace()
    model = np.random.default_rng(0).uniform(-1, 1, (2, 5, 14)).astype(np.float32)
    robot = space.actions_from_model(model)
    want = model.astype(np.float64).copy()
    want[..., FLIPPED] *= -1
    # the policy's servo radians less 0.5476 -> the puppet joint normalised over -0.6213 .. 1.4910 rad
    want[..., GRIPPERS] = (model[..., GRIPPERS] + 0.5476 + 0.6213) / 2.1123
    np.testing.assert_allclose(robot, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(space.actions_to_model(robot), model, rtol=0, atol=1e-6)


def test_a_gripper_state_no_aloha_reports_is_refused():
    with pytest.raises(ValueError, match="robot_space 'aloha': gripper state -1 is outside"):
        AlohaSpace().state_to_model(np.array([0.0] * 6 + [-1.0] + [0.0] * 6 + [0.5], np.float32))


@pytest.fixture
def pair():
    """The tiny adapter (14 state and action values, as ALOHA) with non-trivial statistics, and
    the same one in robot_space aloha."""
    def make(space: str | None):
        a = load_adapter("pi05", {"robot_space": space} if space else None, preset_name="tiny")
        rng = np.random.default_rng(3)
        q01 = rng.uniform(-3, 0, 14).astype(np.float32)
        a.io.state_stats = NormStats("quantile", q01=q01, q99=q01 + rng.uniform(0.5, 4, 14).astype(np.float32))
        q01 = rng.uniform(-2, 0, 14).astype(np.float32)
        a.io.action_stats = NormStats("quantile", q01=q01, q99=q01 + rng.uniform(0.5, 3, 14).astype(np.float32))
        return a
    return make(None), make("aloha")


def _obs(seed: int, prompt: str = "fold the towel") -> Observation:
    rng = np.random.default_rng(seed)
    state = rng.uniform(-1, 1, 14).astype(np.float32)
    state[GRIPPERS] = rng.uniform(0, 1, 2)
    return Observation({"top": rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)}, state, prompt)


@pytest.mark.parametrize("relative", [False, True])
def test_the_adapter_runs_openpis_transform_order(pair, relative: bool):
    plain, aloha = pair
    if relative:
        plain.io.relative_action_mask = aloha.io.relative_action_mask = ALOHA_MASK
    space = AlohaSpace()
    obs = [_obs(1), _obs(2)]
    as_model = [Observation(o.images, space.state_to_model(o.state), o.prompt) for o in obs]
    # the prompt writes the converted state's bins
    np.testing.assert_array_equal(aloha.prompt_tokens(obs)[0], plain.prompt_tokens(as_model)[0])
    assert not np.array_equal(plain.prompt_tokens(obs)[0], plain.prompt_tokens(as_model)[0])
    # the chunk: offsets added in the policy's space, then converted back
    chunk = torch.from_numpy(np.random.default_rng(5).standard_normal((2, plain.chunk_size, 32)).astype(np.float32))
    got = aloha.postprocess(chunk, aloha.preprocess(obs))
    want = space.actions_from_model(plain.postprocess(chunk, plain.preprocess(as_model)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # an RTC prefix in robot units goes the other way, against the new observations' states
    states = aloha.preprocess(obs).extras["states"]
    np.testing.assert_array_equal(states, np.stack([o.state for o in obs]))  # raw, as the runtime hands them
    back = aloha.normalize_actions(got, states=states[:, None, :])
    model_states = np.stack([o.state for o in as_model])[:, None, :]
    np.testing.assert_allclose(back.numpy(), plain.normalize_actions(space.actions_to_model(got), states=model_states).numpy(),
                               rtol=0, atol=1e-6)
    # and it is the chunk the actions came from (this policy's own rows, the same states)
    np.testing.assert_allclose(back.numpy()[..., :14], chunk.numpy()[..., :14], rtol=0, atol=1e-4)


def test_widths_that_are_not_alohas_and_unknown_spaces_are_refused():
    with pytest.raises(ValueError, match=r"robot_space 'aloha': ALOHA's state and actions have 14 values .* state has 7"):
        check_robot_space("aloha", 7, 14)
    check_robot_space("model", 7, 3)
    with pytest.raises(ValueError, match=r"robot_space 'ur5': choose one of model, aloha"):
        load_adapter("pi05", {"robot_space": "ur5"}, preset_name="tiny")


def test_native_folders_and_bundles_keep_the_space(pair, tmp_path):
    plain, aloha = pair
    assert "robot_space" not in json.loads((save_native(plain, tmp_path / "plain") / NATIVE_MANIFEST).read_text())["io"]
    folder = save_native(aloha, tmp_path / "native")
    assert load_pi05(folder).io.robot_space == "aloha"
    save_bundle_checkpoint(aloha, tmp_path / "bundle", with_weights=False)
    assert load_bundle_adapter(tmp_path / "bundle", weights_included=False).io.robot_space == "aloha"
    meta = json.loads((folder / NATIVE_MANIFEST).read_text())
    meta["io"]["robot_space"] = "trossen"
    (folder / NATIVE_MANIFEST).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"phyai_edge\.json: io\.robot_space 'trossen': choose one of"):
        load_pi05(folder)


def test_an_openpi_aloha_folder_says_what_it_needs(tmp_path, caplog):
    a = builtin_adapter("tiny", seed=0)
    folder = write_openpi(a, tmp_path / "openpi", asset_id="trossen")
    with caplog.at_level(logging.WARNING, logger="phyai_edge"):
        loaded = load_pi05(folder, structure="tiny")
    assert loaded.io.robot_space == "model"  # not guessed: the option decides
    assert any("robot_space=aloha" in r.getMessage() and "relative_actions=6,-1,6,-1" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="phyai_edge"):
        load_pi05(write_openpi(a, tmp_path / "other", asset_id="franka"), structure="tiny")
    assert not any("robot_space" in r.getMessage() for r in caplog.records)


def test_a_policy_in_aloha_space_is_the_plain_one_seen_through_the_conversion():
    """Through `Policy.infer` with an RTC prefix, as the daemon calls it: the same noise gives the
    plain policy's chunk for the converted state, converted back."""
    from phyai_edge.engines.base import RTCRequest
    from phyai_edge.engines.policy import load_policy

    plain = load_policy(preset="tiny", adapter_options={"relative_actions": "6,-1,6,-1"})
    aloha = load_policy(preset="tiny", adapter_options={"relative_actions": "6,-1,6,-1", "robot_space": "aloha"})
    space = AlohaSpace()
    noise = torch.randn(1, plain.chunk_size, 32, generator=torch.Generator().manual_seed(4))
    obs = _obs(7)
    first = aloha.infer([obs], noise=noise).actions
    seen = Observation(obs.images, space.state_to_model(obs.state), obs.prompt)
    np.testing.assert_allclose(first, space.actions_from_model(plain.infer([seen], noise=noise).actions), rtol=0, atol=1e-5)
    later = _obs(8)
    prefix = first[0, 10:35]
    got = aloha.infer([later], rtc=RTCRequest("guided-approx", prefix, 3, 25), noise=noise).actions
    seen = Observation(later.images, space.state_to_model(later.state), later.prompt)
    want = plain.infer([seen], rtc=RTCRequest("guided-approx", space.actions_to_model(prefix), 3, 25), noise=noise).actions
    np.testing.assert_allclose(got, space.actions_from_model(want), rtol=0, atol=1e-5)
    assert np.abs(got - plain.infer([later], rtc=RTCRequest("guided-approx", prefix, 3, 25), noise=noise).actions).max() > 1e-2
