"""Attention over a static KV cache, with grouped KV heads and a boolean key mask.

`attention_ref` is the plain reference (explicit softmax in float32, the way the published
PyTorch PI0.5 computes it); `attention` picks the fused SDPA kernel. Both take a boolean mask
of allowed (query, key) pairs; a query row with no allowed key (a padding token) is given
all keys so no kernel ever sees an empty softmax: its output is never read by a valid token.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

# The additive value the reference path uses for masked logits (finite, so a fully masked
# row stays finite), matching openpi.
MASK_VALUE = -2.3819763e38


def _full_rows(mask: torch.Tensor) -> torch.Tensor:
    empty = ~mask.any(dim=-1, keepdim=True)
    return mask | empty


def attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """q (B, Hq, Tq, D); k, v (B, Hkv, Tk, D); mask bool (B, 1 or Hq, Tq, Tk) -> (B, Hq, Tq, D)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    logits = logits.float() + torch.where(_full_rows(mask), 0.0, MASK_VALUE)
    probs = torch.softmax(logits, dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None
) -> torch.Tensor:
    """Same contract as `attention_ref`, through `scaled_dot_product_attention`.

    With grouped KV heads the query heads that share a KV head are folded into the query
    length, (B, Hkv, groups * Tq, D), instead of copying K and V `groups` times: for PI0.5
    (8 query heads, 1 KV head) that copy would move more bytes per denoise step than the
    attention itself. The result is the same function (each query row sees the same keys).
    `mask=None`: every key valid for every query (`attention_unmasked`).

    With one KV head, a key-only mask (or none) and q a (B, T, H, D) buffer seen as (B, H, T, D)
    (`fused_stacks` makes it so), the rows are folded in that token-major order instead: a free
    view both ways, and the output comes back as a view of a (B, T, H, D) buffer, the layout the
    o-projection reads. Where nothing distinguishes the rows, their order does not change them.
    """
    b, hq, tq, d = q.shape
    hkv = k.shape[1]
    groups = hq // hkv
    mask = None if mask is None else _full_rows(mask)
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    key_only = mask is None or (mask.shape[1] == 1 and mask.shape[2] == 1)
    if hkv == 1 and key_only and tq > 1 and q.transpose(1, 2).is_contiguous():
        qf = q.transpose(1, 2).reshape(b, 1, tq * hq, d)
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)
        return out.view(b, tq, hq, d).transpose(1, 2)
    qf = q.reshape(b, hkv, groups * tq, d)
    if mask is None or (mask.shape[1] == 1 and mask.shape[2] == 1):
        mf = mask  # key-only mask: broadcasts over the folded query axis as it is
    else:
        mf = mask.expand(b, hq, tq, mask.shape[-1]).reshape(b, hkv, groups * tq, mask.shape[-1])
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mf, scale=scale)
    return out.reshape(b, hq, tq, d)


def attention_unmasked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, scale: float | None = None
) -> torch.Tensor:
    """`attention` for a caller that knows every key is valid for every query (a prefix with no
    padding and every camera present): SDPA with no mask at all, grouped heads folded the same
    way, `mask` ignored. Without a mask SDPA can take its fastest kernels (cuDNN's on Hopper: at
    the batch-32 PI0.5 prefix 339 us a layer against 723 with the key mask, H200), preferred
    here where this torch can order the backends."""
    with _prefer_cudnn(q):
        return attention(q, k, v, None, scale)


def _prefer_cudnn(q: torch.Tensor) -> contextlib.AbstractContextManager:
    if not q.is_cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.MATH]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # a torch without set_priority: its own order
        return contextlib.nullcontext()


def concat(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """`torch.cat(parts, dim)` as one buffer and a copy per part. On the H200 CUDA's cat took its
    unvectorised kernel for the PI0.5 prefix's images + prompt (bf16, along the token axis): 0.50 ms
    at batch 32, ~10x what the copies move at the memory bandwidth."""
    if len({p.dtype for p in parts}) != 1:
        return torch.cat(list(parts), dim)  # cat's type promotion
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    out = parts[0].new_empty(shape)
    at = 0
    for p in parts:
        out.narrow(dim, at, p.shape[dim]).copy_(p)
        at += p.shape[dim]
    return out
