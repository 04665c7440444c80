"""Stacks of transformer blocks run on the fused kernels: PI0.5's action expert
(`adaptive_block_stack`), its Gemma prefix (`plain_block_stack`) and its SigLIP vision tower
(`siglip_block_stack`). Each is the same function as running the blocks' own forward one after
another; only how the work is launched changes.

The kernels live below this module: the elementwise chains in `layers.triton_ops`, the split-KV
attention in `layers.triton_attention`, the small-M GEMMs in `layers.triton_gemm`, the large-M
TMA GEMMs in `layers.triton_gemm_tma`; each has a reference path, chosen by the same `backend`
argument, so these stacks also run without triton.

`adaptive_block_stack` carries the normed input across block boundaries (the residual of block i is
fused with the input norm of block i + 1, the last one with the final norm). The blocks' own
linears (`qkv_proj`, `o_proj`, `gate_up`, `down_proj`: bf16, or fp8 after
`layers.fp8.convert_fp8`) and attention are called as they are; only the elementwise glue changes,
unless `gemm_backend` is given: then the plain bf16 / fp16 projections that `triton_gemm` takes run
on its small-M GEMMs, with RoPE and GeGLU in the GEMMs' epilogues (`qkv_rope` and `geglu` are then
not launched). `plain_block_stack` does the same for the prefix (Gemma's RMSNorm `normed * (1 + w)`
is the adaptive norm with scale w and no shift, its ungated residual the gated one with gate 1;
its projections go to the TMA GEMMs where `triton_gemm_tma.takes` them: large batches on Hopper),
and `siglip_block_stack` for the vision tower (each block's residual fused with the next block's
first LayerNorm, the last with the tower's post-layernorm; attention is SDPA, handed no mask:
SigLIP's is full).

Models choose these stacks around themselves (`PI05Model.triton_stages`, an engine option:
`CudaGraphEngine(triton_ops=..., triton_gemm=...)`); the model's own code path is unchanged.
Tested against the per-block path in `tests/test_triton_ops.py` and `tests/test_triton_gemm.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from phyai_edge.layers import triton_expert_layer, triton_fold, triton_gemm, triton_gemm_tma
from phyai_edge.layers.attention import attention_unmasked
from phyai_edge.layers.norm import Modulation
from phyai_edge.layers.triton_attention import kernel_key_mask, stack_attention
from phyai_edge.layers.triton_dispatch import Tickets, _use_triton, needs_grad, resolve_backend
from phyai_edge.layers.triton_ops import (
    FoldedNorm,
    SplitSums,
    ada_rms_fold,
    ada_rms_norm,
    bias_gelu,
    check_out_buffer,
    geglu,
    layer_norm,
    qkv_rope,
    residual_ada_rms_norm,
    residual_layer_norm,
)


# -- a stack of adaptive Gemma blocks on the fused ops --------------------------------------------
def _qkv_projection(attn: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The packed (B, T, (H + 2 Hkv) D) projection: the fused GEMM, or its parts concatenated."""
    if attn.qkv_proj is not None:
        return attn.qkv_proj(h)
    return torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)


def _qkv(attn: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str,
         gemm_backend: str | None, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
         tickets: Tickets | None = None) -> tuple[torch.Tensor, ...]:
    """q, k, v with RoPE: the fused QKV GEMM with RoPE in its epilogue where
    `triton_gemm.module_takes` the projection, else the projection then `qkv_rope`. `out`: (q, k, v)
    buffers to write (as `qkv_rope`'s; the small-M GEMM's results are copied there). `tickets`: the
    stack's counters for a split-K tiling's in-kernel sums."""
    if gemm_backend is not None and attn.qkv_proj is not None and triton_gemm.module_takes(attn.qkv_proj, h):
        qkv = triton_gemm.linear_qkv_rope(h, attn.qkv_proj.weight, cos, sin, attn.num_heads, attn.num_kv_heads,
                                          attn.head_dim, gemm_backend, bias=attn.qkv_proj.bias, tickets=tickets)
        return qkv if out is None else tuple(o.copy_(r) for o, r in zip(out, qkv))
    return qkv_rope(_qkv_projection(attn, h), cos, sin, attn.num_heads, attn.num_kv_heads, attn.head_dim, backend,
                    out=out)


def _query_buffer(attn: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """An empty (B, H, T, D) query for attention over one key buffer with no mask. With one KV head
    it is a (B, T, H, D) buffer seen transposed: `layers.attention.attention` then folds its rows in
    that order for free and hands back the output as the o-projection reads it (no copy either
    side); a row's result does not depend on where the row sits when nothing is masked."""
    b, t, _ = h.shape
    if attn.num_kv_heads == 1:
        return h.new_empty(b, t, attn.num_heads, attn.head_dim).transpose(1, 2)
    return h.new_empty(b, attn.num_heads, t, attn.head_dim)


def _attend(attn: torch.nn.Module, q: torch.Tensor, k: Any, v: Any, mask: torch.Tensor,
            attend: Callable[..., torch.Tensor], gemm_backend: str | None,
            backend: str = "reference") -> torch.Tensor | SplitSums:
    """`attn.attend(q, k, v, mask, attention_fn=attend)` with its o-projection through `_project`
    (the small-M Triton GEMM, or the TMA GEMM for large batches, where those take it)."""
    out = _attention_rows(attn, q, k, v, mask, attend)
    return _project(attn.o_proj, out.to(attn.o_proj.weight.dtype), gemm_backend, defer_sum=gemm_backend is not None,
                    backend=backend)


def _attention_rows(attn: torch.nn.Module, q: torch.Tensor, k: Any, v: Any, mask: torch.Tensor,
                    attend: Callable[..., torch.Tensor]) -> torch.Tensor:
    """`attend(q, k, v, mask)` as the o-projection reads it: (B, T, H D)."""
    out = attend(q, k, v, mask)
    b, _, t, _ = out.shape
    # The split kernel's output is a transposed view of a (B, T, H, D) buffer: this reshape is free.
    return out.transpose(1, 2).reshape(b, t, attn.num_heads * attn.head_dim)


def _mlp(mlp: torch.nn.Module, h: torch.Tensor, backend: str, gemm_backend: str | None = None,
         tickets: Tickets | None = None) -> torch.Tensor | SplitSums:
    if mlp.gate_up is None:
        return mlp(h)
    if gemm_backend is None:
        return mlp.down_proj(geglu(mlp.gate_up(h), backend))
    if triton_gemm.module_takes(mlp.gate_up, h):
        a = triton_gemm.linear_geglu(h, mlp.gate_up.weight, gemm_backend, bias=mlp.gate_up.bias, tickets=tickets)
    else:
        a = geglu(mlp.gate_up(h), backend)
    return _project(mlp.down_proj, a, gemm_backend, defer_sum=True)


def _prefix_mlp(mlp: torch.nn.Module, h: torch.Tensor, backend: str) -> torch.Tensor:
    """The prefix's MLP: gate/up with GeGLU in one TMA GEMM where `triton_gemm_tma.takes` it (large
    batches on Hopper), else `_mlp`."""
    if resolve_backend(backend, h.device) == "triton" and triton_gemm_tma.takes("geglu", mlp.gate_up, h):
        return mlp.down_proj(triton_gemm_tma.linear_geglu(h, mlp.gate_up.weight, "triton"))
    return _mlp(mlp, h, backend)


def _project(linear: torch.nn.Module, h: torch.Tensor, gemm_backend: str | None,
             defer_sum: bool = False, backend: str = "reference") -> torch.Tensor | SplitSums:
    """`linear(h)`: on the small-M Triton GEMM where `gemm_backend` is given and
    `triton_gemm.module_takes` it, on the TMA GEMM where `triton_gemm_tma.takes` it (large batches
    on Hopper), else the module. `defer_sum`: the caller hands the result to
    `residual_ada_rms_norm`, which adds a split-K GEMM's partial sums itself (one reducing kernel
    fewer)."""
    if gemm_backend is not None and triton_gemm.module_takes(linear, h):
        return triton_gemm.linear(h, linear.weight, gemm_backend, bias=linear.bias, defer_sum=defer_sum)
    if resolve_backend(backend, h.device) == "triton" and triton_gemm_tma.takes("linear", linear, h):
        return triton_gemm_tma.linear(h, linear.weight, "triton")
    return linear(h)


# Batch 1's norms folded into the GEMMs around them (`adaptive_block_stack(folded=)`); a switch for
# the benchmarks that time both.
_FOLD_NORMS = True


def set_fold_norms(on: bool) -> bool:
    """Whether `adaptive_block_stack` folds the adaptive norms into its small-M GEMMs where it is
    handed `folded` tables (True, the default) or runs the norm kernels; returns the previous
    setting."""
    global _FOLD_NORMS
    before, _FOLD_NORMS = _FOLD_NORMS, bool(on)
    return before


_FOLD_PROJECTIONS = True


def set_fold_projections(on: bool) -> bool:
    """Whether `projected_block_stack` folds its input and output projections into the folded
    stack's first and last kernels (True, the default) or runs them as the model does; returns the
    previous setting."""
    global _FOLD_PROJECTIONS
    before, _FOLD_PROJECTIONS = _FOLD_PROJECTIONS, bool(on)
    return before


def fold_modulation(blocks: Sequence[torch.nn.Module],
                    modulations: Sequence[tuple[Modulation, Modulation]]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The tabulated half of the folded norms (`triton_ops.FoldedNorm`) for one flow time: per block,
    (input norm's shift @ W_qkv^T, post-attention norm's shift @ W_gate_up^T) in float32, (B or 1,
    N) each, for `adaptive_block_stack(folded=)`. Computed once per solver time with the modulation
    tables; None where a block's QKV or gate/up projection is not fused (nothing to fold into)."""
    out = []
    for block, ((_, shift_in, _), (_, shift_post, _)) in zip(blocks, modulations):
        qkv, gate_up = block.self_attn.qkv_proj, block.mlp.gate_up
        if qkv is None or gate_up is None:
            return None
        out.append((fold_shift(shift_in, qkv.weight), fold_shift(shift_post, gate_up.weight)))
    return out


def fold_shift(shift: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """shift (B or 1, 1, N) @ weight (M, N)^T in float32, (B or 1, M): the half of a folded norm
    that its consumer adds (`triton_ops.FoldedNorm`), tabulated once per flow time."""
    return F.linear(shift.float().reshape(shift.shape[0], -1), weight.float())


def _plain_small_linear(linear: torch.nn.Module | None, rows: int, dtype: torch.dtype) -> bool:
    return (type(linear) is torch.nn.Linear and linear.bias is None and linear.weight.dtype == dtype
            and triton_gemm.takes(rows, linear.weight))


def _folds(blocks: Sequence[torch.nn.Module], x: torch.Tensor, gemm_backend: str | None,
           folded: Sequence[Any] | None, joined: Any, dtype: torch.dtype | None = None) -> bool:
    """Whether the stack runs with its norms folded into the small-M GEMMs: tables given, the
    switch on, the kernels' backend, no gradient, no joined KV buffers, and every block's four
    projections plain bias-free linears that `triton_gemm.takes` (fused QKV and gate/up). `dtype`:
    the stream's, where x is not the stream (an input projection's input)."""
    if (folded is None or not _FOLD_NORMS or joined is not None or gemm_backend is None or needs_grad(x)
            or not _use_triton(gemm_backend, x) or len(folded) != len(blocks)):
        return False
    rows = x.numel() // x.shape[-1]
    return all(_plain_small_linear(lin, rows, dtype or x.dtype)
               for b in blocks for lin in (b.self_attn.qkv_proj, b.self_attn.o_proj, b.mlp.gate_up, b.mlp.down_proj))


def _io_kernel_linear(linear: torch.nn.Module, x: torch.Tensor | None, features: int) -> bool:
    """A projection the folded stack's first / last kernel can take: a plain `nn.Linear` (bias or
    not) with a float weight the kernels read and `features` inputs (and, for the input side, x of
    its dtype)."""
    return (type(linear) is torch.nn.Linear and linear.weight.dtype in triton_gemm.KERNEL_DTYPES
            and linear.in_features == features and (x is None or x.dtype == linear.weight.dtype))


def projected_block_stack(in_proj: torch.nn.Module, out_proj: torch.nn.Module, x_in: torch.Tensor,
                          dtype: torch.dtype, blocks: Sequence[torch.nn.Module], cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                          modulations: Sequence[tuple[Modulation, Modulation]], final: Modulation, final_eps: float,
                          backend: str = "reference", gemm_backend: str | None = None,
                          attend: Callable[..., torch.Tensor] | None = None,
                          joined: tuple[torch.Tensor, torch.Tensor] | None = None,
                          folded: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
                          folded_out: torch.Tensor | None = None,
                          kv_wait: Callable[[int], None] | None = None) -> torch.Tensor:
    """`out_proj(adaptive_block_stack(in_proj(x_in) in dtype, ...) in out_proj's dtype)` in float32:
    an action expert with its input and output projections (PI0.5's float32 action projections
    around the bf16 blocks). Where the stack folds its norms (`_folds`) and `folded_out` = the final
    norm's shift @ out_proj.weight^T is given (`fold_shift`), the input projection also starts the
    first norm's fold (`triton_fold.linear_fold_start`: projection, cast and norm in one kernel),
    the last down projection leaves the final norm folded, and the output projection finishes it
    (`triton_fold.linear_folded`): four kernels fewer a step. Otherwise the plain composition.
    `kv_wait` as in `adaptive_block_stack`."""
    # (`_folds` also bounds the rows: every block's projections must be ones `triton_gemm.takes`)
    if (_FOLD_PROJECTIONS and folded_out is not None and attend is not None
            and _folds(blocks, x_in, gemm_backend, folded, joined, dtype)
            and _io_kernel_linear(in_proj, x_in, x_in.shape[-1]) and _io_kernel_linear(out_proj, None, final[0].shape[-1])):
        return _folded_block_stack(blocks, x_in, cos, sin, k_cache, v_cache, mask, modulations, final, final_eps,
                                   backend, gemm_backend, attend, folded, io=(in_proj, out_proj, folded_out, dtype),
                                   kv_wait=kv_wait)
    x = in_proj(x_in).to(dtype)
    h = adaptive_block_stack(blocks, x, cos, sin, k_cache, v_cache, mask, modulations, final, final_eps, backend,
                             gemm_backend, attend, joined, folded, kv_wait=kv_wait)
    return out_proj(h.to(out_proj.weight.dtype)).float()


def _folded_block_stack(blocks: Sequence[torch.nn.Module], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                        modulations: Sequence[tuple[Modulation, Modulation]], final: Modulation, final_eps: float,
                        backend: str, gemm_backend: str, attend: Callable[..., torch.Tensor],
                        folded: Sequence[tuple[torch.Tensor, torch.Tensor]],
                        io: tuple[torch.nn.Module, torch.nn.Module, torch.Tensor, torch.dtype] | None = None,
                        kv_wait: Callable[[int], None] | None = None) -> torch.Tensor:
    """`adaptive_block_stack` with each adaptive norm but the final one folded into the GEMMs around
    it: o_proj and down finish the gated residual and start the next norm in their epilogue (one
    kernel: `triton_fold.linear_residual_fold`), QKV and gate/up finish it on their sums
    (`norm=`). Five kernels a block instead of seven. `io` = (input projection, output projection,
    final shift @ its weight^T, stream dtype): x is the input projection's input, the first and the
    final norm fold too, and the output projection's float32 result is returned
    (`projected_block_stack`)."""
    tickets = getattr(attend, "tickets", None)
    first_scale, first_eps = modulations[0][0][0], blocks[0].input_layernorm.eps
    if io is None:
        norm: FoldedNorm = ada_rms_fold(x, first_scale, first_eps, backend)
    else:
        in_proj = io[0]
        x, norm = triton_fold.linear_fold_start(x, in_proj.weight, in_proj.bias, first_scale, first_eps, io[3],
                                                gemm_backend)
    h = x
    for i, block in enumerate(blocks):
        attn, mlp = block.self_attn, block.mlp
        (_, _, gate_in), (scale2, _, gate_post) = modulations[i]
        bias_qkv, bias_gate_up = folded[i]
        q, k, v = triton_gemm.linear_qkv_rope(norm.u, attn.qkv_proj.weight, cos, sin, attn.num_heads,
                                              attn.num_kv_heads, attn.head_dim, gemm_backend, norm=norm,
                                              norm_bias=bias_qkv, tickets=tickets)
        if kv_wait is not None:
            kv_wait(i)
        out = _attention_rows(attn, q, (k_cache[i], k), (v_cache[i], v), mask, attend)
        x, norm = triton_fold.linear_residual_fold(out, attn.o_proj.weight, x, gate_in, scale2,
                                                   block.post_attention_layernorm.eps, gemm_backend, tickets=tickets)
        a = triton_gemm.linear_geglu(norm.u, mlp.gate_up.weight, gemm_backend, norm=norm, norm_bias=bias_gate_up,
                                     tickets=tickets)
        if i + 1 < len(blocks) or io is not None:
            scale_next, eps_next = ((modulations[i + 1][0][0], blocks[i + 1].input_layernorm.eps) if i + 1 < len(blocks)
                                    else (final[0], final_eps))
            x, norm = triton_fold.linear_residual_fold(a, mlp.down_proj.weight, x, gate_post, scale_next, eps_next,
                                                       gemm_backend, tickets=tickets)
        else:  # the final norm feeds a layer outside the stack: its own kernel
            y = triton_gemm.linear(a, mlp.down_proj.weight, gemm_backend, defer_sum=True)
            x, h = residual_ada_rms_norm(x, y, gate_post, final[0], final[1], final_eps, backend)
    if io is not None:
        out_proj, folded_out = io[1], io[2]
        return triton_fold.linear_folded(norm, out_proj.weight, folded_out, gemm_backend, bias=out_proj.bias,
                                         out_dtype=torch.float32)
    return h


def adaptive_block_stack(
    blocks: Sequence[torch.nn.Module],
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mask: torch.Tensor,
    modulations: Sequence[tuple[Modulation, Modulation]],
    final: Modulation,
    final_eps: float,
    backend: str = "reference",
    gemm_backend: str | None = None,
    attend: Callable[..., torch.Tensor] | None = None,
    joined: tuple[torch.Tensor, torch.Tensor] | None = None,
    folded: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    kv_wait: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Adaptive `GemmaBlock`s over x (B, T, W), each attending to its cached prefix keys/values
    (`k_cache[i]`, `v_cache[i]`) and to itself, then the final adaptive norm (modulation `final`,
    `final_eps`): returns that norm's output, in x.dtype.

    The same function as running `block.project_kv` / `block.finish` per block and then the final
    `AdaRMSNorm`, with the elementwise chains fused: each gated residual is computed together
    with the norm that follows it (the block's post-attention norm, the next block's input norm,
    or the final norm). `modulations[i]` is block i's (input, post-attention) (scale, shift, gate).

    `gemm_backend` (None: every linear is its module's own forward, cuBLAS on a GPU): the
    projections on the small-M GEMMs of `layers.triton_gemm` with that backend, each where
    `triton_gemm.module_takes` it (a plain bf16 / fp16 `nn.Linear`, few enough rows; an fp8
    linear or an unfused projection keeps its module): QKV with RoPE in its epilogue, gate/up
    with GeGLU in its epilogue, o_proj and down as plain GEMMs.

    `attend`: `stack_attention(mask, B, backend)` made ahead (a caller running several stacks on
    one mask, the denoise steps of a chunk, makes it once).

    `joined`: (keys, values) buffers (blocks, B, Hkv, P + T, D) whose first P positions hold the
    prefix cache (`k_cache` / `v_cache` are those positions), from a caller that knows every
    prefix key is valid (`mask` is then not read): each block writes its own k / v into the
    last T positions (in the RoPE kernel, no copy) and attends to the whole buffer with no mask
    (`attention_unmasked`: cuDNN's kernel on Hopper, faster than the split kernel from batch ~8).
    The buffers are written in place, so not for a step that needs a gradient.

    `folded`: `fold_modulation(blocks, modulations)` made ahead (a table entry). Where the small-M
    GEMMs take every projection (batch 1's 50 rows, no gradient, `set_fold_norms` on), each norm
    but the final one is then folded into the GEMMs around it (`triton_ops.FoldedNorm`): o_proj and
    down write the residual and the next norm's input, QKV and gate/up finish the norm on their
    sums, and no norm kernel runs between them. Equal up to rounding.

    `kv_wait(i)`, called before block i first reads `k_cache[i]` / `v_cache[i]` (or `joined`'s prefix
    positions): a caller running the stack beside the prefix that writes the cache, on another CUDA
    stream, waits there for block i's keys (`plain_block_stack(kv_ready=)`); only stream operations
    belong in it.

    With `triton_expert_layer.set_enabled(True)` (off by default: measured slower on the H200),
    where `gemm_backend` runs the kernels and `triton_expert_layer.takes` the stack (batch 1: at
    most 64 rows), each block is one persistent kernel instead (not with `kv_wait`).
    """
    if joined is not None:
        _check_joined(joined, k_cache, x)
    if (joined is None and kv_wait is None and gemm_backend is not None and triton_expert_layer.enabled()
            and _use_triton(gemm_backend, x)
            and triton_expert_layer.takes(blocks, x, mask)):
        key_mask = getattr(attend, "key_mask", None)
        if key_mask is None:
            key_mask = kernel_key_mask(mask, x.shape[0])
        return triton_expert_layer.persistent_block_stack(blocks, x, cos, sin, k_cache, v_cache, key_mask,
                                                          modulations, final, final_eps)
    if attend is None and joined is None:
        attend = stack_attention(mask, x.shape[0], backend)
    if _folds(blocks, x, gemm_backend, folded, joined):
        return _folded_block_stack(blocks, x, cos, sin, k_cache, v_cache, mask, modulations, final, final_eps,
                                   backend, gemm_backend, attend, folded, kv_wait=kv_wait)
    p = k_cache.shape[3]
    tickets = getattr(attend, "tickets", None)
    scale, shift, _ = modulations[0][0]
    h = ada_rms_norm(x, scale, shift, blocks[0].input_layernorm.eps, backend)
    for i, block in enumerate(blocks):
        attn = block.self_attn
        (_, _, gate_in), (scale2, shift2, gate_post) = modulations[i]
        if joined is None:
            q, k, v = _qkv(attn, h, cos, sin, backend, gemm_backend, tickets=tickets)
            if kv_wait is not None:
                kv_wait(i)
            # The cached prefix and the step's own keys as two parts: no per-layer concatenation.
            y = _attend(attn, q, (k_cache[i], k), (v_cache[i], v), mask, attend, gemm_backend)
        else:
            keys, values = joined[0][i], joined[1][i]
            q, _, _ = _qkv(attn, h, cos, sin, backend, gemm_backend,
                           out=(_query_buffer(attn, h), keys[:, :, p:], values[:, :, p:]), tickets=tickets)
            if kv_wait is not None:  # the step's own keys went to the room, which the prefix never writes
                kv_wait(i)
            y = _attend(attn, q, keys, values, None, attention_unmasked, gemm_backend)
        x, h = residual_ada_rms_norm(x, y, gate_in, scale2, shift2, block.post_attention_layernorm.eps, backend)
        y = _mlp(block.mlp, h.to(block.mlp.up_proj.weight.dtype), backend, gemm_backend, tickets)
        if i + 1 < len(blocks):
            next_scale, next_shift, _ = modulations[i + 1][0]
            eps = blocks[i + 1].input_layernorm.eps
        else:
            next_scale, next_shift, _ = final
            eps = final_eps
        x, h = residual_ada_rms_norm(x, y, gate_post, next_scale, next_shift, eps, backend)
    return h


def _check_joined(joined: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor, x: torch.Tensor) -> None:
    """A ValueError unless `joined` are (blocks, B, Hkv, P + T, D) buffers extending `k_cache`
    (blocks, B, Hkv, P, D) by x's T positions, and no gradient is being taken."""
    want = (*k_cache.shape[:3], k_cache.shape[3] + x.shape[1], k_cache.shape[4])
    for name, buf in zip(("keys", "values"), joined):
        if tuple(buf.shape) != want or buf.dtype != k_cache.dtype:
            raise ValueError(f"joined {name}: a {want} {k_cache.dtype} buffer (the prefix cache with room for the "
                             f"step's {x.shape[1]} tokens) expected, got {tuple(buf.shape)} {buf.dtype}")
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError("joined KV buffers are written in place: not for a step that needs a gradient")


def plain_block_stack(
    blocks: Sequence[torch.nn.Module],
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor,
    backend: str = "reference",
    dense: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_ready: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain (non-adaptive) `GemmaBlock`s over x (B, T, W), attending among themselves under a
    key-only mask (B, 1, 1, T): returns every block's rotated keys and values, stacked
    (blocks, B, Hkv, T, D). The last block's attention and MLP are skipped (only its K/V is read).
    `dense`: the caller knows the mask is all true; attention then takes no mask
    (`layers.attention.attention_unmasked`). `out`: contiguous (blocks, B, Hkv, T, D) key and
    value buffers of x's dtype to write into (an engine's KV cache shared by two captured prefix
    graphs; any strides with a unit last one: the cache may have room after the prefix for the
    action expert's own keys, see `adaptive_block_stack(joined=)`) and return; None allocates them.
    `kv_ready(i)` is called as soon as block i's keys and values are written (before its attention
    and MLP): where a reader of the cache runs on another CUDA stream, it records an event there.

    The same function as `project_kv` / `finish` per block (the PI0.5 prefix), on the kernels
    above: Gemma's RMSNorm `normed * (1 + w)` is the adaptive norm with scale w and no shift,
    and its ungated residual the gated one with gate 1 (both exact)."""
    attend = attention_unmasked if dense else stack_attention(mask, x.shape[0], backend)
    width = x.shape[-1]
    zero = torch.zeros(1, 1, width, dtype=torch.float32, device=x.device)
    one = torch.ones(1, 1, width, dtype=x.dtype, device=x.device)

    def weight(norm: torch.nn.Module) -> torch.Tensor:
        return norm.weight.view(1, 1, width)

    first = blocks[0].input_layernorm
    h = ada_rms_norm(x, weight(first), zero, first.eps, backend)
    attn0 = blocks[0].self_attn
    # Every block's K/V written into one stacked buffer as it is made (the TMA QKV kernel writes
    # there directly): no stacking copy at the end.
    kv_shape = (len(blocks), x.shape[0], attn0.num_kv_heads, x.shape[1], attn0.head_dim)
    if out is None:
        ks = torch.empty(kv_shape, dtype=x.dtype, device=x.device)
        vs = torch.empty_like(ks)
    else:
        ks, vs = check_kv_out(out, kv_shape, x.dtype)
    last = len(blocks) - 1
    for i, block in enumerate(blocks):
        attn = block.self_attn
        # Without a mask SDPA folds a (B, T, H, D) query token-major and hands its output back in the
        # o-projection's layout; the split kernel folds a (B, H, T, D) one head-major. Either way no copy.
        q_out = _query_buffer(attn, h) if dense else h.new_empty(h.shape[0], attn.num_heads, h.shape[1], attn.head_dim)
        q, k, v = _prefix_qkv(attn, h, cos, sin, backend, ks[i], vs[i], q_out)
        if kv_ready is not None:
            kv_ready(i)
        if i == last:
            break
        y = _attend(attn, q, k, v, mask, attend, None, backend)
        post = block.post_attention_layernorm
        x, h = residual_ada_rms_norm(x, y, one, weight(post), zero, post.eps, backend)
        y = _prefix_mlp(block.mlp, h.to(block.mlp.up_proj.weight.dtype), backend)
        nxt = blocks[i + 1].input_layernorm
        x, h = residual_ada_rms_norm(x, y, one, weight(nxt), zero, nxt.eps, backend)
    return ks, vs


def check_kv_out(out: tuple[torch.Tensor, torch.Tensor], shape: tuple[int, ...],
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`out` (keys, values) if both are `shape` tensors of `dtype` with a unit last stride and the
    same strides; else a ValueError naming the one that is not."""
    for name, buf in zip(("keys", "values"), out):
        check_out_buffer(f"prefix KV out {name}", buf, shape, dtype)
    if out[0].stride() != out[1].stride():
        raise ValueError(f"prefix KV out: keys and values with the same strides expected, got {out[0].stride()} "
                         f"and {out[1].stride()}")
    return out[0], out[1]


def _prefix_qkv(attn: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str,
                k_out: torch.Tensor, v_out: torch.Tensor,
                q_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prefix's q, k, v with RoPE, written into `q_out`, `k_out`, `v_out`: one TMA GEMM with
    RoPE in its epilogue where `triton_gemm_tma.takes` the projection (large batches on Hopper),
    else the projection and `qkv_rope` (its kernel writes the three buffers)."""
    if (resolve_backend(backend, h.device) == "triton" and attn.qkv_proj is not None
            and triton_gemm_tma.takes("qkv_rope", attn.qkv_proj, h)):
        return triton_gemm_tma.linear_qkv_rope(h, attn.qkv_proj.weight, cos, sin, attn.num_heads,
                                               attn.num_kv_heads, attn.head_dim, "triton", k_out=k_out, v_out=v_out,
                                               q_out=q_out)
    return qkv_rope(_qkv_projection(attn, h), cos, sin, attn.num_heads, attn.num_kv_heads, attn.head_dim, backend,
                    out=(q_out, k_out, v_out))


# -- the SigLIP encoder on the fused ops ------------------------------------------------------------
def _siglip_attention(attn: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """`SiglipAttention` without its mask. The mask is all true (every patch sees every patch), so
    SDPA is given none: the same function, minus the 4 kernels a layer that build the mask and
    check it for empty rows, and minus the mask's reads inside the attention kernel."""
    b, t, w = h.shape
    nh = attn.num_heads
    if attn.qkv_proj is not None:
        q, k, v = attn.qkv_proj(h).reshape(b, t, 3, nh, w // nh).permute(2, 0, 3, 1, 4).unbind(0)
    else:
        q, k, v = (p(h).reshape(b, t, nh, w // nh).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    out = F.scaled_dot_product_attention(q, k, v)
    return attn.out_proj(out.transpose(1, 2).reshape(b, t, w))


def _fc1_gelu(fc1: torch.nn.Module, h: torch.Tensor, backend: str) -> torch.Tensor:
    """gelu_tanh(fc1(h)). With the kernels on, on CUDA, for a plain bf16 / fp16 `nn.Linear` with a
    bias: one cuBLASLt GEMM whose epilogue adds the bias and applies GELU (`torch._addmm_activation`,
    tanh form on CUDA). Measured on an H200 (`benchmarks/gemm_gpu.py --part vision`): SigLIP's fc1
    at 24576 rows 463 -> 402 us, at 768 rows 18.6 -> 15.6 us, against the GEMM plus `bias_gelu`.
    Elsewhere the GEMM, then `bias_gelu` (on a CPU `_addmm_activation` applies the exact, erf GELU,
    not SigLIP's tanh form)."""
    lt = (type(fc1) is torch.nn.Linear and fc1.bias is not None and h.is_cuda
          and h.dtype in (torch.bfloat16, torch.float16) and fc1.weight.dtype == h.dtype
          and not (torch.is_grad_enabled() and h.requires_grad) and resolve_backend(backend, h.device) == "triton")
    if not lt:
        return bias_gelu(fc1(h), None, backend)
    out = torch._addmm_activation(fc1.bias, h.reshape(-1, h.shape[-1]), fc1.weight.t(), use_gelu=True)
    return out.view(*h.shape[:-1], fc1.out_features)


def patch_embed(embeddings: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """`SiglipEmbeddings(pixels)` with the patch convolution as one GEMM: a non-overlapping
    convolution is a matrix product of the flattened patches (C x p x p each, in the weight's
    (C, p, p) order) with the flattened kernel. cuDNN's convolution also converts the layout to
    NHWC and back around it, and the encoder then copies its transposed output to rows: on the H200
    ~1.5 ms of a batch-32 vision stage (96 images), for ~40 us of arithmetic. Here: one copy
    gathers the patches as rows, one GEMM adds the bias, one add the position embedding; the
    output is contiguous rows. A convolution with padding, dilation, groups or a stride other
    than its kernel size takes the module's own forward."""
    conv = embeddings.patch_embedding
    p = conv.kernel_size[0]
    n, c, hgt, wid = pixels.shape
    plain = (conv.kernel_size == (p, p) and conv.stride == (p, p) and conv.padding == (0, 0)
             and conv.dilation == (1, 1) and conv.groups == 1 and hgt % p == 0 and wid % p == 0)
    if not plain:
        return embeddings(pixels)
    gh, gw = hgt // p, wid // p
    x = pixels.to(conv.weight.dtype).reshape(n, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5)
    out = F.linear(x.reshape(n * gh * gw, c * p * p), conv.weight.reshape(conv.out_channels, -1), conv.bias)
    return out.view(n, gh * gw, conv.out_channels) + embeddings.position_embedding.weight[None]


def siglip_block_stack(
    blocks: Sequence[torch.nn.Module], x: torch.Tensor, final_norm: torch.nn.Module, backend: str = "reference"
) -> torch.Tensor:
    """`SiglipBlock`s over x (N, T, W) (the embeddings' output), then `final_norm` (the tower's
    post-layernorm): the same function as `SiglipEncoder` followed by that norm, returned in
    x.dtype.

    Each residual add is computed together with the LayerNorm after it (the block's second norm,
    the next block's first, or the final one); the first norm runs alone; fc1 and its GELU are one
    cuBLASLt GEMM on CUDA (`_fc1_gelu`), else the GEMM (which adds the bias) and `bias_gelu`. The blocks' linears (fused QKV or its parts, fp8
    after `layers.fp8.convert_fp8`) are called as they are, and attention is SDPA's."""
    norms = [block.layer_norm1 for block in blocks] + [final_norm]
    # The embeddings' sum keeps the patch convolution's transposed layout; both the first norm and
    # the first residual read it as rows, so copy once here rather than once in each.
    x = x.contiguous()
    h = layer_norm(x, norms[0].weight, norms[0].bias, norms[0].eps, backend)
    for i, block in enumerate(blocks):
        post = block.layer_norm2
        x, h = residual_layer_norm(x, _siglip_attention(block.self_attn, h), post.weight, post.bias, post.eps,
                                   backend)
        y = block.mlp.fc2(_fc1_gelu(block.mlp.fc1, h, backend))
        nxt = norms[i + 1]
        x, h = residual_layer_norm(x, y, nxt.weight, nxt.bias, nxt.eps, backend)
    return h
