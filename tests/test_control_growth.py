"""The daemon runs for days: nothing it keeps may grow with the number of ticks or inferences.

`benchmarks/daemon_resources.py` measures the whole process (RSS, fds, threads, tracemalloc) under
scrapes, task requests, subscribers, recording and worker restarts; these pin what it found: the
per-inference statistics (`DaemonStats.delays`, `infer_ms`, `stage_ms`) were lists appended to
on every inference for the life of the process.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pytest

from phyai_edge.control import daemon as daemon_module
from phyai_edge.control.daemon import STATS_WINDOW, Daemon, _Inflight
from phyai_edge.control.fakes import FakePolicy, run_ticks, test_config
from phyai_edge.control.metrics import HOLD_REASONS
from phyai_edge.control.worker import Job, JobResult

STAGES = {"preprocess": 0.5, "encode_prefix": 1.0, "solver_loop": 3.0}


def _containers(root: Any, path: str = "stats") -> dict[str, int]:
    """Length of every list / deque / dict reachable from `root` through containers and dataclass
    attributes (what a run could append to)."""
    out: dict[str, int] = {}
    stack = [(path, root)]
    while stack:
        where, obj = stack.pop()
        if isinstance(obj, (list, deque, dict)):
            out[where] = len(obj)
            items = obj.items() if isinstance(obj, dict) else ()
            stack += [(f"{where}[{k!r}]", v) for k, v in items]
        elif hasattr(obj, "__dataclass_fields__"):
            stack += [(f"{where}.{k}", v) for k, v in vars(obj).items()]
    return out


def test_per_inference_statistics_keep_a_window_not_the_whole_run():
    """Three windows of adopted chunks through `_collect`, as the clock thread hands them over:
    each per-inference container holds the newest STATS_WINDOW, and the summary and status line
    describe those."""
    d = Daemon(test_config(), policy=FakePolicy(action_dim=6, state_dim=6), realtime=False, status_line=False)
    d.setup()
    try:
        actions = np.zeros((50, 6), np.float32)
        state = np.zeros(6, np.float32)
        n = 3 * STATS_WINDOW
        for k in range(1, n + 1):
            delay = 2 + k % 3
            res = JobResult(k, actions, dict(STAGES), infer_ms=float(k))
            d._collect(res, _Inflight(Job(k, {}, {}, state, "p", 0.0), 10 * k, 0.0, 3), 10 * k + delay, False)
        st = d.stats
        assert st.adopted == n
        sizes = _containers(st)
        assert sizes["stats.infer_ms"] == sizes["stats.delays"] == STATS_WINDOW
        assert {sizes[f"stats.stage_ms[{s!r}]"] for s in STAGES} == {STATS_WINDOW}
        assert max(sizes.values()) <= STATS_WINDOW, sizes
        # The newest are the ones kept.
        assert list(st.infer_ms)[-3:] == [n - 2.0, n - 1.0, float(n)]
        summary = d.summary()
        assert summary["infer_ms_p50"] == pytest.approx(n - (STATS_WINDOW - 1) / 2)
        assert summary["delay_ticks"]["min"] == 2 and summary["delay_ticks"]["max"] == 4
        assert f"infer {float(n):.1f} ms" in d.render_status()
    finally:
        d.shutdown()


def test_the_running_loop_keeps_no_container_that_grows_with_inferences(monkeypatch):
    """The real loop at 1 kHz with an inference every few ticks: well over a window of inferences,
    and every container under `Daemon.stats` stays within it."""
    monkeypatch.setattr(daemon_module, "STATS_WINDOW", 8)
    cfg = test_config(robot={"control_hz": 1000.0},
                      chunking={"mode": "inpaint", "execution_horizon": 2, "delay_initial": 1})
    d = Daemon(cfg, policy=FakePolicy(chunk_size=20, latency_s=0.0, period_s=0.001), realtime=False,
               status_line=False)
    run_ticks(d, 600, timeout_s=30)
    st = d.stats
    assert st.inferences > 4 * 8, f"only {st.inferences} inferences: the window was never exceeded"
    sizes = _containers(st)
    assert sizes["stats.infer_ms"] <= 8 and sizes["stats.delays"] <= 8
    assert sizes.pop("stats.holds") <= len(HOLD_REASONS)  # keyed by reason: a fixed set
    assert max(sizes.values()) <= 8, sizes


def test_a_wrapped_lateness_log_gives_its_newest_samples_in_order():
    from phyai_edge.control.clock import LatenessLog

    log = LatenessLog(8)
    assert log.recent(3).size == 0
    for v in range(5):
        log.add(v)
    assert log.recent(3).tolist() == [2, 3, 4] and log.recent(100).tolist() == [0, 1, 2, 3, 4]
    for v in range(5, 19):  # wrapped: storage holds 16, 17, 18, 11, ..., 15
        log.add(v)
    assert log.recent(3).tolist() == [16, 17, 18]
    assert log.recent(5).tolist() == [14, 15, 16, 17, 18]
    assert log.recent(8).tolist() == list(range(11, 19)) and log.recent(9).tolist() == list(range(11, 19))
    for v in range(19, 24):  # the write position back at 0
        log.add(v)
    assert log.count % 8 == 0 and log.recent(4).tolist() == [20, 21, 22, 23]


def test_the_status_line_lateness_is_the_newest_ticks_after_the_log_wraps():
    """After 2**18 ticks (87 min at 50 Hz) the status line (and systemd's STATUS=) took its p99 from
    the end of the log's storage, ticks a whole log old, not from the newest."""
    from phyai_edge.control.clock import LatenessLog

    d = Daemon(test_config(), policy=FakePolicy(action_dim=6, state_dim=6), realtime=False, status_line=False)
    log = LatenessLog(1000)
    for _ in range(1000):
        log.add(30_000_000)  # a bad stretch, 30 ms late, long ago
    for _ in range(600):
        log.add(100_000)  # the last 600 ticks: 0.1 ms
    d.stats.lateness = log
    assert "late p99 0.10 ms" in d.render_status()
