"""SigLIP vision transformer (patch embedding, pre-norm encoder blocks, final LayerNorm).

Module names follow the Hugging Face layout so checkpoints map by prefix alone.
"""

from __future__ import annotations

import torch
from torch import nn

from phyai_edge.layers.attention import attention
from phyai_edge.layers.mlp import GeluMLP
from phyai_edge.layers.norm import LayerNorm


class SiglipAttention(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)
        self.qkv_proj: nn.Linear | None = None

    def fuse(self) -> None:
        from phyai_edge.layers.fused import attach_unregistered, concat_linears

        attach_unregistered(self, "qkv_proj", concat_linears([self.q_proj, self.k_proj, self.v_proj]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        h = self.num_heads

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.reshape(b, t, h, w // h).transpose(1, 2)

        if self.qkv_proj is not None:
            q, k, v = (heads(y) for y in self.qkv_proj(x).chunk(3, dim=-1))
        else:
            q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        mask = torch.ones(1, 1, 1, t, dtype=torch.bool, device=x.device).expand(b, 1, t, t)
        out = attention(q, k, v, mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, w))


class SiglipBlock(nn.Module):
    def __init__(self, width: int, num_heads: int, mlp_dim: int, eps: float) -> None:
        super().__init__()
        self.layer_norm1 = LayerNorm(width, eps=eps)
        self.self_attn = SiglipAttention(width, num_heads)
        self.layer_norm2 = LayerNorm(width, eps=eps)
        self.mlp = GeluMLP(width, mlp_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(nn.Module):
    def __init__(self, image_size: int, patch_size: int, width: int) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size)
        self.num_patches = (image_size // patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches, width)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        x = x.flatten(2).transpose(1, 2)
        return x + self.position_embedding.weight[None]


class SiglipEncoder(nn.Module):
    def __init__(self, depth: int, width: int, num_heads: int, mlp_dim: int, eps: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipBlock(width, num_heads, mlp_dim, eps) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class SiglipVisionTower(nn.Module):
    """pixels (N, 3, S, S) in [-1, 1] -> patch features (N, (S/p)^2, width)."""

    def __init__(
        self, image_size: int, patch_size: int, width: int, depth: int, num_heads: int, mlp_dim: int, eps: float
    ) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(image_size, patch_size, width)
        self.encoder = SiglipEncoder(depth, width, num_heads, mlp_dim, eps)
        self.post_layernorm = LayerNorm(width, eps=eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(pixels)))
