"""Policies trained on relative (delta) actions: on the masked action dims the model predicts
offsets from the observed state, which `postprocess` adds back (LeRobot's
AbsoluteActionsProcessorStep, openpi's AbsoluteActions), and an RTC prefix (absolute, robot
units) is made relative to the new observation's state before it is normalised. The mask comes
from a LeRobot folder's processor files (config.json as fallback), openpi's notation in the
`relative_actions` adapter option, or a native folder / bundle that recorded it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.ckpt import write_lerobot, write_openpi

from phyai_edge.adapters import load_adapter
from phyai_edge.adapters.base import Observation
from phyai_edge.adapters.checkpoint import CheckpointError
from phyai_edge.adapters.normalization import NormStats
from phyai_edge.adapters.pi05 import (
    builtin_adapter,
    load_bundle_adapter,
    parse_relative_actions,
    save_bundle_checkpoint,
)
from phyai_edge.adapters.pi05.adapter import fit_relative_mask
from phyai_edge.adapters.pi05.loaders import NATIVE_MANIFEST, lerobot_relative_mask, load_pi05, save_native
from phyai_edge.engines.base import RTCRequest
from phyai_edge.engines.eager import EagerEngine
from phyai_edge.engines.policy import Policy, load_policy

JOINTS = ("waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate", "gripper")
ALOHA_NAMES = [f"{side}_{j}" for side in ("left", "right") for j in JOINTS]
# openpi's make_bool_mask(6, -1, 6, -1): the joints relative, the grippers absolute.
ALOHA_MASK = (True,) * 6 + (False,) + (True,) * 6 + (False,)
GRIPPERS = [6, 13]


def _quantiles(rng, dim, lo, hi):
    q01 = rng.uniform(lo, 0, dim).astype(np.float32)
    return NormStats("quantile", q01=q01, q99=q01 + rng.uniform(0.5, hi, dim).astype(np.float32))


@pytest.fixture
def adapter():
    """The tiny adapter with non-trivial statistics (the built-in ones make normalising a no-op)."""
    a = builtin_adapter("tiny", seed=0)
    rng = np.random.default_rng(3)
    a.io.state_stats = _quantiles(rng, a.state_dim, -3, 4)
    a.io.action_stats = _quantiles(rng, a.action_dim, -2, 3)
    return a


def _policy(adapter) -> Policy:
    return Policy(adapter, EagerEngine(adapter, device="cpu", dtype="float32", seed=0))


def _obs(adapter, seed: int, scale: float = 2.0) -> Observation:
    rng = np.random.default_rng(seed)
    images = {n: rng.integers(0, 256, (96, 128, 3), dtype=np.uint8) for n in adapter.camera_names}
    return Observation(images, rng.uniform(-scale, scale, adapter.state_dim).astype(np.float32), "fold the towel")


def _processors(folder: Path, *, enabled: bool = True, exclude=("gripper",), names=ALOHA_NAMES) -> None:
    """The processor files LeRobot writes for a relative policy (make_pi05_pre_post_processors)."""
    pre = [{"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
           {"registry_name": "to_batch_processor", "config": {}},
           {"registry_name": "relative_actions_processor",
            "config": {"enabled": enabled, "exclude_joints": list(exclude) if isinstance(exclude, tuple) else exclude,
                       "action_names": names}},
           {"registry_name": "normalizer_processor", "config": {},
            "state_file": "policy_preprocessor_step_3_normalizer_processor.safetensors"}]
    post = [{"registry_name": "unnormalizer_processor", "config": {},
             "state_file": "policy_postprocessor_step_0_unnormalizer_processor.safetensors"},
            {"registry_name": "absolute_actions_processor", "config": {"enabled": enabled}},
            {"registry_name": "device_processor", "config": {"device": "cpu"}}]
    (folder / "policy_preprocessor.json").write_text(json.dumps({"name": "policy_preprocessor", "steps": pre}))
    (folder / "policy_postprocessor.json").write_text(json.dumps({"name": "policy_postprocessor", "steps": post}))


def _relative_lerobot(adapter, folder: Path, config: dict | None = None, **processors) -> Path:
    config = {"use_relative_actions": True, "relative_exclude_joints": ["gripper"],
              "action_feature_names": ALOHA_NAMES} if config is None else config
    write_lerobot(adapter, folder, config_extra=config)
    _processors(folder, **processors)
    return folder


# -- the mask ---------------------------------------------------------------------------------
def test_lerobot_mask_rules():
    """An action stays absolute where an exclude token, lower-cased, equals or is part of its
    lower-cased name; no names or no tokens: every dim relative; dims past the names relative."""
    assert lerobot_relative_mask(["gripper"], ALOHA_NAMES, 14) == ALOHA_MASK
    assert lerobot_relative_mask(["GRIP"], ["Left_Gripper.pos", "elbow.pos", "grip"], 3) == (False, True, False)
    assert lerobot_relative_mask(["x"], ["x", "ax", "y"], 3) == (False, False, True)
    assert lerobot_relative_mask(["gripper", "wrist"], ALOHA_NAMES[:7], 7) == (True,) * 4 + (False,) * 3
    assert lerobot_relative_mask(["gripper"], None, 4) == (True,) * 4
    for no_tokens in ([], None, [""]):
        assert lerobot_relative_mask(no_tokens, ALOHA_NAMES, 14) == (True,) * 14
    assert lerobot_relative_mask(["gripper"], ["a_gripper"], 3) == (False, True, True)  # padded with True
    assert lerobot_relative_mask(["gripper"], ALOHA_NAMES, 7) == ALOHA_MASK[:7]  # names past the action cut


def test_the_kept_mask_covers_the_action_and_reaches_only_into_the_state():
    assert fit_relative_mask([True, False], 4, 4) == (True, False, False, False)  # openpi: the rest absolute
    assert fit_relative_mask([False, False], 4, 4) == ()  # nothing relative: absolute
    assert fit_relative_mask([True, True, False], 3, 2) == (True, True, False)
    with pytest.raises(ValueError, match="5 entries, the action only 4"):
        fit_relative_mask([True] * 5, 4, 4)
    with pytest.raises(ValueError, match="action dim 2 relative to the state, which has only 2 values"):
        fit_relative_mask([True, True, True], 3, 2)


# -- LeRobot folders -------------------------------------------------------------------------
def test_a_relative_lerobot_folder_adds_the_state_on_exactly_the_masked_dims(adapter, tmp_path, noise_for):
    """Same weights and statistics, read once as absolute and once as relative: the same
    model-space chunk, and actions that differ by each observation's state on the joints only."""
    absolute = load_pi05(write_lerobot(adapter, tmp_path / "abs"), structure="tiny")
    relative = load_pi05(_relative_lerobot(adapter, tmp_path / "rel"), structure="tiny")
    assert absolute.io.relative_action_mask == () and relative.io.relative_action_mask == ALOHA_MASK
    obs = [_obs(adapter, 1), _obs(adapter, 2)]
    noise = noise_for(adapter, 2)
    ra, rr = _policy(absolute).infer(obs, noise=noise), _policy(relative).infer(obs, noise=noise)
    assert torch.equal(ra.chunk, rr.chunk)
    states = np.stack([o.state for o in obs])
    joints = np.array(ALOHA_MASK)
    np.testing.assert_allclose(rr.actions[..., joints], ra.actions[..., joints] + states[:, None, joints], atol=1e-5)
    assert np.array_equal(rr.actions[..., GRIPPERS], ra.actions[..., GRIPPERS])
    assert np.abs(rr.actions - ra.actions).max() > 0.5  # the states are not near zero


def test_the_processor_files_come_first_and_config_json_is_the_fallback(adapter, tmp_path):
    # config.json alone (processor files without the steps: written before the option existed).
    folder = write_lerobot(adapter, tmp_path / "cfg", config_extra={
        "use_relative_actions": True, "relative_exclude_joints": ["wrist", "gripper"],
        "action_feature_names": ALOHA_NAMES})
    want = tuple(not ("wrist" in n or "gripper" in n) for n in ALOHA_NAMES)
    assert load_pi05(folder, structure="tiny").io.relative_action_mask == want
    # Nothing names the excluded joints: LeRobot's default, ["gripper"].
    folder = write_lerobot(adapter, tmp_path / "default", config_extra={
        "use_relative_actions": True, "action_feature_names": ALOHA_NAMES})
    assert load_pi05(folder, structure="tiny").io.relative_action_mask == ALOHA_MASK
    # config.json's defaults (exclude ["gripper"]) with the processor files' names.
    folder = _relative_lerobot(adapter, tmp_path / "proc", config={}, exclude=("gripper",))
    assert load_pi05(folder, structure="tiny").io.relative_action_mask == ALOHA_MASK
    # The steps off: absolute, whatever the exclude settings.
    folder = _relative_lerobot(adapter, tmp_path / "off", config={"use_relative_actions": False}, enabled=False)
    assert load_pi05(folder, structure="tiny").io.relative_action_mask == ()
    # No names anywhere: LeRobot makes every dim relative, grippers too.
    folder = _relative_lerobot(adapter, tmp_path / "nonames", config={"use_relative_actions": True}, names=None)
    assert load_pi05(folder, structure="tiny").io.relative_action_mask == (True,) * 14


@pytest.mark.parametrize(("config", "processors", "error"), [
    ({"use_relative_actions": False}, {},
     r"absolute_actions_processor\.enabled = True but config\.json use_relative_actions = False"),
    ({"relative_exclude_joints": ["wrist"]}, {},
     r"relative_actions_processor\.exclude_joints = \['gripper'\] but config\.json relative_exclude_joints"),
    ({"action_feature_names": ALOHA_NAMES}, {"names": None},
     r"relative_actions_processor\.action_names = None but config\.json action_feature_names"),
    ({}, {"exclude": "gripper"}, r"relative_actions_processor\.exclude_joints = 'gripper', expected a list"),
    ({"use_relative_actions": "yes"}, {}, r"config\.json use_relative_actions = 'yes', expected true or false"),
], ids=["enabled", "exclude_joints", "action_names", "exclude_not_a_list", "enabled_not_a_bool"])
def test_files_that_disagree_or_cannot_build_the_mask_are_refused(adapter, tmp_path, config, processors, error):
    folder = _relative_lerobot(adapter, tmp_path / "lr", config=config, **processors)
    with pytest.raises(CheckpointError, match=error):
        load_pi05(folder, structure="tiny")


def test_a_relative_dim_past_the_state_is_refused_at_load(tmp_path):
    short = builtin_adapter("tiny", state_dim=10)  # ALOHA's right-arm joints reach action dim 12
    folder = _relative_lerobot(short, tmp_path / "lr")
    with pytest.raises(CheckpointError, match=r"relative_actions_processor.*action dim 12 relative to the state, "
                                              r"which has only 10 values"):
        load_pi05(folder, structure="tiny")


def test_processor_files_are_still_read_strictly(adapter, tmp_path):
    folder = _relative_lerobot(adapter, tmp_path / "lr")
    (folder / "policy_preprocessor.json").write_text(json.dumps({"steps": {}}))
    with pytest.raises(CheckpointError, match=r"policy_preprocessor\.json has no list of steps"):
        load_pi05(folder, structure="tiny")
    (folder / "policy_postprocessor.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"policy_postprocessor\.json is not valid JSON"):
        load_pi05(folder, structure="tiny")


# -- the adapter option ------------------------------------------------------------------------
def test_the_option_takes_openpis_mask_notation_or_none():
    assert parse_relative_actions("6,-1,6,-1") == ALOHA_MASK
    assert parse_relative_actions(" 6, -1 ,6,-1 ") == ALOHA_MASK
    assert parse_relative_actions("none") == parse_relative_actions("None") == ()
    assert load_adapter("pi05", {"relative_actions": "6,-1,6,-1"}, preset_name="tiny").io.relative_action_mask \
        == ALOHA_MASK
    assert load_adapter("pi05", {"relative_actions": "3"}, preset_name="tiny").io.relative_action_mask \
        == (True,) * 3 + (False,) * 11  # openpi leaves the dims past the mask absolute
    assert load_adapter("pi05", {"relative_actions": "-14"}, preset_name="tiny").io.relative_action_mask == ()
    # What the daemon's [model.adapter_options] and the CLI's --adapter-option reach.
    assert load_policy(preset="tiny", adapter_options={"relative_actions": "6,-1,6,-1"}).adapter.relative_actions


@pytest.mark.parametrize("bad", ["", "6,,-1", "six", "6,0,-1", "6.5", "relative", 14, "7,-1,7", "15"])
def test_a_bad_option_value_is_named(bad):
    with pytest.raises(ValueError, match=rf"relative_actions {bad!r}"):
        load_adapter("pi05", {"relative_actions": bad}, preset_name="tiny")


def test_the_option_overrides_the_folder(adapter, tmp_path):
    rel = _relative_lerobot(adapter, tmp_path / "rel")
    assert load_adapter("pi05", {"relative_actions": "none"}, checkpoint=rel, structure="tiny").io \
        .relative_action_mask == ()
    assert load_adapter("pi05", {"relative_actions": "2,-12"}, checkpoint=rel, structure="tiny").io \
        .relative_action_mask == (True, True) + (False,) * 12
    openpi = write_openpi(adapter, tmp_path / "openpi")  # records nothing: absolute unless told
    assert load_adapter("pi05", checkpoint=openpi, structure="tiny").io.relative_action_mask == ()
    assert load_adapter("pi05", {"relative_actions": "6,-1,6,-1"}, checkpoint=openpi, structure="tiny").io \
        .relative_action_mask == ALOHA_MASK


# -- pre / post --------------------------------------------------------------------------------
def test_preprocess_keeps_the_raw_states_on_the_host(adapter):
    obs = [_obs(adapter, 1), _obs(adapter, 2)]
    want = np.stack([o.state for o in obs])
    for inputs in (adapter.preprocess(obs), adapter.preprocess_per_sample(obs)):
        states = inputs.extras["states"]
        assert isinstance(states, np.ndarray) and states.dtype == np.float32 and np.array_equal(states, want)
    obs[0].images[adapter.camera_names[-1]] = None
    obs[1].images[adapter.camera_names[-1]] = None
    dropped = adapter.drop_cameras(adapter.preprocess(obs), {adapter.camera_names[-1]})
    assert dropped.tensors["images"].shape[1] == len(adapter.camera_names) - 1
    assert np.array_equal(dropped.extras["states"], want)


def test_a_relative_adapter_needs_the_states(adapter):
    adapter.io.relative_action_mask = ALOHA_MASK
    chunk = torch.zeros(1, adapter.chunk_size, adapter.model_action_dim)
    with pytest.raises(ValueError, match=r"relative to the robot state.*postprocess needs `inputs`"):
        adapter.postprocess(chunk)
    with pytest.raises(ValueError, match=r"relative to the robot state.*normalize_actions needs the states"):
        adapter.normalize_actions(np.zeros((5, adapter.action_dim)))
    inputs = adapter.preprocess([_obs(adapter, 1)])
    assert adapter.postprocess(chunk, inputs).shape == (1, adapter.chunk_size, adapter.action_dim)
    adapter.io.relative_action_mask = ()
    assert adapter.postprocess(chunk).shape == (1, adapter.chunk_size, adapter.action_dim)  # absolute: as before


# -- Real-Time Chunking --------------------------------------------------------------------------
def _model_space(adapter, actions: np.ndarray) -> torch.Tensor:
    norm = adapter.io.action_stats.normalize(actions)
    return torch.from_numpy(np.pad(norm, [(0, 0)] * (norm.ndim - 1) + [(0, adapter.model_action_dim - adapter.action_dim)]))


def test_the_rtc_prefix_is_made_relative_to_each_new_state(adapter):
    adapter.io.relative_action_mask = ALOHA_MASK
    policy, mask = _policy(adapter), np.array(ALOHA_MASK)
    rng = np.random.default_rng(7)
    prefix = rng.uniform(-2, 2, (2, 20, adapter.action_dim)).astype(np.float32)
    states = rng.uniform(-2, 2, (2, adapter.state_dim)).astype(np.float32)
    g = policy.rtc_guidance(RTCRequest("guided", prefix, 4, 25), 2, states)
    for i in range(2):
        assert torch.allclose(g.target[i, :20], _model_space(adapter, prefix[i] - states[i] * mask), atol=1e-6)
    assert not g.target[:, 20:].any()
    # Per sample: each prefix with its own sample's state; an unguided sample between them.
    reqs = [RTCRequest("inpaint", prefix[0], 4, 25), None, RTCRequest("inpaint", prefix[1, :15], 3, 25)]
    three = rng.uniform(-2, 2, (3, adapter.state_dim)).astype(np.float32)
    g = policy.rtc_guidance_per_sample(reqs, three)
    assert torch.allclose(g.target[0, :20], _model_space(adapter, prefix[0] - three[0] * mask), atol=1e-6)
    assert torch.allclose(g.target[2, :15], _model_space(adapter, prefix[1, :15] - three[2] * mask), atol=1e-6)
    assert not g.target[1].any() and not g.target[2, 15:].any()
    with pytest.raises(ValueError, match="normalize_actions needs the states"):
        policy.rtc_guidance(RTCRequest("guided", prefix, 4, 25), 2)
    with pytest.raises(ValueError, match=r"RTC states must be \(2, 14\), one per sample, got \(1, 14\)"):
        policy.rtc_guidance(RTCRequest("guided", prefix, 4, 25), 2, states[:1])


@pytest.mark.parametrize("per_sample", [False, True])
def test_inpaint_pins_the_new_chunk_to_the_previous_one_in_robot_units(adapter, noise_for, per_sample):
    """The daemon's loop: the executing chunk's actions (absolute) as the prefix of the next
    inference, from an observation whose state has moved. The first d actions of the new chunk
    are those actions, joints and grippers alike."""
    adapter.io.relative_action_mask = ALOHA_MASK
    policy = _policy(adapter)
    first = policy.infer([_obs(adapter, 1), _obs(adapter, 2)], noise=noise_for(adapter, 2, seed=1)).actions
    d, n = 5, 30
    later = [_obs(adapter, 3), _obs(adapter, 4)]  # other states (and frames)
    prefix = first[:, 10:10 + n]  # 10 actions ran meanwhile
    rtc = ([RTCRequest("inpaint", prefix[i], d, 25) for i in range(2)] if per_sample
           else RTCRequest("inpaint", prefix, d, 25))
    new = policy.infer(later, rtc=rtc, noise=noise_for(adapter, 2, seed=2)).actions
    np.testing.assert_allclose(new[:, :d], prefix[:, :d], atol=1e-4)
    assert np.abs(new[:, d:n] - prefix[:, d:]).max() > 1e-2  # past d the new chunk is free


# -- native folders and bundles --------------------------------------------------------------------
def test_native_folders_and_bundles_keep_the_mask(adapter, tmp_path, noise_for):
    plain = save_native(adapter, tmp_path / "plain")
    assert "relative_action_mask" not in json.loads((plain / NATIVE_MANIFEST).read_text())["io"]
    adapter.io.relative_action_mask = ALOHA_MASK
    folder = save_native(adapter, tmp_path / "native")
    loaded = load_pi05(folder)
    assert loaded.io.relative_action_mask == ALOHA_MASK
    obs, noise = [_obs(adapter, 1)], noise_for(adapter)
    assert np.array_equal(_policy(loaded).infer(obs, noise=noise).actions, _policy(adapter).infer(obs, noise=noise).actions)
    save_bundle_checkpoint(adapter, tmp_path / "bundle", with_weights=False)
    assert load_bundle_adapter(tmp_path / "bundle", weights_included=False).io.relative_action_mask == ALOHA_MASK
    meta = json.loads((folder / NATIVE_MANIFEST).read_text())
    meta["io"]["relative_action_mask"] = [True] * 3
    (folder / NATIVE_MANIFEST).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"phyai_edge\.json: io\.relative_action_mask must be a list of 14"):
        load_pi05(folder)


def test_an_exported_bundle_of_a_relative_policy_stays_relative(tmp_path):
    pytest.importorskip("onnxruntime")
    from phyai_edge.cli import main as cli

    out = tmp_path / "b"
    assert cli(["export", "--preset", "tiny", "--out", str(out), "--steps", "2", "--holdout", "1", "--no-progress",
                "--adapter-option", "relative_actions=6,-1,6,-1"]) == 0
    assert load_policy(bundle=out).adapter.io.relative_action_mask == ALOHA_MASK


# -- the daemon ----------------------------------------------------------------------------------
def test_the_daemon_joins_a_relative_policy_s_chunks_in_robot_units(tmp_path):
    """Through the daemon's own path (job -> worker -> Policy.infer, the state moving between
    chunks): with `inpaint`, each recorded chunk's first d actions are the executing chunk's
    actions it was given as the prefix, in robot units, so a relative policy's chunks join as
    an absolute one's do. `--record` keeps every job's prefix, d and chunk."""
    from phyai_edge.control.daemon import Daemon
    from phyai_edge.control.fakes import run_ticks, test_config

    policy = load_policy(preset="tiny", backend="eager", adapter_options={"relative_actions": "6,-1,6,-1"})
    assert policy.adapter.relative_actions
    cfg = test_config(chunking={"mode": "inpaint", "execution_horizon": 10, "delay_initial": 3},
                      model={"worker": "thread", "warmup": 1})
    d = Daemon(cfg, policy=policy, realtime=False, status_line=False, record_dir=str(tmp_path))
    run_ticks(d, 120, timeout_s=120)
    joined = 0
    for f in sorted(tmp_path.glob("obs_*.npz")):
        with np.load(f) as z:
            prefix, actions, k = z["prefix"], z["actions"], int(z["delay_estimate"])
            if prefix.size and actions.size and k:
                np.testing.assert_allclose(actions[:k], prefix[:k], atol=1e-4)
                joined += 1
    assert joined >= 3, joined
