"""FAKE TENSORRT, FOR CPU TESTS ONLY. Nothing in this file is TensorRT, and no test that uses it
runs TensorRT: it cannot tell whether TensorRT parses our ONNX, builds an engine, accepts a
profile or binding, executes correctly, or can be captured in a CUDA graph.

What it is for: `phyai_edge/engines/tensorrt.py` reaches TensorRT only through a `trt` module
object and the builder / engine / context objects it returns. Standing in for those lets the
CPU tests watch our side of the calls: which flags, profiles, names and shapes the builder is
given, and whether the run loop binds an address for every named tensor, feeds the step a new
x_t and t each step and reads outputs from the buffers it bound.

- The builder part records calls. `parse_from_file` reads the ONNX file's declared inputs
  (symbolic dims as -1, as TensorRT reports them); the "serialised plan" it returns is the ONNX
  file's bytes behind a header with the stage name and the profile count.
- The runtime part "deserialises" such a plan into an engine that lists the ONNX's inputs and
  outputs by name, mode and dtype. Its contexts execute the stage with onnxruntime on the CPU
  tensors registered at the addresses bound to them (`FakeTRT.memory`: data_ptr -> tensor, which
  the test fills from the buffers the code under test allocated); an address nobody registered
  fails the execute.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

_ONNX_TYPES = {1: "FLOAT", 10: "HALF", 16: "BF16", 9: "BOOL", 7: "INT64", 6: "INT32", 3: "INT8", 2: "UINT8"}


class _Tensor:
    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        self.name, self.shape = name, shape


class FakeTRT:
    """Stands in for the `tensorrt` module (see the module docstring: this is not TensorRT)."""

    def __init__(self, inputs: dict[str, tuple[int, ...]] | None = None, parse_ok: bool = True,
                 calibrator_base: type | None = None) -> None:
        self.calls: list[tuple] = []
        self.from_file = inputs is None
        self.inputs = inputs or {}
        self.parse_ok = parse_ok
        self.memory: dict[int, torch.Tensor] = {}
        self.executed: list[tuple[str, dict[str, torch.Tensor]]] = []  # (stage, inputs as executed)
        self.contexts: list[FakeContext] = []
        self.configs: list[Any] = []
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
                self.flags: set[str] = set()
                self.profiles: list[Profile] = []
                self.int8_calibrator = None
                self.calibration_profile: int | None = None
                self.builder_optimization_level = None
                self.cache = None

            def set_memory_pool_limit(self, pool, size):
                log.append(("workspace", size))

            def set_flag(self, flag):
                self.flags.add(flag)

            def add_optimization_profile(self, p):
                self.profiles.append(p)
                return len(self.profiles) - 1

            def set_calibration_profile(self, p):
                self.calibration_profile = self.profiles.index(p)
                log.append(("calibration_profile", self.calibration_profile))

            def create_timing_cache(self, data):
                log.append(("timing_cache_in", bytes(data)))
                return Cache(bytes(data))

            def set_timing_cache(self, cache, ignore_mismatch):
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
                trt.configs.append(trt.config)
                return trt.config

            def create_optimization_profile(self):
                return Profile()

            def build_serialized_network(self, network, config):
                log.append(("build", network.flags, sorted(config.flags)))
                if trt.from_file:  # the "plan" carries the ONNX itself, as a real plan carries the network
                    stage = Path(trt.parsed).name.split(".")[0]
                    return f"ONNX:{len(config.profiles)}:{stage}:".encode() + Path(trt.parsed).read_bytes()
                return b"PLAN"

        class Parser:
            def __init__(self, network, logger) -> None:
                pass

            def parse_from_file(self, path):
                log.append(("parse", path))
                trt.parsed = path
                if trt.from_file:  # the ONNX's declared inputs, symbolic dims as -1 like TensorRT
                    from phyai_edge.engines.onnx_export import onnx_io

                    trt.inputs = {n: tuple(d if isinstance(d, int) else -1 for d in dims)
                                  for n, dims in onnx_io(path)["inputs"]}
                    trt.network.num_inputs = len(trt.inputs)
                return trt.parse_ok

            num_errors = 1

            def get_error(self, i):
                return "Unsupported op Foo"

        class Runtime:
            def __init__(self, logger) -> None:
                pass

            def deserialize_cuda_engine(self, data: bytes):
                data = bytes(data)
                if not data.startswith(b"ONNX:"):
                    return None
                _, profiles, stage, model = data.split(b":", 3)
                return FakeEngine(trt, stage.decode(), model, int(profiles))

        self.Logger, self.Builder, self.OnnxParser, self.Runtime = Logger, Builder, Parser, Runtime
        self.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=5)
        self.BuilderFlag = types.SimpleNamespace(FP16="FP16", BF16="BF16", INT8="INT8", FP8="FP8")
        self.MemoryPoolType = types.SimpleNamespace(WORKSPACE="ws")
        self.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")
        self.DataType = types.SimpleNamespace(**{v: v for v in _ONNX_TYPES.values()})
        if calibrator_base is not None:
            self.IInt8EntropyCalibrator2 = calibrator_base

    def register(self, tensors) -> None:
        """Make tensors reachable by address, as device memory is to a real engine."""
        for t in tensors:
            self.memory[t.data_ptr()] = t


class FakeEngine:
    """An "engine" over one stage's ONNX file (not TensorRT: see the module docstring)."""

    def __init__(self, trt: FakeTRT, stage: str, onnx_bytes: bytes, profiles: int) -> None:
        import onnx
        import onnxruntime as ort

        self.trt, self.stage = trt, stage
        self.num_optimization_profiles = max(profiles, 1)
        model = onnx.load_from_string(onnx_bytes)

        def info(vi):
            dims = tuple(d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim)
            return _ONNX_TYPES[vi.type.tensor_type.elem_type], dims

        self.io = {i.name: ("INPUT", *info(i)) for i in model.graph.input}
        self.io.update({o.name: ("OUTPUT", *info(o)) for o in model.graph.output})
        self.session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])

    @property
    def num_io_tensors(self) -> int:
        return len(self.io)

    def get_tensor_name(self, i: int) -> str:
        return list(self.io)[i]

    def get_tensor_mode(self, name: str) -> str:
        return self.io[name][0]

    def get_tensor_dtype(self, name: str) -> str:
        return self.io[name][1]

    def create_execution_context(self) -> FakeContext:
        ctx = FakeContext(self)
        self.trt.contexts.append(ctx)
        return ctx


class FakeContext:
    """Records shapes, addresses and profile; executes with onnxruntime (not TensorRT)."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.profile = 0
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.executions = 0

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        self.profile = index
        return True

    def set_input_shape(self, name: str, shape) -> bool:
        mode, _, dims = self.engine.io[name]
        shape = tuple(shape)
        if mode != "INPUT" or len(shape) != len(dims) or any(isinstance(d, int) and d != s for d, s in zip(dims, shape)):
            return False
        self.shapes[name] = shape
        return True

    def _symbols(self) -> dict[str, int]:
        sizes = {}
        for name, shape in self.shapes.items():
            for d, s in zip(self.engine.io[name][2], shape):
                if isinstance(d, str):
                    sizes[d] = s
        return sizes

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        sym = self._symbols()
        shape = tuple(d if isinstance(d, int) else sym.get(d, -1) for d in self.engine.io[name][2])
        if -1 in shape and self.engine.io[name][0] == "OUTPUT" and len(self.shapes) == len(self.engine.session.get_inputs()):
            shape = self._dry_run_shapes()[name]  # TensorRT infers output shapes; the stand-in runs once on zeros
        return shape

    def _dry_run_shapes(self) -> dict[str, tuple[int, ...]]:
        key = tuple(sorted(self.shapes.items()))
        if getattr(self, "_dry_key", None) != key:
            np_types = {"FLOAT": np.float32, "HALF": np.float16, "BOOL": np.bool_, "INT64": np.int64, "INT32": np.int32}
            feeds = {n: np.ones(s, np_types[self.engine.io[n][1]]) for n, s in self.shapes.items()}
            outs = [o.name for o in self.engine.session.get_outputs()]
            self._dry_key, self._dry = key, dict(zip(outs, (a.shape for a in self.engine.session.run(None, feeds))))
        return self._dry

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.addresses[name] = int(ptr)
        return True

    def _at(self, name: str) -> torch.Tensor:
        ptr = self.addresses.get(name)
        if ptr not in self.engine.trt.memory:
            raise RuntimeError(f"fake engine {self.engine.stage}: no tensor registered at the address bound to {name!r}")
        t = self.engine.trt.memory[ptr]
        if tuple(t.shape) != self.get_tensor_shape(name):
            raise RuntimeError(f"fake engine {self.engine.stage}: {name!r} bound to a {tuple(t.shape)} tensor, "
                               f"expected {self.get_tensor_shape(name)}")
        return t

    def execute_async_v3(self, stream: int) -> bool:
        names = list(self.engine.io)
        feeds = {n: self._at(n) for n in names if self.engine.io[n][0] == "INPUT"}
        outs = self.engine.session.run(None, {n: t.numpy() for n, t in feeds.items()})
        for name, arr in zip([n for n in names if self.engine.io[n][0] == "OUTPUT"], outs):
            self._at(name).copy_(torch.from_numpy(np.ascontiguousarray(arr)))
        self.executions += 1
        self.engine.trt.executed.append((self.engine.stage, {n: t.clone() for n, t in feeds.items()}))
        return True
