"""One way to time GPU work for the kernel benchmarks: the calls captured in one CUDA graph and
replayed, so the numbers are kernel time as the engine runs them (no Python launch gaps).
Used by `gemm_gpu.py` and `attention_gpu.py`."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def time_calls(calls: list[Callable[[], Any]], device: str, replays: int = 20) -> float:
    """Median microseconds per call: on a GPU, the calls captured in one CUDA graph and replayed
    (`calls` may repeat one call, or cycle through copies of its inputs larger than the L2); on a
    CPU, perf_counter over the calls."""
    for c in calls:  # compiles / autotunes nothing inside the capture
        c()
    if not device.startswith("cuda"):
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            for c in calls:
                c()
            ts.append((time.perf_counter() - t0) / len(calls))
        return statistics.median(ts) * 1e6
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # a warm-up on the side stream, as torch's capture docs advise
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    for _ in range(3):
        graph.replay()
    ms = replay_ms(graph, replays)
    del graph
    return ms * 1e3 / len(calls)


def l2_bytes(device: str) -> int:
    """The GPU's L2 cache in bytes (0 on a CPU): inputs cycled through copies larger than this are
    read from memory, as a model's layers find them."""
    if not device.startswith("cuda"):
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    """Median milliseconds of one replay of a captured graph, each timed with CUDA events."""
    ms = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)
