"""The TensorRT backend: stage engines built from ONNX, run with execute_async_v3, and the whole
denoise loop replayed as one CUDA graph.

UNVERIFIED: no machine this was written on has TensorRT. The code follows the TensorRT 10
Python API (Builder / NetworkDefinition / OnnxParser / BuilderConfig / Runtime /
IExecutionContext with named tensors); its logic is tested with a stand-in `tensorrt` module
and the ONNX it consumes is checked with onnxruntime, but a real build has not run. See
docs/export.md.

Build (`build_plans`): one serialised engine per stage from a batch-dynamic ONNX, with one
optimisation profile per requested batch size (min = opt = max, so each profile is as fast as
a static engine), a timing cache shared by every build (and kept on disk between exports), and
per precision:

    fp32 / fp16 / bf16  strongly typed network from an ONNX exported at that precision (the
                        norms, time MLP and action projections stay float32 inside it, as in
                        the eager model); TensorRT keeps the types it is given. TF32 (on by
                        default) is cleared for fp32 only
    int8                weakly typed network, INT8 + FP16 flags, `IInt8EntropyCalibrator2`
                        fed with the stage's recorded inputs (implicit quantisation), or, with
                        int8_mode="qdq", a strongly typed build of an explicitly quantised ONNX
    fp8                 strongly typed build of an explicitly quantised (Q/DQ) fp8 ONNX

Run (`TensorRTEngine`): one execution context per stage and batch size (each bound to its
profile), static torch buffers bound by name with set_tensor_address (stage outputs and the
next stage's inputs share one buffer), and the flow-matching loop of the shared solver captured
into a torch CUDA graph around the per-step execute_async_v3 calls.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from phyai_edge.adapters.base import Adapter, ModelInputs
from phyai_edge.engines.base import EngineBase
from phyai_edge.engines.eager import resolve_dtype
from phyai_edge.engines.onnxrt import exact_guidance_error
from phyai_edge.engines.rtc import RTCGuidance
from phyai_edge.engines.solver import integrate
from phyai_edge.engines.timing import StageTimer

log = logging.getLogger(__name__)

PLANS_META = "plans.json"
_PRECISION_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# The API written against: strongly typed networks and BuilderFlag.BF16 (neither is in 8.6), an
# explicit-batch network from create_network(0) (8.6 makes an implicit-batch one, which the ONNX
# parser refuses), named-tensor I/O. JetPack 6.0 ships TensorRT 8.6; 6.1 and later ship 10.
MIN_TENSORRT_MAJOR = 10


def import_tensorrt() -> Any:
    try:
        import tensorrt
    except ImportError as exc:
        raise RuntimeError(
            "TensorRT is not installed: on a Jetson it comes with JetPack (python3-libnvinfer), on a "
            "workstation `pip install tensorrt`; or export with --backend onnx / cudagraph"
        ) from exc
    version = str(getattr(tensorrt, "__version__", ""))
    major = version.split(".")[0]
    if major.isdigit() and int(major) < MIN_TENSORRT_MAJOR:
        raise RuntimeError(
            f"TensorRT {version} is installed; the tensorrt backend needs TensorRT {MIN_TENSORRT_MAJOR} or newer "
            "(on a Jetson: JetPack 6.1 or newer); or export with --backend onnx / cudagraph"
        )
    return tensorrt


def torch_dtype(trt: Any, dt: Any) -> torch.dtype:
    table = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT8": torch.int8,
             "INT32": torch.int32, "INT64": torch.int64, "BOOL": torch.bool, "UINT8": torch.uint8,
             "FP8": torch.float8_e4m3fn}
    for name, t in table.items():
        if hasattr(trt.DataType, name) and dt == getattr(trt.DataType, name):
            return t
    raise TypeError(f"TensorRT tensor type {dt} has no torch equivalent here")


# -- build --------------------------------------------------------------------------------
@dataclass
class BuildOptions:
    precision: str = "fp16"
    int8_mode: str = "calibrator"  # or "qdq": the ONNX already carries Q/DQ nodes
    workspace_bytes: int | None = None
    optimization_level: int = 3
    timing_cache: Path | None = None
    verbose: bool = False

    @property
    def strongly_typed(self) -> bool:
        # Implicit int8 calibration is the one case that needs a weakly typed network:
        # TensorRT picks int8 kernels itself from the calibrated ranges.
        return not (self.precision == "int8" and self.int8_mode == "calibrator")

    @property
    def tf32(self) -> bool:
        # BuilderFlag.TF32 is on in every new builder config, strongly typed or not, so float32
        # GEMMs round their inputs to 10 mantissa bits. An fp32 engine is the accurate
        # reference (validated to 1e-3 against eager float32): TF32 off. The float32 parts of
        # fp16 / bf16 / fp8 / int8 engines keep it, as the cudagraph engine does.
        return self.precision != "fp32"


def _logger(trt: Any, verbose: bool) -> Any:
    return trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.WARNING)


def _attach_timing_cache(config: Any, path: Path | None) -> None:
    """Give the build the cache at `path` (or an empty one). A cache file made on another GPU
    or TensorRT version is refused by set_timing_cache (it returns False and the config keeps
    no cache); timing it all again is only slower, so the build goes on with an empty cache,
    which then replaces the file."""
    data = b""
    if path is not None and Path(path).exists():
        data = Path(path).read_bytes()
    cache = config.create_timing_cache(data) if data else None
    if cache is not None and config.set_timing_cache(cache, False):
        return
    if data:
        log.warning("timing cache %s was made on another GPU or TensorRT version; starting an empty one", path)
    if not config.set_timing_cache(config.create_timing_cache(b""), False):
        log.warning("TensorRT refused an empty timing cache; building without one")


def build_engine(
    onnx_path: Path,
    plan_path: Path,
    input_shapes: dict[int, dict[str, tuple[int, ...]]],
    options: BuildOptions,
    calibrator: Any = None,
    trt: Any = None,
) -> dict[str, Any]:
    """Build one stage. input_shapes: batch size -> {input name: full static shape}; profile
    i is batch_sizes[i] in the order given. Returns what the manifest records of the build."""
    trt = trt or import_tensorrt()
    logger = _logger(trt, options.verbose)
    builder = trt.Builder(logger)
    flags = 0
    if options.strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    # parse_from_file (not parse(bytes)) so weights in an external-data file next to it load.
    if not parser.parse_from_file(str(onnx_path)):
        errors = "\n  ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}:\n  {errors}")
    config = builder.create_builder_config()
    if options.workspace_bytes:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_bytes)
    config.builder_optimization_level = options.optimization_level
    if not options.tf32:
        config.clear_flag(trt.BuilderFlag.TF32)
    if not options.strongly_typed:
        # Weakly typed (implicit int8): allow fp16 for layers TensorRT keeps out of int8.
        config.set_flag(trt.BuilderFlag.INT8)
        config.set_flag(trt.BuilderFlag.FP16)
    batch_sizes = list(input_shapes)
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    dynamic = any(-1 in tuple(t.shape) for t in inputs)
    profiles = []
    if dynamic:
        for b in batch_sizes:
            profile = builder.create_optimization_profile()
            for t in inputs:
                shape = tuple(input_shapes[b][t.name])
                profile.set_shape(t.name, shape, shape, shape)
            # add_optimization_profile answers -1 (and logs) for a profile that is not valid; unchecked,
            # the plan would lack this batch size and the runtime would fail on it much later.
            if config.add_optimization_profile(profile) < 0:
                raise RuntimeError(f"TensorRT refused the batch-{b} optimisation profile of {onnx_path.name}")
            profiles.append(profile)
    elif len(batch_sizes) > 1:
        raise ValueError(f"{onnx_path} has static shapes; several batch sizes need a batch-dynamic ONNX")
    if calibrator is not None:
        config.int8_calibrator = calibrator
        if profiles:
            # TensorRT calibrates at the calibration profile's opt shapes and reads that many bytes
            # from each pointer get_batch hands it: the profile must be the one of the batch size
            # the calibrator's buffers hold (another one would read past or short of them).
            calib_b = calibrator.get_batch_size()
            if calib_b not in batch_sizes:
                raise ValueError(f"the int8 calibrator feeds batch {calib_b}, but {onnx_path.name} gets profiles "
                                 f"for batches {batch_sizes} only")
            if not config.set_calibration_profile(profiles[batch_sizes.index(calib_b)]):
                raise RuntimeError(f"TensorRT refused the batch-{calib_b} calibration profile of {onnx_path.name}")
    _attach_timing_cache(config, options.timing_cache)
    serialized = builder.build_serialized_network(network, config)
    # TensorRT's Python calibrator bridge catches an exception raised in get_batch, prints it to
    # stderr and takes it as "no more batches", so the build may even succeed with missing or
    # partial int8 scales; the calibrator keeps what it raised and the build fails on it here.
    calib_error = getattr(calibrator, "error", None) if calibrator is not None else None
    if calib_error is not None:
        raise RuntimeError(f"int8 calibration of {onnx_path.name} failed: {calib_error!r}") from calib_error
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build {onnx_path.name} at {options.precision} (see the log above)")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_bytes(bytes(memoryview(serialized)))
    cache = config.get_timing_cache()
    if options.timing_cache is not None and cache is not None:
        Path(options.timing_cache).parent.mkdir(parents=True, exist_ok=True)
        Path(options.timing_cache).write_bytes(bytes(memoryview(cache.serialize())))
    return {"plan": plan_path.name, "strongly_typed": options.strongly_typed, "tf32": options.tf32, "profiles": batch_sizes if dynamic else [],
            "calibrated": calibrator is not None}


def build_plans(
    onnx_files: dict[str, Path],
    plan_dir: Path,
    shapes: dict[int, dict[str, dict[str, tuple[int, ...]]]],
    options: BuildOptions,
    calibrators: dict[str, Any] | None = None,
    on_stage: Callable[[str], None] | None = None,
    trt: Any = None,
) -> dict[str, Any]:
    """Every stage's plan into `plan_dir`, plus plans.json (batch order = profile order).
    shapes: batch -> stage -> input name -> shape."""
    plan_dir = Path(plan_dir)
    plan_dir.mkdir(parents=True, exist_ok=True)
    stages = {}
    for stage, onnx_path in onnx_files.items():
        per_batch = {b: shapes[b][stage] for b in shapes}
        stages[stage] = build_engine(onnx_path, plan_dir / f"{stage}.plan", per_batch, options,
                                     (calibrators or {}).get(stage), trt=trt)
        if on_stage is not None:
            on_stage(stage)
    meta = {"batch_sizes": list(shapes), "precision": options.precision, "int8_mode": options.int8_mode,
            "stages": stages}
    (plan_dir / PLANS_META).write_text(json.dumps(meta, indent=2))
    return meta


# -- run ----------------------------------------------------------------------------------
class _BatchState:
    """Contexts and static buffers for one batch size."""

    def __init__(self) -> None:
        self.contexts: dict[str, Any] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], torch.Tensor]] = {}


class TensorRTEngine(EngineBase):
    backend = "tensorrt"
    max_graphs = 16  # captured loops kept per batch size (one per RTC mode / guidance weight seen)

    def __init__(
        self,
        adapter: Adapter,
        device: str | torch.device = "cuda",
        dtype: str | torch.dtype = "float16",
        seed: int = 0,
        plan_dir: str | Path | None = None,
        batch_sizes: list[int] | tuple[int, ...] = (1,),
        num_views: int | None = None,
        cuda_graph: bool = True,
        build_options: BuildOptions | None = None,
    ) -> None:
        self.trt = import_tensorrt()
        super().__init__(adapter, device, seed)
        if self.device.type != "cuda":
            raise ValueError(f"the TensorRT engine runs on a CUDA device, not {self.device}")
        self.num_views = num_views or len(getattr(adapter, "camera_names", []))
        self.cuda_graph = cuda_graph
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if plan_dir is None:
            precision = _PRECISION_NAMES[resolve_dtype(dtype)]
            self._tmp = tempfile.TemporaryDirectory(prefix="phyai-trt-")
            plan_dir = Path(self._tmp.name)
            build_for_adapter(adapter, plan_dir, list(batch_sizes), self.num_views,
                              build_options or BuildOptions(precision=precision))
        self.plan_dir = Path(plan_dir)
        meta = json.loads((self.plan_dir / PLANS_META).read_text())
        self.batch_sizes = list(meta["batch_sizes"])
        self.logger = _logger(self.trt, False)
        self.runtime = self.trt.Runtime(self.logger)
        self.engines = {}
        for stage in adapter.stage_names():
            engine = self.runtime.deserialize_cuda_engine((self.plan_dir / f"{stage}.plan").read_bytes())
            if engine is None:
                raise RuntimeError(f"TensorRT could not deserialise {stage}.plan (built for another GPU or version?)")
            self.engines[stage] = engine
        self.stream = torch.cuda.Stream(self.device)
        self.states = {b: self._prepare(b) for b in self.batch_sizes}


    def _prepare(self, batch: int) -> _BatchState:
        trt = self.trt
        st = _BatchState()
        profile = self.batch_sizes.index(batch)
        specs = {s.name: s for s in self.adapter.stage_specs(batch, self.num_views)}
        for stage, engine in self.engines.items():
            ctx = engine.create_execution_context()
            if ctx is None:
                raise RuntimeError(f"TensorRT could not create an execution context for {stage} (out of GPU memory?)")
            # set_input_shape and set_tensor_address report failure by returning False (and a log
            # line), not by raising: unchecked, a refused shape surfaces later as a -1 dimension or
            # as buffers of the wrong size. The Python binding of set_optimization_profile_async
            # instead raises RuntimeError("Error in set optimization profile async.") on failure
            # (and otherwise returns True): both are turned into an error that names the plan.
            if engine.num_optimization_profiles > 1 or profile > 0:
                try:
                    switched = ctx.set_optimization_profile_async(profile, self.stream.cuda_stream)
                except RuntimeError:
                    switched = False
                if not switched:
                    raise RuntimeError(f"{stage}: TensorRT refused optimization profile {profile} (batch {batch}); "
                                       f"the plan has {engine.num_optimization_profiles}: re-export with this "
                                       "batch size")
            for name, (shape, _) in specs[stage].inputs.items():
                if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT and not ctx.set_input_shape(name, shape):
                    raise RuntimeError(f"{stage}: TensorRT refused set_input_shape({name}, {tuple(shape)}) "
                                       f"in profile {profile}: the plan does not fit this adapter: re-export")
            missing = ctx.infer_shapes()
            if missing:
                raise RuntimeError(f"{stage}: the plan has inputs this adapter does not give: {list(missing)}")
            for i in range(engine.num_io_tensors):
                name = engine.get_tensor_name(i)
                shape = tuple(ctx.get_tensor_shape(name))
                dtype = torch_dtype(trt, engine.get_tensor_dtype(name))
                buf = st.buffers.get(name)
                if buf is None:
                    buf = st.buffers[name] = torch.empty(shape, dtype=dtype, device=self.device)
                elif tuple(buf.shape) != shape or buf.dtype != dtype:
                    raise RuntimeError(f"{stage}: tensor {name} is {shape} {dtype} but the previous stage made "
                                       f"{tuple(buf.shape)} {buf.dtype}; the plans do not fit together: re-export")
                if not ctx.set_tensor_address(name, buf.data_ptr()):
                    raise RuntimeError(f"{stage}: TensorRT refused the address of tensor {name}")
            st.contexts[stage] = ctx
        self.stream.synchronize()
        return st

    def _execute(self, st: _BatchState, stage: str) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if not st.contexts[stage].execute_async_v3(stream):
            raise RuntimeError(f"TensorRT execute_async_v3 failed for {stage}")

    def _velocity(self, st: _BatchState) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        bufs = st.buffers

        def velocity(xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            bufs["x_t"].copy_(xt)
            bufs["t"].copy_(t)
            self._execute(st, "denoise_step")
            return bufs["velocity"].clone()

        return velocity

    def _graph_key(self, rtc: RTCGuidance | None) -> tuple:
        if rtc is None:
            return ("none",)
        # The guidance weight is a Python float baked into a captured graph, so it is part of
        # the key; the per-sample delays and soft masks are static buffers (any mix replays).
        return (rtc.mode, float(rtc.max_guidance_weight))

    def _loop_graph(self, st: _BatchState, batch: int, rtc: RTCGuidance | None):
        """The captured loop for this key (made on first use), or None when TensorRT's work
        cannot be captured (then graphs are off for this engine)."""
        key = self._graph_key(rtc)
        if key in st.graphs:
            return st.graphs[key]
        if len(st.graphs) >= self.max_graphs:
            st.graphs.pop(next(iter(st.graphs)))
        a = self.adapter
        static = {"noise": torch.zeros(batch, a.chunk_size, a.model_action_dim, device=self.device)}
        guidance = None
        if rtc is not None:
            # One soft-mask row and one hard-prefix length per sample: the captured loop serves
            # any mix of delays at this batch size (`integrate` masks, it does not slice).
            static.update(target=torch.zeros_like(static["noise"]),
                          weights=torch.zeros(batch, a.chunk_size, device=self.device),
                          dim_mask=torch.zeros(a.model_action_dim, device=self.device),
                          delays=torch.zeros(batch, dtype=torch.int64, device=self.device))
            guidance = RTCGuidance(rtc.mode, static["target"], static["weights"], static["dim_mask"],
                                   static["delays"], rtc.max_guidance_weight)
        velocity = self._velocity(st)

        def loop() -> torch.Tensor:
            return integrate(velocity, static["noise"], a.solver, guidance)

        # TensorRT needs one ordinary enqueue before its work can be captured.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            loop()
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.stream):
                out = loop()
        except RuntimeError as exc:
            # execute_async_v3 answers False under capture when the engine holds work stream
            # capture does not permit (torch's capture_end then reports the broken capture in
            # place of it). That is a property of the plan, so every later capture would fail
            # too: run the loop without graphs from now on, as trtexec does.
            log.warning("TensorRT work could not be captured into a CUDA graph (%s); running the denoise "
                        "loop without CUDA graphs", exc)
            self.cuda_graph = False
            return None
        st.graphs[key] = (graph, static, out)
        return st.graphs[key]

    @torch.no_grad()
    def run(self, inputs: ModelInputs, noise: torch.Tensor | None = None, rtc: RTCGuidance | None = None) -> torch.Tensor:
        if rtc is not None and rtc.mode == "guided":
            raise exact_guidance_error(self.backend)
        b = inputs.batch_size
        if b not in self.states:
            raise ValueError(f"this TensorRT bundle was built for batch sizes {self.batch_sizes}, not {b}")
        st = self.states[b]
        a = self.adapter
        noise = self.sample_noise(b) if noise is None else noise.to(self.device, torch.float32)
        rtc = rtc.to(self.device) if rtc is not None else None
        timer = StageTimer(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # inputs made on the default stream
        with torch.cuda.stream(self.stream):
            for name in ("images", "image_mask", "tokens", "token_mask"):
                st.buffers[name].copy_(inputs.tensors[name])
            with timer.stage("embed_images"):
                self._execute(st, "embed_images")
            with timer.stage("encode_prefix"):
                self._execute(st, "encode_prefix")
            with timer.stage("solver_loop"):
                captured = self._loop_graph(st, b, rtc) if self.cuda_graph else None
                if captured is not None:
                    graph, static, out = captured
                    static["noise"].copy_(noise)
                    if rtc is not None:
                        h = a.chunk_size
                        static["target"].copy_(rtc.target.expand(b, h, a.model_action_dim))
                        static["weights"].copy_(rtc.weights.expand(b, h))
                        static["dim_mask"].copy_(rtc.dim_mask)
                        static["delays"].copy_(rtc.delays.expand(b))
                    graph.replay()
                    result = out
                else:
                    result = integrate(self._velocity(st), noise, a.solver, rtc)
        caller = torch.cuda.current_stream(self.device)
        caller.wait_stream(self.stream)
        # The copy is made on the caller's stream, so the next replay cannot overwrite what
        # the caller is still reading, and no tensor crosses streams unrecorded.
        chunk = result.clone()
        if captured is None:
            result.record_stream(caller)
        timer.ms["denoise_step"] = timer.ms["solver_loop"] / a.solver.num_steps
        self._stage_ms = timer.ms
        return chunk


# Lowest compute capability with TensorRT kernels for a precision (TensorRT support matrix,
# "GPU Architecture and Precision Support"): FP8 from Ada (8.9), BF16 from Ampere (8.0).
_MIN_CAPABILITY = {"fp8": (8, 9), "bf16": (8, 0)}


def check_precision_on_gpu(precision: str) -> None:
    """Refuse, before minutes of ONNX export and quantisation, a precision the GPU TensorRT
    will build for has no kernels for (e.g. fp8 on Jetson AGX Orin, compute capability 8.7)."""
    need = _MIN_CAPABILITY.get(precision)
    if need is None or not torch.cuda.is_available():
        return
    idx = torch.cuda.current_device()
    have = tuple(torch.cuda.get_device_capability(idx))
    if have < need:
        raise ValueError(f"TensorRT has no {precision} kernels for {torch.cuda.get_device_name(idx)} (compute "
                         f"capability {have[0]}.{have[1]}; {precision} needs {need[0]}.{need[1]} or newer): "
                         "use int8 or fp16 / bf16 on this GPU")


def build_for_adapter(
    adapter: Adapter,
    plan_dir: Path,
    batch_sizes: list[int],
    num_views: int,
    options: BuildOptions,
    calibration: dict[str, list[dict[str, Any]]] | None = None,
    onnx_dir: Path | None = None,
    on_stage: Callable[[str], None] | None = None,
    trt: Any = None,
) -> dict[str, Any]:
    """Export batch-dynamic ONNX for each stage (typed at the precision), optionally apply
    Q/DQ (int8 qdq, fp8), then build the plans. calibration: stage -> input samples."""
    from phyai_edge.engines.onnx_export import export_ready, export_stage

    check_precision_on_gpu(options.precision)
    if not options.strongly_typed:
        trt = trt or import_tensorrt()
        if not hasattr(trt, "IInt8EntropyCalibrator2"):
            # Implicit quantisation (the calibrator and the INT8 / FP16 flags) was deprecated in
            # TensorRT 10.1 / 10.12 and is gone from TensorRT 11.
            raise ValueError(f"TensorRT {getattr(trt, '__version__', '?')} has no int8 calibrator (implicit "
                             "quantisation was removed in TensorRT 11): export with --int8-mode qdq")
    work = tempfile.TemporaryDirectory(prefix="phyai-trt-onnx-") if onnx_dir is None else None
    onnx_dir = Path(work.name) if work is not None else Path(onnx_dir)
    try:
        typed = options.precision if options.precision in ("fp16", "bf16") else "fp32"
        files: dict[str, Path] = {}
        shapes: dict[int, dict[str, dict[str, tuple[int, ...]]]] = {}
        with export_ready(adapter, typed) as twin:
            for b in batch_sizes:
                shapes[b] = {s.name: {n: tuple(sh) for n, (sh, _) in s.inputs.items()}
                             for s in twin.stage_specs(b, num_views)}
            for spec in twin.stage_specs(batch_sizes[0], num_views):
                files[spec.name] = export_stage(twin.module, spec, onnx_dir / f"{spec.name}.onnx", dynamic_batch=True)
            from phyai_edge.calibration.ort_quant import float32_weights

            keep_float = float32_weights(twin.module)  # left unquantised by Q/DQ, as in the onnxruntime bundles
        calibrators = None
        explicit = options.precision == "fp8" or (options.precision == "int8" and options.int8_mode == "qdq")
        if (explicit or options.precision == "int8") and not calibration:
            raise ValueError(f"{options.precision} needs calibration samples (--calibration DIR or synthetic)")
        if explicit:
            from phyai_edge.calibration.ort_quant import quantize_stage

            for stage, src in list(files.items()):
                files[stage] = quantize_stage(src, onnx_dir / f"{stage}.{options.precision}.onnx", calibration[stage],
                                              kind=options.precision, keep_float=keep_float)
        elif options.precision == "int8":
            from phyai_edge.calibration.trt_calibrator import entropy_calibrator

            device = "cuda" if torch.cuda.is_available() else "cpu"
            calibrators = {}
            for stage in files:
                cache = Path(plan_dir) / f"{stage}.int8.cache"
                # TensorRT checks only a cache's version header, and another checkpoint of the same
                # architecture has the same tensor names: a cache left in plan_dir by an earlier build
                # would be taken as this model's scales. These samples are at hand: calibrate afresh.
                cache.unlink(missing_ok=True)
                calibrators[stage] = entropy_calibrator(calibration[stage], cache, device, trt=trt)
        return build_plans(files, plan_dir, shapes, options, calibrators, on_stage, trt=trt)
    finally:
        if work is not None:
            work.cleanup()
