"""Real-Time Chunking inside the solver (Black, Galliker, Levine 2025, "Real-Time Execution of
Action Chunking Flow Policies").

Conventions are the model's: x = t * noise + (1 - t) * actions, integrated from t = 1 to t = 0,
velocity v = noise - actions, so the predicted clean chunk at time t is x - t * v.

Modes:
- `inpaint`: the first d actions are forced onto the executing chunk at every step (hard prefix).
- `guided-approx`: soft-masked guidance with the Jacobian of the denoiser taken as identity, so
  it works with any engine, including ones without autograd (ONNX, TensorRT).
- `guided`: the paper's exact vector-Jacobian product through the denoiser.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from phyai_edge.engines.base import RTCMode


def prefix_weights(horizon: int, delay: int, execution_horizon: int) -> torch.Tensor:
    """The paper's soft mask W over chunk indices: 1 for i < d, exponential decay on
    [d, H - s), 0 from H - s on (no executing action overlaps those)."""
    h, d, s = horizon, delay, execution_horizon
    if not 0 <= d <= h:
        raise ValueError(f"RTC delay d={d} must lie in [0, H={h}]")
    if not 0 <= s <= h:
        raise ValueError(f"RTC execution horizon s={s} must lie in [0, H={h}]")
    w = torch.zeros(h)
    free_from = max(h - s, d)
    w[:d] = 1.0
    span = h - s - d + 1
    for i in range(d, free_from):
        c = (h - s - i) / span
        w[i] = c * math.expm1(c) / (math.e - 1.0)
    return w


def guidance_weight(t: float, max_weight: float) -> float:
    """min(beta, (1 - tau) / tau / r_tau^2) with tau = 1 - t the paper's flow time."""
    tau = 1.0 - t
    if tau <= 0.0:
        return max_weight
    if tau >= 1.0:
        return 0.0
    inv_r2 = ((1 - tau) ** 2 + tau**2) / (1 - tau) ** 2
    return min(max_weight, (1 - tau) / tau * inv_r2)


@dataclass
class RTCGuidance:
    """What the solver needs, already in model space.

    target: (B, H, D) the executing chunk's actions at the new chunk's indices (zeros where
        nothing overlaps); weights: (H,) soft mask; dim_mask: (D,) 1 on real action dims.
    """

    mode: RTCMode
    target: torch.Tensor
    weights: torch.Tensor
    dim_mask: torch.Tensor
    delay: int
    max_guidance_weight: float

    def to(self, device: torch.device) -> RTCGuidance:
        return RTCGuidance(
            self.mode, self.target.to(device), self.weights.to(device), self.dim_mask.to(device),
            self.delay, self.max_guidance_weight,
        )

    @property
    def mask(self) -> torch.Tensor:
        """(1, H, D) combined weight."""
        return (self.weights[:, None] * self.dim_mask[None, :])[None]
