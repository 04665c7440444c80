"""`prompt_fit` over the serve wire: a robot daemon on a `RemotePolicy` checks an instruction
against the server's tokenizer and warmed-up room before taking it, as a daemon with its own
engine checks it against its own."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from phyai_edge.control import worker
from phyai_edge.control.config import ConfigError
from phyai_edge.control.daemon import Daemon
from phyai_edge.control.fakes import free_tcp_endpoint, test_config
from phyai_edge.control.task import request_instruction
from phyai_edge.engines.policy import Policy
from phyai_edge.serve import wire
from phyai_edge.serve.batching import BatchItem, ItemResult
from phyai_edge.serve.client import RemotePolicy, ServeError
from phyai_edge.serve.server import LocalExecutor, PolicyServer

SHORT = "pick up the red cube"
LONG = " ".join(["then put the red cube next to the blue bowl"] * 6)  # ~157 tokens; the tiny model takes 128


@pytest.fixture
def server(tiny_policy: Policy) -> Iterator[PolicyServer]:
    with PolicyServer(LocalExecutor(tiny_policy), "tcp://127.0.0.1:*") as srv:
        yield srv


def _raw_call(endpoint: str, header: dict[str, Any]) -> wire.Reply:
    """One request with a header no `RemotePolicy` would send."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(json.dumps(header).encode())
        assert sock.poll(10_000), "no reply"
        return wire.decode_reply(sock.recv_multipart())
    finally:
        sock.close()


# -- wire -----------------------------------------------------------------------------------
def test_wire_prompt_fit_round_trip_and_its_fields_checked():
    req = wire.decode_request([bytes(f) for f in wire.encode_request(
        wire.Request("prompt_fit", 3, "arm-1", prompt="wipe the table"))])
    assert (req.kind, req.req_id, req.robot, req.prompt) == ("prompt_fit", 3, "arm-1", "wipe the table")
    head = {"v": 1, "type": "prompt_fit", "id": 1, "robot": "r"}
    for extra, words in [({}, "prompt: expected a string, got None"),
                         ({"prompt": 5}, "prompt: expected a string, got 5"),
                         ({"prompt": "x" * (wire.MAX_CHECK_PROMPT_CHARS + 1)}, "prompt: 4097 characters")]:
        with pytest.raises(wire.WireError, match=words):
            wire.decode_request([json.dumps({**head, **extra}).encode()])

    def reply(info: dict[str, Any]) -> wire.Reply:
        return wire.decode_reply(wire.encode_reply(wire.Reply(1, True, info=info)))

    assert wire.decode_prompt_fit(reply(wire.prompt_fit_info(66, 128, 200))) == (66, 128, 200)
    assert wire.decode_prompt_fit(reply(wire.prompt_fit_info(None, None, None, "no policy"))) == (None, None, None)
    for key, value in [("room", "128"), ("most", -1), ("tokens", True)]:
        with pytest.raises(wire.WireError, match=f"^{key}: "):
            wire.decode_prompt_fit(reply({**wire.prompt_fit_info(66, 128, 200), key: value}))


# -- the server and the client --------------------------------------------------------------
def test_remote_prompt_fit_is_the_server_policy_s_own(server: PolicyServer, tiny_policy: Policy):
    with RemotePolicy(server.endpoint, robot="arm-1", timeout_s=10.0) as remote:
        short, long = remote.prompt_fit(SHORT), remote.prompt_fit(LONG)
    assert short == tiny_policy.prompt_fit(SHORT)
    assert long == tiny_policy.prompt_fit(LONG)
    assert short[0] is not None and short[0] <= 128 and long[0] is not None and long[0] > 128
    assert short[1:] == long[1:] == (128, 128)  # eager: any length up to the model's runs
    assert server.report()["robots"].get("arm-1", {}).get("requests", 0) == 0  # checks are not inference requests


def test_a_malformed_prompt_fit_is_a_bad_request_naming_the_prompt(server: PolicyServer):
    head = {"v": 1, "type": "prompt_fit", "id": 9, "robot": "r"}
    for extra in ({}, {"prompt": ["pick"]}):
        rep = _raw_call(server.endpoint, {**head, **extra})
        assert (rep.req_id, rep.ok, rep.error) == (9, False, wire.ERR_BAD_REQUEST)
        assert rep.message.startswith("prompt: expected a string"), rep.message
    assert _raw_call(server.endpoint, {**head, "prompt": SHORT}).ok  # the server is still serving


def test_the_adapter_refusing_a_prompt_is_an_error_the_worker_reports(server: PolicyServer,
                                                                    tiny_policy: Policy):
    tiny_policy.adapter.io.default_prompt = ""  # so an empty prompt has nothing to stand for it
    with RemotePolicy(server.endpoint, timeout_s=10.0) as remote:
        with pytest.raises(ServeError, match="bad_request: prompt: empty prompt"):
            remote.prompt_fit("")
        fit = worker.prompt_fit(remote, "")
    assert not fit.fits and "empty prompt" in fit.problem()


def test_the_worker_s_check_refuses_a_long_instruction_through_the_wire(server: PolicyServer,
                                                                       tiny_policy: Policy):
    with RemotePolicy(server.endpoint, timeout_s=10.0) as remote:
        short, long = worker.prompt_fit(remote, SHORT), worker.prompt_fit(remote, LONG)
    assert short.fits and short.tokens == tiny_policy.prompt_fit(SHORT)[0]
    assert not long.fits and long.error is None
    assert (long.tokens, long.room, long.most) == tiny_policy.prompt_fit(LONG)
    assert "the model takes at most 128: shorten it" in long.problem()


def test_an_older_server_cannot_check_and_the_instruction_goes_unchecked(
        server: PolicyServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    newer = wire.decode_request

    def older(frames: list[Any], **kw: Any) -> wire.Request:
        # What a server from before prompt_fit says to it: its decoder knew three types.
        if json.loads(bytes(frames[0])).get("type") == "prompt_fit":
            raise wire.WireError("type: unknown request type 'prompt_fit'; expected infer, hello or stats")
        return newer(frames, **kw)

    monkeypatch.setattr(wire, "decode_request", older)  # the server's module reads it per message
    with RemotePolicy(server.endpoint, timeout_s=10.0) as remote, caplog.at_level(logging.WARNING):
        assert remote.prompt_fit(LONG) == (None, None, None)
        fit = worker.prompt_fit(remote, LONG)
    assert fit.fits and fit.error is None  # as before prompt_fit: taken unchecked
    lines = [r.getMessage() for r in caplog.records if "cannot check instructions" in r.getMessage()]
    assert len(lines) == 2 and "predates prompt_fit" in lines[0]


class HeldExecutor(LocalExecutor):
    """Holds each batch until `release` is set: an engine busy for as long as a test needs."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.running, self.release = threading.Event(), threading.Event()

    def run(self, items: list[BatchItem]) -> list[ItemResult]:
        self.running.set()
        assert self.release.wait(30)
        return super().run(items)


def test_a_check_is_answered_while_a_batch_runs(tiny_policy: Policy, make_obs: Callable[..., Any]):
    executor = HeldExecutor(tiny_policy)
    with PolicyServer(executor, "tcp://127.0.0.1:*") as srv, \
            RemotePolicy(srv.endpoint, robot="arm-1", timeout_s=20.0) as busy, \
            RemotePolicy(srv.endpoint, robot="arm-2", timeout_s=5.0) as asking:
        answers: list[Any] = []
        infer = threading.Thread(target=lambda: answers.append(busy.infer(make_obs(tiny_policy.adapter))))
        infer.start()
        try:
            assert executor.running.wait(20)
            assert asking.prompt_fit(SHORT) == tiny_policy.prompt_fit(SHORT)  # the batch is still held
            assert not answers
        finally:
            executor.release.set()
            infer.join(30)
        assert answers and answers[0].actions.shape[0] == 1


class NoPolicyExecutor:
    """An executor that runs batches elsewhere (as `RayExecutor` does), holding no policy here."""

    def __init__(self, inner: LocalExecutor) -> None:
        self._inner = inner

    def describe(self) -> dict[str, Any]:
        return self._inner.describe()

    def run(self, items: list[BatchItem]) -> list[ItemResult]:
        return self._inner.run(items)


def test_a_server_without_a_policy_says_it_cannot_check(tiny_policy: Policy, caplog: pytest.LogCaptureFixture):
    with PolicyServer(NoPolicyExecutor(LocalExecutor(tiny_policy)), "tcp://127.0.0.1:*") as srv:
        rep = _raw_call(srv.endpoint, {"v": 1, "type": "prompt_fit", "id": 2, "robot": "r", "prompt": SHORT})
        assert rep.ok and wire.decode_prompt_fit(rep) == (None, None, None)
        assert "NoPolicyExecutor" in rep.info["unchecked"]
        with RemotePolicy(srv.endpoint, timeout_s=10.0) as remote, caplog.at_level(logging.WARNING):
            assert remote.prompt_fit(LONG) == (None, None, None)
    assert any("cannot check instructions: its executor (NoPolicyExecutor)" in r.getMessage() for r in caplog.records)


def test_checks_still_queued_at_stop_hear_the_shutdown(tiny_policy: Policy):
    srv = PolicyServer(LocalExecutor(tiny_policy), "tcp://127.0.0.1:*")  # not started: nothing takes the checks
    for req_id in (4, 5):
        srv._checks.put_nowait((b"arm", wire.Request("prompt_fit", req_id, "arm", prompt=SHORT)))
    srv.stop()
    replies = []
    while not srv._outbox.empty():
        ident, frames = srv._outbox.get_nowait()
        replies.append((ident, wire.decode_reply([bytes(f) for f in frames])))
    assert [(i, r.req_id, r.error) for i, r in replies] == [(b"arm", 4, wire.ERR_SHUTDOWN), (b"arm", 5, wire.ERR_SHUTDOWN)]


# -- the daemon -----------------------------------------------------------------------------
def test_a_daemon_on_the_server_refuses_an_instruction_with_the_server_s_numbers(server: PolicyServer,
                                                                                  tiny_policy: Policy):
    endpoint = free_tcp_endpoint()
    cfg = test_config(model={"factory": "phyai_edge.serve.client:remote_policy",
                             "factory_args": {"endpoint": server.endpoint, "robot": "arm-7", "timeout_s": 10.0}},
                      task={"endpoint": endpoint})
    d = Daemon(cfg, realtime=False, status_line=False)
    try:
        d.setup()  # model.prompt is checked against the server here too
        refused = request_instruction(endpoint, LONG)
        tokens, room, most = tiny_policy.prompt_fit(LONG)
        assert not refused.ok and (refused.tokens, refused.room) == (tokens, room)
        assert f"takes up to {tokens} prompt tokens" in refused.error and f"at most {most}" in refused.error
        taken = request_instruction(endpoint, SHORT)
        assert taken.ok and (taken.tokens, taken.room, taken.changes) == (tiny_policy.prompt_fit(SHORT)[0], room, 1)
    finally:
        d.shutdown()


@pytest.mark.parametrize("task, message", [
    ({"prompt_tokens": 500}, r"^task\.prompt_tokens: 500 is more than the policy takes \(128\)"),
    ({"prompts": ["fold the towel", LONG]}, r"^task\.prompts\[1\]: takes up to \d+ prompt tokens"),
])
def test_a_daemon_on_the_server_checks_its_task_section_at_start_up(server: PolicyServer, task: dict[str, Any],
                                                                    message: str):
    """The daemon's room settings keep none on the server (a `RemotePolicy` has no
    `fix_prompt_positions`): they must fit the room the server's warm-up kept."""
    cfg = test_config(model={"factory": "phyai_edge.serve.client:remote_policy",
                             "factory_args": {"endpoint": server.endpoint, "timeout_s": 10.0}},
                      task={"endpoint": free_tcp_endpoint(), **task})
    d = Daemon(cfg, realtime=False, status_line=False)
    try:
        with pytest.raises(ConfigError, match=message):
            d.setup()
    finally:
        d.shutdown()
