"""Large-M GEMMs on Hopper's tensor-memory accelerator (TMA) for the prefix at large batches: the
fused gate/up projection with GeGLU in the epilogue, the fused QKV projection with RoPE in the
epilogue, and a plain GEMM (the o-projection).

Why: at batch 32 the PI0.5 prefix runs its gate/up GEMM (26112 x 2048 @ 2048 x 32768) on cuBLAS at
~700 TFLOP/s, then a GeGLU pass that reads the (M, 2 H) product and writes (M, H): 2.6 GB a layer,
0.62 ms at the memory bandwidth, 10.5 ms of a ~240 ms chunk (`benchmarks/RESULTS.md`). The
pointer-based Triton GEMM with the epilogue inside (`triton_gemm.linear_geglu`) reached ~560
TFLOP/s there, 11% slower than cuBLAS plus the pass. Here the operand tiles arrive by TMA
(`TensorDescriptor` loads: one descriptor per operand, the copy engine fills shared memory
asynchronously, no address arithmetic in the loop), the form in which Triton's Hopper GEMMs
approach cuBLAS.

- `linear_geglu(h, weight)`: h (..., K) @ weight (2 H, K).T, gate rows first; each program
  accumulates a (BLOCK_M, BLOCK_N) tile of the gate and the matching tile of the up projection
  (weight rows n and H + n), and stores gelu_tanh(gate) * up: (..., H). Same contract as
  `triton_gemm.linear_geglu_ref`.
- `linear(h, weight)`: the plain GEMM on the same loop; from 16384 rows persistent 128 x 256 tiles
  with the tile and k loops flattened into one pipelined loop (the prefix's o_proj at batch 32).
- `linear_qkv_rope(h, weight, cos, sin, ...)`: the fused QKV projection with RoPE in the epilogue,
  one head (head_dim columns) a tile so each rotary pair is in one accumulator; q, k, v written as
  (B, heads, T, D), k and v optionally into given buffers (a stacked KV cache). Same contract as
  `triton_gemm.linear_qkv_rope_ref`.

Programs are persistent (`programs` of them walk the tiles in grouped order) or one per tile
(`programs=None`). Inputs: bf16 / fp16, contiguous rows, K a multiple of 8 (TMA needs 16-byte
aligned row strides), no bias (PI0.5's Gemma linears have none). Everything else raises.

Dispatch (`backend`) as in `layers.triton_ops`. Under the CPU interpreter (`TRITON_INTERPRET=1`)
tiles are upcast to float32 before `tl.dot` (the interpreter's bf16 `tl.dot` is wrong, see
`triton_gemm`).

Used by: the prefix stack (`fused_stacks.plain_block_stack`) sends its MLPs' gate/up here from
4096 rows on a Hopper-or-newer GPU (`takes`, `set_route`), i.e. the prefix at batch >= 6
(`geglu_config` picks the tiling by rows), and its
QKV and o_proj from 16384 rows (batch >= 20); smaller batches, the down projection and the action
expert stay on cuBLAS (the measurements are beside `_ROUTES`).

Status: tested against the references on CPU under the interpreter
(`tests/test_triton_gemm_tma.py`); timed on the H200 with `benchmarks/gemm_gpu.py --tma` and end
to end with `benchmarks/pi05_gpu.py` (batch 32: 132.8 -> 138.2 samples/s side by side with the first
GeGLU tiling; the QKV + RoPE and o_proj routes -0.6 ms of a ~234 ms chunk side by side).
Not run on Ada / Ampere (no TMA: `takes` refuses below compute capability 9.0) or on an Orin.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from phyai_edge.layers.triton_dispatch import (
    _sm_count,
    _use_triton,
    interpret_mode,
    tl,
    triton,
    triton_available,
)
from phyai_edge.layers.triton_gemm import linear_geglu_ref, linear_qkv_rope_ref, linear_ref
from phyai_edge.layers.triton_ops import check_out_buffer

log = logging.getLogger(__name__)

try:  # triton >= 3.4 (the GPU machine has 3.6)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton, or none
    TensorDescriptor = None


@dataclass(frozen=True)
class TmaConfig:
    """One tiling. `block_n` counts output columns (for `linear_geglu`: H columns, so a program
    holds two (block_m, block_n) accumulators). `programs`: persistent programs (None: one per
    tile)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    warps: int = 8
    stages: int = 3
    group_m: int = 8
    programs: int | None = None
    # A persistent program's tile loop and k loop as one software-pipelined loop: the next tile's
    # first operand loads are in flight while this tile's epilogue runs.
    flatten: bool = False
    # Store the output tile in two column halves: half the epilogue's shared memory, which a
    # pipeline stage can use instead.
    subtile: bool = False
    # Warp-specialise the tile loop (`tl.range(warp_specialize=True)`, Triton >= 3.5 on Hopper):
    # a producer warp issues the TMA loads while consumer warpgroups run the MMAs and the epilogue,
    # so one tile's epilogue overlaps the next tile's loads and MMAs. Not with `flatten` on Hopper.
    warp_specialize: bool = False

    def label(self) -> str:
        p = "tiles" if self.programs is None else f"p{self.programs}"
        extra = (" flat" if self.flatten else "") + (" sub" if self.subtile else "") + (" ws" if self.warp_specialize else "")
        return (f"m{self.block_m} n{self.block_n} k{self.block_k} w{self.warps} s{self.stages} g{self.group_m} "
                f"{p}{extra}")


# Tilings measured on the H200 (`benchmarks/gemm_gpu.py --tma`, RESULTS.md 2026-12-03 third session,
# calls 1-2). gate/up + GeGLU: two (128, 128) accumulators (a 128 x 256 tile of the product).
# At 26112 rows (batch 32) persistent programs, one per SM, walking groups of 16 row tiles: 5275 us
# against 5716 for cuBLAS + the GeGLU pass; at 6528 rows (batch 8) one program a tile, groups of
# 8: 1264 against 1280 (persistent there: 1302-1338).
GEGLU_TILES = TmaConfig(128, 128, 64, 8, 3, 8)
GEGLU_PERSISTENT = TmaConfig(128, 128, 64, 8, 3, 16)  # `programs` filled in: the SM count
PERSISTENT_FROM_ROWS = 16384
# From 4096 to PERSISTENT_FROM_ROWS rows (the prefix at batch 6-19): persistent programs with the
# tile loop warp-specialised and the store in halves. End to end against GEGLU_TILES (RESULTS.md,
# 2026-12-03 fifth session, call 2): prefix 37.88 vs 38.99 ms at batch 8, 77.56 vs 80.14 at 16. At
# 26112 rows (batch 32) warp specialization gained nothing (prefix 155.82 vs 155.59 ms), so
# GEGLU_PERSISTENT stays there.
GEGLU_MID = TmaConfig(128, 128, 64, 8, 3, 16, subtile=True, warp_specialize=True)  # `programs`: SMs
LINEAR_DEFAULT = TmaConfig(128, 128, 64, 4, 4, 8)
# Plain GEMMs: 128 x 256 tiles, persistent, one flattened (tile, k) loop, the store in halves. On
# the prefix's o_proj at 26112 rows 287.7 us against cuBLAS's 318.8 (call 1, 2026-12-03 fourth
# session); flattening the two-accumulator GeGLU kernel instead made it slower (6554 vs 5229 us).
LINEAR_PERSISTENT = TmaConfig(128, 256, 64, 8, 3, 8, flatten=True, subtile=True)
# QKV + RoPE: one head (head_dim columns) a tile, so RoPE's pairs (d, d + D/2) meet in one
# accumulator; the same persistent, flattened loop as LINEAR_PERSISTENT.
QKV_PERSISTENT = TmaConfig(128, 256, 64, 8, 3, 8, flatten=True)

# Where `takes` routes calls here, per op: [on, min rows]. The callers, all in the prefix
# (`fused_stacks.plain_block_stack`): "geglu" its MLPs' gate/up, "qkv_rope" its QKV projections,
# "linear" its o_proj (its down stays on cuBLAS: 2430 vs 2492 us at 26112 rows). geglu: below 4096
# rows (the prefix at batch <= 4) cuBLAS plus the pass won (816 rows: 172 vs 175 us). qkv_rope /
# linear: at 26112 rows 435 vs 455 and 288 vs 319 us, at 6528 par (111 vs 113, 84 vs 76), so from
# 16384. The expert's o_proj / down on `linear` were faster alone at 1600 rows (13.3 vs 14.8, 23.3
# vs 26.7 us) but made the batch-32 step slower end to end (3.522 vs 3.418 ms), and slower at
# 800-1200 and 2400-3200 rows: the expert's stack never asks.
_ROUTES: dict[str, list] = {"geglu": [True, 4096], "qkv_rope": [True, 16384], "linear": [True, 16384]}


def available() -> bool:
    return triton_available() and TensorDescriptor is not None


def set_route(op: str, on: bool) -> bool:
    """Route `op` ("geglu", "qkv_rope", "linear") calls that `takes` accepts here; returns the
    previous setting."""
    if op not in _ROUTES:
        raise ValueError(f"unknown TMA route {op!r}: one of {sorted(_ROUTES)}")
    before = _ROUTES[op][0]
    _ROUTES[op][0] = bool(on)
    return before


def takes(op: str, linear: torch.nn.Module | None, h: torch.Tensor) -> bool:
    """The rule callers use: `op`'s route on, h's rows in its range, a Hopper-or-newer CUDA device,
    a plain bias-free bf16 / fp16 `nn.Linear` of h's dtype (an fp8 linear keeps its own forward),
    no gradient wanted (exact RTC guidance runs the reference)."""
    on, lo = _ROUTES[op]
    if not (on and available() and h.is_cuda and type(linear) is torch.nn.Linear):
        return False
    w = linear.weight
    if linear.bias is not None or w.dtype not in (torch.bfloat16, torch.float16) or h.dtype != w.dtype:
        return False
    rows = h.numel() // h.shape[-1]
    if rows < lo or w.shape[1] % 8:
        return False
    if torch.is_grad_enabled() and h.requires_grad:
        return False
    return torch.cuda.get_device_capability(h.device) >= (9, 0)


if triton is not None:
    from phyai_edge.layers.triton_math import _gelu_tanh, _rope

    @triton.jit
    def _tile_of(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
        # grouped order: GROUP_M row tiles share each weight column tile while it is in L2
        per_group = GROUP_M * tiles_n
        first_m = (tile // per_group) * GROUP_M
        rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % rows_in_group
        pid_n = (tile % per_group) // rows_in_group
        return pid_m, pid_n

    @triton.jit
    def _tma_gemm_kernel(
        a_desc, w_desc, out_desc, M, N, K, up_offset,
        GEGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, UPCAST: tl.constexpr, FLATTEN: tl.constexpr,
        SUBTILE: tl.constexpr, WS: tl.constexpr,
    ):
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=FLATTEN, warp_specialize=WS):
            pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(k_tiles):
                off_k = kk * BLOCK_K
                a = a_desc.load([off_m, off_k])
                w = w_desc.load([off_n, off_k])
                if UPCAST:
                    a = a.to(tl.float32)
                    w = w.to(tl.float32)
                acc = tl.dot(a, w.T, acc)
                if GEGLU:
                    # a gate tile past H reads up rows; its output columns are past H and the
                    # store's bounds drop them
                    wu = w_desc.load([up_offset + off_n, off_k])
                    if UPCAST:
                        wu = wu.to(tl.float32)
                    acc_up = tl.dot(a, wu.T, acc_up)
            if GEGLU:
                acc = _gelu_tanh(acc) * acc_up
            out = acc.to(out_desc.dtype)
            if SUBTILE:
                left, right = tl.split(tl.permute(tl.reshape(out, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
                out_desc.store([off_m, off_n], left)
                out_desc.store([off_m, off_n + BLOCK_N // 2], right)
            else:
                out_desc.store([off_m, off_n], out)


    @triton.jit
    def _tma_qkv_rope_kernel(
        a_desc, w_desc, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
        M, K, seq_len, num_heads, num_kv_heads,
        stride_cb, stride_ct, stride_sb, stride_st, stride_kv_b, stride_kv_h, stride_kv_t,
        stride_q_b, stride_q_h, stride_q_t,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        PROGRAMS: tl.constexpr, UPCAST: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr,
    ):
        # A tile is BLOCK_M tokens of one head (q, k or v): RoPE's pairs (d, d + D/2) are in the
        # same accumulator. Rows are (sample, token) pairs, so a tile may span two samples: the
        # (B, heads, T, D) outputs are written through pointers, not a descriptor. k and v share
        # strides (a KV cache's two halves, possibly with room after the prefix: not contiguous); q
        # has its own (a (B, T, H, D) buffer seen as (B, H, T, D) for SDPA's token-major folding).
        HALF: tl.constexpr = HEAD_DIM // 2
        tiles_m = tl.cdiv(M, BLOCK_M)
        heads = num_heads + 2 * num_kv_heads
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), tiles_m * heads, PROGRAMS, flatten=FLATTEN, warp_specialize=WS):
            pid_m, head = _tile_of(tile, tiles_m, heads, GROUP_M)
            off_m = pid_m * BLOCK_M
            acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
            for kk in range(k_tiles):
                a = a_desc.load([off_m, kk * BLOCK_K])
                w = w_desc.load([head * HEAD_DIM, kk * BLOCK_K])
                if UPCAST:
                    a = a.to(tl.float32)
                    w = w.to(tl.float32)
                acc = tl.dot(a, w.T, acc)
            x1, x2 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
            rows = off_m + tl.arange(0, BLOCK_M)
            b = (rows // seq_len)[:, None]
            t = (rows % seq_len)[:, None]
            cols = tl.arange(0, HALF)[None, :]
            ok = (rows < M)[:, None]
            if head < num_heads + num_kv_heads:  # q and k heads: rotate_half RoPE, as qkv_rope
                cs = cos_ptr + b * stride_cb + t * stride_ct + cols
                sn = sin_ptr + b * stride_sb + t * stride_st + cols
                o1, o2 = _rope(x1, x2, cs, sn, ok, HALF)
            else:
                o1 = x1
                o2 = x2
            if head < num_heads:
                dst = q_ptr + b * stride_q_b + head * stride_q_h + t * stride_q_t + cols
            elif head < num_heads + num_kv_heads:
                dst = k_ptr + b * stride_kv_b + (head - num_heads) * stride_kv_h + t * stride_kv_t + cols
            else:
                dst = v_ptr + b * stride_kv_b + (head - num_heads - num_kv_heads) * stride_kv_h + t * stride_kv_t + cols
            tl.store(dst, o1.to(q_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + HALF, o2.to(q_ptr.dtype.element_ty), mask=ok)


def _check(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if TensorDescriptor is None:
        raise RuntimeError("TMA GEMMs need triton >= 3.4 (triton.tools.tensor_descriptor)")
    if bias is not None:
        raise ValueError("TMA GEMMs take no bias")
    if weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float16) or h.dtype != weight.dtype:
        raise ValueError(f"TMA GEMMs need a 2-D bf16 / fp16 weight and h of its dtype, got {h.dtype} / "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if h.shape[-1] != weight.shape[1] or weight.shape[1] % 8:
        raise ValueError(f"h (..., {h.shape[-1]}) against weight {tuple(weight.shape)}: K must match and be a "
                         "multiple of 8")


def _run(h: torch.Tensor, weight: torch.Tensor, n: int, geglu: bool, cfg: TmaConfig) -> torch.Tensor:
    a = h.reshape(-1, h.shape[-1])
    if not a.is_contiguous():
        a = a.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    m, k = a.shape
    out = torch.empty((m, n), dtype=h.dtype, device=h.device)
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    out_desc = TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n // 2 if cfg.subtile else cfg.block_n])
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = tiles if cfg.programs is None else min(cfg.programs, tiles)

    def launch(c: TmaConfig) -> None:
        _tma_gemm_kernel[(programs,)](
            a_desc, w_desc, out_desc, m, n, k, n,
            GEGLU=geglu, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
            PROGRAMS=programs, UPCAST=interpret_mode(), FLATTEN=c.flatten, SUBTILE=c.subtile,
            WS=c.warp_specialize and _ws_works(), num_warps=c.warps, num_stages=c.stages,
        )

    _launch_with_ws_fallback(launch, cfg)
    return out.view(*h.shape[:-1], n)


_WS_BROKEN: list[str] = []  # why warp specialization failed to compile here, once it has


def _ws_works() -> bool:
    return not _WS_BROKEN


def _launch_with_ws_fallback(launch: Callable[[TmaConfig], None], cfg: TmaConfig) -> None:
    """Launch with `cfg`; if it asks for warp specialization and that fails to compile (a Triton
    or GPU without it: Hopper support arrived in Triton 3.5, and some tilings fail there), say so
    once and run every later call without it. Compilation happens at the first call of a shape, in
    an engine's warm-up, before any graph capture."""
    if not (cfg.warp_specialize and _ws_works()):
        launch(cfg)
        return
    try:
        launch(cfg)
    except Exception as exc:  # Triton raises its own compilation errors; none is fatal here
        _WS_BROKEN.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        log.warning("TMA GEMM: warp specialization failed to compile (%s); running without it", _WS_BROKEN[0])
        launch(dataclasses.replace(cfg, warp_specialize=False))


def linear_geglu(h: torch.Tensor, weight: torch.Tensor, backend: str = "reference", *,
                 bias: torch.Tensor | None = None, config: TmaConfig | None = None) -> torch.Tensor:
    """gelu_tanh(h @ gate.T) * (h @ up.T) for weight = cat([gate, up]) (2 H, K): (..., H)."""
    if not _use_triton(backend, h, weight):
        return linear_geglu_ref(h, weight, bias)
    _check(h, weight, bias)
    if weight.shape[0] % 2:
        raise ValueError(f"gate/up weight needs an even row count, got {weight.shape[0]}")
    if config is None:
        config = geglu_config(h.numel() // h.shape[-1], h.device)
    return _run(h, weight, weight.shape[0] // 2, True, config)


def geglu_config(rows: int, device: torch.device) -> TmaConfig:
    """`linear_geglu`'s default tiling for `rows` on `device`: persistent programs (one per SM) from
    the route's 4096 rows on a GPU, warp-specialised below `PERSISTENT_FROM_ROWS`; else one program
    a tile."""
    if device.type != "cuda" or rows < _ROUTES["geglu"][1]:
        return GEGLU_TILES
    config = GEGLU_PERSISTENT if rows >= PERSISTENT_FROM_ROWS else GEGLU_MID
    return dataclasses.replace(config, programs=_sm_count(device))


def linear(h: torch.Tensor, weight: torch.Tensor, backend: str = "reference", *,
           bias: torch.Tensor | None = None, config: TmaConfig | None = None) -> torch.Tensor:
    """h @ weight.T on the TMA loop (no epilogue). Default tiling: persistent 128 x 256 tiles from
    `PERSISTENT_FROM_ROWS` rows on a GPU, else `LINEAR_DEFAULT`."""
    if not _use_triton(backend, h, weight):
        return linear_ref(h, weight, bias)
    _check(h, weight, bias)
    if config is None:
        config = LINEAR_DEFAULT
        if h.numel() // h.shape[-1] >= PERSISTENT_FROM_ROWS and h.is_cuda:
            config = dataclasses.replace(LINEAR_PERSISTENT, programs=_sm_count(h.device))
    return _run(h, weight, weight.shape[0], False, config)


def _qkv_shapes(h: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, num_heads: int, num_kv_heads: int,
                head_dim: int) -> None:
    if h.dim() != 3:
        raise ValueError(f"linear_qkv_rope: h (B, T, K) expected, got shape {tuple(h.shape)}")
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    if weight.shape[0] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv weight rows {weight.shape[0]} != (heads + 2 kv heads) * head_dim")
    if cos.shape[-2] != h.shape[1] or cos.shape[-1] != head_dim:
        raise ValueError(f"cos {tuple(cos.shape)} does not match {h.shape[1]} tokens of head_dim {head_dim}")


def linear_qkv_rope(
    h: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
    num_kv_heads: int, head_dim: int, backend: str = "reference", *, bias: torch.Tensor | None = None,
    config: TmaConfig | None = None, k_out: torch.Tensor | None = None, v_out: torch.Tensor | None = None,
    q_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contract of `triton_gemm.linear_qkv_rope_ref` (q (B, H, T, D); k, v (B, Hkv, T, D); cos,
    sin (B or 1, 1, T, D)), as one TMA GEMM with RoPE in its epilogue. `k_out` / `v_out`: (B, Hkv,
    T, D) buffers with a unit last stride to write k / v into (a slice of a stacked KV cache, which
    may have room after the prefix: no later copy); both or neither, with the same strides. `q_out`:
    a (B, H, T, D) buffer with a unit last stride for q (a (B, T, H, D) buffer seen transposed, which
    SDPA folds and hands back without copies). The reference path copies into them. head_dim: a
    power of two, 16..256 (one tile's columns)."""
    _qkv_shapes(h, weight, cos, num_heads, num_kv_heads, head_dim)
    b, t, _ = h.shape
    kv_shape = (b, num_kv_heads, t, head_dim)
    for name, buf in (("k_out", k_out), ("v_out", v_out)):
        if buf is not None:
            check_out_buffer(name, buf, kv_shape, h.dtype)
    if q_out is not None:
        check_out_buffer("q_out", q_out, (b, num_heads, t, head_dim), h.dtype)
    if (k_out is None) != (v_out is None) or (k_out is not None and k_out.stride() != v_out.stride()):
        raise ValueError("k_out and v_out: both or neither, with the same strides")
    if not _use_triton(backend, h, weight, cos, sin):
        q, k, v = linear_qkv_rope_ref(h, weight, cos, sin, num_heads, num_kv_heads, head_dim, bias)
        if q_out is not None:
            q = q_out.copy_(q)
        if k_out is not None:
            k = k_out.copy_(k)
        if v_out is not None:
            v = v_out.copy_(v)
        return q, k, v
    _check(h, weight, bias)
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        raise ValueError(f"the TMA QKV kernel takes a power-of-two head_dim in 16..256, got {head_dim}")
    a = h.reshape(-1, h.shape[-1])
    if not a.is_contiguous():
        a = a.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    cos3 = cos.reshape(cos.shape[0], t, head_dim)
    sin3 = sin.reshape(sin.shape[0], t, head_dim)
    cos3 = cos3 if cos3.stride(-1) == 1 else cos3.contiguous()
    sin3 = sin3 if sin3.stride(-1) == 1 else sin3.contiguous()
    if cos3.shape[0] not in (1, b) or sin3.shape[0] != cos3.shape[0]:
        raise ValueError(f"cos / sin batch {cos3.shape[0]} / {sin3.shape[0]}: 1 or {b} expected")
    q = q_out if q_out is not None else torch.empty((b, num_heads, t, head_dim), dtype=h.dtype, device=h.device)
    k = k_out if k_out is not None else torch.empty(kv_shape, dtype=h.dtype, device=h.device)
    v = v_out if v_out is not None else torch.empty(kv_shape, dtype=h.dtype, device=h.device)
    m = a.shape[0]
    if config is None:
        config = QKV_PERSISTENT
        if h.is_cuda:
            config = dataclasses.replace(config, programs=_sm_count(h.device))
    a_desc = TensorDescriptor.from_tensor(a, [config.block_m, config.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [head_dim, config.block_k])
    tiles = triton.cdiv(m, config.block_m) * (num_heads + 2 * num_kv_heads)
    programs = tiles if config.programs is None else min(config.programs, tiles)

    def launch(c: TmaConfig) -> None:
        _tma_qkv_rope_kernel[(programs,)](
            a_desc, w_desc, cos3, sin3, q, k, v,
            m, a.shape[1], t, num_heads, num_kv_heads,
            cos3.stride(0) if cos3.shape[0] > 1 else 0, cos3.stride(1),
            sin3.stride(0) if sin3.shape[0] > 1 else 0, sin3.stride(1), *k.stride()[:3], *q.stride()[:3],
            HEAD_DIM=head_dim, BLOCK_M=c.block_m, BLOCK_K=c.block_k, GROUP_M=c.group_m,
            PROGRAMS=programs, UPCAST=interpret_mode(), FLATTEN=c.flatten, WS=c.warp_specialize and _ws_works(),
            num_warps=c.warps, num_stages=c.stages,
        )

    _launch_with_ws_fallback(launch, config)
    return q, k, v
