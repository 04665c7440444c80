"""Observations -> the inputs each stage really sees, recorded from the float32 eager model.

Calibrators need per-stage inputs, not observations: the denoise step's inputs (x_t at every
flow time, the KV cache of that observation) only exist inside the solver loop, so the loop is
run once with a velocity function that records what it is given.
"""

from __future__ import annotations

from collections.abc import Iterator

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
) -> StageSamples:
    """{stage: [ {input name: array}, ... ]} for every group of `batch_size` observations;
    the denoise stage gets one sample per `denoise_every` flow steps."""
    module = adapter.module
    module.eval()
    gen = torch.Generator().manual_seed(seed)
    out: StageSamples = {name: [] for name in adapter.stage_names()}
    embed, encode, step = (adapter.stage(n) for n in ("embed_images", "encode_prefix", "denoise_step"))
    for group in batches(observations, batch_size):
        x = adapter.preprocess(group).tensors
        img = embed(x["images"])
        out["embed_images"].append({"images": x["images"].numpy()})
        k, v, mask = encode(img, x["image_mask"], x["tokens"], x["token_mask"])
        out["encode_prefix"].append({"image_embeds": img.float().numpy(), "image_mask": x["image_mask"].numpy(),
                                     "tokens": x["tokens"].numpy(), "token_mask": x["token_mask"].numpy()})
        counter = {"i": 0}

        def velocity(xt: torch.Tensor, t: torch.Tensor, k=k, v=v, mask=mask, counter=counter) -> torch.Tensor:
            if counter["i"] % denoise_every == 0:
                out["denoise_step"].append({"x_t": xt.numpy().copy(), "t": t.numpy().copy(),
                                            "k_cache": k.float().numpy(), "v_cache": v.float().numpy(),
                                            "prefix_mask": mask.numpy()})
            counter["i"] += 1
            return step(xt, t, k, v, mask)

        noise = torch.randn(len(group), adapter.chunk_size, adapter.model_action_dim, generator=gen)
        integrate(velocity, noise, adapter.solver)
    return out
