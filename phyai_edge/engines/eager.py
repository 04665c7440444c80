"""The reference engine: calls the adapter's stages as plain PyTorch, on CPU or GPU.

Every other backend is checked against this one on the same inputs and noise.
"""

from __future__ import annotations

import torch

from phyai_edge.adapters.base import Adapter, ModelInputs
from phyai_edge.engines.base import EngineBase
from phyai_edge.engines.rtc import RTCGuidance
from phyai_edge.engines.solver import integrate
from phyai_edge.engines.stages import run_prefix, stage_graph
from phyai_edge.engines.timing import StageTimer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


class EagerEngine(EngineBase):
    backend = "eager"
    any_views = True  # the stages run as the adapter wrote them, for whatever shapes they get

    def __init__(self, adapter: Adapter, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                 seed: int = 0) -> None:
        super().__init__(adapter, device, seed)
        self.dtype = resolve_dtype(dtype)
        module = adapter.module
        self.take_module(module, self.dtype)
        if next(module.parameters()).device.type != "meta":
            module.to(self.device)
        if hasattr(module, "set_precision"):
            module.set_precision(self.dtype)  # PI0.5: casts weights and sets its compute dtype
        else:
            module.to(self.dtype)
        module.eval().requires_grad_(False)


    @torch.no_grad()
    def run(self, inputs: ModelInputs, noise: torch.Tensor | None = None, rtc: RTCGuidance | None = None) -> torch.Tensor:
        a, b = self.adapter, inputs.batch_size
        noise = self.sample_noise(b) if noise is None else noise.to(self.device, torch.float32)
        timer = StageTimer(self.device)
        g = self._graph = getattr(self, "_graph", None) or stage_graph(a)
        # The adapter's stages, driven by name from its stage_specs (PI0.5: embed_images ->
        # encode_prefix -> N x denoise_step); nothing here is specific to one model.
        context = run_prefix(g, lambda name, feeds: a.stage(name)(*feeds.values()), inputs.tensors, self.device, timer)
        step = a.stage(g.step)
        with timer.stage("solver_loop"):
            chunk = integrate(lambda xt, t: step(xt, t, *context), noise, a.solver,
                              rtc.to(self.device) if rtc is not None else None)
        timer.ms[g.step] = timer.ms["solver_loop"] / a.solver.num_steps
        self._stage_ms = timer.ms
        return chunk
