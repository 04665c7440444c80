"""The eager engine: the reference every other backend is checked against."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.reference import rel_err

from phyai_edge.adapters.pi05.builtin import builtin_adapter
from phyai_edge.engines import make_engine
from phyai_edge.engines.eager import EagerEngine, resolve_dtype
from phyai_edge.engines.policy import Policy, load_policy

STAGES = {"embed_images", "encode_prefix", "solver_loop", "denoise_step"}


def test_same_noise_gives_bit_identical_chunks(tiny_policy, make_obs, noise_for):
    obs = make_obs(tiny_policy.adapter)
    noise = noise_for(tiny_policy.adapter)
    a = tiny_policy.infer(obs, noise=noise)
    b = tiny_policy.infer(obs, noise=noise.clone())
    assert torch.equal(a.chunk, b.chunk) and np.array_equal(a.actions, b.actions)
    c = tiny_policy.infer(obs, noise=noise_for(tiny_policy.adapter, seed=1))
    assert (c.chunk - a.chunk).abs().max() > 1e-2
    assert a.chunk.shape == (1, 50, 32) and a.actions.shape == (1, 50, 14)
    assert np.isfinite(a.actions).all() and a.actions.dtype == np.float32


def test_seeded_engine_noise_is_reproducible(make_obs):
    runs = []
    for _ in range(2):
        ad = builtin_adapter("tiny", seed=0)
        pol = Policy(ad, EagerEngine(ad, seed=123))
        obs = make_obs(ad)
        runs.append((pol.infer(obs).chunk, pol.infer(obs).chunk))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][0], runs[0][1])  # the generator advances between calls


def test_noise_is_what_the_solver_starts_from(tiny_adapter, make_obs, noise_for):
    """The engine's chunk is the Euler loop from the injected noise over the adapter's stages."""
    eng = EagerEngine(tiny_adapter)
    inputs = tiny_adapter.preprocess([make_obs(tiny_adapter)])
    noise = noise_for(tiny_adapter)
    chunk = eng.run(inputs, noise=noise)
    m = tiny_adapter.module
    with torch.no_grad():
        img = m.embed_images(inputs.tensors["images"])
        k, v, pm = m.encode_prefix(img, inputs.tensors["image_mask"], inputs.tensors["tokens"], inputs.tensors["token_mask"])
        x = noise.clone()
        for i in range(10):
            x = x - 0.1 * m.denoise_step(x, torch.full((1,), 1.0 - 0.1 * i), k, v, pm)
    assert torch.allclose(chunk, x, atol=1e-6, rtol=0)


def test_bf16_close_to_fp32(make_obs, noise_for):
    a32, a16 = builtin_adapter("tiny", seed=0), builtin_adapter("tiny", seed=0)
    p32 = Policy(a32, EagerEngine(a32, dtype="float32"))
    p16 = Policy(a16, EagerEngine(a16, dtype="bf16"))
    m = a16.module
    assert m.prefix_layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert m.vision.encoder.layers[0].mlp.fc1.weight.dtype == torch.bfloat16
    # norms, time MLP and action projections stay float32
    assert m.prefix_layers[0].input_layernorm.weight.dtype == torch.float32
    assert m.expert_layers[0].input_layernorm.dense.weight.dtype == torch.float32
    assert m.time_mlp_in.weight.dtype == m.action_out_proj.weight.dtype == torch.float32
    obs = [make_obs(a32, seed=0), make_obs(a32, seed=1, prompt="open the drawer")]
    noise = noise_for(a32, batch=2)
    c32, c16 = p32.infer(obs, noise=noise).chunk, p16.infer(obs, noise=noise).chunk
    assert c16.dtype == torch.float32 and torch.isfinite(c16).all()
    err = rel_err(c16, c32)
    assert 0 < err < 2e-2, err  # bf16 really ran, and stayed close


def test_batch_of_two_equals_two_single_runs(tiny_policy, make_obs, noise_for):
    ad = tiny_policy.adapter
    o1 = make_obs(ad, seed=3, prompt="pick up the red cube")
    o2 = make_obs(ad, seed=4, prompt="open the drawer", size=(200, 100))
    o2.images = {**o2.images, "left_wrist": None}
    noise = noise_for(ad, batch=2)
    both = tiny_policy.infer([o1, o2], noise=noise)
    one = tiny_policy.infer(o1, noise=noise[:1])
    two = tiny_policy.infer(o2, noise=noise[1:])
    assert both.chunk.shape == (2, 50, 32)
    assert torch.allclose(both.chunk[0], one.chunk[0], atol=1e-5, rtol=0)
    assert torch.allclose(both.chunk[1], two.chunk[0], atol=1e-5, rtol=0)
    assert not torch.allclose(both.chunk[0], both.chunk[1], atol=1e-3)


def test_stage_timings_are_reported(tiny_policy, make_obs):
    res = tiny_policy.infer(make_obs(tiny_policy.adapter))
    ms = res.stage_ms
    assert STAGES | {"preprocess", "postprocess", "total"} <= set(ms)
    assert all(v > 0 for v in ms.values())
    assert ms["denoise_step"] == pytest.approx(ms["solver_loop"] / 10)
    parts = ms["preprocess"] + ms["embed_images"] + ms["encode_prefix"] + ms["solver_loop"] + ms["postprocess"]
    assert parts <= ms["total"] * 1.001
    assert set(tiny_policy.engine.last_stage_ms) == STAGES


def test_engine_factory_and_dtype_errors(tiny_adapter):
    assert isinstance(make_engine("eager", tiny_adapter), EagerEngine)
    with pytest.raises(ValueError, match="unknown backend"):
        make_engine("warp-drive", tiny_adapter)
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("fp7")


def test_load_policy_default_is_the_tiny_builtin(make_obs, noise_for):
    pol = load_policy()
    assert pol.chunk_size == 50 and pol.action_dim == 14 and pol.camera_names == ["top", "left_wrist", "right_wrist"]
    ad = builtin_adapter("tiny", seed=0)
    ref = Policy(ad, EagerEngine(ad))
    obs = make_obs(ad)
    noise = noise_for(ad)
    assert torch.equal(pol.infer(obs, noise=noise).chunk, ref.infer(obs, noise=noise).chunk)


def test_policy_checks_the_noise_and_the_rtc_mode_as_a_server_does(tiny_policy, make_obs):
    """Locally, noise of 10 steps gave a chunk of 10 actions, a misspelt RTC mode ran unguided, and
    numpy noise ended in an AttributeError; the server refused the first two and took the third."""
    from phyai_edge.engines.base import RTCRequest

    ad = tiny_policy.adapter
    obs = make_obs(ad, seed=1)
    for shape in ((1, 10, ad.model_action_dim), (1, ad.chunk_size, ad.action_dim), (2, ad.chunk_size, 32)):
        with pytest.raises(ValueError, match=r"noise must have shape \(1, 50, 32\)"):
            tiny_policy.infer(obs, noise=torch.randn(*shape))
    noise = np.random.default_rng(0).standard_normal((1, ad.chunk_size, ad.model_action_dim)).astype(np.float32)
    np.testing.assert_array_equal(tiny_policy.infer(obs, noise=noise).actions,
                                  tiny_policy.infer(obs, noise=torch.from_numpy(noise)).actions)
    prefix = np.zeros((20, ad.action_dim), np.float32)
    for mode in ("bogus", "GUIDED"):
        with pytest.raises(ValueError, match=rf"RTC mode '{mode}' is not one of none, crossfade"):
            tiny_policy.infer(obs, rtc=RTCRequest(mode, prefix, 3, 25), noise=noise)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="is not one of"):
            tiny_policy.infer([obs], rtc=[RTCRequest(mode, prefix, 3, 25)], noise=noise)  # type: ignore[arg-type]
