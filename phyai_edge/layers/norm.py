"""RMSNorm (Gemma's `1 + weight` form), adaptive RMSNorm, and LayerNorm in float32.

Statistics are always taken in float32, whatever the activation dtype, as the published
checkpoints were trained that way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# (scale, shift, gate), each (B or 1, 1, dim): what AdaRMSNorm.modulation returns.
Modulation = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) with the statistic in float32. Returns float32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (rms_normalize(x, eps) * (1.0 + weight.float())).to(x.dtype)


def ada_rms_norm_ref(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
) -> torch.Tensor:
    """normed * (1 + scale) + shift; scale/shift broadcast over the token axis."""
    return (rms_normalize(x, eps) * (1.0 + scale.float()) + shift.float()).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)


class AdaRMSNorm(nn.Module):
    """RMSNorm whose scale, shift and residual gate come from a conditioning vector.

    `modulation(cond)` is split out so an engine can compute it once per flow step and reuse
    it for every token (it depends only on the flow time).
    """

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)

    def modulation(self, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cond (B, C) -> scale, shift, gate, each (B, 1, dim)."""
        mod = self.dense(cond.to(self.dense.weight.dtype)).unsqueeze(1)
        scale, shift, gate = mod.chunk(3, dim=-1)
        return scale, shift, gate

    def forward(self, x: torch.Tensor, cond: torch.Tensor | Modulation) -> tuple[torch.Tensor, torch.Tensor]:
        """`cond` is the conditioning vector, or its `modulation` already computed (a table entry)."""
        scale, shift, gate = cond if isinstance(cond, tuple) else self.modulation(cond)
        return ada_rms_norm_ref(x, scale, shift, self.eps), gate.to(x.dtype)


def layer_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    normalized_shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """LayerNorm over the last axis in float32, cast back to x.dtype (SigLIP's published math).
    `normalized_shape`: the module's own, as Python ints; an exporter's tracer would record
    `x.shape[-1:]` as a shape computation."""
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    shape = normalized_shape if normalized_shape is not None else x.shape[-1:]
    return F.layer_norm(x.float(), shape, w, b, eps).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32 and cast back, for bf16 activations (`layer_norm_ref`, which
    the fused kernels are tested against)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm_ref(x, self.weight, self.bias, self.eps, tuple(self.normalized_shape))
