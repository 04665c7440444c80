"""Write tiny PI0.5 checkpoints in the layouts people really have, from an adapter's weights.

The names are written out here from the published layouts (LeRobot 0.6.1's PI05Policy state
dict, openpi's PyTorch conversion), not derived from our loader's key rules.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file as save_np
from safetensors.torch import save_file


def with_moving_stats(adapter, seed: int = 0):
    """`adapter` with quantile statistics that move values (a wrong scale or a skipped
    normalisation then shows in the actions); returned for use as a fixture's value."""
    from phyai_edge.adapters.normalization import NormStats

    io = adapter.io
    rng = np.random.default_rng(seed)
    q01 = rng.uniform(-3, -0.5, io.state_dim).astype(np.float32)
    io.state_stats = NormStats("quantile", q01=q01, q99=q01 + rng.uniform(1, 4, io.state_dim).astype(np.float32))
    a01 = rng.uniform(-2, 0, io.action_dim).astype(np.float32)
    io.action_stats = NormStats("quantile", q01=a01, q99=a01 + rng.uniform(0.5, 3, io.action_dim).astype(np.float32))
    return adapter


PG = "paligemma_with_expert.paligemma."
EX = "paligemma_with_expert.gemma_expert."


def published_name(ours: str, lm_layout: str = "model.language_model.", vision_layout: str = "vision_model.") -> str:
    """Our module name -> the PI0.5 PyTorch checkpoint name (without LeRobot's `model.` prefix)."""
    rules = [
        (r"^vision\.", f"{PG}model.vision_tower.{vision_layout}"),
        (r"^projector\.", f"{PG}model.multi_modal_projector.linear."),
        (r"^embed_tokens\.", f"{PG}{lm_layout}embed_tokens."),
        (r"^prefix_layers\.", f"{PG}{lm_layout}layers."),
        (r"^prefix_norm\.", f"{PG}{lm_layout}norm."),
        (r"^expert_layers\.", f"{EX}model.layers."),
        (r"^expert_norm\.", f"{EX}model.norm."),
    ]
    for pat, repl in rules:
        new, n = re.subn(pat, repl, ours)
        if n:
            return new
    assert re.match(r"^(time_mlp_(in|out)|action_(in|out)_proj)\.", ours), ours
    return ours


def published_state(adapter, *, prefix: str = "model.", lm_layout: str = "model.language_model.",
                    vision_layout: str = "vision_model.", lm_heads: bool = True) -> dict[str, torch.Tensor]:
    cfg = adapter.cfg
    sd = {prefix + published_name(k, lm_layout, vision_layout): v.detach().float().clone().contiguous()
          for k, v in adapter.module.state_dict().items()}
    if lm_heads:  # LeRobot saves both language-model heads; nothing uses them
        sd[prefix + PG + "lm_head.weight"] = sd[prefix + PG + lm_layout + "embed_tokens.weight"].clone()
        sd[prefix + EX + "lm_head.weight"] = torch.randn(cfg.vocab_size, cfg.expert.width)
    return sd


def _stats_arrays(stats, feature: str) -> dict[str, np.ndarray]:
    out = {}
    for name in ("mean", "std", "q01", "q99"):
        val = getattr(stats, name)
        if val is not None:
            out[f"{feature}.{name}"] = np.asarray(val, np.float32)
    return out


def write_lerobot(adapter, folder: Path, *, state: dict | None = None, vision_layout: str = "vision_model.",
                  modes: dict | None = None, tokenizer: bool = True, config_extra: dict | None = None) -> Path:
    """A LeRobot `pi05` policy folder: config.json, model.safetensors (with `model.` names and the
    lm_head tensors), policy_{pre,post}processor normaliser files, the tokenizer."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    io, cfg = adapter.io, adapter.cfg
    inputs = {f"observation.images.{c}": {"type": "VISUAL", "shape": [3, 224, 224]} for c in io.camera_names}
    inputs["observation.state"] = {"type": "STATE", "shape": [io.state_dim]}
    config = {
        "type": "pi05", "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m",
        "dtype": "float32", "chunk_size": cfg.chunk_size, "n_action_steps": cfg.chunk_size,
        "max_state_dim": cfg.max_state_dim, "max_action_dim": cfg.max_action_dim,
        "num_inference_steps": cfg.num_steps, "min_period": cfg.time_min_period, "max_period": cfg.time_max_period,
        "image_resolution": [224, 224], "empty_cameras": 0, "tokenizer_max_length": cfg.max_token_len,
        "input_features": inputs, "output_features": {"action": {"type": "ACTION", "shape": [io.action_dim]}},
        "normalization_mapping": modes or {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"},
        **(config_extra or {}),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state if state is not None else published_state(adapter, vision_layout=vision_layout),
              str(folder / "model.safetensors"))
    pre = {**_stats_arrays(io.state_stats, "observation.state"), **_stats_arrays(io.action_stats, "action")}
    save_np(pre, str(folder / "policy_preprocessor_step_3_normalizer_processor.safetensors"))
    save_np(_stats_arrays(io.action_stats, "action"),
            str(folder / "policy_postprocessor_step_0_unnormalizer_processor.safetensors"))
    (folder / "policy_preprocessor.json").write_text(json.dumps({"name": "policy_preprocessor", "steps": []}))
    if tokenizer:
        (folder / "tokenizer.json").write_bytes(adapter.tokenizer.path.read_bytes())
    return folder


def write_openpi(adapter, folder: Path, *, asset_id: str = "trossen", state: dict | None = None,
                 tokenizer: bool = True) -> Path:
    """An openpi PyTorch folder: model.safetensors without the `model.` prefix (transformers-4
    `paligemma.language_model.model.` layout) and assets/<id>/norm_stats.json."""
    folder = Path(folder)
    (folder / "assets" / asset_id).mkdir(parents=True, exist_ok=True)
    sd = state if state is not None else published_state(adapter, prefix="", lm_layout="language_model.model.",
                                                         lm_heads=False)
    save_file(sd, str(folder / "model.safetensors"))
    io = adapter.io

    def block(s):
        d = {k: np.asarray(getattr(s, k)).tolist() for k in ("mean", "std", "q01", "q99") if getattr(s, k) is not None}
        d.setdefault("mean", [0.0] * len(d["q01"]))
        d.setdefault("std", [1.0] * len(d["q01"]))
        return d

    stats = {"norm_stats": {"state": block(io.state_stats), "actions": block(io.action_stats)}}
    (folder / "assets" / asset_id / "norm_stats.json").write_text(json.dumps(stats))
    if tokenizer:
        (folder / "assets" / asset_id / "tokenizer.json").write_bytes(adapter.tokenizer.path.read_bytes())
    return folder
