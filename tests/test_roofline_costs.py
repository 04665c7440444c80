"""FLOP and byte counts: a config small enough to count by hand, then sanity on the full size."""

from __future__ import annotations

import pytest

from phyai_edge.adapters.pi05.config import GemmaSpec, PI05Config, SiglipSpec, full
from phyai_edge.roofline.costs import (
    COST_MODELS,
    CostModel,
    StageCost,
    cost_model,
    pi05_param_counts,
    pi05_stage_costs,
    pi05_weights_bytes,
    register_cost_model,
    stage_costs,
)
from phyai_edge.roofline.devices import find_device


def hand_config() -> PI05Config:
    # Prefix and expert must have equal depth (every prefix layer pairs with an expert layer).
    return PI05Config(
        vision=SiglipSpec(image_size=4, patch_size=2, width=4, depth=1, num_heads=2, mlp_dim=8),
        prefix=GemmaSpec(width=8, depth=2, mlp_dim=16, num_heads=2, num_kv_heads=1, head_dim=4),
        expert=GemmaSpec(width=4, depth=2, mlp_dim=8, num_heads=2, num_kv_heads=1, head_dim=4),
        vocab_size=32,
        chunk_size=3,
        max_action_dim=2,
        max_token_len=5,
        num_steps=2,
        preset="hand",
    )


def test_hand_counted_flops() -> None:
    c = pi05_stage_costs(hand_config(), batch=1, views=1, prompt_tokens=5, steps=2)
    # Vision, 4 tokens of width 4 (2 heads of dim 2):
    #   patch 2*4*12*4 = 384; qkv 2*4*4*12 = 384; attn 4*4*4*2*2 = 256; out 2*4*4*4 = 128;
    #   mlp 2*4*4*8 + 2*4*8*4 = 512; projector 2*4*4*8 = 256  -> 1920
    assert c["embed_images"].flops == 1920
    # Prefix, 4 image + 5 prompt = 9 tokens, width 8, q 8, kv 4 (x2), mlp 16. Layer 1 in full:
    #   qkv 2*9*8*16 = 2304; attn 4*9*9*2*4 = 2592; o 2*9*8*8 = 1152; gate+up 2*9*8*32 = 4608;
    #   down 2*9*16*8 = 2304 -> 12960. Layer 2 (last) only projects QKV for the cache: 2304.
    assert c["encode_prefix"].flops == 12960 + 2304
    # Denoise step, 3 action tokens of width 4 attending to 9 + 3 keys, per layer:
    #   qkv 2*3*4*16 = 384; attn 4*3*12*2*4 = 1152; o 2*3*8*4 = 192; gate+up 2*3*4*16 = 384;
    #   down 2*3*8*4 = 192 -> 2304; plus in 2*3*2*4 = 48 and out 2*3*4*2 = 48.
    assert c["denoise_step"].flops == 48 + 2 * 2304 + 48
    assert c["solver_loop"].flops == 2 * 4704
    # Attention is the only non-GEMM work.
    assert c["embed_images"].flops - c["embed_images"].gemm_flops == 256
    assert c["encode_prefix"].flops - c["encode_prefix"].gemm_flops == 2592
    assert c["denoise_step"].flops - c["denoise_step"].gemm_flops == 2 * 1152


def test_hand_counted_bytes() -> None:
    c = pi05_stage_costs(hand_config(), batch=1, views=1, prompt_tokens=5, steps=2, precision="bf16")
    # Expert weights: in 2*4 + 2 layers x (qkv 4*16 + o 8*4 + gate/up 4*16 + down 8*4) + out 4*2 = 400.
    assert c["denoise_step"].weight_bytes == 400 * 2
    # Bytes = weights + each GEMM's input and output once + attention Q/K/V/O + the time table.
    per_layer_acts = 3 * (4 + 16) + 3 * (8 + 4) + 3 * (4 + 16) + 3 * (8 + 4)
    acts = 3 * (2 + 4) + 2 * per_layer_acts + 3 * (4 + 2)
    attn = 2 * (2 * 3 * 2 * 4 + 2 * 12 * 1 * 4)  # Q and O of 3 queries; K and V of 12 keys
    table = (2 * 2 + 1) * 3 * 4  # scale/shift/gate for 2 norms per layer + the final norm, float32
    assert c["denoise_step"].bytes == 400 * 2 + (acts + attn) * 2 + table * 4
    fp8 = pi05_stage_costs(hand_config(), batch=1, views=1, prompt_tokens=5, steps=2, precision="fp8")
    assert fp8["denoise_step"].weight_bytes == 400
    assert fp8["denoise_step"].flops == c["denoise_step"].flops


def test_batch_scales_flops_not_weights() -> None:
    one = pi05_stage_costs(hand_config(), batch=1, views=1, prompt_tokens=5)
    two = pi05_stage_costs(hand_config(), batch=2, views=1, prompt_tokens=5)
    for stage in ("embed_images", "encode_prefix", "denoise_step"):
        assert two[stage].flops == 2 * one[stage].flops
        assert two[stage].weight_bytes == one[stage].weight_bytes
        assert two[stage].bytes < 2 * one[stage].bytes


def test_views_grow_prefix_quadratically_in_attention() -> None:
    cfg = hand_config()
    a = pi05_stage_costs(cfg, views=1, prompt_tokens=0)
    b = pi05_stage_costs(cfg, views=2, prompt_tokens=0)

    def attn(c: dict[str, StageCost]) -> float:
        return c["encode_prefix"].flops - c["encode_prefix"].gemm_flops

    assert attn(b) == 4 * attn(a)  # 8 tokens vs 4
    assert b["embed_images"].flops == 2 * a["embed_images"].flops


def test_time_tables_flag_counts_modulation_gemms() -> None:
    cfg = hand_config()
    pre = pi05_stage_costs(cfg, views=1, prompt_tokens=5)
    eager = pi05_stage_costs(cfg, views=1, prompt_tokens=5, time_tables_precomputed=False)
    # time MLP 2 x (4x4) + 5 adaptive norms x (4 x 12) = 32 + 240 params, on one token; float32
    # whatever the precision, as PI05Model.set_precision keeps them.
    assert eager["denoise_step"].flops - pre["denoise_step"].flops == 2 * (32 + 240)
    assert eager["denoise_step"].weight_bytes - pre["denoise_step"].weight_bytes == (32 + 240) * 4
    fp8 = pi05_stage_costs(cfg, views=1, prompt_tokens=5, precision="fp8", time_tables_precomputed=False)
    assert eager["denoise_step"].weight_bytes - fp8["denoise_step"].weight_bytes == 400  # the float32 part stays


def test_full_pi05_matches_published_sizes() -> None:
    cfg = full()
    params = sum(pi05_param_counts(cfg, time_tables_precomputed=False).values())
    assert 3.2e9 < params < 3.5e9  # PaliGemma 3B + 300M action expert (+ adaptive-norm weights)
    c = stage_costs("pi05", cfg)  # defaults: 3 views, 200 prompt tokens, 10 steps
    assert cfg.vision.tokens_per_image == 256
    # Prefix of 3 * 256 + 200 tokens through ~2B non-embedding params: ~2 * 968 * 2e9 FLOPs.
    assert c["encode_prefix"].flops == pytest.approx(2 * 968 * 2.0e9, rel=0.1)
    h200 = find_device("h200")
    # The architecture's claim: the VLM prefix is compute-bound, the action expert at batch 1
    # is memory-bound.
    assert c["encode_prefix"].intensity > h200.ridge("bf16")
    assert c["denoise_step"].intensity < h200.ridge("bf16")
    assert c["solver_loop"].flops == pytest.approx(10 * c["denoise_step"].flops)


def test_registry() -> None:
    assert cost_model("pi05").name == "pi05"
    with pytest.raises(ValueError, match="no roofline cost model"):
        cost_model("not-an-adapter")

    def fake(config: object, batch: int, views: int, prompt_tokens: int, steps: int, precision: str) -> dict:
        step = StageCost(flops=10.0 * batch, bytes=5.0)
        return {"embed_images": StageCost(1, 1), "encode_prefix": StageCost(2, 2), "denoise_step": step}

    register_cost_model(
        CostModel(
            name="fake",
            load_config=lambda preset: {"preset": preset},
            stage_costs=fake,
            weights_bytes=lambda config, precision: 0.0,
            defaults=lambda config: {"views": 1, "prompt_tokens": 0, "steps": 4, "horizon": 8},
        )
    )
    try:
        c = stage_costs("fake", {"preset": "x"}, batch=3)
        assert c["denoise_step"].flops == 30.0
    finally:
        del COST_MODELS["fake"]
    with pytest.raises(ValueError, match="precision"):
        pi05_stage_costs(hand_config(), precision="fp4")


def test_weight_counts_match_the_real_module() -> None:
    """The config-derived counts against the adapter's own PI05Model, built on the meta device."""
    torch = pytest.importorskip("torch")
    from phyai_edge.adapters.pi05.model import PI05Model

    cfg = full()
    with torch.device("meta"):
        model = PI05Model(cfg)
    # Weight matrices only (Linear / Conv2d / Embedding .weight); norms and biases are not counted.
    n = sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Embedding))
    )
    # The learned position embedding of SigLIP is an Embedding too, not a GEMM: add it to ours.
    ours = sum(pi05_param_counts(cfg, time_tables_precomputed=False).values())
    pos = cfg.vision.tokens_per_image * cfg.vision.width
    assert n == ours + pos


@pytest.mark.parametrize("time_tables_precomputed", [True, False])
def test_denoise_weight_bytes_match_the_module_in_engine_precision(time_tables_precomputed: bool) -> None:
    """One denoise step reads every parameter it uses once, in the dtype `set_precision` gives it:
    the expert's projections in bf16, but the adaptive norms' modulation linears, the time MLP and
    the action projections in float32 (`PI05Model.precision_dtypes`). The eager backend
    (no time tables) reads the float32 modulation weights on every step."""
    torch = pytest.importorskip("torch")
    from phyai_edge.adapters.pi05.model import PI05Model

    cfg = full()
    model = PI05Model.skeleton(cfg).set_precision(torch.bfloat16)
    used = [*model.expert_layers, model.action_in_proj, model.action_out_proj]
    if not time_tables_precomputed:
        used += [model.expert_norm, model.time_mlp_in, model.time_mlp_out]
    read = sum(
        p.numel() * p.element_size()
        for m in used
        for name, p in m.named_parameters()
        if time_tables_precomputed is False or "layernorm.dense" not in name
    )
    ours = pi05_stage_costs(cfg, prompt_tokens=48, time_tables_precomputed=time_tables_precomputed)
    # Ours leaves out biases and norm scales (< 0.1 %).
    assert ours["denoise_step"].weight_bytes == pytest.approx(read, rel=1e-3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_resident_weights_match_the_module_in_engine_precision(dtype: str) -> None:
    """What `roofline` checks against a device's memory: every parameter the engine's module holds,
    in the dtype `set_precision` gives it. The adaptive norms' modulation and the time MLP stay
    resident (float32) even when the engine reads precomputed tables instead."""
    torch = pytest.importorskip("torch")
    from phyai_edge.adapters.pi05.model import PI05Model

    cfg = full()
    model = PI05Model.skeleton(cfg).set_precision(getattr(torch, dtype))
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    precision = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    # Ours leaves out biases, norm scales and SigLIP's position embedding (< 0.1 %).
    assert pi05_weights_bytes(cfg, precision) == pytest.approx(held, rel=1e-3)


@pytest.mark.parametrize("batch", [1, 3])
def test_flops_match_flop_counter_on_the_model_stages(batch: int) -> None:
    """Every stage's FLOPs against torch's FlopCounterMode over the model's own stage functions
    (tiny preset, 3 views, 48 valid prompt tokens as the engine trims them, key-only masks as the
    engines set them). SDPA's math kernel is forced so the counter sees attention on the CPU."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from phyai_edge.adapters.pi05.builtin import seeded_model
    from phyai_edge.adapters.pi05.config import tiny

    cfg, views, prompt = tiny(), 3, 48
    model = seeded_model(cfg)
    model.attend_keys_only = True

    def counted(fn):
        with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as counter:
            out = fn()
        return counter.get_total_flops(), out

    size = cfg.vision.image_size
    images = torch.zeros(batch, views, 3, size, size)
    vision, embeds = counted(lambda: model.embed_images(images))
    tokens = torch.zeros(batch, prompt, dtype=torch.long)
    valid = torch.ones(batch, prompt, dtype=torch.bool)
    prefix, (k, v, mask) = counted(
        lambda: model.encode_prefix(embeds, torch.ones(batch, views, dtype=torch.bool), tokens, valid)
    )
    t = torch.full((batch,), 0.5)
    x = torch.zeros(batch, cfg.chunk_size, cfg.max_action_dim)
    with torch.no_grad():
        table = model.time_modulation(t)
    step, _ = counted(lambda: model.denoise_step(x, t, k, v, mask, modulation=table))
    eager_step, _ = counted(lambda: model.denoise_step(x, t, k, v, mask))

    ours = pi05_stage_costs(cfg, batch=batch, views=views, prompt_tokens=prompt)
    eager = pi05_stage_costs(cfg, batch=batch, views=views, prompt_tokens=prompt, time_tables_precomputed=False)
    assert ours["embed_images"].flops == vision
    assert ours["encode_prefix"].flops == prefix
    assert ours["denoise_step"].flops == step
    assert eager["denoise_step"].flops == eager_step
