"""The flow-matching Euler loop and Real-Time Chunking: soft mask, guidance weight, inpainting,
and the guided modes' vector-Jacobian product against an explicit Jacobian."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from phyai_edge.adapters.base import SolverSpec
from phyai_edge.engines.base import RTCRequest
from phyai_edge.engines.rtc import RTCGuidance, guidance_weight, prefix_weights
from phyai_edge.engines.solver import integrate, rtc_velocity


# -- soft mask and weight ------------------------------------------------------------------
def test_prefix_weights_by_hand():
    """H=10, d=3, s=4: ones on [0, 3), c_i (e^c_i - 1)/(e - 1) with c_i = (6 - i)/4 on [3, 6), zeros on [6, 10)."""
    w = prefix_weights(10, 3, 4)
    e = math.e
    hand = [1, 1, 1, 0.75 * (e**0.75 - 1) / (e - 1), 0.5 * (e**0.5 - 1) / (e - 1), 0.25 * (e**0.25 - 1) / (e - 1),
            0, 0, 0, 0]
    assert torch.allclose(w.double(), torch.tensor(hand, dtype=torch.float64), atol=1e-7, rtol=0)
    assert w[3] == pytest.approx(0.4876, abs=1e-4)  # 0.75 * 1.1170 / 1.7183
    assert torch.all(w[:-1] >= w[1:])  # non-increasing


@pytest.mark.parametrize(("h", "d", "s"), [(50, 0, 25), (50, 10, 25), (50, 30, 25), (50, 50, 0), (50, 0, 50), (8, 4, 0)])
def test_prefix_weights_edges(h, d, s):
    w = prefix_weights(h, d, s)
    assert w.shape == (h,)
    assert torch.equal(w[:d], torch.ones(d))
    assert torch.equal(w[max(h - s, d):], torch.zeros(h - max(h - s, d)))
    soft = w[d : max(h - s, d)]
    assert torch.all((soft > 0) & (soft < 1))


@pytest.mark.parametrize(("d", "s"), [(-1, 5), (51, 5), (5, -1), (5, 51)])
def test_prefix_weights_validate_ranges(d, s):
    with pytest.raises(ValueError, match="must lie in"):
        prefix_weights(50, d, s)


def test_guidance_weight_values():
    # t = 1 (tau = 0, pure noise) and t = 0 (tau = 1, done): the unclipped weight grows without
    # bound at both ends, so the cap (tests/test_rtc_audit.py checks the limits)
    assert guidance_weight(1.0, 5.0) == 5.0
    assert guidance_weight(0.0, 5.0) == 5.0
    # tau = 0.5: (1 - tau)/tau * ((1 - tau)^2 + tau^2)/(1 - tau)^2 = 1 * 0.5/0.25 = 2
    assert guidance_weight(0.5, 5.0) == pytest.approx(2.0)
    # tau = 0.2: 4 * (0.64 + 0.04)/0.64 = 4.25, capped at beta when beta is smaller
    assert guidance_weight(0.8, 10.0) == pytest.approx(4.25)
    assert guidance_weight(0.8, 3.0) == 3.0
    # tau = 0.9: (0.1/0.9) * (0.01 + 0.81)/0.01 = 9.111
    assert guidance_weight(0.1, 100.0) == pytest.approx(0.1 / 0.9 * 0.82 / 0.01)


# -- the loop ----------------------------------------------------------------------------
def _field(seed=0, d=4):
    """A small nonlinear velocity field v(x, t) that mixes dims and chunk rows (as attention does)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(d, generator=g, dtype=torch.float64)
    def v(x, t):
        x = x.to(a.dtype)
        return torch.tanh(x @ a) + b * t.to(a.dtype)[:, None, None] + 0.3 * x + 0.5 * torch.tanh(x.mean(1, keepdim=True))

    return v


def test_plain_euler_matches_hand_loop():
    v = _field()
    x0 = torch.randn(2, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = integrate(v, x0, SolverSpec(5))
    x = x0.clone()
    for i in range(5):
        # the solver hands the time over in float32, as every engine's stages take it (it read
        # float64 here, ~1e-8 off, which failed only for an unseeded draw with a value near 0)
        t = 1.0 - i * 0.2
        x = x + (-0.2) * v(x, torch.full((2,), t, dtype=torch.float32))
    torch.testing.assert_close(got, x, rtol=0, atol=1e-12)
    assert SolverSpec(10).times() == pytest.approx([1.0 - 0.1 * i for i in range(10)])


def _guidance(mode, h=8, dim=4, d=3, s=2, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, h, dim, generator=g, dtype=torch.float64)
    dim_mask = torch.ones(dim, dtype=torch.float64)
    dim_mask[-1] = 0.0  # a padded action dim
    return RTCGuidance(mode, target, prefix_weights(h, d, s).double(), dim_mask, d, 5.0)


def test_inpaint_holds_prefix_exactly():
    v = _field()
    rtc = _guidance("inpaint")
    rtc.target[..., -1] = 0.0
    noise = torch.randn(2, 8, 4, dtype=torch.float64)
    seen = []
    out = integrate(v, noise, SolverSpec(10), rtc, on_step=lambda i: seen.append(i))
    assert seen == list(range(10))
    assert torch.equal(out[:, :3], rtc.target[:, :3])  # bit-exact, padded dims included
    free = integrate(v, noise, SolverSpec(10))
    assert not torch.allclose(out[:, 3:], free[:, 3:])  # the held prefix steers the rest


@pytest.mark.parametrize("t", [0.9, 0.5, 0.2])
def test_guided_vjp_equals_explicit_jacobian(t):
    """guided: v - w * J^T ((Y - x1) * W) with x1 = x - t v(x) and J = dx1/dx, here J from
    torch.autograd.functional.jacobian and cross-checked by central finite differences."""
    v = _field(d=4)
    rtc = _guidance("guided", h=5, d=2, s=1, batch=1)
    x = torch.randn(1, 5, 4, dtype=torch.float64)
    tt = torch.full((1,), t, dtype=torch.float64)
    got = rtc_velocity(v, x, tt, t, rtc)

    def x1(flat):
        xx = flat.view(1, 5, 4)
        return (xx - t * v(xx, tt)).reshape(-1)

    jac = torch.autograd.functional.jacobian(x1, x.reshape(-1))  # (20, 20)
    eps = 1e-6
    fd = torch.stack([(x1(x.reshape(-1) + eps * e) - x1(x.reshape(-1) - eps * e)) / (2 * eps)
                      for e in torch.eye(20, dtype=torch.float64)], dim=1)
    assert torch.allclose(jac, fd, atol=1e-8)
    err = ((rtc.target - x1(x.reshape(-1)).view(1, 5, 4)) * rtc.mask).reshape(-1)
    want = v(x, tt) - guidance_weight(t, 5.0) * (jac.T @ err).view(1, 5, 4)
    assert torch.allclose(got, want, atol=1e-10)
    # the identity-Jacobian approximation differs from it (the field is not trivial) ...
    approx = rtc_velocity(v, x, tt, t, _guidance("guided-approx", h=5, d=2, s=1, batch=1))
    assert not torch.allclose(approx, got, atol=1e-4)
    # ... and is exactly v - w * err
    assert torch.allclose(approx, v(x, tt) - guidance_weight(t, 5.0) * err.view(1, 5, 4), atol=1e-12)


def test_guidance_does_not_touch_free_rows_of_a_separable_field():
    """With a per-row field, rows whose weight is 0 get the plain velocity."""
    v = lambda x, t: torch.sin(x) * 0.5  # noqa: E731 - acts row by row
    rtc = _guidance("guided", h=8, d=3, s=2)
    x = torch.randn(2, 8, 4, dtype=torch.float64)
    tt = torch.full((2,), 0.6, dtype=torch.float64)
    out = rtc_velocity(v, x, tt, 0.6, rtc)
    assert torch.allclose(out[:, 6:], v(x, tt)[:, 6:], atol=0)
    assert torch.allclose(out[..., -1], v(x, tt)[..., -1], atol=0)  # padded dim unguided
    assert not torch.allclose(out[:, :3, :3], v(x, tt)[:, :3, :3])


# -- on the tiny policy ------------------------------------------------------------------
@pytest.fixture
def rtc_setup(tiny_policy, make_obs, noise_for):
    obs = make_obs(tiny_policy.adapter, seed=7)
    prev = tiny_policy.infer(obs, noise=noise_for(tiny_policy.adapter, seed=99)).actions[0]
    return tiny_policy, obs, prev, noise_for(tiny_policy.adapter, seed=1)


def test_policy_modes_pull_the_prefix_towards_the_executing_chunk(rtc_setup):
    pol, obs, prev, noise = rtc_setup
    d, s = 5, 25
    free_to = pol.chunk_size - s

    def errors(mode):
        rtc = None if mode == "none" else RTCRequest(mode, prev, d, s)
        a = pol.infer(obs, noise=noise, rtc=rtc).actions[0]
        return np.abs(a[:d] - prev[:d]).mean(), np.abs(a[d:free_to] - prev[d:free_to]).mean(), a

    base_fixed, base_soft, _ = errors("none")
    assert base_fixed > 0.1
    _, _, a_inp = errors("inpaint")
    np.testing.assert_allclose(a_inp[:d], prev[:d], atol=1e-5)  # robot units: exact in model space
    for mode in ("guided-approx", "guided"):
        fixed, soft, _ = errors(mode)
        assert fixed < 0.2 * base_fixed, mode
        assert soft < base_soft, mode


def test_daemon_side_modes_need_no_solver_guidance(tiny_policy):
    prefix = np.zeros((10, tiny_policy.action_dim), np.float32)
    assert tiny_policy.rtc_guidance(RTCRequest("crossfade", prefix, 2, 25), 1) is None
    assert tiny_policy.rtc_guidance(RTCRequest("none", prefix, 2, 25), 1) is None


def test_policy_rtc_guidance_layout_and_validation(tiny_policy):
    ad = tiny_policy.adapter
    prefix = np.random.default_rng(0).uniform(-1, 1, (20, ad.action_dim)).astype(np.float32)
    g = tiny_policy.rtc_guidance(RTCRequest("guided", prefix, 4, 40), batch=2)
    assert g.target.shape == (2, ad.chunk_size, ad.model_action_dim)
    assert torch.allclose(g.target[0, :20], ad.normalize_actions(prefix))
    assert torch.equal(g.target[:, 20:], torch.zeros(2, ad.chunk_size - 20, ad.model_action_dim))
    assert torch.equal(g.weights[20:], torch.zeros(ad.chunk_size - 20))  # nothing to agree with past n
    assert torch.equal(g.weights[:10], prefix_weights(ad.chunk_size, 4, 40)[:10])
    assert g.dim_mask.sum() == ad.action_dim and g.dim_mask[: ad.action_dim].all()
    with pytest.raises(ValueError, match="delay 21 exceeds"):
        tiny_policy.rtc_guidance(RTCRequest("guided", prefix, 21, 25), 1)
    with pytest.raises(ValueError, match="more than the chunk length"):
        tiny_policy.rtc_guidance(RTCRequest("guided", np.zeros((51, ad.action_dim)), 2, 25), 1)
    with pytest.raises(ValueError, match="RTC prefix must be"):
        tiny_policy.rtc_guidance(RTCRequest("guided", np.zeros((5, 3)), 2, 25), 1)
    bad = prefix.copy()
    bad[3, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        tiny_policy.rtc_guidance(RTCRequest("guided", bad, 2, 25), 1)


@pytest.mark.parametrize(("n", "s", "d"), [(20, 10, 3), (15, 25, 5), (25, 25, 3), (20, 40, 4)])
def test_soft_mask_decays_to_zero_where_the_prefix_ends(tiny_policy, n, s, d):
    """The decay ends where the executing chunk does. In the paper's Algorithm 1, s is the number
    of actions that really ran (A_prev = A_cur[s:], so H - s is the prefix length n). A prefix
    shorter than H - s (the daemon's chunking.horizon below the policy's chunk; or the executing
    index past s after a late chunk or missed slots) gets the mask of s' = H - n, not the H - s
    mask cut off at n (a cliff from ~0.25 to 0 for n=20, s=10). A prefix longer than H - s keeps
    the H - s mask."""
    h, a = tiny_policy.chunk_size, tiny_policy.action_dim
    prefix = np.random.default_rng(n).uniform(-1, 1, (n, a)).astype(np.float32)
    want = prefix_weights(h, d, max(s, h - n))
    g = tiny_policy.rtc_guidance(RTCRequest("guided", prefix, d, s), 1)
    assert torch.equal(g.weights, want)
    end = min(h - s, n)
    assert torch.equal(g.weights[end:], torch.zeros(h - end))
    # the last guided row is the decay's smallest step, c * (e^c - 1) / (e - 1) with c = 1 / (end - d + 1)
    c = 1.0 / (end - d + 1)
    assert float(g.weights[end - 1]) == pytest.approx(c * math.expm1(c) / (math.e - 1), abs=1e-6)
    per = tiny_policy.rtc_guidance_per_sample([RTCRequest("guided", prefix, d, s), None])
    assert torch.equal(per.weights[0], want) and torch.equal(per.weights[1], torch.zeros(h))


@pytest.mark.parametrize("mode", ["guided", "guided-approx"])
def test_guided_loop_equals_the_papers_loop_in_its_own_time_convention(mode):
    """The translation check: the paper (and its Kinetix code, `realtime_action` in
    Physical-Intelligence/real-time-chunking-kinetix src/model.py) integrates tau from 0 (noise)
    to 1 (data) with A_tau = tau A + (1 - tau) noise, v = A - noise, A1_hat = A_tau + (1 - tau) v
    and adds + min(beta, (1 - tau) / (tau r_tau^2)) * vjp(A1_hat, W (Y - A1_hat)). The model here
    runs t = 1 - tau with v_model = -v_paper; both loops must land on the same chunk."""
    h, dim, n, beta = 8, 4, 10, 5.0
    field = _field(seed=3, d=dim)
    # the paper's velocity of the same flow (the model is fed its time as float32, as integrate() does)
    f = lambda x, tau: -field(x, torch.full((x.shape[0],), 1.0 - tau, dtype=torch.float32))  # noqa: E731
    rtc = _guidance(mode, h=h, dim=dim, d=3, s=2, batch=2, seed=5)
    noise = torch.randn(2, h, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    mask = rtc.mask

    x = noise
    for k in range(n):
        tau = k / n
        with torch.enable_grad():
            x_in = x.detach().requires_grad_(True)
            v = f(x_in, tau)
            a1 = x_in + (1 - tau) * v
            err = ((rtc.target - a1) * mask).detach()
            corr = torch.autograd.grad(a1, x_in, err)[0] if mode == "guided" else err
        inv_r2 = (tau**2 + (1 - tau) ** 2) / (1 - tau) ** 2
        c = (1 - tau) / tau if tau > 0 else math.inf
        x = x + (1.0 / n) * (v.detach() + min(c * inv_r2, beta) * corr)

    got = integrate(field, noise, SolverSpec(n), rtc)
    assert float((got - x).abs().max()) < 1e-9, float((got - x).abs().max())
    # and the guidance did something: the unguided loop ends elsewhere
    assert not torch.allclose(integrate(field, noise, SolverSpec(n)), x, atol=1e-3)
