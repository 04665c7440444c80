"""Fused ops against their plain references (CPU; the same code runs on the GPU)."""

from __future__ import annotations

import pytest
import torch

from phyai_edge.layers.attention import attention, attention_ref
from phyai_edge.layers.fused import concat_linears, fuse_projections
from phyai_edge.layers.gemma import GemmaBlock
from phyai_edge.layers.mlp import GatedMLP
from phyai_edge.layers.rotary import rope_cos_sin
from phyai_edge.layers.siglip import SiglipAttention


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.mark.parametrize("hq,hkv", [(8, 1), (4, 2), (2, 2)])
@pytest.mark.parametrize("mask_kind", ["keys", "pairs", "per_head"])
def test_attention_gqa_fold_matches_reference(hq: int, hkv: int, mask_kind: str) -> None:
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    b, tq, tk, d = 2, 5, 9, 16
    q = torch.randn(b, hq, tq, d, generator=g)
    k = torch.randn(b, hkv, tk, d, generator=g)
    v = torch.randn(b, hkv, tk, d, generator=g)
    keys = torch.rand(b, tk, generator=g) > 0.3
    keys[:, 0] = True
    if mask_kind == "keys":
        mask = keys[:, None, None, :]
    elif mask_kind == "pairs":
        mask = (torch.rand(b, 1, tq, tk, generator=g) > 0.4) & keys[:, None, None, :]
        mask[:, :, 0] = False  # a fully masked row: both paths give it every key
    else:
        mask = torch.rand(b, hq, tq, tk, generator=g) > 0.4
    ref = attention_ref(q, k, v, mask)
    out = attention(q, k, v, mask)
    assert out.shape == ref.shape
    assert _rel(out, ref) < 1e-5


def test_concat_linears_shares_storage_and_matches() -> None:
    torch.manual_seed(0)
    parts = [torch.nn.Linear(12, n) for n in (8, 4, 4)]
    x = torch.randn(3, 12)
    ref = torch.cat([p(x) for p in parts], dim=-1)
    fused = concat_linears(parts)
    assert torch.allclose(fused(x), ref, atol=1e-6)
    # The parts now view the fused storage: nothing stored twice, same outputs as before.
    assert parts[1].weight.data_ptr() == fused.weight.data_ptr() + 8 * 12 * 4
    assert torch.allclose(torch.cat([p(x) for p in parts], dim=-1), ref, atol=1e-6)
    with pytest.raises(ValueError):
        concat_linears([torch.nn.Linear(4, 2), torch.nn.Linear(4, 2, bias=False)])


def test_fused_modules_match_unfused_and_keep_state_dict() -> None:
    torch.manual_seed(1)
    block = GemmaBlock(32, 64, 4, 1, 8, 1e-6, cond_dim=32)
    mlp = GatedMLP(32, 48)
    sig = SiglipAttention(32, 4)
    for m in (block, mlp, sig):
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 7, 32)
    cond = torch.randn(2, 32)
    cos, sin = rope_cos_sin(torch.arange(7)[None].expand(2, 7), 8, 10000.0, torch.float32)
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)

    def run_block() -> torch.Tensor:
        q, k, v, gate = block.project_kv(x, cos, sin, cond)
        return block.finish(x, q, k, v, mask, gate, cond)

    ref = (run_block(), mlp(x), sig(x))
    keys = [sorted(m.state_dict()) for m in (block, mlp, sig)]
    assert sum(fuse_projections(m) for m in (block, mlp, sig)) == 4  # block: attention + MLP
    assert block.self_attn.qkv_proj is not None and mlp.gate_up is not None and sig.qkv_proj is not None
    assert [sorted(m.state_dict()) for m in (block, mlp, sig)] == keys  # fused linears are not registered
    out = (run_block(), mlp(x), sig(x))
    for o, r in zip(out, ref):
        assert _rel(o, r) < 1e-6


def test_ada_norm_accepts_precomputed_modulation() -> None:
    torch.manual_seed(2)
    block = GemmaBlock(16, 32, 2, 1, 8, 1e-6, cond_dim=16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x, cond = torch.randn(1, 3, 16), torch.randn(1, 16)
    norm = block.input_layernorm
    h1, g1 = norm(x, cond)
    h2, g2 = norm(x, norm.modulation(cond))
    assert torch.equal(h1, h2) and torch.equal(g1, g2)


def test_precision_change_drops_stale_fused_projections():
    """A fused projection is not a registered submodule, so a cast never reaches it; changing
    precision must drop it rather than leave a bf16 copy beside float32 parts."""
    import torch

    from phyai_edge.adapters.pi05 import builtin_adapter
    from phyai_edge.layers.fused import fuse_projections

    model = builtin_adapter("tiny").module.set_precision(torch.bfloat16)
    assert fuse_projections(model) > 0
    model.set_precision(torch.float32)
    attn = model.prefix_layers[0].self_attn
    assert attn.qkv_proj is None
    x = torch.randn(1, 5, model.cfg.prefix.width)
    cos = torch.ones(1, 1, 5, model.cfg.prefix.head_dim)
    q, _, _ = attn.qkv(x, cos, torch.zeros_like(cos))  # float32 input through float32 weights
    assert q.dtype == torch.float32


def test_second_engine_that_would_change_the_weights_is_refused():
    import copy

    import pytest

    from phyai_edge.adapters.pi05 import builtin_adapter
    from phyai_edge.engines.cudagraph import CudaGraphEngine
    from phyai_edge.engines.eager import EagerEngine

    adapter = builtin_adapter("tiny")
    graphs = CudaGraphEngine(adapter, device="cpu", dtype="bfloat16")
    with pytest.raises(RuntimeError, match="already run by a cudagraph engine"):
        EagerEngine(adapter, dtype="float32")
    twin = copy.copy(adapter)
    twin.module = copy.deepcopy(adapter.module)
    EagerEngine(twin, dtype="float32")  # its own copy: allowed
    del graphs
    same = builtin_adapter("tiny")
    first = EagerEngine(same, dtype="float32")
    second = EagerEngine(same, dtype="float32")  # same precision and device: sharing is harmless
    with pytest.raises(RuntimeError, match="would change the weights"):
        EagerEngine(same, dtype="bfloat16")
    del first, second
    EagerEngine(same, dtype="bfloat16")  # nobody runs it any more


def test_concat_is_torch_cat() -> None:
    from phyai_edge.layers.attention import concat

    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(2, n, 5, generator=g).to(torch.bfloat16) for n in (3, 1, 4))
    for dim, parts in ((1, [a, b, c]), (0, [a, a]), (2, [a, a[..., :2]])):
        assert torch.equal(concat(parts, dim), torch.cat(parts, dim))
    mixed = [a, b.float()]
    assert torch.equal(concat(mixed, 1), torch.cat(mixed, 1))
