"""Observations -> the inputs each stage really sees, recorded from the float32 eager model.

Calibrators need per-stage inputs, not observations: the denoise step's inputs (x_t at every
flow time, the KV cache of that observation) only exist inside the solver loop, so the loop is
run once with a velocity function that records what it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from phyai_edge.adapters.base import Adapter, Observation
from phyai_edge.engines.solver import integrate

StageSamples = dict[str, list[dict[str, np.ndarray]]]


def batches(observations: list[Observation], batch_size: int) -> Iterator[list[Observation]]:
    """Consecutive groups of `batch_size`; the last is filled by repeating from the start so
    every group has the static batch the engine was built for."""
    if not observations:
        return
    for i in range(0, len(observations), batch_size):
        group = observations[i:i + batch_size]
        while len(group) < batch_size:
            group.append(observations[(len(group)) % len(observations)])
        yield group


@torch.no_grad()
def collect_stage_inputs(
    adapter: Adapter,
    observations: list[Observation],
    batch_size: int = 1,
    seed: int = 0,
    denoise_every: int = 1,
    on_stage: Callable[[str], None] | None = None,
) -> StageSamples:
    """{stage: [ {input name: array}, ... ]} for every group of `batch_size` observations;
    the denoise stage gets one sample per `denoise_every` flow steps. `on_stage(name)` is called
    before each stage runs (to attribute what a hook sees to its stage)."""
    from phyai_edge.engines.stages import stage_graph

    module = adapter.module
    module.eval()
    gen = torch.Generator().manual_seed(seed)
    out: StageSamples = {name: [] for name in adapter.stage_names()}
    # The adapter's stages by name, as the engines run them (PI0.5: embed_images -> encode_prefix
    # -> denoise_step); floating tensors are recorded in float32.
    graph = stage_graph(adapter)
    step = adapter.stage(graph.step)
    for group in batches(observations, batch_size):
        env = dict(adapter.preprocess(group).tensors)
        for name, inputs, outputs in graph.prefix:
            feeds = {n: env[n] for n in inputs}
            if on_stage is not None:
                on_stage(name)
            result = adapter.stage(name)(*feeds.values())
            out[name].append({n: _np(t) for n, t in feeds.items()})
            env.update(zip(outputs, result if isinstance(result, (tuple, list)) else (result,)))
        context = [env[n] for n in graph.step_context]
        counter = {"i": 0}

        def velocity(xt: torch.Tensor, t: torch.Tensor, context=context, counter=counter) -> torch.Tensor:
            if counter["i"] % denoise_every == 0:
                out[graph.step].append({graph.step_x: xt.numpy().copy(), graph.step_t: t.numpy().copy(),
                                        **{n: _np(c) for n, c in zip(graph.step_context, context)}})
            counter["i"] += 1
            if on_stage is not None:
                on_stage(graph.step)
            return step(xt, t, *context)

        noise = torch.randn(len(group), adapter.chunk_size, adapter.model_action_dim, generator=gen)
        integrate(velocity, noise, adapter.solver)
    return out


def _np(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy() if t.is_floating_point() else t.numpy()
