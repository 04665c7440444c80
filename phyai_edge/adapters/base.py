"""What every model adapter provides, and the data that crosses the adapter boundary.

The runtime (engines, control, serve) only sees these types. An adapter owns the model's
semantics: how raw observations become tensors, which static-shape stages the model is made
of, how the solver integrates them, and how a normalised chunk becomes robot actions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch


@dataclass
class Observation:
    """One robot's observation at one instant, as sensors give it.

    images: camera name -> uint8 HWC array (any size) or float CHW array in [0, 1];
        None (or a missing key) means the camera is absent and is masked out.
    state: joint-space state in robot units, shape (state_dim,).
    prompt: the task instruction.
    timestamp: monotonic seconds of the oldest sensor reading that went into it.
    """

    images: Mapping[str, np.ndarray | None]
    state: np.ndarray
    prompt: str
    timestamp: float = 0.0


@dataclass(frozen=True)
class SolverSpec:
    """Flow-matching integration: Euler from t_start (noise) to t_end (actions)."""

    num_steps: int
    t_start: float = 1.0
    t_end: float = 0.0

    def times(self) -> list[float]:
        dt = (self.t_end - self.t_start) / self.num_steps
        return [self.t_start + i * dt for i in range(self.num_steps)]

    @property
    def dt(self) -> float:
        return (self.t_end - self.t_start) / self.num_steps


@dataclass(frozen=True)
class StageSpec:
    """A static-shape stage: named tensor inputs/outputs with shapes and dtypes for one batch size."""

    name: str
    inputs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    outputs: dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass
class ModelInputs:
    """Tensors that feed the first stage, batched. Produced by `Adapter.preprocess`.

    extras: host-side data the adapter keeps for itself beside the tensors (PI0.5: the camera
    mask, and the raw robot states (B, state_dim) float32 under `states`, which `Policy` also
    hands to `normalize_actions` for the RTC prefix)."""

    tensors: dict[str, torch.Tensor]
    batch_size: int
    extras: dict[str, Any] = field(default_factory=dict)

    def to(self, device: torch.device | str) -> ModelInputs:
        return ModelInputs({k: v.to(device) for k, v in self.tensors.items()}, self.batch_size, self.extras)


class Adapter(Protocol):
    """The contract between a model and the runtime. One module per model implements it.

    Optional methods the runtime uses where an adapter has them (`Policy`):
    `longest_prompt_tokens(prompt)`, the most prompt tokens any robot state can make, counted
    before truncation (so graphs captured at warm-up fit every state); `max_prompt_tokens`, the
    most the model takes (longer is truncated; with the former, a prompt set at run time is
    checked); and `drop_cameras(inputs, names)`, `preprocess`'s inputs without the slots of
    cameras no observation has, for a model whose result does not depend on them (PI0.5).

    Optional arguments, passed only to an adapter whose method names them (so one written before
    them need not take them): `postprocess(chunk, inputs=...)` gets the `ModelInputs` its chunk
    came from, for a model whose actions depend on the observation beyond the chunk (PI0.5
    trained on relative actions adds the observed state back); `normalize_actions(actions,
    states=...)` gets the new observations' raw states (`extras["states"]`, broadcast against
    the actions' leading dims) when it turns an RTC prefix into model space."""

    name: str
    chunk_size: int  # H: actions per chunk
    model_action_dim: int  # padded action width the model integrates over
    action_dim: int  # robot action width after postprocess
    state_dim: int  # robot state width `preprocess` expects
    camera_names: list[str]  # camera slots, in the order the model sees them
    solver: SolverSpec
    module: torch.nn.Module

    def stage_names(self) -> list[str]: ...

    def stage(self, name: str) -> Callable[..., Any]: ...

    def stage_specs(self, batch_size: int, num_views: int | None = None) -> list[StageSpec]:
        """The stages in execution order, as the engines run them (`engines/stages.py`): every
        stage but the last runs once per chunk and takes its inputs by name from
        `preprocess`'s tensors and earlier stages' outputs; the last is the solver's velocity
        step, whose first two inputs are x_t (B, H, model_action_dim) and t (B,). Each stage
        is a method of `module` with the stage's name (what the ONNX exporter traces)."""
        ...

    def preprocess(self, observations: list[Observation], device: torch.device | str = "cpu") -> ModelInputs: ...

    def postprocess(self, chunk: torch.Tensor) -> np.ndarray: ...

    def normalize_actions(self, actions: np.ndarray) -> torch.Tensor: ...
