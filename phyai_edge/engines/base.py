"""The `Engine` interface every backend implements, and what an inference returns.

An engine runs an adapter's stages and the solver loop (with Real-Time Chunking guidance).
It knows nothing of cameras, sockets or robots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import torch

from phyai_edge.adapters.base import ModelInputs

if TYPE_CHECKING:
    from phyai_edge.engines.rtc import RTCGuidance

RTCMode = Literal["none", "crossfade", "inpaint", "guided-approx", "guided"]
SOLVER_RTC_MODES = ("inpaint", "guided-approx", "guided")


@dataclass
class RTCRequest:
    """What the solver needs to join a new chunk onto the one still executing.

    prefix: actions of the executing chunk that the new chunk must agree with, aligned so
        that prefix[i] is the action that will run at index i of the new chunk. Robot
        units, shape (n, action_dim) or (B, n, action_dim); n <= H. Rows past n are free.
    delay: d, the number of actions that will execute while this inference runs (they are
        fixed: the new chunk takes over at index d).
    execution_horizon: s, how many actions of a chunk run before the next inference
        starts; actions in [d, H - s) are softly guided, the rest are free.
    max_guidance_weight: beta in the RTC paper (guided modes only).
    """

    mode: RTCMode
    prefix: np.ndarray | torch.Tensor
    delay: int
    execution_horizon: int
    max_guidance_weight: float = 5.0


@dataclass
class InferenceResult:
    """actions: robot units, (B, H, action_dim) float32. chunk: the model-space chunk (B, H, D)."""

    actions: np.ndarray
    chunk: torch.Tensor
    stage_ms: dict[str, float] = field(default_factory=dict)


class Engine(Protocol):
    """Runs adapter stages + the solver. `run` returns the model-space chunk (B, H, D)."""

    backend: str
    device: torch.device

    def run(
        self,
        inputs: ModelInputs,
        noise: torch.Tensor | None = None,
        rtc: RTCGuidance | None = None,
    ) -> torch.Tensor: ...

    @property
    def last_stage_ms(self) -> dict[str, float]: ...


class EngineBase:
    """What every backend holds the same way: the adapter, the device, a seeded noise stream
    (so a seed gives the same chunks on every backend) and the stage times of the last run."""

    backend = "base"

    def __init__(self, adapter: Any, device: str | torch.device, seed: int) -> None:
        self.adapter = adapter
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._stage_ms: dict[str, float] = {}

    @property
    def last_stage_ms(self) -> dict[str, float]:
        return dict(self._stage_ms)

    def sample_noise(self, batch: int) -> torch.Tensor:
        a = self.adapter
        return torch.randn(batch, a.chunk_size, a.model_action_dim, generator=self.generator, device=self.device)

