"""How far an engine's chunks are from a reference engine's, on the same inputs and noise."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from phyai_edge.adapters.base import Adapter, Observation
from phyai_edge.engines.stage_inputs import batches


def reference_engine(adapter: Adapter, dtype: str = "float32", device: str = "cpu") -> Any:
    """An eager engine at `dtype` that does not disturb `adapter.module` (casting the shared
    module to bf16 and back would lose the float32 weights everything else compares to)."""
    from phyai_edge.engines.eager import EagerEngine

    if dtype in ("float32", "fp32"):
        return EagerEngine(adapter, device=device, dtype="float32")
    twin = copy.copy(adapter)
    twin.module = copy.deepcopy(adapter.module)
    return EagerEngine(twin, device=device, dtype=dtype)


@torch.no_grad()
def compare_engines(
    adapter: Adapter,
    engine: Any,
    reference: Any,
    observations: list[Observation],
    batch_size: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """Model-space chunk errors over `observations` (grouped by the engine's batch size):
    max and mean absolute error, RMSE, and RMSE relative to the reference chunk's RMS. The
    last group's filler rows (repeats, for the engine's static batch) are run but not counted."""
    gen = torch.Generator().manual_seed(seed)
    max_abs, sum_abs, sum_sq, ref_sq, count, n = 0.0, 0.0, 0.0, 0.0, 0, 0
    left = len(observations)
    for group in batches(list(observations), batch_size):
        inputs = adapter.preprocess(group)
        noise = torch.randn(len(group), adapter.chunk_size, adapter.model_action_dim, generator=gen)
        real = min(len(group), left)
        left -= real
        ref = reference.run(inputs, noise=noise).float().cpu()[:real, ..., : adapter.action_dim]
        out = engine.run(inputs, noise=noise).float().cpu()[:real, ..., : adapter.action_dim]
        err = (out - ref).abs()
        max_abs = max(max_abs, float(err.max()))
        sum_abs += float(err.sum())
        sum_sq += float((err**2).sum())
        ref_sq += float((ref**2).sum())
        count += err.numel()
        n += real
    if count == 0:
        return {"samples": 0}
    rmse = math.sqrt(sum_sq / count)
    return {"samples": n, "max_abs_error": max_abs, "mean_abs_error": sum_abs / count, "rmse": rmse,
            "relative_rmse": rmse / max(math.sqrt(ref_sq / count), 1e-12)}
