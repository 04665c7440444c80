"""The instruction set at run time (`[task]`, control/task.py): wire format, config, the
worker's fit check, and the daemon taking a new instruction at once."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from phyai_edge.control.config import ConfigError, TaskConfig, parse_config
from phyai_edge.control.daemon import Daemon
from phyai_edge.control.fakes import FakePolicy, free_tcp_endpoint, test_config
from phyai_edge.control.protocol import TaskReply, TaskRequest, decode_task_request, encode_task_request
from phyai_edge.control.task import TaskChannel, request_instruction
from phyai_edge.control.worker import (
    PolicySpec,
    ProcessWorker,
    PromptFit,
    ThreadWorker,
    make_warmup_job,
    run_job,
)

# ---------------------------------------------------------------- wire format


def test_task_request_and_reply_round_trip():
    assert decode_task_request(encode_task_request("put the cup in the sink")) == TaskRequest("put the cup in the sink")
    assert decode_task_request(encode_task_request(None)) == TaskRequest()
    assert decode_task_request(b"{}") == TaskRequest()  # a query needs no version
    assert decode_task_request(encode_task_request("go", hold=False)) == TaskRequest("go", False)
    assert decode_task_request(b'{"hold": true}') == TaskRequest(None, True)
    reply = TaskReply(False, "pick up the cube", "too long", tokens=90, room=80, changes=3, holding=True)
    assert TaskReply.decode(reply.encode()) == reply
    assert TaskReply.decode(b'{"ok": true, "prompt": "x"}') == TaskReply(True, "x")  # fields added later default


@pytest.mark.parametrize("data, words", [
    (b"put the cup", "not a UTF-8 JSON object"),
    (b"\xff\xfe", "not a UTF-8 JSON object"),
    (b'["a"]', "expected a JSON object"),
    (b'{"prompt": 3}', "prompt must be a string"),
    (b'{"promt": "x"}', "unknown field 'promt'"),
    (b'{"version": 2, "prompt": "x"}', "unsupported version 2"),
    (b'{"hold": "yes"}', 'hold must be true or false, got "yes"'),
    (b'{"prompt": "' + b"a" * 20000 + b'"}', "above the 16384-byte limit"),
])
def test_a_bad_task_request_is_refused_naming_what_is_wrong(data, words):
    with pytest.raises(ValueError, match=words):
        decode_task_request(data)


# ---------------------------------------------------------------- config


def _cfg(task: dict, **model) -> object:
    data = {"cameras": {"top": {}}, "task": task}
    if model:
        data["model"] = model
    return parse_config(data)


def test_the_task_section_parses_and_is_off_by_default():
    assert _cfg({}).task == TaskConfig()
    t = _cfg({"endpoint": "ipc:///tmp/phyai-task", "prompts": ["fold the towel"], "prompt_tokens": 96,
              "any_prompt": False}).task
    assert (t.endpoint, t.prompts, t.prompt_tokens, t.any_prompt) == ("ipc:///tmp/phyai-task", ("fold the towel",), 96, False)


@pytest.mark.parametrize("task, model, key", [
    ({"endpoint": "localhost:5557"}, {}, "task.endpoint"),
    ({"endpoint": "tcp://127.0.0.1:5555"}, {}, "task.endpoint"),  # publish.endpoint's default
    ({"prompts": "fold the towel"}, {}, "task.prompts"),
    ({"prompts": ["ok", "two\nlines"]}, {}, "task.prompts[1]"),
    ({"prompts": ["   "]}, {}, "task.prompts[0]"),
    ({"prompts": ["x" * 1001]}, {}, "task.prompts[0]"),
    ({"prompt_tokens": -1}, {}, "task.prompt_tokens"),
    ({"any_prompts": False}, {}, "task.any_prompts"),
    ({}, {"prompt": "pick\tup"}, "model.prompt"),
    ({"prompts": ["fold the towel"]}, {}, "task.prompts"),  # without an endpoint: never used
    ({"prompt_tokens": 96}, {}, "task.prompt_tokens"),
    ({"any_prompt": False}, {}, "task.any_prompt"),
])
def test_a_task_mistake_names_its_key(task, model, key):
    with pytest.raises(ConfigError) as err:
        _cfg(task, **model)
    assert str(err.value).startswith(f"{key}: "), err.value


def test_an_empty_model_prompt_still_means_the_checkpoint_s_default():
    assert _cfg({}, prompt="").model.prompt == ""


# ---------------------------------------------------------------- the channel's decisions


class Checker:
    """A worker's fit check: every instruction takes `tokens`, the policy runs `room`."""

    def __init__(self, tokens: int = 40, room: int = 64, most: int = 128) -> None:
        self.tokens, self.room, self.most = tokens, room, most
        self.asked: list[str] = []

    def __call__(self, prompt: str) -> PromptFit:
        self.asked.append(prompt)
        return PromptFit(self.tokens, self.room, None, self.most)


def _ask(channel: TaskChannel, prompt: str | None) -> TaskReply:
    return channel.handle(encode_task_request(prompt))


def test_the_channel_takes_an_instruction_that_fits_and_refuses_one_that_does_not():
    check = Checker()
    ch = TaskChannel(TaskConfig(endpoint="ipc:///unused"), "pick up the cube", check)
    assert _ask(ch, None) == TaskReply(True, "pick up the cube")
    assert _ask(ch, "pick up the cube") == TaskReply(True, "pick up the cube")  # unchanged: no check, no change
    assert check.asked == []
    taken = _ask(ch, "put it in the bowl")
    assert taken == TaskReply(True, "put it in the bowl", tokens=40, room=64, changes=1)
    assert ch.current == (1, "put it in the bowl")
    check.tokens = 70
    refused = _ask(ch, "put it in the bowl, then wipe the table")
    assert not refused.ok and refused.prompt == "put it in the bowl" and (refused.tokens, refused.room) == (70, 64)
    assert "raise task.prompt_tokens" in refused.error
    check.tokens = 130
    assert "the model takes at most 128: shorten it" in _ask(ch, "something far too long").error
    assert ch.current == (1, "put it in the bowl") and ch.refused == 2


def test_a_request_of_several_frames_is_refused_and_the_channel_keeps_serving():
    """Two frames (a hold and a stray frame) were taken, left unanswered, and ended the channel's
    thread: every later request went unanswered, so the robot stayed held until a restart."""
    import zmq

    endpoint = free_tcp_endpoint()
    ch = TaskChannel(TaskConfig(endpoint=endpoint), "pick up the cube", Checker())
    ch.start()
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([encode_task_request(None, True), b"stray"])
        assert sock.poll(5000), "no reply to a two-frame request"
        reply = TaskReply.decode(sock.recv())
        assert not reply.ok and "one frame of JSON, got 2 frames" in reply.error and not ch.holding
        assert request_instruction(endpoint, hold=True, timeout_s=5).holding
        assert not request_instruction(endpoint, hold=False, timeout_s=5).holding
    finally:
        sock.close()
        ch.close()


def test_text_that_cannot_be_an_instruction_never_reaches_the_worker():
    check = Checker()
    ch = TaskChannel(TaskConfig(endpoint="ipc:///unused"), "pick up the cube", check)
    for data in (encode_task_request(""), encode_task_request("a\x00b"), b"not json"):
        reply = ch.handle(data)
        assert not reply.ok and reply.prompt == "pick up the cube" and reply.error
    assert check.asked == [] and ch.refused == 3 and ch.changes == 0


def test_with_any_prompt_off_only_declared_instructions_are_taken():
    check = Checker()
    cfg = TaskConfig(endpoint="ipc:///unused", prompts=("fold the towel",), any_prompt=False)
    ch = TaskChannel(cfg, "pick up the cube", check)
    assert "not a declared instruction" in _ask(ch, "throw the cube").error
    assert _ask(ch, "fold the towel").ok
    assert _ask(ch, "pick up the cube").ok  # model.prompt is declared too
    assert ch.changes == 2 and check.asked == ["fold the towel", "pick up the cube"]


def test_a_failed_check_refuses_and_says_why():
    ch = TaskChannel(TaskConfig(endpoint="ipc:///unused"), "a", lambda p: PromptFit(None, None, "worker down"))
    reply = _ask(ch, "b")
    assert not reply.ok and reply.error == "worker down" and ch.prompt == "a"


# ---------------------------------------------------------------- the policy's side: tokens and room


@pytest.fixture(scope="module")
def tiny_eager():
    from phyai_edge.engines.policy import load_policy

    return load_policy(preset="tiny", backend="eager")


LONG = " ".join(["then put the red cube next to the blue bowl"] * 6)


def test_prompt_fit_counts_tokens_before_truncation(tiny_eager):
    tokens, room, most = tiny_eager.prompt_fit("pick up the cube")
    assert tokens == tiny_eager.adapter.longest_prompt_tokens("pick up the cube") and 54 <= tokens <= 65
    assert room == most == tiny_eager.adapter.cfg.max_token_len == 128  # eager: any length runs
    long_tokens, _, _ = tiny_eager.prompt_fit(LONG)
    assert long_tokens > 128  # the tokenizer would cut it at 128: counted whole, so it is refused
    assert not PromptFit(long_tokens, room, None, most).fits


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not _cuda_available(), reason="needs a CUDA device (graph capture)"))])
def test_the_room_a_cudagraph_engine_reports_runs_without_new_graphs(device):
    """The room is a promise: an instruction within it runs the graph set the warm-up captured.
    On the CPU the engine keeps its graph sets (it runs them eagerly), so their count is checked;
    on a GPU the same count is of captured graphs."""
    from phyai_edge.control.worker import policy_info
    from phyai_edge.engines.policy import load_policy

    policy = load_policy(preset="tiny", backend="cudagraph", device=device)
    info_prompt = "pick up the cube"
    warm = replace(make_warmup_job(policy_info(policy), info_prompt), room_tokens=84)
    assert run_job(policy, warm).error is None
    tokens, room, most = policy.prompt_fit(info_prompt)
    assert (tokens, room, most) == (65, 96, 128)  # 84 tokens of room, rounded up to the 16-token bucket
    sets = list(policy.engine._sets)
    # An instruction longer than model.prompt's bucket (80) but within the room: the same graph set.
    longer = "pick up the red cube and put it down gently next to the blue bowl"
    assert 80 < policy.prompt_fit(longer)[0] <= 96
    rng = np.random.default_rng(1)
    for scale in (0.1, 5.0):
        state = (rng.standard_normal(policy.state_dim) * scale).astype(np.float32)
        assert run_job(policy, replace(warm, prompt=longer, state=state, warmup=False)).error is None
    assert list(policy.engine._sets) == sets
    # Without the room the same instruction does not fit: it would build graphs in the loop.
    assert run_job(policy, replace(warm, room_tokens=0)).error is None
    assert policy.prompt_fit(longer)[1] == 80
    assert run_job(policy, replace(warm, prompt=longer, room_tokens=0, warmup=False)).error is None
    assert len(policy.engine._sets) > len(sets)


def test_the_thread_and_process_workers_answer_prompt_checks(tiny_eager):
    tw = ThreadWorker(policy=tiny_eager)
    tw.start()
    fit = tw.check_prompt("pick up the cube")
    assert fit.fits and fit.tokens == tiny_eager.prompt_fit("pick up the cube")[0]
    assert not tw.check_prompt(LONG).fits
    tw.close()

    spec = PolicySpec("phyai_edge.engines.policy:load_policy", {"preset": "tiny", "backend": "eager"})
    pw = ProcessWorker(spec)
    pw.start(120)
    try:
        info = pw.info
        # A check asked while an inference runs is answered after it, on the same pipe.
        pw.submit(make_warmup_job(info, "pick up the cube"))
        remote = pw.check_prompt("pick up the cube", timeout_s=60)
        assert remote == PromptFit(fit.tokens, 128, None, 128)
        deadline = time.monotonic() + 60
        res = None
        while res is None and time.monotonic() < deadline:
            res = pw.poll()
            time.sleep(0.01)
        assert res is not None and res.error is None
        assert not pw.check_prompt(LONG, timeout_s=60).fits
        pw.up = False  # as the client thread sets it when the process died
        down = pw.check_prompt("x", timeout_s=1)
        assert not down.fits and "cannot check the instruction" in down.error
    finally:
        pw.close()


# ---------------------------------------------------------------- the daemon


class RecordsPrompts(FakePolicy):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.calls_seen: list[tuple[str, int]] = []  # (prompt, RTC prefix rows; -1 without one)

    def infer(self, observations, rtc=None, noise=None):
        prefix = -1 if rtc is None or rtc.prefix is None else int(np.asarray(rtc.prefix).reshape(-1, self.action_dim).shape[0])
        self.calls_seen.append((observations[0].prompt, prefix))
        return super().infer(observations, rtc, noise)


def test_the_daemon_runs_a_new_instruction_from_the_next_chunk_started_at_once():
    from phyai_edge.control.listener import Listener
    from phyai_edge.control.protocol import Flag

    endpoint = free_tcp_endpoint()
    cfg = test_config(task={"endpoint": endpoint}, chunking={"mode": "inpaint", "execution_horizon": 40})
    policy = RecordsPrompts(action_dim=6, state_dim=6, latency_s=0.01)
    d = Daemon(cfg, policy=policy, realtime=False, status_line=False)
    d.setup()
    listener = Listener(d.publisher.endpoint, cfg.publish.topic, cfg.publish.chunk_topic, keep=True)
    time.sleep(0.2)  # the subscription reaches the publisher before the first tick
    thread = threading.Thread(target=d.run, kwargs={"duration_s": 20}, daemon=True)
    thread.start()
    try:
        assert d.wait_started(10)
        end = time.monotonic() + 10
        while d.stats.adopted < 2 and time.monotonic() < end:  # a chunk is executing, the next not due
            time.sleep(0.005)
        assert d.stats.adopted >= 2
        assert request_instruction(endpoint) == TaskReply(True, cfg.model.prompt)
        reply = request_instruction(endpoint, "put the cube in the bowl")
        assert reply == TaskReply(True, "put the cube in the bowl", changes=1)  # the fake policy cannot count tokens
        end = time.monotonic() + 10
        while not any(p == "put the cube in the bowl" for p, _ in policy.calls_seen) and time.monotonic() < end:
            time.sleep(0.005)
        new = [i for i, (p, _) in enumerate(policy.calls_seen) if p == "put the cube in the bowl"]
        assert new, "no chunk ran the new instruction"
        first = new[0]
        assert all(p == cfg.model.prompt for p, _ in policy.calls_seen[:first])
        # Started at once: most of the executing chunk was still ahead (a chunk started as
        # usual, after s = 40 of H = 50 actions, carries at most 10 rows of prefix).
        assert policy.calls_seen[first][1] > 10, policy.calls_seen
        assert not request_instruction(endpoint, "two\nlines").ok
        assert d.render_status().endswith(" instructions 1")  # the status line and sd_notify's STATUS=
        # Subscribers see the takeover: the first action of the new instruction's chunk starts it.
        end = time.monotonic() + 10
        while not any(h.instruction == 1 and h.kind == 2 for h, _ in listener.messages) and time.monotonic() < end:
            listener.poll(0.05)  # until the chunk topic's message, sent right after its CHUNK_START action
        msgs = [(h, v) for h, v in listener.messages if h.kind == 1]
        first = next(i for i, (h, _) in enumerate(msgs) if h.instruction == 1)
        assert msgs[first][0].flags & Flag.CHUNK_START
        assert all(h.instruction == 0 for h, _ in msgs[:first])
        assert any(h.kind == 2 and h.instruction == 1 for h, _ in listener.messages)  # the chunk topic too
    finally:
        d.stop()
        thread.join(10)
        listener.close()
    assert not thread.is_alive()
    assert d.summary()["task"] == {"prompt": "put the cube in the bowl", "changes": 1, "refused": 1}


@pytest.mark.parametrize("sections, message", [
    # a model.prompt the model would truncate (with or without [task])
    ({"model": {"prompt": LONG}}, r"^model\.prompt: takes up to \d+ prompt tokens .*the model takes at most 128"),
    ({"task": {"endpoint": "", "prompts": []}, "model": {"prompt": LONG}}, r"^model\.prompt: "),
    ({"task": {"endpoint": "tcp://127.0.0.1:1", "prompts": ["fold the towel", LONG]}}, r"^task\.prompts\[1\]: takes up to"),
    ({"task": {"endpoint": "tcp://127.0.0.1:1", "prompt_tokens": 500}},
     r"^task\.prompt_tokens: 500 is more than the policy takes \(128\)"),
])
def test_an_instruction_the_model_cannot_run_stops_the_start_up_naming_its_key(tiny_eager, sections, message):
    d = Daemon(test_config(**sections), policy=tiny_eager, realtime=False, status_line=False)
    try:
        with pytest.raises(ConfigError, match=message):
            d.setup()
    finally:
        d.shutdown()


def test_the_task_command_says_when_no_daemon_answers_or_the_endpoint_is_not_one():
    def cli(endpoint: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "phyai_edge", "task", "--endpoint", endpoint, "--timeout", "0.3",
                               "fold the towel"], capture_output=True, text=True, timeout=60)

    out = cli(free_tcp_endpoint())
    assert out.returncode == 2 and "no answer from tcp://127.0.0.1:" in out.stderr
    out = cli("localhost:5557")
    assert out.returncode == 2 and "endpoint 'localhost:5557'" in out.stderr and "Traceback" not in out.stderr


def test_task_wait_without_an_instruction_is_refused(capsys):
    """`--release --wait` returned 0 at once: there was no instruction whose action it could wait for."""
    from phyai_edge.cli import main as cli

    assert cli(["task", "--release", "--wait", "--endpoint", free_tcp_endpoint()]) == 2
    assert "--wait waits for an instruction's first action" in capsys.readouterr().err


def test_the_task_command_sets_and_shows_the_instruction(tmp_path):
    """The CLI against a channel served on its own (no daemon): exit codes and the JSON reply."""
    endpoint = free_tcp_endpoint()
    ch = TaskChannel(TaskConfig(endpoint=endpoint), "pick up the cube", Checker())
    ch.start()
    try:
        def cli(*argv: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "phyai_edge", "task", "--endpoint", endpoint, *argv],
                                  capture_output=True, text=True, timeout=60)

        shown = cli()
        assert shown.returncode == 0 and "running: 'pick up the cube'" in shown.stdout
        taken = cli("fold the towel", "--json", str(tmp_path / "r.json"))
        assert taken.returncode == 0 and "taken: 'fold the towel' (40 of 64 prompt tokens)" in taken.stdout
        written = json.loads((tmp_path / "r.json").read_text())
        assert written["changes"] == 1 and written["version"] == 1  # the reply as sent, its version too
        refused = cli("")
        assert refused.returncode == 1 and "refused: the instruction is empty" in refused.stderr
    finally:
        ch.close()
    assert ch.prompt == "fold the towel"


def test_task_wait_returns_when_the_robot_begins_on_the_instruction():
    """`phyai-edge task --wait`: subscribed to the daemon's actions before asking, it returns with
    the first action computed with the new instruction; exit 3 when none comes (here: the daemon
    holds on stale state, so no chunk runs)."""
    endpoint = free_tcp_endpoint()
    cfg = test_config(task={"endpoint": endpoint}, chunking={"mode": "inpaint", "execution_horizon": 40})
    d = Daemon(cfg, policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), realtime=False, status_line=False)
    d.setup()
    thread = threading.Thread(target=d.run, kwargs={"duration_s": 30}, daemon=True)
    thread.start()

    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "phyai_edge", "task", "--endpoint", endpoint, "--actions",
                               d.publisher.endpoint, "--wait", *argv], capture_output=True, text=True, timeout=60)

    try:
        assert d.wait_started(10)
        out = cli("put the cube in the bowl")
        assert out.returncode == 0, out
        assert "taken: 'put the cube in the bowl'" in out.stdout and "the robot began on it at action seq" in out.stdout
        assert cli("put the cube in the bowl").returncode == 0  # already running: nothing to wait for
        d.state.alive = False  # the synthetic state freezes: stale, HOLD, no chunk is computed
        held = cli("fold the towel", "--timeout", "1.5")
        assert held.returncode == 3 and "was taken, but no action computed with it arrived" in held.stderr, held
    finally:
        d.stop()
        thread.join(10)


def test_the_channel_holds_and_releases_and_a_refused_instruction_changes_neither():
    check = Checker()
    ch = TaskChannel(TaskConfig(endpoint="ipc:///unused"), "pick up the cube", check)
    held = ch.handle(encode_task_request(hold=True))
    assert held == TaskReply(True, "pick up the cube", holding=True) and ch.holding
    check.tokens = 99  # too long for the room: the release that comes with it is not applied either
    refused = ch.handle(encode_task_request("wipe the table", hold=False))
    assert not refused.ok and refused.holding and ch.holding and ch.prompt == "pick up the cube"
    check.tokens = 40
    resumed = ch.handle(encode_task_request("wipe the table", hold=False))
    assert resumed == TaskReply(True, "wipe the table", tokens=40, room=64, changes=1, holding=False)
    assert not ch.holding and ch.current == (1, "wipe the table")
    assert TaskChannel(TaskConfig(endpoint="ipc:///unused", start_held=True), "a", check).holding


def test_an_operator_hold_publishes_hold_paused_runs_nothing_and_resumes_fresh():
    from phyai_edge.control.listener import Listener
    from phyai_edge.control.protocol import Flag

    endpoint = free_tcp_endpoint()
    cfg = test_config(task={"endpoint": endpoint, "start_held": True})
    policy = RecordsPrompts(action_dim=6, state_dim=6, latency_s=0.01)
    d = Daemon(cfg, policy=policy, realtime=False, status_line=False)
    d.setup()
    listener = Listener(d.publisher.endpoint, cfg.publish.topic, keep=True)
    time.sleep(0.2)
    thread = threading.Thread(target=d.run, kwargs={"duration_s": 30}, daemon=True)
    thread.start()

    def actions():
        listener.poll(0.05)
        return [h for h, _ in listener.messages if h.kind == 1]

    def wait_for(pred, what):
        end = time.monotonic() + 10
        while not pred() and time.monotonic() < end:
            time.sleep(0.01)
        assert pred(), what

    try:
        assert d.wait_started(10)
        wait_for(lambda: len(actions()) >= 20, "20 actions while held from the start")
        calls = len(policy.calls_seen)  # the warm-up's only: nothing runs while held
        assert all(h.flags & Flag.HOLD and h.flags & Flag.PAUSED for h in actions())
        assert request_instruction(endpoint, "put the cube in the bowl", hold=False).changes == 1
        wait_for(lambda: any(not h.flags & Flag.HOLD for h in actions()), "policy actions after the release")
        first = next(h for h in actions() if not h.flags & Flag.HOLD)
        assert first.flags & Flag.CHUNK_START and first.instruction == 1
        assert policy.calls_seen[calls][0] == "put the cube in the bowl"
        assert policy.calls_seen[calls][1] == -1  # a fresh chunk: no prefix from the dropped one
        held_at = len(actions())
        assert request_instruction(endpoint, hold=True).holding
        wait_for(lambda: len(actions()) >= held_at + 20, "20 more actions")
        tail = actions()[held_at + 5:]  # a tick or two may pass before the clock reads the hold
        assert tail and all(h.flags & Flag.PAUSED and h.flags & Flag.HOLD for h in tail)
        seqs = [h.seq for h in actions()]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no sequence number lost or repeated
    finally:
        d.stop()
        thread.join(10)
        listener.close()
    assert d.summary()["holds"].get("paused", 0) >= 40


def test_a_hold_released_within_one_tick_still_holds_at_least_one():
    """The operator was told `holding = true`: even when the release comes before the clock's next
    tick (a round trip takes well under a period), that hold reaches the robot: a HOLD | PAUSED tick
    at least, and the executing chunk dropped (the next chunk starts fresh)."""
    from test_control_daemon import Running

    from phyai_edge.control.protocol import Flag

    endpoint = free_tcp_endpoint()
    cfg = test_config(task={"endpoint": endpoint}, robot={"control_hz": 20.0})
    run = Running(Daemon(cfg, policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), realtime=False,
                         status_line=False))
    run.wait_for(lambda: run.daemon.stats.adopted >= 2, what="two chunks")
    for _ in range(3):
        n = len(run.actions())
        assert request_instruction(endpoint, hold=True).holding
        assert not request_instruction(endpoint, hold=False).holding
        run.wait_for(lambda n=n: any(h.flags & Flag.PAUSED and h.flags & Flag.HOLD for h, _ in run.actions()[n:]),
                     what="the hold on the wire")
        time.sleep(0.3)
    run.stop()
    seqs = [h.seq for h, _ in run.actions()]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert run.daemon.summary()["holds"].get("paused", 0) >= 3


def test_prometheus_shows_the_hold_and_the_instruction_as_states():
    import socket
    import urllib.request

    from phyai_edge.control.metrics import Metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = Metrics()
    assert metrics.serve("127.0.0.1", port)
    ch = TaskChannel(TaskConfig(endpoint="ipc:///unused", start_held=True), "pick up the cube", Checker(), metrics=metrics)

    def scrape() -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

    assert "phyai_task_holding 1.0" in scrape() and "phyai_task_instruction 0.0" in scrape()
    assert ch.handle(encode_task_request("wipe the table", hold=False)).ok
    text = scrape()
    assert "phyai_task_holding 0.0" in text and "phyai_task_instruction 1.0" in text
    assert 'phyai_task_requests_total{result="release"} 1.0' in text


def test_one_operator_hold_over_an_inference_in_flight_is_one_hold_in_the_log(caplog):
    """The inference a hold drops stays in flight until it returns; each tick until then counted a
    new hold ("10 such holds so far" 0.2 s after one operator hold)."""
    endpoint = free_tcp_endpoint()
    cfg = test_config(task={"endpoint": endpoint})
    d = Daemon(cfg, policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.3), realtime=False, status_line=False)
    d.setup()
    thread = threading.Thread(target=d.run, kwargs={"duration_s": 30}, daemon=True)
    thread.start()
    try:
        assert d.wait_started(10)
        end = time.monotonic() + 10
        while d.stats.adopted < 1 and time.monotonic() < end:
            time.sleep(0.01)
        with caplog.at_level("WARNING", logger="phyai_edge.control"):
            request_instruction(endpoint, hold=True)
            time.sleep(0.5)  # ~25 held ticks, the first with an inference in flight
    finally:
        d.stop()
        thread.join(10)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("HOLD: paused")]
    assert len(lines) == 1 and "such holds" not in lines[0], lines
    assert d._holds_logged["paused"] == 1
