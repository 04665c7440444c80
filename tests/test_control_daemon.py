"""The daemon loop with a stand-in policy: sequence numbers, HOLD on stale inputs, NaN, failures."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import zmq

from phyai_edge.control.daemon import Daemon
from phyai_edge.control.fakes import FakePolicy, free_tcp_endpoint, test_config
from phyai_edge.control.listener import Listener
from phyai_edge.control.protocol import Flag, FrameMessage
from phyai_edge.control.state import StateSample, SyntheticState


class Running:
    """A daemon on a background thread plus a subscriber on the test's thread."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        daemon.setup()
        cfg = daemon.cfg
        self.listener = Listener(daemon.publisher.endpoint, cfg.publish.topic, cfg.publish.chunk_topic, keep=True)
        time.sleep(0.2)  # PUB/SUB join: let the subscription reach the publisher before the first tick
        self.thread = threading.Thread(target=daemon.run, daemon=True)
        self.thread.start()
        assert daemon.wait_started(10)

    def actions(self):
        return [(h, v) for h, v in self.listener.messages if h.kind == 1]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.listener.poll(0.05)
            if predicate():
                return
        raise AssertionError(f"timed out waiting for {what or predicate}")

    def stop(self) -> None:
        self.daemon.stop()
        self.thread.join(5)
        assert not self.thread.is_alive()
        self.wait_for(lambda: any(h.flags & Flag.SHUTDOWN for h, _ in self.actions()), 2, "SHUTDOWN message")
        self.listener.close()


def count(run: Running, pred: Callable) -> int:
    return sum(1 for h, v in run.actions() if pred(h, v))


def test_every_sequence_number_exactly_once_and_chunks_take_over():
    cfg = test_config()
    run = Running(Daemon(cfg, policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.03), realtime=False))
    run.wait_for(lambda: count(run, lambda h, v: not h.flags & Flag.HOLD) >= 60, what="60 policy actions")
    run.stop()
    seqs = [h.seq for h, _ in run.actions()]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "gap or repeat in sequence numbers"
    assert seqs[0] == 0 and run.listener.stats.gaps == 0 and run.listener.stats.repeats == 0
    assert run.actions()[-1][0].flags & Flag.HOLD and run.actions()[-1][0].seq == run.daemon.publisher.seq - 1
    st = run.daemon.stats
    assert st.adopted >= 3 and st.failures == 0
    # The 30 ms fake needs 2-3 slots at 50 Hz; each new chunk takes over at exactly that index.
    starts = [h for h, _ in run.actions() if h.flags & Flag.CHUNK_START]
    assert starts and all(h.index == d for h, d in zip(starts, st.delays))
    assert all(2 <= d <= 6 for d in st.delays), st.delays
    # The whole-chunk topic: one message per adopted chunk, row 0 == the CHUNK_START action.
    chunk_msgs = [(h, v) for h, v in run.listener.messages if h.kind == 2]
    by_seq = {h.seq: v for h, v in run.actions()}
    assert chunk_msgs
    for h, rows in chunk_msgs:
        assert rows.shape == (cfg.chunking.horizon - h.index, 6)
        np.testing.assert_allclose(by_seq[h.seq][0], rows[0], atol=1e-6)
    # Inference starts after s actions of the executing chunk: every RTC prefix came with d.
    reqs = [r for r in run.daemon.worker._policy.requests if r is not None]
    assert reqs and all(r.execution_horizon == 10 and r.mode == "inpaint" for r in reqs)


def test_stale_state_gives_hold_then_recovery():
    cfg = test_config(safety={"state_max_age_ms": 60.0})
    state = SyntheticState(6)
    run = Running(Daemon(cfg, policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), state=state, realtime=False))
    run.wait_for(lambda: count(run, lambda h, v: not h.flags & Flag.HOLD) >= 10, what="policy actions")
    state.alive = False  # the controller's stream stops
    run.wait_for(lambda: count(run, lambda h, v: h.flags & Flag.STALE) >= 5, what="STALE holds")
    n_before = len(run.actions())
    state.alive = True
    run.wait_for(lambda: any(not h.flags & Flag.HOLD for h, _ in run.actions()[n_before:]), what="recovery")
    run.stop()
    flags = [h.flags for h, _ in run.actions()]
    first_stale = next(i for i, f in enumerate(flags) if f & Flag.STALE)
    stale_run = flags[first_stale:first_stale + 5]
    assert all(f & Flag.HOLD for f in stale_run)
    # The hold target ("last") repeats the last published action.
    acts = run.actions()
    np.testing.assert_array_equal(acts[first_stale][1], acts[first_stale - 1][1])
    # After the stale period, a fresh chunk starts (WARMUP holds until it arrives), then policy actions.
    assert run.daemon.stats.holds.get("stale", 0) >= 5
    assert run.listener.stats.gaps == 0 and run.listener.stats.repeats == 0


class StaleWhileResultWaits(SyntheticState):
    """Once armed, the state is stale on exactly the ticks where a finished inference waits to be
    collected: the inputs go bad on the very tick a chunk would be adopted."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.worker = None
        self.armed = False

    def latest(self):
        sample = super().latest()
        if self.armed and self.worker._result is not None:  # ThreadWorker: a result not yet polled
            return StateSample(sample.values, sample.time_s - 10.0, sample.seq)
        return sample


def test_the_chunk_topic_follows_its_chunk_start_action_and_never_a_dropped_chunk():
    cfg = test_config()
    state = StaleWhileResultWaits(6)
    run = Running(Daemon(cfg, policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), state=state, realtime=False))
    state.worker = run.daemon.worker
    run.wait_for(lambda: run.daemon.stats.adopted >= 2, what="two chunks")
    state.armed = True
    run.wait_for(lambda: count(run, lambda h, v: h.flags & Flag.STALE) >= 3, what="STALE on collecting ticks")
    state.armed = False
    n = len(run.actions())
    run.wait_for(lambda: any(h.flags & Flag.CHUNK_START for h, _ in run.actions()[n:]), what="a chunk again")
    run.stop()
    msgs = run.listener.messages
    chunks = [i for i, (h, _) in enumerate(msgs) if h.kind == 2]
    assert len(chunks) == count(run, lambda h, v: h.flags & Flag.CHUNK_START) == run.daemon.stats.adopted
    for i in chunks:
        action, chunk = msgs[i - 1][0], msgs[i][0]
        assert action.kind == 1 and action.seq == chunk.seq, "a chunk message not right after its action"
        assert action.flags & Flag.CHUNK_START and not action.flags & Flag.HOLD and action.chunk_id == chunk.chunk_id
    assert run.daemon.stats.stale_results >= 3, "the chunks that arrived on stale ticks are dropped"
    assert run.listener.stats.gaps == 0 and run.listener.stats.repeats == 0


def test_zmq_camera_that_dies_and_comes_back():
    cam_ep = free_tcp_endpoint()
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind(cam_ep)
    alive = threading.Event()
    alive.set()
    done = threading.Event()

    def camera():
        seq = 0
        img = np.zeros((32, 32, 3), np.uint8)
        while not done.is_set():
            if alive.is_set():
                seq += 1
                pub.send(FrameMessage("top", img, seq, time.monotonic_ns()).encode())
            time.sleep(0.01)

    t = threading.Thread(target=camera, daemon=True)
    t.start()
    cfg = test_config(cameras={"top": {"source": "zmq", "endpoint": cam_ep}}, safety={"camera_max_age_ms": 80.0})
    run = Running(Daemon(cfg, policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), realtime=False))
    try:
        run.wait_for(lambda: count(run, lambda h, v: not h.flags & Flag.HOLD) >= 10, what="policy actions")
        alive.clear()  # camera dies
        run.wait_for(lambda: count(run, lambda h, v: h.flags & Flag.STALE) >= 3, what="STALE holds")
        n = len(run.actions())
        alive.set()  # and comes back
        run.wait_for(lambda: any(not h.flags & Flag.HOLD for h, _ in run.actions()[n:]), what="recovery")
        run.stop()
    finally:
        done.set()
        t.join(1)
        pub.close(0)
    flags = [h.flags for h, _ in run.actions()]
    i_stale = next(i for i, f in enumerate(flags) if f & Flag.STALE)
    i_back = next(i for i in range(i_stale, len(flags)) if not flags[i] & Flag.HOLD)
    assert all(f & Flag.HOLD for f in flags[i_stale:i_back])
    assert any(f & Flag.WARMUP for f in flags[i_stale:i_back])  # a fresh chunk after recovery
    assert run.listener.stats.gaps == 0


def test_nan_from_the_policy_is_never_published():
    cfg = test_config()
    pol = FakePolicy(action_dim=6, state_dim=6, latency_s=0.01, nan_calls=(2, 3, 5))
    run = Running(Daemon(cfg, policy=pol, realtime=False))
    run.wait_for(lambda: pol.calls >= 7 and count(run, lambda h, v: not h.flags & Flag.HOLD) >= 30, what="7 calls")
    run.stop()
    assert all(np.isfinite(v).all() for _, v in run.listener.messages)
    assert run.listener.stats.nonfinite == 0
    assert run.daemon.stats.nonfinite_chunks >= 3
    # Each rejected chunk is flagged INFER_FAIL until a good chunk arrives.
    assert count(run, lambda h, v: h.flags & Flag.INFER_FAIL) >= 1


def test_a_rejected_nan_chunk_counts_as_a_failed_inference_in_prometheus():
    """phyai_nonfinite_actions is the guard acting (a payload replaced at the last line); a chunk
    rejected at collection is a failed inference, as in summary()["failures"]."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pol = FakePolicy(action_dim=6, state_dim=6, latency_s=0.01, nan_calls=(2, 3))
    run = Running(Daemon(test_config(metrics={"port": port}), policy=pol, realtime=False))
    run.wait_for(lambda: run.daemon.stats.nonfinite_chunks >= 2 and run.daemon.stats.adopted >= 2, what="2 NaN chunks")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    run.stop()
    assert run.daemon.summary()["nonfinite_actions"] == 0
    assert "phyai_nonfinite_actions_total 0.0" in text
    assert f"phyai_inference_failures_total {float(run.daemon.stats.failures)}" in text


def test_prometheus_counts_clamps_by_limit_and_exports_process_metrics():
    """phyai_clamped_actions{limit} counts position and rate clamps apart, as the summary does (both
    series from the first scrape), and the standard process_* series are exported."""
    import re
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The fake's actions are 0.5 sin(pi t + i): above 0.3 for part of each period, and moving up
    # to 0.031 a tick, over the 0.02 a tick that 1.0 / s allows at 50 Hz.
    cfg = test_config(metrics={"port": port}, robot={"limits": {"action_max": 0.3, "max_rate": 1.0}})
    run = Running(Daemon(cfg, policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), realtime=False))
    run.wait_for(lambda: run.daemon.stats.adopted >= 3, what="3 chunks")
    run.stop()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    counted = {m[1]: int(float(m[2])) for m in re.finditer(r'phyai_clamped_actions_total\{limit="(\w+)"\} (\S+)', text)}
    clamped = run.daemon.summary()["clamped"]
    assert clamped["position"] > 0 and clamped["rate"] > 0, clamped
    assert counted == clamped
    assert re.search(r"^process_resident_memory_bytes [1-9]", text, re.M), text
    assert "phyai_worker_process_" not in text  # a thread worker: the model's memory is this process's


def test_rtc_prefix_is_what_the_limits_publish():
    """The prefix sent with an inference is the executing chunk's actions as the guard will publish
    them: the fake policy's 0.5-amplitude actions cut at 0.3, not the raw values the robot never
    gets."""
    cfg = test_config(robot={"limits": {"action_max": 0.3}}, chunking={"mode": "inpaint", "execution_horizon": 10})
    pol = FakePolicy(action_dim=6, state_dim=6, latency_s=0.01)
    run = Running(Daemon(cfg, policy=pol, realtime=False))
    run.wait_for(lambda: sum(r is not None and r.prefix is not None for r in pol.requests) >= 3, what="3 prefixes")
    run.stop()
    prefixes = [np.asarray(r.prefix) for r in pol.requests if r is not None and r.prefix is not None]
    assert all(float(p.max()) <= 0.3 + 1e-6 for p in prefixes), max(float(p.max()) for p in prefixes)
    assert run.daemon.summary()["clamped"]["position"] > 0  # the raw chunks did reach above the limit


def test_status_line_before_the_first_chunk_says_nothing_yet():
    """systemd's STATUS= (and the terminal's status line) read "d -1 infer nan ms" until the first
    chunk; now "-" for what has not happened, then the numbers."""
    d = Daemon(test_config(), policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), realtime=False)
    assert " d - infer - ms " in d.render_status()
    run = Running(d)
    run.wait_for(lambda: d.stats.adopted >= 1, what="a chunk")
    text = d.render_status()
    run.stop()
    assert " d - " not in text and "nan" not in text and " infer - " not in text, text


def test_prometheus_counts_every_hold_the_summary_counts():
    """phyai_hold_ticks{reason} and summary()["holds"] count the same ticks, the final SHUTDOWN
    hold included (the metrics endpoint outlives the loop, so it is read after the stop)."""
    import re
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pol = FakePolicy(action_dim=6, state_dim=6, latency_s=0.05)
    run = Running(Daemon(test_config(metrics={"port": port}), policy=pol, realtime=False))
    run.wait_for(lambda: run.daemon.stats.adopted >= 2, what="2 chunks")
    run.stop()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    counted = {m[1]: int(float(m[2])) for m in re.finditer(r'phyai_hold_ticks_total\{reason="(\w+)"\} (\S+)', text)}
    holds = run.daemon.summary()["holds"]
    assert holds.get("shutdown") == 1 and holds.get("warmup", 0) >= 1, holds
    assert {k: v for k, v in counted.items() if v} == holds
    # every reason is a series from the start (at 0 until it happens), so an alert on increase() sees the first
    from phyai_edge.control.metrics import HOLD_REASONS

    assert set(counted) == set(HOLD_REASONS)


def test_inference_failure_runs_out_the_chunk_then_holds():
    cfg = test_config(chunking={"mode": "none", "execution_horizon": 10})
    pol = FakePolicy(action_dim=6, state_dim=6, latency_s=0.01, fail_from=3)
    run = Running(Daemon(cfg, policy=pol, realtime=False))
    run.wait_for(lambda: count(run, lambda h, v: h.flags & Flag.STARVED) >= 3, what="STARVED holds")
    run.stop()
    acts = run.actions()
    last_chunk = max(h.chunk_id for h, _ in acts)
    mine = [h for h, _ in acts if h.chunk_id == last_chunk]
    assert mine[-1].index == cfg.chunking.horizon - 1, "the last good chunk must run to its end"
    i_end = max(i for i, (h, _) in enumerate(acts) if h.chunk_id == last_chunk)
    after = [h.flags for h, _ in acts[i_end + 1:]]
    assert after and all(f & Flag.HOLD for f in after)
    assert all(f & Flag.INFER_FAIL for f in after[:-1])
    fail_flagged = [h for h, _ in acts if h.chunk_id == last_chunk and h.flags & Flag.INFER_FAIL]
    assert fail_flagged, "actions run after a failure carry INFER_FAIL"


def test_a_chunk_of_the_wrong_width_is_rejected_like_a_failed_inference():
    """A policy whose actions stop matching the robot's width: the chunk is refused at collection
    (INFER_FAIL, then STARVED), so neither topic ever carries a row of the wrong width."""
    cfg = test_config(chunking={"mode": "none", "execution_horizon": 10})
    pol = FakePolicy(action_dim=6, state_dim=6, latency_s=0.01)
    run = Running(Daemon(cfg, policy=pol, realtime=False))
    run.wait_for(lambda: count(run, lambda h, v: not h.flags & Flag.HOLD) >= 10, what="policy actions")
    calls = pol.calls
    pol.action_dim = 7  # from now on its chunks are (H, 7) for a 6-wide robot
    run.wait_for(lambda: pol.calls >= calls + 3, what="three wide chunks")
    n = len(run.actions())
    run.wait_for(lambda: len(run.actions()) >= n + cfg.chunking.horizon, what="a chunk's worth of ticks more")
    run.stop()
    assert all(v.shape[1] == 6 for _, v in run.listener.messages), "a row of the wrong width was published"
    acts = run.actions()
    assert count(run, lambda h, v: h.flags & Flag.NONFINITE) == 0, "the guard had to act: the chunk was adopted"
    assert all(h.chunk_id == 0 for h, _ in acts if h.flags & Flag.HOLD)
    assert count(run, lambda h, v: h.flags & Flag.INFER_FAIL) >= 1 and run.daemon.stats.failures >= 3
    assert count(run, lambda h, v: h.flags & Flag.STARVED) >= 1, "the last good chunk runs out, then HOLD"
    assert run.listener.stats.gaps == 0 and run.listener.stats.repeats == 0


class ShortChunks(FakePolicy):
    """From its third call, chunks of `rows` rows (a remote server restarted with a shorter H)."""

    def __init__(self, rows: int, **kw) -> None:
        super().__init__(**kw)
        self.rows = rows

    def infer(self, observations, rtc=None, noise=None):
        out = super().infer(observations, rtc, noise)
        if self.calls > 2:
            out.actions = out.actions[:, : self.rows]
        return out


def test_a_chunk_shorter_than_the_horizon_is_rejected_like_a_failed_inference():
    """Fewer rows than H (here 8, below s = 10): adopted, such a chunk would run out before the next
    inference is asked for, and the daemon would hold STARVED for good with no error. Refused at
    collection instead, naming the rows, and the daemon keeps asking."""
    cfg = test_config(chunking={"mode": "none", "execution_horizon": 10})
    pol = ShortChunks(8, action_dim=6, state_dim=6, latency_s=0.01)
    run = Running(Daemon(cfg, policy=pol, realtime=False))
    run.wait_for(lambda: pol.calls >= 8, what="the policy asked again after short chunks")
    run.stop()
    st = run.daemon.stats
    assert st.failures >= 5 and st.adopted <= 2
    assert count(run, lambda h, v: h.flags & Flag.INFER_FAIL) >= 1
    assert len({h.chunk_id for h, _ in run.actions() if not h.flags & Flag.HOLD}) <= 2, "a short chunk was adopted"
    assert run.listener.stats.gaps == 0 and run.listener.stats.repeats == 0


def test_a_state_hold_never_holds_at_a_stale_state():
    """`safety.hold = "state"` holds at the measured state, but not at one too old to trust: when the
    state itself is what went stale, the hold repeats the last published action. So does the final
    SHUTDOWN message, which held at the stale state."""
    cfg = test_config(safety={"hold": "state", "state_max_age_ms": 60.0})
    state = SyntheticState(6)
    run = Running(Daemon(cfg, policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), state=state,
                         realtime=False))
    run.wait_for(lambda: count(run, lambda h, v: not h.flags & Flag.HOLD) >= 10, what="policy actions")
    state.alive = False
    frozen = state.latest().values.copy()
    run.wait_for(lambda: count(run, lambda h, v: h.flags & Flag.STALE) >= 5, what="STALE holds")
    run.stop()
    acts = run.actions()
    first = next(i for i, (h, _) in enumerate(acts) if h.flags & Flag.STALE)
    assert not np.allclose(acts[first - 1][1], frozen), "the test needs the last action and the state to differ"
    for _, v in acts[first:first + 5]:
        np.testing.assert_array_equal(v, acts[first - 1][1])
    assert acts[-1][0].flags & Flag.SHUTDOWN
    np.testing.assert_array_equal(acts[-1][1], acts[first - 1][1])


def test_the_time_without_a_policy_action_grows_from_the_start_when_none_was_ever_sent():
    """No state ever arrives, so every tick holds STALE: the gauge an alert watches read 0 (it only
    counted from a first policy action, which never came)."""
    import socket
    import urllib.request

    pytest.importorskip("prometheus_client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = SyntheticState(6)
    state.alive = False  # never a sample
    run = Running(Daemon(test_config(metrics={"port": port}), policy=FakePolicy(action_dim=6, state_dim=6),
                         state=state, realtime=False))
    try:
        run.wait_for(lambda: count(run, lambda h, v: h.flags & Flag.STALE) >= 15, what="STALE holds")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        run.stop()
    import re

    value = float(re.search(r"^phyai_seconds_since_policy_action (\S+)$", text, re.M).group(1))
    assert value >= 10 * run.daemon.cfg.robot.period_s


def test_a_hold_carries_every_reason_that_holds():
    """An e-stop, then the state stream dies: the holds said ESTOP alone, so a controller could not
    tell that the stream had gone since."""
    cfg = test_config(safety={"state_max_age_ms": 60.0})
    state = SyntheticState(6)
    run = Running(Daemon(cfg, policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), state=state,
                         realtime=False))
    run.wait_for(lambda: count(run, lambda h, v: not h.flags & Flag.HOLD) >= 5, what="policy actions")
    state.estop = True
    run.wait_for(lambda: count(run, lambda h, v: h.flags & Flag.ESTOP) >= 3, what="ESTOP holds")
    assert not any(h.flags & Flag.STALE for h, _ in run.actions())
    state.alive = False
    run.wait_for(lambda: count(run, lambda h, v: h.flags & Flag.ESTOP and h.flags & Flag.STALE) >= 3,
                 what="ESTOP | STALE holds")
    run.stop()


def test_every_camera_optional_and_silent_holds_stale_rather_than_running_blind():
    """No camera is required, and the only one stops: the policy would run on no image at all.
    HOLD | STALE instead, and no inference starts."""
    cfg = test_config(cameras={"top": {"source": "synthetic", "width": 32, "height": 32, "required": False}})
    pol = FakePolicy(action_dim=6, state_dim=6, latency_s=0.01)
    run = Running(Daemon(cfg, policy=pol, realtime=False))
    run.wait_for(lambda: run.daemon.stats.adopted >= 2, what="two chunks")
    run.daemon.cameras["top"].alive = False
    run.wait_for(lambda: count(run, lambda h, v: h.flags & Flag.STALE) >= 5, what="STALE holds")
    calls = pol.calls
    n = len(run.actions())
    run.wait_for(lambda: len(run.actions()) >= n + 20, what="20 more ticks")
    run.stop()
    assert pol.calls == calls, "an inference ran with no camera"
    assert all(h.flags & Flag.HOLD and h.flags & Flag.STALE for h, _ in run.actions()[n:-1])


def test_a_bad_state_message_is_refused_but_its_estop_bit_is_not():
    """A state message with NaN values is refused like one of the wrong width (the last good sample
    stays), and either kind carrying the e-stop bit e-stops at once."""
    from phyai_edge.control.config import StateConfig
    from phyai_edge.control.protocol import STATE_FLAG_ESTOP, StateMessage
    from phyai_edge.control.state import ZmqState

    ep = free_tcp_endpoint()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(ep)
    src = ZmqState(StateConfig(source="zmq", endpoint=ep), 3)
    src.start()
    try:
        def send(values, flags=0, seq=[0]):  # noqa: B006  (a counter across calls)
            seq[0] += 1
            pub.send(StateMessage(np.asarray(values, np.float32), seq[0], time.monotonic_ns(), time.time_ns(),
                                  flags).encode())

        def settle(pred):
            end = time.monotonic() + 5
            while time.monotonic() < end:
                send([0.1, 0.2, 0.3]) if src.latest() is None else None
                if pred(src.latest()):
                    return src.latest()
                time.sleep(0.01)
            raise AssertionError("state source never settled")

        good = settle(lambda s: s is not None)
        send([0.4, np.nan, 0.6])
        time.sleep(0.1)
        kept = src.latest()
        assert kept.seq == good.seq and np.isfinite(kept.values).all() and not kept.estop
        assert src.bad_messages == 1
        send([0.4, 0.5], flags=STATE_FLAG_ESTOP)  # the wrong width, with the e-stop bit
        stopped = settle(lambda s: s.estop)
        np.testing.assert_array_equal(stopped.values, good.values)
        send([0.7, 0.8, 0.9])
        assert settle(lambda s: not s.estop).values[0] == np.float32(0.7)
    finally:
        src.stop()
        pub.close(0)


def test_record_writes_observations_and_chunks(tmp_path):
    cfg = test_config()
    d = Daemon(cfg, policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), record_dir=str(tmp_path), realtime=False)
    run = Running(d)
    run.wait_for(lambda: d.stats.adopted >= 3, what="3 chunks")
    run.stop()
    files = sorted(tmp_path.glob("obs_*.npz"))
    assert (tmp_path / "meta.json").exists() and len(files) >= 3
    import json

    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["max_guidance_weight"] == cfg.chunking.max_guidance_weight  # what `eval` replays with
    z = np.load(files[1])
    assert z["image.top"].shape == (32, 32, 3) and z["state"].shape == (6,)
    assert z["actions"].shape == (50, 6) and str(z["error"]) == ""
    assert int(z["delay"]) >= 1 and z["prefix"].shape[1] == 6
    # `--summary` shows what a recording lost
    assert d.summary()["recorder"] == {"dropped": 0, "failed": 0, "skipped_low_disk": 0}


def test_record_keeps_its_disk_floor_and_the_robot_runs_on(tmp_path):
    """A floor above the disk's free space: nothing is written, every record is counted as
    skipped, and control is untouched (recording is never what stops a robot)."""
    cfg = test_config()
    d = Daemon(cfg, policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), record_dir=str(tmp_path),
               record_min_free_gb=1e12, realtime=False)
    run = Running(d)
    run.wait_for(lambda: d.stats.adopted >= 3, what="3 chunks")
    run.stop()
    assert list(tmp_path.glob("obs_*")) == [] and (tmp_path / "meta.json").exists()
    rec = d.summary()["recorder"]
    assert rec["skipped_low_disk"] >= 3 and rec["dropped"] == 0 and rec["failed"] == 0
    assert run.listener.stats.gaps == 0


@pytest.mark.parametrize("mode", ["crossfade", "guided-approx"])
def test_other_modes_run_without_gaps(mode):
    cfg = test_config(chunking={"mode": mode, "execution_horizon": 8})
    pol = FakePolicy(action_dim=6, state_dim=6, latency_s=0.02)
    run = Running(Daemon(cfg, policy=pol, realtime=False))
    run.wait_for(lambda: run.daemon.stats.adopted >= 4, what="4 chunks")
    run.stop()
    assert run.listener.stats.gaps == 0
    reqs = [r for r in pol.requests if r is not None]
    if mode == "crossfade":
        assert not reqs  # daemon-side: the solver gets no prefix
    else:
        assert reqs and reqs[0].mode == "guided-approx" and reqs[0].max_guidance_weight == 5.0


def test_zmq_state_stream_estop_and_metrics():
    """State over ZeroMQ (docs/protocol.md section 2): fresh -> actions, ESTOP -> HOLD | ESTOP."""
    import urllib.request

    from phyai_edge.control.protocol import STATE_FLAG_ESTOP, StateMessage

    state_ep = free_tcp_endpoint()
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind(state_ep)
    estop = threading.Event()
    done = threading.Event()

    def controller():
        seq = 0
        while not done.is_set():
            seq += 1
            flags = STATE_FLAG_ESTOP if estop.is_set() else 0
            pub.send(StateMessage(np.full(6, 0.1, np.float32), seq, time.monotonic_ns(), time.time_ns(), flags).encode())
            time.sleep(0.002)

    t = threading.Thread(target=controller, daemon=True)
    t.start()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = test_config(state={"source": "zmq", "endpoint": state_ep}, metrics={"port": port})
    run = Running(Daemon(cfg, policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), realtime=False))
    try:
        run.wait_for(lambda: count(run, lambda h, v: not h.flags & Flag.HOLD) >= 10, what="policy actions")
        estop.set()
        run.wait_for(lambda: count(run, lambda h, v: h.flags & Flag.ESTOP) >= 3, what="ESTOP holds")
        seen = len(run.actions())
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        run.stop()
    finally:
        done.set()
        t.join(1)
        pub.close(0)
    for name in ("phyai_tick_lateness_seconds_bucket", "phyai_inference_stage_seconds_bucket", "phyai_rtc_delay_ticks",
                 'phyai_hold_ticks_total{reason="estop"}', "phyai_missed_ticks_total", "phyai_late_ticks_total"):
        assert name in text, name

    def value(name: str) -> float:
        import re

        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))

    # an alert's signals: every action counted (all the listener had by the scrape, at least); while it
    # holds (three ESTOP ticks seen: two periods at least since the last policy action) that time grows;
    # the last policy action's observation was a fraction of a second old (a 10 ms fake policy)
    assert value("phyai_published_actions_total") >= seen
    assert value("phyai_seconds_since_policy_action") >= 2 * cfg.robot.period_s * 0.99
    assert 0 < value("phyai_action_observation_age_seconds") < 1.0
    flags = [h.flags for h, _ in run.actions()]
    i = next(i for i, f in enumerate(flags) if f & Flag.ESTOP)
    assert all(f & Flag.HOLD for f in flags[i:])


@pytest.mark.parametrize("key", ["publish.endpoint", "state.endpoint", "cameras.top.endpoint"])
def test_an_endpoint_zeromq_refuses_names_its_key_and_shutdown_still_returns(key):
    """`phyai-edge run` with such an endpoint must say which key is wrong and exit, not hang in
    the ZeroMQ context's termination on the socket that failed to bind or connect."""
    from phyai_edge.control.config import ConfigError

    sections = {
        "publish.endpoint": {"publish": {"endpoint": "tcp://no-such-interface:1"}},
        "state.endpoint": {"state": {"source": "zmq", "endpoint": "tcp://no such host:1"}},
        "cameras.top.endpoint": {"cameras": {"top": {"source": "zmq", "endpoint": "tcp://no such host:1"}}},
    }[key]
    d = Daemon(test_config(**sections), policy=FakePolicy(action_dim=6, state_dim=6), realtime=False)
    try:
        d.setup()
    except ConfigError as exc:  # shut down while the error (and its traceback) lives, as `phyai-edge run` does
        assert str(exc).startswith(f"{key}: "), exc
        closer = threading.Thread(target=d.shutdown, daemon=True)
        closer.start()
        closer.join(10)
        assert not closer.is_alive(), "shutdown hung on the socket that could not bind or connect"
    else:
        pytest.fail("setup accepted the endpoint")


def test_a_starved_hold_is_logged_once_when_it_begins(caplog):
    """An inference slower than the chunk lasts: the robot held STARVED for seconds with no line in
    the log (only a hung worker's kill said anything, at inference_timeout_s)."""
    cfg = test_config(chunking={"horizon": 10, "execution_horizon": 5})
    run = Running(Daemon(cfg, policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), realtime=False))
    try:
        run.wait_for(lambda: count(run, lambda h, v: not h.flags & Flag.HOLD) >= 5, what="policy actions")
        with caplog.at_level("WARNING", logger="phyai_edge.control"):
            run.daemon._policy.latency_s = 0.6  # the next inference outlasts the rest of the chunk
            run.wait_for(lambda: count(run, lambda h, v: h.flags & Flag.STARVED) >= 10, what="STARVED holds")
    finally:
        run.stop()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("HOLD: starved")]
    assert len(lines) == 1 and "the inference in flight started" in lines[0], lines


def test_a_metrics_port_in_use_stops_the_start_before_the_model_loads():
    """Another daemon on the port: this one logged "metrics off" after loading and ran on, while
    Prometheus went on scraping the other and describing it as this one."""
    import socket

    from phyai_edge.control.config import ConfigError

    pytest.importorskip("prometheus_client")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        pol = FakePolicy(action_dim=6, state_dim=6)
        d = Daemon(test_config(metrics={"port": port}), policy=pol, realtime=False)
        try:
            with pytest.raises(ConfigError, match=rf"^metrics\.port: 127\.0\.0\.1:{port}: .*in use"):
                d.setup()
            assert d.worker is None, "the policy was loaded first"
        finally:
            d.shutdown()


class SlowerWithRTC(FakePolicy):
    """Exact guidance runs a backward pass too: a chunk with an RTC request takes longer."""

    def __init__(self, rtc_latency_s: float, **kw) -> None:
        super().__init__(**kw)
        self.rtc_latency_s = rtc_latency_s

    def infer(self, observations, rtc=None, noise=None):
        if rtc is not None:
            time.sleep(self.rtc_latency_s)
        return super().infer(observations, rtc, noise)


class SlowFirstCall(FakePolicy):
    """A fresh engine's first chunk compiles kernels and captures graphs: far slower than the rest."""

    def __init__(self, first_s: float, **kw) -> None:
        super().__init__(**kw)
        self.first_s = first_s

    def infer(self, observations, rtc=None, noise=None):
        if self.calls == 0:
            time.sleep(self.first_s)
        return super().infer(observations, rtc, noise)


class SeesFrames(FakePolicy):
    """Records, per call, each policy camera's frame shape (None: masked)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.seen: list[dict[str, tuple[int, ...] | None]] = []

    def infer(self, observations, rtc=None, noise=None):
        self.seen.append({n: None if im is None else im.shape for n, im in observations[0].images.items()})
        return super().infer(observations, rtc, noise)


def test_warm_up_frames_are_the_cameras_as_configured():
    """The warm-up's frames have each camera's configured size, and a policy camera with no source
    is masked, as it will be in every live job: the first live chunk then takes the host path
    (resize, staging buffers, masked views) the warm-up already took."""
    cfg = test_config(model={"warmup": 1}, cameras={"top": {"source": "synthetic", "width": 64, "height": 48}},
                      chunking={"mode": "guided-approx", "execution_horizon": 10, "delay": 3})
    pol = SeesFrames(camera_names=("top", "wrist"), latency_s=0.0)
    d = Daemon(cfg, policy=pol, realtime=False)
    try:
        d.setup()
        assert pol.seen == [{"top": (48, 64, 3), "wrist": None}] * 2  # the chunk without RTC, then with
    finally:
        d.shutdown()


@pytest.mark.parametrize("delay", [0, 4])
def test_the_delay_estimate_never_starts_from_the_capturing_round(delay):
    """With one warm-up round the daemon times a second one for the first delay estimate: the first
    (0.6 s here, 8.8 s for the full-size cudagraph engine on an H200) would have started it at 31
    slots and warned that the execution horizon is below it. A fixed delay needs no timing round."""
    from phyai_edge.commands.run import startup_budget_s
    from phyai_edge.control.daemon import warmup_rounds

    cfg = test_config(model={"warmup": 1}, chunking={"mode": "guided-approx", "execution_horizon": 10,
                                                      "delay_initial": 2, "delay": delay})
    pol = SlowFirstCall(0.6, action_dim=6, state_dim=6, latency_s=0.005)
    d = Daemon(cfg, policy=pol, realtime=False)
    try:
        d.setup()
        assert pol.calls == (4 if delay == 0 else 2)
        assert warmup_rounds(cfg) == (2 if delay == 0 else 1)
        assert startup_budget_s(cfg) == cfg.model.load_timeout_s * (1 + 2 * warmup_rounds(cfg)) + 60.0
        if delay == 0:
            assert 2 <= d.delays.initial <= 4, d.delays.initial  # 5 ms chunks: the floor of 2, or a slot more
        assert d.delays.estimate() == (delay or d.delays.initial)
        assert len(d.worker.warmup_jobs) == 2  # a restarted worker still runs the configured round only
    finally:
        d.shutdown()


class SlowPromptFit(FakePolicy):
    """`Policy.fix_prompt_positions` tokenises the prompt with every state bin: a warm-up's one-off
    setup, on the host, that live jobs never run."""

    def __init__(self, fit_s: float, **kw) -> None:
        super().__init__(**kw)
        self.fit_s = fit_s
        self.fits = 0

    def fix_prompt_positions(self, prompts, at_least: int = 0):
        self.fits += 1
        time.sleep(self.fit_s)
        return None


def test_the_first_delay_estimate_times_the_inference_not_the_warm_up_setup():
    """The delay estimate starts from a warm-up's time: the warm-up's prompt fitting (the full-size
    daemon's rounds took 34-48 ms on an H100 against ~13-25 ms live, the difference this) must not
    be in it, or the first chunks assume slots they will not need."""
    cfg = test_config(model={"warmup": 1}, chunking={"mode": "guided-approx", "execution_horizon": 10,
                                                      "delay_initial": 2})
    pol = SlowPromptFit(0.2, action_dim=6, state_dim=6, latency_s=0.005)
    d = Daemon(cfg, policy=pol, realtime=False)
    try:
        d.setup()
        assert pol.fits == 4  # every warm-up job fits the prompt (two rounds, two jobs each)
        # 5 ms chunks at 50 Hz: 1 slot, plus one of margin (a slot more on a slow machine); with
        # the 200 ms fit in the timing it would be 12
        assert 2 <= d.delays.initial <= 3, d.delays.initial
    finally:
        d.shutdown()


@pytest.mark.parametrize("mode", ["guided", "guided-approx", "inpaint", "crossfade", "none"])
def test_warm_up_meets_the_rtc_mode_the_loop_will_run(mode):
    """Every chunk after the first carries the executing chunk as an RTC prefix. A cudagraph engine
    captures one solver graph per RTC mode on its first use, so the warm-up must run that mode
    before the clock starts (and again in a restarted worker), and the first delay estimate must
    come from the slower of the two kinds of chunk."""
    cfg = test_config(model={"warmup": 2}, chunking={"mode": mode, "execution_horizon": 10, "delay_initial": 2})
    pol = SlowerWithRTC(0.1, action_dim=6, state_dim=6, latency_s=0.005)
    d = Daemon(cfg, policy=pol, realtime=False)
    try:
        d.setup()
        solver_mode = mode in ("guided", "guided-approx", "inpaint")
        rtcs = [r for r in pol.requests if r is not None]
        assert pol.calls == (4 if solver_mode else 2) and pol.requests[0] is None
        if solver_mode:
            assert len(rtcs) == 2 and all(r.mode == mode for r in rtcs)
            assert rtcs[0].prefix.shape == (50 - 10, 6) and 1 <= rtcs[0].delay <= rtcs[0].prefix.shape[0]
            assert rtcs[0].execution_horizon == 10
            # >= 105 ms at 50 Hz is 6 slots, plus one of margin (more on a slow machine); the chunk
            # without RTC alone would give 2.
            assert 7 <= d.delays.initial <= 10, d.delays.initial
        else:
            assert not rtcs and d.delays.initial == 2
        restart = d.worker.warmup_jobs
        assert [j.rtc_mode if j.prefix is not None else "none" for j in restart] == (
            ["none", mode] * 2 if solver_mode else ["none"] * 2)
    finally:
        d.shutdown()


def _solver_policy(cameras: tuple[str, ...], steps: int) -> FakePolicy:
    """A stand-in whose adapter names its solver's steps, as an engine policy's does."""
    from types import SimpleNamespace

    pol = FakePolicy(action_dim=6, state_dim=6, camera_names=cameras, latency_s=0.005)
    pol.adapter = SimpleNamespace(solver=SimpleNamespace(num_steps=steps))  # type: ignore[attr-defined]
    return pol


def test_prometheus_says_which_model_runs_a_bundles_from_its_manifest(tmp_path):
    """phyai_model_info: a bundle's adapter, preset, backend and dtype from its manifest (the
    config's defaults do not apply to it), the device from the config, views, horizon and steps
    from the loaded policy, rate and s from the config; the bundle's path, with a quote and a
    backslash in it, escaped."""
    import json
    import socket
    import urllib.request

    from phyai_edge.sim.report import daemon_model

    pytest.importorskip("prometheus_client")
    bundle = tmp_path / 'full "bf16" \\ cudagraph'
    bundle.mkdir()
    (bundle / "manifest.json").write_text(json.dumps(_sealed({
        "format": "phyai-edge/bundle/1", "adapter": {"name": "pi05", "preset": "full"},
        "backend": "cudagraph", "dtype": "bfloat16", "steps": 10, "views": 3})))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = test_config(metrics={"port": port}, model={"bundle": str(bundle), "device": "cuda"})
    d = Daemon(cfg, policy=_solver_policy(("top", "left_wrist", "right_wrist"), 10), realtime=False)
    try:
        d.setup()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        d.shutdown()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("phyai_model_info")]
    escaped = str(bundle).replace("\\", "\\\\").replace('"', '\\"')
    assert line == (f'phyai_model_info{{adapter="pi05",backend="cudagraph",bundle="{escaped}",device="cuda",'
                    'dtype="bfloat16",exec_horizon="10",horizon="50",preset="full",rate_hz="50",steps="10",'
                    'views="3"} 1.0'), line
    assert daemon_model(text) == {"adapter": "pi05", "preset": "full", "backend": "cudagraph", "device": "cuda",
                                  "dtype": "bfloat16", "bundle": str(bundle), "views": "3", "horizon": "50",
                                  "steps": "10", "rate_hz": "50", "exec_horizon": "10"}


def test_model_info_labels_follow_what_decides_the_model():
    """The config's model section, unless a factory builds the policy (its arguments of those
    names, the rest left out); views from the policy, steps only when it says; horizon the
    policy's chunk unless chunking.horizon is set."""
    from phyai_edge.control.daemon import model_info_labels
    from phyai_edge.control.worker import policy_info

    cfg = test_config(model={"backend": "eager", "device": "cpu", "dtype": "bfloat16", "preset": "tiny"})
    info = policy_info(_solver_policy(("top", "wrist"), 5))
    assert model_info_labels(cfg, info) == {"adapter": "pi05", "preset": "tiny", "backend": "eager", "device": "cpu",
                                            "dtype": "bfloat16", "views": "2", "horizon": "50", "steps": "5",
                                            "rate_hz": "50", "exec_horizon": "10"}
    factory = test_config(model={"factory": "phyai_edge.control.fakes:make_fake_policy",
                                 "factory_args": {"preset": "full", "device": "cuda:1", "latency_s": 0.01}})
    plain = policy_info(FakePolicy(chunk_size=30, camera_names=("top",)))
    assert plain.steps == 0
    assert model_info_labels(factory, plain) == {"preset": "full", "device": "cuda:1", "views": "1", "horizon": "30",
                                                 "rate_hz": "50", "exec_horizon": "10"}
    # horizon is the H the daemon executes: chunking.horizon where set below the chunk.
    short = test_config(model={"device": "cpu"}, chunking={"horizon": 20})
    assert model_info_labels(short, info)["horizon"] == "20"


def test_model_info_labels_name_the_control_rate_and_the_execution_horizon():
    """rate_hz is robot.control_hz and exec_horizon chunking.execution_horizon, the keys the
    roofline reads for --rate and --exec-horizon; a rate %g would round keeps all its digits."""
    from phyai_edge.control.daemon import model_info_labels
    from phyai_edge.control.worker import PolicyInfo

    info = PolicyInfo(50, 6, 6, ("top",))
    cfg = test_config(robot={"control_hz": 30.0}, chunking={"mode": "guided-approx", "execution_horizon": 12})
    labels = model_info_labels(cfg, info)
    assert (labels["rate_hz"], labels["exec_horizon"], labels["horizon"]) == ("30", "12", "50")
    odd = model_info_labels(test_config(robot={"control_hz": 100 / 3}), info)["rate_hz"]
    assert float(odd) == 100 / 3
    assert "rtc_mode" not in labels and "mode" not in labels  # the roofline's s holds in every RTC mode


def _fake_torch(monkeypatch, name: str = "NVIDIA H200") -> list:
    """A stand-in torch module in sys.modules whose CUDA device is `name`; returns the devices asked
    for. The control package never imports torch; the worker finds it already loaded by the policy."""
    import sys
    from types import SimpleNamespace

    asked: list = []

    def get_device_name(device):
        asked.append(device)
        return name

    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=SimpleNamespace(get_device_name=get_device_name)))
    return asked


def test_policy_info_names_the_gpu_a_cuda_policy_runs_on(monkeypatch):
    """PolicyInfo.device_name: torch's name for the policy's CUDA device, asked where torch is
    loaded already; "" for a policy on the CPU, one that names no device, or without torch. It
    crosses the worker pipe pickled, and becomes phyai_model_info's gpu label."""
    import pickle
    import sys
    from types import SimpleNamespace

    from phyai_edge.control.daemon import model_info_labels
    from phyai_edge.control.worker import PolicyInfo, policy_info

    pol = FakePolicy(camera_names=("top",))
    assert policy_info(pol).device_name == ""  # no device attribute
    asked = _fake_torch(monkeypatch)
    pol.device = SimpleNamespace(type="cpu", index=None)  # type: ignore[attr-defined]  # a torch.device's shape
    assert policy_info(pol).device_name == "" and asked == []
    pol.device = SimpleNamespace(type="cuda", index=1)  # type: ignore[attr-defined]
    info = policy_info(pol)
    assert info.device_name == "NVIDIA H200" and asked == [pol.device]
    assert pickle.loads(pickle.dumps(info)) == info
    pol.device = "cuda:0"  # type: ignore[attr-defined]  # a plain string names the type too
    assert policy_info(pol).device_name == "NVIDIA H200"
    cfg = test_config(model={"device": "cuda"})
    assert model_info_labels(cfg, info)["gpu"] == "NVIDIA H200"
    assert "gpu" not in model_info_labels(cfg, PolicyInfo(50, 6, 6, ("top",)))

    monkeypatch.delitem(sys.modules, "torch")  # torch not loaded in this process: not imported for a name
    assert policy_info(pol).device_name == "" and "torch" not in sys.modules

    def fails(device):
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=SimpleNamespace(get_device_name=fails)))
    assert policy_info(pol).device_name == ""


def _manifest(precision: str, backend: str, dtype: str) -> dict:
    """A manifest.json as `phyai-edge export` writes one (the fields the daemon reads)."""
    manifest = {"format": "phyai-edge/bundle/1", "adapter": {"name": "pi05", "preset": "full"}, "backend": backend,
                "dtype": dtype, "precision": dict.fromkeys(("embed_images", "encode_prefix", "denoise_step"), precision),
                "steps": 10, "views": 3}
    if precision == "fp8" and backend == "cudagraph":
        manifest["fp8"] = {"scope": "expert", "scales": "calibration/fp8_scales.safetensors", "activations": "static",
                           "format": "e4m3fn, per-tensor"}
    return _sealed(manifest)


def _sealed(manifest: dict) -> dict:
    """With the fields every bundle loader reads, sealed as `write_manifest` seals it (the config
    refuses a manifest edited after export)."""
    from phyai_edge.engines.bundle import seal

    return seal({"checkpoint": {}, "files": {"checkpoint/model.safetensors": {}}, **manifest})


def test_model_info_says_a_bundle_is_fp8_where_its_dtype_says_bfloat16(tmp_path, monkeypatch):
    """An fp8 bundle's manifest has dtype bfloat16 (its activations) and fp8 per stage: the label
    precision="fp8" says it, as the roofline reads it; int8 likewise; a bf16 bundle has no
    precision label (its dtype says it)."""
    import json

    from phyai_edge.control.daemon import model_info_labels
    from phyai_edge.control.worker import PolicyInfo

    info = PolicyInfo(50, 6, 6, ("top", "left_wrist", "right_wrist"), steps=10)
    labels = {}
    for name, args in {"fp8": ("fp8", "cudagraph", "bfloat16"), "int8": ("int8", "onnxruntime", "float32"),
                       "bf16": ("bf16", "cudagraph", "bfloat16")}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps(_manifest(*args)))
        cfg = test_config(model={"bundle": str(tmp_path / name), "device": "cuda"})
        labels[name] = model_info_labels(cfg, info)
    assert labels["fp8"]["precision"] == "fp8" and labels["fp8"]["dtype"] == "bfloat16"
    assert labels["int8"]["precision"] == "int8"
    assert "precision" not in labels["bf16"] and labels["bf16"]["dtype"] == "bfloat16"
    # A TensorRT fp8 bundle records no `fp8` section: its stages' precision still says it.
    (tmp_path / "trt").mkdir()
    (tmp_path / "trt" / "manifest.json").write_text(json.dumps(_manifest("fp8", "tensorrt", "bfloat16")))
    from phyai_edge.control import config

    monkeypatch.setattr(config, "_importable", lambda module: True)  # as on a machine with TensorRT
    trt = test_config(model={"bundle": str(tmp_path / "trt"), "device": "cuda"})
    assert model_info_labels(trt, info)["precision"] == "fp8"


def test_roofline_reads_the_running_daemon_s_model(tmp_path, monkeypatch):
    """End to end: a daemon running an fp8 bundle on a CUDA policy with chunking.horizon 30 (the
    policy's chunk is 50) exports phyai_model_info, and `phyai-edge roofline --metrics`' reader
    makes of it the GPU's name, fp8, the views, the steps and the H the daemon executes."""
    import json
    import socket
    import urllib.request
    from types import SimpleNamespace

    from phyai_edge.roofline.sources import measurement_from_metrics

    pytest.importorskip("prometheus_client")
    (tmp_path / "manifest.json").write_text(json.dumps(_manifest("fp8", "cudagraph", "bfloat16")))
    _fake_torch(monkeypatch, "NVIDIA H200")
    pol = _solver_policy(("top", "left_wrist", "right_wrist"), 10)
    pol.device = SimpleNamespace(type="cuda", index=0)  # type: ignore[attr-defined]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = test_config(metrics={"port": port}, model={"bundle": str(tmp_path), "device": "cuda"},
                      chunking={"horizon": 30})
    d = Daemon(cfg, policy=pol, realtime=False)
    try:
        d.setup()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        d.shutdown()
    m = measurement_from_metrics(text)
    assert (m.adapter, m.preset, m.backend, m.device, m.precision) == ("pi05", "full", "cudagraph", "NVIDIA H200", "fp8")
    assert (m.views, m.steps, m.horizon, m.calibratable) == (3, 10, 30, True)
    assert (m.rate_hz, m.exec_horizon) == (50.0, 10)  # robot.control_hz, chunking.execution_horizon


def test_model_info_views_count_the_cameras_the_model_runs():
    """Where the policy leaves cameras without a source out of the model (PolicyInfo.drops_cameras),
    the views label counts the fed ones; otherwise the model runs every slot (masked) and it counts
    them all."""
    from dataclasses import replace

    from phyai_edge.control.daemon import model_info_labels
    from phyai_edge.control.worker import PolicyInfo

    info = PolicyInfo(50, 6, 6, ("top", "left_wrist", "right_wrist"))
    cfg = test_config(model={"device": "cpu"})  # one camera, feeding "top"
    assert model_info_labels(cfg, info)["views"] == "3"
    assert model_info_labels(cfg, replace(info, drops_cameras=True))["views"] == "1"
    two = test_config(model={"device": "cpu"}, cameras={"wrist": {"source": "synthetic", "view": "left_wrist"}})
    assert model_info_labels(two, replace(info, drops_cameras=True))["views"] == "2"


def test_a_refused_real_time_setting_is_a_warning(monkeypatch):
    """`journalctl -p warning` (systemd/INSTALL.md) must show a loop that is not real-time: a refused
    SCHED_FIFO or mlockall is a warning, the settings that took are info."""
    import os

    from phyai_edge.control import clock

    def refuse(*_):
        raise PermissionError

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    notes = clock.setup_realtime(80, (), False)
    assert any("not permitted" in n for n in notes)
    assert all(clock.realtime_refused(n) for n in notes)
    assert not clock.realtime_refused("memory: locked (mlockall)")
    assert not clock.realtime_refused("clock thread: SCHED_FIFO priority 80")


class FlappingState(SyntheticState):
    """Fresh for `good_s`, then silent for `bad_s`, over and over: a stream just slower than its
    age limit, as a loaded controller's can be."""

    def __init__(self, dim: int, good_s: float = 0.25, bad_s: float = 0.12) -> None:
        super().__init__(dim)
        self.t0, self.good_s, self.bad_s = time.monotonic(), good_s, bad_s

    def latest(self):
        self.alive = (time.monotonic() - self.t0) % (self.good_s + self.bad_s) < self.good_s
        return super().latest()


def test_a_state_stream_that_never_arrives_is_logged_once(caplog):
    """A state endpoint nobody publishes on (the usual first-robot mistake) held HOLD | STALE on
    every tick from the start without a WARNING: no chunk had run, and only holds that stop one
    were logged. Now the hold's start is logged, once, saying nothing has come."""
    state = SyntheticState(6)
    state.alive = False  # never a sample
    run = Running(Daemon(test_config(), policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), state=state,
                         realtime=False))
    with caplog.at_level("WARNING", logger="phyai_edge.control"):
        run.wait_for(lambda: run.daemon.stats.holds.get("stale", 0) >= 20, what="20 stale holds")
    run.stop()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("HOLD: stale")]
    assert lines == ["HOLD: stale (state: nothing received yet)"], lines


def test_flapping_inputs_do_not_flood_the_log(caplog):
    """A hold that drops a chunk is logged the 1st, 10th, 100th, ... time for its reason, with the
    count; every one of them is still counted in the summary and Prometheus."""
    cfg = test_config(safety={"state_max_age_ms": 60.0})
    run = Running(Daemon(cfg, policy=FakePolicy(action_dim=6, state_dim=6, latency_s=0.01), state=FlappingState(6),
                         realtime=False))
    with caplog.at_level("WARNING", logger="phyai_edge.control"):
        run.wait_for(lambda: run.daemon._holds_logged.get("stale", 0) >= 5, timeout=20, what="five stale episodes")
    run.stop()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("HOLD: stale")]
    assert len(lines) == 1 and run.daemon._holds_logged["stale"] >= 5, lines
    assert run.daemon.stats.holds["stale"] >= 5


def test_an_ipc_endpoint_another_daemon_listens_on_is_refused_not_taken_over(tmp_path):
    """libzmq's ipc bind unlinks the path first: a second daemon on the first one's ipc://
    endpoints took its controllers over without an error. Now the key is named and the first
    daemon's subscribers still hear it; a path a crashed process left behind is bound as before."""
    from phyai_edge.control.config import ConfigError

    path = tmp_path / "actions.sock"
    ctx = zmq.Context.instance()
    first = ctx.socket(zmq.PUB)
    first.bind(f"ipc://{path}")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 2000)
    sub.connect(f"ipc://{path}")
    try:
        d = Daemon(test_config(publish={"endpoint": f"ipc://{path}"}),
                   policy=FakePolicy(action_dim=6, state_dim=6), realtime=False)
        with pytest.raises(ConfigError, match=r"publish\.endpoint: .*is a daemon already running"):
            d.setup()
        d.shutdown()
        late = ctx.socket(zmq.SUB)  # a controller connecting now still reaches the first daemon
        late.setsockopt(zmq.SUBSCRIBE, b"")
        late.setsockopt(zmq.RCVTIMEO, 200)
        late.connect(f"ipc://{path}")
        got = None
        for _ in range(25):
            first.send(b"still here")
            try:
                got = late.recv()
                break
            except zmq.Again:
                continue
        late.close(0)
        assert got == b"still here"
    finally:
        sub.close(0)
        first.close(0)
    from phyai_edge.control.preflight import ipc_listening

    deadline = time.monotonic() + 5  # ZeroMQ's I/O thread closes the listener a moment after close()
    while ipc_listening(f"ipc://{path}") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert path.exists()  # left behind, nobody listening: the next daemon binds it
    d = Daemon(test_config(publish={"endpoint": f"ipc://{path}"}), policy=FakePolicy(action_dim=6, state_dim=6),
               realtime=False)
    try:
        d.setup()
    finally:
        d.shutdown()


def test_a_publish_endpoint_in_use_fails_before_the_model_loads():
    """Another process on publish.endpoint is found in a second, not after minutes of loading and
    warming a model; the key is named and shutdown returns."""
    from phyai_edge.control.config import ConfigError

    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        d = Daemon(test_config(publish={"endpoint": f"tcp://127.0.0.1:{port}"}),
                   policy=FakePolicy(action_dim=6, state_dim=6), realtime=False)
        with pytest.raises(ConfigError, match=r"publish\.endpoint: "):
            d.setup()
        assert getattr(d, "worker", None) is None, "the policy was loaded before the endpoint was tried"
        d.shutdown()
    finally:
        taken.close(0)


def test_every_counter_with_a_result_label_has_its_series_from_the_first_scrape():
    """A worker restart or a task request before the first scrape was invisible to increase(): its
    series did not exist until its first event."""
    import socket
    import urllib.request

    pytest.importorskip("prometheus_client")
    from phyai_edge.control.metrics import RECORD_RESULTS, TASK_RESULTS, Metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert Metrics().serve("127.0.0.1", port)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for result in ("ok", "failed"):
        assert f'phyai_worker_restarts_total{{result="{result}"}} 0.0' in text
    for result in TASK_RESULTS:
        assert f'phyai_task_requests_total{{result="{result}"}} 0.0' in text
    for result in RECORD_RESULTS:
        assert f'phyai_record_observations_total{{result="{result}"}} 0.0' in text
