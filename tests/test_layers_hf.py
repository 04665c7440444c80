"""Our SigLIP and Gemma against transformers' own implementations (code nobody here wrote),
loaded through our checkpoint key mapping, in float32: relative error <= 1e-5."""

from __future__ import annotations

import pytest
import torch
from helpers.reference import rel_err

from phyai_edge.adapters.checkpoint import regex_key_map
from phyai_edge.adapters.pi05.config import GemmaSpec, PI05Config, SiglipSpec
from phyai_edge.adapters.pi05.loaders import PI_KEY_RULES
from phyai_edge.adapters.pi05.model import PI05Model
from phyai_edge.layers.siglip import SiglipVisionTower

transformers = pytest.importorskip("transformers")  # a test dependency (pyproject [test]); never skipped in CI
from transformers import GemmaConfig, GemmaModel, SiglipVisionConfig, SiglipVisionModel  # noqa: E402

TOL = 1e-5
LM = "paligemma_with_expert.paligemma.model.language_model."
VT = "paligemma_with_expert.paligemma.model.vision_tower."


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere, including norm weights that transformers initialises to 0/1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim == 1:  # biases, RMSNorm offsets (used as 1 + w)
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
        for m in module.modules():
            if isinstance(m, torch.nn.LayerNorm):  # LayerNorm scales multiply directly
                m.weight.add_(1.0)


def _map(hf_state: dict, prefix: str) -> dict:
    """HF module names -> LeRobot checkpoint names -> ours, through the loader's PI_KEY_RULES."""
    km = regex_key_map(PI_KEY_RULES, [])
    return {km("model." + prefix + k): v for k, v in hf_state.items()}


# -- SigLIP ------------------------------------------------------------------------------
SIG = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4, image_size=56,
           patch_size=14, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")


@pytest.fixture(scope="module")
def hf_siglip():
    torch.manual_seed(0)
    cfg = SiglipVisionConfig(**SIG, vision_use_head=False, attn_implementation="eager")
    m = SiglipVisionModel(cfg).eval()
    _randomize(m, 1)
    return m


@pytest.mark.parametrize("layout", ["vision_model.", ""])
def test_siglip_matches_transformers(hf_siglip, layout):
    """Both checkpoint layouts (transformers 4.x `vision_tower.vision_model.` and the flattened
    transformers 5 `vision_tower.`) map onto our tower, and outputs match in fp32."""
    hf_state = hf_siglip.state_dict()
    mapped = _map(hf_state, VT + layout)
    assert all(k.startswith("vision.") for k in mapped), sorted(mapped)[:5]
    ours = SiglipVisionTower(56, 14, 48, 3, 4, 80, 1e-6).eval()
    missing, unexpected = ours.load_state_dict({k.removeprefix("vision."): v for k, v in mapped.items()}, strict=True)
    assert not missing and not unexpected
    pixels = torch.rand(3, 3, 56, 56) * 2 - 1
    with torch.no_grad():
        want = hf_siglip(pixel_values=pixels).last_hidden_state  # after post_layernorm, no head
        got = ours(pixels)
    assert got.shape == want.shape == (3, 16, 48)
    assert rel_err(got, want) <= TOL


def test_siglip_detects_a_wrong_weight(hf_siglip):
    """The comparison above can fail: perturb one weight and the error is far above tolerance."""
    mapped = _map(hf_siglip.state_dict(), VT + "vision_model.")
    sd = {k.removeprefix("vision."): v.clone() for k, v in mapped.items()}
    sd["encoder.layers.1.mlp.fc1.bias"] += 0.05
    ours = SiglipVisionTower(56, 14, 48, 3, 4, 80, 1e-6).eval()
    ours.load_state_dict(sd)
    pixels = torch.rand(1, 3, 56, 56)
    with torch.no_grad():
        assert rel_err(ours(pixels), hf_siglip(pixel_values=pixels).last_hidden_state) > 1e-3


# -- Gemma -------------------------------------------------------------------------------
W, HEADS, KV, HD, MLP, DEPTH, VOCAB = 64, 4, 1, 16, 128, 3, 97


def _tiny_cfg() -> PI05Config:
    return PI05Config(
        vision=SiglipSpec(image_size=28, patch_size=14, width=16, depth=1, num_heads=2, mlp_dim=32),
        prefix=GemmaSpec(width=W, depth=DEPTH, mlp_dim=MLP, num_heads=HEADS, num_kv_heads=KV, head_dim=HD),
        expert=GemmaSpec(width=32, depth=DEPTH, mlp_dim=48, num_heads=HEADS, num_kv_heads=KV, head_dim=HD),
        vocab_size=VOCAB, chunk_size=5, max_token_len=12, preset="test",
    )


@pytest.fixture(scope="module")
def gemma_pair():
    torch.manual_seed(0)
    cfg = GemmaConfig(vocab_size=VOCAB, hidden_size=W, intermediate_size=MLP, num_hidden_layers=DEPTH,
                      num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD, rms_norm_eps=1e-6,
                      hidden_activation="gelu_pytorch_tanh", attn_implementation="eager")
    hf = GemmaModel(cfg).eval()
    _randomize(hf, 2)
    ours = PI05Model(_tiny_cfg()).eval()
    mapped = _map(hf.state_dict(), LM)
    prefix_names = {k for k in ours.state_dict() if k.split(".")[0] in ("embed_tokens", "prefix_layers", "prefix_norm")}
    assert set(mapped) == prefix_names  # the mapping covers exactly the prefix model
    missing, unexpected = ours.load_state_dict(mapped, strict=False)
    assert not unexpected and not (set(prefix_names) & set(missing))
    return hf, ours


def _our_blocks(ours: PI05Model, x, pos, allowed):
    """A full forward through our GemmaBlocks (project_kv + finish on every layer) and the final norm."""
    p = ours.cfg.prefix
    from phyai_edge.layers.rotary import rope_cos_sin

    cos, sin = rope_cos_sin(pos, p.head_dim, p.rope_theta, torch.float32)
    hidden = []
    for layer in ours.prefix_layers:
        q, k, v, gate = layer.project_kv(x, cos, sin)
        x = layer.finish(x, q, k, v, allowed[:, None], gate)
        hidden.append(x)
    return ours.prefix_norm(x), hidden


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.where(allowed[:, None], 0.0, torch.finfo(torch.float32).min)


def test_gemma_causal_matches_transformers(gemma_pair):
    """transformers' default causal path (input ids, 2-D padding mask, its own sqrt(width)
    embedding scale) against our blocks with a causal mask and our embedding scale."""
    hf, ours = gemma_pair
    ids = torch.randint(0, VOCAB, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False  # right padding in the second row
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        x = ours.embed_tokens(ids) * W**0.5
        pos = torch.arange(9)[None].expand(2, 9)
        causal = torch.tril(torch.ones(9, 9, dtype=torch.bool))[None] & mask[:, None, :]
        got, _ = _our_blocks(ours, x, pos, causal)
    valid = mask
    assert rel_err(got[valid], want[valid]) <= TOL
    # the scale is really there: without it the outputs differ grossly
    with torch.no_grad():
        unscaled, _ = _our_blocks(ours, ours.embed_tokens(ids), pos, causal)
    assert rel_err(unscaled[valid], want[valid]) > 1e-2


def test_gemma_prefix_encoder_matches_transformers(gemma_pair):
    """Our `encode_prefix` (images + prompt, bidirectional over valid tokens, positions counting
    valid tokens only, a masked camera, right-padded prompt) against transformers' GemmaModel run
    with the equivalent 4-D mask: every layer's KV cache and every layer's hidden states."""
    hf, ours = gemma_pair
    b, nv, per, t = 2, 2, 4, 12
    img = torch.randn(b, nv * per, W)
    image_mask = torch.tensor([[True, True], [False, True]])  # row 1: first camera absent
    tokens = torch.randint(0, VOCAB, (b, t))
    token_mask = torch.zeros(b, t, dtype=torch.bool)
    token_mask[0, :10] = True
    token_mask[1, :5] = True
    valid = torch.cat([image_mask.repeat_interleave(per, 1), token_mask], 1)
    pos = torch.cumsum(valid.long(), 1) - 1
    allowed = valid[:, None, :] & valid[:, :, None]
    with torch.no_grad():
        k_cache, v_cache, prefix_mask = ours.encode_prefix(img, image_mask, tokens, token_mask)
        embeds = torch.cat([img, hf.embed_tokens(tokens)], 1)  # HF's scaled embedding
        out = hf(inputs_embeds=embeds, attention_mask=_additive(allowed), position_ids=pos, use_cache=True,
                 output_hidden_states=True)
        got_final, got_hidden = _our_blocks(ours, torch.cat([img, ours.embed_tokens(tokens) * W**0.5], 1), pos, allowed)
    assert torch.equal(prefix_mask, valid)
    cache = out.past_key_values
    for layer in range(DEPTH):
        hk, hv = cache.layers[layer].keys, cache.layers[layer].values
        for i in range(b):
            assert rel_err(k_cache[layer, i][:, valid[i]], hk[i][:, valid[i]]) <= TOL, layer
            assert rel_err(v_cache[layer, i][:, valid[i]], hv[i][:, valid[i]]) <= TOL, layer
        if layer < DEPTH - 1:  # hidden_states[l + 1] is the output of layer l
            assert rel_err(got_hidden[layer][valid], out.hidden_states[layer + 1][valid]) <= TOL
    assert rel_err(got_final[valid], out.last_hidden_state[valid]) <= TOL


def test_gemma_positions_matter(gemma_pair):
    """With naive positions (arange instead of counting valid tokens), the cache of the
    tokens after a masked camera differs from transformers fed the published positions."""
    hf, ours = gemma_pair
    img = torch.randn(1, 8, W)
    image_mask = torch.tensor([[False, True]])
    tokens = torch.randint(0, VOCAB, (1, 12))
    token_mask = torch.ones(1, 12, dtype=torch.bool)
    valid = torch.cat([image_mask.repeat_interleave(4, 1), token_mask], 1)
    allowed = valid[:, None, :] & valid[:, :, None]
    with torch.no_grad():
        k_cache, _, _ = ours.encode_prefix(img, image_mask, tokens, token_mask)
        embeds = torch.cat([img, hf.embed_tokens(tokens)], 1)
        naive = hf(inputs_embeds=embeds, attention_mask=_additive(allowed), position_ids=torch.arange(20)[None],
                   use_cache=True).past_key_values
    assert rel_err(k_cache[0, 0][:, valid[0]], naive.layers[0].keys[0][:, valid[0]]) > 1e-3
