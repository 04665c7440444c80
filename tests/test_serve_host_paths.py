"""The server's host work, made cheaper without changing what it computes: RTC guidance for a
batch built at once (against one `rtc_guidance(r, 1)` per sample joined by `batch_guidance`),
noise kept on the engine's device, request images left as views of their ZeroMQ frames."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq

from phyai_edge.engines.base import RTCRequest
from phyai_edge.engines.rtc import batch_guidance
from phyai_edge.serve import wire
from phyai_edge.serve.batching import BatchItem, item_noise, run_items
from phyai_edge.serve.server import request_item


def joined_per_sample(policy, requests):
    """What `rtc_guidance_per_sample` computed before it was built for the batch at once."""
    parts = [None if r is None else policy.rtc_guidance(r, 1) for r in requests]
    g = batch_guidance(parts, policy.adapter.chunk_size, policy.adapter.model_action_dim)
    if g is not None and bool((g.weights == g.weights[:1]).all()):
        g.weights = g.weights[0].clone()
    return g


def requests_mix(policy, seed):
    rng = np.random.default_rng(seed)
    a = policy.adapter

    def pre(n, lead=()):
        return rng.uniform(-3, 3, (*lead, n, a.action_dim)).astype(np.float32)

    return [
        RTCRequest("guided-approx", pre(25), 10, 25),
        None,
        RTCRequest("guided-approx", pre(30), 4, 20),
        RTCRequest("crossfade", pre(25), 10, 25),  # daemon-side: unguided in the batch
        RTCRequest("guided-approx", torch.from_numpy(pre(25, (1,))), 10, 25),
        RTCRequest("guided-approx", pre(12).astype(np.float64), 12, 25),
        RTCRequest("guided-approx", pre(25), 0, 25),
    ]


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_rtc_guidance_equals_per_sample_join(tiny_policy, seed):
    reqs = requests_mix(tiny_policy, seed)
    got, ref = tiny_policy.rtc_guidance_per_sample(reqs), joined_per_sample(tiny_policy, reqs)
    assert (got.mode, got.max_guidance_weight) == (ref.mode, ref.max_guidance_weight)
    for name in ("target", "weights", "dim_mask", "delays"):
        x, y = getattr(got, name), getattr(ref, name)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name


def test_batched_rtc_guidance_shared_mask_and_none(tiny_policy):
    a = tiny_policy.adapter
    same = [RTCRequest("inpaint", np.full((25, a.action_dim), 0.5, np.float32), 5, 25)] * 3
    got, ref = tiny_policy.rtc_guidance_per_sample(same), joined_per_sample(tiny_policy, same)
    assert got.weights.ndim == 1 and torch.equal(got.weights, ref.weights) and torch.equal(got.target, ref.target)
    assert tiny_policy.rtc_guidance_per_sample([None, RTCRequest("crossfade", same[0].prefix, 5, 25)]) is None


@pytest.mark.parametrize(("bad", "match"), [
    (RTCRequest("guided-approx", np.zeros((2, 25, 14), np.float32), 5, 25), "sample 1: a per-sample RTC prefix"),
    (RTCRequest("guided-approx", np.zeros((25, 13), np.float32), 5, 25), r"RTC prefix must be \(n, 14\)"),
    (RTCRequest("guided-approx", np.zeros((60, 14), np.float32), 5, 25), "more than the chunk length"),
    (RTCRequest("guided-approx", np.zeros((4, 14), np.float32), 5, 25), "delay 5 exceeds the 4"),
    (RTCRequest("guided-approx", np.full((25, 14), np.nan, np.float32), 5, 25), "NaN"),
    (RTCRequest("inpaint", np.zeros((25, 14), np.float32), 5, 25), "cannot batch RTC mode"),
])
def test_batched_rtc_guidance_errors(tiny_policy, bad, match):
    ok = RTCRequest("guided-approx", np.zeros((25, 14), np.float32), 5, 25)
    with pytest.raises(ValueError, match=match):
        tiny_policy.rtc_guidance_per_sample([ok, bad])


def test_noise_stays_on_the_engine_device(tiny_policy, make_obs):
    obs = make_obs(tiny_policy.adapter)
    drawn = item_noise(tiny_policy, BatchItem([obs, obs]))
    assert drawn.device == tiny_policy.device and drawn.shape == (2, 50, 32)
    given = np.random.default_rng(0).normal(size=(1, 50, 32))
    got = item_noise(tiny_policy, BatchItem([obs], noise=given))
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(given).float())
    # Padded to a captured size: the padding rows are zeros on the same device; real rows unchanged.
    alone = run_items(tiny_policy, [BatchItem([obs], noise=given)])[0].actions
    padded = run_items(tiny_policy, [BatchItem([obs], noise=given)], batch_sizes=[4])[0]
    assert padded.batch == 4
    np.testing.assert_allclose(padded.actions, alone, atol=1e-5)


def test_request_images_are_views_of_the_frames(tiny_policy, make_obs):
    """No copy at decode: the images are the received frames' memory (read-only), and what the
    policy makes of them equals what it makes of the robot's own arrays."""
    a = tiny_policy.adapter
    obs = make_obs(a, size=(48, 64))
    ctx = zmq.Context.instance()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind("inproc://host-paths-views")
    push.connect("inproc://host-paths-views")
    try:
        req = wire.Request("infer", 1, "r", None, [wire.WireObservation(obs.images, obs.state, obs.prompt)])
        push.send_multipart(wire.encode_request(req))
        frames = pull.recv_multipart(copy=False)
    finally:
        push.close(0)
        pull.close(0)
    item = request_item(wire.decode_request(frames))
    for name, img in item.observations[0].images.items():
        assert not img.flags.writeable and not img.flags.owndata
        assert np.array_equal(img, obs.images[name])
    assert item.observations[0].state.flags.writeable  # small arrays are copied
    noise = torch.zeros(1, a.chunk_size, a.model_action_dim)
    np.testing.assert_array_equal(tiny_policy.infer(item.observations, noise=noise).actions,
                                  tiny_policy.infer([obs], noise=noise).actions)
