"""Noise keyed by what a chunk is, not by what ran before it.

An engine's own stream (`EngineBase.sample_noise`) gives a chunk whatever comes next, so the
same observation gets other noise on a replay, in another batch, or after a restart. Keyed noise
is drawn on the host from (seed, episode, frame) alone: the daemon draws each chunk's from its
inference number, `phyai-edge eval` each frame's from its number, and any two of them that share
the key run the solver from the same x_1. The host draw (a 1 x H x D normal, ~10 us) and its copy
to the device are the price; the CPU's generator is the one every machine reproduces (a CUDA
generator's values depend on the device's kernels).
"""

from __future__ import annotations

import torch

_MIX = 1_000_003  # a prime: keys (seed, episode, frame) that differ give generator seeds that differ


def frame_noise(seed: int, episode: int, frame: int, horizon: int, model_dim: int) -> torch.Tensor:
    """(1, horizon, model_dim) float32 standard normal noise on the CPU that depends only on
    (seed, episode, frame)."""
    g = torch.Generator().manual_seed((seed * _MIX + episode) * _MIX + frame)
    return torch.randn(1, horizon, model_dim, generator=g)
