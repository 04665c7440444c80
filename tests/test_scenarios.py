"""One runtime, four scenarios: the same observation and noise give the same actions through the
daemon-facing `Policy`, the daemon's worker path (`control.worker.run_job`), batch evaluation,
the RL rollout API and the multi-robot server (plus per-sample RTC underneath them).

"Same backend and batch composition" means bit-identical; a different batch composition
(the same sample next to others) is allowed float rounding (1e-5 in float32 here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phyai_edge.engines.base import RTCRequest
from phyai_edge.serve.batching import BatchItem, group_items, run_items
from phyai_edge.serve.client import RemotePolicy
from phyai_edge.serve.evaluate import evaluate, frame_noise, read_recording, write_synthetic_recording
from phyai_edge.serve.rollout import RolloutPolicy
from phyai_edge.serve.scheduler import SchedulerConfig
from phyai_edge.serve.server import LocalExecutor, PolicyServer

TOL = 1e-5


class FixedNoise:
    """A PolicyLike for the daemon's worker that injects known noise (the worker calls
    `infer(obs, rtc=rtc)` without noise, as the daemon does)."""

    def __init__(self, inner, noise) -> None:
        self.inner, self.noise = inner, noise
        for k in ("chunk_size", "action_dim", "state_dim", "camera_names"):
            setattr(self, k, getattr(inner, k))

    def infer(self, observations, rtc=None, noise=None):
        return self.inner.infer(observations, rtc=rtc, noise=self.noise)


@pytest.fixture
def case(tiny_policy, make_obs, noise_for):
    obs = make_obs(tiny_policy.adapter, seed=11, size=(40, 56))
    noise = noise_for(tiny_policy.adapter, 1, seed=12)
    prefix = np.random.default_rng(13).uniform(-1, 1, (27, 14)).astype(np.float32)
    rtc = RTCRequest("guided-approx", prefix, 5, 25)
    return obs, noise, rtc


def test_daemon_rollout_serve_paths_give_identical_actions(tiny_policy, case):
    from phyai_edge.control.worker import Job, run_job

    obs, noise, rtc = case
    direct = tiny_policy.infer([obs], rtc=rtc, noise=noise).actions

    # The daemon's worker path: a Job as the daemon builds it, through run_job.
    job = Job(1, dict(obs.images), {}, obs.state, obs.prompt, 0.0, rtc.mode, rtc.prefix, rtc.delay,
              rtc.execution_horizon, rtc.max_guidance_weight)
    res = run_job(FixedNoise(tiny_policy, noise), job)
    assert res.error is None, res.error
    np.testing.assert_array_equal(res.actions, direct[0])

    # The RL rollout API, one environment.
    out = RolloutPolicy(tiny_policy).act([obs], rtc=[rtc], noise=noise)
    np.testing.assert_array_equal(out.actions, direct)

    # The multi-robot server, one robot; and the daemon's worker driving the server as its engine.
    with PolicyServer(LocalExecutor(tiny_policy), "tcp://127.0.0.1:*", SchedulerConfig(window_s=0.0)) as srv, \
            RemotePolicy(srv.endpoint, robot="arm") as remote:
        np.testing.assert_array_equal(remote.infer([obs], rtc=rtc, noise=noise).actions, direct)
        res = run_job(FixedNoise(remote, noise.numpy()), job)
        assert res.error is None, res.error
        np.testing.assert_array_equal(res.actions, direct[0])


def test_eval_replays_a_recording_to_the_recorded_actions(tiny_policy, tmp_path):
    """Write a recording whose 'actions' are what the direct Policy gives on each frame's
    evaluation noise; `evaluate` (one frame per call) must then find zero error."""
    a = tiny_policy.adapter
    root = write_synthetic_recording(tmp_path / "rec", episodes=2, frames=3, camera_names=a.camera_names)
    episodes = read_recording(root)
    for e, ep in enumerate(episodes):
        for i, f in enumerate(ep.frames):
            noise = frame_noise(7, e, i, a.chunk_size, a.model_action_dim)
            f.target = tiny_policy.infer([f.obs], rtc=f.rtc, noise=noise).actions[0]
    assert any(f.rtc is not None for ep in episodes for f in ep.frames), "the recording should carry RTC prefixes"
    rep = evaluate(tiny_policy, episodes, batch=1, seed=7)
    assert rep["overall"]["recorded_max"] == 0.0 and rep["overall"]["failures"] == 0
    # Batched frames (a different batch composition): within float rounding.
    rep = evaluate(tiny_policy, episodes, batch=6, seed=7)
    assert rep["overall"]["recorded_max"] < TOL


def test_batch_composition_changes_actions_only_by_rounding(tiny_policy, make_obs, noise_for):
    """Eight robots in one batch, each with its own delay and prefix (per-sample RTC), against
    each robot alone."""
    a = tiny_policy.adapter
    rng = np.random.default_rng(0)
    items = []
    for i in range(8):
        rtc = None if i % 4 == 3 else RTCRequest("guided-approx", rng.uniform(-1, 1, (30, 14)).astype(np.float32), i % 5, 25)
        items.append(BatchItem([make_obs(a, seed=100 + i, size=(24, 32))], rtc, noise_for(a, 1, seed=200 + i)))
    assert group_items(items) == [list(range(8))], "mixed delays in guided mode share one engine call"
    together = run_items(tiny_policy, items)
    assert {r.batch for r in together} == {8}  # one engine call, no fallback to one-by-one runs
    for it, r in zip(items, together):
        alone = tiny_policy.infer(it.observations, rtc=it.rtc, noise=it.noise).actions
        np.testing.assert_allclose(r.actions, alone, atol=TOL, rtol=0)


def test_padding_to_captured_batch_sizes_keeps_actions(tiny_policy, make_obs, noise_for):
    a = tiny_policy.adapter
    items = [BatchItem([make_obs(a, seed=i, size=(24, 32))], None, noise_for(a, 1, seed=i)) for i in range(3)]
    plain = run_items(tiny_policy, items)
    padded = run_items(tiny_policy, items, batch_sizes=[1, 4])
    assert {r.batch for r in padded} == {4}
    for p, q in zip(plain, padded):
        np.testing.assert_allclose(p.actions, q.actions, atol=TOL, rtol=0)
    split = run_items(tiny_policy, items, batch_sizes=[2])  # larger than the largest size: split and pad
    assert [r.batch for r in split] == [2, 2, 2]


def test_inpaint_requests_with_different_delays_share_a_call(tiny_policy, make_obs, noise_for):
    """Per-sample hard prefixes: inpaint requests with different d (and an unguided rider, d = 0)
    run as one engine call, each as it would alone, each holding its own first d_i actions."""
    a = tiny_policy.adapter
    pre = np.random.default_rng(1).uniform(-1, 1, (30, 14)).astype(np.float32)
    items = [BatchItem([make_obs(a, seed=i, size=(24, 32))], RTCRequest("inpaint", pre, d, 25), noise_for(a, 1, seed=i))
             for i, d in enumerate([2, 4, 2])]
    items.append(BatchItem([make_obs(a, seed=9, size=(24, 32))], None, noise_for(a, 1, seed=9)))
    groups = group_items(items)
    assert sorted(map(sorted, groups)) == [[0, 1, 2, 3]]
    got = run_items(tiny_policy, items)
    assert [r.batch for r in got] == [4, 4, 4, 4]  # one call, no fallback to one-by-one runs
    for it, r in zip(items, got):
        alone = tiny_policy.infer(it.observations, rtc=it.rtc, noise=it.noise).actions
        np.testing.assert_allclose(r.actions, alone, atol=TOL, rtol=0)
        if it.rtc is not None:  # the hard prefix holds exactly where it was forced
            d = it.rtc.delay
            np.testing.assert_allclose(r.actions[0, :d], pre[:d], atol=1e-4)


def test_per_sample_rtc_matches_shared_rtc_and_validates(tiny_policy, make_obs, noise_for):
    a = tiny_policy.adapter
    obs = [make_obs(a, seed=i, size=(24, 32)) for i in range(3)]
    noise = noise_for(a, 3, seed=3)
    pre = np.random.default_rng(2).uniform(-1, 1, (3, 30, 14)).astype(np.float32)
    for mode in ("guided-approx", "guided", "inpaint"):
        shared = tiny_policy.infer(obs, rtc=RTCRequest(mode, pre, 5, 25), noise=noise).actions
        per = tiny_policy.infer(obs, rtc=[RTCRequest(mode, pre[i], 5, 25) for i in range(3)], noise=noise).actions
        np.testing.assert_array_equal(shared, per)  # (B, H) weights equal to (H,) broadcast, bit for bit
    g = tiny_policy.rtc_guidance_per_sample([RTCRequest("guided", pre[0], 2, 25), None,
                                             RTCRequest("guided", pre[2], 7, 25)])
    assert g.weights.shape == (3, 50) and g.mask.shape == (3, 50, 32)
    assert float(g.weights[1].abs().sum()) == 0.0 and float(g.weights[0, :2].min()) == 1.0
    assert float(g.weights[2, :7].min()) == 1.0 and float(g.weights[0, 2]) < 1.0
    with pytest.raises(ValueError, match="group requests by mode"):
        tiny_policy.rtc_guidance_per_sample([RTCRequest("guided", pre[0], 2, 25), RTCRequest("inpaint", pre[1], 2, 25)])
    g = tiny_policy.rtc_guidance_per_sample([RTCRequest("inpaint", pre[0], 2, 25), None,
                                             RTCRequest("inpaint", pre[1], 3, 25)])
    assert g.delays.tolist() == [2, 0, 3] and g.delay == 3
    assert g.fixed_mask(50)[:, :, 0].sum(dim=1).tolist() == [2, 0, 3]
    with pytest.raises(ValueError, match="2 RTC requests for 3"):
        tiny_policy.infer(obs, rtc=[None, None], noise=noise)


def test_engine_noise_stream_is_used_when_no_noise_is_given(tiny_policy, make_obs):
    a = tiny_policy.adapter
    item = BatchItem([make_obs(a, seed=1, size=(24, 32))])
    gen_state = tiny_policy.engine.generator.get_state()
    first = run_items(tiny_policy, [item])[0].actions
    tiny_policy.engine.generator.set_state(gen_state)
    again = tiny_policy.infer(item.observations, noise=tiny_policy.engine.sample_noise(1)).actions
    np.testing.assert_array_equal(first, again)
    assert torch.isfinite(torch.from_numpy(first)).all()


def test_engine_with_one_mask_per_batch_groups_by_delay(tiny_policy, make_obs, noise_for):
    """An engine that takes one RTC mask per batch says per_sample_rtc = False (no built-in one
    does any more); then only requests with equal soft masks share a call, and they reach the
    engine in the shared (H,) form."""
    a = tiny_policy.adapter
    tiny_policy.per_sample_rtc = False
    pre = np.random.default_rng(4).uniform(-1, 1, (30, 14)).astype(np.float32)
    items = [BatchItem([make_obs(a, seed=i, size=(24, 32))], RTCRequest("guided-approx", pre, d, 25),
                       noise_for(a, 1, seed=i)) for i, d in enumerate([2, 4, 2])]
    items.append(BatchItem([make_obs(a, seed=5, size=(24, 32))], None, noise_for(a, 1, seed=5)))
    assert sorted(map(sorted, group_items(items, per_sample=False))) == [[0, 2], [1], [3]]
    seen = []
    run = tiny_policy.engine.run
    tiny_policy.engine.run = lambda inputs, noise=None, rtc=None: seen.append(rtc) or run(inputs, noise, rtc)
    got = run_items(tiny_policy, items)
    assert [r.batch for r in got] == [2, 1, 2, 1]
    assert all(g is None or g.weights.shape == (50,) for g in seen)
    for it, r in zip(items, got):
        alone = tiny_policy.infer(it.observations, rtc=it.rtc, noise=it.noise).actions
        np.testing.assert_allclose(r.actions, alone, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="one RTC soft mask per batch"):
        tiny_policy.rtc_guidance_per_sample([items[0].rtc, items[1].rtc])


def test_cudagraph_backend_through_the_batcher_matches_eager(tiny_policy, make_obs, noise_for):
    """The cudagraph engine (run eagerly on CPU: same code, no capture) takes per-sample RTC
    (static (B, H, D) mask and (B, H, 1) prefix buffers); the batcher keeps mixed delays in one
    call and pads to captured sizes, and the actions match the eager engine's within float32
    rounding (a different backend and batch composition)."""
    from phyai_edge.engines.policy import load_policy

    fast = load_policy(backend="cudagraph", device="cpu", dtype="float32")
    assert tiny_policy.per_sample_rtc and fast.per_sample_rtc
    a = tiny_policy.adapter
    pre = np.random.default_rng(6).uniform(-1, 1, (25, 14)).astype(np.float32)
    items = [BatchItem([make_obs(a, seed=i, size=(24, 32))], RTCRequest("guided-approx", pre, d, 25),
                       noise_for(a, 1, seed=i)) for i, d in enumerate([3, 3, 5])]
    items.append(BatchItem([make_obs(a, seed=7, size=(24, 32))], None, noise_for(a, 1, seed=7)))
    ref = run_items(tiny_policy, items)
    got = run_items(fast, items, batch_sizes=[1, 2, 8])
    assert [r.batch for r in ref] == [4, 4, 4, 4] and [r.batch for r in got] == [8, 8, 8, 8]
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g.actions, r.actions, atol=TOL, rtol=0)
    padded = run_items(fast, items[:1], batch_sizes=[2])  # a pad row copies the real row's RTC
    assert padded[0].batch == 2 and padded[0].error == ""
    np.testing.assert_allclose(padded[0].actions, ref[0].actions, atol=TOL, rtol=0)
