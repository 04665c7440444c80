"""Fused projections: several linears that read the same input become one matmul.

`concat_linears` builds one `nn.Linear` whose weight is the row-wise concatenation of its
parts, then re-points each part's weight (and bias) at a view of that storage, so nothing is
stored twice, the state dict keeps its names, and the unfused reference path still runs.

Why it pays: at batch 1 the action expert is memory-bound and launch-bound; q/k/v as one GEMM
and gate/up as one GEMM halve the launches of those ops and read the activations once. For
the compute-bound prefix the wider GEMM also tiles better.

Fuse *after* the model is cast to its final dtype. The fused module is deliberately not a
registered submodule (so checkpoints keep the model's names), which also means `.to()`,
`.float()` or loading weights never reach it: it would go stale. So anything that re-creates
the parts' tensors calls `unfuse_projections` first (`PI05Model.set_precision` does).
"""

from __future__ import annotations

import torch
from torch import nn


def concat_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear computing torch.cat([p(x) for p in parts], -1); the parts become views of it."""
    has_bias = [p.bias is not None for p in parts]
    if len(set(has_bias)) != 1:
        raise ValueError("cannot fuse linears where only some have a bias")
    in_features = parts[0].in_features
    if any(p.in_features != in_features for p in parts):
        raise ValueError("fused linears must share their input width")
    w0 = parts[0].weight
    out = sum(p.out_features for p in parts)
    fused = nn.Linear(in_features, out, bias=has_bias[0], device=w0.device, dtype=w0.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts], dim=0))
        if has_bias[0]:
            fused.bias.copy_(torch.cat([p.bias for p in parts], dim=0))
    fused.requires_grad_(w0.requires_grad)
    row = 0
    for p in parts:
        n = p.out_features
        p.weight = nn.Parameter(fused.weight[row : row + n], requires_grad=w0.requires_grad)
        if has_bias[0]:
            p.bias = nn.Parameter(fused.bias[row : row + n], requires_grad=w0.requires_grad)
        row += n
    return fused


def fuse_projections(module: nn.Module) -> int:
    """Call `fuse()` on every submodule that has one (attention QKV, gated MLP gate/up).

    Returns how many were fused."""
    count = 0
    for sub in list(module.modules()):
        fuse = getattr(sub, "fuse", None)
        if callable(fuse):
            fuse()
            count += 1
    return count


def attach_unregistered(owner: nn.Module, name: str, fused: nn.Module) -> None:
    """Keep `fused` out of `owner`'s submodules, so the state dict (and checkpoints written from
    it) keeps exactly the model's own names; the parts already share its storage."""
    object.__setattr__(owner, name, fused)
    owner.__dict__.setdefault("_fused_attrs", set()).add(name)


def unfuse_projections(module: nn.Module) -> int:
    """Drop every fused projection under `module`; the parts compute the same thing unfused.
    Returns how many were dropped."""
    count = 0
    for sub in module.modules():
        for name in sub.__dict__.pop("_fused_attrs", ()):
            object.__setattr__(sub, name, None)
            count += 1
    return count
