"""The onnxruntime backend: each stage is an ONNX session; the shared solver loop drives them.

Files are laid out as `<model_dir>/b<B>/<stage>.onnx`, one static-shape file per stage and
batch size (what `phyai-edge export --backend onnx` writes into a bundle). Without a
`model_dir` the engine exports the adapter's stages itself into a temporary folder, which is
what `make_engine("onnxruntime", adapter)` does.

On CPU, tensors cross into onnxruntime as numpy arrays. With the CUDA execution provider,
inputs and outputs are bound in place to torch CUDA tensors (I/O binding), so nothing goes
through host memory; that path is written against the onnxruntime API but was not run here
(no GPU onnxruntime on the machines this was written on).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from phyai_edge.adapters.base import Adapter, ModelInputs
from phyai_edge.engines.base import EngineBase
from phyai_edge.engines.eager import resolve_dtype
from phyai_edge.engines.rtc import RTCGuidance
from phyai_edge.engines.solver import integrate
from phyai_edge.engines.stages import run_prefix, stage_graph
from phyai_edge.engines.timing import StageTimer

log = logging.getLogger(__name__)

_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(bool)": np.bool_,
       "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(double)": np.float64}
_TORCH = {np.float32: torch.float32, np.float16: torch.float16, np.bool_: torch.bool, np.int64: torch.int64,
          np.int32: torch.int32, np.float64: torch.float64}
_PRECISION_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def exact_guidance_error(backend: str) -> ValueError:
    return ValueError(
        f"RTC mode 'guided' needs autograd through the denoiser, which the {backend} engine does not have; "
        "use 'guided-approx' or 'inpaint' with this engine, or the eager / cudagraph backend for exact guidance"
    )


def stage_file(model_dir: Path, batch: int, stage: str) -> Path:
    return Path(model_dir) / f"b{batch}" / f"{stage}.onnx"


def default_providers(device: torch.device) -> list[str]:
    import onnxruntime as ort

    available = ort.get_available_providers()
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise RuntimeError(
                "device is CUDA but this onnxruntime has no CUDAExecutionProvider "
                f"(available: {available}); install onnxruntime-gpu or run on device='cpu'"
            )
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class _Stage:
    """One onnxruntime session and the static metadata of its inputs and outputs."""

    def __init__(self, path: Path, providers: list[Any], device: torch.device, threads: int | None) -> None:
        import onnxruntime as ort

        if not path.exists():
            raise FileNotFoundError(f"ONNX stage file missing: {path}")
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
        # onnxruntime's worker threads busy-wait between runs by default; on a robot computer
        # that steals cores from the control clock, cameras and torch (eager reference runs
        # in the same process slowed ~100x on two cores), for a few microseconds of latency.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
        self.path = path
        self.device = device
        try:
            self.session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        except Exception as exc:
            if type(exc).__name__ != "InvalidGraph":
                raise
            # onnxruntime up to 1.30 fuses float8 Q/DQ pairs around a Gemm / Conv into QGemm /
            # QLinearConv, which have no float8 kernels, and then rejects its own graph (1.32 does
            # not). The basic level leaves Q/DQ unfused; a graph that is really invalid fails again.
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
            self.session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
            log.warning("onnxruntime %s rejected %s after its full graph optimisations (%s); running it with "
                        "basic optimisations", ort.__version__, path.name, str(exc).splitlines()[0][:200])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [(o.name, tuple(o.shape), _NP[o.type]) for o in self.session.get_outputs()]

    def __call__(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise KeyError(f"{self.path.name}: inputs {missing} not provided")
        if self.device.type == "cuda":
            return self._run_bound(feeds)
        arrays = {n: feeds[n].detach().cpu().contiguous().numpy() for n in self.inputs}
        return [torch.from_numpy(np.ascontiguousarray(o)) for o in self.session.run(None, arrays)]

    def _run_bound(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # Inputs and outputs stay on the GPU as torch tensors; onnxruntime reads and writes
        # them in place. Outputs are preallocated from the static shapes in the file.
        dev_id = self.device.index or 0
        torch.cuda.current_stream(self.device).synchronize()  # inputs written by torch kernels
        binding = self.session.io_binding()
        keep = []
        for n in self.inputs:
            t = feeds[n].to(self.device).contiguous()
            keep.append(t)
            binding.bind_input(n, "cuda", dev_id, _np_of(t.dtype), list(t.shape), t.data_ptr())
        outs = []
        for name, shape, np_dtype in self.outputs:
            if any(not isinstance(d, int) for d in shape):
                raise RuntimeError(f"{self.path.name}: output {name} has a symbolic shape {shape}; "
                                   "bundles export static shapes")
            out = torch.empty(shape, dtype=_TORCH[np_dtype], device=self.device)
            binding.bind_output(name, "cuda", dev_id, np_dtype, list(shape), out.data_ptr())
            outs.append(out)
        binding.synchronize_inputs()
        self.session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        return outs


def _np_of(dtype: torch.dtype) -> type:
    for np_t, t in _TORCH.items():
        if t == dtype:
            return np_t
    raise TypeError(f"no onnxruntime binding for {dtype}")


class OnnxRuntimeEngine(EngineBase):
    backend = "onnxruntime"

    def __init__(
        self,
        adapter: Adapter,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        seed: int = 0,
        model_dir: str | Path | None = None,
        batch_sizes: list[int] | tuple[int, ...] = (1,),
        num_views: int | None = None,
        providers: list[Any] | None = None,
        threads: int | None = None,
    ) -> None:
        super().__init__(adapter, device, seed)
        self.batch_sizes = sorted(set(batch_sizes))
        self.num_views = num_views or len(getattr(adapter, "camera_names", [])) or None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if model_dir is None:
            # Export on the fly (tests, `make_engine`): the bundle path is the deployed one.
            from phyai_edge.engines.onnx_export import export_ready, export_stage

            self._tmp = tempfile.TemporaryDirectory(prefix="phyai-ort-")
            model_dir = Path(self._tmp.name)
            precision = _PRECISION_NAMES[resolve_dtype(dtype)]
            with export_ready(adapter, precision) as twin:
                for b in self.batch_sizes:
                    for spec in twin.stage_specs(b, self.num_views):
                        export_stage(twin.module, spec, stage_file(model_dir, b, spec.name))
        self.model_dir = Path(model_dir)
        self.providers = providers or default_providers(self.device)
        self.sessions: dict[int, dict[str, _Stage]] = {
            b: {name: _Stage(stage_file(self.model_dir, b, name), self.providers, self.device, threads)
                for name in adapter.stage_names()}
            for b in self.batch_sizes
        }


    def _stages(self, batch: int) -> dict[str, _Stage]:
        try:
            return self.sessions[batch]
        except KeyError:
            raise ValueError(f"this ONNX engine was exported for batch sizes {self.batch_sizes}, not {batch}; "
                             "re-export with --batch including it") from None

    @torch.no_grad()
    def run(self, inputs: ModelInputs, noise: torch.Tensor | None = None, rtc: RTCGuidance | None = None) -> torch.Tensor:
        if rtc is not None and rtc.mode == "guided":
            raise exact_guidance_error(self.backend)
        a, b = self.adapter, inputs.batch_size
        stages = self._stages(b)
        noise = self.sample_noise(b) if noise is None else noise.to(self.device, torch.float32)
        timer = StageTimer(self.device)
        g = self._graph = getattr(self, "_graph", None) or stage_graph(a)
        # Stages by name from the adapter's stage_specs; each session is fed by input name.
        context = dict(zip(g.step_context, run_prefix(g, lambda name, feeds: stages[name](feeds), inputs.tensors,
                                                      self.device, timer)))
        denoise = stages[g.step]

        def velocity(xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            (vel,) = denoise({g.step_x: xt, g.step_t: t, **context})
            return vel.to(self.device, torch.float32)

        with timer.stage("solver_loop"):
            chunk = integrate(velocity, noise, a.solver, rtc.to(self.device) if rtc is not None else None)
        timer.ms[g.step] = timer.ms["solver_loop"] / a.solver.num_steps
        self._stage_ms = timer.ms
        return chunk
