"""Where a server batch's time goes (`BatchRecord`, `ServerStats.report()["by_size"]`), the
start-up warm-up that seeds the latency rule, and the rerun after a failed engine call being
counted rather than silent."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from phyai_edge.engines.base import InferenceResult, RTCRequest
from phyai_edge.serve import wire
from phyai_edge.serve.batching import BatchItem, ItemResult, run_items, warm_up
from phyai_edge.serve.client import RemotePolicy
from phyai_edge.serve.scheduler import Pending, SchedulerConfig
from phyai_edge.serve.server import LocalExecutor, PolicyServer, batch_record
from phyai_edge.serve.stats import BatchRecord, ServerStats, format_report


def test_batch_record_sums_each_engine_call_once():
    call_a = {"preprocess": 2.0, "embed_images": 5.0, "solver_loop": 20.0, "postprocess": 1.0, "total": 30.0}
    call_b = {"preprocess": 1.0, "postprocess": 0.5, "total": 10.0}
    results = [ItemResult(np.zeros((1, 2, 2)), batch=4, stage_ms=call_a),
               ItemResult(np.zeros((2, 2, 2)), batch=4, stage_ms=call_a),
               ItemResult(np.zeros((1, 2, 2)), batch=1, stage_ms=call_b, rerun=True),
               ItemResult(None, error="bad", rerun=True)]
    batch = [Pending(f"r{i}", i, n, 10.0, arrival=a) for i, (n, a) in enumerate([(1, 1.0), (2, 1.5), (1, 2.0), (1, 2.0)])]
    rec = batch_record(batch, results, t0=2.5, done=2.55)
    assert (rec.observations, rec.padded, rec.calls, rec.reruns) == (5, 5, 2, 2)
    assert rec.wait_ms == pytest.approx(1500.0) and rec.service_ms == pytest.approx(50.0)
    assert (rec.preprocess_ms, rec.postprocess_ms) == (3.0, 1.5)
    assert rec.engine_ms == pytest.approx(27.0 + 8.5)
    assert rec.batcher_ms == pytest.approx(50.0 - 3.0 - 35.5 - 1.5)


def test_stats_group_batches_by_padded_size():
    st = ServerStats()
    st.batch(8, BatchRecord(observations=5, padded=8, calls=1, wait_ms=4.0, service_ms=90.0, preprocess_ms=6.0,
                            engine_ms=80.0, postprocess_ms=0.5, reply_ms=0.2))
    st.batch(8, BatchRecord(observations=7, padded=8, calls=1, wait_ms=6.0, service_ms=110.0, engine_ms=100.0))
    st.batch(2, BatchRecord(observations=2, padded=2, calls=3, wait_ms=1.0, service_ms=40.0, reruns=2))
    rep = st.report()
    assert list(rep["by_size"]) == [2, 8]
    eight = rep["by_size"][8]
    assert eight["batches"] == 2 and eight["observations"] == 6.0 and eight["service_ms"] == 100.0
    assert eight["engine_ms"] == 90.0 and eight["batcher_ms"] == pytest.approx((3.5 + 10.0) / 2)
    assert rep["observations_per_batch"] == {"mean": pytest.approx(14 / 3), "max": 7} and rep["reruns"] == 2
    assert "batch   8: 2 runs, 6.0 real" in format_report(rep)


class CountingPolicy:
    """Stands in for a policy (the batcher's view of one), remembering each engine call's size."""

    chunk_size, action_dim, device, per_sample_rtc = 50, 14, "cpu", True
    adapter = SimpleNamespace(chunk_size=50, model_action_dim=32)

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []
        self.engine = SimpleNamespace(sample_noise=lambda n: torch.zeros(n, 50, 32))

    def infer(self, observations, rtc=None, noise=None):
        self.calls.append((len(observations), "none" if rtc is None else rtc[0].mode))
        return InferenceResult(np.zeros((len(observations), 50, 14), np.float32), noise, {"total": 1.0})


def test_a_batch_whose_engine_call_failed_is_no_batch_size(tiny_policy, make_obs):
    """An executor that raised gives its requests errors, and no engine call: it was counted as a
    batch of padded size 0, so the mean batch (0.5) fell below the real observations per batch (1.0)
    and the report showed a "batch 0" row."""
    class Flaky:
        fail = True

        def describe(self):
            return {}

        def run(self, items):
            if self.fail:
                raise RuntimeError("replica died")
            return [ItemResult(np.zeros((it.size, 50, 14), np.float32), batch=1, stage_ms={}) for it in items]

    ex = Flaky()
    srv = PolicyServer(ex, "tcp://127.0.0.1:*")
    item = BatchItem([make_obs(tiny_policy.adapter, size=(8, 8))])
    for fail in (True, False):
        ex.fail = fail
        srv._run_batch([Pending("a", int(fail), 1, 1e9, payload=(b"a", item), arrival=0.0)])
    rep = srv.report()
    assert (rep["batches"], rep["failed_batches"], rep["batch_size"]["mean"]) == (1, 1, 1.0)
    assert list(rep["by_size"]) == [1] and rep["robots"]["a"]["errors"] == 1
    assert "failed batches 1," in format_report(rep)


def test_every_request_of_a_batch_is_answered_whatever_the_executor_returns(tiny_policy, make_obs):
    """Results pair with requests by position: an executor that returned one for a batch of two
    left the second robot without any reply, to wait out its timeout."""
    class Short:
        def describe(self):
            return {}

        def run(self, items):
            return [ItemResult(np.zeros((1, 50, 14), np.float32), batch=2, stage_ms={})]

    srv = PolicyServer(Short(), "tcp://127.0.0.1:*")
    item = BatchItem([make_obs(tiny_policy.adapter, size=(8, 8))])
    srv._run_batch([Pending(r, i, 1, 1e9, payload=(r.encode(), item), arrival=0.0) for i, r in enumerate("ab")])
    replies = []
    while not srv._outbox.empty():
        ident, frames = srv._outbox.get_nowait()
        replies.append((ident, wire.decode_reply([bytes(f) for f in frames])))
    assert [(i, r.req_id, r.ok, r.error) for i, r in replies] == [(b"a", 0, False, wire.ERR_INFERENCE),
                                                                  (b"b", 1, False, wire.ERR_INFERENCE)]
    assert "answered 1 request(s) for a batch of 2" in replies[0][1].message


def test_warm_up_runs_every_size_for_every_observation_and_rtc_mode(make_obs):
    counted = CountingPolicy()
    obs = [make_obs(None, seed=1, size=(8, 8)), make_obs(None, seed=2, size=(8, 8), prompt="a much longer prompt " * 4)]
    rtc = RTCRequest("guided-approx", np.zeros((25, 14), np.float32), 10, 25)
    times = warm_up(counted, [1, 2, 4], obs, [None, rtc], repeats=2)
    assert sorted(times) == [1, 2, 4] and all(t > 0 for t in times.values())
    # Per size: two runs per RTC request for the first observation (the second is timed), one
    # per RTC request for the other.
    per_size = ["none", "none", "guided-approx", "guided-approx", "none", "guided-approx"]
    assert counted.calls == [(b, m) for b in (1, 2, 4) for m in per_size]
    with pytest.raises(ValueError, match="at least one observation"):
        warm_up(counted, [1], [])


class _FailsOnPrompt:
    """The policy, with an engine that fails on any call holding one request's prompt: a failure
    no check before batching can see (a wrong state, camera, image, prompt or noise never reaches
    a batch: `test_serve`'s refusals before batching)."""

    def __init__(self, policy, prompt: str) -> None:
        self.policy, self.prompt = policy, prompt

    def infer(self, observations, **kw):
        if any(o.prompt == self.prompt for o in observations):
            raise RuntimeError("the engine failed")
        return self.policy.infer(observations, **kw)

    def __getattr__(self, name):
        return getattr(self.policy, name)


def test_a_failed_call_reruns_alone_and_says_so(tiny_policy, make_obs, noise_for):
    """An engine call that fails reruns its requests one by one, so only the request it fails on
    fails."""
    a = tiny_policy.adapter
    policy = _FailsOnPrompt(tiny_policy, "poison")
    good = [BatchItem([make_obs(a, seed=i, size=(8, 8))], noise=noise_for(a, 1, seed=i)) for i in range(2)]
    bad = BatchItem([make_obs(a, seed=9, size=(8, 8), prompt="poison")], noise=noise_for(a, 1, seed=9))
    got = run_items(policy, [good[0], bad, good[1]])
    assert [r.rerun for r in got] == [True] * 3
    assert got[1].actions is None and "the engine failed" in got[1].error and not got[1].bad_request
    for item, r in zip(good, [got[0], got[2]]):
        np.testing.assert_array_equal(r.actions, run_items(policy, [item])[0].actions)
    assert not any(r.rerun for r in run_items(policy, good))


def test_server_reports_phases_and_learns_service_time_per_padded_size(tiny_policy, make_obs, noise_for):
    a = tiny_policy.adapter
    obs = make_obs(a, seed=3, size=(16, 16))
    executor = LocalExecutor(tiny_policy, [1, 2, 4], max_batch=4)
    srv = PolicyServer(executor, "tcp://127.0.0.1:*", SchedulerConfig(max_batch=4, window_s=0.05))
    assert srv.sched.batch_sizes == (1, 2, 4)  # taken from the executor: batches are priced padded
    seeded = srv.warm_up([obs])
    assert sorted(seeded) == [1, 2, 4] and sorted(srv.sched.service_estimates()) == [1, 2, 4]
    with srv:
        clients = [RemotePolicy(srv.endpoint, robot=f"r{i}", timeout_s=60) for i in range(3)]
        want = [tiny_policy.infer([obs], noise=noise_for(a, 1, seed=i)).actions for i in range(3)]
        got: dict[int, np.ndarray] = {}

        def call(i: int) -> None:
            got[i] = clients[i].infer([obs], noise=noise_for(a, 1, seed=i)).actions

        threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        rep = srv.report()
        for c in clients:
            c.close()
    for i in range(3):  # batched and padded, each robot still gets its own actions
        np.testing.assert_allclose(got[i], want[i], rtol=1e-5, atol=1e-5)
    assert sum(b["batches"] * b["observations"] for b in rep["by_size"].values()) == 3
    for size, b in rep["by_size"].items():
        assert size in (1, 2, 4) and b["preprocess_ms"] > 0 and b["engine_ms"] > 0
        assert b["service_ms"] >= b["preprocess_ms"] + b["engine_ms"] + b["postprocess_ms"]
    assert rep["intake_ms_per_request"] > 0 and rep["reruns"] == 0
    assert set(rep["service_estimate_ms"]) == {1, 2, 4}


def test_serve_command_batch_sizes_and_warm_inputs(tiny_policy):
    from phyai_edge.commands.serve import batch_sizes_for, warm_inputs

    assert batch_sizes_for("auto", "eager", tiny_policy.engine, 16) is None  # any size: padding would waste
    assert batch_sizes_for("auto", "cudagraph", None, 16) == [1, 2, 4, 8, 12, 16]
    assert batch_sizes_for("auto", "cudagraph", None, 64)[-4:] == [40, 48, 56, 64]
    assert batch_sizes_for("auto", "tensorrt", SimpleNamespace(batch_sizes=[8, 1]), 16) == [1, 8]  # a bundle's own
    assert batch_sizes_for("4,1,2", "cudagraph", None, 16) == [1, 2, 4]
    assert batch_sizes_for("any", "cudagraph", None, 16) is None
    with pytest.raises(SystemExit, match="--batch-sizes"):
        batch_sizes_for("1,x", "eager", None, 16)
    obs, rtcs = warm_inputs(tiny_policy, ["pick up the cube", "fold the towel"], "none,guided-approx")
    assert [o.prompt for o in obs] == ["pick up the cube", "fold the towel"]
    assert rtcs[0] is None and rtcs[1].mode == "guided-approx" and rtcs[1].prefix.shape == (25, 14)
    with pytest.raises(SystemExit, match="--warm-rtc"):
        warm_inputs(tiny_policy, None, "sideways")


def test_warming_a_prompt_keeps_room_for_it_with_any_robot_state():
    """PI0.5 writes the state into the prompt, so robots on one task send prompts of different
    lengths (54-65 tokens with the tiny tokenizer: two buckets). The local executor's warm-up has the
    engine keep room for its prompts with any state: a robot's request never captures graphs."""
    import math

    from phyai_edge.adapters.base import Observation
    from phyai_edge.engines.policy import load_policy

    policy = load_policy(preset="tiny", backend="cudagraph", device="cpu")
    prompt = "pick up the cube"
    frames = {n: np.zeros((32, 32, 3), np.uint8) for n in policy.camera_names}
    rng = np.random.default_rng(1)
    states = [(rng.standard_normal(policy.state_dim) * s).astype(np.float32) for s in (0.1, 1.0, 5.0) for _ in range(20)]
    lengths = [int(policy.adapter.prompt_tokens([Observation(frames, st, prompt)])[1].sum()) for st in states]
    assert len({math.ceil(n / 16) for n in lengths}) == 2
    executor = LocalExecutor(policy, [1, 2], max_batch=2)
    executor.warm_up([Observation(frames, states[lengths.index(max(lengths))], prompt)])
    warmed = set(policy.engine._sets)
    short = Observation(frames, states[lengths.index(min(lengths))], prompt)
    got = executor.run([BatchItem([short], None), BatchItem([short], None)])
    assert all(r.actions is not None for r in got)
    assert set(policy.engine._sets) == warmed and len(warmed) == 2  # one set per batch size


def test_with_prompt_room_a_batch_of_one_prompt_length_keeps_the_room():
    """From the unmasked graphs' batch size a batch whose prompts share one length keeps exactly that
    length (evaluation: one task, its graphs). Where prompt room is kept (the server, the daemon) it
    keeps the room instead: the warm-up's batches of one observation share a length, live batches of
    robots with their own states do not, so the warm-up must capture the room's graphs, and a live
    batch that happened to share a length must not capture its own. (The server benchmark showed it
    on an H100: 16 graph sets built while 48 robots waited, 0.7-3.5 s each.)"""
    from phyai_edge.adapters.base import Observation
    from phyai_edge.engines import cudagraph
    from phyai_edge.engines.policy import load_policy

    prompt = "pick up the cube"
    batch = cudagraph.DENSE_PREFIX_MIN_BATCH
    for room in (False, True):
        # the fused stages' reference path: on a CPU that is what gives the unmasked graphs
        policy = load_policy(preset="tiny", backend="cudagraph", device="cpu", engine_options={"triton_ops": "reference"})
        assert any(policy.engine._unmasked(batch))
        frames = {n: np.zeros((32, 32, 3), np.uint8) for n in policy.camera_names}
        rng = np.random.default_rng(1)
        states = [(rng.standard_normal(policy.state_dim) * 2).astype(np.float32) for _ in range(batch)]
        lengths = [int(policy.adapter.prompt_tokens([Observation(frames, st, prompt)])[1].sum()) for st in states]
        assert len(set(lengths)) > 1
        same = [Observation(frames, states[0], prompt)] * batch
        if room:  # what the executor's warm-up sets: here exactly this prompt's length
            policy.engine.min_prompt_positions = lengths[0]
        executor = LocalExecutor(policy, [batch], max_batch=batch)
        assert all(r.actions is not None for r in executor.run([BatchItem([o], None) for o in same]))
        (key,) = policy.engine._sets
        assert key[2] == (_bucketed(lengths[0]) if room else lengths[0]), (room, key)
        if room:
            mixed = executor.run([BatchItem([Observation(frames, st, prompt)], None) for st in states])
            assert all(r.actions is not None for r in mixed)
            assert set(policy.engine._sets) == {key}  # the room's graphs served the live batch


def _bucketed(tokens: int, bucket: int = 16) -> int:
    return -(-tokens // bucket) * bucket


def test_serve_runs_without_the_cameras_no_robot_has():
    """`serve --absent-camera`: the policy leaves those cameras out of the model (load_policy's
    absent_cameras), the hello reply names them, the warm-up observations lack them, so the warm-up
    captures the view count the robots' requests run and a request reuses it."""
    import argparse

    from phyai_edge.adapters.base import Observation
    from phyai_edge.commands.serve import add_arguments, warm_inputs
    from phyai_edge.engines.policy import load_policy
    from phyai_edge.serve.server import describe_policy

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--absent-camera", "left_wrist", "--absent-camera", "right_wrist"])
    assert args.absent_camera == ["left_wrist", "right_wrist"]
    policy = load_policy(preset="tiny", backend="cudagraph", device="cpu", absent_cameras=args.absent_camera)
    assert describe_policy(policy)["absent_cameras"] == ["left_wrist", "right_wrist"]
    obs, rtcs = warm_inputs(policy, None, "none")
    assert [n for n, img in obs[0].images.items() if img is not None] == ["top"]
    executor = LocalExecutor(policy, [1, 2], max_batch=2)
    executor.warm_up(obs, rtcs)
    warmed = set(policy.engine._sets)
    assert {key[:2] for key in warmed} == {(1, 1), (2, 1)}  # (batch, views): one view
    robot = Observation({"top": np.full((32, 32, 3), 7, np.uint8)}, np.zeros(policy.state_dim, np.float32), obs[0].prompt)
    got = executor.run([BatchItem([robot], None)])
    assert got[0].actions is not None and set(policy.engine._sets) == warmed
    with pytest.raises(ValueError, match="unknown cameras"):
        load_policy(preset="tiny", backend="eager", device="cpu", absent_cameras=["side"])


def test_prompt_tokens_keep_room_for_a_prompt_no_warm_up_ran() -> None:
    """`serve --prompt-tokens`: a robot's prompt that no --warm-prompt gave, longer than the warmed
    one's bucket, runs the graphs the warm-up captured when it fits the room; without the room it
    makes the engine build a graph set inside the request."""
    from phyai_edge.adapters.base import Observation
    from phyai_edge.engines.policy import load_policy

    frames = {"top": np.zeros((32, 32, 3), np.uint8)}
    longer = "pick up the red cube and put it down gently next to the blue bowl"  # 90 tokens at most (tiny)
    for room, builds in ((96, False), (0, True)):
        policy = load_policy(preset="tiny", backend="cudagraph", device="cpu")
        state = np.zeros(policy.state_dim, np.float32)
        assert policy.prompt_fit(longer)[0] > 80  # past "pick up the cube"'s 80-token bucket
        executor = LocalExecutor(policy, [1], max_batch=1, prompt_tokens=room)
        executor.warm_up([Observation(frames, state, "pick up the cube")])
        warmed = set(policy.engine._sets)
        got = executor.run([BatchItem([Observation(frames, state, longer)], None)])
        assert got[0].actions is not None
        assert (set(policy.engine._sets) != warmed) == builds, (room, policy.engine._sets)
        assert executor.graphs_built_serving == int(builds)  # counted (and logged) where it happens


def test_serve_refuses_prompt_tokens_where_no_warm_up_keeps_them(capsys) -> None:
    from phyai_edge.cli import main as cli

    assert cli(["serve", "--prompt-tokens", "96", "--no-warm", "--duration", "0.1"]) == 2
    assert "--prompt-tokens is kept by the start-up warm-up" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "says"), [
    (["--batch-sizes", "1,x"], "--batch-sizes: expected a comma list of integers"),  # exit 1, no prefix, after loading
    (["--batch-sizes", "0,4"], "--batch-sizes: sizes must be >= 1"),
    (["--warm-rtc", "sideways"], "--warm-rtc: unknown mode 'sideways'"),  # served on eager without a word
    (["--gpus-per-replica", "-1"], "--gpus-per-replica -1: expected a finite number >= 0"),
    (["--window-ms", "inf"], "--window-ms inf: expected a finite number of milliseconds"),  # waited out each budget
])
def test_serve_flags_are_refused_in_one_line_before_loading(monkeypatch, capsys, flags, says):
    from phyai_edge.cli import main as cli
    from phyai_edge.commands import common

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(common, "load_policy_or_fail", loaded)
    with pytest.raises(SystemExit) as exc:
        cli(["serve", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith(f"phyai-edge serve: {says}"), err


def test_serve_ray_takes_a_replica_without_gpus(monkeypatch):
    """0 is the default without cuda and what a CPU replica needs; given explicitly, it was
    refused as `expected a finite number > 0`."""
    import sys

    from phyai_edge.cli import main as cli

    asked = {}

    def deploy(load_kwargs, **kw):
        asked.update(kw)
        raise SystemExit(0)  # stop here: what was asked for is the test

    # Stands in for the module, which imports ray (an optional extra).
    monkeypatch.setitem(sys.modules, "phyai_edge.serve.ray_deployment",
                        SimpleNamespace(RayExecutor=SimpleNamespace(deploy=deploy)))
    with pytest.raises(SystemExit) as exc:
        cli(["serve", "--ray", "--gpus-per-replica", "0"])
    assert exc.value.code == 0 and asked["gpus_per_replica"] == 0.0
