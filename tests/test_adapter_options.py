"""The adapter's user options (`adapters.load_adapter(name, options)`; the CLI's
`--adapter-option`, the daemon's `[model.adapter_options]`): PI0.5's `prompt_state` for policies
fine-tuned with LeRobot v0.4.x, which wrote the state zero-padded to 32 values into the prompt."""

from __future__ import annotations

import numpy as np
import pytest

from phyai_edge.adapters import load_adapter
from phyai_edge.adapters.base import Observation
from phyai_edge.cli import main as cli
from phyai_edge.engines.policy import load_policy


def _tokens(adapter) -> int:
    obs = Observation({"top": np.zeros((224, 224, 3), np.uint8)}, np.zeros(adapter.state_dim, np.float32), "go")
    _, mask = adapter.prompt_tokens([obs])
    return int(mask.sum())


def test_prompt_state_padded_writes_the_state_at_the_models_width():
    own = load_adapter("pi05", preset_name="tiny")
    padded = load_adapter("pi05", {"prompt_state": "padded"}, preset_name="tiny")
    assert not own.io.pad_state_in_prompt and padded.io.pad_state_in_prompt
    # 14 state values against the model's 32: 18 more numbers in the prompt, each at least a token.
    assert _tokens(padded) >= _tokens(own) + 18
    assert not load_adapter("pi05", {"prompt_state": "robot"}, preset_name="tiny").io.pad_state_in_prompt
    # What the daemon's [model.adapter_options] and the CLI's --adapter-option reach.
    assert load_policy(preset="tiny", adapter_options={"prompt_state": "padded"}).adapter.io.pad_state_in_prompt


def test_a_wrong_option_or_value_is_named():
    with pytest.raises(ValueError, match=r"adapter 'pi05' has no option 'prompt_stat' \(its options: prompt_state:"):
        load_adapter("pi05", {"prompt_stat": "padded"}, preset_name="tiny")
    with pytest.raises(ValueError, match=r"prompt_state 'pad': choose one of robot, padded"):
        load_adapter("pi05", {"prompt_state": "pad"}, preset_name="tiny")


def test_a_bundle_takes_the_options_it_was_exported_with(tmp_path, capsys):
    """Export with the option: the bundle's checkpoint folder keeps it, so its policy writes the
    padded prompt with no option at load time; an option given at load time is refused."""
    pytest.importorskip("onnxruntime")
    out = tmp_path / "b"
    assert cli(["export", "--preset", "tiny", "--out", str(out), "--steps", "2", "--holdout", "1", "--no-progress",
                "--adapter-option", "prompt_state=padded"]) == 0
    policy = load_policy(bundle=out)
    assert policy.adapter.io.pad_state_in_prompt
    with pytest.raises(ValueError, match="apply when a bundle is exported"):
        load_policy(bundle=out, adapter_options={"prompt_state": "padded"})
    capsys.readouterr()
    with pytest.raises(SystemExit) as err:
        cli(["bench", "--preset", "tiny", "--adapter-option", "prompt_state"])
    assert err.value.code == 2
    assert "--adapter-option 'prompt_state': expected NAME=VALUE" in capsys.readouterr().err


def test_bench_runs_a_policy_on_relative_actions(capsys):
    """`phyai-edge bench` postprocesses each chunk with the inputs it came from: a relative policy
    adds the observed state back there, and without them it raised."""
    assert cli(["bench", "--preset", "tiny", "--adapter-option", "relative_actions=6,-1,6,-1",
                "--iters", "1", "--warmup", "0", "--json"]) == 0
    assert '"postprocess"' in capsys.readouterr().out
