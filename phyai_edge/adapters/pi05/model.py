"""PI0.5 as plain PyTorch: SigLIP + projector, a Gemma prefix model, and an action expert.

The model is exposed as three static-shape stages, which is all the runtime ever calls:

    embed_images(images)                                   -> image_embeds
    encode_prefix(image_embeds, image_mask, tokens, token_mask) -> k_cache, v_cache, prefix_mask
    denoise_step(x_t, t, k_cache, v_cache, prefix_mask)    -> velocity

The prefix (images + prompt) attends bidirectionally over its valid tokens and is encoded once
per chunk into a per-layer KV cache; every flow step of the action expert reads that cache and
attends bidirectionally among the chunk's own tokens. The solver loop belongs to the engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from phyai_edge.adapters.pi05.config import PI05Config
from phyai_edge.layers.fp8 import remove_fp8
from phyai_edge.layers.fused import unfuse_projections
from phyai_edge.layers.gemma import GemmaBlock
from phyai_edge.layers.norm import AdaRMSNorm, LayerNorm, Modulation, RMSNorm
from phyai_edge.layers.rotary import rope_cos_sin
from phyai_edge.layers.siglip import SiglipVisionTower


def sinusoidal_time_embedding(
    t: torch.Tensor, dim: int, min_period: float, max_period: float, fp64: bool = True
) -> torch.Tensor:
    """t (B,) -> (B, dim): sin then cos of t at geometrically spaced periods, returned in fp32.

    The published model computes this in float64; `fp64=False` is for exporters whose
    runtimes have no double-precision sine (the difference is ~1e-4 rad at the shortest period).
    """
    dtype = torch.float64 if fp64 else torch.float32
    frac = torch.linspace(0.0, 1.0, dim // 2, dtype=dtype, device=t.device)
    period = min_period * (max_period / min_period) ** frac
    angle = (2 * math.pi / period)[None, :] * t.to(dtype)[:, None]
    return torch.cat([angle.sin(), angle.cos()], dim=-1).float()


class _NoMetaInit(TorchFunctionMode):
    """Random initialisers on meta tensors return at once. Their values never exist, and a
    checkpoint replaces every tensor; but `normal_` on a meta tensor (nn.Embedding's init)
    imports torch._dynamo for its meta kernel: about a second of every process start that loads
    a checkpoint. Thread-local, like every torch function mode."""

    _SKIP = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, nn.init.normal_, nn.init.uniform_,
                       nn.init.trunc_normal_, nn.init.kaiming_uniform_, nn.init.kaiming_normal_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._SKIP:
            t = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


class PI05Model(nn.Module):
    @classmethod
    def skeleton(cls, cfg: PI05Config) -> PI05Model:
        """The model on the meta device, for loading a checkpoint into (no memory, no init)."""
        with torch.device("meta"), _NoMetaInit():
            return cls(cfg)

    def __init__(self, cfg: PI05Config) -> None:
        super().__init__()
        self.cfg = cfg
        v, p, e = cfg.vision, cfg.prefix, cfg.expert
        self.vision = SiglipVisionTower(v.image_size, v.patch_size, v.width, v.depth, v.num_heads, v.mlp_dim, v.ln_eps)
        self.projector = nn.Linear(v.width, p.width)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, p.width)
        self.prefix_layers = nn.ModuleList(
            GemmaBlock(p.width, p.mlp_dim, p.num_heads, p.num_kv_heads, p.head_dim, p.rms_eps) for _ in range(p.depth)
        )
        self.prefix_norm = RMSNorm(p.width, p.rms_eps)  # loaded for completeness; nothing reads its output
        self.expert_layers = nn.ModuleList(
            GemmaBlock(e.width, e.mlp_dim, e.num_heads, e.num_kv_heads, e.head_dim, e.rms_eps, cond_dim=e.width)
            for _ in range(e.depth)
        )
        self.expert_norm = AdaRMSNorm(e.width, e.width, e.rms_eps)
        self.action_in_proj = nn.Linear(cfg.max_action_dim, e.width)
        self.action_out_proj = nn.Linear(e.width, cfg.max_action_dim)
        self.time_mlp_in = nn.Linear(e.width, e.width)
        self.time_mlp_out = nn.Linear(e.width, e.width)
        self.time_embed_fp64 = True
        self.compute_dtype = torch.float32
        # Fast path: mask keys only (B, 1, 1, T). Every valid token's output is unchanged (padding
        # keys are masked either way); only padding rows, which nothing reads, differ. It lets
        # attention kernels broadcast one small mask instead of reading a (T x T) one per layer.
        self.attend_keys_only = False

    # -- precision -------------------------------------------------------------------------
    def precision_dtypes(self, dtype: torch.dtype) -> dict[str, torch.dtype]:
        """The dtype `set_precision(dtype)` gives every parameter and buffer, by state-dict name:
        the big matmuls' weights (linears, the patch convolution, embeddings of the vision tower,
        projector, token embedding, prefix and expert layers) in `dtype`; norms (with the adaptive
        norms' modulation linears), the time MLP and the action projections in float32 (they are
        tiny, and the published bf16 model keeps them in float32 too); non-float tensors as they are.

        The one statement of that rule: set_precision casts by it and `save_native(dtype=...)`
        stores by it, so a bundle's reduced-precision weights are exactly what the engine would
        have cast the float32 checkpoint to."""
        low: set[int] = set()
        if dtype != torch.float32:
            norm_parts = {
                id(sub)
                for m in self.modules()
                if isinstance(m, (RMSNorm, AdaRMSNorm, LayerNorm))
                for sub in m.modules()
            }
            for module in (self.vision, self.projector, self.embed_tokens, self.prefix_layers, self.expert_layers):
                for sub in module.modules():
                    if isinstance(sub, (nn.Linear, nn.Conv2d, nn.Embedding)) and id(sub) not in norm_parts:
                        # the whole submodule, as `sub.to(dtype)` would cast it
                        low.update(id(m) for m in sub.modules())
        out: dict[str, torch.dtype] = {}
        for prefix, module in self.named_modules():
            for name, t in (*module._parameters.items(), *module._buffers.items()):
                if t is None:
                    continue
                key = f"{prefix}.{name}" if prefix else name
                out[key] = (dtype if id(module) in low else torch.float32) if t.is_floating_point() else t.dtype
        return out

    def set_precision(self, dtype: torch.dtype) -> PI05Model:
        """Cast to the dtypes `precision_dtypes(dtype)` gives. Tensors already in theirs are left
        alone, so weights loaded in the engine's precision (a bf16 bundle) are not copied, nor
        widened to float32 on the device first. Fp8 linears and fused projections are dropped
        first: the casts below re-create the tensors they would share (an fp8 copy would go stale;
        `layers.fp8` keeps the original Parameters, so nothing is lost)."""
        remove_fp8(self)
        unfuse_projections(self)
        want = self.precision_dtypes(dtype)
        for prefix, module in self.named_modules():
            for store in (module._parameters, module._buffers):
                for name, t in store.items():
                    if t is None:
                        continue
                    target = want[f"{prefix}.{name}" if prefix else name]
                    if t.dtype == target:
                        continue
                    # Through float32, as the cast always went (bf16 <-> fp16 never directly).
                    src = t.data if t.dtype in (torch.float32, target) else t.data.float()
                    if isinstance(t, nn.Parameter):
                        t.data = src.to(target)  # the same Parameter object, as Module.to keeps it
                    else:
                        store[name] = src.to(target)
        self.compute_dtype = dtype
        return self

    # -- stages ----------------------------------------------------------------------------
    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, V, 3, S, S) in [-1, 1] -> (B, V * tokens_per_image, prefix width)."""
        b, nv = images.shape[:2]
        return self.project_images(self.vision(images.flatten(0, 1)), b, nv)

    def project_images(self, feats: torch.Tensor, batch: int, views: int) -> torch.Tensor:
        """The vision tower's output (B * V, tokens_per_image, width) -> (B, V * tokens_per_image,
        prefix width) through the projector."""
        feats = self.projector(feats.to(self.projector.weight.dtype))
        return feats.reshape(batch, views * feats.shape[1], feats.shape[2]).to(self.compute_dtype)

    def embed_prefix(
        self, image_embeds: torch.Tensor, image_mask: torch.Tensor, tokens: torch.Tensor, token_mask: torch.Tensor,
        concat: Callable[..., torch.Tensor] = torch.cat,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> the prefix's embeddings (images, then prompt tokens) and its token mask. `concat`
        (`torch.cat`'s contract) lets a fast path join the embeddings its own way."""
        per_image = image_embeds.shape[1] // image_mask.shape[1]
        # sqrt(width) rounded to the embedding dtype, as the published model does; a Python float
        # (not a device tensor) so no host-to-device copy lands inside a captured CUDA graph.
        scale = float(torch.tensor(self.cfg.prefix.width**0.5, dtype=self.embed_tokens.weight.dtype))
        text = self.embed_tokens(tokens) * scale
        x = concat([image_embeds.to(self.compute_dtype), text.to(self.compute_dtype)], dim=1)
        mask = torch.cat([image_mask.repeat_interleave(per_image, dim=1), token_mask], dim=1)
        return x, mask

    def encode_prefix(
        self, image_embeds: torch.Tensor, image_mask: torch.Tensor, tokens: torch.Tensor, token_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> k_cache, v_cache (layers, B, kv_heads, P, head_dim) and prefix_mask (B, P) bool.

        Masked tokens (absent cameras, prompt padding) take no position: positions count valid
        tokens only, as in the published model.
        """
        p = self.cfg.prefix
        x, mask = self.embed_prefix(image_embeds, image_mask, tokens, token_mask)
        positions = torch.cumsum(mask.long(), dim=1) - 1
        cos, sin = rope_cos_sin(positions, p.head_dim, p.rope_theta, self.compute_dtype)
        if self.attend_keys_only:
            pair_mask = mask[:, None, None, :]
        else:
            pair_mask = mask[:, None, :, None] & mask[:, None, None, :]
        ks, vs = [], []
        last = len(self.prefix_layers) - 1
        for i, layer in enumerate(self.prefix_layers):
            q, k, v, gate = layer.project_kv(x, cos, sin)
            ks.append(k)
            vs.append(v)
            if i < last:  # the last layer's output feeds nothing the action expert reads
                x = layer.finish(x, q, k, v, pair_mask, gate)
        return torch.stack(ks), torch.stack(vs), mask

    def time_condition(self, t: torch.Tensor) -> torch.Tensor:
        """Flow time (B,) -> the adaptive-norm conditioning vector (B, expert width)."""
        e = self.cfg.expert
        emb = sinusoidal_time_embedding(
            t, e.width, self.cfg.time_min_period, self.cfg.time_max_period, self.time_embed_fp64
        )
        h = F.silu(self.time_mlp_in(emb.to(self.time_mlp_in.weight.dtype)))
        return F.silu(self.time_mlp_out(h))

    def time_modulation(self, t: torch.Tensor) -> tuple[list[tuple[Modulation, Modulation]], Modulation]:
        """Every adaptive norm's (scale, shift, gate) at flow time t (B,): per expert layer the
        (input, post-attention) pair, then the final norm's. They depend on t alone, so an
        engine can tabulate them once for the solver's time grid (`denoise_step(modulation=)`)
        instead of reading 37 conditioning matrices on every step."""
        cond = self.time_condition(t)
        per_layer = [
            (layer.input_layernorm.modulation(cond), layer.post_attention_layernorm.modulation(cond))
            for layer in self.expert_layers
        ]
        return per_layer, self.expert_norm.modulation(cond)

    def denoise_step(
        self,
        x_t: torch.Tensor,
        t: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        prefix_mask: torch.Tensor,
        modulation: tuple[list[tuple[Modulation, Modulation]], Modulation] | None = None,
    ) -> torch.Tensor:
        """x_t (B, H, D) at flow time t (B,) -> velocity (B, H, D) float32.

        `modulation`: `time_modulation(t)` computed ahead (a table entry), or None to compute it."""
        per_layer, final_mod = modulation[:2] if modulation is not None else self.time_modulation(t)
        x, cos, sin, mask = self.expert_inputs(x_t, prefix_mask)
        for i, layer in enumerate(self.expert_layers):
            q, k, v, gate = layer.project_kv(x, cos, sin, per_layer[i][0])
            k_all = torch.cat([k_cache[i], k], dim=2)
            v_all = torch.cat([v_cache[i], v], dim=2)
            x = layer.finish(x, q, k_all, v_all, mask, gate, per_layer[i][1])
        out, _ = self.expert_norm(x, final_mod)
        return self.expert_output(out)

    def expert_inputs(
        self, x_t: torch.Tensor, prefix_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The action expert's input: x_t (B, H, D) -> embedded actions (B, H, width), the chunk's
        rotary cos/sin (positions continue after the valid prefix) and its attention mask."""
        x = self.action_in_proj(x_t.to(self.action_in_proj.weight.dtype)).to(self.compute_dtype)
        return (x, *self.expert_context(prefix_mask, x_t.shape[1]))

    def expert_context(
        self, prefix_mask: torch.Tensor, chunk: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The part of `expert_inputs` that depends on the prefix alone (the same for every denoise
        step of a chunk): the chunk's rotary cos/sin and its attention mask."""
        e = self.cfg.expert
        b = prefix_mask.shape[0]
        offset = prefix_mask.long().sum(dim=1, keepdim=True)
        positions = offset + torch.arange(chunk, device=prefix_mask.device)[None, :]
        cos, sin = rope_cos_sin(positions, e.head_dim, e.rope_theta, self.compute_dtype)
        p_len = prefix_mask.shape[1]
        rows = 1 if self.attend_keys_only else chunk  # the chunk attends to the valid prefix and itself
        mask = torch.cat(
            [
                prefix_mask[:, None, None, :].expand(b, 1, rows, p_len),
                torch.ones(b, 1, rows, chunk, dtype=torch.bool, device=prefix_mask.device),
            ],
            dim=-1,
        )
        return cos, sin, mask

    def expert_output(self, normed: torch.Tensor) -> torch.Tensor:
        """The final norm's output (B, H, width) -> velocity (B, H, D) float32."""
        return self.action_out_proj(normed.to(self.action_out_proj.weight.dtype)).float()

    def triton_stages(self, backend: str = "auto", gemm: bool = False) -> dict[str, Callable[..., torch.Tensor]]:
        """Stage functions, same contracts as the model's own, with the elementwise chains and
        attention as fused Triton kernels (`layers.triton_ops`, `layers.triton_attention`, run by
        the stacks of `layers.fused_stacks`; `backend` as there):

        - `embed_images`: SigLIP's blocks on `fused_stacks.siglip_block_stack` (LayerNorms fused
          with the residual adds, GELU; SDPA without the all-true mask); the patch embedding as one
          GEMM (`fused_stacks.patch_embed`); position embedding and projector as in `embed_images`.
        - `encode_prefix`: the Gemma prefix on `fused_stacks.plain_block_stack` (key-only masks);
          `dense=True` from a caller that knows every image and prompt token is valid: no mask;
          `out=(keys, values)`: the KV cache buffers to write (an engine's, shared by two graphs);
          `kv_ready(i)` once block i's keys are written (`plain_block_stack`).
        - `denoise_step`: the action expert on `fused_stacks.adaptive_block_stack`; with `gemm`, its
          projections too, on the small-M GEMMs of `layers.triton_gemm` (RoPE and GeGLU in their
          epilogues). Only the denoise step: its M is batch x 50 rows (memory-bound GEMMs), while
          the prefix's ~batch x 816 rows are compute-bound: cuBLAS, or on Hopper for large batches
          the TMA GEMMs with RoPE / GeGLU in their epilogues (`layers.triton_gemm_tma.takes`).
          `joined=(keys, values)` from a caller whose prefix is all valid and whose KV cache has
          room for the chunk's own keys after the prefix (`k_cache` / `v_cache` being views of its
          first positions): attention over the whole buffer with no mask
          (`fused_stacks.adaptive_block_stack(joined=)`). `kv_wait(i)` before block i reads the
          prefix cache, for a step run beside the prefix (`adaptive_block_stack(kv_wait=)`).

        Engine options choose them (`CudaGraphEngine(triton_ops=True, triton_gemm=...)`); the
        model's own stage methods stay the reference."""
        from phyai_edge.layers import fused_stacks
        from phyai_edge.layers.attention import concat
        from phyai_edge.layers.triton_attention import stack_attention

        def embed_images(images):
            tower = self.vision
            x = fused_stacks.patch_embed(tower.embeddings, images.flatten(0, 1))
            feats = fused_stacks.siglip_block_stack(tower.encoder.layers, x, tower.post_layernorm, backend)
            return self.project_images(feats, images.shape[0], images.shape[1])

        def step_context(prefix_mask):
            # What every denoise step of a chunk shares: rotary tables, mask, the attention's form of
            # the mask. The engine computes it once a chunk (~20 small kernels a step otherwise).
            cos, sin, mask = self.expert_context(prefix_mask, self.cfg.chunk_size)
            return cos, sin, mask, stack_attention(mask, prefix_mask.shape[0], backend)

        def denoise_step(x_t, t, k_cache, v_cache, prefix_mask, modulation=None, context=None, joined=None,
                         kv_wait=None):
            # a table entry may carry the folded norms' parts (`fold_modulation` below) as more items
            per_layer, final_mod, *folded = modulation if modulation is not None else self.time_modulation(t)
            cos, sin, mask, attend = context if context is not None else step_context(prefix_mask)
            # the action projections around the expert, as `denoise_step` / `expert_output` run them
            return fused_stacks.projected_block_stack(
                self.action_in_proj, self.action_out_proj, x_t.to(self.action_in_proj.weight.dtype),
                self.compute_dtype, self.expert_layers, cos, sin, k_cache, v_cache, mask, per_layer, final_mod,
                self.expert_norm.eps, backend, gemm_backend=backend if gemm else None, attend=attend,
                joined=joined, folded=folded[0] if folded else None,
                folded_out=folded[1] if len(folded) > 1 else None, kv_wait=kv_wait,
            )

        def fold_modulation(modulation):
            # A modulation table entry, extended once per flow time with what the small-M GEMMs need
            # to finish the adaptive norms themselves (`fused_stacks.fold_modulation`).
            # and the final norm's shift through the output projection (`fused_stacks.projected_block_stack`)
            per_layer, final_mod = modulation[:2]
            folded = fused_stacks.fold_modulation(self.expert_layers, per_layer)
            if folded is None:
                return per_layer, final_mod
            return per_layer, final_mod, folded, fused_stacks.fold_shift(final_mod[1], self.action_out_proj.weight)

        def encode_prefix(image_embeds, image_mask, tokens, token_mask, dense=False, out=None, kv_ready=None):
            if not self.attend_keys_only:  # the fused stack takes key-only masks
                k, v, mask = self.encode_prefix(image_embeds, image_mask, tokens, token_mask)
                if out is not None:
                    ko, vo = fused_stacks.check_kv_out(out, k.shape, k.dtype)
                    k, v = ko.copy_(k), vo.copy_(v)
                for i in range(k.shape[0] if kv_ready is not None else 0):
                    kv_ready(i)  # every block's keys at once, at the end
                return k, v, mask
            p = self.cfg.prefix
            x, mask = self.embed_prefix(image_embeds, image_mask, tokens, token_mask, concat=concat)
            positions = torch.cumsum(mask.long(), dim=1) - 1
            cos, sin = rope_cos_sin(positions, p.head_dim, p.rope_theta, self.compute_dtype)
            k, v = fused_stacks.plain_block_stack(self.prefix_layers, x, cos, sin, mask[:, None, None, :], backend,
                                                  dense=dense, out=out, kv_ready=kv_ready)
            return k, v, mask

        stages = {"embed_images": embed_images, "denoise_step": denoise_step, "encode_prefix": encode_prefix,
                  "step_context": step_context}
        if gemm:  # only the small-M GEMMs fold norms
            stages["fold_modulation"] = fold_modulation
        return stages
