"""The server's scheduler on a simulated clock: how many robots an engine with a given time per
batch size can serve within their budget, and what a scheduling rule or a set of captured batch
sizes changes. Torch-free and deterministic for a seed; nothing here is timed.

One inference thread, as `PolicyServer` with a local engine: it forms a batch with the real
`Scheduler`, the engine takes `engine(padded size)` seconds, and the batch's requests are
answered when it ends. Robots behave like `serve.loadgen`'s: one request every `period_s` from
a random phase, the next only after the answer (at its tick, or at once if the answer came after
it), a refused one skipped until the next tick. The scheduler starts with the engine's times
(the server's warm-up measures them) and keeps learning from the batches it runs.

    python -m phyai_edge.serve.simulate --engine-ms 1:21.4,8:75.8,32:267.6,64:524.9 --robots 32,48,56,64
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from phyai_edge.serve.scheduler import DEFAULT_BATCH_SIZES, Pending, Scheduler, SchedulerConfig, ServiceTimes

Clock = Callable[[], float]


class TakeAllScheduler(Scheduler):
    """The rule before the latency rule, for comparison: a batch takes every compatible
    candidate up to max_batch."""

    def _take(self, candidates: list[Pending], now: float) -> int:
        return len(candidates)


class SimClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class SimResult:
    sent: int = 0
    answered: int = 0
    refused: int = 0
    late: int = 0
    answers: list[tuple[float, float]] = field(default_factory=list)  # (arrival, latency) per answer
    batches: list[int] = field(default_factory=list)  # observations per batch

    def latencies(self, after: float = 0.0) -> list[float]:
        return [lat for arrival, lat in self.answers if arrival >= after]

    def rate(self) -> float:
        """Answers per second over the run."""
        end = max((a + lat for a, lat in self.answers), default=0.0)
        return self.answered / end if end > 0 else 0.0


def engine_from_points(points: dict[int, float]) -> Callable[[int], float]:
    """Seconds per padded batch size from measured points, filled in as the latency rule fills
    sizes it has not measured (`ServiceTimes`: linear between points, proportional above)."""
    times = ServiceTimes()
    for size, seconds in points.items():
        times.record(size, seconds)
    return times.estimate


def simulate(robots: int, engine: Callable[[int], float], sizes: Sequence[int] | None = DEFAULT_BATCH_SIZES,
             max_batch: int | None = None, seconds: float = 20.0, period_s: float = 0.5, budget_s: float = 0.5,
             capacity: int | None = None, window_s: float = 0.005, seed: int = 0,
             stall: tuple[float, float] | None = None, rule: type[Scheduler] = Scheduler) -> SimResult:
    """`robots` robots sending for `seconds`; the batch that starts first at or after stall[0]
    takes stall[1] seconds longer (e.g. a CUDA-graph capture at a shape first met while
    serving). capacity: the queue's bound (default: never reached, as in serve_gpu.py)."""
    rng = np.random.default_rng(seed)
    clock = SimClock()
    limit = max_batch or (max(sizes) if sizes else 64)
    cfg = SchedulerConfig(max_batch=limit, window_s=window_s, per_robot=2,
                          capacity=capacity if capacity is not None else 4 * robots + 16,
                          batch_sizes=tuple(sizes) if sizes else None)
    s = rule(cfg, clock)
    for b in sizes or range(1, limit + 1):
        s.record_service(b, engine(b))
    res = SimResult()
    sends: list[tuple[float, int]] = []  # (time, robot) of each robot's next request
    tick = [float(rng.uniform(0, period_s)) for _ in range(robots)]
    for r in range(robots):
        heapq.heappush(sends, (tick[r], r))
    stalled = stall is None

    def send_due(upto: float) -> None:
        while sends and sends[0][0] <= upto:
            t, r = heapq.heappop(sends)
            res.sent += 1
            tick[r] += period_s
            if s.submit(Pending(f"r{r}", res.sent, 1, t + budget_s, None, r, t)) is not None:
                res.refused += 1
                if tick[r] < seconds:
                    heapq.heappush(sends, (tick[r], r))

    while True:
        send_due(clock.t)
        batch = s.next_batch(0)
        if batch:
            size = s.padded(sum(p.size for p in batch))
            service = engine(size)
            if not stalled and clock.t >= stall[0]:  # type: ignore[index]
                service += stall[1]  # type: ignore[index]
                stalled = True
            done = clock.t + service
            s.record_service(size, service)
            res.batches.append(len(batch))
            for p in batch:
                res.answered += 1
                res.late += done > p.deadline
                res.answers.append((p.arrival, done - p.arrival))
                r = p.payload
                if tick[r] < seconds:
                    heapq.heappush(sends, (max(tick[r], done), r))
            clock.t = done  # requests that arrived meanwhile are submitted at the loop's top
            continue
        ready = s.ready_at()
        due = [t for t in (ready, sends[0][0] if sends else None) if t is not None]
        if not due:
            return res
        clock.t = max(min(due), clock.t)


def _row(name: str, robots: int, res: SimResult, budget_s: float, after: float) -> str:
    lat = res.latencies(after)
    p50, p99 = (float(np.percentile(lat, q)) * 1e3 for q in (50, 99))
    late = sum(x > budget_s for x in lat)
    return (f"| {name} | {robots} | {len(lat)} | {late} | {p50:.0f} | {p99:.0f} | {max(lat) * 1e3:.0f} | "
            f"{np.mean(res.batches):.1f} | {res.rate():.1f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-ms", default="1:21.4,8:75.8,32:267.6,64:524.9",
                   help="measured ms per padded batch size, size:ms,... (default: the H200, full PI0.5, cudagraph bf16)")
    p.add_argument("--host-ms-per-obs", type=float, default=0.25, help="host work per observation on top (H200: 7.8 ms / 32)")
    p.add_argument("--robots", default="32,48,56,64")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)) + ";1,2,4,8,16,32,64",
                   help="captured size lists to compare, ';'-separated ('any': no padding)")
    p.add_argument("--rules", default="latency,take-all")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup-s", type=float, default=2.0, help="answers to requests sent before this are not counted")
    p.add_argument("--period-s", type=float, default=0.5)
    p.add_argument("--budget-ms", type=float, default=500.0)
    p.add_argument("--stall", default="", help="at_s:extra_s, one batch that long (e.g. 5:1 for a capture)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    points = {int(k): float(v) / 1e3 for k, v in (x.split(":") for x in args.engine_ms.split(","))}
    model = engine_from_points(points)

    def engine(b: int) -> float:
        return model(b) + args.host_ms_per_obs * b / 1e3

    stall = tuple(float(x) for x in args.stall.split(":")) if args.stall else None
    rules = {"latency": Scheduler, "take-all": TakeAllScheduler}
    print(f"# simulated server: engine ms {args.engine_ms} + {args.host_ms_per_obs} ms/obs host, one request per "
          f"robot every {args.period_s} s, budget {args.budget_ms:.0f} ms, {args.seconds:.0f} s, stall {args.stall or 'none'}")
    print("| rule, sizes | robots | requests | late | p50 ms | p99 ms | max ms | mean batch | answers/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for spec in args.sizes.split(";"):
        sizes = None if spec.strip() == "any" else [int(x) for x in spec.split(",")]
        for rname in args.rules.split(","):
            for n in (int(x) for x in args.robots.split(",")):
                res = simulate(n, engine, sizes, seconds=args.seconds, period_s=args.period_s,
                               budget_s=args.budget_ms / 1e3, stall=stall, rule=rules[rname], seed=args.seed)  # type: ignore[arg-type]
                label = f"{rname}, {'any' if sizes is None else f'{len(sizes)} sizes'}"
                print(_row(label, n, res, args.budget_ms / 1e3, args.warmup_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
