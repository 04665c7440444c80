"""The `Engine` interface every backend implements, and what an inference returns.

An engine runs an adapter's stages and the solver loop (with Real-Time Chunking guidance).
It knows nothing of cameras, sockets or robots.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from phyai_edge.adapters.base import ModelInputs
from phyai_edge.engines.rtc import RTC_MODES, SOLVER_RTC_MODES, RTCGuidance, RTCMode

__all__ = ["RTC_MODES", "SOLVER_RTC_MODES", "Engine", "EngineBase", "InferenceResult", "RTCMode", "RTCRequest"]



@dataclass
class RTCRequest:
    """What the solver needs to join a new chunk onto the one still executing.

    prefix: actions of the executing chunk that the new chunk must agree with, aligned so
        that prefix[i] is the action that will run at index i of the new chunk. Robot
        units, shape (n, action_dim) or (B, n, action_dim); n <= H. Rows past n are free.
    delay: d, the number of actions that will execute while this inference runs (they are
        fixed: the new chunk takes over at index d).
    execution_horizon: s, how many actions of a chunk run before the next inference
        starts; actions in [d, min(H - s, n)) are softly guided (the soft mask decays to 0
        where the executing chunk ends: a prefix shorter than H - s means more than s ran),
        the rest are free.
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


# module -> the engine running it. Kept outside the module so a copy.deepcopy of the model (a
# reference twin) starts unowned.
_OWNERS: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


class EngineBase:
    """What every backend holds the same way: the adapter, the device, a seeded noise stream
    (so a seed gives the same chunks on every backend) and the stage times of the last run."""

    backend = "base"
    # Takes per-sample RTC: (B, H) soft masks and (B,) hard-prefix lengths in one call. Every
    # built-in backend does (the shared solver loop masks per sample; cudagraph and TensorRT
    # hold per-sample static buffers); a backend that cannot sets False and the batchers then
    # give it only requests with equal masks.
    per_sample_rtc = True
    # Runs the adapter's stages for any number of camera views (each view count its own shapes),
    # so `Policy` may drop camera slots no observation has (`Adapter.drop_cameras`). Backends built
    # for a fixed view count (ONNX, TensorRT, cudagraph's generic path) leave it False.
    any_views = False

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

    def take_module(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        """Become the engine that runs `module`, refusing when a live engine already runs it in a
        way this one would break: setting another precision or device re-creates the weights under
        the first engine (a captured CUDA graph would then read freed memory)."""
        ref = _OWNERS.get(module)
        owner = ref() if ref is not None else None
        if owner is not None and owner is not self:
            same = (owner.device, getattr(owner, "dtype", None)) == (self.device, dtype)
            if not same or "cudagraph" in (owner.backend, self.backend):
                raise RuntimeError(
                    f"this adapter's model is already run by a {owner.backend} engine "
                    f"({getattr(owner, 'dtype', '?')} on {owner.device}); a {self.backend} engine "
                    f"({dtype} on {self.device}) would change the weights under it. Give each engine "
                    "its own adapter (load it again, or copy.deepcopy(adapter.module))."
                )
        _OWNERS[module] = weakref.ref(self)

    def sample_noise(self, batch: int) -> torch.Tensor:
        a = self.adapter
        return torch.randn(batch, a.chunk_size, a.model_action_dim, generator=self.generator, device=self.device)

