"""`phyai-edge export`: build an engine bundle once, before deployment, on the robot computer."""

from __future__ import annotations

import argparse
import importlib.util
import signal
import sys
from pathlib import Path

from phyai_edge.commands.common import (
    adapter_options,
    add_adapter_option_argument,
    check_at_least,
    check_device,
    check_positive,
)
from phyai_edge.engines import backend_name
from phyai_edge.extras import BACKEND_NEEDS, backend_install_hint

HELP = "build an engine bundle (ONNX, TensorRT, CUDA graph) from a checkpoint"
DESCRIPTION = """\
Build a self-describing engine bundle that the daemon (`[model] bundle = "engines/NAME"` in its
config), `phyai-edge bench --engine`, `eval --engine` and `serve --engine` load without
rebuilding anything. Run it on the machine that will run the robot: TensorRT engines only run
on the GPU architecture and TensorRT version they were built with, and loading refuses others.

backends:
  onnx       one static-shape ONNX file per stage and batch size, run with onnxruntime
             (CPU, or the CUDA execution provider); portable between machines
  tensorrt   TensorRT engines built from those ONNX files (strongly typed where possible,
             one optimisation profile per --batch, timing cache reused between builds);
             the denoise loop replays as one CUDA graph
  cudagraph  the checkpoint weights and shapes; CUDA graphs are captured when the bundle loads

precisions: fp32, fp16, bf16 (tensorrt, cudagraph), int8 (onnx via onnxruntime QDQ, tensorrt via
an entropy calibrator), fp8 (tensorrt and onnx: E4M3 QDQ; cudagraph: the --fp8-scope linears in
E4M3 with the bundle's per-tensor scales, torch._scaled_mm on Ada / Hopper).
int8 and fp8 read --calibration: a `phyai-edge run --record` folder, a LeRobot dataset folder,
or `synthetic`; the calibrated engine's error against bf16 and fp32 on held-out samples is
printed and stored in the manifest.

examples:
  phyai-edge export --preset tiny --out engines/tiny-onnx --backend onnx
  phyai-edge export --checkpoint ckpt/pi05_aloha --out engines/aloha-trt --backend tensorrt \\
      --precision fp16 --batch 1,2 --views 3
  phyai-edge export --checkpoint ckpt/pi05_aloha --out engines/aloha-int8 --backend onnx \\
      --precision int8 --calibration recordings/day1
"""


def _batches(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch takes comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--batch needs positive integers, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("model")
    src.add_argument("--adapter", default="pi05", help="model adapter (default: pi05)")
    g = src.add_mutually_exclusive_group()
    g.add_argument("--checkpoint", type=Path, help="checkpoint folder (LeRobot, openpi or native)")
    g.add_argument("--preset", default="tiny", help="built-in seeded preset when no checkpoint (default: tiny)")
    src.add_argument("--tokenizer", type=Path, help="tokenizer file or folder, if not in the checkpoint")
    add_adapter_option_argument(src)
    out = p.add_argument_group("bundle")
    out.add_argument("--out", type=Path, required=True, help="bundle folder, e.g. engines/aloha-fp16")
    out.add_argument("--backend", default="onnx", choices=["onnx", "tensorrt", "cudagraph"],
                     help="engine kind (default: onnx)")
    out.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16", "fp8", "int8"],
                     help="compute precision (default: fp32)")
    out.add_argument("--batch", type=_batches, default=[1], metavar="B[,B...]",
                     help="batch sizes to build for, e.g. 1,2,4 (default: 1)")
    out.add_argument("--views", type=int, help="camera slots (default: the checkpoint's cameras)")
    out.add_argument("--steps", type=int, help="flow-matching steps (default: the checkpoint's)")
    out.add_argument("--overwrite", action="store_true", help="replace an existing bundle folder")
    cal = p.add_argument_group("calibration (int8 / fp8)")
    cal.add_argument("--calibration", metavar="DIR|synthetic",
                     help="recorded observations, a LeRobot dataset folder, or 'synthetic'")
    cal.add_argument("--calibration-samples", type=int, default=32, help="samples used to calibrate (default: 32)")
    cal.add_argument("--holdout", type=int, default=4, help="held-out samples for the accuracy report (default: 4)")
    cal.add_argument("--fp8-scope", choices=["expert", "prefix", "all"], default="expert",
                     help="cudagraph fp8: linears run in fp8 (E4M3, calibrated per-tensor scales): the action "
                     "expert's, the prefix's, or every attention/MLP projection (default: expert)")
    cal.add_argument("--int8-mode", choices=["calibrator", "qdq"], default="calibrator",
                     help="tensorrt int8: entropy calibrator (implicit) or onnxruntime Q/DQ ONNX (explicit)")
    b = p.add_argument_group("build")
    b.add_argument("--device", help="device for validation / building (default: cuda for tensorrt and "
                   "cudagraph when present, else cpu)")
    b.add_argument("--timing-cache", type=Path, help="TensorRT timing cache file, reused across builds "
                   "(default: ~/.cache/phyai-edge/trt-timing.cache)")
    b.add_argument("--workspace-gb", type=float,
                   help="TensorRT builder workspace limit in GiB (default: TensorRT's, the GPU's memory)")
    b.add_argument("--no-validate", action="store_true", help="skip the check against the eager engine")
    b.add_argument("--no-progress", action="store_true",
                   help="a line per step instead of progress bars (also what a log file or the journal gets: "
                   "bars are drawn only on a terminal)")
    b.add_argument("--seed", type=int, default=0, help="seed for the built-in preset and sample noise")


def main(args: argparse.Namespace) -> int:
    from phyai_edge.engines.bundle import BundleError
    from phyai_edge.engines.exporter import DEFAULT_TIMING_CACHE, ExportRequest, export_bundle

    req = ExportRequest(
        out=args.out, backend=args.backend, precision=args.precision, adapter=args.adapter,
        checkpoint=args.checkpoint, preset=args.preset, batch_sizes=args.batch, views=args.views, steps=args.steps,
        calibration=args.calibration, calibration_samples=args.calibration_samples, holdout=args.holdout,
        device=args.device, seed=args.seed, validate=not args.no_validate, int8_mode=args.int8_mode,
        fp8_scope=args.fp8_scope,
        timing_cache=args.timing_cache or DEFAULT_TIMING_CACHE, workspace_gb=args.workspace_gb,
        # A bar redraws itself with carriage returns: in a CI log, a file or journald that is one
        # unreadable line per redraw, so off a terminal each step gets a plain line instead.
        overwrite=args.overwrite, progress=not args.no_progress and sys.stderr.isatty(), tokenizer=args.tokenizer,
        adapter_options=adapter_options("export", args),
    )
    # Checked first, so a missing module is one clear line, not a traceback after the checkpoint
    # has loaded.
    backend = backend_name(req.backend)
    missing = [m for m in BACKEND_NEEDS.get(backend, ()) if importlib.util.find_spec(m) is None]
    if missing:
        print(f"phyai-edge export: the {req.backend} backend needs {', '.join(missing)}: "
              f"{backend_install_hint(backend)}", file=sys.stderr)
        return 2
    # Before the export: a device torch cannot use would otherwise fail only at validation,
    # after every stage was exported, and in torch's words rather than the flag's.
    check_device("export", args.device)
    check_at_least("export", ("--views", args.views, 1), ("--steps", args.steps, 1),
                   ("--calibration-samples", args.calibration_samples, 1), ("--holdout", args.holdout, 0))
    check_positive("export", ("--workspace-gb", args.workspace_gb))
    # SIGTERM (systemd, a CI timeout) ends the export as Ctrl-C does, through its clean-up: no hidden
    # half-written folder (gigabytes at full size) is left behind.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        manifest = export_bundle(req)
    except (BundleError, ValueError, OSError, RuntimeError) as exc:
        print(f"phyai-edge export: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # cleaned up on the way out, as SIGTERM is: one line, not a traceback
        print(f"phyai-edge export: interrupted; {args.out} is left as it was", file=sys.stderr)
        return 128 + signal.SIGINT
    return 1 if manifest["validation"].get("status") == "failed" else 0
