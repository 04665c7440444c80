"""Rotary position embedding in the half-split (`rotate_half`) layout Gemma uses."""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, T) -> cos, sin (B, 1, T, head_dim), angles computed in float32."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim)
    )
    angles = positions.float()[..., None] * inv_freq  # (B, T, head_dim/2)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, head_dim)."""
    return x * cos + rotate_half(x) * sin
