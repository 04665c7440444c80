"""Checkpoint loaders on tiny checkpoints written in each real layout: LeRobot `pi05` folders,
openpi PyTorch folders, our native folders. Round trips give identical chunks; any missing,
extra, mis-shaped or wrongly typed tensor is a CheckpointError naming it; the language-model
heads are never read."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.ckpt import EX, PG, published_state, with_moving_stats, write_lerobot, write_openpi

from phyai_edge.adapters import checkpoint as ckpt_mod
from phyai_edge.adapters.base import Observation
from phyai_edge.adapters.checkpoint import CheckpointError
from phyai_edge.adapters.normalization import NormStats
from phyai_edge.adapters.pi05.loaders import OPENPI_CAMERAS, detect_format, load_pi05, save_native
from phyai_edge.engines.eager import EagerEngine
from phyai_edge.engines.policy import Policy

EMBED = "model." + PG + "model.language_model.embed_tokens.weight"


@pytest.fixture
def adapter(tiny_adapter):
    """The tiny adapter with non-trivial statistics, so normalisation is exercised."""
    return with_moving_stats(tiny_adapter)


def _run(adapter, obs, noise):
    pol = Policy(adapter, EagerEngine(adapter, device="cpu", dtype="float32"))
    return pol.infer(obs, noise=noise)


def _obs(adapter, names=None, seed=0):
    rng = np.random.default_rng(seed)
    names = names or adapter.camera_names
    return Observation({n: rng.integers(0, 256, (120, 160, 3), dtype=np.uint8) for n in names},
                       rng.uniform(-1, 1, adapter.state_dim).astype(np.float32), "fold the towel")


def _assert_same(a, b, obs_a, obs_b, noise):
    ra, rb = _run(a, obs_a, noise), _run(b, obs_b, noise)
    assert torch.equal(ra.chunk, rb.chunk)
    assert np.array_equal(ra.actions, rb.actions)


def test_native_round_trip(adapter, tmp_path, noise_for):
    folder = save_native(adapter, tmp_path / "native")
    assert detect_format(folder) == "native"
    loaded = load_pi05(folder)
    assert loaded.cfg == adapter.cfg
    assert loaded.io.camera_names == adapter.io.camera_names
    _assert_same(adapter, loaded, _obs(adapter), _obs(adapter), noise_for(adapter))


def test_loaded_weights_own_their_memory(adapter, tmp_path):
    """On the CPU, loaded parameters are copies, not views of the memory-mapped file (which
    safetensors >= 0.8 hands out): a view sits wherever the file's header ends, and CPU BLAS rounds
    differently at that alignment (the round trips here compare bit for bit); it would also change
    under a running model if the file were rewritten in place."""
    folder = save_native(adapter, tmp_path / "native")
    loaded = load_pi05(folder)
    size = (folder / "model.safetensors").stat().st_size
    for name, p in loaded.module.named_parameters():
        assert p.data_ptr() % 64 == 0, name
    with open(folder / "model.safetensors", "r+b") as f:  # the same file, zeroed in place
        f.write(bytes(size))
    original = adapter.module.state_dict()
    for name, p in loaded.module.named_parameters():
        assert torch.equal(p, original[name]), name


@pytest.mark.parametrize("vision_layout", ["vision_model.", ""])
def test_lerobot_round_trip(adapter, tmp_path, noise_for, vision_layout):
    folder = write_lerobot(adapter, tmp_path / "lerobot", vision_layout=vision_layout)
    assert detect_format(folder) == "lerobot"
    loaded = load_pi05(folder, structure="tiny")
    assert loaded.camera_names == adapter.camera_names
    assert (loaded.state_dim, loaded.action_dim) == (adapter.state_dim, adapter.action_dim)
    assert loaded.io.state_stats.mode == loaded.io.action_stats.mode == "quantile"
    assert not loaded.io.pad_state_in_prompt
    assert all(p.dtype == torch.float32 and not p.is_meta for p in loaded.module.parameters())
    _assert_same(adapter, loaded, _obs(adapter), _obs(adapter), noise_for(adapter))


def test_lerobot_mean_std_statistics(adapter, tmp_path, noise_for):
    io = adapter.io
    io.state_stats = NormStats("mean_std", mean=np.linspace(-1, 1, io.state_dim), std=np.linspace(0.5, 2, io.state_dim))
    io.action_stats = NormStats("mean_std", mean=np.linspace(1, 2, io.action_dim), std=np.linspace(0.1, 1, io.action_dim))
    folder = write_lerobot(adapter, tmp_path / "lr", modes={"STATE": "MEAN_STD", "ACTION": "MEAN_STD"})
    loaded = load_pi05(folder, structure="tiny")
    assert loaded.io.state_stats.mode == "mean_std"
    np.testing.assert_array_equal(loaded.io.action_stats.std, io.action_stats.std)
    _assert_same(adapter, loaded, _obs(adapter), _obs(adapter), noise_for(adapter))


def test_openpi_round_trip(adapter, tmp_path, noise_for):
    folder = write_openpi(adapter, tmp_path / "openpi")
    assert detect_format(folder) == "openpi"
    loaded = load_pi05(folder, structure="tiny")
    assert loaded.camera_names == OPENPI_CAMERAS
    assert not loaded.io.pad_state_in_prompt  # openpi PI0.5 tokenises before padding the state
    assert loaded.io.resize_antialias  # openpi resizes frames as PIL's BILINEAR does
    # and normalises with its own epsilon
    assert loaded.io.state_stats.convention == loaded.io.action_stats.convention == "openpi"
    noise = noise_for(adapter)
    as_openpi = copy.copy(adapter)
    as_openpi.io = dataclasses.replace(
        adapter.io, resize_antialias=True,
        state_stats=dataclasses.replace(adapter.io.state_stats, convention="openpi"),
        action_stats=dataclasses.replace(adapter.io.action_stats, convention="openpi"))
    ra = _run(as_openpi, _obs(adapter), noise)
    rb = _run(loaded, _obs(loaded, OPENPI_CAMERAS), noise)
    assert torch.equal(ra.chunk, rb.chunk)
    np.testing.assert_allclose(ra.actions, rb.actions, rtol=0, atol=1e-6)  # stats went through JSON


def test_resize_convention_follows_the_checkpoint_through_a_native_folder(adapter, tmp_path):
    """LeRobot folders resize without antialiasing, openpi folders with it, and a native folder
    (what a bundle carries) keeps the one it was saved with."""
    assert not load_pi05(write_lerobot(adapter, tmp_path / "lr"), structure="tiny").io.resize_antialias
    from_openpi = load_pi05(write_openpi(adapter, tmp_path / "openpi"), structure="tiny")
    again = load_pi05(save_native(from_openpi, tmp_path / "native"))
    assert again.io.resize_antialias
    obs = _obs(from_openpi, OPENPI_CAMERAS)
    assert torch.equal(again.preprocess([obs]).tensors["images"], from_openpi.preprocess([obs]).tensors["images"])


def test_openpi_normalisation_follows_the_checkpoint_through_a_native_folder(adapter, tmp_path):
    """openpi folders normalise with openpi's epsilon, and a native folder (a bundle) keeps it."""
    from_openpi = load_pi05(write_openpi(adapter, tmp_path / "openpi"), structure="tiny")
    again = load_pi05(save_native(from_openpi, tmp_path / "native"))
    for stats in (again.io.state_stats, again.io.action_stats):
        assert stats.convention == "openpi"
    assert load_pi05(write_lerobot(adapter, tmp_path / "lr"), structure="tiny").io.state_stats.convention == "lerobot"


def test_full_structure_is_the_default_and_says_so(adapter, tmp_path):
    """LeRobot folders do not record their size: without structure= they are read as `full`,
    and a tiny checkpoint then fails with every mis-shaped tensor named and a hint."""
    folder = write_lerobot(adapter, tmp_path / "lr")
    with pytest.raises(CheckpointError) as err:
        load_pi05(folder)
    msg = str(err.value)
    assert "mis-shaped" in msg and "structure=" in msg
    assert "missing tensors (" in msg  # full has 18 layers, the checkpoint 2
    assert "model.action_in_proj.weight: checkpoint [32, 32], model [1024, 32]" in msg


def test_native_rejects_a_conflicting_structure(adapter, tmp_path):
    folder = save_native(adapter, tmp_path / "n")
    assert load_pi05(folder, structure="tiny").cfg == adapter.cfg
    with pytest.raises(CheckpointError, match="different structure"):
        load_pi05(folder, structure="full")


# -- strictness --------------------------------------------------------------------------
def _broken(adapter, tmp_path, edit):
    state = published_state(adapter)
    edit(state)
    return write_lerobot(adapter, tmp_path / "broken", state=state)


def test_missing_tensor_is_named(adapter, tmp_path):
    name = "model." + EX + "model.layers.1.mlp.up_proj.weight"
    folder = _broken(adapter, tmp_path, lambda s: s.pop(name))
    with pytest.raises(CheckpointError, match="missing tensors \\(1\\)") as err:
        load_pi05(folder, structure="tiny")
    assert "expert_layers.1.mlp.up_proj.weight" in str(err.value)


def test_extra_tensor_is_named(adapter, tmp_path):
    extra = "model." + PG + "model.language_model.layers.0.self_attn.rotary.extra"
    folder = _broken(adapter, tmp_path, lambda s: s.update({extra: torch.zeros(3), "model.state_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(CheckpointError, match="unexpected tensors \\(2\\)") as err:
        load_pi05(folder, structure="tiny")
    assert extra in str(err.value) and "model.state_proj.weight" in str(err.value)


def test_misshaped_tensor_is_named_with_shapes(adapter, tmp_path):
    name = "model.action_in_proj.weight"
    folder = _broken(adapter, tmp_path, lambda s: s.update({name: torch.zeros(32, 31)}))
    with pytest.raises(CheckpointError, match="mis-shaped tensors \\(1\\)") as err:
        load_pi05(folder, structure="tiny")
    assert f"{name}: checkpoint [32, 31], model [32, 32]" in str(err.value)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_wrongly_typed_tensor_is_named(adapter, tmp_path, dtype):
    name = "model.time_mlp_in.bias"
    folder = _broken(adapter, tmp_path, lambda s: s.update({name: torch.zeros(s[name].shape, dtype=dtype)}))
    with pytest.raises(CheckpointError, match="wrongly typed tensors \\(1\\)") as err:
        load_pi05(folder, structure="tiny")
    assert name in str(err.value)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the flags are gathered on the device)"))])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_named_at_load(adapter, tmp_path, bad, device):
    """One NaN or Inf weight loaded and ran, and every action came back NaN (the daemon then held
    the robot with no reason given)."""
    name = "model.action_out_proj.weight"

    def edit(s):
        s[name][3, 1] = bad

    folder = _broken(adapter, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"NaN or Inf weights.*\n.*non-finite tensors \(1\)") as err:
        load_pi05(folder, structure="tiny", device=device)
    assert name in str(err.value)
    assert load_pi05(_broken(adapter, tmp_path / "ok", lambda s: None), structure="tiny", device=device) is not None


def test_a_weight_beyond_float16_is_named_when_loaded_as_float16(adapter, tmp_path):
    """70000 is a fine float32 weight and Inf in float16: refused for the dtype that overflows."""
    name = "model.time_mlp_in.weight"

    def edit(s):
        s[name][0, 0] = 7e4

    folder = _broken(adapter, tmp_path, edit)
    assert load_pi05(folder, structure="tiny") is not None
    with pytest.raises(CheckpointError, match=r"beyond the range of float16") as err:
        load_pi05(folder, structure="tiny", dtype=torch.float16)
    assert name in str(err.value)


def _edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(("edit", "match"), [
    (lambda c: c.update(num_inference_steps=0), r"num_steps = 0: expected a positive integer"),
    (lambda c: c.update(num_inference_steps=-3), r"num_steps = -3: expected a positive integer"),
    (lambda c: c.update(tokenizer_max_length=0), r"max_token_len = 0: expected a positive integer"),
    (lambda c: c.update(chunk_size="fifty"), r"fifty"),
    (lambda c: c["input_features"]["observation.state"].update(shape=[]), r"metadata does not fit the format"),
])
def test_lerobot_config_values_are_checked_at_load(adapter, tmp_path, edit, match):
    """A negative step count ran no denoising and published the noise; zero steps divided by zero
    at the first inference; a zero prompt length dropped the instruction; a string or an empty
    shape raised a bare ValueError / IndexError from inside the reader."""
    folder = write_lerobot(adapter, tmp_path / "lr")
    _edit_json(folder / "config.json", edit)
    with pytest.raises(CheckpointError, match=match) as err:
        load_pi05(folder, structure="tiny")
    assert str(folder) in str(err.value)


@pytest.mark.parametrize(("file", "edit", "match"), [
    ("phyai_edge.json", lambda m: m["config"].update(num_steps="10"), r"num_steps = '10'"),
    ("phyai_edge.json", lambda m: m.pop("io"), r"metadata does not fit the format: no 'io'"),
    ("phyai_edge.json", lambda m: m["config"].update(unknown_field=1), r"unknown_field"),
    ("norm_stats.json", lambda st: st["state"].update(mode="minmax"), r"mode 'minmax' is not one of"),
])
def test_native_manifest_contents_are_checked_at_load(adapter, tmp_path, file, edit, match):
    folder = save_native(adapter, tmp_path / "native")
    _edit_json(folder / file, edit)
    with pytest.raises(CheckpointError, match=match):
        load_pi05(folder)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_checkpoint_json_that_is_not_an_object_is_named(adapter, tmp_path, text):
    folder = write_openpi(adapter, tmp_path / "openpi")
    (stats,) = folder.glob("assets/*/norm_stats.json")
    stats.write_text(text)
    with pytest.raises(CheckpointError, match=re.escape(str(stats)) + r" (is not valid JSON|holds a JSON list)"):
        load_pi05(folder, structure="tiny")


def test_all_problems_reported_at_once(adapter, tmp_path):
    def edit(s):
        s.pop("model.action_out_proj.bias")
        s["model.bogus"] = torch.zeros(1)
        s["model.time_mlp_out.weight"] = torch.zeros(2, 2)
    folder = _broken(adapter, tmp_path, edit)
    with pytest.raises(CheckpointError) as err:
        load_pi05(folder, structure="tiny")
    msg = str(err.value)
    assert "action_out_proj.bias" in msg and "model.bogus" in msg and "model.time_mlp_out.weight" in msg


def test_damaged_weight_file_is_named(adapter, tmp_path):
    """A truncated or garbled safetensors file (an interrupted copy) is a CheckpointError that
    names the file: safetensors' own error names neither it nor, in a sharded checkpoint, which
    shard."""
    folder = save_native(adapter, tmp_path / "native")
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(damaged|not a safetensors)"):
        load_pi05(folder)
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage}")
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_pi05(folder)


def test_damaged_normaliser_file_is_named(adapter, tmp_path):
    """LeRobot's normaliser statistics are safetensors files too: a damaged one is named."""
    folder = write_lerobot(adapter, tmp_path / "lr")
    (f,) = folder.glob("policy_preprocessor*normalizer_processor.safetensors")
    f.write_bytes(f.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=re.escape(f.name) + r".*(damaged|not a safetensors)"):
        load_pi05(folder, structure="tiny")


def test_tensor_in_two_shards_names_both_files(adapter, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_native(adapter, tmp_path / "native")
    state = load_file(str(folder / "model.safetensors"))
    names = sorted(state)
    (folder / "model.safetensors").unlink()
    save_file({k: state[k] for k in names[::2]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in [names[0], *names[1::2]]}, str(folder / "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_pi05(folder)
    msg = str(err.value)
    assert names[0] in msg and "model-00001-of-00002.safetensors" in msg and "model-00002-of-00002.safetensors" in msg


def test_bf16_checkpoint_loads_as_float32(adapter, tmp_path, noise_for):
    state = {k: v.to(torch.bfloat16) for k, v in published_state(adapter).items()}
    loaded = load_pi05(write_lerobot(adapter, tmp_path / "bf", state=state), structure="tiny")
    assert all(p.dtype == torch.float32 for p in loaded.module.parameters())
    w = adapter.module.action_in_proj.weight
    assert torch.equal(loaded.module.action_in_proj.weight, w.to(torch.bfloat16).float())


# -- language-model heads ----------------------------------------------------------------
class _Recorder:
    """Wraps safetensors.safe_open and records which tensors' data or headers were touched, in
    the weight files (model*.safetensors; the normaliser files are opened through it too)."""

    def __init__(self, real):
        self.real, self.read, self.sliced = real, [], []

    def __call__(self, *a, **kw):
        handle = self.real(*a, **kw)
        if not Path(a[0]).name.startswith("model"):
            return handle
        rec = self

        class H:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *e):
                return handle.__exit__(*e)

            def keys(self):
                return handle.keys()

            def get_tensor(self, k):
                rec.read.append(k)
                return handle.get_tensor(k)

            def get_slice(self, k):
                rec.sliced.append(k)
                return handle.get_slice(k)

        return H()


def test_lm_heads_are_skipped_unread(adapter, tmp_path, monkeypatch):
    folder = write_lerobot(adapter, tmp_path / "lr")
    rec = _Recorder(ckpt_mod.safe_open)
    monkeypatch.setattr(ckpt_mod, "safe_open", rec)
    loaded = load_pi05(folder, structure="tiny")
    heads = {"model." + PG + "lm_head.weight", "model." + EX + "lm_head.weight"}
    assert heads.isdisjoint(rec.read) and heads.isdisjoint(rec.sliced)
    assert len(rec.read) == len(loaded.module.state_dict())  # everything else read exactly once
    assert EMBED in rec.read


def test_tied_embedding_falls_back_to_lm_head(adapter, tmp_path, noise_for, monkeypatch):
    """Checkpoints saved with tied weights may hold the embedding only as paligemma's lm_head."""
    def edit(s):
        s["model." + PG + "lm_head.weight"] = s.pop(EMBED)
    folder = _broken(adapter, tmp_path, edit)
    rec = _Recorder(ckpt_mod.safe_open)
    monkeypatch.setattr(ckpt_mod, "safe_open", rec)
    loaded = load_pi05(folder, structure="tiny")
    assert "model." + EX + "lm_head.weight" not in rec.read  # the expert's head is still skipped
    assert torch.equal(loaded.module.embed_tokens.weight, adapter.module.embed_tokens.weight)
    _assert_same(adapter, loaded, _obs(adapter), _obs(adapter), noise_for(adapter))


# -- folder-level errors ---------------------------------------------------------------------
def test_folder_errors(adapter, tmp_path):
    with pytest.raises(FileNotFoundError):
        detect_format(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"not a PI0\.5 checkpoint folder"):
        detect_format(tmp_path / "empty")
    bad = tmp_path / "badjson"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        detect_format(bad)


def test_missing_tokenizer_is_a_clear_error(adapter, tmp_path):
    folder = write_lerobot(adapter, tmp_path / "lr", tokenizer=False)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_pi05(folder, structure="tiny")
    # an explicit tokenizer path works
    assert load_pi05(folder, structure="tiny", tokenizer=adapter.tokenizer.path).tokenizer.vocab_size > 0


def test_lerobot_config_errors(adapter, tmp_path):
    folder = write_lerobot(adapter, tmp_path / "v", config_extra={"paligemma_variant": "gemma_7b"})
    with pytest.raises(CheckpointError, match="paligemma_variant"):
        load_pi05(folder, structure="tiny")
    folder = write_lerobot(adapter, tmp_path / "r", config_extra={"image_resolution": [256, 256]})
    with pytest.raises(CheckpointError, match="image_resolution"):
        load_pi05(folder, structure="tiny")
    folder = write_lerobot(adapter, tmp_path / "s", modes={"STATE": "MEAN_STD", "ACTION": "QUANTILES"})
    with pytest.raises(CheckpointError, match=r"observation\.state\.mean"):
        load_pi05(folder, structure="tiny")


def test_lerobot_settings_come_from_config(adapter, tmp_path):
    folder = write_lerobot(adapter, tmp_path / "lr", config_extra={"num_inference_steps": 4,
                                                                  "tokenizer_max_length": 64})
    loaded = load_pi05(folder, structure="tiny")
    assert loaded.solver.num_steps == 4 and loaded.cfg.max_token_len == 64
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["type"] == "pi05"


@pytest.mark.parametrize("key", ["use_visual_memory", "use_proprioceptive_memory"])
def test_lerobot_options_this_runtime_does_not_apply_are_refused(adapter, tmp_path, key):
    """LeRobot PI0.5 options that change what the policy reads (configuration_pi05.py): MEM
    observation histories. Loading one as a plain PI0.5 would run without error and send the
    robot wrong actions, so it is refused naming the key; false (the default) loads. (Relative
    actions are applied: tests/test_relative_actions.py.)"""
    folder = write_lerobot(adapter, tmp_path / key, config_extra={key: True})
    with pytest.raises(CheckpointError, match=rf"config\.json {key} = true.*history"):
        load_pi05(folder, structure="tiny")
    ok = write_lerobot(adapter, tmp_path / f"{key}_off", config_extra={key: False})
    assert load_pi05(ok, structure="tiny").action_dim == adapter.action_dim


def test_lerobot_absolute_actions_step_is_read_from_the_processor_file(adapter, tmp_path):
    """The processor files are what LeRobot runs: an enabled absolute-actions step in
    policy_postprocessor.json makes the policy relative even where config.json does not say so."""
    folder = write_lerobot(adapter, tmp_path / "lr")
    steps = [{"registry_name": "unnormalizer_processor", "config": {},
              "state_file": "policy_postprocessor_step_0_unnormalizer_processor.safetensors"},
             {"registry_name": "absolute_actions_processor", "config": {"enabled": True}},
             {"registry_name": "device_processor", "config": {"device": "cpu"}}]
    (folder / "policy_postprocessor.json").write_text(json.dumps({"name": "policy_postprocessor", "steps": steps}))
    assert load_pi05(folder, structure="tiny").io.relative_action_mask == (True,) * adapter.action_dim
    steps[1]["config"]["enabled"] = False
    (folder / "policy_postprocessor.json").write_text(json.dumps({"name": "policy_postprocessor", "steps": steps}))
    assert load_pi05(folder, structure="tiny").io.relative_action_mask == ()
    (folder / "policy_postprocessor.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"policy_postprocessor\.json.*not valid JSON"):
        load_pi05(folder, structure="tiny")
