"""The RL rollout API: per-environment noise streams, per-environment RTC state, and the
gymnasium example."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from phyai_edge.engines.base import RTCRequest
from phyai_edge.serve.rollout import RolloutChunks, RolloutPolicy

TOL = 1e-5


def test_environment_noise_does_not_depend_on_the_batch(tiny_policy, make_obs):
    a = tiny_policy.adapter
    obs = [make_obs(a, seed=i, size=(24, 32)) for i in range(3)]
    full = RolloutPolicy(tiny_policy, seed=4).act(obs)
    assert full.actions.shape == (3, 50, 14) and full.batches == 1
    # Environment 2 alone, with a fresh runner: same stream, so the same actions.
    alone = RolloutPolicy(tiny_policy, seed=4).act([obs[2]], env_ids=[2])
    np.testing.assert_allclose(alone.actions[0], full.actions[2], atol=TOL, rtol=0)
    # Streams advance per environment: the next call draws new noise.
    r = RolloutPolicy(tiny_policy, seed=4)
    first, second = r.env_noise([0]), r.env_noise([0])
    assert not np.array_equal(first.numpy(), second.numpy())
    assert not np.array_equal(RolloutPolicy(tiny_policy, seed=5).env_noise([0]).numpy(), first.numpy())


def test_max_batch_above_the_largest_captured_size_splits_there(tiny_policy, make_obs):
    """max_batch larger than the largest captured batch size: groups split at that size (an
    engine with captured shapes runs no larger batch), rather than failing as one call and
    rerunning every environment alone."""
    a = tiny_policy.adapter
    obs = [make_obs(a, seed=i, size=(24, 32)) for i in range(6)]
    sizes = []
    run = tiny_policy.engine.run
    tiny_policy.engine.run = lambda inputs, noise=None, rtc=None: sizes.append(inputs.batch_size) or run(inputs, noise, rtc)
    got = RolloutPolicy(tiny_policy, batch_sizes=[1, 4], max_batch=8, seed=2).act(obs)
    assert sizes == [4, 4] and got.batches == 2  # 4 + 2 padded to 4; no failed call, no reruns
    tiny_policy.engine.run = run
    ref = RolloutPolicy(tiny_policy, seed=2).act(obs)
    np.testing.assert_allclose(got.actions, ref.actions, atol=TOL, rtol=0)


def test_act_validates_and_reports_failures(tiny_policy, make_obs):
    a = tiny_policy.adapter
    obs = [make_obs(a, seed=0, size=(24, 32)), make_obs(a, seed=1, size=(24, 32), state=np.zeros(3, np.float32))]
    r = RolloutPolicy(tiny_policy)
    with pytest.raises(ValueError, match="1 RTC requests for 2"):
        r.act(obs, rtc=[None])
    with pytest.raises(RuntimeError, match=r"environment 1: inference failed.*state has 3 values"):
        r.act(obs)
    with pytest.raises(ValueError, match="at least one"):
        r.act([])


def test_rollout_chunks_follow_the_daemons_rtc_timing():
    h, a = 10, 2
    ch = RolloutChunks(2, execution_horizon=4)
    assert ch.requests(2) == [None, None]  # nothing executing yet
    first = np.arange(2 * h * a, dtype=np.float32).reshape(2, h, a)
    ch.update(first, delay=2)  # no executing chunk: starts at index 0
    for i in range(4):
        np.testing.assert_array_equal(ch.next_actions(), first[:, i])
    reqs = ch.requests(2)
    assert all(isinstance(r, RTCRequest) and r.delay == 2 and r.execution_horizon == 4 for r in reqs)
    np.testing.assert_array_equal(reqs[0].prefix, first[0, 4:])  # the rest of the executing chunk
    second = first + 1000
    ch.update(second, delay=2)
    # Two more actions of the old chunk run (committed while the new one was computed) ...
    np.testing.assert_array_equal(ch.next_actions(), first[:, 4])
    np.testing.assert_array_equal(ch.next_actions(), first[:, 5])
    # ... then the new chunk takes over at its index d = 2.
    np.testing.assert_array_equal(ch.next_actions(), second[:, 2])
    ch.reset([1])
    assert ch.requests(0)[1] is None
    with pytest.raises(RuntimeError, match="no chunk"):
        ch.next_actions()
    with pytest.raises(ValueError, match="exceeds"):
        ch.requests(100)


def test_mixed_delays_share_one_call_and_match_single_env_calls(tiny_policy, make_obs):
    a = tiny_policy.adapter
    obs = [make_obs(a, seed=i, size=(24, 32)) for i in range(3)]
    runner = RolloutPolicy(tiny_policy, seed=1)
    ch = RolloutChunks(3, execution_horizon=25)
    ch.update(runner.act(obs).actions)
    for _ in range(25):
        ch.next_actions()
    delays = [0, 3, 7]
    reqs = ch.requests(delays)
    noise = runner.env_noise([0, 1, 2])
    out = runner.act(obs, rtc=reqs, noise=noise)
    assert out.batches == 1
    for e in range(3):
        alone = tiny_policy.infer([obs[e]], rtc=reqs[e], noise=noise[e:e + 1]).actions
        np.testing.assert_allclose(out.actions[e], alone[0], atol=TOL, rtol=0)


@pytest.mark.skipif(importlib.util.find_spec("gymnasium") is None,
                    reason="gymnasium not installed (pip install 'phyai-edge[rl]')")
def test_gymnasium_example_runs():
    path = Path(__file__).resolve().parents[1] / "examples" / "rollout_gymnasium.py"
    spec = importlib.util.spec_from_file_location("rollout_gymnasium", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["rollout_gymnasium"] = mod
    spec.loader.exec_module(mod)
    # 70 steps over 60-step episodes: periodic inference, RTC with a delay, and resets.
    res = mod.rollout(num_envs=3, steps=70, execution_horizon=25, delay=3)
    assert res["envs"] == 3 and res["inferences"] >= 4 and np.isfinite(res["mean_return"])


@pytest.mark.parametrize("s,d", [(2, 3), (1, 4), (3, 3), (4, 2)])
def test_rollout_chunks_run_what_each_request_promised(s: int, d: int) -> None:
    """Every request's prefix is what runs in the d steps after it, and the new chunk takes over
    at its own index d, also when the next request comes before the last chunk took over (s < d):
    the prefix then runs through the chunk still waiting, and the new chunk replaces it."""
    h, a = 10, 1
    ch = RolloutChunks(1, execution_horizon=s)
    rng = np.random.default_rng(s * 10 + d)
    ch.update(rng.standard_normal((1, h, a)).astype(np.float32))
    for _ in range(s):
        ch.next_actions()
    promises: list[tuple[int, np.ndarray, np.ndarray]] = []  # (step asked at, prefix, the chunk it asked for)
    ran: list[np.ndarray] = []
    for _ in range(6):
        (req,) = ch.requests(d)
        assert req is not None and len(req.prefix) >= d
        new = rng.standard_normal((1, h, a)).astype(np.float32)
        ch.update(new, delay=d)
        promises.append((len(ran), req.prefix, new[0]))
        ran.extend(ch.next_actions()[0] for _ in range(s))
    for at, prefix, new in promises:
        for i in range(d):  # committed while the chunk was computed: the prefix
            if at + i < len(ran):
                np.testing.assert_array_equal(ran[at + i], prefix[i])
        if at + d < len(ran):  # then the new chunk from its index d (a later one takes over later still)
            np.testing.assert_array_equal(ran[at + d], new[d])
