"""Stage timers that are honest on GPUs (synchronise before reading the clock)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class StageTimer:
    def __init__(self, device: torch.device) -> None:
        self.sync = device.type == "cuda"
        self.device = device
        self.ms: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if self.sync:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize(self.device)
            self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
