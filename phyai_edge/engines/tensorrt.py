"""The TensorRT backend: stage engines built from ONNX, run with execute_async_v3, and the whole
solver loop replayed as one CUDA graph. Nothing here names a model's stages or tensors: which
stage runs once per chunk and which once per flow step, every tensor name, shape and batch axis
come from the adapter's `stage_specs` through `engines/stages.py` (`static_plan`, `batch_axes`).

NEVER RUN: no machine this was written on has TensorRT or a GPU, so no engine has been built,
deserialised or executed. The code follows the TensorRT 10 Python API (Builder /
NetworkDefinition / OnnxParser / BuilderConfig / Runtime / ICudaEngine / IExecutionContext with
named tensors). The CPU tests check everything up to those calls: the plan of which stage runs
when, the binding names, shapes and dtypes for PI0.5 and a second adapter, the ONNX each build
consumes (run in onnxruntime against eager), and the builder's and the run loop's calls against
stand-ins that record them. See docs/export.md.

Build (`build_plans`): one serialised engine per stage from a batch-dynamic ONNX (the batch axis
of each tensor found from the specs), with one optimisation profile per requested batch size
(min = opt = max, so each profile is as fast as a static engine), a timing cache shared by every
build (and kept on disk between exports), and per precision:

    fp32 / fp16 / bf16  strongly typed network from an ONNX exported at that precision (what
                        the adapter keeps in float32 stays float32 inside it); TensorRT keeps
                        the types it is given
    int8                weakly typed network, INT8 + FP16 flags, `IInt8EntropyCalibrator2`
                        fed with the stage's recorded inputs (implicit quantisation), or, with
                        int8_mode="qdq", a strongly typed build of an explicitly quantised ONNX
    fp8                 strongly typed build of an explicitly quantised (Q/DQ) fp8 ONNX

Run (`TensorRTEngine`): per batch size, one execution context per stage (each bound to that
batch's profile) and one static torch buffer per tensor name, bound with set_tensor_address (a
stage's outputs and a later stage's inputs of the same name are one buffer). Per chunk the
preprocessed tensors are copied into their buffers, the once-per-chunk stages execute in spec
order, and the solver loop writes the step's x_t and t buffers before each execute of the step;
that loop is captured into a torch CUDA graph and replayed.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from phyai_edge.adapters.base import Adapter, ModelInputs
from phyai_edge.engines.base import EngineBase
from phyai_edge.engines.eager import resolve_dtype
from phyai_edge.engines.onnxrt import exact_guidance_error
from phyai_edge.engines.rtc import RTCGuidance
from phyai_edge.engines.solver import Velocity, integrate
from phyai_edge.engines.stages import StaticPlan, batch_axes, stage_graph, static_plan
from phyai_edge.engines.timing import StageTimer

log = logging.getLogger(__name__)

PLANS_META = "plans.json"
_PRECISION_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def import_tensorrt() -> Any:
    try:
        import tensorrt
    except ImportError as exc:
        raise RuntimeError(
            "TensorRT is not installed: on a Jetson it comes with JetPack (python3-libnvinfer), on a "
            "workstation `pip install tensorrt`; or export with --backend onnx / cudagraph"
        ) from exc
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


def _logger(trt: Any, verbose: bool) -> Any:
    return trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.WARNING)


def _check_network_inputs(onnx_path: Path, inputs: list[Any], input_shapes: dict[int, dict[str, tuple[int, ...]]]) -> None:
    """Every network input must be a spec input, with the spec's size on each static axis:
    otherwise the profiles would be set on names the network does not have (or miss one), and
    TensorRT would fail far from the cause."""
    for b, shapes in input_shapes.items():
        unknown = [t.name for t in inputs if t.name not in shapes]
        if unknown:
            raise ValueError(f"{onnx_path.name}: network inputs {unknown} are not in the stage's spec at batch {b} "
                             f"(spec inputs: {sorted(shapes)}); the ONNX and the adapter's stage_specs disagree")
        for t in inputs:
            net, spec = tuple(t.shape), tuple(shapes[t.name])
            if len(net) != len(spec) or any(d not in (-1, s) for d, s in zip(net, spec)):
                raise ValueError(f"{onnx_path.name}: input {t.name!r} is {net} in the network but {spec} in the "
                                 f"spec at batch {b}")


def build_engine(
    onnx_path: Path,
    plan_path: Path,
    input_shapes: dict[int, dict[str, tuple[int, ...]]],
    options: BuildOptions,
    calibrator: Any = None,
    trt: Any = None,
) -> dict[str, Any]:
    """Build one stage. input_shapes: batch size -> {input name: full static shape}, from the
    stage's spec; profile i is the i-th batch size in the order given. Returns what the
    manifest records of the build."""
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
    if not options.strongly_typed:
        # Weakly typed (implicit int8): allow fp16 for layers TensorRT keeps out of int8.
        config.set_flag(trt.BuilderFlag.INT8)
        config.set_flag(trt.BuilderFlag.FP16)
    batch_sizes = list(input_shapes)
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    _check_network_inputs(onnx_path, inputs, input_shapes)
    dynamic = any(-1 in tuple(t.shape) for t in inputs)
    profiles = []
    if dynamic:
        for b in batch_sizes:
            profile = builder.create_optimization_profile()
            for t in inputs:
                shape = tuple(input_shapes[b][t.name])
                profile.set_shape(t.name, shape, shape, shape)
            config.add_optimization_profile(profile)
            profiles.append(profile)
    elif len(batch_sizes) > 1:
        raise ValueError(f"{onnx_path} has static shapes; several batch sizes need a batch-dynamic ONNX")
    if calibrator is not None:
        config.int8_calibrator = calibrator
        if profiles:
            # Calibrate at the batch size the calibrator feeds.
            calib_b = calibrator.get_batch_size()
            config.set_calibration_profile(profiles[batch_sizes.index(calib_b)] if calib_b in batch_sizes else profiles[0])
    cache_bytes = b""
    if options.timing_cache is not None and Path(options.timing_cache).exists():
        cache_bytes = Path(options.timing_cache).read_bytes()
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, False)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build {onnx_path.name} at {options.precision} (see the log above)")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_bytes(bytes(memoryview(serialized)))
    if options.timing_cache is not None:
        Path(options.timing_cache).parent.mkdir(parents=True, exist_ok=True)
        Path(options.timing_cache).write_bytes(bytes(memoryview(config.get_timing_cache().serialize())))
    return {"plan": plan_path.name, "inputs": [t.name for t in inputs], "strongly_typed": options.strongly_typed,
            "profiles": batch_sizes if dynamic else [], "calibrated": calibrator is not None}


def build_plans(
    onnx_files: dict[str, Path],
    plan_dir: Path,
    shapes: dict[int, dict[str, dict[str, tuple[int, ...]]]],
    options: BuildOptions,
    calibrators: dict[str, Any] | None = None,
    on_stage: Callable[[str], None] | None = None,
    trt: Any = None,
) -> dict[str, Any]:
    """Every stage's plan into `plan_dir`, plus plans.json (batch order = profile order; stage
    order = the adapter's execution order, as `onnx_files` lists them).
    shapes: batch -> stage -> input name -> shape."""
    plan_dir = Path(plan_dir)
    plan_dir.mkdir(parents=True, exist_ok=True)
    stages = {}
    for stage, onnx_path in onnx_files.items():
        missing = [b for b in shapes if stage not in shapes[b]]
        if missing:
            raise KeyError(f"no input shapes for stage {stage!r} at batch sizes {missing}")
        per_batch = {b: shapes[b][stage] for b in shapes}
        stages[stage] = build_engine(onnx_path, plan_dir / f"{stage}.plan", per_batch, options,
                                     (calibrators or {}).get(stage), trt=trt)
        if on_stage is not None:
            on_stage(stage)
    meta = {"batch_sizes": list(shapes), "precision": options.precision, "int8_mode": options.int8_mode,
            "stages": stages}
    (plan_dir / PLANS_META).write_text(json.dumps(meta, indent=2))
    return meta


def profile_shapes(adapter: Adapter, batch_sizes: list[int], num_views: int | None) -> dict[int, dict[str, dict[str, tuple[int, ...]]]]:
    """batch -> stage -> input name -> shape: every optimisation profile, from the specs."""
    return {b: {s.name: {n: tuple(int(d) for d in sh) for n, (sh, _) in s.inputs.items()}
                for s in adapter.stage_specs(b, num_views)} for b in batch_sizes}


def calibration_batch(samples: list[Mapping[str, Any]], axes: Mapping[str, int | None]) -> int:
    """The batch size recorded calibration samples were taken at, read on each input's batch axis."""
    for name, arr in samples[0].items():
        ax = axes.get(name)
        if ax is not None:
            return int(arr.shape[ax])
    raise ValueError(f"no calibration input with a batch axis among {list(samples[0])}")


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

    if not batch_sizes:
        raise ValueError("no batch sizes to build for")
    static_plan(adapter, batch_sizes[0], num_views)  # refuse specs that cannot share buffers, before any work
    axes = batch_axes(adapter, num_views)
    work = tempfile.TemporaryDirectory(prefix="phyai-trt-onnx-") if onnx_dir is None else None
    onnx_dir = Path(work.name) if work is not None else Path(onnx_dir)
    try:
        typed = options.precision if options.precision in ("fp16", "bf16") else "fp32"
        files: dict[str, Path] = {}
        with export_ready(adapter, typed) as twin:
            shapes = profile_shapes(twin, batch_sizes, num_views)
            for spec in twin.stage_specs(batch_sizes[0], num_views):
                files[spec.name] = export_stage(twin.module, spec, onnx_dir / f"{spec.name}.onnx", batch_axes=axes)
        calibrators = None
        explicit = options.precision == "fp8" or (options.precision == "int8" and options.int8_mode == "qdq")
        if explicit or options.precision == "int8":
            missing = [s for s in files if not (calibration or {}).get(s)]
            if missing:
                raise ValueError(f"{options.precision} needs calibration samples for stages {missing} "
                                 "(--calibration DIR or synthetic)")
        if explicit:
            from phyai_edge.calibration.ort_quant import quantize_stage

            for stage, src in list(files.items()):
                files[stage] = quantize_stage(src, onnx_dir / f"{stage}.{options.precision}.onnx", calibration[stage],
                                              kind=options.precision)
        elif options.precision == "int8":
            from phyai_edge.calibration.trt_calibrator import entropy_calibrator

            device = "cuda" if torch.cuda.is_available() else "cpu"
            calibrators = {stage: entropy_calibrator(calibration[stage], plan_dir / f"{stage}.int8.cache", device,
                                                     trt=trt, batch_size=calibration_batch(calibration[stage], axes))
                           for stage in files}
        return build_plans(files, plan_dir, shapes, options, calibrators, on_stage, trt=trt)
    finally:
        if work is not None:
            work.cleanup()


# -- run ----------------------------------------------------------------------------------
def load_plans(plan_dir: Path, stages: list[str], runtime: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(plans.json, stage -> deserialised engine) for the adapter's stages, in its order."""
    plan_dir = Path(plan_dir)
    meta = json.loads((plan_dir / PLANS_META).read_text())
    missing = [s for s in stages if s not in meta.get("stages", {})]
    if missing:
        raise RuntimeError(f"{plan_dir} has no plans for stages {missing} (it has {sorted(meta.get('stages', {}))}); "
                           "it was built for another adapter: re-export")
    engines = {}
    for stage in stages:
        engine = runtime.deserialize_cuda_engine((plan_dir / f"{stage}.plan").read_bytes())
        if engine is None:
            raise RuntimeError(f"TensorRT could not deserialise {stage}.plan (built for another GPU or version?)")
        engines[stage] = engine
    return meta, engines


class StageBindings:
    """One batch size: an execution context per stage, each bound to `profile`, and one static
    buffer per tensor name of `plan`, bound by name in every context that has the tensor.

    `stream()` gives the CUDA stream handle to enqueue on (the current torch stream, so the
    calls land in a graph being captured); this class makes no CUDA call of its own."""

    def __init__(self, plan: StaticPlan, engines: Mapping[str, Any], profile: int, device: torch.device,
                 trt: Any, stream: Callable[[], int]) -> None:
        self.plan, self.stream = plan, stream
        self.contexts: dict[str, Any] = {}
        io: dict[str, list[str]] = {}  # stage -> the names its engine has
        found: dict[str, tuple[tuple[int, ...], torch.dtype, str]] = {}  # name -> (shape, dtype, stage)
        for stage, (spec_in, spec_out) in plan.io.items():
            engine = engines[stage]
            ctx = engine.create_execution_context()
            if ctx is None:
                raise RuntimeError(f"TensorRT could not create an execution context for {stage} (out of memory?)")
            if engine.num_optimization_profiles > 1 or profile > 0:
                ctx.set_optimization_profile_async(profile, stream())
            names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
            unknown = [n for n in names if n not in (*spec_in, *spec_out)]
            missing_out = [n for n in spec_out if n not in names]
            if unknown or missing_out:
                raise RuntimeError(f"{stage}.plan has tensors {names}; the adapter's spec declares inputs "
                                   f"{list(spec_in)} and outputs {list(spec_out)}: re-export")
            for name in names:
                want_input = name in spec_in
                if (engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT) != want_input:
                    raise RuntimeError(f"{stage}.plan has {name!r} as an {'output' if want_input else 'input'}; the "
                                       f"spec has it as an {'input' if want_input else 'output'}: re-export")
                if want_input and not ctx.set_input_shape(name, plan.tensors[name][0]):
                    raise RuntimeError(f"{stage}.plan refuses input {name!r} of shape {plan.tensors[name][0]} "
                                       f"(profile {profile} is for another batch size?)")
            for name in names:
                shape = tuple(ctx.get_tensor_shape(name))
                dtype = torch_dtype(trt, engine.get_tensor_dtype(name))
                if shape != plan.tensors[name][0]:
                    raise RuntimeError(f"{stage}.plan makes {name!r} {shape}; the spec at batch {plan.batch} says "
                                       f"{plan.tensors[name][0]}: re-export")
                prev = found.setdefault(name, (shape, dtype, stage))
                if prev[1] != dtype:
                    raise RuntimeError(f"{name!r} is {prev[1]} in {prev[2]}.plan but {dtype} in {stage}.plan; the "
                                       "plans do not fit together: re-export them together")
            io[stage] = names
            self.contexts[stage] = ctx
        # One buffer per name. The engines' dtypes win over the spec's: a plan built at fp16
        # takes fp16 where the adapter (loaded in float32) declares float32. A name no engine
        # has (an input the exporter found unused) keeps the spec's dtype.
        self.buffers: dict[str, torch.Tensor] = {
            name: torch.empty(shape, dtype=found[name][1] if name in found else spec_dtype, device=device)
            for name, (shape, spec_dtype) in plan.tensors.items()}
        for stage, names in io.items():
            for name in names:
                if not self.contexts[stage].set_tensor_address(name, self.buffers[name].data_ptr()):
                    raise RuntimeError(f"TensorRT refused the address of {name!r} for {stage}")

    def execute(self, stage: str) -> None:
        if not self.contexts[stage].execute_async_v3(self.stream()):
            raise RuntimeError(f"TensorRT execute_async_v3 failed for {stage}")

    def run_prefix(self, tensors: Mapping[str, torch.Tensor], timer: StageTimer) -> None:
        """Copy the preprocessed tensors into their buffers and run the once-per-chunk stages in
        order, each timed under its name; the step's context is then in place for the loop."""
        for name in self.plan.feeds:
            if name not in tensors:
                raise KeyError(f"the stages need {name!r} from preprocess, which gives {sorted(tensors)}")
            src, buf = tensors[name], self.buffers[name]
            # copy_ would broadcast a wrong-sized tensor silently.
            if tuple(src.shape) != tuple(buf.shape):
                raise ValueError(f"preprocess gives {name!r} of shape {tuple(src.shape)}; the engine was built for "
                                 f"{tuple(buf.shape)}")
            buf.copy_(src)
        for stage in self.plan.prefix:
            with timer.stage(stage):
                self.execute(stage)

    def velocity(self) -> Velocity:
        """The solver's velocity: write x_t and t into the step's buffers, run the step, return a
        float32 copy of its output (the buffer is overwritten by the next step)."""
        g, bufs = self.plan.graph, self.buffers
        x, t, out = bufs[g.step_x], bufs[g.step_t], bufs[self.plan.step_out]

        def velocity(xt: torch.Tensor, tt: torch.Tensor) -> torch.Tensor:
            x.copy_(xt)
            t.copy_(tt)
            self.execute(g.step)
            return out.to(torch.float32, copy=True)

        return velocity


class LoopInputs:
    """The solver loop's inputs as static buffers, so a captured loop reads each call's values:
    the noise and, with RTC, one target, soft-mask row and hard-prefix length per sample (the
    loop masks per sample, so any mix of delays replays the same graph)."""

    def __init__(self, batch: int, horizon: int, dim: int, rtc: RTCGuidance | None, device: torch.device) -> None:
        self.batch, self.horizon, self.dim = batch, horizon, dim
        self.noise = torch.zeros(batch, horizon, dim, device=device)
        self.guidance = None
        if rtc is not None:
            self.guidance = RTCGuidance(rtc.mode, torch.zeros(batch, horizon, dim, device=device),
                                        torch.zeros(batch, horizon, device=device), torch.zeros(dim, device=device),
                                        torch.zeros(batch, dtype=torch.int64, device=device), rtc.max_guidance_weight)

    def fill(self, noise: torch.Tensor, rtc: RTCGuidance | None) -> None:
        self.noise.copy_(noise)
        if self.guidance is not None and rtc is not None:
            b, h, d = self.batch, self.horizon, self.dim
            self.guidance.target.copy_(rtc.target.expand(b, h, d))
            self.guidance.weights.copy_(rtc.weights.expand(b, h))
            self.guidance.dim_mask.copy_(rtc.dim_mask)
            self.guidance.delays.copy_(rtc.delays.expand(b))


def loop_key(rtc: RTCGuidance | None) -> tuple:
    if rtc is None:
        return ("none",)
    # The guidance weight is a Python float baked into a captured graph, so it is part of the
    # key; the per-sample targets, masks and delays are static buffers (any mix replays).
    return (rtc.mode, float(rtc.max_guidance_weight))


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
        self.graph = stage_graph(adapter)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if plan_dir is None:
            precision = _PRECISION_NAMES[resolve_dtype(dtype)]
            self._tmp = tempfile.TemporaryDirectory(prefix="phyai-trt-")
            plan_dir = Path(self._tmp.name)
            build_for_adapter(adapter, plan_dir, list(batch_sizes), self.num_views,
                              build_options or BuildOptions(precision=precision))
        self.plan_dir = Path(plan_dir)
        self.logger = _logger(self.trt, False)
        self.runtime = self.trt.Runtime(self.logger)
        meta, self.engines = load_plans(self.plan_dir, self.graph.names, self.runtime)
        self.batch_sizes = list(meta["batch_sizes"])
        self.stream = torch.cuda.Stream(self.device)
        self.states: dict[int, StageBindings] = {}
        self.loops: dict[int, dict[tuple, tuple[torch.cuda.CUDAGraph, LoopInputs, torch.Tensor]]] = {}
        for profile, b in enumerate(self.batch_sizes):
            with torch.cuda.stream(self.stream):
                self.states[b] = StageBindings(static_plan(adapter, b, self.num_views), self.engines, profile,
                                               self.device, self.trt, self._stream_handle)
            self.loops[b] = {}
        self.stream.synchronize()

    def _stream_handle(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _loop_graph(self, st: StageBindings, rtc: RTCGuidance | None):
        graphs = self.loops[st.plan.batch]
        key = loop_key(rtc)
        if key in graphs:
            return graphs[key]
        if len(graphs) >= self.max_graphs:
            graphs.pop(next(iter(graphs)))
        a = self.adapter
        static = LoopInputs(st.plan.batch, a.chunk_size, a.model_action_dim, rtc, self.device)
        velocity = st.velocity()

        def loop() -> torch.Tensor:
            return integrate(velocity, static.noise, a.solver, static.guidance)

        # TensorRT needs one ordinary enqueue before its work can be captured.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            loop()
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            out = loop()
        graphs[key] = (graph, static, out)
        return graphs[key]

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
            st.run_prefix(inputs.tensors, timer)
            with timer.stage("solver_loop"):
                if self.cuda_graph:
                    graph, static, out = self._loop_graph(st, rtc)
                    static.fill(noise, rtc)
                    graph.replay()
                    result = out
                else:
                    result = integrate(st.velocity(), noise, a.solver, rtc)
        caller = torch.cuda.current_stream(self.device)
        caller.wait_stream(self.stream)
        # The copy is made on the caller's stream, so the next replay cannot overwrite what
        # the caller is still reading, and no tensor crosses streams unrecorded.
        chunk = result.clone()
        if not self.cuda_graph:
            result.record_stream(caller)
        timer.ms[self.graph.step] = timer.ms["solver_loop"] / a.solver.num_steps
        self._stage_ms = timer.ms
        return chunk
