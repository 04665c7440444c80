"""Does the control daemon grow? Memory, file descriptors, threads and Python containers over time.

`phyai-edge run` runs for days under systemd; a few hundred bytes kept per tick or per inference
is tens of megabytes a day. This runs the daemon on its embedded default (tiny PI0.5 on the CPU,
a synthetic camera and state) at 250 Hz instead of 50, with s = 15 instead of 25, to put hours
of ticks and inferences into minutes, while this process keeps it busy the way a robot's
surroundings do (`--load`):

- scrape: Prometheus scrapes /metrics every `--scrape-s`;
- task: a planner sends instructions (declared ones, new ones never seen before, an empty one
  that is refused), holds and releases, and queries, over the task channel;
- listen: subscribers connect and disconnect: `phyai_edge.control.listener.Listener`, a plain
  pyzmq SUB on a context of its own, and a slow one that never reads (its queue fills to `sndhwm`);
- crash: in the process-record run, the worker process is SIGKILLed three times and restarted.

Runs (`--runs`): the process worker and the thread worker, each with `--record` (to a temporary
folder) and without. Each run is a child process (`--child`) holding only the daemon: the load
runs here, so that its sockets and threads are not counted against the daemon. The child samples
its RSS (/proc/self/status VmRSS), open fds (/proc/self/fd) and threads, the worker process's
same, tracemalloc's traced bytes (`py kB`; tracing starts once the clock runs) and tracemalloc's
own tables (`tm kB`, in RSS); after `--warmup-frac` of the run and at its end it takes a
tracemalloc snapshot and a census of every list, dict, set and deque reachable from the `Daemon`
(their lengths, a bounded deque's maxlen), and prints what grew between them. The daemon's
per-inference window (`daemon.STATS_WINDOW`, 4096) is set to `--stats-window` (64) so that a run
of minutes fills it as days would.

    python benchmarks/daemon_resources.py                  # ~4.5 min: 4 runs of ~1 min
    python benchmarks/daemon_resources.py --minutes 10 --runs process --samples 20
    python benchmarks/daemon_resources.py --runs thread --frames 8   # who allocated what grew
    python benchmarks/daemon_resources.py --frames 0 --load scrape   # no tracemalloc; scrapes only
    python benchmarks/daemon_resources.py --collect 172800  # a day of results at 50 Hz, s = 25, no clock

Slopes are least-squares fits over the samples after warm-up, scaled to an hour of this run (5
hours of ticks at the default 50 Hz). The daemon's RSS rises 16 B a tick for its first 2**18
ticks (the lateness logs' pages, written for the first time; the report says how much of the
slope that is) and moves by allocator noise of a few hundred kB; the traced Python heap, the
tracemalloc top growth and the container census are the sensitive measures: a container that
grows with run time shows there by name.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (worker, record, crashes)
RUNS: dict[str, tuple[str, bool, bool]] = {
    "process-record": ("process", True, True),
    "process": ("process", False, False),
    "thread-record": ("thread", True, False),
    "thread": ("thread", False, False),
}
LATENESS_SLOTS = 2**18  # DaemonStats.lateness and .wake_lateness: LatenessLog(1 << 18) each
LATENESS_BYTES_PER_TICK = 16  # one int64 in each
LOADS = ("scrape", "task", "listen", "crash")  # what `Load` does to the daemon (--load)
PROMPTS = ("pick up the cube", "put the cup in the sink", "wipe the table")


# ---------------------------------------------------------------- /proc


def proc_sample(pid: int | str = "self") -> dict[str, int] | None:
    """RSS (kB), open fds and threads of a process; None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rss = threads = 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return {"rss_kb": rss, "fds": fds, "threads": threads}


# ---------------------------------------------------------------- container census


def census(root: Any, name: str = "daemon", max_nodes: int = 200_000) -> dict[str, int]:
    """Length of every list / dict / set / deque reachable from `root` through phyai_edge objects'
    attributes and through containers, by attribute path (a bounded deque's path says its maxlen).
    Items of a long list are not walked past the first few (their count is what matters here)."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    stack: list[tuple[str, Any, int]] = [(name, root, 0)]
    while stack and len(seen) < max_nodes:
        path, obj, depth = stack.pop()
        if id(obj) in seen or depth > 8:
            continue
        seen.add(id(obj))
        children: list[tuple[str, Any]] = []
        if isinstance(obj, dict):
            out[path] = len(obj)
            try:
                items = list(obj.items())  # one C-level copy: safe beside the clock thread's updates
            except RuntimeError:
                continue
            children = [(f"{path}[{k!r:.40}]", v) for k, v in items[:256]]
        elif isinstance(obj, (list, deque, set, frozenset)):
            bounded = isinstance(obj, deque) and obj.maxlen is not None
            out[path + (f" (deque, maxlen {obj.maxlen})" if bounded else "")] = len(obj)
            try:
                items = list(obj)
            except RuntimeError:
                continue
            children = [(f"{path}[{i}]", v) for i, v in enumerate(items[:8])]
        elif type(obj).__module__.startswith("phyai_edge") and hasattr(obj, "__dict__"):
            children = [(f"{path}.{k}", v) for k, v in list(vars(obj).items())]
        elif isinstance(obj, tuple):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(obj[:16])]
        for child_path, child in children:
            if isinstance(child, (dict, list, deque, set, frozenset, tuple)) or \
                    type(child).__module__.startswith("phyai_edge"):
                stack.append((child_path, child, depth + 1))
    return out


# ---------------------------------------------------------------- the child: the daemon alone


def child_main(spec_path: str) -> int:
    """Run one daemon in this process; JSON lines on stdout: samples, then the result."""
    import logging
    import tracemalloc

    from phyai_edge.control import daemon as daemon_module
    from phyai_edge.control.config import parse_config
    from phyai_edge.control.daemon import Daemon
    from phyai_edge.control.log import setup_logging

    spec = json.loads(Path(spec_path).read_text())
    setup_logging(logging.WARNING, to_stderr=True)
    if spec["stats_window"]:
        # Days of inferences in minutes: the per-inference window fills as it would in a long run.
        daemon_module.STATS_WINDOW = spec["stats_window"]
    cfg = parse_config(spec["config"], "<daemon_resources>")
    daemon = Daemon(cfg, record_dir=spec["record_dir"] or None, record_min_free_gb=0.0, realtime=False,
                    status_line=False)

    def emit(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    daemon.setup()
    thread = threading.Thread(target=daemon.run, kwargs={"duration_s": None}, name="daemon-main", daemon=True)
    thread.start()
    if not daemon.wait_started(120):
        emit({"event": "error", "error": "the daemon did not start"})
        return 1
    traced = spec["frames"] > 0
    if traced:
        tracemalloc.start(spec["frames"])
    t0 = time.monotonic()
    n, interval = spec["samples"], spec["duration_s"] / spec["samples"]
    warm_index = max(1, round(spec["warmup_frac"] * n))
    emit({"event": "started", "worker_pid": daemon.worker.pid})
    snap_warm = census_warm = None
    counts_warm: dict[str, int] = {}
    for i in range(n + 1):
        time.sleep(max(0.0, t0 + i * interval - time.monotonic()))
        if i == warm_index:
            # Before this sample, so that what the snapshot itself holds is in every sample fitted.
            snap_warm = tracemalloc.take_snapshot() if traced else None
            census_warm, counts_warm = census(daemon), _counts(daemon)
        pid = daemon.worker.pid
        w = proc_sample(pid) if pid else None
        emit({"event": "sample", "t": time.monotonic() - t0, **(proc_sample() or {}),
              "py_kb": tracemalloc.get_traced_memory()[0] // 1024, "worker_pid": pid, "worker": w,
              # tracemalloc's own tables live outside the traced heap, but in RSS
              "tm_kb": tracemalloc.get_tracemalloc_memory() // 1024,
              "warm": i >= warm_index, **_counts(daemon)})
    snap_end = tracemalloc.take_snapshot() if traced else None
    census_end = census(daemon)
    counts_end = _counts(daemon)
    tracemalloc.stop()
    daemon.stop()
    thread.join(30)
    assert census_warm is not None
    # Innermost frame first; with --frames > 1 the callers follow, " <- " between them.
    top = [] if snap_end is None or snap_warm is None else [
        {"where": " <- ".join(str(f) for f in reversed(s.traceback)), "kb": s.size_diff / 1024, "count": s.count_diff}
        for s in snap_end.compare_to(snap_warm, "lineno" if spec["frames"] == 1 else "traceback")[:spec["top"]]
        if s.size_diff > 0]
    grown = sorted(((p, census_warm.get(p, 0), n) for p, n in census_end.items() if n > census_warm.get(p, 0)),
                   key=lambda x: x[1] - x[2])
    summary = daemon.summary()
    emit({"event": "result", "top": top, "grown": grown[:spec["top"]],
          "between": {k: counts_end[k] - counts_warm.get(k, 0) for k in counts_end},
          "summary": {k: summary[k] for k in ("ticks", "missed_slots", "inferences", "failures", "holds", "worker",
                                              "task", "recorder")}})
    return 0


# What the tiny PI0.5 on the eager engine reports per inference (`JobResult.stage_ms`).
PI05_STAGES = ("preprocess", "embed_images", "encode_prefix", "denoise_step", "solver_loop", "postprocess", "total")


def collect_day(inferences: int) -> int:
    """The clock thread's side of `inferences` finished chunks, without the clock: each result
    (fresh floats, as unpickled from the worker process) through `Daemon._collect`, then what the
    process and the daemon's containers hold. 172800 is a day at 50 Hz with s = 25."""
    import gc

    import numpy as np

    from phyai_edge.control.daemon import Daemon, _Inflight
    from phyai_edge.control.fakes import FakePolicy, test_config
    from phyai_edge.control.worker import Job, JobResult

    d = Daemon(test_config(), policy=FakePolicy(action_dim=6, state_dim=6), realtime=False, status_line=False)
    d.setup()
    actions, state = np.zeros((50, 6), np.float32), np.zeros(6, np.float32)
    gc.collect()
    before = proc_sample() or {}
    t0 = time.monotonic()
    for k in range(1, inferences + 1):
        stages = {name: (k % 997) * 0.01 + i for i, name in enumerate(PI05_STAGES)}
        res = JobResult(k, actions, stages, infer_ms=20.0 + (k % 991) * 0.01)
        d._collect(res, _Inflight(Job(k, {}, {}, state, "p", 0.0), 10 * k, 0.0, 3), 10 * k + 2 + k % 3, False)
    took = time.monotonic() - t0
    gc.collect()
    after = proc_sample() or {}
    sizes = {p: n for p, n in census(d.stats, "stats").items() if n > 16}
    d.shutdown()
    print(f"{inferences} inferences through Daemon._collect in {took:.1f} s: RSS {before['rss_kb'] / 1024:.1f} -> "
          f"{after['rss_kb'] / 1024:.1f} MB ({(after['rss_kb'] - before['rss_kb']) / 1024:+.1f} MB), "
          f"{1024 * (after['rss_kb'] - before['rss_kb']) / inferences:.0f} B an inference")
    for path, n in sorted(sizes.items()):
        print(f"  {path}: {n}")
    return 0


def _counts(daemon: Any) -> dict[str, int]:
    st = daemon.stats
    return {"ticks": st.ticks, "inferences": st.inferences}


# ---------------------------------------------------------------- this process: the surroundings


class Load:
    """Scrapes, task requests, subscribers and worker kills against one running daemon."""

    def __init__(self, publish: str, task: str, metrics_port: int, crash_times: list[float],
                 scrape_s: float, task_s: float, listener_s: float, kinds: tuple[str, ...] = LOADS) -> None:
        self.publish, self.task, self.port = publish, task, metrics_port
        self.crash_times = sorted(crash_times)
        self.scrape_s, self.task_s, self.listener_s = scrape_s, task_s, listener_s
        self.counts = {"scrapes": 0, "scrape_errors": 0, "task_requests": 0, "task_errors": 0, "listeners": 0,
                       "listener_messages": 0, "kills": 0}
        self.worker_pid: int | None = None
        self.kinds = kinds
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, t0: float) -> None:
        self.t0 = t0
        jobs = {"scrape": self._scrape, "task": self._tasks, "listen": self._listeners, "crash": self._crashes}
        for fn in (jobs[k] for k in self.kinds):
            t = threading.Thread(target=fn, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(15)

    def _scrape(self) -> None:
        import urllib.request

        while not self._stop.wait(self.scrape_s):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                    r.read()
                self.counts["scrapes"] += 1
            except OSError:
                self.counts["scrape_errors"] += 1

    def _tasks(self) -> None:
        from phyai_edge.control.task import request_instruction

        k = 0
        while not self._stop.wait(self.task_s):
            k += 1
            step = k % 6
            kwargs: dict[str, Any] = {}
            if step == 0:
                kwargs = {"prompt": PROMPTS[(k // 6) % len(PROMPTS)]}
            elif step == 1:
                kwargs = {"hold": True}
            elif step == 2:
                kwargs = {"prompt": PROMPTS[(k // 6 + 1) % len(PROMPTS)], "hold": False}
            elif step == 3:
                kwargs = {}  # which instruction runs
            elif step == 4:
                kwargs = {"prompt": f"move block {k} left"}  # never seen before
            else:
                kwargs = {"prompt": "  "}  # refused
            try:
                request_instruction(self.task, timeout_s=10.0, **kwargs)
                self.counts["task_requests"] += 1
            except (TimeoutError, ValueError):
                self.counts["task_errors"] += 1

    def _listeners(self) -> None:
        import zmq

        from phyai_edge.control.listener import Listener

        k = 0
        while not self._stop.wait(self.listener_s):
            k += 1
            if k % 3 == 0:
                lis = Listener(self.publish, chunk_topic="chunk")
                lis.poll(0.15)
                self.counts["listener_messages"] += lis.stats.received
                lis.close()
            elif k % 3 == 1:
                ctx = zmq.Context()
                sock = ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.connect(self.publish)
                deadline = time.monotonic() + 0.15
                while time.monotonic() < deadline:
                    if sock.poll(20):
                        sock.recv_multipart()
                        self.counts["listener_messages"] += 1
                sock.close(0)
                ctx.term()
            else:
                # A subscriber that never reads: the daemon queues up to sndhwm messages for it
                # until it goes away.
                ctx = zmq.Context()
                sock = ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 10)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.connect(self.publish)
                self._stop.wait(2 * self.listener_s)
                sock.close(0)
                ctx.term()
            self.counts["listeners"] += 1

    def _crashes(self) -> None:
        for at in self.crash_times:
            if self._stop.wait(max(0.0, self.t0 + at - time.monotonic())):
                return
            pid = self.worker_pid
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                    self.counts["kills"] += 1
                except ProcessLookupError:
                    pass


def run_config(worker: str, hz: float, s: int) -> tuple[dict[str, Any], str, str, int]:
    """The embedded default with this run's changes: worker, rate, s, local endpoints, metrics,
    task channel, no real-time setup (a shared machine)."""
    from phyai_edge.control.config import DEFAULT_CONFIG_TOML, tomllib  # tomli on Python 3.10
    from phyai_edge.control.fakes import free_tcp_endpoint

    data = tomllib.loads(DEFAULT_CONFIG_TOML)
    publish, task = free_tcp_endpoint(), free_tcp_endpoint()
    port = int(free_tcp_endpoint().rsplit(":", 1)[1])
    data["robot"]["control_hz"] = hz
    data["chunking"]["execution_horizon"] = s
    data["model"].update(worker=worker, restart_backoff_s=0.2, load_timeout_s=120.0)
    data["publish"]["endpoint"] = publish
    data["metrics"]["port"] = port
    data["task"].update(endpoint=task, prompts=list(PROMPTS[1:]), prompt_tokens=48)
    data["clock"].update(priority=0, mlock=False)
    return data, publish, task, port


def run_one(name: str, args: argparse.Namespace, duration_s: float) -> dict[str, Any]:
    worker, record, crashes = RUNS[name]
    data, publish, task, port = run_config(worker, args.hz, args.exec_horizon)
    with tempfile.TemporaryDirectory(prefix="phyai-resources-") as tmp:
        spec = {"config": data, "record_dir": str(Path(tmp) / "rec") if record else "", "duration_s": duration_s,
                "samples": args.samples, "stats_window": args.stats_window, "warmup_frac": args.warmup_frac,
                "top": args.top, "frames": args.frames}
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        errlog = Path(tmp) / "stderr.log"
        crash_times = [duration_s * f for f in (0.35, 0.55, 0.75)] if crashes and args.crashes else []
        load = Load(publish, task, port, crash_times, args.scrape_s, args.task_s, args.listener_s, args.load)
        samples: list[dict[str, Any]] = []
        result: dict[str, Any] = {}
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with open(errlog, "wb") as err:
            proc = subprocess.Popen([sys.executable, __file__, "--child", str(spec_path)], stdout=subprocess.PIPE,
                                    stderr=err, env=env, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                msg = json.loads(line)
                if msg["event"] == "started":
                    load.worker_pid = msg["worker_pid"]
                    load.start(time.monotonic())
                elif msg["event"] == "sample":
                    load.worker_pid = msg["worker_pid"]
                    samples.append(msg)
                elif msg["event"] == "result":
                    result = msg
                elif msg["event"] == "error":
                    print(f"{name}: {msg['error']}", file=sys.stderr)
            load.stop()
            code = proc.wait(60)
        log_tail = errlog.read_text(errors="replace").splitlines()
        rec_files = len(list((Path(tmp) / "rec").glob("obs_*.npz"))) if record else 0
    if code != 0 or not result:
        print("\n".join(log_tail[-30:]), file=sys.stderr)
        raise SystemExit(f"{name}: the child exited with {code}")
    warnings = [ln for ln in log_tail if " WARNING " in ln or " ERROR " in ln]
    return {"name": name, "worker": worker, "record": record, "duration_s": duration_s, "samples": samples,
            "load": load.counts, "recorded_files": rec_files, "log_warnings": len(warnings), **result}


def slope_per_hour(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 3600.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else float("nan")


def report(run: dict[str, Any]) -> dict[str, Any]:
    samples = run["samples"]
    proc = run["worker"] == "process"
    print(f"\n== {run['name']}: {run['worker']} worker, record {'on' if run['record'] else 'off'}, "
          f"{run['duration_s']:.0f} s ==")
    head = f"{'t s':>6} {'ticks':>7} {'infer':>6} {'RSS MB':>8} {'fds':>4} {'thr':>4} {'py kB':>7} {'tm kB':>6}"
    if proc:
        head += f" | {'wRSS MB':>8} {'wfds':>4} {'wthr':>4}"
    print(head)
    first_warm = next(i for i, s in enumerate(samples) if s["warm"])
    for i, s in enumerate(samples):
        line = (f"{s['t']:6.1f} {s['ticks']:7d} {s['inferences']:6d} {s['rss_kb'] / 1024:8.1f} {s['fds']:4d} "
                f"{s['threads']:4d} {s['py_kb']:7d} {s['tm_kb']:6d}")
        if proc:
            w = s["worker"]
            # A process just spawned has no VmRSS yet: the worker is being restarted.
            line += f" | {w['rss_kb'] / 1024:8.1f} {w['fds']:4d} {w['threads']:4d}" if w and w["rss_kb"] else \
                " |  (restarting)"
        print(line + ("   <- warm-up snapshot; slopes from here" if i == first_warm else ""))
    after = [s for s in samples if s["warm"]]
    ts = [s["t"] for s in after]
    slopes = {k: slope_per_hour(ts, [s[k] / (1024 if k == "rss_kb" else 1) for s in after])
              for k in ("rss_kb", "fds", "threads", "py_kb")}
    up = [s for s in after if s["worker"] and s["worker"]["rss_kb"]]
    if proc and len(up) >= 2:
        # Restarts replace the process (its RSS starts again): fit only since the last one.
        last_pid = up[-1]["worker_pid"]
        same = [s for s in up if s["worker_pid"] == last_pid]
        slopes["worker_rss_kb"] = slope_per_hour([s["t"] for s in same], [s["worker"]["rss_kb"] / 1024 for s in same])
    print("slope per hour (after warm-up): " + ", ".join(
        f"{k.replace('_kb', '')} {v:+.1f}{' MB' if k.endswith('rss_kb') else ' kB' if k == 'py_kb' else ''}"
        for k, v in slopes.items()))
    # The daemon's two lateness logs (clock.LatenessLog) are np.zeros of 2**18 int64s: the kernel
    # maps their pages as the ticks first write them, 16 B a tick, until 2**18 ticks (4 MB). RSS
    # rises by that much and then stops; it is not a leak, but it is in the RSS slope.
    a, b = after[0], after[-1]
    committed = LATENESS_BYTES_PER_TICK * (min(b["ticks"], LATENESS_SLOTS) - min(a["ticks"], LATENESS_SLOTS))
    lateness = 3600.0 * committed / 2**20 / (b["t"] - a["t"]) if b["t"] > a["t"] else float("nan")
    print(f"  of the RSS slope, the lateness logs' pages written for the first time: {lateness:+.1f} MB/h "
          f"({'still filling' if b['ticks'] < LATENESS_SLOTS else 'full: no more'}; at most "
          f"{LATENESS_BYTES_PER_TICK * LATENESS_SLOTS / 2**20:.0f} MB, reached after {LATENESS_SLOTS} ticks)")
    between = run["between"]
    print(f"between the snapshots: {between['ticks']} ticks, {between['inferences']} inferences")
    print("tracemalloc growth between the snapshots (top):")
    for t in run["top"]:
        per = f", {1024 * t['kb'] / between['inferences']:.0f} B/inference" if between["inferences"] else ""
        print(f"  {t['kb']:9.1f} kB {t['count']:+7d} blocks  {t['where']}{per}")
    if not run["top"]:
        print("  (none)")
    print("containers reachable from the Daemon that grew between the snapshots:")
    for path, before, after_n in run["grown"]:
        print(f"  {path}: {before} -> {after_n}")
    if not run["grown"]:
        print("  (none)")
    summ = run["summary"]
    print(f"daemon: {summ['ticks']} ticks, {summ['missed_slots']} missed, {summ['inferences']} inferences "
          f"({summ['failures']} failed), worker {summ['worker']}, holds {summ['holds']}")
    print(f"load: {run['load']}; recorder {summ['recorder']}, files {run['recorded_files']}; "
          f"{run['log_warnings']} warning/error log lines")
    return slopes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=4.0, help="total time of the runs (default 4: ~1 min each)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    p.add_argument("--hz", type=float, default=250.0, help="robot.control_hz (default 250: 5x the default)")
    p.add_argument("--exec-horizon", type=int, default=15, help="chunking.execution_horizon s (default 15)")
    p.add_argument("--samples", type=int, default=12, help="samples per run")
    p.add_argument("--stats-window", type=int, default=64,
                   help="the daemon's STATS_WINDOW (inferences whose times it keeps; default 64, so that a "
                        "run of minutes fills it as days would; 0: the daemon's own)")
    p.add_argument("--warmup-frac", type=float, default=0.25, help="fraction of a run before the first snapshot")
    p.add_argument("--scrape-s", type=float, default=0.1)
    p.add_argument("--task-s", type=float, default=0.25)
    p.add_argument("--listener-s", type=float, default=0.2)
    p.add_argument("--no-crashes", dest="crashes", action="store_false",
                   help="do not kill the worker process in the process-record run")
    p.add_argument("--top", type=int, default=12, help="lines of tracemalloc growth and grown containers")
    p.add_argument("--frames", type=int, default=1,
                   help="tracemalloc frames per allocation (more: who called; 0: no tracemalloc, whose own tables "
                        "are in RSS)")
    p.add_argument("--load", default=",".join(LOADS),
                   help=f"what to do to the daemon, comma-separated, of {', '.join(LOADS)} (default all; '': none)")
    p.add_argument("--json", metavar="FILE", help="write every sample and result as JSON")
    p.add_argument("--collect", type=int, metavar="N", default=0,
                   help="instead: N inference results through Daemon._collect alone (172800: a day at 50 Hz, "
                        "s = 25) and the RSS they leave")
    p.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_main(args.child)
    if args.collect:
        return collect_day(args.collect)
    args.load = tuple(k.strip() for k in args.load.split(",") if k.strip())
    if set(args.load) - set(LOADS):
        p.error(f"--load: unknown {', '.join(sorted(set(args.load) - set(LOADS)))} (known: {', '.join(LOADS)})")
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        p.error(f"--runs: unknown {', '.join(unknown)} (known: {', '.join(RUNS)})")
    # Start-up (load, warm-up) takes a few seconds a run, outside this.
    duration = max(10.0, args.minutes * 60.0 / len(names) - 5.0)
    runs, table = [], []
    for name in names:
        run = run_one(name, args, duration)
        runs.append(run)
        table.append((run, report(run)))
    print("\n== summary: at the warm-up snapshot -> at the end, and the slope per hour between ==")
    print(f"{'run':15} {'RSS MB':>13} {'/h':>7} {'fds':>7} {'/h':>6} {'threads':>7} {'/h':>6} {'py kB':>11} "
          f"{'/h':>8} {'infer':>6}")
    for run, sl in table:
        a = next(s for s in run["samples"] if s["warm"])
        b = run["samples"][-1]
        print(f"{run['name']:15} {a['rss_kb'] / 1024:6.1f}{b['rss_kb'] / 1024:7.1f} {sl['rss_kb']:+7.1f} "
              f"{a['fds']:3d}{b['fds']:4d} {sl['fds']:+6.1f} {a['threads']:3d}{b['threads']:4d} {sl['threads']:+6.1f} "
              f"{a['py_kb']:5d}{b['py_kb']:6d} {sl['py_kb']:+8.1f} {b['inferences'] - a['inferences']:6d}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
