"""An adapter's stages as a graph, read from its `stage_specs` by tensor name.

Engines do not hard-code a model's stage names. The convention (see `Adapter.stage_specs`):

- the stages are listed in execution order; every stage but the last runs once per chunk, and
  its inputs are found by name among the preprocessed tensors (`ModelInputs.tensors`) and the
  outputs of earlier stages;
- the last stage is the velocity (denoise) step the solver calls once per flow step: its first
  two inputs are the noisy chunk x_t (B, H, D) and the time t (B,); the rest are found by name
  like the others (e.g. a KV cache written by an earlier stage) and stay fixed over the loop.

PI0.5's `embed_images -> encode_prefix -> denoise_step` is one such graph; another model may
have one prefix stage or five, with its own names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from phyai_edge.engines.timing import StageTimer


@dataclass(frozen=True)
class StageGraph:
    prefix: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...]  # (name, inputs, outputs), once per chunk
    step: str  # the velocity stage
    step_x: str
    step_t: str
    step_context: tuple[str, ...]  # the step's other inputs, produced before the loop

    @property
    def names(self) -> list[str]:
        return [p[0] for p in self.prefix] + [self.step]


def stage_graph(adapter: Any) -> StageGraph:
    """The graph of `adapter`'s stages (names only: batch 1, the adapter's own view count)."""
    views = len(getattr(adapter, "camera_names", ()) or ()) or None
    specs = adapter.stage_specs(1, views)
    if not specs:
        raise ValueError(f"adapter {getattr(adapter, 'name', '?')!r} declares no stages")
    *pre, last = specs
    step_inputs = list(last.inputs)
    if len(step_inputs) < 2:
        raise ValueError(f"the last stage {last.name!r} is the solver's velocity step and must take (x_t, t, ...) "
                         f"as its first two inputs; it declares {step_inputs}")
    (x_shape, _), (t_shape, _) = last.inputs[step_inputs[0]], last.inputs[step_inputs[1]]
    want = (1, adapter.chunk_size, adapter.model_action_dim)
    if tuple(x_shape) != want or tuple(t_shape) != (1,):
        raise ValueError(f"the last stage {last.name!r} must take x_t {want} and t (1,) first (for batch 1); "
                         f"it declares {step_inputs[0]} {tuple(x_shape)} and {step_inputs[1]} {tuple(t_shape)}")
    return StageGraph(
        prefix=tuple((s.name, tuple(s.inputs), tuple(s.outputs)) for s in pre),
        step=last.name, step_x=step_inputs[0], step_t=step_inputs[1], step_context=tuple(step_inputs[2:]),
    )


def _outputs(result: Any) -> tuple[Any, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def run_prefix(
    graph: StageGraph,
    run_stage: Callable[[str, dict[str, torch.Tensor]], Any],
    tensors: dict[str, torch.Tensor],
    device: torch.device,
    timer: StageTimer,
) -> list[torch.Tensor]:
    """Run the once-per-chunk stages, each timed under its own name; returns the step's context
    tensors in its input order. `run_stage(name, feeds)` gets the stage's inputs by name, in spec
    order, on `device`, and returns one tensor or a tuple in spec output order."""
    env: dict[str, torch.Tensor] = dict(tensors)
    for name, inputs, outputs in graph.prefix:
        missing = [n for n in inputs if n not in env]
        if missing:
            raise KeyError(f"stage {name!r} needs {missing}, which neither preprocess nor an earlier stage gives "
                           f"(available: {sorted(env)})")
        with timer.stage(name):
            out = _outputs(run_stage(name, {n: env[n].to(device) for n in inputs}))
        if len(out) != len(outputs):
            raise ValueError(f"stage {name!r} returned {len(out)} tensor(s), its spec declares {list(outputs)}")
        env.update(zip(outputs, out))
    missing = [n for n in graph.step_context if n not in env]
    if missing:
        raise KeyError(f"stage {graph.step!r} needs {missing}, which neither preprocess nor an earlier stage gives")
    return [env[n].to(device) for n in graph.step_context]
