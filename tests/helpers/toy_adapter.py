"""A second model adapter that is not PI0.5, written only against `phyai_edge/adapters/base.py`.

A tiny flow-matching policy: a conv image encoder pooled over the present cameras, joined with
an MLP over the normalised state into one conditioning vector (`encode_obs`, once per chunk), and
an MLP velocity field over the action chunk (`velocity`, once per flow step). No tokenizer: the
prompt is ignored. Two stages with their own names and tensor names, its own config, its own
checkpoint folder (`toy.json` + `model.safetensors`).

Registered the way a new model is added: `phyai_edge.adapters.ADAPTERS["toy"] =
"helpers.toy_adapter"` (tests do it with monkeypatch), which finds `load_adapter` here, and
`save_bundle_checkpoint` / `load_bundle_adapter` for engine bundles.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from phyai_edge.adapters.base import ModelInputs, Observation, SolverSpec, StageSpec

STAGES = ("encode_obs", "velocity")


@dataclass
class ToyConfig:
    preset: str = "tiny"
    image_size: int = 16
    channels: int = 8
    hidden: int = 32
    state_dim: int = 5
    action_dim: int = 4
    model_action_dim: int = 6  # padded width the flow integrates over
    chunk_size: int = 12
    num_steps: int = 4
    camera_names: list[str] = field(default_factory=lambda: ["top", "wrist"])
    state_mean: list[float] = field(default_factory=lambda: [0.1, -0.2, 0.0, 0.3, 0.05])
    state_std: list[float] = field(default_factory=lambda: [0.5, 0.8, 1.0, 0.6, 0.9])
    action_mean: list[float] = field(default_factory=lambda: [0.2, -0.1, 0.0, 0.4])
    action_std: list[float] = field(default_factory=lambda: [0.3, 0.7, 0.5, 1.2])


class ToyModel(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        c, h = cfg.channels, cfg.hidden
        self.cfg = cfg
        self.conv1 = nn.Conv2d(3, c, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.img_proj = nn.Linear(c, h)
        self.state_mlp = nn.Sequential(nn.Linear(cfg.state_dim, h), nn.GELU(), nn.Linear(h, h))
        self.act_in = nn.Linear(cfg.model_action_dim, h)
        self.time_mlp = nn.Sequential(nn.Linear(2 * 8, h), nn.GELU(), nn.Linear(h, h))
        self.pos = nn.Parameter(torch.randn(cfg.chunk_size, h) * 0.02)
        self.mlp = nn.Sequential(nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, cfg.model_action_dim))
        self.register_buffer("freqs", torch.exp(torch.linspace(0.0, 4.0, 8)), persistent=False)

    # stage 1: once per chunk
    def encode_obs(self, images: torch.Tensor, image_mask: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        dt = self.pos.dtype  # run in the weights' dtype (the engines cast the module for bf16 / fp16)
        images, state = images.to(dt), state.to(dt)
        b, v = images.shape[:2]
        f = F.gelu(self.conv1(images.flatten(0, 1)))
        f = F.gelu(self.conv2(f)).mean(dim=(2, 3))  # (B*V, C)
        f = self.img_proj(f).reshape(b, v, -1)
        m = image_mask.to(f.dtype)[..., None]
        pooled = (f * m).sum(1) / m.sum(1).clamp(min=1.0)
        return pooled + self.state_mlp(state)

    # stage 2: the velocity field, once per flow step
    def velocity(self, noisy: torch.Tensor, time: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        dt = self.pos.dtype
        ang = time.float()[:, None] * self.freqs.float()[None, :]
        temb = self.time_mlp(torch.cat([ang.sin(), ang.cos()], dim=-1).to(dt))
        h = self.act_in(noisy.to(dt)) + self.pos[None] + (temb + cond.to(dt))[:, None, :]
        return self.mlp(h).float()  # the solver integrates in float32


class ToyAdapter:
    name = "toy"

    def __init__(self, cfg: ToyConfig, model: ToyModel, camera_names: list[str] | None = None) -> None:
        self.cfg, self.module = cfg, model
        self.chunk_size = cfg.chunk_size
        self.model_action_dim = cfg.model_action_dim
        self.action_dim = cfg.action_dim
        self.state_dim = cfg.state_dim
        self.camera_names = list(camera_names or cfg.camera_names)
        self.solver = SolverSpec(cfg.num_steps)
        self._s_mean, self._s_std = (np.asarray(x, np.float32) for x in (cfg.state_mean, cfg.state_std))
        self._a_mean, self._a_std = (np.asarray(x, np.float32) for x in (cfg.action_mean, cfg.action_std))

    def stage_names(self) -> list[str]:
        return list(STAGES)

    def stage(self, name: str) -> Callable[..., Any]:
        if name not in STAGES:
            raise KeyError(f"toy has no stage {name!r}")
        return getattr(self.module, name)

    def stage_specs(self, batch_size: int, num_views: int | None = None) -> list[StageSpec]:
        c, b = self.cfg, batch_size
        nv = num_views or len(self.camera_names)
        s, f32 = c.image_size, torch.float32
        dt = next(self.module.parameters()).dtype
        chunk = ((b, c.chunk_size, c.model_action_dim), f32)
        return [
            StageSpec("encode_obs", {"images": ((b, nv, 3, s, s), f32), "image_mask": ((b, nv), torch.bool),
                                     "state": ((b, c.state_dim), f32)},
                      {"cond": ((b, c.hidden), dt)}),
            StageSpec("velocity", {"noisy": chunk, "time": ((b,), f32), "cond": ((b, c.hidden), dt)},
                      {"vel": chunk}),
        ]

    def preprocess(self, observations: list[Observation], device: torch.device | str = "cpu") -> ModelInputs:
        if not observations:
            raise ValueError("preprocess needs at least one observation")
        s = self.cfg.image_size
        images, masks, states = [], [], []
        for i, obs in enumerate(observations):
            unknown = set(obs.images) - set(self.camera_names)
            if unknown:
                raise ValueError(f"observation {i}: unknown cameras {sorted(unknown)}")
            views, present = [], []
            for name in self.camera_names:
                img = obs.images.get(name)
                if img is None:
                    views.append(torch.zeros(3, s, s))
                    present.append(False)
                    continue
                t = torch.from_numpy(np.ascontiguousarray(img))
                t = t.permute(2, 0, 1).float() / 255.0 if t.dtype == torch.uint8 else t.float()
                views.append(F.interpolate(t[None], size=(s, s), mode="bilinear", align_corners=False)[0])
                present.append(True)
            if not any(present):
                raise ValueError(f"observation {i}: every camera is missing")
            state = np.asarray(obs.state, np.float32).reshape(-1)
            if state.shape[0] != self.state_dim or not np.isfinite(state).all():
                raise ValueError(f"observation {i}: state must be {self.state_dim} finite values, got {state}")
            images.append(torch.stack(views))
            masks.append(present)
            states.append(torch.from_numpy((state - self._s_mean) / self._s_std))
        return ModelInputs({"images": torch.stack(images).to(device),
                            "image_mask": torch.tensor(masks, dtype=torch.bool, device=device),
                            "state": torch.stack(states).to(device)}, len(observations))

    def postprocess(self, chunk: torch.Tensor) -> np.ndarray:
        arr = chunk[..., : self.action_dim].detach().float().cpu().numpy()
        return (arr * self._a_std + self._a_mean).astype(np.float32)

    def normalize_actions(self, actions: np.ndarray | torch.Tensor) -> torch.Tensor:
        arr = actions.detach().cpu().numpy() if isinstance(actions, torch.Tensor) else np.asarray(actions)
        norm = (arr.astype(np.float32) - self._a_mean) / self._a_std
        pad = [(0, 0)] * (norm.ndim - 1) + [(0, self.model_action_dim - norm.shape[-1])]
        return torch.from_numpy(np.pad(norm, pad))


# -- what the runtime looks up in this module -------------------------------------------------
def load_adapter(checkpoint=None, preset_name: str = "tiny", device="cpu", tokenizer=None, camera_names=None,
                 seed: int = 0, **_: Any) -> ToyAdapter:
    if checkpoint is not None:
        return load_bundle_adapter(checkpoint, weights_included=True, camera_names=camera_names)
    if preset_name != "tiny":
        raise ValueError(f"toy has only the 'tiny' preset, not {preset_name!r}")
    cfg = ToyConfig()
    torch.manual_seed(seed)
    return ToyAdapter(cfg, ToyModel(cfg).to(device), camera_names)


def save_bundle_checkpoint(adapter: ToyAdapter, folder, with_weights: bool) -> None:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {**asdict(adapter.cfg), "camera_names": list(adapter.camera_names)}
    (folder / "toy.json").write_text(json.dumps(meta, indent=2))
    if with_weights:
        save_file({k: v.detach().float().cpu().contiguous() for k, v in adapter.module.state_dict().items()},
                  str(folder / "model.safetensors"))


def load_bundle_adapter(folder, weights_included: bool, camera_names=None) -> ToyAdapter:
    folder = Path(folder)
    cfg = ToyConfig(**json.loads((folder / "toy.json").read_text()))
    if not weights_included:
        with torch.device("meta"):
            return ToyAdapter(cfg, ToyModel(cfg), camera_names)
    from safetensors.torch import load_file

    model = ToyModel(cfg)
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    return ToyAdapter(cfg, model, camera_names)
