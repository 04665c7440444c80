"""The TensorRT int8 entropy calibrator: feeds a stage's recorded inputs to the builder.

`tensorrt` is imported only when a calibrator is made, so this module imports anywhere. The
class is built inside `entropy_calibrator` because its base class lives in `tensorrt`.

The cache file holds TensorRT's per-tensor scales: a rebuild with the same cache skips
calibration entirely. TensorRT checks only the cache's version header, not that it belongs to this
network or these weights, so `tensorrt.build_for_adapter` deletes a cache it finds before calibrating.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def entropy_calibrator(
    samples: list[dict[str, np.ndarray]],
    cache_file: str | Path,
    device: str | torch.device = "cuda",
    trt: Any = None,
) -> Any:
    """An `IInt8EntropyCalibrator2` over `samples` (each a full batch of the stage's inputs,
    all of the same batch size). `trt` may be passed in (tests use a stand-in module)."""
    if trt is None:
        import tensorrt as trt
    if not samples:
        raise ValueError("an int8 calibrator needs at least one sample")
    first = next(iter(samples[0].values()))
    names = list(samples[0])
    # k/v caches carry the batch on axis 1; every other input on axis 0.
    batch = int(samples[0]["k_cache"].shape[1]) if "k_cache" in samples[0] else int(first.shape[0])

    class EntropyCalibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self.cache_file = Path(cache_file)
            self.index = 0
            self.error: Exception | None = None  # what get_batch raised, for build_engine to report
            # Device buffers, written before each batch; their addresses never change, which
            # is what the builder expects of get_batch's pointers.
            self.buffers = {n: torch.empty(samples[0][n].shape, dtype=torch.from_numpy(samples[0][n]).dtype,
                                           device=device) for n in names}

        def get_batch_size(self) -> int:
            return batch

        def get_batch(self, names_asked: list[str]) -> list[int] | None:
            # TensorRT's Python bridge catches whatever this raises, prints it to stderr and treats
            # it as the end of the data, so the build would go on with missing scales. Keep the
            # error instead (build_engine raises it after the build) and end the data here.
            try:
                return self._next_batch(names_asked)
            except Exception as exc:
                log.error("int8 calibrator: %s", exc)
                self.error = exc
                return None

        def _next_batch(self, names_asked: list[str]) -> list[int] | None:
            if self.error is not None or self.index >= len(samples):
                return None
            sample = samples[self.index]
            self.index += 1
            ptrs = []
            for n in names_asked:
                if n not in self.buffers:
                    raise KeyError(f"calibrator has no input {n!r}; it has {names}")
                self.buffers[n].copy_(torch.from_numpy(np.ascontiguousarray(sample[n])))
                ptrs.append(int(self.buffers[n].data_ptr()))
            if self.buffers[names[0]].is_cuda:
                torch.cuda.synchronize(self.buffers[names[0]].device)
            return ptrs

        def read_calibration_cache(self) -> bytes | None:
            if self.cache_file.exists():
                log.info("reusing int8 calibration cache %s", self.cache_file)
                return self.cache_file.read_bytes()
            return None

        def write_calibration_cache(self, cache: Any) -> None:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            self.cache_file.write_bytes(bytes(cache))

    return EntropyCalibrator()
