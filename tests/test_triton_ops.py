"""Fused Triton ops (`layers/triton_ops.py`) against their plain-torch references, the dispatcher,
and the cudagraph engine's `triton_ops` option against the eager engine.

Without a GPU the kernels run in Triton's CPU interpreter: `conftest.py` sets `TRITON_INTERPRET=1`
(only where CUDA is absent) before anything imports triton, since Triton decides at decoration.
Kernel tests skip, with the reason, where triton is not installed (the `test` extra installs it
on Linux x86-64, so CI runs them under the interpreter); the reference, dispatcher and engine
tests run everywhere (the engine then takes the dispatcher's reference path).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from test_cudagraph import _inputs, _rel, _rtc

from phyai_edge.adapters.base import SolverSpec
from phyai_edge.adapters.pi05 import builtin_adapter
from phyai_edge.engines.cudagraph import CudaGraphEngine
from phyai_edge.engines.eager import EagerEngine
from phyai_edge.layers import fused_stacks, triton_dispatch, triton_ops
from phyai_edge.layers.gemma import GemmaBlock
from phyai_edge.layers.norm import ada_rms_norm_ref, layer_norm_ref
from phyai_edge.layers.rotary import rope_cos_sin

KERNELS_RUN, WHY_NOT = triton_ops.triton_status("cuda" if torch.cuda.is_available() else "cpu")
kernels = pytest.mark.skipif(not KERNELS_RUN, reason=f"Triton kernels cannot run here: {WHY_NOT}")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + 0.1).to(dtype).to(DEVICE)


@pytest.fixture
def poisoned(monkeypatch):
    """Kernel outputs start as NaN: any element a kernel fails to write shows up."""

    def empty(shape, like):
        return torch.full(tuple(shape), float("nan"), dtype=like.dtype, device=like.device)

    monkeypatch.setattr(triton_ops, "_empty", empty)


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "output not fully written (NaN poison left)"
    assert _rel(out.float(), ref.float()) < TOL[dtype]


# -- kernels against references ---------------------------------------------------------------------
SHAPES = [(1, 50, 1024), (2, 7, 96), (3, 5, 1000), (2, 3, 33)]
DTYPES = [torch.float32, torch.bfloat16]


@kernels
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_batch", [False, True])
def test_ada_rms_norm_kernel(poisoned, shape, dtype, per_batch) -> None:
    b, _, n = shape
    mb = b if per_batch else 1
    x = _randn(*shape, dtype=dtype, seed=1, scale=3.0)
    scale, shift = _randn(mb, 1, n, seed=2, scale=0.3), _randn(mb, 1, n, seed=3, scale=0.3)
    out = triton_ops.ada_rms_norm(x, scale, shift, 1e-6, backend="triton")
    _check(out, ada_rms_norm_ref(x, scale, shift, 1e-6), dtype)


@kernels
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_batch", [False, True])
def test_residual_ada_rms_norm_kernel(poisoned, shape, dtype, per_batch) -> None:
    b, _, n = shape
    mb = b if per_batch else 1
    x, y = _randn(*shape, dtype=dtype, seed=1, scale=2.0), _randn(*shape, dtype=dtype, seed=4)
    gate = _randn(mb, 1, n, seed=5, scale=0.5)  # float32, as the modulation tables hold it
    scale, shift = _randn(mb, 1, n, seed=2, scale=0.3), _randn(mb, 1, n, seed=3, scale=0.3)
    res, out = triton_ops.residual_ada_rms_norm(x, y, gate, scale, shift, 1e-6, backend="triton")
    ref_res, ref_out = triton_ops.residual_ada_rms_norm_ref(x, y, gate, scale, shift, 1e-6)
    _check(res, ref_res, dtype)
    _check(out, ref_out, dtype)


ROPE_CASES = [  # (batch, tokens, heads, kv heads, head dim), layout of qkv and cos/sin
    ((1, 50, 8, 1, 256), "packed"),  # the PI0.5 expert
    ((2, 7, 2, 1, 16), "packed"),  # the tiny preset
    ((2, 7, 2, 1, 16), "strided"),  # qkv a column slice of a wider tensor
    ((2, 5, 3, 3, 24), "shared-cos"),  # half = 12: not a power of two; cos/sin broadcast over batch
    ((2, 5, 3, 3, 24), "strided"),
    ((1, 3, 4, 2, 10), "packed"),
    ((2, 3, 8, 1, 16), "packed"),  # 9 heads: a 16-row head tile with 7 rows masked off
]


@kernels
@pytest.mark.parametrize(("shape", "layout"), ROPE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_rope_kernel(poisoned, shape, dtype, layout) -> None:
    b, t, hq, hkv, d = shape
    width = (hq + 2 * hkv) * d
    qkv = _randn(b, t, width + (8 if layout == "strided" else 0), dtype=dtype, seed=6)[..., :width]
    positions = torch.arange(t)[None, :] + torch.tensor([[37], [5], [0]])[:b] * 3
    if layout == "shared-cos":
        positions = positions[:1]
    cos, sin = rope_cos_sin(positions.to(DEVICE), d, 10000.0, dtype)
    q, k, v = triton_ops.qkv_rope(qkv, cos, sin, hq, hkv, d, backend="triton")
    rq, rk, rv = triton_ops.qkv_rope_ref(qkv, cos, sin, hq, hkv, d)
    _check(q, rq, dtype)
    _check(k, rk, dtype)
    assert torch.equal(v, rv)
    assert q.is_contiguous() and k.is_contiguous()


@kernels
@pytest.mark.parametrize("shape", [(1, 50, 4096), (2, 7, 96), (3, 5, 1000), (2, 3, 33)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_geglu_kernel(poisoned, shape, dtype) -> None:
    b, t, hidden = shape
    gate_up = _randn(b, t, 2 * hidden, dtype=dtype, seed=7, scale=2.0)
    _check(triton_ops.geglu(gate_up, backend="triton"), triton_ops.geglu_ref(gate_up), dtype)


# -- the block stack ----------------------------------------------------------------------------------
def _blocks(dtype, fuse=True, depth=3, width=48, heads=2, kv_heads=1, head_dim=16):
    torch.manual_seed(0)
    blocks = [GemmaBlock(width, 96, heads, kv_heads, head_dim, 1e-6, cond_dim=width) for _ in range(depth)]
    for blk in blocks:
        for p in blk.parameters():
            p.data.normal_(0, 0.2)
        # on the device before fusing: the fused projections are unregistered copies, which a
        # later .to() would leave behind
        blk.to(DEVICE)
        blk.self_attn.to(dtype)
        blk.mlp.to(dtype)
        if fuse:
            blk.self_attn.fuse()
            blk.mlp.fuse()
    return [blk.eval().requires_grad_(False) for blk in blocks]


def _stack_inputs(blocks, dtype, b=2, t=6, p=9):
    attn = blocks[0].self_attn
    width = blocks[0].mlp.up_proj.in_features
    x = _randn(b, t, width, dtype=dtype, seed=11)
    cond = _randn(b, width, seed=12)
    mods = [(blk.input_layernorm.modulation(cond), blk.post_attention_layernorm.modulation(cond)) for blk in blocks]
    final = blocks[-1].post_attention_layernorm.modulation(cond * 0.5)
    positions = torch.arange(t)[None, :].to(DEVICE) + torch.tensor([[p], [p - 3]], device=DEVICE)[:b]
    cos, sin = rope_cos_sin(positions, attn.head_dim, 10000.0, dtype)
    shape = (len(blocks), b, attn.num_kv_heads, p, attn.head_dim)
    k_cache, v_cache = _randn(*shape, dtype=dtype, seed=13), _randn(*shape, dtype=dtype, seed=14)
    mask = torch.ones(b, 1, 1, p + t, dtype=torch.bool, device=DEVICE)
    mask[1, ..., p - 3 : p] = False  # padded prefix keys in the second sample
    return x, cos, sin, k_cache, v_cache, mask, mods, final


def _stack_reference(blocks, x, cos, sin, k_cache, v_cache, mask, mods, final):
    """The model's own per-block path (`GemmaBlock.project_kv` / `finish`) and the final norm."""
    for i, blk in enumerate(blocks):
        q, k, v, gate = blk.project_kv(x, cos, sin, mods[i][0])
        x = blk.finish(x, q, torch.cat([k_cache[i], k], 2), torch.cat([v_cache[i], v], 2), mask, gate, mods[i][1])
    return ada_rms_norm_ref(x, final[0], final[1], 1e-6)


def _float32_truth(blocks, args):
    """The stack's reference output with the same blocks and inputs in float32 (fused projections,
    as the kernels' path uses): what a bf16 run is judged against."""
    truth_blocks = [copy.deepcopy(blk).float() for blk in blocks]
    for blk in truth_blocks:
        blk.self_attn.fuse()
        blk.mlp.fuse()
    with torch.no_grad():
        return _stack_reference(truth_blocks, *[a.float() if a.is_floating_point() else a for a in args[:6]],
                                *args[6:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fuse", [True, False])
def test_block_stack_reference_path(dtype, fuse) -> None:
    blocks = _blocks(dtype, fuse=fuse)
    args = _stack_inputs(blocks, dtype)
    with torch.no_grad():
        out = fused_stacks.adaptive_block_stack(blocks, *args, 1e-6, backend="reference")
        ref = _stack_reference(blocks, *args)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < (1e-6 if dtype == torch.float32 else 1e-2)


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_stack_kernels(poisoned, dtype) -> None:
    blocks = _blocks(dtype)
    args = _stack_inputs(blocks, dtype)
    with torch.no_grad():
        out = fused_stacks.adaptive_block_stack(blocks, *args, 1e-6, backend="triton")
        ref = _stack_reference(blocks, *args)
    if dtype == torch.float32:
        _check(out, ref, dtype)
        return
    # bf16 through three blocks: the kernels round once per chain, the reference after every op,
    # so judge both against the same blocks in float32 and hold the kernels to the reference's error.
    truth = _float32_truth(blocks, args)
    assert torch.isfinite(out).all()
    err, ref_err = _rel(out.float(), truth), _rel(ref.float(), truth)
    assert err < 2e-2 and err < 1.5 * ref_err, (err, ref_err)
    assert _rel(out.float(), ref.float()) < 2e-2


# -- dispatcher --------------------------------------------------------------------------------------
def test_dispatcher(monkeypatch) -> None:
    assert triton_ops.resolve_backend("reference", "cuda") == "reference"
    with pytest.raises(ValueError, match="backend="):
        triton_ops.resolve_backend("fast", "cpu")
    monkeypatch.setattr(triton_dispatch, "_INTERPRET", False)
    monkeypatch.setattr(triton_dispatch, "_INTERPRET_ASKED", False)
    monkeypatch.setattr(triton_dispatch, "triton", triton_dispatch.triton or object())  # installed, or pretend it is
    assert triton_ops.resolve_backend("auto", "cpu") == "reference"
    assert triton_ops.resolve_backend("auto", "cuda") == "triton"
    with pytest.raises(RuntimeError, match="CUDA device or TRITON_INTERPRET"):
        triton_ops.resolve_backend("triton", "cpu")
    monkeypatch.setattr(triton_dispatch, "_INTERPRET_ASKED", True)  # asked for, but triton came first
    assert "after triton was imported" in triton_ops.triton_status("cpu")[1]
    monkeypatch.setattr(triton_dispatch, "triton", None)
    assert triton_ops.resolve_backend("auto", "cuda") == "reference"
    ok, why = triton_ops.triton_status("cuda")
    assert not ok and "not installed" in why
    with pytest.raises(RuntimeError, match="not installed"):
        triton_ops.resolve_backend("triton", "cuda")
    # The default is the reference: nothing reaches a kernel unless asked.
    x = torch.randn(1, 3, 8)
    out = triton_ops.ada_rms_norm(x, torch.randn(1, 1, 8), torch.randn(1, 1, 8), 1e-6)
    assert out.shape == x.shape


def test_imports_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import phyai_edge.engines.cudagraph\n"
        "from phyai_edge.layers import fused_stacks, triton_gemm, triton_ops as t\n"
        "assert not t.triton_available() and t.resolve_backend('auto', 'cuda') == 'reference'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# -- the engine option --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    base = builtin_adapter("tiny", seed=3)
    if KERNELS_RUN and not torch.cuda.is_available():
        base.solver = SolverSpec(3)  # the interpreter runs each program in numpy: keep it short
    return base, EagerEngine(copy.deepcopy(base), device="cpu", dtype="float32")


@pytest.mark.parametrize("mode", ["none", "guided"])
def test_engine_triton_ops_fp32(tiny, mode, monkeypatch) -> None:
    """fp32: the fused path (kernels under the interpreter, else the reference path) matches eager."""
    base, eager = tiny
    vision_calls = []
    stack = fused_stacks.siglip_block_stack
    monkeypatch.setattr(fused_stacks, "siglip_block_stack", lambda *a: vision_calls.append(a[-1]) or stack(*a))
    fast = CudaGraphEngine(copy.deepcopy(base), device=DEVICE, dtype="float32", triton_ops=True)
    assert fast.triton_ops == ("triton" if KERNELS_RUN else "reference")
    inputs = _inputs(base, 2, 3, [9, 30], masked_view=True)
    noise = torch.randn(2, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(7))
    rtc = None if mode == "none" else _rtc(base, 2, mode)
    out, ref = fast.run(inputs, noise=noise, rtc=rtc), eager.run(inputs, noise=noise, rtc=rtc)
    assert vision_calls and set(vision_calls) == {"auto"}  # the vision stage ran on the fused stack
    assert torch.isfinite(out).all()
    assert _rel(out.cpu(), ref.cpu()) < 1e-5


@pytest.mark.parametrize("backend", [True, "reference"])
def test_engine_triton_ops_bf16(tiny, backend) -> None:
    base, eager = tiny
    fast = CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="bfloat16", triton_ops=backend)
    plain = CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="bfloat16")
    inputs = _inputs(base, 1, 3, [20])
    noise = torch.randn(1, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(9))
    out, ref = fast.run(inputs, noise=noise), eager.run(inputs, noise=noise)
    assert _rel(out, ref) < 3e-2  # the bound test_cudagraph's bf16 test holds the plain engine to
    assert _rel(out, plain.run(inputs, noise=noise)) < 2e-2


def test_engine_triton_ops_validation(tiny) -> None:
    base, _ = tiny
    with pytest.raises(ValueError, match="triton_ops="):
        CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="float32", triton_ops="fast")
    eng = CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="float32")
    assert eng.triton_ops is None  # off by default


def test_engine_triton_ops_with_fp8(tiny) -> None:
    """Composes with fp8 linears (`layers/fp8.py`): the fused path calls the fp8 QKV / o / gate-up /
    down linears as they are; results as close to eager fp32 as the fp8 engine without the ops."""
    from phyai_edge.layers.fp8 import Fp8Linear

    base, eager = tiny
    fast = CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="bfloat16", fp8="expert", triton_ops=True)
    plain = CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="bfloat16", fp8="expert")
    assert fast.fp8_linears == plain.fp8_linears > 0
    attn = fast.module.expert_layers[0].self_attn
    assert isinstance(attn.qkv_proj, Fp8Linear)
    inputs = _inputs(base, 1, 3, [20])
    noise = torch.randn(1, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(9))
    out, ref, fp8_only = fast.run(inputs, noise=noise), eager.run(inputs, noise=noise), plain.run(inputs, noise=noise)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 3e-2  # test_fp8's bound for the fp8 expert engine
    assert _rel(out, fp8_only) < 2e-2


# -- the plain (prefix) stack -------------------------------------------------------------------------
def _plain_blocks(dtype, depth=3, width=48, heads=2, kv_heads=1, head_dim=16):
    torch.manual_seed(1)
    blocks = [GemmaBlock(width, 96, heads, kv_heads, head_dim, 1e-6) for _ in range(depth)]
    for blk in blocks:
        for p in blk.parameters():
            p.data.normal_(0, 0.2)
        blk.to(DEVICE)  # before fusing (see `_blocks`)
        blk.self_attn.to(dtype)
        blk.mlp.to(dtype)
        blk.self_attn.fuse()
        blk.mlp.fuse()
    return [blk.eval().requires_grad_(False) for blk in blocks]


def _plain_reference(blocks, x, cos, sin, mask):
    ks, vs = [], []
    for i, blk in enumerate(blocks):
        q, k, v, gate = blk.project_kv(x, cos, sin)
        ks.append(k)
        vs.append(v)
        if i < len(blocks) - 1:
            x = blk.finish(x, q, k, v, mask, gate)
    return torch.stack(ks), torch.stack(vs)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=kernels)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_block_stack(backend, dtype) -> None:
    """The prefix's K/V cache through the fused ops equals the per-block path, padding keys included."""
    blocks = _plain_blocks(dtype)
    b, t = 2, 140
    attn = blocks[0].self_attn
    x = _randn(b, t, 48, dtype=dtype, seed=21)
    mask = torch.ones(b, t, dtype=torch.bool, device=DEVICE)
    mask[1, 100:] = False
    positions = torch.cumsum(mask.long(), 1) - 1
    cos, sin = rope_cos_sin(positions, attn.head_dim, 10000.0, dtype)
    with torch.no_grad():
        k, v = fused_stacks.plain_block_stack(blocks, x, cos, sin, mask[:, None, None, :], backend=backend)
        rk, rv = _plain_reference(blocks, x, cos, sin, mask[:, None, None, :])
    assert k.shape == rk.shape and v.shape == rv.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    valid = mask[:, None, :, None].expand_as(k[0])  # padding rows' own K/V: computed, never read
    for got, want in ((k, rk), (v, rv)):
        assert torch.isfinite(got).all()
        assert _rel(got[:, valid], want[:, valid]) < tol


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=kernels)])
def test_unmasked_prefix_hands_sdpa_a_query_it_folds_without_copies(monkeypatch, backend) -> None:
    """With every key valid (`dense`) each block's query is a (B, T, H, D) buffer seen as (B, H, T, D):
    SDPA folds it token-major and its output comes back in the o-projection's (B, T, H * D) layout,
    so neither side copies (on the H200 that copy was ~0.16 ms a layer at batch 32). The K/V cache
    equals the masked stack's."""
    blocks = _plain_blocks(torch.float32)
    b, t = 2, 40
    x = _randn(b, t, 48, seed=22)
    mask = torch.ones(b, 1, 1, t, dtype=torch.bool, device=DEVICE)
    cos, sin = rope_cos_sin(torch.arange(t, device=DEVICE)[None].expand(b, t), 16, 10000.0, torch.float32)
    layouts = []
    real = fused_stacks.attention_unmasked

    def spy(q, k, v, *rest):
        out = real(q, k, v, *rest)
        layouts.append((q.transpose(1, 2).is_contiguous(), out.transpose(1, 2).is_contiguous()))
        return out

    monkeypatch.setattr(fused_stacks, "attention_unmasked", spy)
    with torch.no_grad():
        k, v = fused_stacks.plain_block_stack(blocks, x, cos, sin, mask, backend=backend, dense=True)
        rk, rv = fused_stacks.plain_block_stack(blocks, x, cos, sin, mask, backend=backend)
    assert layouts == [(True, True)] * (len(blocks) - 1)
    assert _rel(k, rk) < 1e-5 and _rel(v, rv) < 1e-5


# -- SigLIP: LayerNorm, residual + LayerNorm, GELU, the vision stack ------------------------------------
# Under the interpreter a float32 -> bf16 store truncates (Triton 3.9's numpy emulation rounds toward
# zero; GPUs round to nearest even), so the bf16 cases sit ~1 ulp (0.4%) from the references by design.
# 1152: SigLIP so400m's width (one row a program); narrower rows share a program (33 -> 32 rows of
# 64 columns: 65 rows leave the last program partly empty)
LN_SHAPES = [(1, 50, 1152), (2, 7, 96), (3, 5, 1000), (2, 3, 33), (5, 13, 33)]
AFFINE = ["weight+bias", "weight", "none"]


def _affine(n, affine):
    w = _randn(n, seed=31, scale=0.3) + 0.9 if affine != "none" else None
    b = _randn(n, seed=32, scale=0.2) if affine == "weight+bias" else None
    return w, b


@kernels
@pytest.mark.parametrize("shape", LN_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", AFFINE)
def test_layer_norm_kernel(poisoned, shape, dtype, affine) -> None:
    n = shape[-1]
    x = _randn(*shape, dtype=dtype, seed=33, scale=2.0) + 5.0  # |mean| >> std: the variance must not cancel
    w, b = _affine(n, affine)
    _check(triton_ops.layer_norm(x, w, b, 1e-6, backend="triton"), layer_norm_ref(x, w, b, 1e-6), dtype)


@kernels
@pytest.mark.parametrize("shape", LN_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_residual_layer_norm_kernel(poisoned, shape, dtype, layout) -> None:
    n = shape[-1]
    x = _randn(*shape, dtype=dtype, seed=34, scale=3.0)
    y = _randn(*shape[:-1], n + (5 if layout == "strided" else 0), dtype=dtype, seed=35)[..., :n]
    w, b = _affine(n, "weight+bias")
    res, out = triton_ops.residual_layer_norm(x, y, w, b, 1e-6, backend="triton")
    ref_res, ref_out = triton_ops.residual_layer_norm_ref(x, y, w, b, 1e-6)
    _check(res, ref_res, dtype)
    if dtype == torch.float32:
        assert torch.equal(res, ref_res)  # one add in float32 in both (bf16: the interpreter truncates)
    _check(out, ref_out, dtype)


@kernels
def test_residual_layer_norm_checks() -> None:
    x = _randn(2, 3, 8)
    with pytest.raises(ValueError, match="must match x"):
        triton_ops.residual_layer_norm(x, x.to(torch.bfloat16), None, None, 1e-6, backend="triton")
    with pytest.raises(ValueError, match="weight of shape"):
        triton_ops.layer_norm(x, torch.ones(9, device=DEVICE), None, 1e-6, backend="triton")


@kernels
@pytest.mark.parametrize("shape", [(1, 50, 4304), (2, 7, 96), (3, 5, 1000), (2, 3, 33)])  # 4304: SigLIP's fc1
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bias_gelu_kernel(poisoned, shape, dtype, with_bias) -> None:
    n = shape[-1]
    y = _randn(*shape[:-1], n + 3, dtype=dtype, seed=36, scale=3.0)[..., :n]  # not contiguous
    bias = _randn(n, dtype=dtype, seed=37) if with_bias else None
    _check(triton_ops.bias_gelu(y, bias, backend="triton"), triton_ops.bias_gelu_ref(y, bias), dtype)


def _tower(dtype, fuse, cfg=(28, 7, 60, 3, 4, 100)):
    """A small SigLIP tower, seeded (default: 16 patches, width 60, 4 heads of 15, MLP 100, 3 blocks)."""
    from phyai_edge.layers.siglip import SiglipVisionTower

    image, patch, width, depth, heads, mlp = cfg
    torch.manual_seed(2)
    tower = SiglipVisionTower(image, patch, width, depth, heads, mlp, 1e-6)
    for name, p in tower.named_parameters():
        if "norm" in name:
            p.data = 1.0 + 0.2 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p)
        else:
            p.data.normal_(0, 0.1)
    tower.to(DEVICE)  # before fusing (see `_blocks`)
    for sub in tower.modules():  # as PI05Model.set_precision: matmul weights low, norms float32
        if isinstance(sub, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Embedding)):
            sub.to(dtype)
    if fuse:
        for block in tower.encoder.layers:
            block.self_attn.fuse()
    return tower.eval().requires_grad_(False)


def _stack(tower, pixels, backend):
    return fused_stacks.siglip_block_stack(tower.encoder.layers, tower.embeddings(pixels), tower.post_layernorm,
                                         backend)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fuse", [True, False])
def test_siglip_stack_reference_path(dtype, fuse) -> None:
    """The stack's own glue (unmasked SDPA, packed QKV split, norm order) against the tower's forward."""
    tower = _tower(dtype, fuse)
    pixels = _randn(3, 3, 28, 28, seed=38).clamp(-1, 1)
    with torch.no_grad():
        out, ref = _stack(tower, pixels, "reference"), tower(pixels)
    assert out.dtype == ref.dtype == dtype
    assert _rel(out.float(), ref.float()) < (1e-6 if dtype == torch.float32 else 1e-2)


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_siglip_stack_kernels(poisoned, dtype) -> None:
    tower = _tower(dtype, fuse=True)
    pixels = _randn(3, 3, 28, 28, seed=38).clamp(-1, 1)
    with torch.no_grad():
        out, ref = _stack(tower, pixels, "triton"), tower(pixels)
    if dtype == torch.float32:
        _check(out, ref, dtype)
        return
    # bf16 through three blocks: judge kernels and reference against the same tower in float32.
    from phyai_edge.layers.fused import unfuse_projections

    truth_tower = copy.deepcopy(tower)
    unfuse_projections(truth_tower)  # `.float()` does not reach the unregistered fused QKV
    with torch.no_grad():
        truth = truth_tower.float()(pixels)
    assert torch.isfinite(out).all()
    err, ref_err = _rel(out.float(), truth), _rel(ref.float(), truth)
    assert err < 2e-2 and err < 1.5 * ref_err, (err, ref_err)  # here 7.2e-3 against 5.9e-3
    assert _rel(out.float(), ref.float()) < 2e-2


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_siglip_stage_tiny_preset(poisoned, dtype) -> None:
    """`PI05Model.triton_stages()["embed_images"]` on the tiny preset (SigLIP at 224 px / 14, width 32)
    against the model's own `embed_images`, as the cudagraph engine would prepare the model."""
    from phyai_edge.layers.fused import fuse_projections

    model = copy.deepcopy(builtin_adapter("tiny", seed=4).module).to(DEVICE).set_precision(dtype)
    model.eval().requires_grad_(False)
    fuse_projections(model)
    images = _randn(1, 2, 3, 224, 224, seed=39).clamp(-1, 1)
    with torch.no_grad():
        out, ref = model.triton_stages("triton")["embed_images"](images), model.embed_images(images)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert _rel(out.float(), ref.float()) < (1e-5 if dtype == torch.float32 else 2e-2)  # bf16 here: 8.5e-3


def test_siglip_stack_fp8_linears() -> None:
    """With every SigLIP linear in fp8 (`convert_fp8(scope="all")`) the stack calls them as they are."""
    from phyai_edge.layers.fp8 import Fp8Linear, convert_fp8
    from phyai_edge.layers.fused import fuse_projections

    model = copy.deepcopy(builtin_adapter("tiny", seed=4).module).set_precision(torch.bfloat16)
    model.eval().requires_grad_(False)
    fuse_projections(model)
    convert_fp8(model, "all")
    assert isinstance(model.vision.encoder.layers[0].self_attn.qkv_proj, Fp8Linear)
    images = _randn(1, 1, 3, 224, 224, seed=40).clamp(-1, 1).cpu()
    with torch.no_grad():
        out = model.triton_stages("reference")["embed_images"](images)
        ref = model.embed_images(images)
    assert _rel(out.float(), ref.float()) < 1e-2


def test_programmatic_dependent_launch_options() -> None:
    """PDL is asked for only on a CUDA device (never on the CPU or in the interpreter), and
    `set_pdl` switches it, returning the previous setting."""
    from phyai_edge.layers import triton_dispatch as td

    cpu = torch.zeros(2)
    assert td.launch_options(cpu) == {"PDL": False}
    before = td.set_pdl(False)
    try:
        assert td.set_pdl(True) is False
        assert td.launch_options(cpu) == {"PDL": False}
    finally:
        td.set_pdl(before)


def test_a_triton_older_than_the_kernels_were_run_with_counts_as_absent(monkeypatch) -> None:
    """JetPack 6's PyTorch 2.5 pairs with Triton 3.1, which cannot even interpret these kernels:
    such a Triton is reported as not usable, so `auto` takes the reference ops rather than a
    kernel failing at an engine's first launch."""
    from phyai_edge.layers import triton_dispatch as td

    monkeypatch.setattr(td.triton, "__version__", "3.1.0")
    ok, why = td.triton_status("cuda")
    assert not ok and why.startswith("triton 3.1.0 is older than 3.6"), why
    assert td.resolve_backend("auto", "cuda") == "reference" and not td.triton_available()
    with pytest.raises(RuntimeError, match=r"older than 3\.6"):
        td.resolve_backend("triton", "cuda")
    for version in ("3.6.0", "3.9.0+git1234", "4.0.0"):
        monkeypatch.setattr(td.triton, "__version__", version)
        assert td.triton_status("cuda")[0] and td.triton_available(), version


@pytest.mark.parametrize("dtype", DTYPES)
def test_patch_embed_is_the_convolution(dtype) -> None:
    """The patch convolution as a GEMM gives SiglipEmbeddings' output (rows, contiguous)."""
    from phyai_edge.layers.siglip import SiglipEmbeddings

    torch.manual_seed(5)
    emb = SiglipEmbeddings(image_size=28, patch_size=7, width=24)
    for prm in emb.parameters():
        prm.data.normal_(0, 0.3)
    emb = emb.to(DEVICE, dtype)
    pixels = torch.rand(3, 3, 28, 28, device=DEVICE) * 2 - 1
    with torch.no_grad():
        got = fused_stacks.patch_embed(emb, pixels)
        want = emb(pixels)
    assert got.shape == want.shape == (3, 16, 24) and got.dtype == want.dtype
    assert got.is_contiguous()
    assert _rel(got.float(), want.float()) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_patch_embed_other_convolutions_take_the_module() -> None:
    from phyai_edge.layers.siglip import SiglipEmbeddings

    emb = SiglipEmbeddings(image_size=28, patch_size=7, width=8)
    emb.patch_embedding.padding = (1, 1)  # no longer a plain patch split
    pixels = torch.rand(1, 3, 26, 26)
    with torch.no_grad():
        assert torch.equal(fused_stacks.patch_embed(emb, pixels), emb(pixels))


@pytest.mark.parametrize("dense_prefix", [True, False])
def test_engine_unmasked_prefix_for_full_batches(tiny, monkeypatch, dense_prefix) -> None:
    """A batch with every prompt token valid after trimming (16 of bucket 16) and every camera
    present runs the prefix's attention with no mask (when `dense_prefix`); a padded batch or a
    missing camera on the same engine keeps the mask. Both match the eager engine."""
    from phyai_edge.engines import cudagraph

    base, eager = tiny
    monkeypatch.setattr(cudagraph, "DENSE_PREFIX_MIN_BATCH", 2)  # the tiny batch below
    calls = []
    real = fused_stacks.attention_unmasked
    monkeypatch.setattr(fused_stacks, "attention_unmasked", lambda *a: calls.append(1) or real(*a))
    # the reference path of the fused stages: the choice is the engine's, whatever runs the kernels
    fast = CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="float32", triton_ops="reference",
                           dense_prefix=dense_prefix)
    noise = torch.randn(2, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(7))
    layers = len(base.module.prefix_layers) - 1  # the last layer's attention is skipped
    for valid, masked_view, unmasked in (([16, 16], False, True), ([9, 16], False, False), ([16, 16], True, False)):
        calls.clear()
        inputs = _inputs(base, 2, 3, valid, masked_view=masked_view)
        out, ref = fast.run(inputs, noise=noise), eager.run(inputs, noise=noise)
        assert len(calls) == (layers if unmasked and dense_prefix else 0), (valid, masked_view)
        assert torch.isfinite(out).all()
        assert _rel(out, ref) < 1e-5, (valid, masked_view)
    calls.clear()
    one = _inputs(base, 1, 3, [16])  # below the batch threshold: masked
    assert _rel(fast.run(one, noise=noise[:1]), eager.run(one, noise=noise[:1])) < 1e-5
    assert calls == []


def test_prefix_stage_writes_given_kv_buffers(tiny) -> None:
    """`encode_prefix(dense=True, out=(keys, values))` writes the KV cache into the given buffers
    and returns them, with the values of a call that allocates its own; a buffer of the wrong
    shape is refused by name."""
    base, _ = tiny
    model = copy.deepcopy(base.module).eval().requires_grad_(False)
    stages = model.triton_stages("reference")
    x = _inputs(base, 2, 3, [16, 16]).tensors
    for keys_only in (True, False):  # the fused stack, and the model's own prefix as the fallback
        model.attend_keys_only = keys_only
        _check_prefix_out(model, stages, x)


def _check_prefix_out(model, stages, x) -> None:
    with torch.no_grad():
        feats = model.embed_images(x["images"])
        k, v, mask = stages["encode_prefix"](feats, x["image_mask"], x["tokens"], x["token_mask"], dense=True)
        kb, vb = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        k2, v2, mask2 = stages["encode_prefix"](feats, x["image_mask"], x["tokens"], x["token_mask"], dense=True,
                                                out=(kb, vb))
        assert k2 is kb and v2 is vb
        assert torch.equal(kb, k) and torch.equal(vb, v) and torch.equal(mask2, mask)
        with pytest.raises(ValueError, match="out keys"):
            stages["encode_prefix"](feats, x["image_mask"], x["tokens"], x["token_mask"], dense=True,
                                    out=(kb[:, :1], vb))


def test_unmasked_prefix_graph_body_fills_the_masked_graphs_cache(tiny, monkeypatch) -> None:
    """The unmasked prefix graph's body (run here without capture: CPU) leaves the masked graph's
    KV cache and mask holding what the unmasked prefix computes, in the same tensors the loop reads,
    also after a padded batch left its own mask there."""
    base, _ = tiny
    fast = CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="float32", triton_ops="reference")
    gs = fast._graph_set(2, 3, 16)
    gs.image_embeds = fast._vision(gs)
    gs.kv = tuple(t.clone() for t in fast._prefix(gs))  # the masked graph's outputs (its buffers)
    cache = gs.kv
    cache[0].fill_(float("nan"))
    cache[2][0, -1] = False  # an earlier padded batch's mask
    monkeypatch.setattr(fast, "_capture", lambda sets, fn: (fn(), None))
    fast._capture_dense_prefix(gs)
    k, v, mask = fast._prefix(gs, dense=True)
    assert gs.kv is cache and torch.equal(cache[0], k) and torch.equal(cache[1], v) and torch.equal(cache[2], mask)


def test_attention_unmasked_is_attention_with_a_full_mask() -> None:
    from phyai_edge.layers.attention import attention, attention_unmasked

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 7, 16, generator=g) for h in (4, 2, 2))
    full = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    assert _rel(attention_unmasked(q, k, v), attention(q, k, v, full)) < 1e-6
