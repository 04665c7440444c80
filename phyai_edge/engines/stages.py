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

Engines that bind one static buffer per tensor (TensorRT) take `static_plan` (who writes each
tensor, at one batch size) and `batch_axes` (each tensor's batch axis, for batch-dynamic export
and optimisation profiles) from here too.
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


Shape = tuple[int, ...]


@dataclass(frozen=True)
class StaticPlan:
    """The graph at one batch size laid out for engines that bind one static buffer per tensor
    name (TensorRT contexts, captured graphs): who writes each tensor, in which order.

    feeds: tensors copied in from `preprocess` once per chunk (inputs that no stage writes),
        in first-use order. The solver writes the step's x_t and t before every step; each other
        tensor is written by exactly one stage (`writers`).
    io: stage -> (input names, output names), in spec order; the dict is in execution order.
    tensors: every name -> (shape, dtype) as the adapter's specs declare it.
    """

    batch: int
    graph: StageGraph
    feeds: tuple[str, ...]
    step_out: str
    io: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]
    tensors: dict[str, tuple[Shape, torch.dtype]]
    writers: dict[str, str]  # name -> "preprocess", "solver" or the stage that outputs it

    @property
    def prefix(self) -> list[str]:
        return [p[0] for p in self.graph.prefix]


def static_plan(adapter: Any, batch: int, num_views: int | None = None) -> StaticPlan:
    """`adapter`'s stages at `batch` as a static-buffer plan, refusing specs that cannot share
    buffers by name: a name with two shapes or dtypes, two writers, or a step without exactly one
    chunk-shaped output."""
    graph = stage_graph(adapter)
    specs = adapter.stage_specs(batch, num_views)
    if [s.name for s in specs] != graph.names:
        raise ValueError(f"stage_specs({batch}) lists {[s.name for s in specs]}, at batch 1 {graph.names}")
    tensors: dict[str, tuple[Shape, torch.dtype]] = {}
    writers: dict[str, str] = {}
    feeds: list[str] = []

    def declare(stage: str, name: str, shape: Any, dtype: torch.dtype) -> None:
        shape = tuple(int(d) for d in shape)
        prev = tensors.setdefault(name, (shape, dtype))
        if prev != (shape, dtype):
            raise ValueError(f"tensor {name!r} is {prev[0]} {prev[1]} in one stage and {shape} {dtype} in "
                             f"{stage!r}: one name is one buffer")

    def write(stage: str, name: str) -> None:
        if name in writers:
            raise ValueError(f"stage {stage!r} outputs {name!r}, which {writers[name]} already writes")
        writers[name] = stage

    *pre, step = specs
    x, t = graph.step_x, graph.step_t
    for spec in pre:
        for name, (shape, dtype) in spec.inputs.items():
            declare(spec.name, name, shape, dtype)
            if name not in writers:
                writers[name] = "preprocess"
                feeds.append(name)
        for name, (shape, dtype) in spec.outputs.items():
            declare(spec.name, name, shape, dtype)
            write(spec.name, name)
    for name in (x, t):
        if name in writers:
            raise ValueError(f"{name!r} is the step's {'x_t' if name == x else 't'}, which the solver writes every "
                             f"step; {writers[name]} writes it too")
    for name, (shape, dtype) in step.inputs.items():
        declare(step.name, name, shape, dtype)
        if name in (x, t):
            writers[name] = "solver"
        elif name not in writers:
            writers[name] = "preprocess"
            feeds.append(name)
    chunk = (batch, adapter.chunk_size, adapter.model_action_dim)
    if tensors[x][0] != chunk or tensors[t][0] != (batch,):
        raise ValueError(f"stage {step.name!r} at batch {batch} takes {x} {tensors[x][0]} and {t} {tensors[t][0]}; "
                         f"the solver gives {chunk} and {(batch,)}")
    outs = list(step.outputs.items())
    if len(outs) != 1 or tuple(outs[0][1][0]) != chunk:
        raise ValueError(f"stage {step.name!r} is the velocity step: it must output one tensor of shape {chunk}, "
                         f"it declares {[(n, tuple(s)) for n, (s, _) in outs]}")
    declare(step.name, outs[0][0], *outs[0][1])
    write(step.name, outs[0][0])
    return StaticPlan(batch=batch, graph=graph, feeds=tuple(feeds), step_out=outs[0][0],
                      io={s.name: (tuple(s.inputs), tuple(s.outputs)) for s in specs}, tensors=tensors,
                      writers=writers)


def batch_axes(adapter: Any, num_views: int | None = None) -> dict[str, int | None]:
    """Tensor name -> its batch axis (None: no batch axis), found by comparing the specs at batch
    1 and batch 2: the one axis whose size changes. Most tensors carry the batch on axis 0,
    PI0.5's per-layer KV caches on axis 1; the exporter marks that axis dynamic."""
    shapes = [{n: tuple(sh) for s in adapter.stage_specs(b, num_views)
               for n, (sh, _) in [*s.inputs.items(), *s.outputs.items()]} for b in (1, 2)]
    axes: dict[str, int | None] = {}
    for name, one in shapes[0].items():
        two = shapes[1].get(name)
        if two is None or len(two) != len(one):
            raise ValueError(f"tensor {name!r} is {one} at batch 1 but {two} at batch 2")
        changed = [i for i, (p, q) in enumerate(zip(one, two)) if p != q]
        if len(changed) > 1 or any(two[i] != 2 * one[i] for i in changed):
            raise ValueError(f"tensor {name!r} is {one} at batch 1 and {two} at batch 2: a batch-dynamic export "
                             "needs one axis that scales with the batch")
        axes[name] = changed[0] if changed else None
    return axes
