"""Each fast path in layers/ against its plain reference, and the references against transformers."""

from __future__ import annotations

import pytest
import torch
from helpers import reference as R

from phyai_edge.layers.attention import attention, attention_ref
from phyai_edge.layers.mlp import GatedMLP
from phyai_edge.layers.norm import AdaRMSNorm, LayerNorm, RMSNorm
from phyai_edge.layers.rotary import apply_rope, rope_cos_sin


def _mask(b, tq, tk, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(b, 1, tq, tk, generator=g) > 0.3
    m[0, 0, 2] = False  # a fully masked query row (a padding token)
    return m


@pytest.mark.parametrize(("hq", "hkv"), [(4, 1), (4, 2), (2, 2)])
def test_sdpa_matches_reference(hq, hkv):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, hq, 7, 16, generator=g)
    k, v = torch.randn(2, hkv, 9, 16, generator=g), torch.randn(2, hkv, 9, 16, generator=g)
    mask = _mask(2, 7, 9)
    ref, fast = attention_ref(q, k, v, mask), attention(q, k, v, mask)
    assert torch.allclose(fast, ref, atol=1e-5, rtol=0)
    assert torch.isfinite(fast).all() and torch.isfinite(ref).all()
    # valid rows equal an explicit masked softmax
    want = R.attend(q.double(), k.double(), v.double(), mask[:, 0])
    rows = mask[:, 0].any(-1)
    assert torch.allclose(ref.double().transpose(1, 2)[rows], want.transpose(1, 2)[rows], atol=1e-5)
    # a fully masked row attends to every key instead of producing NaN
    full = R.attend(q.double(), k.double(), v.double(), torch.ones(2, 7, 9, dtype=torch.bool))
    assert torch.allclose(ref[0, :, 2].double(), full[0, :, 2], atol=1e-5)


def test_sdpa_matches_reference_bf16():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 12, 32, generator=g).to(torch.bfloat16) for _ in range(3))
    k, v = k[:, :1], v[:, :1]
    mask = _mask(1, 12, 12)
    a, b = attention(q, k, v, mask).float(), attention_ref(q, k, v, mask).float()
    assert (a - b).abs().max() / b.abs().max() < 2e-2


def test_masked_keys_contribute_exactly_nothing():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 2, 4, 8, generator=g), torch.randn(1, 1, 6, 8, generator=g), torch.randn(1, 1, 6, 8, generator=g)
    mask = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    mask[..., 4:] = False
    k2, v2 = k.clone(), v.clone()
    k2[..., 4:, :] = 1e4
    v2[..., 4:, :] = -1e4
    for fn in (attention, attention_ref):
        assert torch.equal(fn(q, k, v, mask), fn(q, k2, v2, mask))


def test_rope_matches_transformers_and_formula():
    from transformers.models.gemma.modeling_gemma import apply_rotary_pos_emb

    pos = torch.tensor([[0, 1, 2, 5, 9], [3, 3, 4, 100, 7]])
    cos, sin = rope_cos_sin(pos, 16, 10000.0, torch.float32)
    x = torch.randn(2, 3, 5, 16)
    ours = apply_rope(x, cos, sin)
    hf, _ = apply_rotary_pos_emb(x, x, cos[:, 0], sin[:, 0], unsqueeze_dim=1)
    assert torch.allclose(ours, hf, atol=1e-6)
    assert torch.allclose(ours.double(), R.rope(x.double(), pos), atol=1e-4)  # angles up to 100 rad in fp32
    # position 0 is the identity; rotation preserves norms
    assert torch.allclose(ours[0, :, 0], x[0, :, 0])
    assert torch.allclose(ours.norm(dim=-1), x.norm(dim=-1), atol=1e-5)


def test_rmsnorm_matches_transformers_gemma():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    hf = GemmaRMSNorm(24, eps=1e-6)
    ours = RMSNorm(24, 1e-6)
    with torch.no_grad():
        hf.weight.normal_()
        ours.weight.copy_(hf.weight)
    x = torch.randn(3, 5, 24) * 4
    assert torch.allclose(ours(x), hf(x), atol=1e-6)
    xb = x.to(torch.bfloat16)
    assert ours(xb).dtype == torch.bfloat16
    assert torch.allclose(ours(xb).float(), hf(xb).float(), atol=3e-2)


def test_ada_rmsnorm_formula():
    n = AdaRMSNorm(8, 6, 1e-6)
    with torch.no_grad():
        n.dense.weight.normal_()
        n.dense.bias.normal_()
    x, c = torch.randn(2, 4, 8), torch.randn(2, 6)
    out, gate = n(x, c)
    want, want_gate = R.norm(x.double(), (n.dense.weight.double(), n.dense.bias.double()), c.double(), 1e-6)
    assert torch.allclose(out.double(), want, atol=1e-5)
    assert torch.allclose(gate.double(), want_gate, atol=1e-5)
    assert gate.shape == (2, 1, 8)  # broadcast over tokens


def test_gated_mlp_matches_transformers():
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    hf = GemmaMLP(GemmaConfig(hidden_size=16, intermediate_size=40, hidden_activation="gelu_pytorch_tanh"))
    ours = GatedMLP(16, 40)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 3, 16)
    assert torch.allclose(ours(x), hf(x), atol=1e-6)


def test_layernorm_runs_in_fp32_for_bf16():
    ln = LayerNorm(32, eps=1e-6)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    x = (torch.randn(4, 32) * 100 + 1000).to(torch.bfloat16)  # large mean: bf16 statistics would lose it
    out = ln(x)
    assert out.dtype == torch.bfloat16
    want = torch.nn.functional.layer_norm(x.double(), (32,), ln.weight.double(), ln.bias.double(), 1e-6)
    assert (out.double() - want).abs().max() < 0.05 * want.abs().max()
