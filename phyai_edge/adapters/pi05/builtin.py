"""The embedded default: the tiny PI0.5 preset with seeded random weights, the shipped tiny
tokenizer and identity-like statistics, for a 14-joint bimanual robot with three camera slots.
It makes `phyai-edge run` work on a fresh machine; it is not a trained policy."""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from phyai_edge.adapters.normalization import NormStats
from phyai_edge.adapters.pi05.adapter import PI05Adapter, RobotIO
from phyai_edge.adapters.pi05.config import PI05Config, preset
from phyai_edge.adapters.pi05.model import PI05Model
from phyai_edge.adapters.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)

DEFAULT_CAMERAS = ["top", "left_wrist", "right_wrist"]
DEFAULT_DIM = 14


def tiny_tokenizer_path() -> Path:
    return Path(str(resources.files("phyai_edge") / "assets" / "tiny_tokenizer.json"))


def seeded_model(cfg: PI05Config, seed: int = 0) -> PI05Model:
    """Random weights that are the same on every machine for a given seed."""
    gen = torch.Generator().manual_seed(seed)
    model = PI05Model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # biases and RMSNorm offsets (used as 1 + w): small
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):  # LayerNorm scales multiply directly
                m.weight.add_(1.0)
    return model


def seeded_model_on(device: str | torch.device, cfg: PI05Config, seed: int = 0) -> PI05Model:
    """The same init as `seeded_model`, drawn on `device` with that device's generator: the full
    size in seconds on a GPU, for benchmarks. The values differ from `seeded_model`'s CPU draw."""
    with torch.device(device):
        model = PI05Model(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(0.0, 0.05, generator=gen)
            else:
                p.normal_(0.0, 1.0 / p[0].numel() ** 0.5, generator=gen)
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.add_(1.0)
    return model


def builtin_adapter(
    preset_name: str = "tiny",
    seed: int = 0,
    camera_names: list[str] | None = None,
    state_dim: int = DEFAULT_DIM,
    action_dim: int = DEFAULT_DIM,
    prompt: str = "pick up the cube",
    device: str | torch.device | None = None,
) -> PI05Adapter:
    """The tiny preset: seeded weights drawn on the CPU (the same values on every machine). The
    full preset has no weights to ship: on the meta device (structure and parameter counts) unless
    `device` names a real one, where seeded random weights are drawn directly (`seeded_model_on`:
    for timing a full-size engine without a checkpoint; not a trained policy)."""
    cfg = preset(preset_name)
    if preset_name == "full":
        if device is None or torch.device(device).type == "meta":
            with torch.device("meta"):
                model = PI05Model(cfg)
        else:
            log.info("pi05 preset 'full' without a checkpoint: seeded random weights on %s (timing only, "
                     "not a trained policy)", device)
            model = seeded_model_on(device, cfg, seed)
    else:
        model = seeded_model(cfg, seed)
    lo, hi = -np.ones(action_dim, np.float32), np.ones(action_dim, np.float32)
    io = RobotIO(
        camera_names=list(camera_names or DEFAULT_CAMERAS),
        state_dim=state_dim,
        action_dim=action_dim,
        state_stats=NormStats("quantile", q01=-np.ones(state_dim, np.float32), q99=np.ones(state_dim, np.float32)),
        action_stats=NormStats("quantile", q01=lo, q99=hi),
        default_prompt=prompt,
    )
    return PI05Adapter(cfg, model, PromptTokenizer(tiny_tokenizer_path()), io)
