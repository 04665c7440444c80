"""The daemon with the real tiny PI0.5 (RTC inside the engine's solver)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from phyai_edge.control.daemon import Daemon
from phyai_edge.control.fakes import test_config
from phyai_edge.control.listener import Listener
from phyai_edge.control.protocol import Flag
from phyai_edge.control.rtc import ChunkQueue, DelayEstimator

policy_mod = pytest.importorskip("phyai_edge.engines.policy")


@pytest.fixture(scope="module")
def policy():
    return policy_mod.load_policy(adapter="pi05", preset="tiny", backend="eager", device="cpu")


def observation(p, level: int, state: float):
    from phyai_edge.adapters.base import Observation

    images = {n: np.full((64, 64, 3), level, np.uint8) for n in p.camera_names}
    return Observation(images=images, state=np.full(p.state_dim, state, np.float32), prompt="pick up the cube")


@pytest.mark.parametrize("mode", ["inpaint", "guided", "guided-approx"])
def test_new_chunk_agrees_with_the_executing_one(policy, mode):
    """The daemon's queue plans the request; the engine's solver honours it."""
    from phyai_edge.engines.base import RTCRequest

    h, s = policy.chunk_size, 20
    q = ChunkQueue(mode, h, s, 4, DelayEstimator(initial=4))
    first = policy.infer([observation(policy, 0, 0.0)]).actions[0]
    q.adopt(first, 1, start_slot=0, now_slot=3, obs_time_s=0.0)
    while not q.wants_inference():
        q.next_action()
    plan = q.plan(slot=s)
    np.testing.assert_array_equal(plan.prefix, first[s:])  # executing actions, aligned to the new chunk
    d = plan.delay
    obs2 = observation(policy, 90, 0.4)  # the world moved: a free chunk would disagree
    free = policy.infer([obs2]).actions[0]
    rtc = RTCRequest(mode, plan.prefix, d, s, 5.0)
    new = policy.infer([obs2], rtc=rtc).actions[0]
    free_gap = np.abs(free[:d] - plan.prefix[:d]).max()
    gap = np.abs(new[:d] - plan.prefix[:d]).max()
    assert free_gap > 0.5, "test needs observations whose free chunks differ"
    if mode == "inpaint":
        np.testing.assert_allclose(new[:d], plan.prefix[:d], rtol=0, atol=1e-5)
    else:
        assert gap < 0.1 * free_gap, (gap, free_gap)
    # Past the soft region the new chunk is free to follow the new observation.
    assert np.isfinite(new).all()


def test_daemon_with_real_tiny_model_inpaint(policy, tmp_path):
    cfg = test_config(
        cameras={"top": {"source": "synthetic", "width": 64, "height": 64}},
        chunking={"mode": "inpaint", "execution_horizon": 25},
        state={"source": "synthetic"},
    )
    d = Daemon(cfg, policy=policy, record_dir=str(tmp_path), realtime=False)
    d.setup()
    lis = Listener(d.publisher.endpoint, "action", keep=True)
    time.sleep(0.2)
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    end = time.monotonic() + 60
    while d.stats.adopted < 4 and time.monotonic() < end:
        lis.poll(0.05)
    d.stop()
    t.join(10)
    end = time.monotonic() + 2
    while not any(h.flags & Flag.SHUTDOWN for h, _ in lis.messages) and time.monotonic() < end:
        lis.poll(0.05)
    lis.close()
    assert d.stats.adopted >= 4, d.summary()
    assert lis.stats.gaps == 0 and lis.stats.repeats == 0 and lis.stats.nonfinite == 0
    # Every chunk after the first froze its first d (estimated) actions to the executing chunk's.
    recs = [np.load(f) for f in sorted(tmp_path.glob("obs_*.npz"))]
    with_prefix = [r for r in recs if r["prefix"].size and r["actions"].size]
    assert len(with_prefix) >= 2
    for r in with_prefix:
        dd = int(r["delay_estimate"])
        assert dd >= 1
        np.testing.assert_allclose(r["actions"][:dd], r["prefix"][:dd], atol=1e-5)
