"""The multi-robot server: wire format, scheduler (deadlines, fairness, back-pressure), and the
ZeroMQ server with `RemotePolicy` clients on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from phyai_edge.engines.base import RTCRequest
from phyai_edge.serve import wire
from phyai_edge.serve.batching import ItemResult
from phyai_edge.serve.client import RemotePolicy, ServeError, ServerBusyError
from phyai_edge.serve.scheduler import Pending, Scheduler, SchedulerConfig
from phyai_edge.serve.server import LocalExecutor, PolicyServer, describe_policy, request_item


# -- wire -----------------------------------------------------------------------------------
def test_wire_request_round_trip(make_obs, tiny_adapter):
    obs = make_obs(tiny_adapter, size=(8, 10))
    obs.images["left_wrist"] = None
    prefix = np.arange(30 * 14, dtype=np.float32).reshape(30, 14)
    noise = np.random.default_rng(0).standard_normal((1, 50, 32)).astype(np.float32)
    req = wire.Request("infer", 5, "arm-1", 250.0, [obs], wire.WireRTC("guided", prefix, 4, 25, 3.0), noise)
    frames = [bytes(f) for f in wire.encode_request(req)]
    got = wire.decode_request(frames)
    assert (got.kind, got.req_id, got.robot, got.budget_ms) == ("infer", 5, "arm-1", 250.0)
    o = got.observations[0]
    assert o.images["left_wrist"] is None
    np.testing.assert_array_equal(o.images["top"], obs.images["top"])
    np.testing.assert_array_equal(o.state, obs.state)
    assert o.prompt == obs.prompt
    assert (got.rtc.mode, got.rtc.delay, got.rtc.execution_horizon, got.rtc.max_guidance_weight) == ("guided", 4, 25, 3.0)
    np.testing.assert_array_equal(got.rtc.prefix, prefix)
    np.testing.assert_array_equal(got.noise, noise)


def test_wire_rejects_malformed_messages_naming_the_field():
    good = wire.encode_request(wire.Request("hello", 1, "r"))
    with pytest.raises(wire.WireError, match="header is not JSON"):
        wire.decode_request([b"\xff"])
    with pytest.raises(wire.WireError, match="wire version"):
        wire.decode_request([b'{"v": 99, "type": "hello", "id": 1, "robot": "r"}'])
    with pytest.raises(wire.WireError, match="robot"):
        wire.decode_request([b'{"v": 1, "type": "hello", "id": 1, "robot": ""}'])
    with pytest.raises(wire.WireError, match="id: expected an integer, got True"):
        wire.decode_request([b'{"v": 1, "type": "hello", "id": true, "robot": "r"}'])
    with pytest.raises(wire.WireError, match="obs"):
        wire.decode_request([b'{"v": 1, "type": "infer", "id": 1, "robot": "r", "obs": []}'])
    bad_buf = (b'{"v": 1, "type": "infer", "id": 1, "robot": "r", "obs": [{"images": {}, '
               b'"state": {"buf": 1, "shape": [14], "dtype": "<f4"}}]}')
    with pytest.raises(wire.WireError, match=r"obs\[0\].state: buffer has 3 bytes"):
        wire.decode_request([bad_buf, b"abc"])
    assert wire.decode_request(good).kind == "hello"
    huge = (b'{"v": 1, "type": "infer", "id": 1, "robot": "r", "obs": [{"images": {}, "prompt": "'
            + b"x" * (wire.MAX_CHECK_PROMPT_CHARS + 1) + b'"}]}')
    with pytest.raises(wire.WireError, match=r"obs\[0\].prompt: 4097 characters; at most 4096"):
        wire.decode_request([huge])


def test_wire_rejects_wrongly_typed_fields_naming_them():
    """Scalars of the wrong JSON type are WireErrors that name the field, as bad arrays are: a
    ValueError or TypeError out of int() / float() would escape the server's bad-request reply."""
    import json

    state = {"buf": 1, "shape": [14], "dtype": "<f4"}
    rtc = {"mode": "guided", "prefix": {"buf": 1, "shape": [1, 14], "dtype": "<f4"}, "delay": 1, "execution_horizon": 3}
    cases = [
        (r"obs\[0\]\.timestamp", {"obs": [{"images": {}, "state": state, "timestamp": "abc"}]}),
        (r"rtc\.delay", {"rtc": {**rtc, "delay": "x"}}),
        (r"rtc\.delay", {"rtc": {**rtc, "delay": None}}),
        (r"rtc\.execution_horizon", {"rtc": {**rtc, "execution_horizon": 2.5}}),
        (r"rtc\.max_guidance_weight", {"rtc": {**rtc, "max_guidance_weight": [1]}}),
        (r"obs\[0\]\.state: bad shape", {"obs": [{"images": {}, "state": {**state, "shape": [-1, -14]}}]}),
        ("budget_ms", {"budget_ms": True}),
        ("wait_ms", {"wait_ms": True}),
        ("wait_ms", {"wait_ms": "1000"}),
        ("wait_ms: expected a positive number", {"wait_ms": 0}),
        ("wait_ms: expected a positive number", {"wait_ms": -5.0}),
        (r"obs\[0\]\.state: dtype '<M8\[s\]' is not accepted", {"obs": [{"images": {}, "state": {**state, "dtype": "<M8[s]"}}]}),
        (r"obs\[0\]\.state: dtype '\|O' is not accepted", {"obs": [{"images": {}, "state": {**state, "dtype": "|O"}}]}),
    ]
    for field_re, fields in cases:
        head = {"v": 1, "type": "infer", "id": 1, "robot": "r", "obs": [{"images": {}, "state": state}], **fields}
        with pytest.raises(wire.WireError, match=field_re):
            wire.decode_request([json.dumps(head).encode(), np.zeros(14, np.float32).tobytes()])


def test_wire_wait_ms_round_trip_and_absent_for_older_clients():
    import json

    obs = wire.WireObservation({}, np.zeros(14, np.float32), "p")
    got = wire.decode_request(wire.encode_request(wire.Request("infer", 1, "r", 250.0, [obs], wait_ms=750.0)))
    assert (got.budget_ms, got.wait_ms) == (250.0, 750.0)
    # Unset, the header has no wait_ms at all (as an older client's); absent or null: no limit.
    frames = wire.encode_request(wire.Request("infer", 2, "r", None, [obs]))
    head = json.loads(bytes(frames[0]))
    assert "wait_ms" not in head and wire.decode_request(frames).wait_ms is None
    head["wait_ms"] = None
    assert wire.decode_request([json.dumps(head).encode(), *frames[1:]]).wait_ms is None


def test_wire_reply_round_trip():
    acts = np.ones((1, 50, 14), np.float32)
    rep = wire.decode_reply([bytes(f) for f in wire.encode_reply(wire.Reply(3, True, acts, info={"batch": 4}))])
    assert rep.ok and rep.req_id == 3 and rep.info["batch"] == 4
    np.testing.assert_array_equal(rep.actions, acts)
    err = wire.decode_reply(wire.encode_reply(wire.Reply(4, False, error=wire.ERR_OVERLOADED, message="full")))
    assert (err.ok, err.error, err.message) == (False, "overloaded", "full")


# -- scheduler ------------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _p(robot: str, deadline: float, key=None, size: int = 1, arrival: float = 100.0,
       expiry: float | None = None) -> Pending:
    return Pending(robot, 0, size, deadline, key, robot, arrival, expiry)


def test_scheduler_orders_by_deadline_and_takes_one_per_robot_first():
    clock = FakeClock()
    s = Scheduler(SchedulerConfig(max_batch=2, window_s=0.0, capacity=10, per_robot=3), clock)
    a1, a2, b1 = _p("a", 101.0), _p("a", 101.1), _p("b", 105.0)
    for p in (b1, a2, a1):
        assert s.submit(p) is None
    # Robot a has the two earliest deadlines, but b's only request goes before a's second.
    assert s.next_batch(0) == [a1, b1]
    assert s.next_batch(0) == [a2]


def test_scheduler_back_pressure_and_per_robot_share():
    s = Scheduler(SchedulerConfig(max_batch=4, capacity=3, per_robot=2), FakeClock())
    assert s.submit(_p("a", 101)) is None
    assert s.submit(_p("a", 101)) is None
    assert s.submit(_p("a", 101)) == wire.ERR_ROBOT_LIMIT
    assert s.submit(_p("b", 101)) is None
    assert s.submit(_p("c", 101)) == wire.ERR_OVERLOADED
    assert len(s) == 3


def test_scheduler_window_waits_for_company_but_not_past_a_deadline():
    clock = FakeClock()
    s = Scheduler(SchedulerConfig(max_batch=4, window_s=0.010, service_estimate_s=0.050), clock)
    s.submit(_p("a", deadline=101.0))
    assert s.next_batch(0) == []  # window still open, deadline far
    clock.t += 0.011
    assert len(s.next_batch(0)) == 1  # window closed
    # A tight deadline closes the window at once: waiting would make it late.
    s.submit(_p("b", deadline=clock.t + 0.040, arrival=clock.t))
    assert len(s.next_batch(0)) == 1
    # A full batch closes it at once too.
    for r in "cdef":
        s.submit(_p(r, deadline=clock.t + 10, arrival=clock.t))
    assert len(s.next_batch(0)) == 4


def test_scheduler_hands_back_expired_requests_instead_of_batching_them():
    clock = FakeClock()
    s = Scheduler(SchedulerConfig(max_batch=8, window_s=0.0), clock)
    gone, later, never = _p("a", 101.0, expiry=100.5), _p("b", 101.0, expiry=102.0), _p("c", 101.0)
    for p in (gone, later, never):
        assert s.submit(p) is None
    clock.t = 100.5  # the client of `gone` stops waiting now
    assert s.next_batch(0) == [later, never]  # the unexpired ones, as they would have been
    assert s.take_expired() == [gone]
    assert s.take_expired() == []  # handed back once
    # Without an expiry a request is run however long it waited (late, past its deadline).
    old = _p("c", 101.0)
    assert s.submit(old) is None
    clock.t = 10_000.0
    assert s.next_batch(0) == [old] and s.take_expired() == []


def test_an_expired_request_frees_its_robots_share_and_the_capacity():
    clock = FakeClock()
    s = Scheduler(SchedulerConfig(max_batch=4, capacity=4, per_robot=2), clock)
    a1, a2 = _p("a", 101, expiry=100.1), _p("a", 101, expiry=100.1)
    for p in (a1, a2, _p("b", 101)):
        assert s.submit(p) is None
    assert s.submit(_p("a", 101)) == wire.ERR_ROBOT_LIMIT
    assert s.submit(_p("c", 101)) is None
    assert s.submit(_p("d", 101)) == wire.ERR_OVERLOADED
    clock.t = 100.1
    assert s.submit(_p("a", 101)) is None  # a's expired requests no longer count toward its share
    assert s.submit(_p("d", 101)) is None  # nor toward the capacity
    assert len(s) == 4 and s.take_expired() == [a1, a2]


def test_an_expired_request_neither_fills_a_batch_nor_closes_the_window():
    """Queued with company it filled a batch of 2, and its deadline would close the window
    early; once it expired, the other request waits out the window alone."""
    clock = FakeClock()
    s = Scheduler(SchedulerConfig(max_batch=2, window_s=0.050, service_estimate_s=0.050), clock)
    urgent = _p("a", deadline=100.070, expiry=100.010)
    relaxed = _p("b", deadline=110.0)
    s.submit(urgent)
    assert s.ready_at() == pytest.approx(100.020)  # its deadline less the service time
    s.submit(relaxed)
    assert s.ready_at() == 100.0  # two of two: full
    clock.t = 100.010
    assert s.ready_at() == pytest.approx(100.050)  # relaxed's window, nothing else
    assert s.next_batch(0) == [] and s.take_expired() == [urgent]
    clock.t = 100.050
    assert s.next_batch(0) == [relaxed]


def test_a_waiting_next_batch_returns_when_a_request_expires():
    """The worker hears of an expired request at once (to answer it), not when its wait ends."""
    s = Scheduler(SchedulerConfig(max_batch=8, window_s=5.0))
    got: list = []

    def wait() -> None:
        t0 = time.monotonic()
        got.append((s.next_batch(5.0), time.monotonic() - t0))

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.05)
    now = time.monotonic()
    p = Pending("z", 1, 1, now + 10, arrival=now, expiry=now)  # its client gave up as it arrived
    assert s.submit(p) is None
    t.join(10.0)
    assert got and got[0][0] == [] and got[0][1] < 2.5
    assert s.take_expired() == [p] and len(s) == 0
    s.close()


def test_scheduler_batches_only_compatible_rtc_and_blocks_until_ready():
    clock = FakeClock()
    s = Scheduler(SchedulerConfig(max_batch=8, window_s=0.0), clock)
    g2, free, g7 = _p("a", 101, ("guided", 5.0, -1, -1, -1)), _p("b", 102), _p("c", 103, ("guided", 5.0, -1, -1, -1))
    inp3, inp5 = _p("d", 104, ("inpaint", 5.0, 3, -1, -1)), _p("e", 105, ("inpaint", 5.0, 5, -1, -1))
    for p in (inp5, g2, free, inp3, g7):
        s.submit(p)
    assert s.next_batch(0) == [g2, free, g7]  # guided requests (any delay) and an unguided one
    assert s.next_batch(0) == [inp3]  # inpaint batches share d and take no unguided rider
    assert s.next_batch(0) == [inp5]
    s.submit(free := _p("f", 106))
    s.submit(inp := _p("g", 107, ("inpaint", 5.0, 3, -1, -1)))
    assert s.next_batch(0) == [free] and s.next_batch(0) == [inp]
    real = Scheduler(SchedulerConfig(max_batch=8, window_s=0.0))
    got: list = []
    t = threading.Thread(target=lambda: got.append(real.next_batch(5.0)))
    t.start()
    time.sleep(0.05)
    real.submit(Pending("z", 1, 1, time.monotonic() + 1))
    t.join(5.0)
    assert len(got[0]) == 1
    real.close()
    assert real.next_batch(1.0) == []


def test_a_local_engine_runs_one_batch_at_a_time(tiny_policy, make_obs):
    """Two inference threads on one engine would share its static buffers (cudagraph,
    TensorRT) and noise generator: the server runs one worker on a local engine, and the
    executor itself never lets two calls overlap."""
    srv = PolicyServer(LocalExecutor(tiny_policy), "tcp://127.0.0.1:*", workers=3)
    assert srv.workers == 1
    entered = [threading.Event(), threading.Event()]
    release = threading.Event()
    calls = iter(entered)

    class Blocking:  # the policy, with an infer that holds the engine until released
        def __init__(self, policy):
            self.policy = policy

        def __getattr__(self, name):
            return getattr(self.policy, name)

        def infer(self, *args, **kwargs):
            next(calls).set()
            release.wait(10.0)
            return self.policy.infer(*args, **kwargs)

    ex = LocalExecutor(Blocking(tiny_policy))
    item = request_item(wire.Request("infer", 1, "a", None, [make_obs(tiny_policy.adapter, size=(8, 10))]))
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(ex.run([item]))) for _ in range(2)]
    threads[0].start()
    assert entered[0].wait(10.0)
    threads[1].start()
    # The second call may not reach the engine while the first is inside it (this can only
    # pass wrongly on a box too slow to start the thread in a second, never fail wrongly).
    assert not entered[1].wait(1.0)
    release.set()
    for t in threads:
        t.join(30.0)
    assert entered[1].is_set() and len(got) == 2 and all(r[0].actions is not None for r in got)


# -- server and client ----------------------------------------------------------------------
@pytest.fixture
def server(tiny_policy):
    srv = PolicyServer(LocalExecutor(tiny_policy), "tcp://127.0.0.1:*", SchedulerConfig(max_batch=8, window_s=0.002))
    srv.start()
    yield srv
    srv.stop()


def test_remote_policy_gives_the_direct_actions(server, tiny_policy, make_obs, noise_for):
    obs = make_obs(tiny_policy.adapter, seed=1)
    noise = noise_for(tiny_policy.adapter, 1, seed=2)
    prefix = np.random.default_rng(3).uniform(-1, 1, (30, 14)).astype(np.float32)
    rtc = RTCRequest("guided-approx", prefix, 4, 25)
    with RemotePolicy(server.endpoint, robot="arm-0") as remote:
        assert (remote.chunk_size, remote.action_dim, remote.state_dim) == (50, 14, 14)
        assert remote.camera_names == tiny_policy.camera_names
        got = remote.infer([obs], rtc=rtc, noise=noise)
        want = tiny_policy.infer([obs], rtc=rtc, noise=noise)
        # Same backend, same batch composition (one robot, batch of one): identical.
        np.testing.assert_array_equal(got.actions, want.actions)
        assert got.chunk is None and got.stage_ms["roundtrip"] > 0 and got.batch == 1
        rep = remote.server_stats()
    assert rep["robots"]["arm-0"]["served"] == 1


def test_malformed_header_is_refused_and_the_server_keeps_serving(server, tiny_policy, make_obs, monkeypatch):
    """A request whose header has a wrongly typed field gets a bad_request reply naming it; one
    that breaks the decoder in a way nobody foresaw is refused too. Neither may end the intake
    thread, which every robot's requests and replies go through."""
    import json

    import zmq

    head = {"v": 1, "type": "infer", "id": 9, "robot": "rogue",
            "obs": [{"images": {}, "state": {"buf": 1, "shape": [14], "dtype": "<f4"}, "timestamp": "abc"}]}
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        def ask() -> wire.Reply:
            sock.send_multipart([json.dumps(head).encode(), np.zeros(14, np.float32).tobytes()])
            assert sock.poll(5000), "no reply: the server's intake thread died"
            return wire.decode_reply(sock.recv_multipart())

        rep = ask()
        assert (rep.ok, rep.req_id, rep.error) == (False, 9, wire.ERR_BAD_REQUEST) and "timestamp" in rep.message

        def broken(frames, **kw):
            raise TypeError("unforeseen")

        monkeypatch.setattr(wire, "decode_request", broken)
        rep = ask()
        assert (rep.ok, rep.req_id, rep.error) == (False, 9, wire.ERR_BAD_REQUEST) and "unforeseen" in rep.message
        monkeypatch.undo()
    finally:
        sock.close(0)
    with RemotePolicy(server.endpoint, robot="after", timeout_s=30) as remote:
        assert remote.infer([make_obs(tiny_policy.adapter, size=(24, 32))]).actions.shape == (1, 50, 14)


def _frames(observations: int = 1, rtc: wire.WireRTC | None = None, state_shape: tuple[int, ...] = (14,)) -> list:
    obs = wire.WireObservation({"top": np.zeros((8, 8, 3), np.uint8)}, np.zeros(state_shape, np.float32), "go")
    return wire.encode_request(wire.Request("infer", 3, "r", None, [obs] * observations, rtc))


@pytest.mark.parametrize(("field", "value"), [("delay", -1), ("execution_horizon", -100),
                                              ("max_guidance_weight", -1e6)])
def test_rtc_values_below_zero_are_refused_naming_the_field(field, value):
    """A negative execution horizon was clamped without a word; a negative guidance weight ran and
    pushed the chunk away from the prefix."""
    rtc = dict(mode="guided", prefix=np.zeros((20, 14), np.float32), delay=2, execution_horizon=10,
               max_guidance_weight=5.0)
    rtc[field] = value
    with pytest.raises(wire.WireError, match=rf"^rtc\.{field}: expected a value >= 0"):
        wire.decode_request(_frames(rtc=wire.WireRTC(**rtc)))


def test_oversized_messages_are_refused_before_they_are_decoded():
    """200,000 observations in a 16 MB header held the server's intake thread for seconds; a shape
    whose byte count overflows int64 wrapped to 0 bytes and escaped as a bare ValueError."""
    with pytest.raises(wire.WireError, match=r"^obs: 9 observations; this server runs at most 8 a request"):
        wire.decode_request(_frames(observations=9), max_observations=8)
    assert len(wire.decode_request(_frames(observations=8), max_observations=8).observations) == 8
    frames = _frames()
    head = json.loads(frames[0])
    head["pad"] = "x" * wire.MAX_HEADER_BYTES
    with pytest.raises(wire.WireError, match=r"^header is \d+ bytes; at most"):
        wire.decode_request([json.dumps(head).encode(), *frames[1:]])
    head = json.loads(frames[0])
    head["obs"][0]["state"].update(shape=[2**32, 2**32], dtype="|u1")
    with pytest.raises(wire.WireError, match=r"^obs\[0\]\.state: shape \[4294967296, 4294967296\] .* at most"):
        wire.decode_request([json.dumps(head).encode(), *frames[1:]])


def test_a_reply_never_carries_non_finite_actions(tiny_policy, make_obs, monkeypatch):
    """An RTC guidance weight of 1e300 overflows the guided velocity: the server answered ok with
    NaN actions. It answers inference_failed, and counts the request as failed."""
    ad = tiny_policy.adapter
    rtc = RTCRequest("guided", np.zeros((20, ad.action_dim), np.float32), delay=2, execution_horizon=10,
                     max_guidance_weight=1e300)
    srv = PolicyServer(LocalExecutor(tiny_policy), "tcp://127.0.0.1:*", SchedulerConfig(max_batch=4)).start()
    try:
        with RemotePolicy(srv.endpoint, robot="wild", timeout_s=30) as remote:
            with pytest.raises(ServeError, match="inference_failed: the policy's actions hold NaN or Inf values"):
                remote.infer([make_obs(ad, seed=1)], rtc=rtc)
            rep = remote.server_stats()
    finally:
        srv.stop()
    assert rep["robots"]["wild"]["served"] == 0


def test_bad_request_fails_alone(server, tiny_policy, make_obs):
    good = make_obs(tiny_policy.adapter, seed=1)
    bad = make_obs(tiny_policy.adapter, seed=2, state=np.zeros(5, np.float32))
    with RemotePolicy(server.endpoint, robot="good") as g, RemotePolicy(server.endpoint, robot="bad") as b:
        errors: list[Exception] = []

        def call_bad() -> None:
            try:
                b.infer([bad])
            except ServeError as exc:
                errors.append(exc)

        t = threading.Thread(target=call_bad)
        t.start()
        assert g.infer([good]).actions.shape == (1, 50, 14)
        t.join(10)
    assert errors and errors[0].code == wire.ERR_BAD_REQUEST and "state has 5 values" in str(errors[0])


def test_a_wrong_request_is_refused_before_batching_and_costs_its_neighbours_nothing(tiny_policy, make_obs,
                                                                                      monkeypatch):
    """A state of the wrong width, an unknown camera, an empty image or a prompt the model would
    truncate (cutting the robot's state off the prompt) is answered as a bad request before any
    batch: its neighbours run in one engine call, with no failed call and no reruns."""
    from phyai_edge.serve.batching import BatchItem, run_items

    ad = tiny_policy.adapter
    calls = []
    real = tiny_policy.infer
    monkeypatch.setattr(tiny_policy, "infer", lambda obs, **kw: calls.append(len(obs)) or real(obs, **kw))
    long_prompt = " ".join(["pick up the red cube and put it in the bowl"] * 40)
    empty = make_obs(ad, seed=5)
    empty.images[ad.camera_names[0]] = np.zeros((0, 0, 3), np.uint8)
    obs = [make_obs(ad, seed=1), make_obs(ad, seed=2, state=np.zeros(5, np.float32)),
           make_obs(ad, seed=3, prompt=long_prompt), make_obs(ad, seed=4, cameras=["side"]), empty, make_obs(ad, seed=6)]
    noise = [torch.randn(1, ad.chunk_size, ad.model_action_dim, generator=torch.Generator().manual_seed(i))
             for i in range(len(obs))]
    items = [BatchItem([o], None, n) for o, n in zip(obs, noise)]
    got = run_items(tiny_policy, items, strict_prompts=True)  # as the server runs them
    assert calls == [2], "the good requests share one engine call, and nothing else ran"
    assert [r.actions is not None for r in got] == [True, False, False, False, False, True]
    assert not any(r.rerun for r in got)
    bad = [r for r in got if r.actions is None]
    assert all(r.bad_request and r.error.startswith("obs[0]: ") for r in bad)
    assert "state has 5 values" in bad[0].error
    assert "would be truncated" in bad[1].error and f"takes {ad.cfg.max_token_len}" in bad[1].error
    assert "unknown cameras ['side']" in bad[2].error and "an image of shape (0, 0, 3)" in bad[3].error
    # offline (eval, rollouts) the long prompt is truncated as preprocess does, not refused
    assert run_items(tiny_policy, [items[2]])[0].actions is not None
    alone = run_items(tiny_policy, [items[0]])[0]
    # the refusals changed nothing for it: batched with one neighbour, its chunk is its own up to rounding
    np.testing.assert_allclose(got[0].actions, alone.actions, atol=1e-5)


@pytest.mark.parametrize(("image", "says"), [
    (np.full((3, 32, 32), np.nan, np.float32), "NaN or Inf"),
    (np.full((3, 32, 32), 200.0, np.float32), r"must lie in [0, 1]"),
    (np.zeros((32, 32, 3), np.int16), "unsupported image dtype"),
    (np.zeros((32, 32, 4), np.uint8), "1 or 3 channels"),
    (np.zeros((1, 5000, 3), np.uint8), "keeps no row or column"),
])
def test_an_image_preprocess_would_refuse_is_refused_before_batching(tiny_policy, make_obs, monkeypatch, image, says):
    """Such an image passed the server's check (only its rank was), failed the batch's engine call
    and made every neighbour rerun alone; the robot that sent it heard inference_failed, and for
    the 1 x 5000 frame a bare torch error."""
    from phyai_edge.serve.batching import BatchItem, run_items

    ad = tiny_policy.adapter
    calls = []
    real = tiny_policy.infer
    monkeypatch.setattr(tiny_policy, "infer", lambda obs, **kw: calls.append(len(obs)) or real(obs, **kw))
    bad = make_obs(ad, seed=2)
    bad.images[ad.camera_names[0]] = image
    got = run_items(tiny_policy, [BatchItem([make_obs(ad, seed=1)], None), BatchItem([bad], None),
                                  BatchItem([make_obs(ad, seed=3)], None)], strict_prompts=True)
    assert calls == [2] and not any(r.rerun for r in got)
    assert got[1].bad_request and says in got[1].error and repr(ad.camera_names[0]) in got[1].error


class _HeldExecutor:
    """Blocks every batch until released: makes the queue fill deterministically. `ran`: the
    observations of each request it was given, in order."""

    def __init__(self, policy) -> None:
        self.policy, self.release = policy, threading.Event()
        self.ran: list[int] = []

    def describe(self):
        return describe_policy(self.policy)

    def run(self, items):
        self.ran.extend(it.size for it in items)
        self.release.wait(10)
        return [ItemResult(np.zeros((it.size, 50, 14), np.float32), batch=len(items)) for it in items]


def test_over_capacity_is_refused_with_a_clear_reply(tiny_policy, make_obs):
    ex = _HeldExecutor(tiny_policy)
    cfg = SchedulerConfig(max_batch=1, window_s=0.0, capacity=1, per_robot=1)
    obs = make_obs(tiny_policy.adapter, size=(8, 8))
    with PolicyServer(ex, "tcp://127.0.0.1:*", cfg) as srv:
        clients = [RemotePolicy(srv.endpoint, robot=f"r{i}", timeout_s=10) for i in range(3)]
        results: dict[int, object] = {}

        def call(i: int) -> None:
            try:
                results[i] = clients[i].infer([obs])
            except Exception as exc:
                results[i] = exc

        threads = []
        for i in range(3):  # r0 runs (held), r1 waits in the queue, r2 finds it full
            threads.append(threading.Thread(target=call, args=(i,)))
            threads[-1].start()
            deadline = time.monotonic() + 5
            while srv.stats.report()["robots"].get(f"r{i}", {}).get("requests", 0) < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.05)
        threads[2].join(5)
        assert isinstance(results[2], ServerBusyError) and results[2].code == wire.ERR_OVERLOADED
        assert "capacity" in str(results[2])
        ex.release.set()
        for t in threads:
            t.join(10)
        assert results[0].actions.shape == (1, 50, 14) and results[1].actions.shape == (1, 50, 14)
        assert srv.report()["robots"]["r2"]["rejected"] == 1
        # More observations than an engine call takes: a permanent error, not busy-retry.
        with pytest.raises(ServeError) as err:
            clients[2].infer([obs, obs])
        assert not isinstance(err.value, ServerBusyError) and err.value.code == wire.ERR_BAD_REQUEST
        assert "2 observations" in str(err.value) and "at most 1" in str(err.value)
        for c in clients:
            c.close()


def test_a_request_whose_client_timed_out_is_answered_expired_and_never_run(tiny_policy, make_obs, monkeypatch):
    """Robot "hasty" (timeout 0.3 s) asks while the engine is busy with robot a's batch: it
    gives up, and the server answers its queued request `expired` instead of running it later;
    its next request (the stale reply discarded by id) and a's are served."""
    ex = _HeldExecutor(tiny_policy)
    cfg = SchedulerConfig(max_batch=1, window_s=0.0, capacity=4, per_robot=2)
    obs = make_obs(tiny_policy.adapter, size=(8, 8))
    sent: list[wire.Request] = []
    encode = wire.encode_request
    monkeypatch.setattr(wire, "encode_request", lambda req: sent.append(req) or encode(req))

    def wait_for(cond, what: str) -> None:
        deadline = time.monotonic() + 5
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cond(), what

    with PolicyServer(ex, "tcp://127.0.0.1:*", cfg) as srv, \
            RemotePolicy(srv.endpoint, robot="a", timeout_s=10) as a, \
            RemotePolicy(srv.endpoint, robot="hasty", timeout_s=0.3) as hasty:
        results: dict[str, object] = {}
        busy = threading.Thread(target=lambda: results.update(a=a.infer([obs])))
        busy.start()
        wait_for(lambda: ex.ran == [1], "robot a's batch never reached the executor")
        with pytest.raises(TimeoutError):
            hasty.infer([obs])
        assert sent[-1].robot == "hasty" and sent[-1].wait_ms == 300.0  # the client says how long it waits
        # Answered while the engine is still held: it was never in a batch.
        wait_for(lambda: srv.report()["robots"]["hasty"]["expired"] == 1, "hasty's request was not expired")
        hasty.timeout_s = 10
        again = threading.Thread(target=lambda: results.update(hasty=hasty.infer([obs])))
        again.start()
        wait_for(lambda: len(srv.sched) == 1, "hasty's second request was not queued")
        ex.release.set()
        busy.join(10)
        again.join(10)
        assert results["a"].actions.shape == results["hasty"].actions.shape == (1, 50, 14)
        report = srv.report()
    assert ex.ran == [1, 1]  # a's request and hasty's second: the expired one never ran
    robots = report["robots"]
    assert (robots["hasty"]["requests"], robots["hasty"]["served"], robots["hasty"]["expired"]) == (2, 1, 1)
    assert robots["a"]["served"] == 1 and robots["a"]["expired"] == 0 and report["expired"] == 1


def test_client_errors_are_clear_when_no_server():
    with pytest.raises(ConnectionError, match="no connection"):
        RemotePolicy("tcp://127.0.0.1:1", connect_timeout_s=0.2)


def test_client_imports_no_torch():
    code = "import sys, phyai_edge.serve.client, phyai_edge.serve.wire; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_noise_tensor_and_array_are_accepted(server, tiny_policy, make_obs, noise_for):
    obs = make_obs(tiny_policy.adapter, seed=4)
    noise = noise_for(tiny_policy.adapter, 1, seed=5)
    with RemotePolicy(server.endpoint) as remote:
        a = remote.infer(obs, noise=noise).actions
        b = remote.infer([obs], noise=noise.numpy()).actions
    np.testing.assert_array_equal(a, b)
    assert torch.isfinite(torch.from_numpy(a)).all()


@pytest.mark.slow
def test_serve_command_serves_and_stops_on_sigterm(make_obs, tiny_policy):
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "phyai_edge", "serve", "--bind", "tcp://127.0.0.1:*", "--threads", "1",
                             "--report-s", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 60
        while not line.startswith("serving on ") and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "serve exited early"
        endpoint = line.split()[-1]
        with RemotePolicy(endpoint, robot="cli-robot", timeout_s=30) as remote:
            assert remote.infer([make_obs(tiny_policy.adapter, size=(24, 32))]).actions.shape == (1, 50, 14)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert "cli-robot" in out  # the final per-robot table


def test_stats_report_percentiles_and_forget_idle_robots():
    from phyai_edge.serve.stats import ServerStats, format_report

    st = ServerStats(forget_s=0.05)
    for i in range(100):
        st.arrived("a")
        st.answered("a", True, float(i + 1), 0.5, missed=i >= 98)
    st.arrived("b")
    st.rejected("b")
    st.batch(4)
    rep = st.report()
    a = rep["robots"]["a"]
    assert (a["served"], a["deadline_misses"], a["latency_ms"]["p50"], a["latency_ms"]["p99"]) == (100, 2, 50.0, 99.0)
    assert rep["robots"]["b"]["rejected"] == 1 and rep["batch_size"]["max"] == 4
    assert "a" in format_report(rep) and "graphs built while serving" not in format_report(rep)
    assert "graphs built while serving 2," in format_report({**rep, "graphs_built_serving": 2})
    time.sleep(0.1)
    assert st.report()["robots"] == {}


def test_requests_queued_at_shutdown_are_counted(tiny_policy):
    """The report printed at exit: every robot's requests are served, refused, failed or
    expired (one whose client stopped waiting is answered so, not as shut down)."""
    srv = PolicyServer(LocalExecutor(tiny_policy), "tcp://127.0.0.1:*", SchedulerConfig(per_robot=3))
    now = time.monotonic()
    for i, expiry in enumerate((None, None, now)):
        srv.stats.arrived("a")
        assert srv.sched.submit(Pending("a", i, 1, now + 10, None, (b"a", None), now, expiry)) is None
    srv.stop()
    a = srv.report()["robots"]["a"]
    assert (a["rejected"], a["expired"]) == (2, 1)
    assert a["requests"] == a["served"] + a["rejected"] + a["errors"] + a["expired"] == 3


def test_a_batch_running_at_shutdown_is_still_answered(tiny_policy, make_obs):
    """Its robot waits for this answer: the intake thread stopped before the batch ended, and the
    reply was dropped (the robot timed out instead). A request queued behind it hears `shutdown`."""
    ex = _HeldExecutor(tiny_policy)
    obs = make_obs(tiny_policy.adapter, size=(8, 8))
    srv = PolicyServer(ex, "tcp://127.0.0.1:*", SchedulerConfig(max_batch=1, window_s=0.0)).start()
    results: dict[str, object] = {}

    def call(remote: RemotePolicy, name: str) -> None:
        try:
            results[name] = remote.infer([obs])
        except Exception as exc:
            results[name] = exc

    with RemotePolicy(srv.endpoint, robot="a", timeout_s=3) as a, RemotePolicy(srv.endpoint, robot="b", timeout_s=3) as b:
        running = threading.Thread(target=call, args=(a, "a"))
        running.start()
        deadline = time.monotonic() + 5
        while ex.ran != [1] and time.monotonic() < deadline:
            time.sleep(0.01)
        queued = threading.Thread(target=call, args=(b, "b"))
        queued.start()
        while len(srv.sched) != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        stopping = threading.Thread(target=srv.stop)
        stopping.start()
        time.sleep(0.3)  # past the intake thread's poll: it would have closed the socket by now
        ex.release.set()
        for t in (stopping, running, queued):
            t.join(10)
    assert not isinstance(results["a"], Exception), results["a"]
    assert results["a"].actions.shape == (1, 50, 14)
    assert isinstance(results["b"], ServeError) and results["b"].code == wire.ERR_SHUTDOWN


def test_stats_count_expired_per_robot_and_in_total():
    from phyai_edge.serve.stats import ServerStats, format_report

    st = ServerStats(forget_s=0.05)
    for robot in ("a", "b", "b"):
        st.arrived(robot)
        st.expired(robot)
    rep = st.report()
    assert (rep["robots"]["a"]["expired"], rep["robots"]["b"]["expired"], rep["expired"]) == (1, 2, 3)
    text = format_report(rep)
    assert "expired 3" in text and "exp" in text.splitlines()[1]
    time.sleep(0.1)
    rep = st.report()
    assert rep["robots"] == {} and rep["expired"] == 3  # the total outlives forgotten robots


def test_percentile_is_nearest_rank():
    from phyai_edge.serve.stats import percentile

    # The smallest sample with at least q % of the samples at or below it.
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.0  # 2 of 4 at or below 2
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0
    # Under 100 samples the p99 is the worst one (docs/scenarios.md relies on it); rounding
    # q % of (n - 1) gave the second worst from 52 samples on.
    assert percentile([float(i) for i in range(60)], 99) == 59.0
    assert percentile([float(i) for i in range(1, 352)], 99) == 348.0  # ceil(347.49)
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([7.0], 99) == percentile([7.0], 0) == 7.0 and percentile([], 50) == 0.0


def test_a_busy_endpoint_is_one_line_naming_it(server, tiny_policy):
    """`phyai-edge serve` prints this message after its own "phyai-edge serve: " prefix: the
    server's words name the endpoint and the cause, once."""
    other = PolicyServer(LocalExecutor(tiny_policy), server.endpoint, SchedulerConfig(max_batch=1))
    with pytest.raises(RuntimeError) as err:
        other.start()
    other.stop()
    assert str(err.value).startswith(f"cannot bind {server.endpoint}: "), str(err.value)


@pytest.mark.parametrize("name", ["timeout_s", "connect_timeout_s"])
@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf")])
def test_remote_policy_refuses_a_timeout_that_is_not_positive(name, timeout):
    """The timeout becomes every request's wait_ms, which the server refuses unless positive: the
    robot hears it at construction, naming the argument, not as a TimeoutError per request. An
    infinite one raised OverflowError from every call (the poll's milliseconds), never a wait."""
    with pytest.raises(ValueError, match=f"^{name} must be a positive, finite number of seconds"):
        RemotePolicy("tcp://127.0.0.1:1", robot="r", **{name: timeout})


@pytest.mark.slow
def test_serve_json_report_is_alone_on_stdout():
    """--json-report's stdout is the report and nothing else (the log and the endpoint line go to
    stderr), so it can be piped into a JSON reader."""
    proc = subprocess.run([sys.executable, "-m", "phyai_edge", "serve", "--bind", "tcp://127.0.0.1:*", "--threads", "1",
                           "--report-s", "0", "--duration", "1", "--json-report"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert isinstance(report, dict) and report
    assert "serving on tcp://127.0.0.1:" in proc.stderr


def test_noise_of_another_shape_is_a_bad_request_before_batching(tiny_policy, make_obs):
    """It failed inside the batch's engine call: inference_failed for the robot that sent it (a
    server fault, by its code) and a rerun for every neighbour."""
    from phyai_edge.serve.batching import BatchItem, run_items

    ad = tiny_policy.adapter
    got = run_items(tiny_policy, [BatchItem([make_obs(ad, seed=1)], None),
                                  BatchItem([make_obs(ad, seed=2)], None, torch.zeros(1, 10, ad.model_action_dim))])
    assert got[0].actions is not None and not got[0].rerun
    assert got[1].bad_request and "noise must have shape (1, 50, 32)" in got[1].error


def test_a_connection_lost_between_the_poll_and_the_send_is_an_error_not_a_hang():
    """The client polled for room, then sent blocking: a server gone between the two (here: the
    poll says yes, and nobody was ever connected) held the caller forever, with no timeout."""
    import zmq

    class PollSaysYes:
        def __init__(self, sock):
            self.sock = sock

        def poll(self, timeout, flags):
            return True if flags == zmq.POLLOUT else self.sock.poll(timeout, flags)

        def __getattr__(self, name):
            return getattr(self.sock, name)

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.connect("tcp://127.0.0.1:9")  # nothing listens: IMMEDIATE leaves no pipe to queue on
    client = RemotePolicy.__new__(RemotePolicy)
    client.endpoint, client._lock, client._closed, client._sock = "tcp://127.0.0.1:9", threading.Lock(), False, PollSaysYes(sock)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            client._call(wire.Request("stats", 1, "r"), 0.5)
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "the send blocked"  # (the socket is then left open: closing it would hang too)
    sock.close(0)
    assert len(outcome) == 1 and isinstance(outcome[0], ConnectionError)
