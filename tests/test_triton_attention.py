"""Split-KV attention (`layers/triton_attention.py`) against the plain reference attention.

Without a GPU the kernels run in Triton's CPU interpreter (`conftest.py` sets TRITON_INTERPRET=1);
they skip, with the reason, where triton is not installed. The split planner and the dispatcher's
fallbacks are tested everywhere.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_triton_gemm import _RefusesStages  # a kernel stand-in refusing more than N pipeline stages

from phyai_edge.layers import triton_attention as ta
from phyai_edge.layers import triton_dispatch, triton_ops
from phyai_edge.layers.attention import attention, attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS_RUN, WHY_NOT = triton_ops.triton_status(DEVICE)
kernels = pytest.mark.skipif(not KERNELS_RUN, reason=f"Triton kernels cannot run here: {WHY_NOT}")


def _qkv(b, hq, hkv, tq, tk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g)
    k = torch.randn(b, hkv, tk, d, generator=g)
    v = torch.randn(b, hkv, tk, d, generator=g)
    return (t.to(dtype).to(DEVICE) for t in (q, k, v))


def _key_mask(b, tk, seed=1, p=0.3):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(b, tk, generator=g) > p)[:, None, None, :].to(DEVICE)


@pytest.fixture
def poisoned(monkeypatch):
    """Kernel outputs start as NaN: any element a kernel fails to write shows up."""

    def empty(shape, dtype, device):
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(ta, "_empty", empty)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@kernels
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("splits", [1, 2, 3, None])
@pytest.mark.parametrize("shape", [(1, 4, 1, 10, 300, 64), (2, 2, 2, 7, 150, 32), (2, 8, 1, 5, 290, 256)])
def test_kernel_matches_reference(poisoned, shape, splits, dtype, tol):
    b, hq, hkv, tq, tk, d = shape
    q, k, v = _qkv(b, hq, hkv, tq, tk, d, dtype)
    mask = _key_mask(b, tk)
    out = ta.attention_split(q, k, v, mask, backend="triton", splits=splits)
    ref = attention_ref(q.float(), k.float(), v.float(), mask)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "output not fully written (NaN poison left)"
    assert _rel(out, ref) < tol


@kernels
def test_masked_ranges_and_empty_rows(poisoned):
    """A split whose keys are all masked contributes nothing; a batch row with no allowed key
    attends to every key (the `attention` contract), never NaN."""
    b, hq, hkv, tq, tk, d = 3, 4, 1, 6, 260, 32
    q, k, v = _qkv(b, hq, hkv, tq, tk, d, torch.float32, seed=3)
    mask = torch.ones(b, 1, 1, tk, dtype=torch.bool, device=DEVICE)
    mask[0, ..., :200] = False  # the first splits of row 0 see no key at all
    mask[1] = False  # no allowed key: all keys
    mask[2, ..., 1::2] = False
    out = ta.attention_split(q, k, v, mask, backend="triton", splits=3)
    ref = attention_ref(q, k, v, mask)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 2e-5


@kernels
def test_output_is_a_free_transpose():
    q, k, v = _qkv(2, 4, 1, 5, 140, 32, torch.float32)
    out = ta.attention_split(q, k, v, _key_mask(2, 140), backend="triton")
    flat = out.transpose(1, 2)
    assert flat.is_contiguous()  # (B, Tq, Hq, D): the o-projection's reshape is a view


def test_fallbacks_take_the_reference():
    q, k, v = _qkv(1, 4, 1, 5, 40, 24, torch.float32)  # head size 24: not a power of two
    mask = _key_mask(1, 40)
    assert torch.equal(ta.attention_split(q, k, v, mask, backend="auto"), attention(q, k, v, mask))
    q, k, v = _qkv(1, 4, 1, 5, 40, 32, torch.float32)
    pair = torch.ones(1, 1, 5, 40, dtype=torch.bool, device=DEVICE)  # not key-only
    assert torch.equal(ta.attention_split(q, k, v, pair, backend="auto"), attention(q, k, v, pair))
    assert torch.equal(ta.attention_split(q, k, v, mask, backend="reference"), attention(q, k, v, mask))
    qg = q.clone().requires_grad_(True)  # one key part, so no new keys: the backward has only dq to give
    out = ta.attention_split(qg, k, v, mask, backend="auto")
    out.sum().backward()
    qr = q.clone().requires_grad_(True)
    attention(qr, k, v, mask).sum().backward()
    assert torch.allclose(qg.grad, qr.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,keys,groups,sms,expect_splits", [
    (400, 866, 1, 132, 6),    # PI0.5 batch 1: 7 query blocks; keys allow 6 splits of >= 128
    (400, 866, 32, 132, 2),   # batch 32: 224 programs already; two splits reach 2 per SM
    (400, 866, 64, 132, 1),   # enough programs without splitting
    (400, 100, 1, 132, 1),    # too few keys to split
])
def test_plan_splits(rows, keys, groups, sms, expect_splits):
    splits, per = ta.plan_splits(rows, keys, groups, sms, 64, 32)
    assert splits == expect_splits
    assert per % 32 == 0 and splits * per >= keys and (splits - 1) * per < keys


@kernels
@pytest.mark.parametrize("split_at", [0, 37, 200, 250])
@pytest.mark.parametrize("splits", [1, 3])
def test_two_part_keys_equal_concatenation(poisoned, split_at, splits):
    """Keys and values given as (cached, new) parts attend exactly as their concatenation, with the
    boundary anywhere (inside a key block, on a split edge, one part empty)."""
    b, hq, hkv, tq, tk, d = 2, 4, 1, 6, 250, 32
    q, k, v = _qkv(b, hq, hkv, tq, tk, d, torch.float32, seed=5)
    mask = _key_mask(b, tk, seed=6)
    whole = ta.attention_split(q, k, v, mask, backend="triton", splits=splits)
    parts = ta.attention_split(q, (k[:, :, :split_at], k[:, :, split_at:]), (v[:, :, :split_at], v[:, :, split_at:]),
                               mask, backend="triton", splits=splits)
    assert torch.isfinite(parts).all()
    assert _rel(parts, whole) < 1e-6
    ref = ta.attention_split(q, (k[:, :, :split_at], k[:, :, split_at:]), (v[:, :, :split_at], v[:, :, split_at:]),
                             mask, backend="reference")
    assert _rel(parts, ref) < 2e-5


@kernels
@pytest.mark.parametrize("split_at", [0, 203])
def test_tma_tiling_with_an_empty_key_part(poisoned, split_at):
    """A TMA tiling handed an empty key part (the prefix's one-part call) describes the other part
    twice (the empty part's loop never runs) and still matches the reference."""
    b, hq, hkv, tq, tk, d = 1, 8, 1, 5, 203, 32
    q, k, v = _qkv(b, hq, hkv, tq, tk, d, torch.float32, seed=13)
    mask = _key_mask(b, tk, seed=14)
    descs = ta._kv_descriptors(k[:, :, :split_at], v[:, :, :split_at], k[:, :, split_at:], v[:, :, split_at:], 32)
    if descs is not None:  # None only where this Triton has no tensor descriptors
        full = k[:, :, split_at:] if split_at == 0 else k[:, :, :split_at]
        assert all(dsc.base.data_ptr() == t.data_ptr() for dsc, t in zip(descs[::2], (full, full)))
        assert [tuple(dsc.shape) for dsc in descs] == [tuple(full.shape)] * 4
    assert ta._kv_descriptors(k[:, :, :0], v[:, :, :0], k[:, :, :0], v[:, :, :0], 32) is None
    cfg = ta.SplitConfig(block_m=16, block_n=32, warps=4, stages=3, min_keys=32, inline_merge=True, tma=True)
    out = ta.attention_split(q, (k[:, :, :split_at], k[:, :, split_at:]), (v[:, :, :split_at], v[:, :, split_at:]),
                             mask, backend="triton", config=cfg)
    assert torch.isfinite(out).all() and _rel(out, attention_ref(q, k, v, mask)) < 2e-5


@kernels
@pytest.mark.parametrize("config", [
    ta.SplitConfig(block_m=16, block_n=16, warps=2, stages=1, min_keys=32),
    ta.SplitConfig(block_m=32, block_n=64, warps=4, stages=3, min_keys=64),
    ta.SplitConfig(block_m=64, block_n=32, warps=8, stages=2, min_keys=16),
    ta.SplitConfig(block_m=128, block_n=32, warps=8, stages=2, min_keys=16),
    ta.SplitConfig(block_m=64, block_n=32, warps=4, stages=2, min_keys=16, inline_merge=True),
    # key / value tiles by TMA descriptors (the batch-1 form); rows past a part's end come back as zeros
    ta.SplitConfig(block_m=16, block_n=32, warps=4, stages=3, min_keys=32, inline_merge=True, tma=True),
    ta.SplitConfig(block_m=64, block_n=64, warps=4, stages=2, min_keys=16, tma=True),
    ta.SplitConfig(block_m=64, block_n=64, warps=4, stages=3, min_keys=16, tma=True),  # MID_BLOCKS' form, split
    # each key block computed transposed (keys x rows), by TMA and by pointers
    ta.SplitConfig(block_m=16, block_n=32, warps=4, stages=3, min_keys=32, inline_merge=True, tma=True,
                   keys_as_rows=True),
    ta.SplitConfig(block_m=32, block_n=64, warps=4, stages=2, min_keys=64, keys_as_rows=True),
])
def test_tilings_agree(poisoned, config):
    """Every tiling the GPU sweep may choose gives the reference's result, with the two key parts
    meeting inside a key block and a query row count no block size divides."""
    b, hq, hkv, tq, tk, d = 2, 8, 1, 5, 203, 64
    q, k, v = _qkv(b, hq, hkv, tq, tk, d, torch.float32, seed=11)
    mask = _key_mask(b, tk, seed=12)
    cut = 150
    out = ta.attention_split(q, (k[:, :, :cut], k[:, :, cut:]), (v[:, :, :cut], v[:, :, cut:]), mask,
                             backend="triton", config=config)
    assert torch.isfinite(out).all()
    assert _rel(out, attention_ref(q, k, v, mask)) < 2e-5
    splits, _ = ta.plan_splits(hq * tq, tk, b, ta._sm_count(q.device), config.block_m, config.block_n, config.min_keys)
    assert splits > 1, "the merge path is exercised"


@pytest.mark.parametrize("rows,groups,tiling", [
    (400, 1, ta.FEW_BLOCKS), (400, 2, ta.FEW_BLOCKS), (400, 4, ta.MANY_BLOCKS), (400, 8, ta.MID_BLOCKS),
    (400, 16, ta.MID_BLOCKS), (400, 24, ta.BIG_BLOCKS), (400, 32, ta.BIG_BLOCKS), (400, 64, ta.BIG_BLOCKS),
    (6528, 1, ta.MID_BLOCKS), (6528, 2, ta.BIG_BLOCKS), (6528, 8, ta.BIG_BLOCKS),
])
def test_default_config_by_shape(rows, groups, tiling):
    assert ta.default_config(rows, groups, 132) == tiling


@kernels
def test_stack_attention_shares_one_key_mask(poisoned):
    """The stacks' attention makes the kernel's mask once; each call equals attention_split alone."""
    q, k, v = _qkv(1, 4, 1, 10, 300, 32, torch.float32, seed=8)
    mask = _key_mask(1, 300, seed=9)
    attend = ta.stack_attention(mask, 1, "triton")
    alone = ta.attention_split(q, k, v, mask, backend="triton")
    assert torch.equal(attend(q, k, v, mask), alone)
    other = _key_mask(1, 300, seed=10)  # a different mask object: computed from it, not the shared one
    assert torch.equal(attend(q, k, v, other), ta.attention_split(q, k, v, other, backend="triton"))


@kernels
@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("shape", [(1, 8, 1, 5, 290, 64), (3, 4, 2, 7, 203, 32)])
def test_inline_merge_equals_merge_kernel(poisoned, shape, splits):
    """The split kernel merging its own splits (the last program of a query block to finish) gives
    the same bits as the separate merge kernel (the same sums in the same order), and every
    ticket it drew is back at zero afterwards."""
    b, hq, hkv, tq, tk, d = shape
    q, k, v = _qkv(b, hq, hkv, tq, tk, d, torch.bfloat16, seed=21)
    mask = _key_mask(b, tk, seed=22)
    mask[0, ..., : tk // 2] = False  # whole splits without an allowed key
    cut = 120
    kp, vp = (k[:, :, :cut], k[:, :, cut:]), (v[:, :, :cut], v[:, :, cut:])
    base = ta.SplitConfig(block_m=16, block_n=32, warps=4, stages=1, min_keys=16, inline_merge=True)
    tickets = ta.Tickets(q.device)
    inline = ta.attention_split(q, kp, vp, mask, backend="triton", splits=splits, config=base, tickets=tickets)
    second = replace(base, inline_merge=False)
    separate = ta.attention_split(q, kp, vp, mask, backend="triton", splits=splits, config=second)
    assert torch.isfinite(inline).all()
    assert torch.equal(inline, separate)
    assert tickets._used > 0 and int(tickets._buf.abs().sum()) == 0
    assert _rel(inline, attention_ref(q.float(), k.float(), v.float(), mask)) < 2e-2


def test_tickets_hand_out_disjoint_zeroed_slices():
    t = ta.Tickets(torch.device("cpu"))
    a, b = t.take(10), t.take(20)
    assert a.data_ptr() != b.data_ptr() and a.numel() == 10 and b.numel() == 20
    assert int(a.sum()) == 0 and int(b.sum()) == 0
    big = t.take(ta.Tickets.CHUNK + 1)  # larger than a chunk: its own buffer
    assert big.numel() == ta.Tickets.CHUNK + 1 and int(big.sum()) == 0


def test_set_inline_merge_switches_the_default_tiling():
    before = ta.set_inline_merge(False)
    try:
        assert ta.default_config(400, 1, 132).inline_merge is False
        assert ta.default_config(400, 8, 132) == ta.MID_BLOCKS  # no merge there anyway
        assert ta.set_inline_merge(True) is False
        assert ta.default_config(400, 1, 132) == ta.FEW_BLOCKS
    finally:
        ta.set_inline_merge(before)


@kernels
def test_big_blocks_never_split(poisoned):
    """The 128-row tiling takes every key in one program (no partials, no merge) and matches the
    reference, with a query row count no 128-row block divides."""
    for cfg in (ta.BIG_BLOCKS, ta.MID_BLOCKS):
        assert ta.plan_splits(400, 866, 32, 132, cfg.block_m, cfg.block_n, cfg.min_keys)[0] == 1
    b, hq, hkv, tq, tk, d = 2, 8, 1, 21, 203, 32
    q, k, v = _qkv(b, hq, hkv, tq, tk, d, torch.float32, seed=31)
    mask = _key_mask(b, tk, seed=32)
    cfg = replace(ta.BIG_BLOCKS, block_n=32)
    out = ta.attention_split(q, (k[:, :, :150], k[:, :, 150:]), (v[:, :, :150], v[:, :, 150:]), mask,
                             backend="triton", config=cfg)
    assert torch.isfinite(out).all()
    assert _rel(out, attention_ref(q, k, v, mask)) < 2e-5


class _RefusesBlockRows:
    """A kernel stand-in that, like Triton on a GPU with too little shared memory, raises
    `OutOfResources` at launch for tilings of `block_m` query rows and runs the real kernel otherwise."""

    def __init__(self, kernel, block_m):
        self.kernel, self.block_m, self.refused = kernel, block_m, 0

    def __getitem__(self, grid):
        def launch(*args, **kw):
            if kw["BLOCK_M"] == self.block_m:
                self.refused += 1
                raise triton_dispatch.OutOfResources(262144, 101376, "shared memory")
            return self.kernel[grid](*args, **kw)
        return launch


@kernels
@pytest.mark.parametrize("batch,tokens,tiling,compact", [
    (1, 5, "FEW_BLOCKS", "FEW_BLOCKS_COMPACT"),   # the batch-1 expert: 16-row blocks, split keys
    (12, 21, "MID_BLOCKS", "MID_BLOCKS_COMPACT"),  # 64-row blocks, one split (168 rows x 12 on 132 SMs)
])
def test_a_tma_tiling_falls_back_to_its_compact_form(monkeypatch, batch, tokens, tiling, compact):
    """Where a TMA tiling (three stages) does not fit, the tiling it replaced runs (two stages, the
    same blocks and splits), not the next shape class's."""
    monkeypatch.setattr(triton_dispatch, "_DOES_NOT_FIT", set())
    monkeypatch.setattr(ta, "_sm_count", lambda device: 132)
    chosen, want_cfg = getattr(ta, tiling), getattr(ta, compact)
    b, hq, hkv, tq, tk, d = batch, 8, 1, tokens, 300, 32
    q, k, v = _qkv(b, hq, hkv, tq, tk, d, torch.float32, seed=23)
    mask = _key_mask(b, tk, seed=24)
    assert ta.default_config(hq * tq, b, 132) is chosen and chosen.tma and chosen.stages == 3
    want = ta.attention_split(q, k, v, mask, backend="triton", config=want_cfg)
    refusing = _RefusesStages(ta._split_attn_kernel, 2)
    monkeypatch.setattr(ta, "_split_attn_kernel", refusing)
    got = ta.attention_split(q, k, v, mask, backend="triton")
    assert refusing.refused == 1 and torch.equal(got, want)
    assert _rel(got, attention_ref(q, k, v, mask)) < 2e-5


def test_tma_tilings_start_at_their_compact_form_without_tma(monkeypatch):
    """Before Hopper (no TMA) a TMA tiling's stage count buys nothing: its compact form is tried
    first; the tilings without TMA keep their order."""
    cpu = torch.device("cpu")
    assert ta._tilings(ta.MID_BLOCKS, cpu)[:2] == (ta.MID_BLOCKS, ta.MID_BLOCKS_COMPACT)
    monkeypatch.setattr(ta, "_has_tma", lambda device: False)
    assert ta._tilings(ta.MID_BLOCKS, cpu)[0] is ta.MID_BLOCKS_COMPACT
    assert ta._tilings(ta.FEW_BLOCKS, cpu)[0] is ta.FEW_BLOCKS_COMPACT
    assert ta._tilings(ta.BIG_BLOCKS, cpu)[0] is ta.BIG_BLOCKS_COMPACT
    assert ta._tilings(ta.MANY_BLOCKS, cpu)[0] is ta.MANY_BLOCKS
    k = torch.zeros(1, 1, 64, 32)
    assert ta._kv_descriptors(k, k, k, k, 32) is None


class _RefusesTma:
    """A kernel stand-in refusing, as `OutOfResources`, every launch that loads tiles by TMA."""

    def __init__(self, kernel):
        self.kernel, self.refused = kernel, 0

    def __getitem__(self, grid):
        def launch(*args, **kw):
            if kw["TMA"]:
                self.refused += 1
                raise triton_dispatch.OutOfResources(238592, 232448, "shared memory")
            return self.kernel[grid](*args, **kw)
        return launch


@kernels
def test_big_tma_tiling_falls_back_to_128_rows_without_tma(monkeypatch):
    """The 128-row TMA tiling that does not fit falls back to the same blocks loaded by pointers
    (`BIG_BLOCKS_COMPACT`), not to the 64-row class."""
    monkeypatch.setattr(triton_dispatch, "_DOES_NOT_FIT", set())
    monkeypatch.setattr(ta, "_sm_count", lambda device: 8)  # 6 blocks of 128 rows fill 70% of 8 SMs
    b, hq, hkv, tq, tk, d = 6, 8, 1, 5, 90, 32
    assert ta.default_config(hq * tq, b, 8) is ta.BIG_BLOCKS and ta.BIG_BLOCKS.tma
    q, k, v = _qkv(b, hq, hkv, tq, tk, d, torch.float32, seed=25)
    mask = _key_mask(b, tk, seed=26)
    want = ta.attention_split(q, k, v, mask, backend="triton", config=ta.BIG_BLOCKS_COMPACT)
    refusing = _RefusesTma(ta._split_attn_kernel)
    monkeypatch.setattr(ta, "_split_attn_kernel", refusing)
    got = ta.attention_split(q, k, v, mask, backend="triton")
    assert refusing.refused == 1 and torch.equal(got, want)
    assert _rel(got, attention_ref(q, k, v, mask)) < 2e-5


@kernels
def test_a_tiling_too_big_for_the_gpu_falls_back(monkeypatch, caplog):
    """Where the shape's tiling does not fit the GPU (here: 128-row blocks refused, as an RTX GPU's
    99 KB would), the first fallback tiling that fits runs, gives that tiling's own result, each
    refused tiling is said once in the log, and later calls go straight to it; when none fits, the
    error names the kernel."""
    monkeypatch.setattr(triton_dispatch, "_DOES_NOT_FIT", set())
    monkeypatch.setattr(ta, "default_config", lambda rows, groups, sms: ta.BIG_BLOCKS)
    refusing = _RefusesBlockRows(ta._split_attn_kernel, ta.BIG_BLOCKS.block_m)
    b, hq, hkv, tq, tk, d = 2, 8, 1, 5, 90, 32
    q, k, v = _qkv(b, hq, hkv, tq, tk, d, torch.float32, seed=21)
    mask = _key_mask(b, tk, seed=22)
    want = ta.attention_split(q, k, v, mask, backend="triton", config=ta.FALLBACK_TILINGS[0])
    monkeypatch.setattr(ta, "_split_attn_kernel", refusing)
    with caplog.at_level("WARNING", logger="phyai_edge.layers.triton_dispatch"):
        got = ta.attention_split(q, k, v, mask, backend="triton")
        again = ta.attention_split(q, k, v, mask, backend="triton")
    assert torch.equal(got, want) and torch.equal(again, want)
    assert refusing.refused == 2  # the 128-row tiling with TMA, then without; the second call tries neither
    assert sum("does not fit this GPU" in r.getMessage() for r in caplog.records) == 2
    assert _rel(got, attention_ref(q, k, v, mask)) < 2e-5
    monkeypatch.setattr(ta, "FALLBACK_TILINGS", ())
    monkeypatch.setattr(triton_dispatch, "_DOES_NOT_FIT", set())
    with pytest.raises(RuntimeError, match="split attention: none of its tilings fits"):
        ta.attention_split(q, k, v, mask, backend="triton")
