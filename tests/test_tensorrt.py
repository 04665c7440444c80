"""The TensorRT path. A real build needs TensorRT and a GPU (skipped here with the reason);
the builder's decisions are tested against a stand-in `tensorrt` module that records calls."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from phyai_edge.engines.tensorrt import BuildOptions, build_engine, build_for_adapter

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None
SKIP_REAL = ("unverified here: " + ", ".join(
    m for m, ok in (("TensorRT is not installed", HAVE_TRT), ("no CUDA GPU", torch.cuda.is_available())) if not ok))


class _Tensor:
    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        self.name, self.shape = name, shape


class FakeTRT:
    """Just enough of the TensorRT 10 builder API to watch what build_engine asks for."""

    def __init__(self, inputs: dict[str, tuple[int, ...]] | None, parse_ok: bool = True,
                 profile_ok: bool = True) -> None:
        self.calls: list[tuple] = []
        self.from_file = inputs is None
        self.inputs = inputs or {}
        self.parse_ok = parse_ok
        self.profile_ok = profile_ok
        log = self.calls
        trt = self

        class Logger:
            WARNING, VERBOSE = "W", "V"

            def __init__(self, level: str) -> None:
                pass

        class Profile:
            def __init__(self) -> None:
                self.shapes: dict[str, tuple] = {}

            def set_shape(self, name, mn, opt, mx):
                self.shapes[name] = (mn, opt, mx)

        class Cache:
            def __init__(self, data: bytes) -> None:
                self.data = data

            def serialize(self) -> bytes:
                return self.data + b"+"

        class Config:
            def __init__(self) -> None:
                self.flags: set[str] = {"TF32"}  # as in TensorRT: TF32 is on in a new config
                self.profiles: list[Profile] = []
                self.int8_calibrator = None
                self.builder_optimization_level = None
                self.cache = None

            def set_memory_pool_limit(self, pool, size):
                log.append(("workspace", size))

            def set_flag(self, flag):
                self.flags.add(flag)

            def clear_flag(self, flag):
                self.flags.discard(flag)

            def add_optimization_profile(self, p):
                # Like TensorRT: -1 for a profile that is not valid (here: one that leaves a
                # network input without shapes, or one the test declares invalid).
                if not trt.profile_ok or set(p.shapes) != set(trt.inputs):
                    return -1
                self.profiles.append(p)
                return len(self.profiles) - 1

            def set_calibration_profile(self, p):
                log.append(("calibration_profile", self.profiles.index(p)))
                return True

            def create_timing_cache(self, data):
                log.append(("timing_cache_in", bytes(data)))
                return Cache(bytes(data))

            def set_timing_cache(self, cache, ignore_mismatch):
                # Like TensorRT: a cache whose header names another device (or TensorRT) is
                # refused with False unless ignore_mismatch, and the config is left without one.
                if cache.data.startswith(b"foreign") and not ignore_mismatch:
                    log.append(("timing_cache_refused",))
                    return False
                self.cache = cache
                return True

            def get_timing_cache(self):
                return self.cache

        class Network:
            def __init__(self, flags: int) -> None:
                self.flags = flags
                self.num_inputs = len(trt.inputs)

            def get_input(self, i):
                name = list(trt.inputs)[i]
                return _Tensor(name, trt.inputs[name])

        class Builder:
            def __init__(self, logger) -> None:
                pass

            def create_network(self, flags):
                trt.network = Network(flags)
                return trt.network

            def create_builder_config(self):
                trt.config = Config()
                return trt.config

            def create_optimization_profile(self):
                return Profile()

            def build_serialized_network(self, network, config):
                log.append(("build", network.flags, sorted(config.flags)))
                cal = config.int8_calibrator
                while cal is not None:
                    # TensorRT's Python calibrator bridge (python/src/infer/pyInt8.cpp): an exception
                    # in get_batch is printed and taken as the end of the data; the build goes on.
                    try:
                        if cal.get_batch(list(trt.inputs)) is None:
                            break
                    except Exception as exc:
                        print(f"[ERROR] Exception caught in get_batch(): {exc}", file=sys.stderr)
                        break
                return b"PLAN"

        class Parser:
            def __init__(self, network, logger) -> None:
                pass

            def parse_from_file(self, path):
                log.append(("parse", path))
                if trt.from_file:  # read the real ONNX inputs, symbolic dims as -1 like TensorRT
                    from phyai_edge.engines.onnx_export import onnx_io

                    trt.inputs = {n: tuple(d if isinstance(d, int) else -1 for d in dims)
                                  for n, dims in onnx_io(path)["inputs"]}
                    trt.network.num_inputs = len(trt.inputs)
                return trt.parse_ok

            num_errors = 1

            def get_error(self, i):
                return "Unsupported op Foo"

        self.Logger, self.Builder, self.OnnxParser = Logger, Builder, Parser
        self.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=1)  # kSTRONGLY_TYPED = 1
        self.BuilderFlag = types.SimpleNamespace(FP16="FP16", BF16="BF16", INT8="INT8", FP8="FP8", TF32="TF32")
        self.MemoryPoolType = types.SimpleNamespace(WORKSPACE="ws")


SHAPES = {1: {"x_t": (1, 50, 32), "t": (1,)}, 2: {"x_t": (2, 50, 32), "t": (2,)}}


def test_strongly_typed_build_with_a_profile_per_batch_and_a_reused_timing_cache(tmp_path):
    trt = FakeTRT({"x_t": (-1, 50, 32), "t": (-1,)})
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"old")
    info = build_engine(tmp_path / "d.onnx", tmp_path / "d.plan", SHAPES,
                        BuildOptions("fp16", timing_cache=cache, workspace_bytes=1 << 30), trt=trt)
    assert info["strongly_typed"] and info["profiles"] == [1, 2]
    assert trt.network.flags == 1 << 1  # STRONGLY_TYPED: types come from the fp16 ONNX
    # Precision flags are refused when strongly typed; TF32 (float32 parts) stays allowed.
    assert trt.config.flags == {"TF32"}
    assert [p.shapes["x_t"] for p in trt.config.profiles] == [((1, 50, 32),) * 3, ((2, 50, 32),) * 3]
    assert ("timing_cache_in", b"old") in trt.calls and cache.read_bytes() == b"old+"
    assert ("workspace", 1 << 30) in trt.calls
    assert (tmp_path / "d.plan").read_bytes() == b"PLAN"


def test_fp32_build_turns_tf32_off(tmp_path):
    # BuilderFlag.TF32 is on by default, strongly typed or not: an "fp32" engine would round
    # every float32 GEMM's inputs to 10 mantissa bits unless the flag is cleared.
    trt = FakeTRT({"x_t": (-1, 50, 32), "t": (-1,)})
    info = build_engine(tmp_path / "d.onnx", tmp_path / "d.plan", SHAPES, BuildOptions("fp32"), trt=trt)
    assert "TF32" not in trt.config.flags and info["tf32"] is False


def test_a_timing_cache_from_another_device_is_replaced_not_fatal(tmp_path):
    # IBuilderConfig.set_timing_cache returns False for a cache made on another device; the
    # build must go on with a fresh cache (and not call serialize() on None afterwards).
    trt = FakeTRT({"x_t": (-1, 50, 32), "t": (-1,)})
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"foreign-gpu")
    build_engine(tmp_path / "d.onnx", tmp_path / "d.plan", SHAPES, BuildOptions("fp16", timing_cache=cache), trt=trt)
    assert ("timing_cache_refused",) in trt.calls
    assert ("timing_cache_in", b"") in trt.calls  # started again from an empty cache
    assert (tmp_path / "d.plan").read_bytes() == b"PLAN" and cache.read_bytes() == b"+"


def test_int8_calibrator_build_is_weakly_typed_and_calibrates_at_its_batch(tmp_path):
    trt = FakeTRT({"x_t": (-1, 50, 32), "t": (-1,)})
    calibrator = types.SimpleNamespace(get_batch_size=lambda: 2, get_batch=lambda names: None)
    info = build_engine(tmp_path / "d.onnx", tmp_path / "d.plan", SHAPES, BuildOptions("int8"), calibrator, trt=trt)
    assert not info["strongly_typed"] and info["calibrated"]
    assert trt.network.flags == 0 and trt.config.flags == {"INT8", "FP16", "TF32"}
    assert trt.config.int8_calibrator is calibrator and ("calibration_profile", 1) in trt.calls


def test_the_calibration_profile_is_the_calibrators_batch_or_an_error(tmp_path):
    # TensorRT reads the calibration profile's opt shape from each get_batch pointer: a calibrator
    # feeding a batch no profile has would be read past its buffers, not calibrated at profile 0.
    trt = FakeTRT({"x_t": (-1, 50, 32), "t": (-1,)})
    calibrator = types.SimpleNamespace(get_batch_size=lambda: 3, get_batch=lambda names: None)
    with pytest.raises(ValueError, match=r"calibrator feeds batch 3.*\[1, 2\]"):
        build_engine(tmp_path / "d.onnx", tmp_path / "d.plan", SHAPES, BuildOptions("int8"), calibrator, trt=trt)
    assert not any(c[0] == "build" for c in trt.calls)


def test_a_calibrator_error_fails_the_build_not_only_stderr(tmp_path):
    # TensorRT's bridge swallows what get_batch raises (prints it, ends calibration) and may
    # build an engine without int8 scales; build_engine must fail with the calibrator's error.
    import numpy as np

    from phyai_edge.calibration.trt_calibrator import entropy_calibrator

    class Base:
        def __init__(self) -> None:
            pass

    trt = FakeTRT({"x_t": (-1, 50, 32), "t": (-1,)})
    trt.IInt8EntropyCalibrator2 = Base
    samples = [{"x_t": np.zeros((2, 50, 32), np.float32)}]  # no "t": the network asks for it
    cal = entropy_calibrator(samples, tmp_path / "c.cache", device="cpu", trt=trt)
    with pytest.raises(RuntimeError, match=r"int8 calibration of d\.onnx failed.*no input 't'"):
        build_engine(tmp_path / "d.onnx", tmp_path / "d.plan", SHAPES, BuildOptions("int8"), cal, trt=trt)
    assert not (tmp_path / "d.plan").exists()


def test_a_refused_optimisation_profile_is_an_error(tmp_path):
    # add_optimization_profile answers -1 for a profile TensorRT does not take.
    trt = FakeTRT({"x_t": (-1, 50, 32), "t": (-1,)}, profile_ok=False)
    with pytest.raises(RuntimeError, match="batch-1 optimisation profile"):
        build_engine(tmp_path / "d.onnx", tmp_path / "d.plan", SHAPES, BuildOptions("fp16"), trt=trt)


def test_parse_errors_are_reported(tmp_path):
    trt = FakeTRT({"x_t": (1, 50, 32)}, parse_ok=False)
    with pytest.raises(RuntimeError, match="Unsupported op Foo"):
        build_engine(tmp_path / "d.onnx", tmp_path / "d.plan", {1: {"x_t": (1, 50, 32)}}, BuildOptions(), trt=trt)


def test_build_for_adapter_exports_batch_dynamic_onnx_for_every_stage(tmp_path):
    pytest.importorskip("onnxruntime")
    import onnxruntime as ort

    from phyai_edge.adapters.pi05 import builtin_adapter
    from phyai_edge.engines.onnx_export import sample_inputs

    adapter = builtin_adapter("tiny")
    trt = FakeTRT(None)
    onnx_dir = tmp_path / "onnx"
    meta = build_for_adapter(adapter, tmp_path / "trt", [1, 2], 3, BuildOptions("fp32"), onnx_dir=onnx_dir, trt=trt)
    assert meta["batch_sizes"] == [1, 2] and set(meta["stages"]) == set(adapter.stage_names())
    assert (tmp_path / "trt" / "plans.json").exists()
    assert all(p == [1, 2] for p in (st["profiles"] for st in meta["stages"].values()))
    # The ONNX TensorRT would consume runs at both batch sizes in onnxruntime.
    for b in (1, 2):
        spec = next(s for s in adapter.stage_specs(b, 3) if s.name == "denoise_step")
        sess = ort.InferenceSession(str(onnx_dir / "denoise_step.onnx"), providers=["CPUExecutionProvider"])
        feeds = sample_inputs(spec)
        out = sess.run(None, {n: t.numpy() for n, t in feeds.items()})[0]
        ref = adapter.module.denoise_step(*feeds.values())
        assert out.shape == (b, 50, 32) and abs(out - ref.numpy()).max() < 1e-4


def test_engine_refuses_without_tensorrt_or_on_cpu():
    from phyai_edge.adapters.pi05 import builtin_adapter
    from phyai_edge.engines.tensorrt import TensorRTEngine

    with pytest.raises((RuntimeError, ValueError), match=r"TensorRT is not installed|CUDA device"):
        TensorRTEngine(builtin_adapter("tiny"), device="cpu", plan_dir=Path("/nonexistent"))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TRT and torch.cuda.is_available()), reason=SKIP_REAL)
def test_tensorrt_bundle_matches_eager(tmp_path):
    from phyai_edge.engines.exporter import ExportRequest, export_bundle
    from phyai_edge.engines.policy import load_bundle_policy

    out = tmp_path / "tiny-trt"
    m = export_bundle(ExportRequest(out=out, backend="tensorrt", precision="fp32", batch_sizes=[1, 2],
                                    timing_cache=tmp_path / "tc", progress=False))
    assert m["validation"]["status"] == "passed", m["validation"]
    policy = load_bundle_policy(out, device="cuda")
    assert policy.engine.backend == "tensorrt"


class _FakeContext:
    """An IExecutionContext that answers like TensorRT 10's: the setters return False on a
    name it does not know or a shape outside the active profile, and an input whose shape was
    never set stays -1 (infer_shapes names it)."""

    def __init__(self, engine: _FakeEngine) -> None:
        self.engine, self.profile, self.shapes, self.addresses = engine, 0, {}, {}

    def set_optimization_profile_async(self, index, stream):
        # The Python binding raises on failure rather than returning False
        # (python/src/infer/pyCore.cpp, PY_ASSERT_RUNTIME_ERROR in 10.0 to 11.x).
        if not 0 <= index < self.engine.num_optimization_profiles:
            raise RuntimeError("Error in set optimization profile async.")
        self.profile = index
        return True

    def set_input_shape(self, name, shape):
        if self.engine.modes.get(name) != "INPUT" or tuple(shape) != self.engine.profiles[self.profile][name]:
            return False
        self.shapes[name] = tuple(shape)
        return True

    def infer_shapes(self):
        return [n for n, m in self.engine.modes.items() if m == "INPUT" and n not in self.shapes]

    def get_tensor_shape(self, name):
        if self.engine.modes[name] == "INPUT":
            return self.shapes.get(name, self.engine.dims[name])
        b = self.shapes.get("x_t", (-1,))[0]
        return (b, *self.engine.dims[name][1:])

    def set_tensor_address(self, name, ptr):
        if name not in self.engine.modes:
            return False
        self.addresses[name] = ptr
        return True


class _FakeEngine:
    """One denoise-step engine, batch-dynamic, with a min = opt = max profile per batch."""

    def __init__(self, batches: list[int]) -> None:
        self.modes = {"x_t": "INPUT", "t": "INPUT", "velocity": "OUTPUT"}
        self.dims = {"x_t": (-1, 50, 32), "t": (-1,), "velocity": (-1, 50, 32)}
        self.profiles = [{"x_t": (b, 50, 32), "t": (b,)} for b in batches]
        self.num_optimization_profiles = len(batches)
        self.num_io_tensors = len(self.modes)

    def create_execution_context(self):
        return _FakeContext(self)

    def get_tensor_name(self, i):
        return list(self.modes)[i]

    def get_tensor_mode(self, name):
        return self.modes.get(name, "NONE")

    def get_tensor_dtype(self, name):
        return "FLOAT"


def _runtime_engine(engine_batches: list[int], bundle_batches: list[int]):
    from phyai_edge.engines.tensorrt import TensorRTEngine

    eng = object.__new__(TensorRTEngine)  # the parts _prepare reads, without a GPU
    eng.trt = types.SimpleNamespace(TensorIOMode=types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT"),
                                    DataType=types.SimpleNamespace(FLOAT="FLOAT", HALF="HALF"))
    eng.adapter = types.SimpleNamespace(stage_specs=lambda b, v: [types.SimpleNamespace(
        name="denoise_step", inputs={"x_t": ((b, 50, 32), "float32"), "t": ((b,), "float32")})])
    eng.engines = {"denoise_step": _FakeEngine(engine_batches)}
    eng.batch_sizes, eng.num_views, eng.device = bundle_batches, 3, torch.device("cpu")
    eng.stream = types.SimpleNamespace(cuda_stream=0, synchronize=lambda: None)
    return eng


def test_runtime_binds_each_batch_to_its_profile():
    eng = _runtime_engine([1, 2], [1, 2])
    st = eng._prepare(2)
    ctx = st.contexts["denoise_step"]
    assert ctx.profile == 1 and ctx.shapes == {"x_t": (2, 50, 32), "t": (2,)}
    assert tuple(st.buffers["velocity"].shape) == (2, 50, 32)
    assert ctx.addresses["velocity"] == st.buffers["velocity"].data_ptr()


def test_runtime_reports_a_refused_profile_or_shape():
    # plans.json promises batch 2 but the plan has one profile: TensorRT answers False to the
    # profile switch and the shape; that must be the error, not a -1 dimension later.
    eng = _runtime_engine([1], [1, 2])
    with pytest.raises(RuntimeError, match="optimization profile 1"):
        eng._prepare(2)
    eng = _runtime_engine([4], [1])  # a profile that does not hold the shape asked for
    with pytest.raises(RuntimeError, match=r"set_input_shape.*x_t"):
        eng._prepare(1)


def test_fp8_is_refused_before_export_on_a_gpu_without_fp8(tmp_path, monkeypatch):
    # TensorRT has FP8 kernels from compute capability 8.9 (Ada, Hopper, Blackwell: Thor);
    # Jetson AGX Orin is 8.7, where an fp8 build can only fail, after the ONNX export and
    # quantisation. Refuse it first.
    from phyai_edge.adapters.pi05 import builtin_adapter

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 7))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Orin")
    with pytest.raises(ValueError, match=r"compute capability 8\.7"):
        build_for_adapter(builtin_adapter("tiny"), tmp_path / "trt", [1], 3, BuildOptions("fp8"), trt=FakeTRT(None))


def test_a_loop_tensorrt_cannot_capture_runs_without_a_graph(monkeypatch):
    # execute_async_v3 returns False when the engine holds work that stream capture does not
    # permit; trtexec then ends the capture and runs without a graph
    # (samples/common/sampleInference.cpp). The engine must do the same, not fail the chunk.
    import contextlib

    from phyai_edge.adapters.base import SolverSpec

    capturing = [False]

    @contextlib.contextmanager
    def graph(g, stream=None, **kw):
        capturing[0] = True
        try:
            yield
        finally:
            capturing[0] = False
        # (on an exception torch's capture_end raises its own error in place of it)

    current = types.SimpleNamespace(cuda_stream=0, wait_stream=lambda s: None)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    eng = _runtime_engine([1], [1])
    eng.stream = types.SimpleNamespace(cuda_stream=7, synchronize=lambda: None, wait_stream=lambda s: None)
    eng.adapter.chunk_size, eng.adapter.model_action_dim, eng.adapter.solver = 50, 32, SolverSpec(2)
    eng.cuda_graph, eng.max_graphs = True, 4
    st = eng._prepare(1)
    calls = []

    def execute_async_v3(stream):
        calls.append(capturing[0])
        return not capturing[0]

    st.contexts["denoise_step"].execute_async_v3 = execute_async_v3
    assert eng._loop_graph(st, 1, None) is None  # no graph: the caller runs the loop itself
    assert calls == [False, False, True] and eng.cuda_graph is False and not st.graphs


def test_implicit_int8_is_refused_before_export_where_tensorrt_has_no_calibrator(tmp_path):
    # TensorRT 11 removed IInt8EntropyCalibrator2 and the INT8 / FP16 builder flags (deprecated
    # since 10.1 / 10.12); the stand-in module, like it, has neither.
    from phyai_edge.adapters.pi05 import builtin_adapter

    trt = FakeTRT(None)
    with pytest.raises(ValueError, match="int8-mode qdq"):
        build_for_adapter(builtin_adapter("tiny"), tmp_path / "trt", [1], 3, BuildOptions("int8"),
                          calibration={"x": []}, trt=trt)
    assert not any(c[0] == "parse" for c in trt.calls)


def test_a_qdq_build_leaves_the_float32_linears_unquantised(tmp_path, monkeypatch):
    """TensorRT's Q/DQ builds quantise what the onnxruntime bundles quantise and no more: the linears
    the model keeps in float32 at every precision (PI0.5's time MLP, action projections, norm
    modulation) are handed to the quantiser to leave alone, as the exporter's onnxruntime path does."""
    pytest.importorskip("onnxruntime")
    from phyai_edge.adapters.pi05 import builtin_adapter
    from phyai_edge.calibration import ort_quant

    kept: dict[str, int] = {}

    def quantize(src, dst, samples, kind, keep_float=()):
        kept[Path(src).stem] = len(keep_float)
        return Path(src)

    monkeypatch.setattr(ort_quant, "quantize_stage", quantize)
    adapter = builtin_adapter("tiny")
    want = len(ort_quant.float32_weights(adapter.module))
    assert want > 0
    build_for_adapter(adapter, tmp_path / "trt", [1], 3, BuildOptions("int8", int8_mode="qdq"),
                      calibration={name: [] for name in adapter.stage_names()}, trt=FakeTRT(None))
    assert kept and all(n == want for n in kept.values()), kept
