"""The engine as a Ray Serve deployment on a local Ray instance (CPU): the ZeroMQ front with a
`RayExecutor` gives robots the same actions as the local engine, and Ray-native callers get
batched by `@serve.batch`.

Ray is an optional extra (`pip install 'phyai-edge[ray]'`): without it this file is skipped.
Starting a local Ray instance takes ~10 s, hence `slow`.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from phyai_edge.engines.base import RTCRequest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # ray's own pydantic deprecations
    pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                       reason="ray[serve] not installed (optional extra: pip install 'phyai-edge[ray]')"),
]

# The replica runs in another process with its own torch thread count, so matmul reductions may
# be ordered differently: the same backend within float32 rounding, not bit for bit.
TOL = 1e-5


@pytest.fixture(scope="module")
def ray_executor():
    import ray

    from phyai_edge.serve.ray_deployment import RayExecutor

    ray.init(num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False)
    try:
        ex = RayExecutor.deploy({"preset": "tiny", "seed": 0}, replicas=1, cpus_per_replica=0.5, threads=1,
                                max_batch=8, app_name="phyai_edge_test")
        yield ex
        ex.shutdown()
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def test_ray_deployment_behind_the_zeromq_front(ray_executor, tiny_policy, make_obs, noise_for):
    from phyai_edge.serve.client import RemotePolicy
    from phyai_edge.serve.scheduler import SchedulerConfig
    from phyai_edge.serve.server import PolicyServer

    a = tiny_policy.adapter
    obs = make_obs(a, seed=3, size=(24, 32))
    noise = noise_for(a, 1, seed=4)
    rtc = RTCRequest("guided-approx", np.random.default_rng(5).uniform(-1, 1, (30, 14)).astype(np.float32), 4, 25)
    assert ray_executor.describe()["camera_names"] == tiny_policy.camera_names
    with PolicyServer(ray_executor, "tcp://127.0.0.1:*", SchedulerConfig(window_s=0.0), workers=1) as srv, \
            RemotePolicy(srv.endpoint, robot="arm", timeout_s=60) as remote:
        got = remote.infer([obs], rtc=rtc, noise=noise).actions
    want = tiny_policy.infer([obs], rtc=rtc, noise=noise).actions
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_a_ray_server_checks_instructions(ray_executor, tiny_policy):
    """The daemon asks its server whether an instruction fits before taking it; a server whose
    engine runs as Ray replicas answered that it could not check (the front holds no policy).
    A replica answers now: no warm-up there, so the room is what the model takes."""
    from phyai_edge.serve.client import RemotePolicy
    from phyai_edge.serve.scheduler import SchedulerConfig
    from phyai_edge.serve.server import PolicyServer

    with PolicyServer(ray_executor, "tcp://127.0.0.1:*", SchedulerConfig(window_s=0.0), workers=1) as srv, \
            RemotePolicy(srv.endpoint, robot="arm", timeout_s=60) as remote:
        short = remote.prompt_fit("go")
        long = remote.prompt_fit(" ".join(["pick up the red cube and put it in the bowl"] * 40))
    assert short == tiny_policy.prompt_fit("go") and short[0] is not None and short[0] < short[1]
    assert long[0] is not None and long[2] is not None and long[0] > long[2]  # too long for the model: refused


def test_ray_native_callers_are_batched(ray_executor, tiny_policy, make_obs, noise_for):
    from phyai_edge.serve.batching import BatchItem

    a = tiny_policy.adapter
    items = [BatchItem([make_obs(a, seed=10 + i, size=(24, 32))], None, noise_for(a, 1, seed=20 + i)) for i in range(4)]
    responses = [ray_executor.handle.infer.remote(it) for it in items]
    results = [r.result(timeout_s=60) for r in responses]
    assert max(r.batch for r in results) > 1, "concurrent calls should share a replica batch"
    for it, r in zip(items, results):
        want = tiny_policy.infer(it.observations, noise=it.noise).actions
        np.testing.assert_allclose(r.actions, want, atol=TOL, rtol=0)


@pytest.mark.parametrize(("flags", "gpus"), [(["--device", "cuda"], 1.0), (["--device", "cpu"], 0.0),
                                             (["--device", "cuda", "--gpus-per-replica", "0.5"], 0.5)])
def test_serve_ray_gives_each_replica_a_gpu_when_the_engine_runs_on_one(monkeypatch, flags, gpus):
    """Ray hides the GPUs from a replica given none: `--device cuda` alone must ask for one each."""
    from phyai_edge.cli import main as cli
    from phyai_edge.serve import ray_deployment

    asked = {}

    def deploy(load_kwargs, **kw):
        asked.update(kw)
        raise SystemExit(0)  # stop here: what was asked for is the test

    monkeypatch.setattr(ray_deployment.RayExecutor, "deploy", staticmethod(deploy))
    with pytest.raises(SystemExit):
        cli(["serve", "--ray", "--replicas", "2", *flags])
    assert asked["gpus_per_replica"] == gpus and asked["replicas"] == 2
