"""`phyai-edge info`: what this machine offers the runtime."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import platform
import sys

HELP = "what this machine has: torch, CUDA, GPUs, TensorRT, onnxruntime"
DESCRIPTION = "Print the Python, torch, CUDA, GPU, TensorRT and onnxruntime versions this install can use."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _version(module: str) -> str | None:
    """The module's version; None where it is not installed. One that is installed but fails to
    import (TensorRT's Python package without its libnvinfer, a wheel built for another CUDA) was
    reported "not installed", hiding the error that says what to fix."""
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):  # a broken parent package, a module without a spec
        return None
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as exc:
        return f"installed, but fails to import ({type(exc).__name__}: {exc})"


def collect() -> dict:
    import torch

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": prop.name, "capability": f"{prop.major}.{prop.minor}",
                         "memory_gib": round(prop.total_memory / 2**30, 1)})
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpus,
        "tensorrt": _version("tensorrt"),
        "onnxruntime": _version("onnxruntime"),
        "onnx": _version("onnx"),
        "triton": _version("triton"),
        "pyzmq": _version("zmq"),
        "opencv": _version("cv2"),
        # On a Jetson, what its timings depend on: whether the GPU clock is locked, the power mode.
        "jetson": _jetson(),
        # The CPUs' frequency governors (host work after an idle gap is slower off `performance`).
        "cpu_governor": _cpu_governor(),
    }


def _cpu_governor() -> str | None:
    from phyai_edge.control.preflight import cpu_governors, describe_governors

    return describe_governors(cpu_governors()) or None


def _jetson() -> dict[str, str] | None:
    from phyai_edge.control.preflight import jetson_checks

    checks = jetson_checks()
    return {c.what.removeprefix("jetson."): f"{c.status}: {c.detail}" for c in checks} if checks else None


def main(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, val in info.items():
        if key == "gpus":
            if not val:
                print(f"{'gpus':<16}none")
            for g in val:
                print(f"{'gpu ' + str(g['index']):<16}{g['name']} (sm {g['capability']}, {g['memory_gib']} GiB)")
        elif key == "jetson":
            for what, text in (val or {}).items():  # nothing off a Jetson
                print(f"{what:<16}{text}")
        elif key == "cpu_governor" and val is None:
            print(f"{key:<16}not exposed (no cpufreq: a VM or container)")
        elif key == "cuda" and val is None:
            # torch.version.cuda is None for a CPU-only torch wheel: installing the CUDA toolkit
            # would not help; a CUDA build of torch (JetPack's wheel on a Jetson) would.
            print(f"{'cuda':<16}none: this torch is a CPU-only build")
        else:
            print(f"{key:<16}{val if val is not None else 'not installed'}")
    return 0
