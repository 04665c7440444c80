"""Straightforward re-implementations of PI0.5's pieces, written from the published formulas
(LeRobot 0.6.1 / openpi semantics), sharing no code with `phyai_edge` beyond reading weights.

They are deliberately naive: explicit loops, explicit softmax, float64 where it costs nothing.
"""

from __future__ import annotations

import math

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (the scale-relative error the parity criteria use)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x, pos, theta=10000.0):
    """x (B, H, T, D), pos (B, T): Gemma's half-split rotary embedding."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None, :, None] * inv  # (B, 1, T, D/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attend(q, k, v, allowed):
    """q (B, H, Tq, D), k/v (B, Hkv, Tk, D), allowed bool (B, Tq, Tk); explicit softmax."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    # a query with no allowed key (a padding token) gets zeros; nothing valid ever reads it
    return torch.softmax(logits, -1).nan_to_num(0.0) @ v


def heads(x, n, d):
    b, t, _ = x.shape
    return x.view(b, t, n, d).transpose(1, 2)


def merge(x):
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def lin(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


def sinusoid(t, dim, min_period, max_period):
    """openpi's create_sinusoidal_pos_embedding, from its formula, in float64."""
    n = dim // 2
    frac = torch.tensor([i / (n - 1) for i in range(n)], dtype=torch.float64)
    period = min_period * (max_period / min_period) ** frac
    ang = t.double()[:, None] * (2 * math.pi / period)[None]
    return torch.cat([ang.sin(), ang.cos()], -1)


def make_att_2d_masks(pad, ar):
    """big_vision / openpi: token i may attend j iff cumsum(ar)[j] <= cumsum(ar)[i], both valid."""
    c = torch.cumsum(ar.long(), 1)
    return (c[:, None, :] <= c[:, :, None]) & (pad[:, None, :] & pad[:, :, None])


class LayerW:
    """One Gemma layer's weights, read out of a state dict under `prefix`."""

    def __init__(self, sd, prefix, adaptive):
        g = lambda n: sd[prefix + n]  # noqa: E731
        self.wq, self.wk, self.wv, self.wo = (g(f"self_attn.{n}_proj.weight") for n in "qkvo")
        self.gate, self.up, self.down = (g(f"mlp.{n}_proj.weight") for n in ("gate", "up", "down"))
        if adaptive:
            self.n1 = (g("input_layernorm.dense.weight"), g("input_layernorm.dense.bias"))
            self.n2 = (g("post_attention_layernorm.dense.weight"), g("post_attention_layernorm.dense.bias"))
        else:
            self.n1, self.n2 = g("input_layernorm.weight"), g("post_attention_layernorm.weight")


def norm(x, w, cond, eps):
    """PiGemmaRMSNorm: (normed * (1 + w), None) or adaptive (normed * (1 + scale) + shift, gate)."""
    if cond is None:
        return rms(x, eps) * (1.0 + w), None
    mod = lin(cond, *w)[:, None]
    scale, shift, gate = mod.chunk(3, -1)
    return rms(x, eps) * (1.0 + scale) + shift, gate


def residual(x, y, gate):
    return x + y if gate is None else x + y * gate


def mlp(lw, h):
    return lin(gelu_tanh(lin(h, lw.gate)) * lin(h, lw.up), lw.down)


def qkv(lw, h, pos, nh, nkv, hd, theta):
    q = rope(heads(lin(h, lw.wq), nh, hd), pos, theta)
    k = rope(heads(lin(h, lw.wk), nkv, hd), pos, theta)
    return q, k, heads(lin(h, lw.wv), nkv, hd)
