"""Small-M Triton GEMMs (`layers/triton_gemm.py`) against their plain-torch references, the
dispatch rule, and their use in the action expert's stack and the cudagraph engine.

As in `test_triton_ops.py`: without a GPU the kernels run in Triton's CPU interpreter
(`conftest.py` sets `TRITON_INTERPRET=1` before anything imports triton); kernel tests skip where
triton is not installed. Shapes are small so the interpreter (numpy, one program at a time) keeps
the file to seconds; they are chosen to hit every mask: odd row counts (1, 7, 50, 100), K and N
that are not multiples of the blocks, rotary halves narrower than a column tile.

Tolerances. float32: the kernels sum in float32 in a different order than the reference's BLAS:
relative L2 1e-5. bf16: the kernels round once from float32 sums; the references round the GEMM
output to bf16 and then again after each elementwise op. Under the interpreter a float32 -> bf16
store rounds toward zero (a GPU rounds to nearest), so a plain GEMM's output is within
1 ulp (truncation) + 1/2 ulp (the reference's rounding) of the exact sum: elementwise
|out - ref| <= 2^-6 |ref| holds with margin (bf16 has 8 significant bits, ulp <= 2^-7 |x|). The
fused epilogues (GeGLU, RoPE) can cancel, so elementwise relative bounds do not hold there; they
are judged against float64 on the same bf16 inputs: no further from it than the reference is
(up to a factor for the truncating stores, see `_check_bf16`).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from test_cudagraph import _inputs, _rel, _rtc
from test_triton_ops import _blocks, _float32_truth, _stack_inputs, _stack_reference

from phyai_edge.adapters.base import SolverSpec
from phyai_edge.adapters.pi05 import builtin_adapter
from phyai_edge.engines.cudagraph import CudaGraphEngine
from phyai_edge.layers import fused_stacks, triton_dispatch, triton_ops
from phyai_edge.layers import triton_gemm as tg
from phyai_edge.layers.rotary import rope_cos_sin

KERNELS_RUN, WHY_NOT = triton_ops.triton_status("cuda" if torch.cuda.is_available() else "cpu")
kernels = pytest.mark.skipif(not KERNELS_RUN, reason=f"Triton kernels cannot run here: {WHY_NOT}")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
LAUNCHERS = ("_linear_triton", "_geglu_triton", "_qkv_rope_triton")


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _weight(n, k, dtype, seed):
    return _randn(n, k, dtype=dtype, seed=seed, scale=k**-0.5)  # outputs of order 1


@pytest.fixture
def poisoned(monkeypatch):
    """Kernel outputs and split-K partials start as NaN: any element a kernel fails to write shows up."""

    def empty(shape, dtype, device):
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(tg, "_empty", empty)


@pytest.fixture
def launches(monkeypatch):
    """Counts the kernel launches per op (and lets the ops run)."""
    counts = dict.fromkeys(LAUNCHERS, 0)
    for name in LAUNCHERS:
        real = getattr(tg, name)

        def counted(*args, _name=name, _real=real, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(tg, name, counted)
    return counts


@pytest.fixture
def no_kernels(monkeypatch):
    """Any kernel launch fails the test: the reference path must be taken."""
    for name in LAUNCHERS:
        monkeypatch.setattr(tg, name, lambda *a, _n=name: pytest.fail(f"{_n} launched; the reference was expected"))


def _f64(*tensors):
    return [t.double() if t is not None else None for t in tensors]


def _check_f32(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "output not fully written (NaN poison left)"
    assert _rel(out, ref) < 1e-5


def _check_bf16(out, ref, truth):
    """`truth`: float64 on the same bf16 inputs. The kernel rounds once; under the interpreter that
    rounding truncates, whose RMS error (ulp / sqrt(3)) is twice a rounding to nearest's
    (ulp / sqrt(12)), and measured here the kernel sits 1.6-2.0x further from float64 than the
    reference does (the reference's later roundings partly average out). 2.5x is that with margin;
    a wrong epilogue (a swapped half, a missing bias, another row's cos) is off by O(1), not O(ulp)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "output not fully written (NaN poison left)"
    err, ref_err = _rel(out.double(), truth), _rel(ref.double(), truth)
    assert err < 2.5 * ref_err + 1e-4, (err, ref_err)
    assert _rel(out.float(), ref.float()) < 1e-2


# -- linear ------------------------------------------------------------------------------------------
# (batch, tokens, K, N): rows = batch x tokens in 1, 7, 50, 100
LINEAR_SHAPES = [(1, 1, 64, 48), (1, 7, 100, 70), (1, 50, 96, 128), (2, 50, 40, 24)]
SPLIT_CONFIGS = {
    "default": None,
    "narrow": tg.GemmConfig(16, 16, 32),  # many programs, K in 3-4 blocks with a ragged last one
    "split3": tg.GemmConfig(32, 32, 16, split_k=3),  # K split 3 ways (ragged last split when K % 16)
    "split8": tg.GemmConfig(64, 64, 32, split_k=8),  # more splits than K blocks: fewer splits
}


@kernels
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", list(SPLIT_CONFIGS))
def test_linear_kernel(poisoned, launches, shape, dtype, config) -> None:
    b, t, k, n = shape
    h, w = _randn(b, t, k, dtype=dtype, seed=1), _weight(n, k, dtype, seed=2)
    out = tg.linear(h, w, "triton", config=SPLIT_CONFIGS[config])
    ref = tg.linear_ref(h, w)
    assert launches["_linear_triton"] == 1
    if dtype == torch.float32:
        _check_f32(out, ref)
        return
    assert out.shape == ref.shape and out.dtype == ref.dtype and torch.isfinite(out).all()
    # elementwise: within 2^-6 |ref| (module docstring), plus a floor for sums that cancel to ~0
    assert ((out.float() - ref.float()).abs() <= 2**-6 * ref.float().abs() + 2e-3).all()
    truth = F.linear(*_f64(h, w))
    # one truncation (RMS error ulp / sqrt(3)) against one rounding to nearest (ulp / sqrt(12)): 2x expected
    assert _rel(out.double(), truth) < 2.5 * _rel(ref.double(), truth) + 1e-4


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", ["default", "split3"])
def test_linear_bias_and_strides(poisoned, dtype, config) -> None:
    """A bias (added once, after the split-K sum) and a non-contiguous activation (a column slice)."""
    h = _randn(3, 5, 90, dtype=dtype, seed=3)[..., :77]
    w, bias = _weight(50, 77, dtype, seed=4), _randn(50, dtype=dtype, seed=5)
    out, ref = tg.linear(h, w, "triton", bias=bias, config=SPLIT_CONFIGS[config]), tg.linear_ref(h, w, bias)
    if dtype == torch.float32:
        _check_f32(out, ref)
    else:
        _check_bf16(out, ref, F.linear(*_f64(h, w, bias)))


@kernels
def test_linear_split_k_reduces_partials(monkeypatch) -> None:
    """split_k really splits: the partial buffer holds split_k float32 slices that sum to the result."""
    seen = []
    real = tg._empty

    def spy(shape, dtype, device):
        t = real(shape, dtype, device)
        seen.append(t)
        return t

    monkeypatch.setattr(tg, "_empty", spy)
    h, w = _randn(7, 96, seed=6), _weight(40, 96, torch.float32, seed=7)
    out = tg.linear(h, w, "triton", config=tg.GemmConfig(16, 16, 16, split_k=3))
    assert [tuple(t.shape) for t in seen] == [(7, 40), (3, 7, 40)]  # the output, then the partials
    part = seen[1]
    assert part.dtype == torch.float32
    assert torch.allclose(part.sum(0), out, atol=1e-6)
    assert (part[0] - part[1]).abs().max() > 1e-3  # different K ranges, not one sum three times


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_deferred_split_sums_fold_into_the_residual_norm(poisoned, dtype) -> None:
    """`linear(defer_sum=True)` hands back the unreduced partials; `residual_ada_rms_norm` adds them
    in its own kernel and gives the same bits as the reducing kernel followed by the norm, on the
    kernel path and on the reference path. Without a split (or with a bias) it is the tensor."""
    b, t, k, n = 2, 5, 96, 40
    h, w = _randn(b, t, k, dtype=dtype, seed=21), _weight(n, k, dtype, seed=22)
    split = tg.GemmConfig(16, 16, 16, split_k=3)
    deferred = tg.linear(h, w, "triton", config=split, defer_sum=True)
    assert isinstance(deferred, triton_ops.SplitSums) and deferred.parts.shape == (3, b * t, n)
    reduced = tg.linear(h, w, "triton", config=split)
    # torch rounds to nearest; the interpreter's bf16 store truncates (a GPU's rounds): one ulp apart.
    assert torch.allclose(deferred.total().float(), reduced.float(), rtol=2**-7 if dtype == torch.bfloat16 else 0,
                          atol=0)
    x = _randn(b, t, n, dtype=dtype, seed=23)
    gate, scale, shift = (_randn(b, 1, n, dtype=dtype, seed=s) for s in (24, 25, 26))
    got = triton_ops.residual_ada_rms_norm(x, deferred, gate, scale, shift, 1e-6, "triton")
    want = triton_ops.residual_ada_rms_norm(x, reduced, gate, scale, shift, 1e-6, "triton")
    assert all(torch.equal(g, w_) for g, w_ in zip(got, want, strict=True))  # the same rounding, in-kernel
    got = triton_ops.residual_ada_rms_norm(x, deferred, gate, scale, shift, 1e-6, "reference")
    want = triton_ops.residual_ada_rms_norm_ref(x, deferred.total(), gate, scale, shift, 1e-6)
    assert all(torch.equal(g, w_) for g, w_ in zip(got, want, strict=True))
    plain = tg.linear(h, w, "triton", config=tg.GemmConfig(16, 16, 16), defer_sum=True)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, tg.linear(h, w, "triton", config=tg.GemmConfig(16, 16, 16)))
    biased = tg.linear(h, w, "triton", bias=_randn(n, dtype=dtype, seed=27), config=split, defer_sum=True)
    assert isinstance(biased, torch.Tensor)


def test_split_sums_of_another_dtype_are_added_first() -> None:
    """A residual in another dtype than the GEMM's output: the sums are rounded to the GEMM's dtype
    first (`total`), as the unfused path would, never to the residual's."""
    parts = torch.randn(3, 4, 8)
    sums = triton_ops.SplitSums(parts, (1, 4, 8), torch.bfloat16)
    x = torch.randn(1, 4, 8)
    g, sc, sh = torch.rand(1, 1, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    got = triton_ops.residual_ada_rms_norm(x, sums, g, sc, sh, 1e-6, "reference")
    want = triton_ops.residual_ada_rms_norm(x, sums.total(), g, sc, sh, 1e-6, "reference")
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


# -- gate/up + GeGLU ------------------------------------------------------------------------------------
GEGLU_SHAPES = [(1, 1, 64, 32), (1, 7, 100, 40), (1, 50, 96, 64), (2, 50, 48, 20)]  # (b, t, K, H)


@kernels
@pytest.mark.parametrize("shape", GEGLU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
# split3: K in 3 splits (ragged last split when K % 16), the tiles' last splits adding the partials
@pytest.mark.parametrize("config", [None, tg.GemmConfig(16, 16, 32), tg.GemmConfig(64, 32, 64),
                                    tg.GemmConfig(16, 16, 16, split_k=3)],
                         ids=["default", "narrow", "wide", "split3"])
def test_linear_geglu_kernel(poisoned, launches, shape, dtype, config) -> None:
    b, t, k, hidden = shape
    h, w = _randn(b, t, k, dtype=dtype, seed=8, scale=1.5), _weight(2 * hidden, k, dtype, seed=9)
    out, ref = tg.linear_geglu(h, w, "triton", config=config), tg.linear_geglu_ref(h, w)
    assert launches["_geglu_triton"] == 1 and out.shape == (b, t, hidden)
    if dtype == torch.float32:
        _check_f32(out, ref)
    else:
        _check_bf16(out, ref, tg.linear_geglu_ref(*_f64(h, w)))


@kernels
def test_linear_geglu_bias_and_halves(poisoned) -> None:
    """The bias's gate and up halves land on the gate and up sums (a swap would be caught:
    gelu(g) * u is not symmetric)."""
    h, w = _randn(2, 7, 40, seed=10), _weight(2 * 24, 40, torch.float32, seed=11)
    bias = _randn(48, seed=12)
    _check_f32(tg.linear_geglu(h, w, "triton", bias=bias), tg.linear_geglu_ref(h, w, bias))
    swapped = torch.cat([w[24:], w[:24]])
    assert _rel(tg.linear_geglu(h, swapped, "triton"), tg.linear_geglu_ref(h, w)) > 0.1


# -- QKV + RoPE ----------------------------------------------------------------------------------------
QKV_CASES = [  # (batch, tokens, heads, kv heads, head dim, K), cos/sin per sample or shared
    ((1, 50, 8, 1, 32, 64), "per-sample"),  # the expert's head layout, narrower
    ((2, 7, 2, 1, 16, 32), "per-sample"),  # the tiny preset: half = 8 < the 16-column tile
    ((2, 7, 2, 1, 16, 32), "shared"),  # one cos/sin table broadcast over the batch
    ((2, 50, 3, 3, 24, 40), "per-sample"),  # half = 12: not a power of two
    ((1, 100, 4, 2, 10, 48), "shared"),
    ((1, 1, 2, 1, 64, 100), "per-sample"),  # one row; K not a multiple of the block
]


def _rope_inputs(b, t, d, dtype, layout):
    positions = torch.arange(t)[None, :] + torch.tensor([[37], [5], [0]])[:b] * 3
    if layout == "shared":
        positions = positions[:1]
    return rope_cos_sin(positions.to(DEVICE), d, 10000.0, dtype)


@kernels
@pytest.mark.parametrize(("shape", "layout"), QKV_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [None, tg.GemmConfig(16, 16, 32), tg.GemmConfig(32, 32, 64),
                                    tg.GemmConfig(16, 16, 16, split_k=3)],
                         ids=["default", "narrow", "wide", "split3"])
def test_linear_qkv_rope_kernel(poisoned, launches, shape, layout, dtype, config) -> None:
    b, t, hq, hkv, d, k = shape
    h, w = _randn(b, t, k, dtype=dtype, seed=13), _weight((hq + 2 * hkv) * d, k, dtype, seed=14)
    cos, sin = _rope_inputs(b, t, d, dtype, layout)
    out = tg.linear_qkv_rope(h, w, cos, sin, hq, hkv, d, "triton", config=config)
    ref = tg.linear_qkv_rope_ref(h, w, cos, sin, hq, hkv, d)
    assert launches["_qkv_rope_triton"] == 1
    truth = tg.linear_qkv_rope_ref(*_f64(h, w, cos, sin), hq, hkv, d)
    for got, want, exact in zip(out, ref, truth):
        assert got.is_contiguous()
        if dtype == torch.float32:
            _check_f32(got, want)
        else:
            _check_bf16(got, want, exact)


@kernels
def test_linear_qkv_rope_bias(poisoned) -> None:
    b, t, hq, hkv, d, k = 2, 7, 2, 1, 16, 24
    h, w = _randn(b, t, k, seed=15), _weight((hq + 2 * hkv) * d, k, torch.float32, seed=16)
    bias = _randn((hq + 2 * hkv) * d, seed=17)
    cos, sin = _rope_inputs(b, t, d, torch.float32, "per-sample")
    out = tg.linear_qkv_rope(h, w, cos, sin, hq, hkv, d, "triton", bias=bias)
    for got, want in zip(out, tg.linear_qkv_rope_ref(h, w, cos, sin, hq, hkv, d, bias)):
        _check_f32(got, want)


@kernels
@pytest.mark.parametrize("op", ["geglu", "qkv_rope"])
def test_paired_split_k_sums_partials_and_leaves_tickets_at_zero(monkeypatch, op) -> None:
    """split_k really splits for the paired-column kernels: the partial buffer holds split_k float32
    slices whose sum, finished by the epilogue, is the output; one ticket per tile, all back at zero
    after the call (the next call, or the next replay of a graph, reuses them); and the splits' sum
    matches the unsplit kernel's to float32 rounding."""
    seen = []
    real = tg._empty

    def spy(shape, dtype, device):
        t = real(shape, dtype, device)
        if dtype == torch.float32 and len(shape) == 3 and shape[0] == 3:  # (splits, rows, width): the partials
            seen.append(t)
        return t

    monkeypatch.setattr(tg, "_empty", spy)
    tickets = triton_dispatch.Tickets(torch.device(DEVICE))
    split = tg.GemmConfig(16, 16, 16, split_k=3)
    if op == "geglu":
        h, w = _randn(1, 7, 48, seed=30), _weight(2 * 20, 48, torch.float32, seed=31)
        out = tg.linear_geglu(h, w, "triton", config=split, tickets=tickets)
        whole = tg.linear_geglu(h, w, "triton", config=tg.GemmConfig(16, 16, 16))
        _check_f32(out, tg.linear_geglu_ref(h, w))
        hidden = 20
        sums = seen[0].sum(0)
        assert _rel(tg.geglu_ref(sums).view_as(out), out) < 1e-5
        assert _rel(out, whole) < 1e-6
        tiles = 2 * 1  # H 20 in 16-column tiles, one row tile
        assert seen[0].shape == (3, 7, 2 * hidden)
    else:
        b, t, hq, hkv, d, k = 2, 7, 2, 1, 16, 48
        h, w = _randn(b, t, k, seed=32), _weight((hq + 2 * hkv) * d, k, torch.float32, seed=33)
        cos, sin = _rope_inputs(b, t, d, torch.float32, "per-sample")
        out = tg.linear_qkv_rope(h, w, cos, sin, hq, hkv, d, "triton", config=split, tickets=tickets)
        whole = tg.linear_qkv_rope(h, w, cos, sin, hq, hkv, d, "triton", config=tg.GemmConfig(16, 16, 16))
        for got, want, one in zip(out, tg.linear_qkv_rope_ref(h, w, cos, sin, hq, hkv, d), whole):
            _check_f32(got, want)
            assert _rel(got, one) < 1e-6
        sums = seen[0].sum(0).view(b, t, -1)
        for got, want in zip(out, triton_ops.qkv_rope_ref(sums, cos, sin, hq, hkv, d)):
            assert _rel(got, want) < 1e-5
        tiles = (hq + 2 * hkv) * 1  # half 8 in one 16-column tile per head, one row tile
        assert seen[0].shape == (3, b * t, (hq + 2 * hkv) * d)
    assert tickets._used == tiles and int(tickets._buf.abs().sum()) == 0


# -- dispatch ------------------------------------------------------------------------------------------
def test_takes_rule() -> None:
    w = torch.zeros(64, 32, dtype=torch.bfloat16)
    assert tg.takes(50, w) and tg.takes(tg.MAX_ROWS, w) and tg.takes(1, w.half())
    assert not tg.takes(tg.MAX_ROWS + 1, w)  # compute-bound: cuBLAS
    assert not tg.takes(0, w)
    assert not tg.takes(50, w.float())  # float32 is not routed to the kernels
    assert not tg.takes(50, w[None])  # not 2-D
    lin = torch.nn.Linear(32, 64, bias=False).to(torch.bfloat16)
    h = torch.zeros(2, 25, 32, dtype=torch.bfloat16)
    assert tg.module_takes(lin, h)
    assert not tg.module_takes(lin, h.float())  # dtypes differ: the module's forward decides
    assert not tg.module_takes(lin, torch.zeros(2, tg.MAX_ROWS, 32, dtype=torch.bfloat16))
    assert not tg.module_takes(None, h)
    assert not tg.module_takes(lin, torch.zeros(2, 3, 0, dtype=torch.bfloat16))
    assert not tg.module_takes(torch.nn.Identity(), h)


def test_module_takes_leaves_fp8_alone() -> None:
    from phyai_edge.layers.fp8 import Fp8Linear

    lin = torch.nn.Linear(32, 64, bias=False).to(torch.bfloat16)
    fp8 = Fp8Linear(lin)
    assert isinstance(fp8, torch.nn.Linear) and fp8.weight.dtype == torch.bfloat16  # would pass a naive check
    assert not tg.module_takes(fp8, torch.zeros(1, 50, 32, dtype=torch.bfloat16))


def test_shape_classes_have_configs() -> None:
    assert tg.shape_class("linear", 50, 1024) == "linear/m64/narrow"  # o_proj / down at batch 1
    assert tg.shape_class("linear", 400, 4096) == "linear/m1024/wide"
    assert tg.shape_class("geglu", 1600, 4096) == "geglu/mbig"
    assert tg.shape_class("qkv_rope", 1, 2560) == "qkv_rope/m16"
    for op in tg.OPS:
        for rows in (1, 16, 17, 64, 65, 256, 257, 1024, 1025):
            for n in (1024, 4096):
                assert isinstance(tg.default_config(op, rows, n), tg.GemmConfig)
    with pytest.raises(ValueError, match="op"):
        tg.shape_class("conv", 1, 1)
    with pytest.raises(ValueError, match="power of two"):
        tg.GemmConfig(24, 32, 32)
    with pytest.raises(ValueError, match="split_k"):
        tg.GemmConfig(16, 16, 16, split_k=0)


@kernels
@pytest.mark.parametrize("op", ["linear", "geglu", "qkv_rope"])
def test_grad_inputs_take_the_reference(no_kernels, unfused_vjp, op) -> None:
    """Exact RTC guidance differentiates through the step: with `set_fused_vjp_forward(False)` such a
    call takes the reference (cuBLAS and the elementwise ops' own kernels)."""
    h = _randn(1, 7, 32, seed=18).requires_grad_(True)
    cos, sin = _rope_inputs(1, 7, 16, torch.float32, "shared")
    w = {"linear": _weight(24, 32, torch.float32, 19), "geglu": _weight(48, 32, torch.float32, 19),
         "qkv_rope": _weight(64, 32, torch.float32, 19)}[op]
    if op == "linear":
        out = tg.linear(h, w, "triton")
    elif op == "geglu":
        out = tg.linear_geglu(h, w, "triton")
    else:
        out = tg.linear_qkv_rope(h, w, cos, sin, 2, 1, 16, "triton")[0]
    out.sum().backward()
    assert h.grad is not None and h.grad.abs().sum() > 0


# -- exact guidance's forward on the fused kernels (`set_fused_vjp_forward`, on by default) -------------
@pytest.fixture
def unfused_vjp():
    before = tg.set_fused_vjp_forward(False)
    yield
    tg.set_fused_vjp_forward(before)


@pytest.fixture
def fused_vjp():
    """On, as by default (pinned: a test elsewhere may not have put a switch back)."""
    before = tg.set_fused_vjp_forward(True)
    yield
    tg.set_fused_vjp_forward(before)


def _f64_grad(fn, h, cots):
    """d <fn(h), cots> / dh in float64 (fn on float64 copies of its inputs)."""
    leaf = h.double().requires_grad_(True)
    outs = fn(leaf)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return torch.autograd.grad(outs, leaf, [c.double() for c in cots])[0]


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["shared", "per_sample"])
def test_linear_qkv_rope_grad_on_the_fused_kernel(poisoned, fused_vjp, launches, dtype, layout) -> None:
    """By default QKV + RoPE needing h's gradient runs its fused kernel (the same bits as
    without a gradient); its backward is RoPE's rotation back and one GEMM. Against float64 autograd
    through the reference."""
    b, t, k, heads, kv_heads, d = 2, 7, 40, 2, 1, 16
    h, w = _randn(b, t, k, dtype=dtype, seed=35), _weight((heads + 2 * kv_heads) * d, k, dtype, 36)
    cos, sin = _rope_inputs(b, t, d, dtype, layout)
    cots = [_randn(b, hh, t, d, dtype=dtype, seed=37 + i) for i, hh in enumerate((heads, kv_heads, kv_heads))]
    leaf = h.clone().requires_grad_(True)
    outs = tg.linear_qkv_rope(leaf, w, cos, sin, heads, kv_heads, d, "triton")
    assert type(outs[0].grad_fn).__name__ == "LinearQkvRopeFnBackward"
    for got, plain in zip(outs, tg.linear_qkv_rope(h, w, cos, sin, heads, kv_heads, d, "triton")):
        assert torch.equal(got.detach(), plain)
    (dh,) = torch.autograd.grad(outs, leaf, cots)
    truth = _f64_grad(lambda x: tg.linear_qkv_rope_ref(x, w.double(), cos.double(), sin.double(), heads, kv_heads,
                                                      d), h, cots)
    assert dh.dtype == dtype and torch.isfinite(dh).all()
    assert _rel(dh.double(), truth) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert launches == {"_linear_triton": 0, "_geglu_triton": 0, "_qkv_rope_triton": 2}


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [None, tg.GemmConfig(16, 16, 16, split_k=3)], ids=["default", "split3"])
def test_linear_geglu_grad_on_the_fused_kernel(poisoned, fused_vjp, launches, dtype, config) -> None:
    """Gate/up + GeGLU needing h's gradient runs its fused kernel, which also stores the gate/up sums
    for GeGLU's gradient (split K too: the tile's last split stores them); the output the same bits
    as without a gradient. Against float64 autograd through the reference."""
    h, w = _randn(1, 50, 40, dtype=dtype, seed=41), _weight(2 * 24, 40, dtype, 42)
    cot = _randn(1, 50, 24, dtype=dtype, seed=43)
    leaf = h.clone().requires_grad_(True)
    out = tg.linear_geglu(leaf, w, "triton", config=config)
    assert type(out.grad_fn).__name__ == "LinearGegluFnBackward"
    assert torch.equal(out.detach(), tg.linear_geglu(h, w, "triton", config=config))
    (dh,) = torch.autograd.grad(out, leaf, cot)
    truth = _f64_grad(lambda x: tg.linear_geglu_ref(x, w.double()), h, [cot])
    assert dh.dtype == dtype and torch.isfinite(dh).all()
    assert _rel(dh.double(), truth) < (1e-5 if dtype == torch.float32 else 2e-2)
    assert launches == {"_linear_triton": 0, "_geglu_triton": 2, "_qkv_rope_triton": 0}


@kernels
def test_grad_calls_the_fused_kernels_do_not_take(no_kernels, fused_vjp) -> None:
    """A plain linear needing a gradient stays on cuBLAS (the kernel would add a
    reducing kernel where it splits K), and so does a call whose weight needs a gradient."""
    h = _randn(1, 7, 32, seed=44).requires_grad_(True)
    assert tg.linear(h, _weight(24, 32, torch.float32, 45), "triton").grad_fn is not None
    w = _weight(48, 32, torch.float32, 46).requires_grad_(True)
    assert "LinearGeglu" not in type(tg.linear_geglu(h, w, "triton").grad_fn).__name__


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_stack_vjp_on_the_fused_kernels(poisoned, launches, float32_routed, fused_vjp, dtype) -> None:
    """The expert stack's input gradient (exact guidance's VJP) with QKV + RoPE and gate/up + GeGLU on
    their fused kernels, o_proj and down on cuBLAS, against autograd through the reference path."""
    blocks = _blocks(dtype)
    for blk in blocks:  # constants, as the engine's (it fuses after freezing; `_blocks` fuses first)
        blk.self_attn.qkv_proj.requires_grad_(False)
        blk.mlp.gate_up.requires_grad_(False)
    x, *rest = _stack_inputs(blocks, dtype)
    cot = _randn(*x.shape, dtype=dtype, seed=40)

    def grad(backend, gemm, blocks=blocks, x=x, rest=rest):
        leaf = x.clone().requires_grad_(True)
        out = fused_stacks.adaptive_block_stack(blocks, leaf, *rest, 1e-6, backend=backend, gemm_backend=gemm)
        return torch.autograd.grad(out, leaf, cot.to(x.dtype))[0]

    got = grad("triton", "triton")
    n = len(blocks)
    assert launches == {"_linear_triton": 0, "_geglu_triton": n, "_qkv_rope_triton": n}
    assert torch.isfinite(got).all()
    if dtype == torch.float32:
        assert _rel(got, grad("reference", None)) < 1e-5
        return
    # bf16 through three blocks: against the float32 gradient, with test_triton_grad's stack bound
    # (on a GPU the bf16 reference path is itself ~1e-1 from it, so not against that)
    truth = _float32_truth_blocks(blocks)
    f32 = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in (x, *rest[:5])]
    assert _rel(got.float(), grad("reference", None, truth, f32[0], [*f32[1:], *rest[5:]])) < 6e-2


def _float32_truth_blocks(blocks):
    out = [copy.deepcopy(b).float() for b in blocks]
    for b in out:
        b.self_attn.fuse()
        b.mlp.fuse()
    return out


@kernels
def test_engine_exact_guidance_on_the_fused_kernels(tiny, launches, float32_routed, fused_vjp) -> None:
    """The engine's exact RTC mode with QKV + RoPE and gate/up + GeGLU on their fused kernels gives
    eager's chunk (fp32)."""
    from phyai_edge.engines.eager import EagerEngine

    fast = CudaGraphEngine(copy.deepcopy(tiny), device=DEVICE, dtype="float32", triton_ops=True, triton_gemm=True)
    eager = EagerEngine(copy.deepcopy(tiny), device="cpu", dtype="float32")
    inputs = _inputs(tiny, 1, 1, [20])
    noise = torch.randn(1, tiny.chunk_size, tiny.model_action_dim, generator=torch.Generator().manual_seed(9))
    rtc = _rtc(tiny, 1, "guided")
    out = fast.run(inputs, noise=noise, rtc=rtc)
    calls = tiny.cfg.expert.depth * tiny.solver.num_steps
    assert launches["_qkv_rope_triton"] >= calls and launches["_geglu_triton"] >= calls
    assert _rel(out.cpu(), eager.run(inputs, noise=noise, rtc=rtc).cpu()) < 1e-5


@kernels
def test_unsupported_inputs_take_the_reference(no_kernels) -> None:
    h64 = _randn(1, 7, 32, dtype=torch.float64, seed=20)
    w64 = _randn(24, 32, dtype=torch.float64, seed=21)
    assert torch.equal(tg.linear(h64, w64, "triton"), F.linear(h64, w64))  # float64: no kernel
    h2 = _randn(7, 32, seed=22)
    cos, sin = _rope_inputs(1, 7, 16, torch.float32, "shared")
    w = _weight(64, 32, torch.float32, 23)
    q = tg.linear_qkv_rope(h2[None], w, cos, sin, 2, 1, 16, "reference")[0]  # the default: reference
    assert q.shape == (1, 2, 7, 16)
    with pytest.raises(ValueError, match=r"h \(B, T, K\)"):  # no token axis for RoPE
        tg.linear_qkv_rope(h2, w, cos, sin, 2, 1, 16, "triton")


def test_argument_checks() -> None:
    h = torch.zeros(1, 3, 32, device=DEVICE)
    cos = sin = torch.zeros(1, 1, 3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="even head_dim"):
        tg.linear_qkv_rope(h, torch.zeros(60, 32, device=DEVICE), cos, sin, 2, 1, 15)
    with pytest.raises(ValueError, match="qkv weight rows"):
        tg.linear_qkv_rope(h, torch.zeros(48, 32, device=DEVICE), cos, sin, 2, 1, 16)
    with pytest.raises(ValueError, match="odd row count"):
        tg.linear_geglu(h, torch.zeros(63, 32, device=DEVICE))


# -- the expert's stack ----------------------------------------------------------------------------------
@pytest.fixture
def float32_routed(monkeypatch):
    """Route float32 weights to the kernels too, for a tight check of the stack's wiring."""
    monkeypatch.setattr(tg, "TAKES_DTYPES", (torch.float32, torch.bfloat16, torch.float16))


@kernels
def test_block_stack_gemm_fp32(poisoned, launches, float32_routed) -> None:
    blocks = _blocks(torch.float32)
    args = _stack_inputs(blocks, torch.float32)
    with torch.no_grad():
        out = fused_stacks.adaptive_block_stack(blocks, *args, 1e-6, backend="triton", gemm_backend="triton")
        ref = _stack_reference(blocks, *args)
    n = len(blocks)
    assert launches == {"_linear_triton": 2 * n, "_geglu_triton": n, "_qkv_rope_triton": n}
    _check_f32(out, ref)


@kernels
def test_block_stack_gemm_bf16(poisoned, launches) -> None:
    blocks = _blocks(torch.bfloat16)
    args = _stack_inputs(blocks, torch.bfloat16)
    with torch.no_grad():
        out = fused_stacks.adaptive_block_stack(blocks, *args, 1e-6, backend="triton", gemm_backend="triton")
        plain = fused_stacks.adaptive_block_stack(blocks, *args, 1e-6, backend="triton")
        ref = _stack_reference(blocks, *args)
    assert launches["_qkv_rope_triton"] == len(blocks) and launches["_linear_triton"] == 2 * len(blocks)
    # bf16 through three blocks: judged against the same blocks in float32, as test_triton_ops does
    truth = _float32_truth(blocks, args)
    assert torch.isfinite(out).all()
    err, ref_err, plain_err = _rel(out.float(), truth), _rel(ref.float(), truth), _rel(plain.float(), truth)
    assert err < 2e-2 and err < 1.5 * max(ref_err, plain_err), (err, ref_err, plain_err)


def test_block_stack_gemm_reference_path() -> None:
    """gemm_backend="reference" runs the same stack on F.linear + the reference ops (no triton needed)."""
    blocks = _blocks(torch.bfloat16)
    args = _stack_inputs(blocks, torch.bfloat16)
    with torch.no_grad():
        out = fused_stacks.adaptive_block_stack(blocks, *args, 1e-6, backend="reference", gemm_backend="reference")
        ref = fused_stacks.adaptive_block_stack(blocks, *args, 1e-6, backend="reference")
    assert torch.equal(out, ref)


@kernels
def test_block_stack_gemm_skips_unfused_and_fp8(launches) -> None:
    """Unfused projections and fp8 linears keep their modules; only what module_takes runs the GEMMs."""
    from phyai_edge.layers.fp8 import convert_fp8

    blocks = _blocks(torch.bfloat16, fuse=False)
    args = _stack_inputs(blocks, torch.bfloat16)
    with torch.no_grad():
        fused_stacks.adaptive_block_stack(blocks, *args, 1e-6, backend="triton", gemm_backend="triton")
    # no fused QKV / gate-up: those (and an unfused MLP's down) keep the module path; o_proj takes the GEMM
    assert launches == {"_linear_triton": len(blocks), "_geglu_triton": 0, "_qkv_rope_triton": 0}
    fused = _blocks(torch.bfloat16)
    holder = torch.nn.ModuleDict({"expert_layers": torch.nn.ModuleList(fused)})
    assert convert_fp8(holder, "expert") > 0
    launches.update(dict.fromkeys(launches, 0))
    with torch.no_grad():
        out = fused_stacks.adaptive_block_stack(fused, *args, 1e-6, backend="triton", gemm_backend="triton")
    assert launches == dict.fromkeys(LAUNCHERS, 0) and torch.isfinite(out).all()


# -- the PI0.5 denoise stage and the engine ------------------------------------------------------------------
def _tiny_model(dtype):
    from phyai_edge.layers.fused import fuse_projections

    model = copy.deepcopy(builtin_adapter("tiny", seed=4).module).to(DEVICE).set_precision(dtype)
    model.eval().requires_grad_(False)
    model.attend_keys_only = True
    fuse_projections(model)
    return model


def _denoise_args(model, b=2, p=20):
    cfg = model.cfg
    g = torch.Generator().manual_seed(41)
    e = cfg.expert
    x_t = torch.randn(b, cfg.chunk_size, cfg.max_action_dim, generator=g).to(DEVICE)
    t = torch.full((b,), 0.7, device=DEVICE)
    shape = (e.depth, b, e.num_kv_heads, p, e.head_dim)
    k_cache = (torch.randn(*shape, generator=g) * 0.5).to(DEVICE, model.compute_dtype)
    v_cache = torch.randn(*shape, generator=g).to(DEVICE, model.compute_dtype)
    prefix_mask = torch.ones(b, p, dtype=torch.bool, device=DEVICE)
    prefix_mask[-1, p - 6:] = False
    return x_t, t, k_cache, v_cache, prefix_mask


@kernels
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_denoise_stage_tiny_preset(poisoned, launches, float32_routed, dtype, batch) -> None:
    """`PI05Model.triton_stages(gemm=True)["denoise_step"]` on the tiny preset (expert width 32,
    2 + 1 heads of 16, MLP 64; batch x 50 rows) against the model's own `denoise_step`: batch 1's
    50 rows take the kernels, batch 2's 100 rows (over MAX_ROWS) the modules."""
    model = _tiny_model(dtype)
    args = _denoise_args(model, b=batch)
    with torch.no_grad():
        out = model.triton_stages("triton", gemm=True)["denoise_step"](*args)
        ref = model.denoise_step(*args)
    depth = model.cfg.expert.depth
    n = depth if batch * model.cfg.chunk_size <= tg.MAX_ROWS else 0
    assert launches == {"_linear_triton": 2 * n, "_geglu_triton": n, "_qkv_rope_triton": n}
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=kernels)])
def test_denoise_stage_context_is_the_same_function(backend) -> None:
    """The fused denoise step given the chunk's shared context (`step_context`, made once a chunk)
    returns exactly what it returns making that context itself."""
    model = _tiny_model(torch.bfloat16)
    args = _denoise_args(model, b=2)
    stages = model.triton_stages(backend, gemm=True)
    with torch.no_grad():
        context = stages["step_context"](args[-1])
        shared = [stages["denoise_step"](*args, context=context) for _ in range(2)]
        own = stages["denoise_step"](*args)
    assert torch.equal(shared[0], own) and torch.equal(shared[1], own)


@pytest.fixture(scope="module")
def tiny():
    base = builtin_adapter("tiny", seed=3)
    if KERNELS_RUN and not torch.cuda.is_available():
        base.solver = SolverSpec(3)  # the interpreter runs each program in numpy: keep it short
    return base


@kernels
def test_engine_triton_gemm_bf16(tiny, launches, monkeypatch) -> None:
    """The engine option end to end (bf16: the dtype `takes` routes): the engine asks the model for
    its Triton stages with `gemm=True`, and a chunk matches eager within the bf16 engine's bound.
    Only the denoise stage is taken from `triton_stages` here: the vision and prefix Triton paths
    (covered by test_triton_ops) take ~30 s under the interpreter and involve no GEMM kernel."""
    from phyai_edge.adapters.pi05.model import PI05Model
    from phyai_edge.engines.eager import EagerEngine

    asked, contexts = [], []
    real = PI05Model.triton_stages

    def denoise_only(self, backend="auto", gemm=False):
        asked.append((backend, gemm))
        stages = real(self, backend, gemm=gemm)
        return {"denoise_step": stages["denoise_step"],
                "step_context": lambda *a: contexts.append(1) or stages["step_context"](*a)}

    monkeypatch.setattr(PI05Model, "triton_stages", denoise_only)
    fast = CudaGraphEngine(copy.deepcopy(tiny), device=DEVICE, dtype="bfloat16", triton_ops=True, triton_gemm=True)
    assert fast.triton_gemm and asked == [("auto", True)]
    inputs = _inputs(tiny, 1, 1, [20])
    noise = torch.randn(1, tiny.chunk_size, tiny.model_action_dim, generator=torch.Generator().manual_seed(9))
    out = fast.run(inputs, noise=noise)
    calls = tiny.cfg.expert.depth * tiny.solver.num_steps
    # On a GPU the loop also runs while its graph is warmed up and captured: a whole number of
    # loops, each launching every kernel once a block and step; the context once a loop.
    loops = launches["_qkv_rope_triton"] // calls
    assert loops >= 1 and launches == {"_linear_triton": 2 * calls * loops, "_geglu_triton": calls * loops,
                                       "_qkv_rope_triton": calls * loops}
    assert contexts == [1] * loops  # the steps' shared context, made once for the chunk's loop
    assert loops == 1 or torch.cuda.is_available()
    eager = EagerEngine(copy.deepcopy(tiny), device="cpu", dtype="float32")
    assert torch.isfinite(out).all()
    assert _rel(out.cpu(), eager.run(inputs, noise=noise).cpu()) < 3e-2  # test_cudagraph's bf16 bound


def test_engine_triton_gemm_validation(tiny) -> None:
    with pytest.raises(ValueError, match="triton_gemm"):
        CudaGraphEngine(copy.deepcopy(tiny), device="cpu", dtype="bfloat16", triton_ops=False, triton_gemm=True)
    eng = CudaGraphEngine(copy.deepcopy(tiny), device="cpu", dtype="float32", triton_ops=True)
    assert eng.triton_gemm is False  # the default turns it on only on a CUDA device


def test_bench_triton_gemm_option(capsys) -> None:
    """`phyai-edge bench --triton-gemm` reaches the engine and is reported; it is refused where it
    does not apply."""
    import json

    from phyai_edge.cli import main as cli

    assert cli(["bench", "--backend", "cudagraph", "--dtype", "bfloat16", "--triton-ops", "--triton-gemm",
                "--batch", "1", "--iters", "1", "--warmup", "0", "--steps", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["triton_gemm"] is True and res["triton_ops"] in ("triton", "reference")
    with pytest.raises(SystemExit) as exc:  # a usage error: exit 2, one line naming the flag
        cli(["bench", "--backend", "eager", "--triton-gemm", "--iters", "1"])
    assert exc.value.code == 2 and "phyai-edge bench: --triton-gemm" in capsys.readouterr().err


# -- large-M tile order and the GELU epilogue -------------------------------------------------------------
@kernels
@pytest.mark.parametrize("op", ["linear", "geglu", "qkv_rope", "gelu"])
def test_grouped_tile_order_covers_every_tile(poisoned, op) -> None:
    """group_m > 1 walks row tiles in groups (the last group partial: 5 row tiles in groups of 2)
    across several column tiles; every output element is still written once, with its own row's
    and column's sums (float32: tight against the reference)."""
    cfg = tg.GemmConfig(16, 16, 32, group_m=2)
    b, t, k = 2, 40, 48  # 80 rows: 5 tiles of 16
    h = _randn(b, t, k, seed=31)
    if op == "qkv_rope":
        hq, hkv, d = 2, 1, 32  # 4 heads x 1 tile of the 16-column half
        w = _weight((hq + 2 * hkv) * d, k, torch.float32, seed=32)
        cos, sin = _rope_inputs(b, t, d, torch.float32, "per-sample")
        out = tg.linear_qkv_rope(h, w, cos, sin, hq, hkv, d, "triton", config=cfg)
        for got, want in zip(out, tg.linear_qkv_rope_ref(h, w, cos, sin, hq, hkv, d)):
            _check_f32(got, want)
        return
    n = 72 if op != "geglu" else 2 * 40  # 5 column tiles (the last ragged)
    w, bias = _weight(n, k, torch.float32, seed=33), _randn(n, seed=34)
    fn, ref = {"linear": (tg.linear, tg.linear_ref), "geglu": (tg.linear_geglu, tg.linear_geglu_ref),
               "gelu": (tg.linear_gelu, tg.linear_gelu_ref)}[op]
    _check_f32(fn(h, w, "triton", bias=bias, config=cfg), ref(h, w, bias))


@kernels
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_gelu_kernel(poisoned, launches, shape, dtype) -> None:
    """SigLIP's fc1 + GELU (tanh) in one kernel, with its bias, against the GEMM then `bias_gelu`."""
    b, t, k, n = shape
    h, w = _randn(b, t, k, dtype=dtype, seed=35, scale=1.5), _weight(n, k, dtype, seed=36)
    bias = _randn(n, dtype=dtype, seed=37, scale=0.5)
    out, ref = tg.linear_gelu(h, w, "triton", bias=bias), tg.linear_gelu_ref(h, w, bias)
    assert launches["_linear_triton"] == 1 and out.shape == (b, t, n)
    if dtype == torch.float32:
        _check_f32(out, ref)
    else:
        _check_bf16(out, ref, tg.linear_gelu_ref(*_f64(h, w, bias)))
    with pytest.raises(ValueError, match="split_k"):
        tg.linear_gelu(h, w, "triton", bias=bias, config=tg.GemmConfig(16, 16, 16, split_k=2))


class _RefusesStages:
    """A kernel stand-in that, like Triton where a tiling's pipeline stages need more shared memory
    than the GPU has, raises `OutOfResources` at launch for more than `most` stages."""

    def __init__(self, kernel, most):
        self.kernel, self.most, self.refused = kernel, most, 0

    def __getitem__(self, grid):
        def launch(*args, **kw):
            if kw["num_stages"] > self.most:
                self.refused += 1
                raise triton_dispatch.OutOfResources(114688, 101376, "shared memory")
            return self.kernel[grid](*args, **kw)
        return launch


@kernels
@pytest.mark.parametrize("op", ["linear", "geglu", "qkv_rope"])
def test_tiling_with_too_many_stages_for_the_gpu_falls_back(monkeypatch, caplog, op):
    """Where the shape's tiling needs more shared memory than the GPU has, the same tiling runs with
    fewer pipeline stages (here: more than one refused), which gives the same bits, said once."""
    monkeypatch.setattr(triton_dispatch, "_DOES_NOT_FIT", set())
    h = _randn(1, 40, 64, seed=1)
    cos, sin = _rope_inputs(1, 40, 32, torch.float32, "shared")
    n = {"linear": 48, "geglu": 2 * 48, "qkv_rope": 4 * 32}[op]
    weight = _weight(n, 64, torch.float32, seed=2)
    kernel = {"linear": "_linear_kernel", "geglu": "_linear_geglu_kernel", "qkv_rope": "_linear_qkv_rope_kernel"}[op]

    def call(config=None):
        if op == "linear":
            return (tg.linear(h, weight, "triton", config=config),)
        if op == "geglu":
            return (tg.linear_geglu(h, weight, "triton", config=config),)
        return tg.linear_qkv_rope(h, weight, cos, sin, 2, 1, 32, "triton", config=config)

    chosen = tg.default_config({"linear": "linear", "geglu": "geglu", "qkv_rope": "qkv_rope"}[op], 40,
                               {"linear": n, "geglu": n // 2, "qkv_rope": n}[op])
    assert chosen.num_stages > 1
    want = call(replace(chosen, num_stages=1))
    refusing = _RefusesStages(getattr(tg, kernel), 1)
    monkeypatch.setattr(tg, kernel, refusing)
    with caplog.at_level("WARNING", logger="phyai_edge.layers.triton_dispatch"):
        got, again = call(), call()
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and all(torch.equal(g, w) for g, w in zip(again, want))
    assert refusing.refused == (2 if chosen.num_stages > 2 else 1)  # each refused tiling tried once, ever
    assert sum("does not fit this GPU" in r.getMessage() for r in caplog.records) == refusing.refused
