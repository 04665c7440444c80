"""TMA GEMMs (`layers/triton_gemm_tma.py`) against their references, under Triton's CPU
interpreter here (`conftest.py` sets `TRITON_INTERPRET=1`) and compiled on a Hopper GPU.

Shapes are small and chosen to hit every bound the descriptors clip: rows and columns that are
not multiples of the tiles, an H that is not a multiple of block_n (the gate tile past H reads up
rows, whose columns the store must drop), fewer persistent programs than tiles. bf16 / fp16 are
judged as `test_triton_gemm._check_bf16` judges the pointer-based kernels: against float64 on the
same inputs, no further from it than the reference (with the interpreter's truncating stores).
"""

from __future__ import annotations

import pytest
import torch
from test_triton_gemm import DEVICE, _check_bf16, _randn, _weight

from phyai_edge.layers import triton_gemm_tma as tma
from phyai_edge.layers import triton_ops
from phyai_edge.layers.mlp import gelu_tanh
from phyai_edge.layers.rotary import rope_cos_sin
from phyai_edge.layers.triton_gemm import linear_geglu_ref, linear_qkv_rope_ref, linear_ref
from phyai_edge.layers.triton_ops import qkv_rope_ref

KERNELS_RUN, WHY_NOT = triton_ops.triton_status(DEVICE)
kernels = pytest.mark.skipif(not (KERNELS_RUN and tma.available()), reason=f"TMA kernels cannot run here: {WHY_NOT}")
DTYPES = [torch.bfloat16, torch.float16]
CONFIGS = {
    "tiles": tma.TmaConfig(16, 16, 16, 4, 2, 2),  # one program a tile
    "persistent": tma.TmaConfig(16, 32, 16, 4, 2, 3, programs=3),  # 3 programs walk all tiles
    # one loop over (tile, k) and the output stored in two column halves
    "flat, halves": tma.TmaConfig(16, 32, 16, 4, 2, 3, programs=3, flatten=True, subtile=True),
    # the batch 5-19 prefix tiling's form (GEGLU_MID); the interpreter ignores the specialization
    "persistent, halves, warp-specialised": tma.TmaConfig(16, 32, 16, 4, 2, 3, programs=3, subtile=True,
                                                          warp_specialize=True),
}
# (rows, H or N, K): ragged rows and columns, K over 2-4 blocks with a ragged last one
SHAPES = [(37, 24, 40), (16, 32, 16), (50, 40, 72)]


def _truth_geglu(h, w):
    g, u = (h.double() @ w.double().T).chunk(2, dim=-1)
    return gelu_tanh(g) * u


@kernels
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_geglu(shape, dtype, config) -> None:
    m, hidden, k = shape
    h = _randn(m, k, dtype=dtype, seed=1)
    w = _weight(2 * hidden, k, dtype, seed=2)
    out = tma.linear_geglu(h, w, "triton", config=CONFIGS[config])
    _check_bf16(out, linear_geglu_ref(h, w), _truth_geglu(h, w))


@kernels
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear(shape, dtype, config) -> None:
    m, n, k = shape
    h = _randn(2, m, k, dtype=dtype, seed=3)  # (B, T, K): the leading dims come back
    w = _weight(n, k, dtype, seed=4)
    out = tma.linear(h, w, "triton", config=CONFIGS[config])
    assert out.shape == (2, m, n)
    _check_bf16(out, linear_ref(h, w), h.double() @ w.double().T)


def test_reference_backend_is_the_reference() -> None:
    h = _randn(5, 16, dtype=torch.bfloat16, seed=5)
    w = _weight(32, 16, torch.bfloat16, seed=6)
    assert torch.equal(tma.linear_geglu(h, w), linear_geglu_ref(h, w))


@kernels
@pytest.mark.parametrize(
    ("h_shape", "w_shape", "dtype", "bias", "match"),
    [
        ((4, 12), (16, 12), torch.bfloat16, False, "multiple of 8"),
        ((4, 16), (16, 24), torch.bfloat16, False, "K must match"),
        ((4, 16), (16, 16), torch.float32, False, "bf16 / fp16"),
        ((4, 16), (16, 16), torch.bfloat16, True, "no bias"),
        ((4, 16), (15, 16), torch.bfloat16, False, "even row count"),
    ],
)
def test_rejects_what_it_cannot_run(h_shape, w_shape, dtype, bias, match) -> None:
    h = _randn(*h_shape, dtype=dtype, seed=7)
    w = _weight(*w_shape, dtype, seed=8)
    b = torch.zeros(w_shape[0], dtype=dtype, device=DEVICE) if bias else None
    with pytest.raises(ValueError, match=match):
        tma.linear_geglu(h, w, "triton", bias=b)


def _truth_qkv_rope(h, w, cos, sin, heads, kv_heads, d):
    return qkv_rope_ref(h.double() @ w.double().T, cos.double(), sin.double(), heads, kv_heads, d)


# (batch, tokens, K, heads, kv heads, head_dim): 16-row tiles that span two samples, K ragged
QKV_SHAPES = [(2, 19, 40, 2, 1, 16), (3, 7, 24, 4, 2, 32), (1, 33, 16, 1, 1, 16)]
QKV_CONFIGS = {
    "tiles": tma.TmaConfig(16, 0, 16, 4, 2, 2),
    "persistent, flat": tma.TmaConfig(16, 0, 16, 4, 2, 3, programs=3, flatten=True),
    "persistent, warp-specialised": tma.TmaConfig(16, 0, 16, 4, 2, 3, programs=3, warp_specialize=True),
}


@kernels
@pytest.mark.parametrize("config", list(QKV_CONFIGS))
@pytest.mark.parametrize("shape", QKV_SHAPES)
@pytest.mark.parametrize("per_sample_cos", [True, False])
def test_linear_qkv_rope(shape, per_sample_cos, config) -> None:
    b, t, k, heads, kv_heads, d = shape
    dtype = torch.bfloat16
    h = _randn(b, t, k, dtype=dtype, seed=11)
    w = _weight((heads + 2 * kv_heads) * d, k, dtype, seed=12)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, t // 2:] = False  # sample 0 right-padded: its positions stop, as a short prompt's do
    positions = torch.cumsum(mask.long(), 1) - 1
    cos, sin = rope_cos_sin(positions if per_sample_cos else positions[-1:], d, 10000.0, dtype)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    got = tma.linear_qkv_rope(h, w, cos, sin, heads, kv_heads, d, "triton", config=QKV_CONFIGS[config])
    ref = linear_qkv_rope_ref(h, w, cos, sin, heads, kv_heads, d)
    truth = _truth_qkv_rope(h, w, cos, sin, heads, kv_heads, d)
    for g, r, tr in zip(got, ref, truth):
        assert g.is_contiguous()
        _check_bf16(g, r.contiguous(), tr)


@kernels
@pytest.mark.parametrize("room", [0, 5])
def test_linear_qkv_rope_writes_into_given_buffers(room) -> None:
    """k and v go straight into a stacked KV cache's slice: a contiguous one, or one with `room`
    positions after the prefix (the engine's cache for an unmasked action expert), which must stay
    untouched; q into a given buffer of other strides."""
    b, t, k, heads, kv_heads, d = 2, 19, 40, 2, 1, 16
    h = _randn(b, t, k, dtype=torch.bfloat16, seed=13)
    w = _weight((heads + 2 * kv_heads) * d, k, torch.bfloat16, seed=14)
    positions = torch.arange(t)[None].expand(b, t)
    cos, sin = (c.to(DEVICE) for c in rope_cos_sin(positions, d, 10000.0, torch.bfloat16))
    cache = torch.full((2, 3, b, kv_heads, t + room, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    k_out, v_out = cache[0, 1, :, :, :t], cache[1, 1, :, :, :t]
    # q into a (B, T, H, D) buffer seen as (B, H, T, D): the layout SDPA folds without a copy
    q_buf = torch.full((b, t, heads, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    q_, k_, v = tma.linear_qkv_rope(h, w, cos, sin, heads, kv_heads, d, "triton", k_out=k_out, v_out=v_out,
                                    q_out=q_buf.transpose(1, 2), config=QKV_CONFIGS["tiles"])
    assert k_.data_ptr() == cache[0, 1].data_ptr() and v.data_ptr() == cache[1, 1].data_ptr()
    assert q_.data_ptr() == q_buf.data_ptr() and q_.shape == (b, heads, t, d) and torch.isfinite(q_buf).all()
    assert torch.isfinite(cache[:, 1, :, :, :t]).all()
    assert torch.isnan(cache[:, 1, :, :, t:]).all() and torch.isnan(cache[:, 0]).all() and torch.isnan(cache[:, 2]).all()
    rq, rk, rv = linear_qkv_rope_ref(h, w, cos, sin, heads, kv_heads, d)
    assert (q_.float() - rq.float()).abs().max() < 0.05
    assert (k_out.float() - rk.float()).abs().max() < 0.05
    assert (v_out.float() - rv.float()).abs().max() < 0.05
    with pytest.raises(ValueError, match=r"k_out: a .* unit last stride"):
        tma.linear_qkv_rope(h, w, cos, sin, heads, kv_heads, d, "triton", k_out=cache[0, 1, :, :, :t].transpose(-1, -2),
                            v_out=v_out)
    with pytest.raises(ValueError, match="both or neither"):
        tma.linear_qkv_rope(h, w, cos, sin, heads, kv_heads, d, "triton", k_out=k_out)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        w24 = _weight((heads + 2 * kv_heads) * 24, k, torch.bfloat16, seed=15)
        c24, s24 = (c.to(DEVICE) for c in rope_cos_sin(positions, 24, 10000.0, torch.bfloat16))
        tma.linear_qkv_rope(h, w24, c24, s24, heads, kv_heads, 24, "triton")


@kernels
def test_prefix_stack_with_tma_routes(monkeypatch) -> None:
    """The prefix stack with its QKV + RoPE, o_proj and gate/up + GeGLU on the TMA GEMMs (forced:
    `takes` needs a Hopper GPU and thousands of rows) gives the per-block path's K/V cache, and
    each TMA kernel was called where it should be."""
    from test_triton_ops import _plain_blocks, _plain_reference

    from phyai_edge.layers import fused_stacks

    calls: dict[str, int] = {"geglu": 0, "qkv_rope": 0, "linear": 0}

    def counted(name, real):
        def call(*a, **kw):
            calls[name] += 1
            return real(*a, **kw)
        return call

    monkeypatch.setattr(tma, "takes", lambda op, linear, h: True)
    monkeypatch.setattr(tma, "linear_geglu", counted("geglu", tma.linear_geglu))
    monkeypatch.setattr(tma, "linear_qkv_rope", counted("qkv_rope", tma.linear_qkv_rope))
    monkeypatch.setattr(tma, "linear", counted("linear", tma.linear))
    blocks = _plain_blocks(torch.bfloat16)
    b, t = 2, 40
    x = _randn(b, t, 48, dtype=torch.bfloat16, seed=21)
    mask = torch.ones(b, t, dtype=torch.bool, device=DEVICE)
    positions = torch.cumsum(mask.long(), 1) - 1
    cos, sin = rope_cos_sin(positions, blocks[0].self_attn.head_dim, 10000.0, torch.bfloat16)
    with torch.no_grad():
        k, v = fused_stacks.plain_block_stack(blocks, x, cos, sin, mask[:, None, None, :], backend="triton")
        rk, rv = _plain_reference(blocks, x, cos, sin, mask[:, None, None, :])
    # every block's QKV; every block's o_proj and MLP but the last's (skipped: only its K/V is read)
    assert calls == {"qkv_rope": len(blocks), "linear": len(blocks) - 1, "geglu": len(blocks) - 1}
    for got, want in ((k, rk), (v, rv)):
        assert torch.isfinite(got).all()
        assert (got.float() - want.float()).norm() / want.float().norm() < 2e-2


def test_takes_never_on_cpu_and_rejects_unknown_routes() -> None:
    lin = torch.nn.Linear(16, 32, bias=False).to(torch.bfloat16)
    h = torch.zeros(8192, 16, dtype=torch.bfloat16)
    before = tma.set_route("geglu", True)
    try:
        assert not tma.takes("geglu", lin, h)  # a CPU tensor: never
    finally:
        tma.set_route("geglu", before)
    with pytest.raises(ValueError, match="unknown TMA route"):
        tma.set_route("attention", True)


def test_warp_specialization_falls_back_once_when_it_fails_to_compile(monkeypatch, caplog) -> None:
    """A tiling that asks for warp specialization where it does not compile runs without it, says
    so once, and later calls do not ask again; a tiling without it is launched as it is."""
    monkeypatch.setattr(tma, "_WS_BROKEN", [])
    seen = []

    def launch(c):
        seen.append(c.warp_specialize and tma._ws_works())
        if seen[-1]:
            raise RuntimeError("PassManager::run failed")

    ws = tma.TmaConfig(16, 16, 16, 4, 2, 2, warp_specialize=True)
    with caplog.at_level("WARNING", logger=tma.__name__):
        tma._launch_with_ws_fallback(launch, ws)
        tma._launch_with_ws_fallback(launch, ws)
        tma._launch_with_ws_fallback(launch, tma.TmaConfig(16, 16, 16, 4, 2, 2))
    assert seen == [True, False, False, False]
    assert [r.message for r in caplog.records if "warp specialization" in r.message] and len(caplog.records) == 1
    assert "PassManager" in tma._WS_BROKEN[0]
    with pytest.raises(ValueError, match="boom"):  # an error without warp specialization is the caller's
        tma._launch_with_ws_fallback(lambda c: (_ for _ in ()).throw(ValueError("boom")), tma.TmaConfig(16, 16, 16))
