"""Robot daemons that use the multi-robot server as their engine: two real `Daemon` loops,
configured only through the config file's `model.factory` hook, against one tiny-model server.
Their clocks, RTC and safety stay on the robot; the server only computes chunks."""

from __future__ import annotations

import threading
import time

import pytest

from phyai_edge.control.daemon import Daemon
from phyai_edge.control.fakes import test_config
from phyai_edge.control.listener import Listener
from phyai_edge.serve.scheduler import SchedulerConfig
from phyai_edge.serve.server import LocalExecutor, PolicyServer


@pytest.mark.slow
def test_two_daemons_run_on_the_server(tiny_policy):
    with PolicyServer(LocalExecutor(tiny_policy), "tcp://127.0.0.1:*", SchedulerConfig(window_s=0.002)) as srv:
        daemons, threads, listeners = [], [], []
        for i in range(2):
            cfg = test_config(
                model={"factory": "phyai_edge.serve.client:remote_policy",
                       "factory_args": {"endpoint": srv.endpoint, "robot": f"arm-{i}", "timeout_s": 10.0}},
                chunking={"mode": "guided-approx", "execution_horizon": 25, "delay_initial": 5},
            )
            d = Daemon(cfg, realtime=False, status_line=False)
            d.setup()
            listeners.append(Listener(d.publisher.endpoint, cfg.publish.topic, cfg.publish.chunk_topic, keep=True))
            daemons.append(d)
        time.sleep(0.2)  # let the subscriptions reach the publishers
        for d in daemons:
            threads.append(threading.Thread(target=d.run, daemon=True))
            threads[-1].start()
            assert d.wait_started(30)
        end = time.monotonic() + 60
        while time.monotonic() < end and min(d.stats.adopted for d in daemons) < 3:
            for lst in listeners:
                lst.poll(0.05)
        for d, t in zip(daemons, threads):
            d.stop()
            t.join(10)
        for lst in listeners:
            lst.poll(0.3)
            lst.close()
        report = srv.report()
    for i, (d, lst) in enumerate(zip(daemons, listeners)):
        assert d.stats.adopted >= 3, f"arm-{i}: only {d.stats.adopted} chunks adopted"
        assert d.stats.failures == 0
        seqs = [h.seq for h, _ in lst.messages if h.kind == 1]
        assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs))), "gap or repeat in sequence numbers"
        robot = report["robots"][f"arm-{i}"]
        assert robot["served"] >= 3 and robot["errors"] == 0 and robot["rejected"] == 0
