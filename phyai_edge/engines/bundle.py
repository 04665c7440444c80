"""Engine bundles on disk: `engines/<name>/manifest.json` plus everything needed to run.

Layout (paths are relative to the bundle folder and listed, with hashes, in the manifest):

    manifest.json               what was built, for what, by what, and how well it matched eager
    checkpoint/                 native adapter metadata: phyai_edge.json, norm_stats.json,
                                tokenizer.json; plus model.safetensors for backends that need
                                the weights at load time (cudagraph), stored in the dtypes the
                                engine runs them in (manifest checkpoint.weight_dtype)
    onnx/b<B>/<stage>.onnx      static-shape ONNX per batch size (onnxruntime backend; a TensorRT
                                bundle is built from batch-dynamic ONNX it does not keep)
    trt/<stage>.plan            serialised TensorRT engines, one profile per batch size
    trt/timing.cache            the TensorRT timing cache the build used and extended
    calibration/                int8 cache, fp8 scales, the calibration report

Integrity. Every file is hashed with a block-parallel SHA-256 (`sha256-b64m`: SHA-256 over the
SHA-256 digests of consecutive 64 MiB blocks), so a 12 GB bundle verifies at disk speed on many
cores instead of one core's hashing speed: a robot restarted by systemd waits for this. The
manifest carries `manifest_sha256`, the SHA-256 of its own canonical JSON without that field,
so an edited manifest is refused just like an edited file.

Loading refuses (BundleError, with the reason) a bundle whose manifest is edited, any file
missing or failing its hash, whose checkpoint hash differs from a checkpoint given to compare
against, whose GPU compute capability differs from this machine's (TensorRT plans are
architecture-specific), or whose TensorRT version differs from the installed one.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import platform
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FORMAT = "phyai-edge/bundle/1"
MANIFEST = "manifest.json"
HASH_ALGO = "sha256-b64m"
BLOCK = 64 << 20
# Backends whose artefacts only run on the GPU architecture (and TensorRT version) they were
# built with. ONNX files and checkpoint weights are portable.
ARCH_BOUND = {"tensorrt"}


class BundleError(RuntimeError):
    """A bundle that must not be loaded here. The message says why and what to do."""


# -- hashing ------------------------------------------------------------------------------
def _block_digest(path: Path, offset: int, length: int) -> bytes:
    h = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(offset)
        left = length
        while left > 0:
            buf = f.read(min(left, 8 << 20))
            if not buf:
                break
            h.update(buf)
            left -= len(buf)
    return h.digest()


def hash_files(paths: list[Path], workers: int | None = None) -> dict[Path, str]:
    """`sha256-b64m` of each file, all blocks of all files hashed in parallel (hashlib
    releases the GIL, so threads scale with cores and disk)."""
    jobs: list[tuple[Path, int, int]] = []
    for p in paths:
        size = p.stat().st_size
        jobs.extend((p, off, min(BLOCK, size - off)) for off in range(0, max(size, 1), BLOCK))
    workers = workers or min(32, (os.cpu_count() or 2) * 2)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        digests = list(pool.map(lambda j: _block_digest(*j), jobs))
    per_file: dict[Path, hashlib._Hash] = {p: hashlib.sha256() for p in paths}
    for (p, _, _), d in zip(jobs, digests):
        per_file[p].update(d)
    return {p: h.hexdigest() for p, h in per_file.items()}


def weight_files(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("model*.safetensors"))


def checkpoint_sha256(folder: str | Path) -> str:
    """One hash for a checkpoint's weights: SHA-256 over `name:hash` lines of its
    model*.safetensors files (each hashed as `sha256-b64m`)."""
    files = weight_files(Path(folder))
    if not files:
        raise BundleError(f"no model*.safetensors in {folder} to hash")
    hashes = hash_files(files)
    lines = "".join(f"{p.name}:{hashes[p]}\n" for p in files)
    return hashlib.sha256(lines.encode()).hexdigest()


def canonical(manifest: dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """Set manifest_sha256 over everything else (call last, after every edit)."""
    manifest["manifest_sha256"] = hashlib.sha256(canonical(manifest)).hexdigest()
    return manifest


def write_manifest(bundle: Path, manifest: dict[str, Any]) -> Path:
    """Hash every file in the bundle into the manifest, seal it, and write it."""
    bundle = Path(bundle)
    files = sorted(p for p in bundle.rglob("*") if p.is_file() and p.name != MANIFEST)
    hashes = hash_files(files)
    manifest["hash_algorithm"] = HASH_ALGO
    manifest["files"] = {p.relative_to(bundle).as_posix(): {"bytes": p.stat().st_size, "sha256": hashes[p]}
                         for p in files}
    seal(manifest)
    path = bundle / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False))
    os.replace(tmp, path)  # a crash mid-write never leaves a half manifest
    return path


# -- the machine --------------------------------------------------------------------------
@dataclass
class Platform:
    """What this machine offers that a bundle may depend on."""

    cuda_available: bool = False
    gpu_name: str | None = None
    compute_capability: str | None = None
    versions: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def current(cls, device: str | torch.device | None = None) -> Platform:
        import importlib.metadata as md

        import torch

        def version(pkg: str) -> str | None:
            try:
                return md.version(pkg)
            except md.PackageNotFoundError:
                return None

        versions = {
            "phyai_edge": version("phyai-edge"),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "onnx": version("onnx"),
            "onnxruntime": version("onnxruntime") or version("onnxruntime-gpu"),
            "tensorrt": _tensorrt_version(),
        }
        p = cls(versions=versions)
        if torch.cuda.is_available():
            dev = torch.device(device) if device is not None and torch.device(device).type == "cuda" else torch.device("cuda")
            idx = dev.index if dev.index is not None else torch.cuda.current_device()
            major, minor = torch.cuda.get_device_capability(idx)
            p.cuda_available = True
            p.gpu_name = torch.cuda.get_device_name(idx)
            p.compute_capability = f"{major}.{minor}"
        return p

    def describe(self) -> dict[str, Any]:
        return {"machine": platform.machine(), "system": platform.system(), "cuda_available": self.cuda_available,
                "gpu_name": self.gpu_name, "compute_capability": self.compute_capability}


def _tensorrt_version() -> str | None:
    # Importing tensorrt is slow and loads CUDA libraries: the package metadata first (pip wheels).
    import importlib
    import importlib.metadata as md
    import importlib.util

    for pkg in ("tensorrt", "tensorrt-cu12", "tensorrt-cu13", "tensorrt_libs"):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            continue
    mod = sys.modules.get("tensorrt")
    if mod is None and importlib.util.find_spec("tensorrt") is not None:
        # Installed without pip metadata (a Jetson's apt package python3-libnvinfer may be): the
        # module itself says, or a TensorRT bundle would be refused as "TensorRT is not installed".
        try:
            mod = importlib.import_module("tensorrt")
        except Exception as exc:  # present but broken (missing CUDA libraries): say so as absent
            log.warning("tensorrt is present but does not import (%s: %s)", type(exc).__name__, exc)
            return None
    return getattr(mod, "__version__", None) if mod is not None else None


# -- reading and checking -----------------------------------------------------------------
def read_manifest(bundle: str | Path) -> dict[str, Any]:
    """The parsed manifest, after checking its own hash (no file hashes: see verify_bundle)."""
    bundle = Path(bundle)
    path = bundle / MANIFEST
    if not bundle.is_dir():
        raise BundleError(f"bundle folder not found: {bundle}")
    if not path.exists():
        raise BundleError(f"{bundle} has no {MANIFEST}: not an engine bundle (export one with `phyai-edge export`)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BundleError(f"{path} is not valid JSON ({exc}); the bundle is damaged: re-export it") from exc
    if not isinstance(manifest, dict):
        raise BundleError(f"{path} is not a JSON object (it holds a {type(manifest).__name__}); "
                          "the bundle is damaged: re-export it")
    fmt = manifest.get("format")
    if fmt != FORMAT:
        raise BundleError(f"{path}: format {fmt!r}, this phyai-edge reads {FORMAT!r}; " + _format_advice(fmt))
    want = manifest.get("manifest_sha256")
    got = hashlib.sha256(canonical(manifest)).hexdigest()
    if want != got:
        raise BundleError(
            f"{path} was edited after export (its content hash is {got[:16]}..., the manifest records "
            f"{str(want)[:16]}...); a hand-edited manifest can describe files it does not match: re-export the bundle"
        )
    _check_required(path, manifest)
    return manifest


# What every loader reads, by type. A sealed manifest without them was not written by
# `write_manifest` (or was re-sealed by hand): refused here with the field named, not as a
# KeyError later, and an empty file list would otherwise make the hash check vouch for nothing.
_REQUIRED: dict[str, type] = {"backend": str, "checkpoint": dict, "files": dict}


def _check_required(path: Path, manifest: dict[str, Any]) -> None:
    for key, kind in _REQUIRED.items():
        if not isinstance(manifest.get(key), kind):
            raise BundleError(f"{path}: field {key!r} is missing or not a {kind.__name__}; "
                              "the manifest was not written by `phyai-edge export`: re-export the bundle")
    if not manifest["files"]:
        raise BundleError(f"{path}: field 'files' lists no files, so nothing in the bundle can be checked; "
                          "re-export the bundle")


def _format_advice(fmt: Any) -> str:
    """What to do about a bundle format this phyai-edge does not read: a later version of ours
    was written by a newer phyai-edge (re-exporting with this one is the other way out)."""
    family, _, version = FORMAT.rpartition("/")
    if isinstance(fmt, str) and fmt.startswith(family + "/"):
        theirs = fmt.removeprefix(family + "/")
        if theirs.isdigit() and int(theirs) > int(version):
            return ("it was written by a newer phyai-edge: upgrade phyai-edge here, or re-export the bundle "
                    "with this version")
    return "re-export the bundle with this version"


def check_files(bundle: Path, manifest: dict[str, Any]) -> None:
    files: dict[str, dict[str, Any]] = manifest.get("files", {})
    if manifest.get("hash_algorithm") != HASH_ALGO:
        raise BundleError(f"unknown hash algorithm {manifest.get('hash_algorithm')!r} (expected {HASH_ALGO})")
    missing = [rel for rel in files if not (bundle / rel).is_file()]
    if missing:
        raise BundleError(f"bundle {bundle} is missing {len(missing)} file(s): {', '.join(sorted(missing)[:8])}")
    wrong_size = [rel for rel, info in files.items() if (bundle / rel).stat().st_size != info["bytes"]]
    if wrong_size:
        raise BundleError(f"bundle {bundle}: file(s) changed size since export: {', '.join(sorted(wrong_size)[:8])}")
    paths = {bundle / rel: rel for rel in files}
    hashes = hash_files(list(paths))
    bad = [rel for p, rel in paths.items() if hashes[p] != files[rel]["sha256"]]
    if bad:
        raise BundleError(f"bundle {bundle}: file(s) fail their hash (damaged or replaced): {', '.join(sorted(bad)[:8])}")


def check_platform(manifest: dict[str, Any], here: Platform, device: str | torch.device) -> None:
    import torch

    backend = manifest["backend"]
    target = manifest.get("target", {})
    dev = torch.device(device)
    if (backend in ARCH_BOUND or backend == "cudagraph") and dev.type != "cuda":
        raise BundleError(f"a {backend} bundle runs on a CUDA device, not {dev} (--device cuda, device='cuda')")
    if backend in ARCH_BOUND:
        want = target.get("compute_capability")
        if not here.cuda_available:
            raise BundleError(f"bundle was built for {target.get('gpu_name')} (compute capability {want}); "
                              "this machine has no CUDA GPU")
        if want != here.compute_capability:
            raise BundleError(
                f"GPU architecture differs: bundle built for {target.get('gpu_name')} (compute capability {want}), "
                f"this machine has {here.gpu_name} (compute capability {here.compute_capability}); TensorRT "
                "engines only run on the architecture they were built for: re-export on this machine"
            )
        if target.get("gpu_name") != here.gpu_name:
            # Same architecture, so the plan loads; TensorRT tunes its tactics for the GPU model
            # it was built on (SM count, clocks, memory), and says to rebuild for another.
            log.warning("TensorRT bundle built on %s, running on %s (both compute capability %s): it runs, "
                        "but re-export on this GPU for its own tactics", target.get("gpu_name"), here.gpu_name, want)
        built = manifest.get("versions", {}).get("tensorrt")
        have = here.versions.get("tensorrt")
        if have is None:
            raise BundleError(f"bundle needs TensorRT {built} but TensorRT is not installed here")
        if built != have:
            raise BundleError(f"TensorRT version differs: bundle built with {built}, installed {have}; "
                              "serialised engines are tied to the exact version: re-export")


def builtin_source(preset: str, seed: int) -> str:
    """The manifest's `checkpoint.source` of weights built from a preset (no folder)."""
    return f"builtin:{preset}:seed={seed}"


def parse_builtin_source(source: str) -> tuple[str, int] | None:
    """(preset, seed) of a `builtin_source` string; None for a folder's path."""
    match = re.fullmatch(r"builtin:([^:]+):seed=(\d+)", source)
    return (match[1], int(match[2])) if match else None


def check_checkpoint(manifest: dict[str, Any], checkpoint: str | Path) -> None:
    source = str(manifest["checkpoint"].get("source", ""))
    if parse_builtin_source(source) is not None:
        # Its hash is of the preset's tensors, not of checkpoint files: no folder can match it, and
        # "hash differs" would wrongly suggest the folder holds other weights.
        raise BundleError(f"this bundle was exported from a built-in preset ({source}), not from a checkpoint "
                          f"folder, so {checkpoint} cannot be checked against it: load the bundle without a "
                          "checkpoint, or re-export it from that folder")
    want = manifest["checkpoint"].get("sha256")
    got = checkpoint_sha256(checkpoint)
    if want != got:
        raise BundleError(f"checkpoint hash differs: bundle was exported from weights {str(want)[:16]}..., "
                          f"{checkpoint} has {got[:16]}...; re-export from this checkpoint")


def verify_bundle(
    bundle: str | Path,
    device: str | torch.device = "cpu",
    checkpoint: str | Path | None = None,
    here: Platform | None = None,
    check_hashes: bool = True,
    timings: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Every refusal check, cheapest first. Returns the manifest; `timings` gets `hash_s`."""
    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    t0 = time.perf_counter()
    if check_hashes:
        check_files(bundle, manifest)
    if timings is not None:
        timings["hash_s"] = time.perf_counter() - t0
    if checkpoint is not None:
        check_checkpoint(manifest, checkpoint)
    check_platform(manifest, here or Platform.current(device), device)
    check_validation(bundle, manifest)
    return manifest


def bundle_precision(manifest: dict[str, Any]) -> str | None:
    """"fp8" / "int8" for a bundle whose stages run quantised weights (the manifest's `precision`,
    stage -> precision, as the loader reads it; an fp8 bundle's `dtype` is "bfloat16", what its
    activations run in); None otherwise: the dtype says it."""
    precision = manifest.get("precision")
    values = {v for v in (precision.values() if isinstance(precision, dict) else [precision]) if isinstance(v, str)}
    if "fp8" in values or isinstance(manifest.get("fp8"), dict):
        return "fp8"
    return "int8" if "int8" in values else None


def validation_problem(bundle: Path, manifest: dict[str, Any]) -> str | None:
    """Why the bundle must not run on a robot by its export's validation (None if it may)."""
    v = manifest.get("validation") or {}
    if v.get("status") == "failed":
        return (f"{bundle} failed its validation at export ({_validation_summary(v)}): its actions are too far "
                "from the float32 model's to run on a robot; re-export (another precision, more calibration samples)")
    return None


def check_validation(bundle: Path, manifest: dict[str, Any]) -> None:
    """Refuse a bundle whose export found its actions too far from float32 eager's (`phyai-edge
    export` exits 1 and writes it for inspection, not for a robot); say so where it was never
    validated (a cudagraph bundle exported without a GPU)."""
    problem = validation_problem(bundle, manifest)
    if problem:
        raise BundleError(problem)
    v = manifest.get("validation") or {}
    status = v.get("status")
    if status not in (None, "passed"):
        log.warning("%s: not validated at export (%s); its actions were never compared with float32 eager's",
                    bundle, v.get("reason") or status)


def _validation_summary(v: dict[str, Any]) -> str:
    worst = v.get("max_abs_error")
    tol = v.get("tolerance")
    if isinstance(worst, (int, float)) and isinstance(tol, (int, float)):
        return f"max |error| {worst:.3g} over the tolerance {tol:g}"
    return "status failed"


# -- loading ------------------------------------------------------------------------------
def adapter_module(name: str) -> Any:
    """The module registered for adapter `name` (phyai_edge.adapters.ADAPTERS)."""
    import importlib

    from phyai_edge.adapters import ADAPTERS

    if name not in ADAPTERS:
        raise BundleError(f"bundle adapter {name!r} is not supported by this phyai-edge "
                          f"(known adapters: {sorted(ADAPTERS)})")
    return importlib.import_module(ADAPTERS[name])


def optional_kwargs(fn: Any, **options: Any) -> dict[str, Any]:
    """The `options` that `fn` names (or takes as **kwargs), for the optional keywords of the
    adapter module protocol: an adapter written before them still loads and saves."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(options)
    return {k: v for k, v in options.items() if k in params}


def bundle_adapter(bundle: Path, manifest: dict[str, Any], seed: int = 0, device: str | torch.device | None = None,
                   timings: dict[str, float] | None = None):
    """The adapter from the bundle's own checkpoint folder, with weights only when included.
    Read by the adapter's module (`load_bundle_adapter(folder, weights_included)`), which puts
    included weights on `device` if it takes one (else the engine moves them) and adds
    `read_s` / `to_device_s` to `timings` if it takes that."""
    name = manifest["adapter"]["name"]
    module = adapter_module(name)
    load = getattr(module, "load_bundle_adapter", None)
    if load is None:
        raise BundleError(f"adapter {name!r} cannot be loaded from a bundle: its module {module.__name__} "
                          "has no load_bundle_adapter(folder, weights_included)")
    from phyai_edge.adapters.base import SolverSpec

    options = {k: v for k, v in (("device", device), ("timings", timings)) if v is not None}
    adapter = load(bundle / "checkpoint", bool(manifest["checkpoint"].get("weights_included")),
                   **optional_kwargs(load, **options))
    adapter.solver = SolverSpec(int(manifest["steps"]))
    return adapter


def load_bundle_engine(bundle: str | Path, device: str | torch.device = "cpu", checkpoint: str | Path | None = None,
                       seed: int = 0, here: Platform | None = None, check_hashes: bool = True,
                       timings: dict[str, float] | None = None, **engine_kwargs: Any):
    """(adapter, engine, manifest) for a verified bundle.

    Logs one INFO line with where the time went (what a robot restarted by systemd waits
    before its first chunk, less imports and the first chunk itself), and puts the same numbers
    in `timings` if given: verify_s (manifest, hashes, platform: the first CUDA call is here),
    hash_s (the file hashes alone), read_s (weight headers, checks and mapping), to_device_s
    (weights copied to the device: the file's bytes are read here), adapter_s (the rest of the
    adapter: metadata, tokenizer, model skeleton), engine_s (the engine's construction: casts,
    fusion; CUDA graphs are captured at the first chunk), total_s.
    """
    import torch

    t0 = time.perf_counter()
    bundle = Path(bundle)
    verified: dict[str, float] = {}
    manifest = verify_bundle(bundle, device, checkpoint, here, check_hashes, timings=verified)
    t_verified = time.perf_counter()
    backend = manifest["backend"]
    weights: dict[str, float] = {}
    # Included weights (cudagraph) go straight to the engine's device, in the dtypes stored.
    adapter = bundle_adapter(bundle, manifest, seed, device=device if backend == "cudagraph" else None,
                             timings=weights)
    t_adapter = time.perf_counter()
    batches = manifest["batch_sizes"]
    if backend == "onnxruntime":
        from phyai_edge.engines.onnxrt import OnnxRuntimeEngine

        engine = OnnxRuntimeEngine(adapter, device=device, seed=seed, model_dir=bundle / "onnx",
                                   batch_sizes=batches, num_views=manifest["views"], **engine_kwargs)
    elif backend == "tensorrt":
        from phyai_edge.engines.tensorrt import TensorRTEngine

        engine = TensorRTEngine(adapter, device=device, seed=seed, plan_dir=bundle / "trt", batch_sizes=batches,
                                num_views=manifest["views"], **engine_kwargs)
    elif backend == "cudagraph":
        from phyai_edge.engines import make_engine

        # CUDA graphs cannot be serialised: the bundle holds the weights and the graphs are
        # captured here, once, before the first chunk. An fp8 bundle converts its linears here too,
        # with the scales stored in it.
        options = {**cudagraph_fp8_options(bundle, manifest), **engine_kwargs}
        engine = make_engine("cudagraph", adapter, device=device, dtype=manifest["dtype"], seed=seed, **options)
    else:
        raise BundleError(f"bundle backend {backend!r} is unknown to this phyai-edge")
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)  # the engine's casts and copies are queued, not done
    t_end = time.perf_counter()
    read_s, to_device_s = weights.get("read_s", 0.0), weights.get("to_device_s", 0.0)
    spent = {"verify_s": t_verified - t0, "hash_s": verified["hash_s"], "read_s": read_s, "to_device_s": to_device_s,
             "adapter_s": max(0.0, t_adapter - t_verified - read_s - to_device_s), "engine_s": t_end - t_adapter,
             "total_s": t_end - t0}
    files = manifest.get("files", {})
    weight_gb = sum(info["bytes"] for rel, info in files.items()
                    if rel.startswith("checkpoint/") and rel.endswith(".safetensors")) / 1e9
    included = manifest["checkpoint"].get("weights_included")
    stored = manifest["checkpoint"].get("weight_dtype", "float32") if included else None  # older bundles: float32
    log.info("bundle %s (%s) loaded in %.2f s: verify/hash %.2f s (%s), read weights %.2f s, to device %.2f s, "
             "adapter %.2f s, engine build %.2f s%s", bundle.name, backend, spent["total_s"], spent["verify_s"],
             f"hashes {spent['hash_s']:.2f} s" if check_hashes else "hashes not checked", read_s, to_device_s,
             spent["adapter_s"], spent["engine_s"], f" ({weight_gb:.2f} GB of {stored} weights to {device})" if stored else "")
    if timings is not None:
        timings.update(spent)
    return adapter, engine, manifest


def cudagraph_fp8_options(bundle: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """`CudaGraphEngine` keyword arguments for a cudagraph bundle exported with `--precision fp8`:
    which linears (`manifest["fp8"]["scope"]`), the bundle's calibrated per-tensor scales and the
    activation scaling. Bundles written before `fp8` was recorded convert the action expert."""
    if "fp8" not in set(manifest.get("precision", {}).values()):
        return {}
    info = manifest.get("fp8") or {}
    rel = info.get("scales") or manifest.get("artefacts", {}).get("fp8_scales")
    if not rel or not (Path(bundle) / rel).is_file():
        raise BundleError(f"fp8 bundle {bundle} has no fp8 scales file ({rel!r}); re-export it")
    from phyai_edge.calibration.fp8 import load_scales

    return {"fp8": info.get("scope", "expert"), "fp8_scales": load_scales(Path(bundle) / rel),
            "fp8_activations": info.get("activations", "static")}


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
