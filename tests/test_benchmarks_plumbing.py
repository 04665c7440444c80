"""The GPU benchmarks' plumbing, run on this CPU: each script's `--tiny` mode under Triton's interpreter
(the kernel scripts), so that a change to a kernel's arguments or a tiling's fields breaks a test here
instead of the next GPU session's first call, whose device time is scarce. The numbers such a run
prints mean nothing on a CPU; what is checked is that the script runs to its end and prints the
table it exists for, with no variant that raised (the scripts record such a variant's error in
their table and go on, as a GPU refusing a tiling needs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_triton_ops import kernels

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    # script, arguments, what its output must contain
    "attention_grad_gpu": (["--batches", "1", "--cold"], ["input sets, cycled", "fwd+bwd, kernel vs sdpa"]),
    "expert_layer_gpu": ([], ["| per-op kernels (before) |", "| phases one by one |"]),
    "gemm_gpu": ([], ["Suggested `triton_gemm.CONFIGS` entries"]),
    "siglip_padding_gpu": ([], ["fc1 us", "sdpa us"]),
}


def _run(script: str, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@kernels
@pytest.mark.parametrize("script", list(CASES))
def test_benchmark_runs_tiny_on_the_cpu(script) -> None:
    args, markers = CASES[script]
    done = _run(script, ["--device", "cpu", "--tiny", *args])
    assert done.returncode == 0, done.stderr[-3000:]
    for marker in markers:
        assert marker in done.stdout, (marker, done.stdout[-2000:])
    # the scripts record a variant that raised and go on (a tiling a GPU refuses): none may here
    assert "Error:" not in done.stdout, done.stdout[-3000:]


def test_gpu_only_benchmark_imports_on_the_cpu() -> None:
    """`l2_prefetch_gpu.py` has no CPU mode (its kernel is inline PTX): its imports and arguments, at least."""
    done = _run("l2_prefetch_gpu", ["--help"], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--programs" in done.stdout
