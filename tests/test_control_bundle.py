"""The daemon runs from an exported engine bundle (`phyai-edge export --backend onnx`).

End to end: `model.bundle` in the daemon config, the policy in a worker process, finite policy
actions on the socket. And the daemon's inference path (config -> PolicySpec -> ProcessWorker
-> run_job) gives exactly what `load_policy(bundle=DIR).infer(...)` gives for the same
observation and noise: nothing in the daemon depends on which backend runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from test_control_daemon import Running

from phyai_edge.control.config import ConfigError
from phyai_edge.control.daemon import Daemon, policy_spec_from_config
from phyai_edge.control.fakes import test_config
from phyai_edge.control.protocol import Flag
from phyai_edge.control.worker import Job, ProcessWorker

pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    from phyai_edge.cli import main as cli

    out = tmp_path_factory.mktemp("engines") / "tiny-onnx"
    assert cli(["export", "--preset", "tiny", "--backend", "onnx", "--out", str(out), "--no-progress"]) == 0
    return out


def bundle_config(bundle: Path, **model):
    return test_config(
        cameras={"top": {"source": "synthetic", "width": 64, "height": 64}},
        model={"worker": "process", "bundle": str(bundle), "warmup": 1, "threads": 1, "load_timeout_s": 120, **model},
        chunking={"mode": "inpaint", "execution_horizon": 10},
    )


def test_bundle_key_is_validated_with_its_name(tmp_path, bundle):
    with pytest.raises(ConfigError, match=r"^model\.bundle: .* is not a folder; expected the folder written by"):
        bundle_config(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^model\.bundle: .* has no manifest\.json"):
        bundle_config(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"^model\.bundle: .*manifest\.json is not valid JSON"):
        bundle_config(tmp_path / "bad")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ConfigError, match=r"^model\.bundle: .*manifest\.json: format 'something-else'"):
        bundle_config(tmp_path / "other")
    with pytest.raises(ConfigError, match=r"^model\.bundle: set either model\.bundle or model\.factory"):
        bundle_config(bundle, factory="phyai_edge.control.fakes:make_fake_policy")
    spec = policy_spec_from_config(bundle_config(bundle))
    assert spec.factory == "phyai_edge.engines.policy:load_bundle_policy"
    assert spec.kwargs == {"bundle": str(bundle), "device": "cpu", "checkpoint": None}


def test_daemon_publishes_finite_policy_actions_from_the_onnx_bundle(bundle):
    cfg = bundle_config(bundle)
    run = Running(Daemon(cfg, realtime=False))
    d = run.daemon
    try:
        assert isinstance(d.worker, ProcessWorker)
        run.wait_for(lambda: d.stats.adopted >= 3 and sum(1 for h, _ in run.actions() if not h.flags & Flag.HOLD) >= 30,
                     60, "3 chunks from the bundle")
        run.stop()
    finally:
        if run.thread.is_alive():
            d.stop()
    acts = run.actions()
    seqs = [h.seq for h, _ in acts]
    assert seqs == list(range(len(seqs))) and run.listener.stats.gaps == 0
    policy = [(h, v) for h, v in acts if not h.flags & Flag.HOLD]
    assert len(policy) >= 30 and d.stats.failures == 0
    assert all(np.isfinite(v).all() and v.size == d.info.action_dim for _, v in policy)
    assert np.ptp(np.stack([v.reshape(-1) for _, v in policy]), axis=0).max() > 0, "actions vary: they come from the model"
    assert d.info.description == "Policy" and d.info.chunk_size == d.queue.horizon


def test_daemon_worker_path_equals_direct_load_policy_on_the_bundle(bundle):
    """Same observation, same noise, same RTC request: the worker process's chunk == the direct call."""
    from phyai_edge.adapters.base import Observation
    from phyai_edge.engines.base import RTCRequest
    from phyai_edge.engines.noise import frame_noise
    from phyai_edge.engines.policy import load_policy

    direct = load_policy(bundle=str(bundle))
    h, adim = direct.chunk_size, direct.adapter.model_action_dim
    rng = np.random.default_rng(7)
    images = {n: rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for n in direct.camera_names}
    images[direct.camera_names[-1]] = None  # a masked camera, as the daemon sends for unfed slots
    state = rng.standard_normal(direct.state_dim).astype(np.float32)
    noise = rng.standard_normal((1, h, adim)).astype(np.float32)
    prompt = "pick up the cube"

    # The worker runs this process's thread count (an earlier test may have set it: a thread
    # worker's spec does); a different count changes float summation order in torch's
    # pre/post-processing (differences ~1e-7).
    worker = ProcessWorker(policy_spec_from_config(bundle_config(bundle, threads=torch.get_num_threads())))
    worker.start(120)
    try:
        free = worker.run_sync(Job(1, dict(images), {}, state, prompt, time.monotonic(), noise=noise))
        assert free.error is None, free.error
        prefix = free.actions[10:]  # an executing chunk's remaining actions, as the daemon plans them
        joined = worker.run_sync(Job(2, dict(images), {}, state * 0.5, prompt, time.monotonic(), rtc_mode="inpaint",
                                     prefix=prefix, delay=4, execution_horizon=10, noise=noise))
        assert joined.error is None, joined.error
        # as the daemon sends its jobs: the worker draws the noise from (seed, 0, job number)
        keyed = worker.run_sync(Job(9, dict(images), {}, state, prompt, time.monotonic(), noise_seed=5))
        assert keyed.error is None and keyed.noise_seed == 5 and free.noise_seed is None
    finally:
        worker.close()

    obs = Observation(images=dict(images), state=state, prompt=prompt)
    want_free = direct.infer([obs], noise=torch.from_numpy(noise)).actions[0]
    obs2 = Observation(images=dict(images), state=state * 0.5, prompt=prompt)
    want_joined = direct.infer([obs2], rtc=RTCRequest("inpaint", prefix, 4, 10, 5.0), noise=torch.from_numpy(noise)).actions[0]
    assert np.isfinite(free.actions).all() and free.actions.shape == (h, direct.action_dim)
    np.testing.assert_array_equal(free.actions, np.asarray(want_free, np.float32))
    np.testing.assert_array_equal(joined.actions, np.asarray(want_joined, np.float32))
    np.testing.assert_allclose(joined.actions[:4], prefix[:4], atol=1e-5)  # inpaint held the prefix
    want_keyed = direct.infer([obs], noise=frame_noise(5, 0, 9, h, adim)).actions[0]
    np.testing.assert_array_equal(keyed.actions, np.asarray(want_keyed, np.float32))
    assert np.abs(keyed.actions - free.actions).max() > 1e-3  # the noise it drew is not the test's
    # The noise really is what decides the chunk (so equality above is not vacuous).
    other = direct.infer([obs], noise=torch.from_numpy(noise + 1.0)).actions[0]
    assert np.abs(np.asarray(other) - free.actions).max() > 1e-3
