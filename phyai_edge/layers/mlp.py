"""Feed-forward blocks: Gemma's gated GELU (GeGLU) and SigLIP's plain GELU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class GatedMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), no biases.

    After `fuse()`, gate and up are one matmul over a concatenated weight (one launch, one read
    of x, a better-shaped GEMM); `gate_proj` and `up_proj` stay as views into it, so the state
    dict and the reference path are unchanged.
    """

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.gate_up: nn.Linear | None = None

    def fuse(self) -> None:
        from phyai_edge.layers.fused import attach_unregistered, concat_linears

        attach_unregistered(self, "gate_up", concat_linears([self.gate_proj, self.up_proj]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down_proj(gelu_tanh(gate) * up)
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(gelu_tanh(self.fc1(x)))
