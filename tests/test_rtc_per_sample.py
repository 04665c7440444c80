"""Per-sample Real-Time Chunking: one batch carries samples (robots, environments) with different
inference delays d_i and soft masks, in every solver mode, on every engine that runs on a CPU.

A batch of 3 with delays (2, 5, 9) must give each sample what it gets alone (same noise), and
`inpaint` must hold each sample's own first d_i actions exactly. The cudagraph engine runs its
static-buffer loop eagerly on a CPU (no capture), with the same (B, H, D) / (B, H, 1) buffers
a captured graph reads.
"""

from __future__ import annotations

import copy

import pytest
import torch

from phyai_edge.adapters.base import ModelInputs, SolverSpec
from phyai_edge.adapters.pi05 import builtin_adapter
from phyai_edge.engines.cudagraph import CudaGraphEngine
from phyai_edge.engines.eager import EagerEngine
from phyai_edge.engines.rtc import RTCGuidance, batch_guidance, prefix_weights
from phyai_edge.engines.solver import integrate

DELAYS = (2, 5, 9)
S = 20  # execution horizon
TOL = 1e-5


def _inputs(adapter, batch: int, seed: int = 0) -> ModelInputs:
    cfg = adapter.cfg
    g = torch.Generator().manual_seed(seed)
    s, length, views = cfg.vision.image_size, cfg.max_token_len, len(adapter.camera_names)
    images = torch.rand(batch, views, 3, s, s, generator=g) * 2 - 1
    image_mask = torch.ones(batch, views, dtype=torch.bool)
    valid = torch.tensor([7, 19, 12][:batch])
    tokens = torch.randint(1, cfg.vocab_size, (batch, length), generator=g)
    token_mask = torch.arange(length)[None, :] < valid[:, None]
    tokens = torch.where(token_mask, tokens, torch.zeros_like(tokens))
    return ModelInputs({"images": images, "image_mask": image_mask, "tokens": tokens, "token_mask": token_mask}, batch)


def _row(inputs: ModelInputs, i: int) -> ModelInputs:
    return ModelInputs({k: v[i:i + 1] for k, v in inputs.tensors.items()}, 1)


def _single(adapter, mode: str, d: int, seed: int) -> RTCGuidance:
    """A batch-1 guidance as `Policy.rtc_guidance` builds it: soft mask for d, hard prefix d."""
    h, dim = adapter.chunk_size, adapter.model_action_dim
    target = torch.randn(1, h, dim, generator=torch.Generator().manual_seed(seed)) * 0.5
    dim_mask = torch.zeros(dim)
    dim_mask[: adapter.action_dim] = 1.0
    return RTCGuidance(mode, target, prefix_weights(h, d, S), dim_mask, d, 5.0)


@pytest.fixture(scope="module")
def engines():
    base = builtin_adapter("tiny", seed=4)
    return (base, EagerEngine(copy.deepcopy(base), device="cpu", dtype="float32"),
            CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="float32"))


def test_guidance_carries_one_delay_per_sample():
    h = 12
    parts = [RTCGuidance("inpaint", torch.zeros(1, h, 3), prefix_weights(h, d, 4), torch.ones(3), d, 5.0)
             for d in (1, 4)]
    g = batch_guidance([parts[0], None, parts[1]], h, 3)
    assert g.delays.dtype == torch.int64 and g.delays.tolist() == [1, 0, 4] and g.delay == 4
    fixed = g.fixed_mask(h)
    assert fixed.shape == (3, h, 1) and fixed.dtype == torch.bool
    assert fixed[:, :, 0].sum(dim=1).tolist() == [1, 0, 4]
    shared = parts[0]
    assert shared.delays.tolist() == [1] and shared.fixed_mask(h).shape == (1, h, 1)
    assert torch.equal(shared.to(torch.device("cpu")).delays, shared.delays)
    per = RTCGuidance("inpaint", torch.zeros(2, h, 3), torch.zeros(2, h), torch.ones(3), torch.tensor([3, 0]), 5.0)
    assert per.delays.dtype == torch.int64 and per.fixed_mask(h)[:, :, 0].sum(dim=1).tolist() == [3, 0]


def test_solver_inpaint_mixed_delays_equals_one_by_one():
    """The shared loop alone (a fixed velocity field, float64): bit-identical rows."""
    h, dim = 10, 3
    w = torch.randn(dim, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 0.3

    def v(x, t):
        return torch.tanh(x @ w) + t[:, None, None]

    noise = torch.randn(3, h, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    parts = [RTCGuidance("inpaint", torch.randn(1, h, dim, dtype=torch.float64), prefix_weights(h, d, 3).double(),
                         torch.ones(dim, dtype=torch.float64), d, 5.0) for d in (1, 4, 7)]
    g = batch_guidance(parts, h, dim)
    g.target, g.dim_mask = g.target.double(), g.dim_mask.double()
    together = integrate(v, noise, SolverSpec(8), g)
    for i, (p, d) in enumerate(zip(parts, (1, 4, 7))):
        alone = integrate(v, noise[i:i + 1], SolverSpec(8), p)
        assert torch.equal(together[i:i + 1], alone)
        assert torch.equal(together[i, :d], p.target[0, :d])
        assert not torch.equal(together[i, d], p.target[0, d])


@pytest.mark.parametrize("mode", ["inpaint", "guided-approx", "guided"])
@pytest.mark.parametrize("which", ["eager", "cudagraph"])
def test_mixed_delays_batch_equals_batch_of_one(engines, which: str, mode: str) -> None:
    base, eager, fast = engines
    engine = eager if which == "eager" else fast
    inputs = _inputs(base, 3, seed=11)
    noise = torch.randn(3, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(12))
    parts = [_single(base, mode, d, seed=20 + i) for i, d in enumerate(DELAYS)]
    rtc = batch_guidance(parts, base.chunk_size, base.model_action_dim)
    assert rtc.weights.shape == (3, base.chunk_size) and rtc.delays.tolist() == list(DELAYS)
    together = engine.run(inputs, noise=noise, rtc=rtc)
    assert torch.isfinite(together).all()
    for i, (p, d) in enumerate(zip(parts, DELAYS)):
        alone = engine.run(_row(inputs, i), noise=noise[i:i + 1], rtc=p)
        diff = float((together[i:i + 1] - alone).abs().max())
        assert diff < TOL, (which, mode, i, diff)
        if mode == "inpaint":
            # Each sample holds its own hard prefix exactly, and only that one.
            assert torch.equal(together[i, :d], p.target[0, :d])
            assert torch.equal(alone[0, :d], p.target[0, :d])
            assert not torch.equal(together[i, d], p.target[0, d])
    if which == "cudagraph":
        # Eager and cudagraph agree on the mixed batch too (a different backend: float rounding).
        ref = eager.run(inputs, noise=noise, rtc=rtc)
        assert float((together - ref).abs().max()) < TOL


def test_cudagraph_one_buffer_set_serves_any_mix_of_delays(engines) -> None:
    """The static RTC buffers are per sample and sized by the batch: a second call with other
    delays reuses the same graph set and loop entry (on a GPU: replays the same captured graph)."""
    base, eager, fast = engines
    inputs = _inputs(base, 3, seed=31)
    noise = torch.randn(3, base.chunk_size, base.model_action_dim, generator=torch.Generator().manual_seed(32))
    h, dim = base.chunk_size, base.model_action_dim
    outs = []
    for delays in ((1, 6, 3), (8, 0, 4)):
        rtc = batch_guidance([_single(base, "inpaint", d, seed=40 + d) for d in delays], h, dim)
        outs.append((delays, rtc, fast.run(inputs, noise=noise, rtc=rtc)))
        (gs,) = [g for k, g in fast._sets.items() if k[0] == 3]
        assert ("inpaint", base.solver, "") in gs.loops
        assert gs.loop_bufs["mask"].shape == (3, h, dim)
        assert gs.loop_bufs["fixed"].shape == (3, h, 1) and gs.loop_bufs["fixed"].dtype == torch.bool
        assert gs.loop_bufs["fixed"][:, :, 0].sum(dim=1).tolist() == list(delays)
    assert len([k for k in fast._sets if k[0] == 3]) == 1  # one graph set, one inpaint loop, any delays
    for delays, rtc, out in outs:
        for i, d in enumerate(delays):
            assert torch.equal(out[i, :d], rtc.target[i, :d])
        ref = eager.run(inputs, noise=noise, rtc=rtc)
        assert float((out - ref).abs().max()) < TOL
