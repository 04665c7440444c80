"""Gemma decoder blocks: grouped-query attention with RoPE, GeGLU MLP, (adaptive) RMSNorm.

Blocks here do not decide what attends to what: callers pass the keys/values to attend over
and a boolean mask. That lets one block serve the prefix (bidirectional over valid tokens,
writing a KV cache) and the action expert (attending to the cached prefix and to itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from phyai_edge.layers.attention import attention
from phyai_edge.layers.mlp import GatedMLP
from phyai_edge.layers.norm import AdaRMSNorm, Modulation, RMSNorm
from phyai_edge.layers.rotary import apply_rope


class GemmaAttention(nn.Module):
    def __init__(self, width: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(width, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, width, bias=False)
        self.qkv_proj: nn.Linear | None = None

    def fuse(self) -> None:
        """One matmul for q, k and v (see `layers.fused.concat_linears`)."""
        from phyai_edge.layers.fused import attach_unregistered, concat_linears

        attach_unregistered(self, "qkv_proj", concat_linears([self.q_proj, self.k_proj, self.v_proj]))

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, W) -> q (B, H, T, D), k, v (B, Hkv, T, D), RoPE applied to q and k."""
        b, t, _ = x.shape
        if self.qkv_proj is not None:
            nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([nq, nkv, nkv], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: Any, v: Any, mask: torch.Tensor,
               attention_fn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """Attention then the output projection. `attention_fn` (same contract as
        `layers.attention.attention`) lets a fast path swap the kernel without copying this."""
        out = (attention_fn or attention)(q, k, v, mask)
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out.to(self.o_proj.weight.dtype))


class GemmaBlock(nn.Module):
    """One decoder layer. With `cond_dim`, its norms are adaptive and residuals gated."""

    def __init__(
        self,
        width: int,
        mlp_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        cond_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(width, num_heads, num_kv_heads, head_dim)
        self.mlp = GatedMLP(width, mlp_dim)
        self.adaptive = cond_dim is not None
        if cond_dim is None:
            self.input_layernorm: nn.Module = RMSNorm(width, eps)
            self.post_attention_layernorm: nn.Module = RMSNorm(width, eps)
        else:
            self.input_layernorm = AdaRMSNorm(width, cond_dim, eps)
            self.post_attention_layernorm = AdaRMSNorm(width, cond_dim, eps)

    def _norm(self, norm: nn.Module, x: torch.Tensor, cond: torch.Tensor | Modulation | None):
        if self.adaptive:
            return norm(x, cond)
        return norm(x), None

    @staticmethod
    def _residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return x + y if gate is None else x + y * gate

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cond: torch.Tensor | Modulation | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`cond`: the time conditioning, or the input norm's precomputed modulation."""
        h, gate = self._norm(self.input_layernorm, x, cond)
        q, k, v = self.self_attn.qkv(h, cos, sin)
        return q, k, v, gate

    def finish(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        k_all: torch.Tensor,
        v_all: torch.Tensor,
        mask: torch.Tensor,
        gate: torch.Tensor | None,
        cond: torch.Tensor | Modulation | None = None,
    ) -> torch.Tensor:
        """Attention over (k_all, v_all), gated residual, MLP, gated residual.

        `cond`: the time conditioning, or the post-attention norm's precomputed modulation."""
        x = self._residual(x, self.self_attn.attend(q, k_all, v_all, mask), gate)
        h, gate2 = self._norm(self.post_attention_layernorm, x, cond)
        h = h.to(self.mlp.up_proj.weight.dtype)
        return self._residual(x, self.mlp(h), gate2)
