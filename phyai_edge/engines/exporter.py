"""`phyai-edge export`: adapter stages -> a self-describing engine bundle under engines/<name>/.

The bundle is assembled in a sibling temporary folder and renamed into place at the end, so
an interrupted export never leaves a half bundle that a robot could try to load.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from phyai_edge.adapters.base import Adapter, Observation, SolverSpec
from phyai_edge.engines import backend_name
from phyai_edge.engines.bundle import (
    FORMAT,
    BundleError,
    Platform,
    builtin_source,
    checkpoint_sha256,
    now_iso,
    weight_files,
    write_manifest,
)

log = logging.getLogger(__name__)

BACKENDS = ("onnxruntime", "tensorrt", "cudagraph")
# Largest model-space |error| vs float32 eager that still passes validation, per precision.
# fp32 differs only by the fp32 (not fp64) time embedding and kernel order; the low
# precisions are bounded loosely: their real cost is in the calibration report.
TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2, "bf16": 1.5e-1, "int8": 1.0, "fp8": 1.0}
SUPPORTED = {
    "onnxruntime": ("fp32", "fp16", "int8", "fp8"),
    "tensorrt": ("fp32", "fp16", "bf16", "int8", "fp8"),
    "cudagraph": ("fp32", "fp16", "bf16", "fp8"),
}
DEFAULT_TIMING_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "phyai-edge" / "trt-timing.cache"


@dataclass
class ExportRequest:
    out: Path
    backend: str = "onnxruntime"
    precision: str = "fp32"
    adapter: str = "pi05"
    checkpoint: Path | None = None
    preset: str = "tiny"
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    views: int | None = None
    steps: int | None = None
    calibration: str | None = None
    calibration_samples: int = 32
    holdout: int = 4
    device: str | None = None
    seed: int = 0
    validate: bool = True
    int8_mode: str = "calibrator"
    fp8_scope: str = "expert"  # cudagraph fp8: which linears run in fp8 (layers.fp8.SCOPES)
    timing_cache: Path | None = DEFAULT_TIMING_CACHE
    workspace_gb: float | None = None
    overwrite: bool = False
    progress: bool = True
    tokenizer: Path | None = None
    adapter_options: dict[str, Any] = field(default_factory=dict)  # the adapter's OPTIONS, e.g. prompt_state

    def normalised(self) -> ExportRequest:
        self.backend = backend_name(self.backend)
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of onnx, tensorrt, cudagraph")
        if self.precision not in SUPPORTED[self.backend]:
            hint = {"bf16": " (onnxruntime has few bf16 kernels; use fp16, or the tensorrt backend)",
                    "int8": " (int8 needs TensorRT or onnxruntime; the torch path uses fp8 weights)"}.get(self.precision, "")
            raise ValueError(f"precision {self.precision!r} is not available with the {self.backend} backend"
                             f"{hint}; choose one of {', '.join(SUPPORTED[self.backend])}")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be positive integers, got {self.batch_sizes}")
        self.batch_sizes = sorted(set(self.batch_sizes))
        from phyai_edge.layers.fp8 import SCOPES

        if self.fp8_scope not in SCOPES:
            raise ValueError(f"fp8 scope {self.fp8_scope!r}: choose one of {', '.join(SCOPES)}")
        if self.device is None:
            self.device = "cuda" if self.backend in ("tensorrt", "cudagraph") and torch.cuda.is_available() else "cpu"
        return self


# -- progress -----------------------------------------------------------------------------
def say(line: str) -> None:
    """Print one line of the export's output and flush it. Off a terminal (systemd's journal, a CI
    log, a pipe) Python block-buffers stdout, so without the flush every step line of a long export
    arrived at its very end, together, and a killed export lost them."""
    print(line, flush=True)


class Progress:
    """A tqdm bar per phase when tqdm is installed, wanted and stderr (where tqdm draws) is a
    terminal, else one line per step: a bar redraws itself with carriage returns, which a log file
    or the journal keeps as one unreadable line per redraw."""

    def __init__(self, enabled: bool, echo: Callable[[str], None]) -> None:
        self.echo = echo
        self.tqdm = None
        if enabled and _is_terminal(sys.stderr):
            try:
                from tqdm.auto import tqdm

                self.tqdm = tqdm
            except ImportError:
                pass

    @contextmanager
    def phase(self, title: str, steps: list[str], unit: str = "stage") -> Iterator[Callable[[str], None]]:
        if self.tqdm is not None:
            bar = self.tqdm(total=len(steps), desc=title, unit=unit, leave=True)

            def done(name: str) -> None:
                bar.set_postfix_str(name)
                bar.update(1)

            try:
                yield done
            finally:
                bar.close()
        else:
            self.echo(f"{title}: {len(steps)} step(s)")
            yield lambda name: self.echo(f"  {title}: {name} done")


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


# -- helpers ------------------------------------------------------------------------------
def _set_views(adapter: Adapter, views: int | None) -> int:
    """Fix the number of camera slots the engines are built for."""
    names = list(adapter.camera_names)
    if views is None or views == len(names):
        return len(names)
    if views < 1:
        raise ValueError("--views must be at least 1")
    if views < len(names):
        log.warning("keeping the first %d of the checkpoint's cameras: %s", views, names[:views])
        names = names[:views]
    else:
        # Extra slots are filled with absent cameras (masked out), as LeRobot's empty_cameras.
        names = names + [f"empty_camera_{i}" for i in range(views - len(names))]
    adapter.camera_names = names
    if hasattr(adapter, "io"):
        adapter.io.camera_names = list(names)
    return views


def write_checkpoint(adapter: Adapter, folder: Path, with_weights: bool,
                     weight_dtype: str = "float32") -> str | None:
    """The adapter's own checkpoint folder in the bundle (metadata, statistics, tokenizer...),
    weights only if asked. Written by the adapter's module (`save_bundle_checkpoint`), the same
    module `bundle.bundle_adapter` asks to read it back. Weights are stored for an engine running
    in `weight_dtype` when the module takes that option (PI0.5: big matmuls in it, the rest
    float32), else in float32. Returns the dtype they were stored for (None: no weights)."""
    from phyai_edge.engines.bundle import adapter_module, optional_kwargs
    from phyai_edge.engines.eager import resolve_dtype

    module = adapter_module(adapter.name)
    save = getattr(module, "save_bundle_checkpoint", None)
    if save is None:
        raise BundleError(f"adapter {adapter.name!r} cannot be exported into a bundle: its module "
                          f"{module.__name__} has no save_bundle_checkpoint(adapter, folder, with_weights)")
    options = {}
    if with_weights and weight_dtype != "float32":
        options = optional_kwargs(save, weight_dtype=resolve_dtype(weight_dtype))
    save(adapter, folder, with_weights, **options)
    if not with_weights:
        return None
    return weight_dtype if options else "float32"


def tensor_sha256(module: torch.nn.Module) -> str:
    """A hash of the weights themselves, for models that came from no checkpoint file."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def _spec_json(specs: list[Any]) -> list[dict[str, Any]]:
    def io(d: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, Any]:
        return {n: {"shape": list(shape), "dtype": str(dt).removeprefix("torch.")} for n, (shape, dt) in d.items()}

    return [{"name": s.name, "inputs": io(s.inputs), "outputs": io(s.outputs)} for s in specs]


def _typed(precision: str) -> str:
    """The float type the graph is exported in; int8 / fp8 are quantised from float32."""
    return precision if precision in ("fp16", "bf16") else "fp32"


# -- the export ---------------------------------------------------------------------------
def export_bundle(
    req: ExportRequest,
    adapter: Adapter | None = None,
    echo: Callable[[str], None] = say,
) -> dict[str, Any]:
    """Build the bundle described by `req`; returns its manifest."""
    req.normalised()
    t_start = time.perf_counter()
    if req.backend == "tensorrt":
        from phyai_edge.engines.tensorrt import check_precision_on_gpu, import_tensorrt

        import_tensorrt()  # fail before any work when TensorRT is absent
        check_precision_on_gpu(req.precision)  # ... or has no kernels for the precision on this GPU
    out = Path(req.out)
    if out.exists() and not out.is_dir():
        raise BundleError(f"--out {out}: a file, not a folder")
    if not out.name or out.name in (".", ".."):
        raise BundleError(f"--out {out}: name the bundle's own folder, e.g. engines/mytask")
    if out.exists() and any(out.iterdir()):
        if not req.overwrite:
            raise BundleError(f"{out} already exists; pass --overwrite to replace it")
        if not (out / "manifest.json").exists():
            raise BundleError(f"--overwrite: {out} is not an engine bundle (no manifest.json); it is left as it is")
    if adapter is None:
        from phyai_edge.adapters import load_adapter

        adapter = load_adapter(req.adapter, req.adapter_options, checkpoint=req.checkpoint, preset_name=req.preset,
                               device="cpu", tokenizer=req.tokenizer, seed=req.seed)
    views = _set_views(adapter, req.views)
    if req.steps is not None:
        if req.steps < 1:
            raise ValueError("--steps must be at least 1")
        adapter.solver = SolverSpec(req.steps)
    adapter.module.float().eval().requires_grad_(False)
    progress = Progress(req.progress, echo)

    work = out.with_name(f".{out.name}.partial-{os.getpid()}")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    try:
        manifest = _build(req, adapter, views, work, progress, echo)
        manifest["export_seconds"] = round(time.perf_counter() - t_start, 2)
        write_manifest(work, manifest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    failed = manifest["validation"].get("status") == "failed"
    if failed and out.exists() and any(out.iterdir()):
        # A bundle that fails never replaces one in place (which may be the robot's): it goes beside it.
        beside = out.with_name(f"{out.name}.failed-validation")
        shutil.rmtree(beside, ignore_errors=True)
        os.replace(work, beside)
        echo(f"validation failed: the new bundle is in {beside}; {out} is unchanged")
        out = beside
    elif out.exists():
        # Swapped by renames, the old bundle removed last: a kill in between leaves one of the two.
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(work, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(work, out)
    echo(summary_table(manifest, out))
    return manifest


def _build(req: ExportRequest, adapter: Adapter, views: int, work: Path, progress: Progress,
           echo: Callable[[str], None]) -> dict[str, Any]:
    here = Platform.current(req.device)
    include_weights = req.backend == "cudagraph"
    dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "bfloat16"}.get(req.precision, "float32")
    (work / "checkpoint").mkdir()
    # In the engine's own precision: half the bytes to hash, read and move at every start of a
    # bf16 / fp16 engine, and bit-identical to what it would cast the float32 weights to.
    with progress.phase("checkpoint", ["weights" if include_weights else "metadata"], unit="step") as done:
        weight_dtype = write_checkpoint(adapter, work / "checkpoint", include_weights, dtype)
        done("written")
    if req.checkpoint is not None and weight_files(Path(req.checkpoint)):
        ck_hash, ck_source = checkpoint_sha256(req.checkpoint), str(Path(req.checkpoint).resolve())
    else:
        ck_hash, ck_source = tensor_sha256(adapter.module), builtin_source(req.preset, req.seed)

    calib_obs, held_out, calib_source = _calibration(req, adapter, echo)
    stage_names = adapter.stage_names()
    timings: dict[str, float] = {}
    calibration_info: dict[str, Any] | None = None
    stage_precision = dict.fromkeys(stage_names, req.precision)
    artefacts: dict[str, Any] = {}

    if req.backend == "onnxruntime":
        artefacts["onnx"] = _export_onnx(req, adapter, views, work, calib_obs, progress, timings)
    elif req.backend == "tensorrt":
        artefacts["tensorrt"] = _export_tensorrt(req, adapter, views, work, calib_obs, progress, timings)
    if req.precision == "fp8":
        with progress.phase("fp8 calibration", ["scales"], unit="step") as done:
            calibration_info = _fp8_scales(adapter, work, calib_obs, held_out, req)
            done("scales")
        if req.backend == "cudagraph":
            artefacts["fp8_scales"] = "calibration/fp8_scales.safetensors"
            # The scope's stages run fp8 linears; the rest of the engine runs in its dtype.
            fp8_stages = calibration_info["fp8_stages"]
            stage_precision = {n: "fp8" if n in fp8_stages else "bf16" for n in stage_names}

    specs = {}
    from phyai_edge.engines.onnx_export import export_ready

    with export_ready(adapter, _typed(req.precision)) as twin:
        for b in req.batch_sizes:
            specs[str(b)] = _spec_json(twin.stage_specs(b, views))

    manifest: dict[str, Any] = {
        "format": FORMAT,
        "name": Path(req.out).name,
        "created": now_iso(),
        "adapter": {"name": adapter.name, "preset": getattr(getattr(adapter, "cfg", None), "preset", req.preset),
                    "camera_names": list(adapter.camera_names), "state_dim": getattr(adapter, "state_dim", None),
                    "action_dim": adapter.action_dim, "chunk_size": adapter.chunk_size,
                    "model_action_dim": adapter.model_action_dim},
        "checkpoint": {"source": ck_source, "sha256": ck_hash, "weights_included": include_weights,
                       "folder": "checkpoint", **({"weight_dtype": weight_dtype} if weight_dtype else {})},
        "backend": req.backend,
        "dtype": dtype,
        "precision": stage_precision,
        "batch_sizes": req.batch_sizes,
        "views": views,
        "steps": adapter.solver.num_steps,
        "stages": specs,
        "artefacts": artefacts,
        "target": {**here.describe(), "device": req.device},
        "versions": here.versions,
        "build_seconds": {k: round(v, 3) for k, v in timings.items()},
        # The fp8 report carries the source too: a bundle calibrated on synthetic samples must say so.
        "calibration": {**calibration_info, "source": calib_source} if calibration_info is not None else (
            {"source": calib_source, "samples": len(calib_obs), "held_out": len(held_out)} if calib_source else None),
    }
    if req.precision == "fp8" and req.backend == "cudagraph":
        # What the loader converts (engines/bundle.py cudagraph_fp8_options): these linears, these
        # scales, static activation scales from the same calibration.
        manifest["fp8"] = {"scope": req.fp8_scope, "scales": "calibration/fp8_scales.safetensors",
                           "activations": "static", "format": "e4m3fn, per-tensor"}
    manifest["validation"] = _validate(req, adapter, work, manifest, held_out, progress, echo)
    if req.precision in ("int8", "fp8") and req.backend == "onnxruntime":
        manifest["calibration"] = {**(manifest["calibration"] or {}), "source": calib_source,
                                   "report": manifest["validation"].get("calibrated")}
    if manifest["calibration"]:
        import json

        (work / "calibration").mkdir(exist_ok=True)
        (work / "calibration" / "report.json").write_text(json.dumps(manifest["calibration"], indent=2))
    return manifest


def _calibration(req: ExportRequest, adapter: Adapter,
                 echo: Callable[[str], None]) -> tuple[list[Observation], list[Observation], str | None]:
    """(calibration observations, held-out observations, source). Held-out ones also serve
    as validation samples; without a calibration set they are synthetic."""
    from phyai_edge.calibration import load_calibration_set, synthetic_observations

    needs = req.precision in ("int8", "fp8")
    source = req.calibration
    if needs and source is None:
        echo(f"note: {req.precision} needs calibration data; using synthetic observations")
        source = "synthetic"
    if needs and str(source) == "synthetic":
        # Asked for or defaulted to, the scales then fit random images, uniform states and stock
        # prompts, not the robot's inputs, and the accuracy report is measured on the same kind of
        # samples, so a good number there says nothing about the robot.
        echo(f"WARNING: {req.precision} scales from synthetic observations are not the robot's activation "
             "ranges, and the accuracy report below is measured on synthetic samples too: calibrate with "
             "--calibration DIR (a `phyai-edge run --record` folder or a LeRobot dataset) before deploying")
    n_val = max(req.holdout, max(req.batch_sizes))
    if source is None:
        return [], synthetic_observations(adapter, n_val, seed=req.seed + 1000), None
    cset = load_calibration_set(source, adapter, limit=req.calibration_samples + req.holdout, seed=req.seed)
    calib, held = cset.split(req.holdout)
    if len(calib) < req.calibration_samples:
        echo(f"note: {cset.source} gave {len(calib)} calibration sample(s) of the {req.calibration_samples} asked "
             f"({len(held)} more held out for the accuracy report)")
    if not held:
        echo("note: no sample left to hold out; the accuracy report uses synthetic observations")
        held = synthetic_observations(adapter, n_val, seed=req.seed + 1000)
    return calib, held, cset.source


def _calibration_seed(req: ExportRequest) -> int:
    """The seed of the noise calibration runs the solver from. Not `req.seed`, which the accuracy
    report draws the held-out samples' noise with: x_t at t = 1 is that noise, and a scale set on
    it would make the held-out inputs partly calibration ones."""
    return req.seed + 2000


def _export_onnx(req: ExportRequest, adapter: Adapter, views: int, work: Path, calib: list[Observation],
                 progress: Progress, timings: dict[str, float]) -> dict[str, Any]:
    from phyai_edge.engines.onnx_export import export_ready, export_stage
    from phyai_edge.engines.onnxrt import stage_file

    quantised = req.precision in ("int8", "fp8")
    files: dict[str, dict[str, str]] = {}
    with export_ready(adapter, _typed(req.precision)) as twin:
        for b in req.batch_sizes:
            samples = None
            if quantised:
                from phyai_edge.engines.stage_inputs import collect_stage_inputs

                samples = collect_stage_inputs(adapter, calib, batch_size=b, seed=_calibration_seed(req))
            specs = twin.stage_specs(b, views)
            with progress.phase(f"onnx b{b} {req.precision}", [s.name for s in specs]) as done:
                for spec in specs:
                    t0 = time.perf_counter()
                    dst = stage_file(work / "onnx", b, spec.name)
                    if quantised:
                        from phyai_edge.calibration.ort_quant import float32_weights, quantize_stage

                        src = export_stage(twin.module, spec, work / ".tmp" / f"b{b}" / f"{spec.name}.onnx")
                        quantize_stage(src, dst, samples[spec.name], kind=req.precision,
                                       keep_float=float32_weights(twin.module))
                    else:
                        export_stage(twin.module, spec, dst)
                    timings[f"b{b}/{spec.name}"] = time.perf_counter() - t0
                    files.setdefault(str(b), {})[spec.name] = dst.relative_to(work).as_posix()
                    done(spec.name)
    shutil.rmtree(work / ".tmp", ignore_errors=True)
    # What the files declare, not the export's own opset: the float8 quantiser raises it to 19, which
    # needs a newer onnxruntime than the 17 that was recorded for every bundle.
    return {"files": files, "opset": max(_onnx_opset(work / rel) for per_b in files.values() for rel in per_b.values())}


def _onnx_opset(path: Path) -> int:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _export_tensorrt(req: ExportRequest, adapter: Adapter, views: int, work: Path, calib: list[Observation],
                     progress: Progress, timings: dict[str, float]) -> dict[str, Any]:
    from phyai_edge.engines.tensorrt import BuildOptions, build_for_adapter

    calibration = None
    if req.precision in ("int8", "fp8"):
        from phyai_edge.engines.stage_inputs import collect_stage_inputs

        calibration = collect_stage_inputs(adapter, calib, batch_size=req.batch_sizes[0],
                                           seed=_calibration_seed(req))
    options = BuildOptions(precision=req.precision, int8_mode=req.int8_mode, timing_cache=req.timing_cache,
                           workspace_bytes=int(req.workspace_gb * (1 << 30)) if req.workspace_gb else None)
    t0 = time.perf_counter()
    last = [t0]

    with progress.phase(f"tensorrt {req.precision}", adapter.stage_names()) as done:
        def on_stage(name: str) -> None:
            now = time.perf_counter()
            timings[name] = now - last[0]
            last[0] = now
            done(name)

        meta = build_for_adapter(adapter, work / "trt", req.batch_sizes, views, options, calibration,
                                 on_stage=on_stage)
    if req.timing_cache is not None and Path(req.timing_cache).exists():
        shutil.copyfile(req.timing_cache, work / "trt" / "timing.cache")
    return {"plans": {s: f"trt/{s}.plan" for s in meta["stages"]}, "build": meta}


def _fp8_scales(adapter: Adapter, work: Path, calib: list[Observation], held: list[Observation],
                req: ExportRequest) -> dict[str, Any]:
    """Per-tensor fp8 scales from the calibration set, and their fake-quantised accuracy. For a
    cudagraph bundle, also `fp8_stages`: the stages that call a linear of the fp8 scope (the others
    run in bf16), seen by running them, so no adapter has to declare which modules a stage uses."""
    from phyai_edge.calibration.fp8 import collect_amax, fake_fp8, save_scales, scales_from_amax
    from phyai_edge.engines.accuracy import compare_engines, reference_engine
    from phyai_edge.engines.stage_inputs import collect_stage_inputs
    from phyai_edge.layers.fp8 import SCOPES

    current = [""]
    stage_linears: dict[str, set[str]] = {}
    amax = collect_amax(
        adapter.module,
        lambda: collect_stage_inputs(adapter, calib, seed=_calibration_seed(req), denoise_every=1,
                                     on_stage=lambda name: current.__setitem__(0, name)),
        on_call=lambda linear: stage_linears.setdefault(current[0], set()).add(linear),
    )
    scales = scales_from_amax(amax)
    save_scales(work / "calibration" / "fp8_scales.safetensors", scales, {"samples": len(calib)})
    from phyai_edge.engines.eager import EagerEngine

    ref = reference_engine(adapter, "float32")
    twin = copy.copy(adapter)  # fake-quantise a copy: the reference must keep its float32 weights
    twin.module = copy.deepcopy(adapter.module)
    with fake_fp8(twin.module, scales):
        err = compare_engines(adapter, EagerEngine(twin, dtype="float32"), ref, held, seed=req.seed)
    info = {"fp8_scales": "calibration/fp8_scales.safetensors", "linears": len(scales), "samples": len(calib),
            "held_out": len(held), "fake_fp8_vs_fp32": err}
    if req.backend == "cudagraph":
        # What the bundle will run, through the fp8 layers' plain-torch reference path on the CPU:
        # bf16 compute, the scoped linears in E4M3 with these scales (static activation scales).
        from phyai_edge.engines.cudagraph import CudaGraphEngine

        twin = copy.copy(adapter)
        twin.module = copy.deepcopy(adapter.module)
        eng = CudaGraphEngine(twin, device="cpu", dtype="bfloat16", seed=req.seed, fp8=req.fp8_scope,
                              fp8_scales=scales, fp8_activations="static")
        info["fp8_engine"] = {"scope": req.fp8_scope, "linears": eng.fp8_linears, "path": "reference (cpu)"}
        info["fp8_engine_vs_fp32"] = compare_engines(adapter, eng, ref, held, seed=req.seed)
        del eng, twin
        roots = SCOPES[req.fp8_scope]
        info["fp8_stages"] = [stage for stage in adapter.stage_names()
                              if any(linear == root or linear.startswith(root + ".")
                                     for linear in stage_linears.get(stage, ()) for root in roots)]
    return info


def _validate(req: ExportRequest, adapter: Adapter, work: Path, manifest: dict[str, Any], held: list[Observation],
              progress: Progress, echo: Callable[[str], None]) -> dict[str, Any]:
    """The bundle's own engine against float32 eager on held-out samples, per batch size."""
    if not req.validate:
        return {"status": "skipped", "reason": "--no-validate"}
    dev = torch.device(req.device)
    if req.backend in ("tensorrt", "cudagraph") and dev.type != "cuda":
        return {"status": "skipped", "reason": f"{req.backend} engines need a CUDA device; none here"}
    from phyai_edge.engines.accuracy import compare_engines, reference_engine

    tol = TOLERANCE[req.precision]
    result: dict[str, Any] = {"reference": "eager float32 (fp64 time embedding)", "tolerance": tol,
                              "samples": len(held), "per_batch": {}}
    # Load exactly as a robot will (but before the manifest exists, so no hash checks).
    engine = _engine_for(req, work, manifest, adapter)
    ref = reference_engine(adapter, "float32", device=req.device)
    worst = 0.0
    # At full size each batch size is a capture (cudagraph) and a float32 reference run per held-out
    # sample: minutes, after the build's own bars have closed.
    with progress.phase(f"validate {req.precision}", [f"b{b}" for b in req.batch_sizes], unit="batch") as done:
        for b in req.batch_sizes:
            err = compare_engines(adapter, engine, ref, held, batch_size=b, seed=req.seed)
            result["per_batch"][str(b)] = err
            worst = max(worst, err["max_abs_error"])
            done(f"b{b}")
    result["max_abs_error"] = worst
    result["status"] = "passed" if worst <= tol else "failed"
    if req.precision in ("int8", "fp8"):
        bf16 = reference_engine(adapter, "bfloat16", device=req.device)
        result["calibrated"] = {
            "vs_fp32": result["per_batch"][str(req.batch_sizes[0])],
            "vs_bf16": compare_engines(adapter, engine, bf16, held, batch_size=req.batch_sizes[0], seed=req.seed),
            "bf16_vs_fp32": compare_engines(adapter, bf16, ref, held, batch_size=req.batch_sizes[0], seed=req.seed),
        }
    if result["status"] == "failed":
        echo(f"WARNING: validation failed: max |error| {worst:.3g} exceeds {tol:g} for {req.precision}")
    return result


def _engine_for(req: ExportRequest, work: Path, manifest: dict[str, Any], adapter: Adapter) -> Any:
    from phyai_edge.engines.bundle import bundle_adapter

    bundle_ad = bundle_adapter(work, manifest) if not manifest["checkpoint"]["weights_included"] else adapter
    if req.backend == "onnxruntime":
        from phyai_edge.engines.onnxrt import OnnxRuntimeEngine

        return OnnxRuntimeEngine(bundle_ad, device=req.device, seed=req.seed, model_dir=work / "onnx",
                                 batch_sizes=req.batch_sizes, num_views=manifest["views"])
    if req.backend == "tensorrt":
        from phyai_edge.engines.tensorrt import TensorRTEngine

        return TensorRTEngine(bundle_ad, device=req.device, seed=req.seed, plan_dir=work / "trt",
                              batch_sizes=req.batch_sizes, num_views=manifest["views"])
    from phyai_edge.engines import make_engine

    # Its own copy of the model: the cudagraph engine casts and fuses the weights it runs, and the
    # float32 reference it is validated against must keep the originals.
    from phyai_edge.engines.bundle import cudagraph_fp8_options

    twin = copy.copy(adapter)
    twin.module = copy.deepcopy(adapter.module)
    return make_engine("cudagraph", twin, device=req.device, dtype=manifest["dtype"], seed=req.seed,
                       **cudagraph_fp8_options(work, manifest))


def summary_table(manifest: dict[str, Any], out: Path) -> str:
    rows = [("file", "bytes", "sha256")]
    for rel, info in sorted(manifest["files"].items()):
        rows.append((rel, f"{info['bytes']:,}", info["sha256"][:12]))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"bundle {out}  backend={manifest['backend']}  precision={manifest['dtype'] if manifest['backend'] == 'cudagraph' else next(iter(manifest['precision'].values()))}"
             f"  batch={manifest['batch_sizes']}  views={manifest['views']}  steps={manifest['steps']}"]
    lines += [f"  {r[0]:<{w0}}  {r[1]:>{w1}}  {r[2]}" for r in rows]
    if manifest.get("build_seconds"):
        lines.append("  build: " + ", ".join(f"{k} {v:.2f}s" for k, v in manifest["build_seconds"].items()))
    v = manifest.get("validation", {})
    if v.get("status") in ("passed", "failed"):
        lines.append(f"  validation vs eager fp32: {v['status']}  max |error| {v['max_abs_error']:.3g} "
                     f"(tolerance {v['tolerance']:g}, {v['samples']} held-out samples)")
        cal = v.get("calibrated")
        if cal:
            lines.append(f"  calibrated accuracy: vs bf16 max {cal['vs_bf16']['max_abs_error']:.3g} "
                         f"rel-RMSE {cal['vs_bf16']['relative_rmse']:.3g}; vs fp32 rel-RMSE "
                         f"{cal['vs_fp32']['relative_rmse']:.3g} (bf16 itself vs fp32: "
                         f"{cal['bf16_vs_fp32']['relative_rmse']:.3g})")
    else:
        lines.append(f"  validation: {v.get('status')} ({v.get('reason', '')})")
    c = manifest.get("calibration") or {}
    if c.get("source") == "synthetic" and set(manifest["precision"].values()) & {"int8", "fp8"}:
        lines.append("  calibration: synthetic observations, not the robot's: re-export with --calibration DIR "
                     "before deploying")
    if "fake_fp8_vs_fp32" in c:
        f = c["fake_fp8_vs_fp32"]
        lines.append(f"  fp8 scales ({c['linears']} linears, {c['samples']} samples): fake-fp8 eager vs fp32 "
                     f"max {f['max_abs_error']:.3g} rel-RMSE {f['relative_rmse']:.3g}")
    if "fp8_engine_vs_fp32" in c:
        f, e = c["fp8_engine_vs_fp32"], c["fp8_engine"]
        lines.append(f"  fp8 engine ({e['scope']}: {e['linears']} linears, {e['path']}) vs fp32 "
                     f"max {f['max_abs_error']:.3g} rel-RMSE {f['relative_rmse']:.3g}")
    lines.append(f"  export took {manifest.get('export_seconds', 0):.1f}s")
    return "\n".join(lines)
