"""Whole-policy structure against LeRobot 0.6.1 / openpi semantics, re-implemented in the test
from the published formulas (helpers/reference.py), on the tiny preset; and the full preset's
structure and parameter count on the meta device."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import reference as R
from helpers.reference import rel_err

from phyai_edge.adapters.pi05 import model as model_mod
from phyai_edge.adapters.pi05.builtin import builtin_adapter
from phyai_edge.adapters.pi05.config import full
from phyai_edge.adapters.pi05.model import PI05Model, sinusoidal_time_embedding

TOL = 1e-5


def _inputs(adapter, obs_list):
    return adapter.preprocess(obs_list).tensors


def _reference_velocity_joint(model: PI05Model, image_embeds, image_mask, tokens, token_mask, x_t, t):
    """LeRobot's training-path forward (`PI05Pytorch.forward` / `compute_layer_complete`): prefix
    and suffix processed together in every layer, one attention over the joint sequence with
    make_att_2d_masks(pad, ar) where ar = [0]*prefix + [1] + [0]*(H-1), positions = cumsum(pad) - 1.
    No KV cache, no stages: a different computation from ours that must give the same velocity."""
    cfg = model.cfg
    p, e = cfg.prefix, cfg.expert
    sd = {k: v.double() for k, v in model.state_dict().items()}
    b, h = x_t.shape[:2]
    per = image_embeds.shape[1] // image_mask.shape[1]
    prefix_x = torch.cat([image_embeds.double(), sd["embed_tokens.weight"][tokens] * math.sqrt(p.width)], 1)
    prefix_pad = torch.cat([image_mask.repeat_interleave(per, 1), token_mask], 1)
    n_p = prefix_pad.shape[1]
    # suffix: actions in, time -> sinusoid -> MLP -> adaptive-norm condition
    temb = R.sinusoid(t, e.width, cfg.time_min_period, cfg.time_max_period)
    cond = torch.nn.functional.silu(R.lin(temb, sd["time_mlp_in.weight"], sd["time_mlp_in.bias"]))
    cond = torch.nn.functional.silu(R.lin(cond, sd["time_mlp_out.weight"], sd["time_mlp_out.bias"]))
    suffix_x = R.lin(x_t.double(), sd["action_in_proj.weight"], sd["action_in_proj.bias"])
    pad = torch.cat([prefix_pad, torch.ones(b, h, dtype=torch.bool)], 1)
    ar = torch.tensor([0] * n_p + [1] + [0] * (h - 1))[None].expand(b, -1)
    allowed = R.make_att_2d_masks(pad, ar)
    pos = torch.cumsum(pad.long(), 1) - 1
    xs = [prefix_x, suffix_x]
    for i in range(p.depth):
        layers = [R.LayerW(sd, f"prefix_layers.{i}.", False), R.LayerW(sd, f"expert_layers.{i}.", True)]
        conds = [None, cond]
        eps = [p.rms_eps, e.rms_eps]
        qs, ks, vs, gates, start = [], [], [], [], 0
        for lw, x, c, ep in zip(layers, xs, conds, eps):
            hN, gate = R.norm(x, lw.n1, c, ep)
            q, k, v = R.qkv(lw, hN, pos[:, start : start + x.shape[1]], p.num_heads, p.num_kv_heads, p.head_dim,
                            p.rope_theta)
            qs.append(q), ks.append(k), vs.append(v), gates.append(gate)
            start += x.shape[1]
        att = R.merge(R.attend(torch.cat(qs, 2), torch.cat(ks, 2), torch.cat(vs, 2), allowed))
        out, start = [], 0
        for lw, x, c, ep, gate in zip(layers, xs, conds, eps, gates):
            y = R.lin(att[:, start : start + x.shape[1]], lw.wo)
            start += x.shape[1]
            x = R.residual(x, y, gate)
            hN, gate2 = R.norm(x, lw.n2, c, ep)
            out.append(R.residual(x, R.mlp(lw, hN), gate2))
        xs = out
    final, _ = R.norm(xs[1], (sd["expert_norm.dense.weight"], sd["expert_norm.dense.bias"]), cond, e.rms_eps)
    return R.lin(final, sd["action_out_proj.weight"], sd["action_out_proj.bias"])


@pytest.fixture
def two_obs(tiny_adapter, make_obs):
    a = make_obs(tiny_adapter, seed=1, prompt="pick up the red cube and put it in the box")
    b = make_obs(tiny_adapter, seed=2, prompt="open drawer", size=(64, 200))
    b.images = {**b.images, "top": None}  # first camera absent in the second observation
    return [a, b]


@pytest.mark.parametrize("t", [1.0, 0.55, 0.1])
def test_cached_stages_match_joint_forward(tiny_adapter, two_obs, t):
    """embed_images -> encode_prefix (KV cache) -> denoise_step equals the joint forward of the
    published model, with a masked camera and right-padded prompts of different lengths."""
    m = tiny_adapter.module.eval()
    x = _inputs(tiny_adapter, two_obs)
    x_t = torch.randn(2, m.cfg.chunk_size, m.cfg.max_action_dim, generator=torch.Generator().manual_seed(3))
    tt = torch.full((2,), t)
    with torch.no_grad():
        img = m.embed_images(x["images"])
        k, v, pm = m.encode_prefix(img, x["image_mask"], x["tokens"], x["token_mask"])
        got = m.denoise_step(x_t, tt, k, v, pm)
        want = _reference_velocity_joint(m, img, x["image_mask"], x["tokens"], x["token_mask"], x_t, tt)
    assert got.dtype == torch.float32 and got.shape == x_t.shape
    assert rel_err(got, want) <= TOL


def test_joint_reference_is_sensitive(tiny_adapter, two_obs):
    """The comparison above can fail: the reference disagrees if the suffix positions ignore
    the valid-prefix offset (the suffix RoPE starts at 0 instead)."""
    m = tiny_adapter.module.eval()
    x = _inputs(tiny_adapter, two_obs)
    x_t = torch.randn(2, m.cfg.chunk_size, m.cfg.max_action_dim)
    tt = torch.full((2,), 0.5)
    real = model_mod.rope_cos_sin

    def no_offset(positions, *a):
        if positions.shape[1] == m.cfg.chunk_size:
            positions = positions - positions[:, :1]
        return real(positions, *a)

    with torch.no_grad():
        img = m.embed_images(x["images"])
        k, v, pm = m.encode_prefix(img, x["image_mask"], x["tokens"], x["token_mask"])
        want = _reference_velocity_joint(m, img, x["image_mask"], x["tokens"], x["token_mask"], x_t, tt)
        model_mod.rope_cos_sin = no_offset
        try:
            wrong = m.denoise_step(x_t, tt, k, v, pm)
        finally:
            model_mod.rope_cos_sin = real
    assert rel_err(wrong, want) > 1e-4


def test_positions_and_masks(tiny_adapter, two_obs, monkeypatch):
    """Prefix positions = cumsum(valid) - 1 (a masked camera takes no positions); suffix
    positions = number of valid prefix tokens + arange(H); the action expert's mask admits
    valid prefix tokens and every action token."""
    m = tiny_adapter.module.eval()
    x = _inputs(tiny_adapter, two_obs)
    seen = []
    real = model_mod.rope_cos_sin
    monkeypatch.setattr(model_mod, "rope_cos_sin", lambda pos, *a: (seen.append(pos.clone()), real(pos, *a))[1])
    attn_masks = []
    from phyai_edge.layers import gemma as gemma_mod

    real_attn = gemma_mod.attention
    monkeypatch.setattr(gemma_mod, "attention", lambda q, k, v, mask: (attn_masks.append(mask.clone()),
                                                                      real_attn(q, k, v, mask))[1])
    with torch.no_grad():
        img = m.embed_images(x["images"])
        k, v, pm = m.encode_prefix(img, x["image_mask"], x["tokens"], x["token_mask"])
        m.denoise_step(torch.zeros(2, 50, 32), torch.ones(2), k, v, pm)
    per = m.cfg.vision.tokens_per_image
    n_views = len(tiny_adapter.camera_names)
    prefix_pos, suffix_pos = seen
    tok_valid = x["token_mask"]
    for i in range(2):
        valid = torch.cat([x["image_mask"][i].repeat_interleave(per), tok_valid[i]])
        assert torch.equal(pm[i], valid)
        n_valid = int(valid.sum())
        # valid tokens are numbered 0..n_valid-1 in order
        assert torch.equal(prefix_pos[i][valid], torch.arange(n_valid))
        assert torch.equal(suffix_pos[i], n_valid + torch.arange(50))
    # second observation: the first camera is masked, so its second camera starts at position 0
    assert not x["image_mask"][1, 0] and x["image_mask"][1, 1]
    assert prefix_pos[1][per] == 0
    assert prefix_pos[0][per] == per
    # prefix attention: bidirectional among valid tokens, nothing attends a padded token
    prefix_mask = attn_masks[0]
    valid1 = pm[1]
    assert torch.equal(prefix_mask[1, 0][valid1][:, valid1], torch.ones(int(valid1.sum()), int(valid1.sum()), dtype=torch.bool))
    assert not prefix_mask[1, 0][valid1][:, ~valid1].any()
    # expert attention (last recorded): (B, 1, H, P + H); prefix part = prefix_mask, action part all True
    exp_mask = attn_masks[-1]
    p_len = pm.shape[1]
    assert exp_mask.shape == (2, 1, 50, p_len + 50)
    assert torch.equal(exp_mask[:, 0, :, :p_len], pm[:, None, :].expand(2, 50, p_len))
    assert exp_mask[:, 0, :, p_len:].all()
    assert n_views == x["image_mask"].shape[1]


def test_time_embedding_formula():
    """openpi's sinusoid: sin then cos of 2*pi*t/period, periods geometric from min to max, fp64."""
    t = torch.tensor([0.0, 0.25, 1.0, 0.999])
    got = sinusoidal_time_embedding(t, 16, 4e-3, 4.0)
    want = R.sinusoid(t, 16, 4e-3, 4.0)
    assert got.dtype == torch.float32 and got.shape == (4, 16)
    assert torch.allclose(got.double(), want, atol=1e-7, rtol=0)
    assert torch.equal(got[0, :8], torch.zeros(8)) and torch.equal(got[0, 8:], torch.ones(8))
    # the shortest period is min_period: sin(2*pi*t/0.004) for t = 0.25 is sin(125*pi) = 0
    assert abs(float(got[1, 0])) < 1e-6
    # the longest period is max_period: sin(2*pi*0.25/4) = sin(pi/8)
    assert abs(float(got[1, 7]) - math.sin(math.pi / 8)) < 1e-7
    # fp32 variant (for exporters) stays close
    assert torch.allclose(sinusoidal_time_embedding(t, 16, 4e-3, 4.0, fp64=False), got, atol=5e-4)


def test_time_condition_is_silu_mlp(tiny_adapter):
    m = tiny_adapter.module
    t = torch.tensor([0.3, 0.9])
    emb = R.sinusoid(t, m.cfg.expert.width, m.cfg.time_min_period, m.cfg.time_max_period).float()
    silu = torch.nn.functional.silu
    want = silu(m.time_mlp_out(silu(m.time_mlp_in(emb))))
    with torch.no_grad():
        assert rel_err(m.time_condition(t), want) <= 1e-6


def test_adaptive_block_matches_formulas(tiny_adapter):
    """One adaptive expert block vs the formulas: normed*(1+scale)+shift, gated residual x + y*gate."""
    from phyai_edge.layers.rotary import rope_cos_sin

    m = tiny_adapter.module
    blk = m.expert_layers[1]
    e = m.cfg.expert
    sd = {k.removeprefix("expert_layers.1."): v.double() for k, v in m.state_dict().items() if k.startswith("expert_layers.1.")}
    lw = R.LayerW(sd, "", True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, e.width, generator=g)
    cond = torch.randn(2, e.width, generator=g)
    pos = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, 5, 6]])
    allowed = torch.ones(2, 7, 7, dtype=torch.bool)
    allowed[0, :, 5:] = False
    with torch.no_grad():
        cos, sin = rope_cos_sin(pos, e.head_dim, e.rope_theta, torch.float32)
        q, k, v, gate = blk.project_kv(x, cos, sin, cond)
        got = blk.finish(x, q, k, v, allowed[:, None], gate, cond)
    xd, cd = x.double(), cond.double()
    hN, g1 = R.norm(xd, lw.n1, cd, e.rms_eps)
    rq, rk, rv = R.qkv(lw, hN, pos, e.num_heads, e.num_kv_heads, e.head_dim, e.rope_theta)
    y = R.lin(R.merge(R.attend(rq, rk, rv, allowed)), lw.wo)
    x1 = xd + y * g1
    h2, g2 = R.norm(x1, lw.n2, cd, e.rms_eps)
    want = x1 + R.mlp(lw, h2) * g2
    assert rel_err(got, want) <= TOL
    # gates are real: forcing gate = 1 (plain residual) changes the result
    with torch.no_grad():
        plain = blk.finish(x, q, k, v, allowed[:, None], torch.ones_like(gate), cond)
    assert rel_err(plain, want) > 1e-3


def test_padding_tokens_do_not_change_the_chunk(tiny_policy, make_obs, noise_for):
    """Change the ids sitting in padded prompt positions: the chunk is identical."""
    ad, eng = tiny_policy.adapter, tiny_policy.engine
    inputs = ad.preprocess([make_obs(ad, seed=4, prompt="pick")])
    pad = ~inputs.tensors["token_mask"]
    assert pad.sum() > 10
    noise = noise_for(ad)
    base = eng.run(inputs, noise=noise)
    inputs.tensors["tokens"] = torch.where(pad, torch.randint(1, ad.cfg.vocab_size, pad.shape), inputs.tensors["tokens"])
    assert torch.equal(eng.run(inputs, noise=noise), base)
    # whereas changing one *valid* token does change it
    inputs.tensors["tokens"][0, 1] = (inputs.tensors["tokens"][0, 1] + 7) % ad.cfg.vocab_size
    assert not torch.allclose(eng.run(inputs, noise=noise), base, atol=1e-6)


def test_masked_camera_content_is_ignored(tiny_policy, make_obs, noise_for):
    ad, eng = tiny_policy.adapter, tiny_policy.engine
    obs = make_obs(ad, seed=5)
    obs.images = {**obs.images, "left_wrist": None}
    inputs = ad.preprocess([obs])
    assert inputs.tensors["image_mask"].tolist() == [[True, False, True]]
    assert torch.equal(inputs.tensors["images"][0, 1], torch.full_like(inputs.tensors["images"][0, 1], -1.0))
    noise = noise_for(ad)
    base = eng.run(inputs, noise=noise)
    inputs.tensors["images"][0, 1] = torch.rand_like(inputs.tensors["images"][0, 1])
    assert torch.equal(eng.run(inputs, noise=noise), base)
    # but masking a camera is not a no-op: with the camera present the chunk differs
    present = ad.preprocess([make_obs(ad, seed=5)])
    assert not torch.allclose(eng.run(present, noise=noise), base, atol=1e-6)


# -- full preset on the meta device ----------------------------------------------------
def _expected_full_parameter_count() -> dict[str, int]:
    """From the published sizes (PaliGemma-3B's SigLIP so400m/14 + Gemma-2B, a Gemma-300M-shaped
    expert with adaptive RMSNorm, openpi's PI0.5 projections), not from our code."""
    # SigLIP so400m/14 @ 224: width 1152, 27 layers, MLP 4304, 256 patches
    w, mlp, depth, patches = 1152, 4304, 27, (224 // 14) ** 2
    siglip = (3 * 14 * 14 * w + w) + patches * w  # patch conv + bias, position table
    siglip += depth * (2 * 2 * w + 4 * (w * w + w) + (w * mlp + mlp) + (mlp * w + w))
    siglip += 2 * w  # post_layernorm
    projector = w * 2048 + 2048
    # Gemma-2B: width 2048, 18 layers, 8 heads x 256, 1 KV head, MLP 16384, vocab 257152
    W, F, H, D = 2048, 16384, 8, 256
    gemma = 257152 * W + 18 * (W * H * D + 2 * W * D + H * D * W + 3 * W * F + 2 * W) + W
    # expert: width 1024, 18 layers, same heads, MLP 4096; every norm is Linear(1024 -> 3*1024)
    We, Fe = 1024, 4096
    ada = We * 3 * We + 3 * We
    expert = 18 * (We * H * D + 2 * We * D + H * D * We + 3 * We * Fe + 2 * ada) + ada
    heads_ = (32 * We + We) + (We * 32 + 32) + 2 * (We * We + We)  # action in/out, time MLP
    return {"siglip": siglip, "projector": projector, "gemma": gemma, "expert": expert, "other": heads_}


def test_full_preset_on_meta_device_parameter_count():
    exp = _expected_full_parameter_count()
    total = sum(exp.values())
    print(f"\nPI0.5 full: {total:,} parameters ({', '.join(f'{k} {v:,}' for k, v in exp.items())})")
    # the published names are the right order of magnitude
    assert 400e6 < exp["siglip"] < 430e6  # "so400m"
    assert 2.45e9 < exp["gemma"] < 2.55e9  # Gemma-2B incl. its 257152 x 2048 embedding
    assert 300e6 < exp["expert"] - 18 * 2 * (1024 * 3072 + 3072) - (1024 * 3072 + 3072) < 320e6  # "300M"
    with torch.device("meta"):
        m = PI05Model(full())
    assert all(p.is_meta for p in m.parameters())
    n = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    assert n(m.vision) == exp["siglip"]
    assert n(m.projector) == exp["projector"]
    assert n(m.embed_tokens) + n(m.prefix_layers) + n(m.prefix_norm) == exp["gemma"]
    assert n(m.expert_layers) + n(m.expert_norm) == exp["expert"]
    assert n(m) == total


def test_full_builtin_adapter_does_not_allocate():
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ad = builtin_adapter("full")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert all(p.is_meta for p in ad.module.parameters())
    assert after - before < 200 * 1024  # KiB: far less than the ~13 GB fp32 weights would take
    specs = {s.name: s for s in ad.stage_specs(batch_size=1)}
    assert specs["embed_images"].outputs["image_embeds"][0] == (1, 3 * 256, 2048)
    assert specs["encode_prefix"].outputs["k_cache"][0] == (18, 1, 1, 3 * 256 + 200, 256)
    assert specs["denoise_step"].inputs["x_t"][0] == (1, 50, 32)
    assert ad.solver.num_steps == 10 and ad.solver.times()[0] == 1.0
    assert np.isclose(ad.solver.dt, -0.1)


def test_full_preset_on_a_real_device_draws_seeded_weights(monkeypatch):
    """Without a checkpoint the full preset is meta for structure (default, device="meta") and
    seeded random weights drawn on a real device (what `phyai-edge bench --preset full --device
    cuda` times); the tiny preset is the CPU draw whatever the device. The full config is swapped
    for the tiny one here so the test allocates megabytes, not 13 GB."""
    from phyai_edge.adapters import load_adapter
    from phyai_edge.adapters.pi05 import builtin
    from phyai_edge.adapters.pi05.config import preset

    tiny = preset("tiny")
    monkeypatch.setattr(builtin, "preset", lambda name: tiny)
    assert all(p.is_meta for p in builtin.builtin_adapter("full", device="meta").module.parameters())
    assert all(p.is_meta for p in load_adapter("pi05", preset_name="full", device="meta").module.parameters())
    drawn = load_adapter("pi05", preset_name="full", device="cpu", seed=3).module
    again = builtin.builtin_adapter("full", device="cpu", seed=3).module
    assert not any(p.is_meta for p in drawn.parameters())
    for (name, a), b in zip(drawn.named_parameters(), again.parameters()):
        assert torch.equal(a, b) and torch.isfinite(a).all(), name
    other = builtin.builtin_adapter("full", device="cpu", seed=4).module
    assert not torch.equal(next(drawn.parameters()), next(other.parameters()))
