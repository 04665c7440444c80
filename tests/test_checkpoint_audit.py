"""Loading the checkpoints and tokenizers people have, as a robot engineer meets them offline:
Hugging Face's PaliGemma tokenizer.json (an added `<image>` token one past the embedding), a
foreign tokenizer, normaliser statistics that do not fit the config, openpi statistics without
quantiles or a folder without config.json, the padded prompt state's width, openpi policies
trained without the state in the prompt (pi05_libero), and folders people point at instead of
the checkpoint."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.ckpt import with_moving_stats, write_lerobot, write_openpi
from safetensors.numpy import load_file, save_file

from phyai_edge.adapters import load_adapter
from phyai_edge.adapters.base import Observation
from phyai_edge.adapters.checkpoint import CheckpointError
from phyai_edge.adapters.normalization import NormStats
from phyai_edge.adapters.pi05 import PI05Adapter
from phyai_edge.adapters.pi05.builtin import seeded_model, tiny_tokenizer_path
from phyai_edge.adapters.pi05.config import GemmaSpec, tiny
from phyai_edge.adapters.pi05.loaders import detect_format, load_pi05, save_native
from phyai_edge.adapters.tokenizer import PromptTokenizer
from phyai_edge.engines.eager import EagerEngine
from phyai_edge.engines.policy import Policy

PALIGEMMA_VOCAB = 257152


@pytest.fixture
def adapter(tiny_adapter: PI05Adapter) -> PI05Adapter:
    """The tiny adapter with statistics that move values, so a wrong scale would show."""
    return with_moving_stats(tiny_adapter, seed=3)


def _obs(adapter: PI05Adapter, prompt: str = "pick up the cube", state: np.ndarray | None = None) -> Observation:
    rng = np.random.default_rng(0)
    if state is None:
        state = rng.uniform(-1, 1, adapter.state_dim).astype(np.float32)
    return Observation({n: rng.integers(0, 256, (64, 80, 3), dtype=np.uint8) for n in adapter.camera_names},
                       state, prompt)


def _paligemma_like_tokenizer(path: Path, text_vocab: int) -> Path:
    """The shipped tiny tokenizer grown to `text_vocab` tokens with `<image>` added at `text_vocab`,
    the layout of Hugging Face's PaliGemma tokenizer.json (257152 text tokens, `<image>` at 257152)."""
    spec = json.loads(tiny_tokenizer_path().read_text())
    vocab = spec["model"]["vocab"]
    for i in range(len(vocab), text_vocab):
        vocab[f"<unused{i}>"] = i
    spec["added_tokens"].append({"id": text_vocab, "content": "<image>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    path.write_text(json.dumps(spec))
    return path


# -- the tokenizer ---------------------------------------------------------------------------
@pytest.fixture
def paligemma_vocab_folder(adapter: PI05Adapter, tmp_path: Path) -> Path:
    """A native folder of a small model that embeds PaliGemma's whole vocabulary (a narrow prefix
    keeps the embedding at 16 MB), with a PaliGemma-shaped tokenizer.json."""
    cfg = dataclasses.replace(tiny(), vocab_size=PALIGEMMA_VOCAB,
                              prefix=GemmaSpec(width=16, depth=2, mlp_dim=32, num_heads=2, num_kv_heads=1, head_dim=16))
    small = PI05Adapter(cfg, seeded_model(cfg), adapter.tokenizer, adapter.io)
    folder = save_native(small, tmp_path / "native")
    _paligemma_like_tokenizer(folder / "tokenizer.json", PALIGEMMA_VOCAB)
    return folder


def test_hugging_face_paligemma_tokenizer_loads(paligemma_vocab_folder: Path) -> None:
    """Its `<image>` token sits at 257152, one past the rows PI0.5 embeds: counted, the tokenizer
    LeRobot trains with was refused ("tokenizer has 257153 tokens but the model embeds 257152").
    A prompt that spells `<image>` out is refused by name, not sent to the embedding."""
    loaded = load_pi05(paligemma_vocab_folder)
    assert loaded.tokenizer.vocab_size == PALIGEMMA_VOCAB
    plain = PromptTokenizer(tiny_tokenizer_path())
    ids, mask = loaded.prompt_tokens([_obs(loaded, "fold the towel")])
    n = int(mask.sum())
    text = loaded._prompt_text(_obs(loaded, "fold the towel"), 0)
    assert ids[0, :n].tolist() == [plain.bos_id, *plain.encode_plain(text)]  # the text ids are unchanged
    with pytest.raises(ValueError, match=r"'<image>'.*no embedding"):
        loaded.preprocess([_obs(loaded, "look at <image> now")])
    with pytest.raises(ValueError, match="'<image>'"):
        loaded.longest_prompt_tokens("look at <image> now")  # the daemon's check of a new instruction


def test_a_foreign_tokenizer_is_refused_for_a_paligemma_vocabulary(paligemma_vocab_folder: Path) -> None:
    """Any tokenizer no larger than the embedding used to load, and another model's ids would index
    rows trained for other tokens: garbage prompts, no error."""
    (paligemma_vocab_folder / "tokenizer.json").write_bytes(tiny_tokenizer_path().read_bytes())
    with pytest.raises(CheckpointError, match=r"not the PaliGemma tokenizer.*257152"):
        load_pi05(paligemma_vocab_folder)


# -- normaliser statistics -------------------------------------------------------------------
def test_lerobot_statistics_of_another_width_are_named_at_load(adapter: PI05Adapter, tmp_path: Path) -> None:
    """Statistics whose width differs from config.json's feature shape loaded, and the first
    observation (the daemon: its warm-up) failed with a bare 'expected last dimension 32'."""
    folder = write_lerobot(adapter, tmp_path / "lr")
    (pre,) = folder.glob("policy_preprocessor*normalizer_processor.safetensors")
    stats = load_file(str(pre))
    stats["observation.state.q01"] = np.zeros(32, np.float32)
    stats["observation.state.q99"] = np.ones(32, np.float32)
    save_file(stats, str(pre))
    with pytest.raises(CheckpointError, match=re.escape(pre.name) + r".*observation\.state\.q01 has 32 values.*\[14\]"):
        load_pi05(folder, structure="tiny")


def test_lerobot_missing_statistics_name_the_files_looked_in(adapter: PI05Adapter, tmp_path: Path) -> None:
    folder = write_lerobot(adapter, tmp_path / "lr")
    for f in folder.glob("policy_*processor*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match=r"policy_preprocessor\*normalizer_processor\.safetensors.*"
                                              r"observation\.state\.q01"):
        load_pi05(folder, structure="tiny")


def test_native_statistics_of_another_width_are_refused_at_load(adapter: PI05Adapter, tmp_path: Path) -> None:
    folder = save_native(adapter, tmp_path / "native")
    stats = json.loads((folder / "norm_stats.json").read_text())
    stats["action"]["q01"] = stats["action"]["q01"][:7]
    stats["action"]["q99"] = stats["action"]["q99"][:7]
    (folder / "norm_stats.json").write_text(json.dumps(stats))
    with pytest.raises(CheckpointError, match=r"action statistics have 7 values, the robot's action 14"):
        load_pi05(folder)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"q01": [0.0, 0.0], "q99": [1.0]}, "unequal length: q01 has 2, q99 has 1"),
    ({"q01": [0.0, np.nan], "q99": [1.0, 1.0]}, "NaN or Inf values in q01"),
    ({"q01": [0.0, 2.0, 1.0], "q99": [1.0, 1.0, 1.0]}, "q01 is above q99 at index 1$"),
    ({"mode": "mean_std", "mean": [0.0, 0.0], "std": [-1.0, 1.0]}, "std is negative at index 0$"),
    ({"mode": "minmax", "q01": [0.0], "q99": [1.0]}, "mode 'minmax' is not one of quantile, mean_std, identity"),
])
def test_broken_statistics_are_refused_where_they_are_made(kwargs: dict[str, Any], match: str) -> None:
    """Unequal arrays broadcast or fail mid-run; a NaN only shows as NaN actions; an inverted
    spread mirrors the robot's space; an unknown mode failed at the first observation."""
    with pytest.raises(ValueError, match=match):
        NormStats(**{"mode": "quantile", **kwargs})


def test_a_zero_spread_is_kept_as_the_published_loaders_keep_it() -> None:
    """A joint that never moved in the data has q01 == q99 (or std 0): LeRobot and openpi divide
    by an epsilon there, and such checkpoints must still load."""
    q = NormStats("quantile", q01=[0.5, -1.0], q99=[0.5, 1.0])
    assert np.allclose(q.unnormalize(np.zeros(2)), [0.5, 0.0])
    m = NormStats("mean_std", mean=[2.0], std=[0.0])
    assert np.allclose(m.unnormalize(np.ones(1)), [2.0])


def _openpi_stats(folder: Path) -> tuple[Path, dict]:
    (path,) = folder.glob("assets/*/norm_stats.json")
    return path, json.loads(path.read_text())


@pytest.mark.parametrize("part", ["state", "actions"])
def test_openpi_statistics_without_quantiles_are_refused(adapter: PI05Adapter, tmp_path: Path, part: str) -> None:
    """openpi normalises PI0.5 with q01/q99. Without them the loader read mean/std instead, and
    without them in one part it read both parts as mean/std: another scale, no error."""
    folder = write_openpi(adapter, tmp_path / "openpi")
    path, stats = _openpi_stats(folder)
    del stats["norm_stats"][part]["q01"]
    path.write_text(json.dumps(stats))
    with pytest.raises(CheckpointError, match=rf"norm_stats\.json: no {part}\.q01.*quantiles"):
        load_pi05(folder, structure="tiny")


def test_openpi_without_config_json_says_what_it_assumes(adapter: PI05Adapter, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """openpi's PyTorch trainer writes no config.json: the action horizon, which no tensor's shape
    records, was taken to be 50 without a word (pi05_libero is trained at 10)."""
    folder = write_openpi(adapter, tmp_path / "openpi")
    with caplog.at_level(logging.WARNING, logger="phyai_edge.adapters.pi05.loaders"):
        load_pi05(folder, structure="tiny")
    assert any("no config.json" in r.message and "action_horizon" in r.message for r in caplog.records)
    caplog.clear()
    (folder / "config.json").write_text(json.dumps({"action_horizon": 10, "action_dim": 32}))
    with caplog.at_level(logging.WARNING, logger="phyai_edge.adapters.pi05.loaders"):
        loaded = load_pi05(folder, structure="tiny")
    # (the folder's assets are named trossen, as openpi's ALOHA ones: that line is another matter)
    assert loaded.chunk_size == 10 and not [r for r in caplog.records if "robot_space=aloha" not in r.message]


# -- the state in the prompt -----------------------------------------------------------------
def _state_values(adapter: PI05Adapter, obs: Observation) -> list[str]:
    text = adapter._prompt_text(obs, 0)
    return text.split("State: ")[1].split(";")[0].split()


def test_padded_prompt_state_takes_the_state_width(adapter: PI05Adapter, tmp_path: Path) -> None:
    """LeRobot v0.4.x padded the state to max_state_dim before writing it (pad_vector(state,
    max_state_dim)); the adapter padded to max_action_dim, which a config may set apart."""
    folder = write_lerobot(adapter, tmp_path / "lr", config_extra={"max_state_dim": 20})
    loaded = load_adapter("pi05", {"prompt_state": "padded"}, checkpoint=folder, structure="tiny")
    assert (loaded.cfg.max_state_dim, loaded.cfg.max_action_dim) == (20, 32)
    obs = _obs(loaded)
    values = _state_values(loaded, obs)
    assert len(values) == 20 and values[14:] == ["128"] * 6
    _, mask = loaded.prompt_tokens([obs])
    assert int(mask.sum()) <= loaded.longest_prompt_tokens(obs.prompt)


def test_openpi_state_width_is_its_one_width(adapter: PI05Adapter, tmp_path: Path) -> None:
    """openpi pads state and actions to one action_dim (PadStatesAndActions), so an older openpi
    policy's padded prompt state has action_dim values: the loader kept the default 32 for the
    state width whatever config.json's action_dim said."""
    cfg = dataclasses.replace(adapter.cfg, max_action_dim=24)
    narrow = PI05Adapter(cfg, seeded_model(cfg), adapter.tokenizer, adapter.io)
    folder = write_openpi(narrow, tmp_path / "openpi")
    (folder / "config.json").write_text(json.dumps({"action_horizon": 50, "action_dim": 24}))
    loaded = load_adapter("pi05", {"prompt_state": "padded"}, checkpoint=folder, structure="tiny")
    assert loaded.cfg.max_state_dim == loaded.cfg.max_action_dim == 24
    assert len(_state_values(loaded, _obs(loaded))) == 24


def test_prompt_state_none_writes_the_bare_instruction(adapter: PI05Adapter, tmp_path: Path) -> None:
    """openpi's pi05_libero (discrete_state_input=False) was trained on BOS + the instruction + "\\n"
    tokenised apart, with no state; its folder does not say so, and no option could give it."""
    folder = write_openpi(adapter, tmp_path / "openpi")
    loaded = load_adapter("pi05", {"prompt_state": "none"}, checkpoint=folder, structure="tiny")
    tok = loaded.tokenizer
    want = [tok.bos_id, *tok.encode_plain("fold the towel"), *tok.encode_plain("\n")]
    a = _obs(loaded, "  fold_the towel\n", state=np.zeros(loaded.state_dim, np.float32))
    b = _obs(loaded, "fold the towel", state=np.full(loaded.state_dim, 0.7, np.float32))
    ids, mask = loaded.prompt_tokens([a, b])
    n = len(want)
    assert ids[0, :n].tolist() == ids[1, :n].tolist() == want  # cleaned as openpi cleans it; no state
    assert mask.sum(axis=1).tolist() == [n, n]
    assert loaded.longest_prompt_tokens("fold the towel") == n
    assert loaded.observation_problem(a) is None
    result = Policy(loaded, EagerEngine(loaded, device="cpu", dtype="float32")).infer(b)
    assert np.isfinite(result.actions).all()
    # A native folder (what a bundle carries) keeps it; folders with the state stay as they were.
    again = load_pi05(save_native(loaded, tmp_path / "native"))
    assert not again.io.state_in_prompt
    assert np.array_equal(again.prompt_tokens([b])[0], ids[1:])
    plain = save_native(load_pi05(folder, structure="tiny"), tmp_path / "plain")
    assert "state_in_prompt" not in json.loads((plain / "phyai_edge.json").read_text())["io"]


# -- folders people point at -----------------------------------------------------------------
def test_folders_next_to_the_checkpoint_say_where_it_is(adapter: PI05Adapter, tmp_path: Path) -> None:
    step = tmp_path / "checkpoints" / "last"  # LeRobot's training output
    write_lerobot(adapter, step / "pretrained_model")
    (step / "training_state").mkdir()
    with pytest.raises(CheckpointError, match=r"pretrained_model"):
        detect_format(step)
    jax = tmp_path / "pi05_libero"  # an openpi JAX checkpoint
    (jax / "params").mkdir(parents=True)
    (jax / "assets").mkdir()
    with pytest.raises(CheckpointError, match=r"openpi JAX checkpoint.*convert_jax_model_to_pytorch"):
        detect_format(jax)
    pi0 = tmp_path / "pi0"
    pi0.mkdir()
    (pi0 / "config.json").write_text(json.dumps({"type": "pi0"}))
    with pytest.raises(CheckpointError, match=r"LeRobot 'pi0' policy, not 'pi05'"):
        detect_format(pi0)


def test_missing_tokenizer_names_the_flags(adapter: PI05Adapter, tmp_path: Path) -> None:
    folder = write_lerobot(adapter, tmp_path / "lr", tokenizer=False)
    with pytest.raises(FileNotFoundError, match=r"--tokenizer.*model\.tokenizer"):
        load_pi05(folder, structure="tiny")


def test_robot_io_statistics_checked_for_any_adapter(adapter: PI05Adapter) -> None:
    io = dataclasses.replace(adapter.io, state_stats=NormStats("quantile", q01=np.zeros(3), q99=np.ones(3)))
    with pytest.raises(ValueError, match="state statistics have 3 values, the robot's state 14"):
        PI05Adapter(adapter.cfg, adapter.module, adapter.tokenizer, io)
