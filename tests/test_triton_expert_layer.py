"""The persistent expert block (`layers/triton_expert_layer.py`) against the model's per-block path,
its dispatch rule, and its route through `fused_stacks.adaptive_block_stack`.

On a CPU the kernel runs under Triton's interpreter one launch per phase (`persistent=False`): every
phase's tile code is checked here; the grid barrier, which only a GPU can run, is checked by the GPU
test below (and by `benchmarks/expert_layer_gpu.py`: the persistent launch bit-identical to its
phases launched one by one). Shapes are the block-stack tests' (3 blocks, width 48, 2 query heads on
one KV head of 16, 12 rows, 9 prefix keys of which 3 are masked in one sample): widths that are not
multiples of the tiles, so every mask is exercised.
"""

from __future__ import annotations

import pytest
import torch
from test_cudagraph import _rel
from test_triton_ops import KERNELS_RUN, WHY_NOT, _blocks, _float32_truth, _stack_inputs, _stack_reference

from phyai_edge.layers import fused_stacks
from phyai_edge.layers import triton_expert_layer as tel
from phyai_edge.layers.triton_attention import kernel_key_mask

kernels = pytest.mark.skipif(not KERNELS_RUN, reason=f"Triton kernels cannot run here: {WHY_NOT}")
ON_GPU = torch.cuda.is_available()
SPLIT_TILES = tel.LayerTiles(qkv_n=16, attn_m=16, attn_n=16, o_n=16, o_split=2, gu_n=16, down_n=16, down_split=3,
                             block_k=16)


def _run(blocks, args, **kw):
    x, cos, sin, kc, vc, mask, mods, final = args
    with torch.no_grad():
        return tel.persistent_block_stack(blocks, x, cos, sin, kc, vc, kernel_key_mask(mask, x.shape[0]), mods, final,
                                          1e-6, persistent=kw.pop("persistent", False), **kw)


@kernels
@pytest.mark.parametrize("tiles", [tel.DEFAULT_TILES, SPLIT_TILES], ids=["default", "split-K"])
def test_float32_matches_the_block_path(tiles) -> None:
    """float32: the same function as the blocks' own forward (o_proj / down split over K with the
    split tiles, summed in split order in the norm phases)."""
    blocks = _blocks(torch.float32)
    args = _stack_inputs(blocks, torch.float32)
    out = _run(blocks, args, tiles=tiles)
    with torch.no_grad():
        ref = _stack_reference(blocks, *args)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-5


@kernels
def test_bf16_within_the_per_op_path_error() -> None:
    """bf16 through three blocks: judged against the same blocks in float32, no further from them
    than the reference ops or the per-op kernels are (with margin for the interpreter's truncating
    stores)."""
    blocks = _blocks(torch.bfloat16)
    args = _stack_inputs(blocks, torch.bfloat16)
    out = _run(blocks, args)
    with torch.no_grad():
        ref = _stack_reference(blocks, *args)
        per_op = fused_stacks.adaptive_block_stack(blocks, *args, 1e-6, backend="triton", gemm_backend="triton")
    truth = _float32_truth(blocks, args)
    err = _rel(out.float(), truth)
    assert torch.isfinite(out).all()
    assert err < 2e-2 and err < 1.5 * max(_rel(ref.float(), truth), _rel(per_op.float(), truth))


@kernels
def test_the_route_through_adaptive_block_stack(monkeypatch) -> None:
    """Off by default; on, a bf16 stack with the GEMM backend goes through the persistent block
    (the same output as calling it directly); one without the GEMM backend, or a float32 stack (not
    a `takes` dtype), does not."""
    calls = []
    real = tel.persistent_block_stack

    def counted(*a, **kw):
        calls.append(a[1].dtype)
        return real(*a, **kw)

    monkeypatch.setattr(tel, "persistent_block_stack", counted)
    blocks = _blocks(torch.bfloat16)
    args = _stack_inputs(blocks, torch.bfloat16)
    assert not tel.enabled()
    with torch.no_grad():
        fused_stacks.adaptive_block_stack(blocks, *args, 1e-6, backend="triton", gemm_backend="triton")
    assert calls == []
    before = tel.set_enabled(True)
    try:
        with torch.no_grad():
            routed = fused_stacks.adaptive_block_stack(blocks, *args, 1e-6, backend="triton", gemm_backend="triton")
            plain = fused_stacks.adaptive_block_stack(blocks, *args, 1e-6, backend="triton")  # no GEMM backend
            f32 = _blocks(torch.float32)
            fused_stacks.adaptive_block_stack(f32, *_stack_inputs(f32, torch.float32), 1e-6, backend="triton",
                                              gemm_backend="triton")
    finally:
        tel.set_enabled(before)
    # only the bf16 stack with the GEMM backend was routed (`plain` and the float32 stack were not)
    assert calls == [torch.bfloat16]
    assert torch.equal(routed, _run(blocks, args)) and torch.isfinite(plain).all()


def test_takes() -> None:
    blocks = _blocks(torch.bfloat16)
    x, _, _, _, _, mask, _, _ = _stack_inputs(blocks, torch.bfloat16)
    assert tel.takes(blocks, x, mask)
    assert not tel.takes(blocks, x.float(), mask)  # float32 is not routed (a test-only kernel dtype)
    assert tel.takes(_blocks(torch.float32), x.float(), mask, dtypes=tel.KERNEL_DTYPES)
    assert not tel.takes(blocks, x.new_zeros(11, 6, x.shape[-1]), mask)  # 66 rows > MAX_ROWS
    assert not tel.takes(blocks, x, mask.expand(-1, -1, x.shape[1], -1))  # not a key-only mask
    assert not tel.takes(_blocks(torch.bfloat16, fuse=False), x, mask)  # unfused QKV / gate-up
    biased = _blocks(torch.bfloat16)
    biased[1].mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(x.shape[-1], dtype=torch.bfloat16, device=x.device))
    assert not tel.takes(biased, x, mask)


def test_argument_checks() -> None:
    blocks = _blocks(torch.bfloat16)
    x, cos, sin, kc, vc, mask, mods, final = _stack_inputs(blocks, torch.bfloat16)
    key_mask = kernel_key_mask(mask, x.shape[0])
    if not ON_GPU:
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            tel.persistent_block_stack(blocks, x, cos, sin, kc, vc, key_mask, mods, final, 1e-6, persistent=True)
    with pytest.raises(ValueError, match="key_mask"):
        tel.persistent_block_stack(blocks, x, cos, sin, kc, vc, key_mask[:, 1:], mods, final, 1e-6, persistent=False)
    with pytest.raises(ValueError, match="at most 64"):
        tel.persistent_block_stack(blocks, x.repeat(6, 1, 1), cos, sin, kc, vc, key_mask, mods, final, 1e-6,
                                   persistent=False)
    with pytest.raises(ValueError, match="power of two"):
        tel.LayerTiles(o_n=24)
    with pytest.raises(ValueError, match="splits"):
        tel.LayerTiles(o_split=0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (the grid barrier)")
def test_persistent_launch_matches_its_phases_on_gpu() -> None:
    """One launch per block with grid barriers gives the same bits as the phases launched one by
    one (same tiles, same order), and again when replayed (the barrier words are left consistent)."""
    blocks = _blocks(torch.bfloat16)
    args = _stack_inputs(blocks, torch.bfloat16)
    phases = _run(blocks, args)
    for _ in range(2):
        assert torch.equal(_run(blocks, args, persistent=True), phases)
