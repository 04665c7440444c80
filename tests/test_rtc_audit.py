"""Real-Time Chunking checked against the paper (Black, Galliker, Levine 2025, arXiv 2506.07339)
with every reference quantity written out again here from the paper's formulas, in the paper's
own time convention (tau from 0 at noise to 1 at data), rather than reusing the code under test:

- the guidance weight min(beta, (1 - tau) / (tau r_tau^2)), r_tau^2 = (1 - tau)^2 / (tau^2 + (1 - tau)^2),
  over tau and at both ends;
- the soft mask W_i, index by index, with c_i = (H - s - i) / (H - s - d + 1);
- whole guided and guided-approx loops on a small random MLP velocity network, the guidance
  from an explicit Jacobian rather than a vector-Jacobian product;
- `inpaint`'s replaced rows sitting at the noise level of the step that reads them;
- the daemon's chunk queue against world time: takeover index, prefix alignment, delay estimate.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest
import torch

from phyai_edge.adapters.base import SolverSpec
from phyai_edge.control.rtc import ChunkQueue, DelayEstimator
from phyai_edge.engines.rtc import RTCGuidance, guidance_weight, prefix_weights
from phyai_edge.engines.solver import integrate


# -- the paper's formulas, in its convention ------------------------------------------------
def paper_weight(tau: float, beta: float) -> float:
    r2 = (1 - tau) ** 2 / (tau**2 + (1 - tau) ** 2)
    return min(beta, (1 - tau) / (tau * r2))


def paper_mask(h: int, d: int, s: int) -> list[float]:
    out = []
    for i in range(h):
        if i < d:
            out.append(1.0)
        elif i < h - s:
            c = (h - s - i) / (h - s - d + 1)
            out.append(c * (math.exp(c) - 1) / (math.e - 1))
        else:
            out.append(0.0)
    return out


# -- guidance weight ------------------------------------------------------------------------
@pytest.mark.parametrize("beta", [0.5, 2.0, 5.0, 1e6])
def test_guidance_weight_is_the_papers_over_tau(beta: float) -> None:
    for tau in np.linspace(0.01, 0.99, 99):
        assert guidance_weight(1.0 - float(tau), beta) == pytest.approx(paper_weight(float(tau), beta), rel=1e-9)


@pytest.mark.parametrize("beta", [1.0, 5.0, 50.0])
def test_guidance_weight_takes_the_clip_at_both_ends(beta: float) -> None:
    """(1 - tau) / (tau r_tau^2) = (tau^2 + (1 - tau)^2) / (tau (1 - tau)) grows without bound as
    tau -> 0 and as tau -> 1, so min(beta, .) is beta near and at both ends; the ends themselves
    divide by zero and must not raise."""
    for tau in (1e-12, 1e-6, 1 - 1e-6, 1 - 1e-12):
        assert paper_weight(tau, beta) == beta
        assert guidance_weight(1.0 - tau, beta) == beta
    assert guidance_weight(1.0, beta) == beta  # tau = 0: pure noise, the first step
    assert guidance_weight(0.0, beta) == beta  # tau = 1: the data end


# -- soft mask ------------------------------------------------------------------------------
def _in_paper_range() -> list[tuple[int, int, int]]:
    return [(h, d, s) for h in range(1, 13) for s in range(h + 1) for d in range(h - s + 1)]


def test_soft_mask_is_the_papers_by_index() -> None:
    """Every (H, d, s) with d <= H - s, including d = 0 (no frozen row: the decay starts at row
    0 below 1), d = s, and d = H - s (no decay row at all)."""
    for h, d, s in _in_paper_range():
        got = prefix_weights(h, d, s).double()
        want = torch.tensor(paper_mask(h, d, s), dtype=torch.float64)
        assert torch.allclose(got, want, atol=1e-7, rtol=0), (h, d, s, got, want)
        if d < h - s:
            assert 0 < float(got[d]) < 1  # the first free row is already decayed
            assert float(got[h - s - 1]) > 0  # the last row before H - s still guided
        assert torch.all(got[h - s:] == 0)  # nothing of the executing chunk is left there


def test_soft_mask_matches_the_clipped_linear_form() -> None:
    """The same mask written as a clipped ramp (the form of the authors' Kinetix code): linear
    from 1 before d down to 0 at H - s, then shaped by c (e^c - 1) / (e - 1)."""
    for h, d, s in _in_paper_range():
        end = h - s
        i = np.arange(h)
        c = np.clip((d - 1 - i) / (end - d + 1) + 1, 0, 1)
        want = np.where(i >= end, 0.0, c * np.expm1(c) / (math.e - 1))
        np.testing.assert_allclose(prefix_weights(h, d, s).numpy(), want, atol=1e-7, rtol=0)


def test_soft_mask_keeps_frozen_rows_past_h_minus_s() -> None:
    """d > H - s lies outside the paper's range; the rows that will execute keep weight 1 and the
    rest are free (the Kinetix code would push d down to H - s and free them)."""
    w = prefix_weights(10, 6, 6)
    assert torch.equal(w, torch.tensor([1.0] * 6 + [0.0] * 4))


# -- whole loops on a random MLP ----------------------------------------------------------
class _Net(torch.nn.Module):
    """A velocity network that mixes every row and dim of the chunk with the time, as attention
    would; the model's convention (v = noise - actions, t from 1 to 0)."""

    def __init__(self, h: int, dim: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.h, self.dim = h, dim
        self.body = torch.nn.Sequential(torch.nn.Linear(h * dim + 1, 32), torch.nn.Tanh(),
                                        torch.nn.Linear(32, h * dim)).double()

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        flat = torch.cat([x.reshape(x.shape[0], -1), t.to(torch.float64)[:, None]], dim=1)
        return self.body(flat).view(-1, self.h, self.dim) + 0.5 * x


def _paper_loop(net: _Net, noise: torch.Tensor, y: torch.Tensor, wmask: torch.Tensor, n: int, beta: float,
                exact: bool) -> torch.Tensor:
    """The paper's guided Euler loop: A <- A + (1/n) (v + w(tau) (Y - A1_hat)^T diag(W) dA1_hat/dA),
    A1_hat = A + (1 - tau) v, with v the paper's velocity (data - noise), and dA1_hat/dA as an
    explicit Jacobian, one per sample (identity for the approximation)."""
    b, h, dim = noise.shape
    a = noise.clone()
    for k in range(n):
        tau = k / n
        t_model = torch.full((1,), 1.0 - tau, dtype=torch.float32)

        def v_paper(flat: torch.Tensor, t_model: torch.Tensor = t_model) -> torch.Tensor:
            return -net(flat.view(1, h, dim), t_model).reshape(-1)

        def a1_hat(flat: torch.Tensor, tau: float = tau) -> torch.Tensor:
            return flat + (1 - tau) * v_paper(flat)

        rows = []
        for j in range(b):
            aj = a[j].reshape(-1)
            v = v_paper(aj)
            err = wmask[j].reshape(-1) * (y[j].reshape(-1) - a1_hat(aj))
            if exact:
                corr = torch.autograd.functional.jacobian(a1_hat, aj).T @ err
            else:
                corr = err
            w = paper_weight(tau, beta) if tau > 0 else beta
            rows.append((aj + (1.0 / n) * (v + w * corr)).view(h, dim))
        a = torch.stack(rows).detach()
    return a


@pytest.mark.parametrize(("h", "d", "s", "beta"), [
    (6, 0, 2, 5.0),    # no frozen row
    (6, 2, 2, 5.0),    # d = s
    (6, 4, 2, 5.0),    # d = H - s: no decay row
    (6, 1, 2, 0.5),    # the clip acts at every step
    (6, 2, 1, 1e3),    # the clip acts only at the first step
])
@pytest.mark.parametrize("mode", ["guided", "guided-approx"])
def test_loop_equals_the_papers_on_a_random_mlp(mode: str, h: int, d: int, s: int, beta: float) -> None:
    dim, n, batch = 3, 8, 2
    net = _Net(h, dim, seed=h * 100 + d * 10 + s)
    g = torch.Generator().manual_seed(17)
    noise = torch.randn(batch, h, dim, generator=g, dtype=torch.float64)
    y = torch.randn(batch, h, dim, generator=g, dtype=torch.float64)
    dim_mask = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)  # the last dim is padding
    y[..., 2] = 0.0
    w_rows = torch.tensor(paper_mask(h, d, s), dtype=torch.float64)
    wmask = (w_rows[:, None] * dim_mask[None, :]).expand(batch, h, dim)
    with torch.no_grad():
        want = _paper_loop(net, noise, y, wmask, n, beta, exact=mode == "guided")
        rtc = RTCGuidance(mode, y, prefix_weights(h, d, s).double(), dim_mask, d, beta)  # type: ignore[arg-type]
        got = integrate(net, noise, SolverSpec(n), rtc)
        free = integrate(net, noise, SolverSpec(n))
    assert float((got - want).abs().max()) < 1e-6, float((got - want).abs().max())
    assert float((free - want).abs().max()) > 1e-3  # the guidance did something


def test_exact_and_approximate_guidance_differ_on_a_random_mlp() -> None:
    """The identity-Jacobian approximation is an approximation: on a network whose Jacobian is
    far from 0 it lands elsewhere than the paper's guidance."""
    h, dim = 6, 3
    net = _Net(h, dim, seed=5)
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(1, h, dim, generator=g, dtype=torch.float64)
    y = torch.randn(1, h, dim, generator=g, dtype=torch.float64)
    ones = torch.ones(dim, dtype=torch.float64)
    with torch.no_grad():
        exact = integrate(net, noise, SolverSpec(8), RTCGuidance("guided", y, prefix_weights(h, 2, 2).double(), ones, 2, 5.0))
        approx = integrate(net, noise, SolverSpec(8),
                           RTCGuidance("guided-approx", y, prefix_weights(h, 2, 2).double(), ones, 2, 5.0))
    assert float((exact - approx).abs().max()) > 1e-3


# -- inpaint --------------------------------------------------------------------------------
def test_inpaint_rows_sit_at_the_noise_level_of_each_step() -> None:
    """Every call of the velocity at model time t sees the frozen rows at t * noise + (1 - t) * Y,
    the straight path from this chunk's noise to the prefix at that same time (a row at another
    noise level than the rest of the chunk is out of the model's distribution); the chunk ends on Y."""
    h, dim, d, n = 6, 3, 2, 5
    net = _Net(h, dim, seed=11)
    g = torch.Generator().manual_seed(4)
    noise = torch.randn(2, h, dim, generator=g, dtype=torch.float64)
    y = torch.randn(2, h, dim, generator=g, dtype=torch.float64)
    seen: list[tuple[float, torch.Tensor]] = []

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        seen.append((float(t[0]), x.clone()))
        return net(x, t)

    rtc = RTCGuidance("inpaint", y, prefix_weights(h, d, 1).double(), torch.ones(dim, dtype=torch.float64), d, 5.0)
    with torch.no_grad():
        out = integrate(velocity, noise, SolverSpec(n), rtc)
    assert [round(t, 6) for t, _ in seen] == [round(1 - k / n, 6) for k in range(n)]
    for t, x in seen:
        assert torch.allclose(x[:, :d], t * noise[:, :d] + (1 - t) * y[:, :d], atol=1e-6), t
    assert torch.equal(out[:, :d], y[:, :d])


# -- the daemon's queue against world time ---------------------------------------------------
def _world_chunk(start_slot: int, h: int) -> np.ndarray:
    """A chunk from the observation at `start_slot` of a policy that knows the world exactly: its
    action i is the one for slot start_slot + i, here that slot's number itself."""
    slots = np.arange(start_slot, start_slot + h, dtype=np.float32)
    return np.stack([slots, -slots], axis=1)


def test_queue_follows_world_time_with_varying_delays_and_missed_slots() -> None:
    """The daemon's tick order (skip missed slots, adopt a finished chunk, start the next
    inference, publish): with any delays and missed slots every published action is the one for
    its slot (a takeover one index off would publish its neighbour's), each prefix row i is the
    executing chunk's action for the new chunk's slot i, and each request's d is the maximum of
    the last `window` measured delays (the initial value before any), at most the prefix length."""
    h, s, window, initial = 16, 5, 3, 4
    q = ChunkQueue("guided", h, s, 0, DelayEstimator(initial=initial, window=window))
    script = iter([3, 1, 6, 2, 2, 5, 1, 1, 1, 4, 7, 2, 3, 3, 1, 2])  # how long each inference takes
    missed_before = {9: 2, 23: 1, 40: 3}  # the clock's next slot -> how many it misses there
    measured: deque[int] = deque(maxlen=window)
    inflight: tuple[int, int] | None = None  # (observation slot, slot it is ready at)
    slot, published, plans, job = 0, 0, 0, 0
    while slot < 80:
        missed = missed_before.get(slot + 1, 0)
        slot += 1 + missed
        q.skip(missed)
        if inflight is not None and slot >= inflight[1]:
            start = inflight[0]
            job += 1
            assert q.adopt(_world_chunk(start, h), job, start, slot, 0.0) == slot - start
            measured.append(slot - start)
            inflight = None
        if inflight is None and q.wants_inference():
            plan = q.plan(slot)
            want_d = max(measured) if measured else initial
            if q.current is None:
                assert plan.prefix is None and plan.delay == want_d
            else:
                assert q.current.index >= s
                n = h - q.current.index
                assert plan.prefix is not None and plan.prefix.shape == (n, 2)
                np.testing.assert_array_equal(plan.prefix[:, 0], np.arange(slot, slot + n, dtype=np.float32))
                assert plan.delay == min(want_d, n)
                plans += 1
            inflight = (slot, slot + next(script, 2))
        nxt = q.next_action()
        if nxt is not None:
            assert nxt[0][0] == np.float32(slot), (slot, nxt[0])
            published += 1
    assert plans >= 8 and published >= 70
