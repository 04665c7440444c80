"""Per-stage FLOP and byte counts, computed from an adapter's config.

Each adapter registers a `CostModel` under its name. Its `stage_costs(config, batch, views,
prompt_tokens, steps, precision)` returns `{stage: StageCost}` for the engine's stage names:
`embed_images`, `encode_prefix`, `denoise_step` (one flow step) and `solver_loop`
(steps x denoise_step). A new adapter adds its own function with `register_cost_model`.

Counting rules (shared by every adapter through the helpers below)
  * A linear layer y = x W over n tokens: 2*n*d_in*d_out FLOPs; bytes = weights once per batch
    (d_in*d_out*weight_bytes) + read input and write output once (n*(d_in+d_out)*act_bytes).
    Weights are read once per stage call whatever the batch: that is why batch 1 is
    memory-bound and batching is nearly free until the ridge point.
  * Attention with n_q queries over n_k keys: 4*n_q*n_k*heads*head_dim FLOPs (QK^T and PV;
    softmax is ignored). Bytes as a fused (flash) kernel moves them: read Q, K, V, write O;
    the n_q x n_k score matrix never reaches DRAM.
  * Norms, biases, residual adds, rotary, softmax: ignored (< 1 % of FLOPs and bytes here).
  * Precision sets weight bytes (bf16/fp16: 2, fp8/int8: 1). Activations and the KV cache stay
    16-bit (2 bytes), as our engines keep them; weight GEMMs run at the precision's peak,
    attention at the 16-bit peak. Parts a model keeps in float32 whatever the precision are
    counted at 4 bytes (PI0.5: the adaptive norms' modulation and the time MLP).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WEIGHT_BYTES: dict[str, float] = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0}
ACT_BYTES = 2.0
FP32_BYTES = 4.0
PRECISIONS = tuple(WEIGHT_BYTES)


def weight_bytes(precision: str) -> float:
    try:
        return WEIGHT_BYTES[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; choose one of {list(PRECISIONS)}") from None


@dataclass(frozen=True)
class StageCost:
    """Work of one stage call. `gemm_flops` is the part in weight GEMMs (runs at the chosen
    precision's peak); the rest of `flops` (attention) runs at the 16-bit peak."""

    flops: float = 0.0
    bytes: float = 0.0
    gemm_flops: float = 0.0
    weight_bytes: float = 0.0

    def __add__(self, other: StageCost) -> StageCost:
        return StageCost(
            self.flops + other.flops,
            self.bytes + other.bytes,
            self.gemm_flops + other.gemm_flops,
            self.weight_bytes + other.weight_bytes,
        )

    def scaled(self, k: float) -> StageCost:
        return StageCost(self.flops * k, self.bytes * k, self.gemm_flops * k, self.weight_bytes * k)

    @property
    def intensity(self) -> float:
        """FLOPs per DRAM byte: compare with the device's ridge point peak / bandwidth."""
        return self.flops / self.bytes if self.bytes else float("inf")


def linear(n: float, d_in: int, d_out: int, wbytes: float) -> StageCost:
    w = d_in * d_out * wbytes
    f = 2.0 * n * d_in * d_out
    return StageCost(flops=f, bytes=w + n * (d_in + d_out) * ACT_BYTES, gemm_flops=f, weight_bytes=w)


def attention(
    n_q: float, n_k: float, heads: int, kv_heads: int, head_dim: int, instances: float = 1
) -> StageCost:
    """`instances` independent attentions (e.g. one per image or per batch element)."""
    f = 4.0 * n_q * n_k * heads * head_dim
    b = (2 * n_q * heads * head_dim + 2 * n_k * kv_heads * head_dim) * ACT_BYTES
    return StageCost(flops=f * instances, bytes=b * instances)


def table_read(elements: float, bytes_per_element: float) -> StageCost:
    """A lookup that moves bytes and does no math (embedding rows, precomputed tables)."""
    return StageCost(bytes=elements * bytes_per_element)


def gemma_layer(spec: Any, n_q: int, n_k: int, batch: int, wbytes: float) -> StageCost:
    """One Gemma-style decoder layer (GQA attention + gated MLP) over n_q query tokens per sample
    attending to n_k keys (cached prefix + its own tokens)."""
    n = batch * n_q
    q_dim = spec.num_heads * spec.head_dim
    kv_dim = spec.num_kv_heads * spec.head_dim
    return (
        linear(n, spec.width, q_dim + 2 * kv_dim, wbytes)  # fused QKV
        + attention(n_q, n_k, spec.num_heads, spec.num_kv_heads, spec.head_dim, instances=batch)
        + linear(n, q_dim, spec.width, wbytes)  # output projection
        + linear(n, spec.width, 2 * spec.mlp_dim, wbytes)  # fused gate + up
        + linear(n, spec.mlp_dim, spec.width, wbytes)  # down
    )


def vit_layer(spec: Any, tokens: int, images: int, wbytes: float) -> StageCost:
    """One pre-norm ViT encoder layer (MHA + plain MLP) over `images` independent images."""
    n = images * tokens
    return (
        linear(n, spec.width, 3 * spec.width, wbytes)
        + attention(tokens, tokens, spec.num_heads, spec.num_heads, spec.width // spec.num_heads, images)
        + linear(n, spec.width, spec.width, wbytes)
        + linear(n, spec.width, spec.mlp_dim, wbytes)
        + linear(n, spec.mlp_dim, spec.width, wbytes)
    )


# --------------------------------------------------------------------------- registry

StageCostFn = Callable[..., dict[str, StageCost]]


@dataclass(frozen=True)
class CostModel:
    """What the roofline needs from an adapter: its configs and how to count its stages."""

    name: str
    load_config: Callable[[str], Any]  # preset name -> config
    stage_costs: StageCostFn  # (config, batch, views, prompt_tokens, steps, precision) -> costs
    weights_bytes: Callable[[Any, str], float]  # (config, precision) -> resident weight bytes
    defaults: Callable[[Any], dict[str, int]]  # config -> default views / prompt_tokens / steps / horizon


COST_MODELS: dict[str, CostModel] = {}


def register_cost_model(model: CostModel) -> CostModel:
    COST_MODELS[model.name] = model
    return model


def cost_model(adapter: str) -> CostModel:
    _ensure_builtin()
    try:
        return COST_MODELS[adapter]
    except KeyError:
        raise ValueError(
            f"no roofline cost model for adapter {adapter!r}; known: {sorted(COST_MODELS)}"
        ) from None


def stage_costs(
    adapter: str,
    config: Any,
    batch: int = 1,
    views: int | None = None,
    prompt_tokens: int | None = None,
    steps: int | None = None,
    precision: str = "bf16",
    **options: Any,
) -> dict[str, StageCost]:
    """Look up the adapter's cost function and fill unset arguments from its defaults.
    `options` go to the adapter's function as they are (e.g. PI0.5's time_tables_precomputed)."""
    m = cost_model(adapter)
    dflt = m.defaults(config)
    return m.stage_costs(
        config,
        batch=batch,
        views=dflt["views"] if views is None else views,
        prompt_tokens=dflt["prompt_tokens"] if prompt_tokens is None else prompt_tokens,
        steps=dflt["steps"] if steps is None else steps,
        precision=precision,
        **options,
    )


def _ensure_builtin() -> None:
    if "pi05" not in COST_MODELS:
        register_cost_model(PI05_COSTS)


# --------------------------------------------------------------------------- PI0.5


def pi05_stage_costs(
    config: Any,
    batch: int = 1,
    views: int = 3,
    prompt_tokens: int | None = None,
    steps: int | None = None,
    precision: str = "bf16",
    time_tables_precomputed: bool = True,
) -> dict[str, StageCost]:
    """PI0.5: SigLIP over each view, Gemma prefix over image + prompt tokens (writes the KV
    cache), and an action expert that attends to prefix + chunk on every flow step.

    Every size comes from `config` (a PI05Config); `prompt_tokens` defaults to the padded
    static length `max_token_len` the engines use (state tokens live inside the prompt).
    `time_tables_precomputed`: the adaptive-RMSNorm modulation and time MLP depend only on
    the flow time, which is fixed per step, so our engines precompute them (a table read);
    False counts them as the GEMMs an eager model runs. Either way they are float32 whatever the
    precision (`PI05Model.precision_dtypes` keeps norms, their modulation linears and the time MLP
    in float32): 4-byte weights and table rows.
    """
    if batch < 1 or views < 1:
        raise ValueError(f"batch and views must be >= 1, got batch={batch}, views={views}")
    wb = weight_bytes(precision)
    v, p, e = config.vision, config.prefix, config.expert
    prompt = config.max_token_len if prompt_tokens is None else prompt_tokens
    n_steps = config.num_steps if steps is None else steps
    if prompt < 0 or n_steps < 1:
        raise ValueError(f"need prompt_tokens >= 0 and steps >= 1, got {prompt}, {n_steps}")
    t_img = v.tokens_per_image
    images = batch * views

    vision = linear(images * t_img, v.patch_size * v.patch_size * 3, v.width, wb)  # patch embedding
    for _ in range(v.depth):
        vision = vision + vit_layer(v, t_img, images, wb)
    vision = vision + linear(images * t_img, v.width, p.width, wb)  # projector into the prefix width

    n_prefix = views * t_img + prompt
    prefix = table_read(batch * prompt * p.width, wb)  # embedding rows of the prompt tokens
    for _ in range(p.depth - 1):
        prefix = prefix + gemma_layer(p, n_prefix, n_prefix, batch, wb)
    # The expert reads only the prefix KV cache, so the last layer stops after its QKV projection.
    prefix = prefix + linear(batch * n_prefix, p.width, (p.num_heads + 2 * p.num_kv_heads) * p.head_dim, wb)

    h = config.chunk_size
    n_act = batch * h
    step = linear(n_act, config.max_action_dim, e.width, wb)  # action in-projection
    norms = 2 * e.depth + 1  # two adaptive norms per layer and the final one
    if time_tables_precomputed:
        step = step + table_read(norms * 3 * e.width, FP32_BYTES)  # scale/shift/gate rows for this t
    else:
        step = step + linear(batch, e.width, e.width, FP32_BYTES) + linear(batch, e.width, e.width, FP32_BYTES)
        for _ in range(norms):
            step = step + linear(batch, e.width, 3 * e.width, FP32_BYTES)
    for _ in range(e.depth):
        step = step + gemma_layer(e, h, n_prefix + h, batch, wb)  # KV read counted in attention
    step = step + linear(n_act, e.width, config.max_action_dim, wb)  # velocity out-projection

    return {
        "embed_images": vision,
        "encode_prefix": prefix,
        "denoise_step": step,
        "solver_loop": step.scaled(n_steps),
    }


def pi05_param_counts(config: Any, time_tables_precomputed: bool = True) -> dict[str, int]:
    """Weight-matrix parameters per part (biases and norm scales left out, as in the stage counts).
    With precomputed time tables the stages do not read the adaptive-norm and time-MLP weights
    (they stay resident all the same: `pi05_weights_bytes`)."""
    v, p, e = config.vision, config.prefix, config.expert

    def gemma(spec: Any) -> int:
        qkv = spec.width * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        return qkv + spec.num_heads * spec.head_dim * spec.width + 3 * spec.width * spec.mlp_dim

    counts = {
        "vision": v.patch_size**2 * 3 * v.width + v.depth * (4 * v.width**2 + 2 * v.width * v.mlp_dim),
        "projector": v.width * p.width,
        "embed_tokens": config.vocab_size * p.width,
        "prefix_layers": p.depth * gemma(p),
        "expert_layers": e.depth * gemma(e),
        "action_proj": 2 * config.max_action_dim * e.width,
    }
    if not time_tables_precomputed:
        counts["time_mlp"] = 2 * e.width * e.width
        counts["adaptive_norms"] = (2 * e.depth + 1) * e.width * 3 * e.width
    return counts


def pi05_weights_bytes(config: Any, precision: str) -> float:
    """Resident weights: every layer (including the whole embedding table) at `precision`, and the
    float32 parts (adaptive-norm modulation, time MLP) at 4 bytes. The engine's module keeps those
    even when its stages read precomputed tables instead."""
    counts = pi05_param_counts(config, time_tables_precomputed=False)
    fp32 = counts.pop("time_mlp") + counts.pop("adaptive_norms")
    return sum(counts.values()) * weight_bytes(precision) + fp32 * FP32_BYTES


def _pi05_load(preset: str) -> Any:
    from phyai_edge.adapters.pi05.config import preset as load

    return load(preset)


def _pi05_defaults(config: Any) -> dict[str, int]:
    # PI0.5 checkpoints take up to three camera views (base + two wrists).
    return {
        "views": 3,
        "prompt_tokens": config.max_token_len,
        "steps": config.num_steps,
        "horizon": config.chunk_size,
    }


PI05_COSTS = CostModel(
    name="pi05",
    load_config=_pi05_load,
    stage_costs=pi05_stage_costs,
    weights_bytes=pi05_weights_bytes,
    defaults=_pi05_defaults,
)
