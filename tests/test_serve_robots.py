"""Eight simulated robot daemons (separate processes, torch-free `RemotePolicy` clients) against
one tiny-model server; one robot is killed mid-run with a request in flight. The other seven
must see no gap: every request answered, none refused or failed, latencies bounded.

Bounds are generous on purpose (the CI machine has two cores shared with other test runs):
the point is "answered, and not stuck behind the dead robot", not a latency benchmark.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time

import pytest

from phyai_edge.serve.loadgen import robots_process
from phyai_edge.serve.scheduler import SchedulerConfig
from phyai_edge.serve.server import LocalExecutor, PolicyServer

ROBOTS = 8
REQUESTS = 10
VICTIM = 3
KILL_AT = 4  # the victim sends its 5th request and dies before reading the answer
PERIOD_S = 0.2  # one request per robot per period: several robots share each batch


@pytest.mark.slow
def test_eight_robots_one_killed_mid_run(tiny_policy):
    cfg = SchedulerConfig(max_batch=8, window_s=0.01, capacity=64, per_robot=2)
    ctx = mp.get_context("spawn")  # a clean interpreter per robot, as separate daemons would be
    out = ctx.Queue()
    names = [f"robot-{i}" for i in range(ROBOTS)]
    with PolicyServer(LocalExecutor(tiny_policy), "tcp://127.0.0.1:*", cfg, default_budget_ms=500.0) as srv:
        start_at = time.time() + 3.0  # every robot starts together, after all have connected
        procs = [ctx.Process(target=robots_process,
                             args=(srv.endpoint, [n], REQUESTS, PERIOD_S, 500.0, (24, 32), i,
                                   {n: KILL_AT} if i == VICTIM else {}, start_at, out), daemon=True)
                 for i, n in enumerate(names)]
        for p in procs:
            p.start()
        results: dict[str, dict] = {}
        ready: set[str] = set()
        deadline = time.monotonic() + 120
        while len(results) < ROBOTS - 1 and time.monotonic() < deadline:
            try:
                kind, name, payload = out.get(timeout=1.0)
            except Exception:
                continue
            if kind == "ready":
                ready.add(name)
            elif kind == "done":
                results[name] = payload
        for p in procs:
            p.join(10)
        report = srv.report()
    assert procs[VICTIM].exitcode == -signal.SIGKILL, "the victim robot should have been killed"
    assert len(ready) == ROBOTS
    survivors = {n for i, n in enumerate(names) if i != VICTIM}
    assert set(results) == survivors, f"missing robots: {survivors - set(results)}"
    for name, r in sorted(results.items()):
        assert r["errors"] == [] and r["refused"] == 0, f"{name}: {r['errors']} ({r['refused']} refused)"
        assert r["answered"] == REQUESTS, f"{name} got {r['answered']} of {REQUESTS} answers"
        assert max(r["latency_s"]) < 20.0, f"{name}: a request took {max(r['latency_s']):.1f} s"
    # The server ran the dead robot's in-flight request (its reply was dropped); nobody else suffered.
    robots = report["robots"]
    assert robots[names[VICTIM]]["requests"] == KILL_AT + 1
    for name in survivors:
        assert robots[name]["served"] == REQUESTS and robots[name]["rejected"] == 0 and robots[name]["errors"] == 0
    assert report["batch_size"]["max"] > 1, "requests from different robots should share batches"
