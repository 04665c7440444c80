"""The CUDA-graph backend: the eager model's stages replayed from captured graphs.

Two paths, chosen by the adapter's stage graph. PI0.5's (`embed_images -> encode_prefix ->
denoise_step`) is everything listed below and is the one measured on GPUs. Any other adapter
takes the generic path, so a new model needs no change here: static input buffers laid out from
its `stage_specs` and filled by name from `ModelInputs.tensors`, one graph for all its per-chunk
stages in order (external events inside it time each stage), one graph per RTC mode for the
solver loop of its last stage (`static_euler`, the loop PI0.5's path runs too), precision via the
module's `set_precision` or a plain cast. Its capture has not yet been run on a GPU.

What makes the PI0.5 path fast (each is exact, or equal within rounding, to the eager engine):
- Static buffers and three graphs per (batch, views, prompt bucket): vision, prefix (writes the
  KV cache once per chunk) and the whole solver loop (all flow steps, RTC guidance included:
  the exact vector-Jacobian product is captured too; RTC masks are per-sample (B, H, D) and
  (B, H, 1) buffers, so one graph serves any mix of robots' delays). At batch 1 the eager model is
  launch-bound (thousands of small kernels per chunk); a replay launches them from the GPU.
  Vision and prefix are separate graphs so each stage is timed with events at no cost
  (one extra replay launch, a few microseconds).
- Prompt padding trimmed: tokens are right-padded, so the prefix is cut to the batch's longest
  valid prompt rounded up to `token_bucket`; padded tokens take no position and no valid token
  attends to them, so the valid outputs are unchanged and the prefix does less work. A batch of 8 or
  more whose prompts all have one length (evaluation, rollouts) keeps exactly that length, for up to
  EXACT_PROMPT_LENGTHS lengths per shape: no padding left, so the unmasked graphs below serve it.
- An unmasked prefix for full batches of 8 or more (`dense_prefix`, with the fused stages): a batch whose
  trimmed prompts have no padding and whose cameras are all present replays a second prefix graph
  whose attention takes no mask (SDPA's fastest kernel; cuDNN's on Hopper) and writes its KV
  cache straight into the buffers the loop reads. Padded batches replay the masked one.
- An unmasked action expert for full batches of 8 or more (`dense_expert`, with the fused stages):
  the KV cache has room after the prefix for the chunk's own keys, each expert block writes its
  keys and values there (in its RoPE kernel) and attends to the one buffer with no mask (cuDNN's
  kernel on Hopper, faster than the split kernel from batch ~8), in a twin of the loop graph
  chosen per call like the unmasked prefix. Not for exact RTC guidance (its backward would read
  keys the next block overwrites in place): that mode keeps the masked loop.
- Adaptive-norm tables: every adaptive RMSNorm's scale/shift/gate depends on the flow time
  only, so they are computed once per solver time grid, not read from 37 conditioning
  matrices on every step.
- Fused projections (QKV, gate/up) and key-only attention masks with grouped-query folding
  (see `layers.fused`, `layers.attention`).
- Optional fp8 (E4M3) weights and activations for the action expert (`fp8="expert"`) or every
  attention / MLP projection (`fp8="all"`): `layers.fp8`, `torch._scaled_mm` on Ada / Hopper,
  its plain-torch reference elsewhere. Converted after the precision is set and after fusion, so
  the fused QKV and gate/up GEMMs are the ones quantised (see `layers/fp8.py` for why).
- Fused Triton kernels for the vision tower's, the prefix's and the action expert's elementwise
  chains and attention (`triton_ops`: norm + modulation, residual + the next norm, RoPE out of the
  fused QKV, GeGLU, SigLIP's LayerNorm / residual + LayerNorm / GELU, split-KV attention;
  `layers.triton_ops`, `layers.triton_attention`), chosen around the model
  (`PI05Model.triton_stages`). On by default on a CUDA device with triton installed, with or
  without fp8 (the stacks call the fp8 linears as they are; H200, batch 32: fp8 prefix with static
  scales and the Triton ops 165.8 samples/s, bf16 with them 127.4, benchmarks/RESULTS.md);
  `triton_ops=False` turns them off.
  `triton_gemm` also runs the action expert's projections in the denoise step on small-M Triton
  GEMMs with RoPE / GeGLU in their epilogues (`layers.triton_gemm`), where a call has at most 64
  rows (batch 1): on by default with the Triton ops on CUDA (H200: 18.5 -> 17.5 ms a batch-1
  chunk); the prefix's compute-bound GEMMs and larger batches stay on cuBLAS.
- The first flow step beside the prefix (`early_step`, with the fused stages; batches up to
  EARLY_STEP_MAX_BATCH, every RTC mode): step 0's velocity depends only on the noise and the prefix
  cache, and its block i only on the prefix's block-i keys, so a second prefix graph runs it on a
  side stream, each expert block waiting for its prefix block's keys (events recorded as they are
  written), in the SMs the prefix leaves idle; the loop graph then starts from that velocity (a
  full batch from 8: another, beside the unmasked prefix; exact guidance with
  EARLY_STEP_GUIDED: another, whose step takes its gradient there too). The same
  operations on the same inputs, so the same chunk (bit for bit on the H200); there a batch-1 chunk
  took 14.86 against 15.26 ms (-2.7%; -2.9% with guided-approx), engines alternated; batch 2 and 4
  -2.1% and -2.3% on an H100, batch 8 -2.3% on the H200; from batch 16 the prefix slows by about
  what the step saves.
- Optional `torch.compile` of the stage functions (inductor fuses norms, RoPE, GeGLU and
  residuals) underneath the same graphs.

On a CPU (or when capture fails) the same static-buffer code runs eagerly, with one log line:
that is what the CPU tests check against `EagerEngine`.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from phyai_edge.adapters.base import Adapter, ModelInputs, SolverSpec
from phyai_edge.engines.base import EngineBase
from phyai_edge.engines.eager import resolve_dtype
from phyai_edge.engines.rtc import RTCGuidance, guidance_weight
from phyai_edge.engines.solver import exact_guidance
from phyai_edge.engines.stages import StageGraph, stage_graph
from phyai_edge.layers.fused import fuse_projections

log = logging.getLogger(__name__)

LOOP_MODES = ("none", "inpaint", "guided-approx", "guided")
# The unmasked prefix graph from this batch size: H200 (RESULTS.md 2026-12-03, third session call 4)
# prefix 156.3 vs 158.4 ms at batch 32, 39.2 vs 39.6 at 8, but 5.41 vs 5.28 at batch 1 (cuDNN's
# kernel against the split kernel's small-batch tiling, plus the cache copy).
DENSE_PREFIX_MIN_BATCH = 8
# The unmasked action expert from this batch size: H200, attention alone (RESULTS.md 2026-12-03,
# sixth session call 10): SDPA without a mask 27.2 vs the split kernel's 29.9 us a block at batch 8,
# 29.0 vs 41.7 at 32, 55.6 vs 91.1 at 64, but 26.2 vs 13.8 at batch 1.
DENSE_EXPERT_MIN_BATCH = 8
# A batch whose prompts all have the same length keeps exactly that many positions (no padding, so
# the unmasked graphs serve it) for at most this many lengths per (batch, views); later lengths are
# rounded to the bucket as other batches are. Each length is a graph set (captured at first use).
EXACT_PROMPT_LENGTHS = 4
# `early_step` up to this batch: where the prefix leaves SMs idle and the step is small beside it.
# Engines alternated, the same chunk bit for bit (RESULTS.md): batch 1 -2.7% (H200), batch 2 -2.1%
# and batch 4 -2.3% (H100), batch 8 -2.3% full / -1.8% padded, batch 16 -0.7%, batch 32 +0.7% (H200):
# the prefix takes more of the step as the batch grows. From batch 8 a full batch runs it beside
# the unmasked prefix, on the unmasked expert.
EARLY_STEP_MAX_BATCH = 8
# ... and in exact RTC guidance, the first step's gradient taken there too (another prefix graph,
# autograd on the side stream). H100, engines alternated, the same chunk bit for bit (RESULTS.md,
# twenty-third session call 1): batch 1 -1.5%, batch 8 -0.3% full / -1.0% padded. Less than the
# unguided step saves: the guided step is 2.1 ms beside a 5.6 ms prefix, and hides ~0.5 ms of it.
EARLY_STEP_GUIDED = True
# The stage graph the PI0.5 path is written for; any other graph takes the generic path.
PI05_STAGES = ("embed_images", "encode_prefix", "denoise_step")


@contextmanager
def float32_matmuls_in_tf32(on: bool) -> Iterator[None]:
    """While open (with `on`), float32 matmuls may run in TF32 on tensor cores; the process's own
    setting is restored after. A bf16 / fp16 engine captures its graphs inside it: the float32
    layers it keeps (PI0.5's action projections) then replay as TF32 GEMMs, whose 10-bit mantissa
    is finer than the bf16 activations around them, instead of cuBLAS's SIMT SGEMMs, which left
    the batch-1 loop 0.32 ms slower on the H200 (`phyai-edge bench`, RESULTS.md 2026-12-04,
    fourteenth session). A float32 engine is captured as the process says (its tests compare at
    1e-4 and below)."""
    matmul = torch.backends.cuda.matmul
    if not on:
        yield
        return
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9: its own API only (mixing the two raises)
        before = matmul.fp32_precision
        matmul.fp32_precision = "tf32"
        try:
            yield
        finally:
            matmul.fp32_precision = before
    else:  # pragma: no cover - torch < 2.9
        legacy = matmul.allow_tf32
        matmul.allow_tf32 = True
        try:
            yield
        finally:
            matmul.allow_tf32 = legacy


def prompt_bucket(token_mask: torch.Tensor, bucket: int, exact: bool = False, at_least: int = 0) -> int:
    """How many prompt positions the prefix must keep: the longest valid prompt in the batch (or
    `at_least`, if more), rounded up to `bucket`, when every row is right-padded (valid tokens
    first); else all. `exact`: when every row has the same number of valid tokens, at least
    `at_least`, that number (no padding left)."""
    mask = token_mask.detach().to("cpu", torch.bool)
    length = mask.shape[1]
    valid = mask.sum(dim=1)
    right_padded = bool((mask == (torch.arange(length)[None, :] < valid[:, None])).all())
    if not right_padded or bucket <= 0:
        return length
    longest = max(int(valid.max()), 1)
    if exact and int(valid.min()) == longest >= at_least:
        return longest
    return _bucketed(max(longest, at_least), bucket, length)


def _bucketed(tokens: int, bucket: int, length: int) -> int:
    """`tokens` prompt positions rounded up to the bucket, at most the prompt's padded `length`."""
    return min(length, math.ceil(tokens / bucket) * bucket)


class _HostStaging:
    """Pinned host buffers that host-made values pass through on their way to a CUDA device:
    from pinned memory a copy is queued without blocking the host (from pageable memory the host
    waits for the stream to reach it). One buffer per name, reused while the shape holds; before
    the buffers are rewritten, the copies queued from them last time are waited for."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.done: Any = None  # a CUDA event after the last queued copies

    def copy(self, dst: torch.Tensor, src: torch.Tensor, name: str, stage: bool) -> None:
        """dst.copy_(src), through this staging's buffer `name` when `stage` (src on the host,
        dst on a CUDA device)."""
        if not stage:
            dst.copy_(src)
            return
        buf = self.buffers.get(name)
        if buf is None or buf.shape != src.shape or buf.dtype != dst.dtype:
            buf = torch.empty(src.shape, dtype=dst.dtype, pin_memory=dst.is_cuda)
            self.buffers[name] = buf
        buf.copy_(src)
        dst.copy_(buf, non_blocking=dst.is_cuda)

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()

    def queued(self, device: torch.device) -> None:
        if device.type == "cuda":
            self.done = torch.cuda.Event()
            self.done.record()


@dataclass
class _GraphSet:
    """Static buffers and graphs for one (batch, views, prompt length)."""

    key: tuple[int, int, int]
    inputs: dict[str, torch.Tensor]
    pool: Any = None
    image_embeds: torch.Tensor | None = None
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    vision_graph: torch.cuda.CUDAGraph | None = None
    prefix_graph: torch.cuda.CUDAGraph | None = None
    # The prefix for a batch with no padding and every camera present: attention without a mask,
    # writing the same KV buffers (`dense_prefix`).
    prefix_dense_graph: torch.cuda.CUDAGraph | None = None
    # (`dense_expert`) The KV cache with room for the chunk's own keys after the prefix: (layers, B,
    # kv heads, prefix + chunk, head dim) keys and values; `kv[0]` / `kv[1]` are its prefix positions.
    kv_room: tuple[torch.Tensor, torch.Tensor] | None = None
    loop_bufs: dict[str, torch.Tensor] = field(default_factory=dict)
    loops: dict[tuple, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = field(default_factory=dict)
    # (`early_step`) The prefix with the first flow step beside it on the `side` CUDA stream, which
    # writes loop_bufs["first_velocity"], per (unmasked prefix, unmasked expert, exact guidance):
    # captured on first use, None where that capture failed (those calls run the whole loop).
    prefix_steps: dict[tuple[bool, bool, bool], torch.cuda.CUDAGraph | None] = field(default_factory=dict)
    side: Any = None
    eager: bool = False
    staging: _HostStaging = field(default_factory=_HostStaging)  # the call's host-made noise and RTC values


@dataclass
class _StageSet:
    """Static buffers and graphs for one (batch, views) of an adapter on the generic path."""

    key: tuple[int, int | None]
    inputs: dict[str, torch.Tensor]
    pool: Any = None
    context: list[torch.Tensor] = field(default_factory=list)
    chunk_graph: torch.cuda.CUDAGraph | None = None
    # Recorded inside the per-chunk graph after each stage, so one replay still times every stage.
    stage_events: list[Any] = field(default_factory=list)
    loop_bufs: dict[str, torch.Tensor] = field(default_factory=dict)
    loops: dict[tuple, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = field(default_factory=dict)
    eager: bool = False
    staging: _HostStaging = field(default_factory=_HostStaging)  # the call's host-made noise and RTC values


def static_euler(velocity: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor], bufs: dict[str, torch.Tensor],
                 mode: str, solver: SolverSpec, first: torch.Tensor | None = None) -> torch.Tensor:
    """The Euler loop of `engines.solver.integrate`, with every per-call quantity (noise, RTC
    target, per-sample soft mask (B, H, D), per-sample hard prefix (B, H, 1), guidance
    weights) read from static buffers so it can be captured. `velocity(i, x, t)` is step i.
    `first`: step 0's velocity made beforehand from the noise (`first_velocity`, beside the
    prefix): in exact guidance the guided one (`guided_velocity`), else the model's, which
    guided-approx then corrects here as any step's."""
    noise, target, mask, fixed, weight = bufs["noise"], bufs["target"], bufs["mask"], bufs["fixed"], bufs["weight"]
    x = noise
    dt = solver.dt
    batch = noise.shape[0]
    times = solver.times()
    next_times = [*times[1:], solver.t_end]  # as integrate(): the last is exactly t_end
    for i, t in enumerate(times):
        tt = torch.full((batch,), t, dtype=torch.float32, device=noise.device)
        if i == 0 and first is not None:
            vel = first
        elif mode == "guided":
            vel = guided_velocity(lambda x_in, i=i, tt=tt: velocity(i, x_in, tt), x, t, bufs, i)
        else:
            vel = velocity(i, x, tt)
        if mode == "guided-approx":
            vel = vel - weight[i] * ((target - (x - t * vel)) * mask)
        x = x + dt * vel
        if mode == "inpaint":
            t_next = next_times[i]
            x = torch.where(fixed, t_next * noise + (1.0 - t_next) * target, x)
    return x


def guided_velocity(velocity: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, t: float,
                    bufs: dict[str, torch.Tensor], i: int = 0) -> torch.Tensor:
    """Step i's exactly guided velocity (`solver.exact_guidance`) from the static RTC buffers."""
    return exact_guidance(velocity, x, t, bufs["target"], bufs["mask"], bufs["weight"][i])


def _takes(fn: Callable[..., Any] | None, argument: str) -> bool:
    """Whether a stage function has a parameter of that name (an option it may be handed)."""
    try:
        return fn is not None and argument in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature to read
        return False


class CudaGraphEngine(EngineBase):
    backend = "cudagraph"

    def __init__(
        self,
        adapter: Adapter,
        device: str | torch.device = "cuda",
        dtype: str | torch.dtype = "bfloat16",
        seed: int = 0,
        *,
        fuse: bool = True,
        trim_prompt: bool = True,
        token_bucket: int = 16,
        modulation_tables: bool = True,
        compile: bool = False,
        compile_mode: str | None = None,
        graphs: bool = True,
        capture: list[tuple[int, int]] | None = None,
        fp8: str | None = None,
        fp8_scales: Any = None,
        fp8_activations: str | None = None,
        triton_ops: bool | str | None = None,
        triton_gemm: bool | None = None,
        dense_prefix: bool = True,
        dense_expert: bool = True,
        early_step: bool = True,
    ) -> None:
        super().__init__(adapter, device, seed)
        self.dtype = resolve_dtype(dtype)
        module = adapter.module
        if next(module.parameters()).device.type == "meta":
            raise ValueError("the cudagraph engine needs real weights (the model is on the meta device)")
        # PI0.5's path (prompt trimming, KV-cache graphs, modulation tables) only for PI0.5's
        # graph; any other adapter's stages run from buffers laid out by its own stage_specs.
        self._graph: StageGraph = stage_graph(adapter)
        self.generic = tuple(self._graph.names) != PI05_STAGES
        self.any_views = not self.generic  # PI0.5's graph sets are per (batch, views, prompt length)
        if self.generic and fp8 is not None:  # the scopes name PI0.5's submodules
            raise ValueError(f"fp8={fp8!r} is for PI0.5's stages; adapter {getattr(adapter, 'name', '?')!r} "
                             f"has {self._graph.names}")
        if fp8 is not None:
            from phyai_edge.layers.fp8 import SCOPES

            if fp8 not in SCOPES:  # before touching the model
                raise ValueError(f"fp8={fp8!r}: choose one of {tuple(SCOPES)} or None")
        if triton_ops is None:  # the default: the kernels where they can run on a GPU, else the model's own stages
            from phyai_edge.layers.triton_ops import triton_available

            triton_ops = self.device.type == "cuda" and triton_available() and hasattr(module, "triton_stages")
        triton_backend = {False: None, True: "auto"}.get(triton_ops, triton_ops)  # type: ignore[call-overload]
        if triton_backend not in (None, "auto", "triton", "reference"):
            raise ValueError(f"triton_ops={triton_ops!r}: choose True, False, 'auto', 'triton' or 'reference'")
        self.triton_ops: str | None = None  # the path the fused ops take: "triton" or "reference"
        if triton_backend is not None:  # before touching the model
            if not hasattr(module, "triton_stages"):
                raise ValueError(f"triton_ops: {type(module).__name__} has no Triton stages")
            from phyai_edge.layers.triton_ops import resolve_backend

            self.triton_ops = resolve_backend(triton_backend, self.device)
        if triton_gemm and triton_backend is None:
            raise ValueError("triton_gemm=True runs inside the fused Triton path: it needs triton_ops on "
                             "(True, 'auto' or 'triton'; the default turns it on only on CUDA)")
        if triton_gemm is None:  # the default: with the Triton path on a GPU (measured faster at batch 1)
            triton_gemm = self.triton_ops == "triton" and self.device.type == "cuda"
        self.triton_gemm = bool(triton_gemm)
        self.take_module(module, self.dtype)
        module.to(self.device)
        if hasattr(module, "set_precision"):
            module.set_precision(self.dtype)
        else:  # a model without PI0.5's hook: cast it, as the eager engine does
            module.to(self.dtype)
        module.eval().requires_grad_(False)
        self.module = module
        self.trim_prompt, self.token_bucket = trim_prompt, token_bucket
        # Prompt positions every call keeps at least (`Policy.fix_prompt_positions`): a caller whose
        # prompt's length varies with the robot state then runs one graph set for all of them.
        self.min_prompt_positions = 0
        self.modulation_tables = modulation_tables and hasattr(module, "time_modulation")
        if hasattr(module, "attend_keys_only"):
            module.attend_keys_only = True
        self.fused = fuse_projections(module) if fuse else 0
        # fp8 last: set_precision drops fp8 linears (and fusions), so converting earlier would be undone,
        # and quantising after fusion makes the fused QKV / gate-up GEMMs the fp8 ones.
        self.fp8, self.fp8_linears = fp8, 0
        if fp8 is not None:
            from phyai_edge.layers.fp8 import convert_fp8, fp8_linears

            if isinstance(fp8_scales, (str, Path)):
                from phyai_edge.calibration.fp8 import load_scales

                fp8_scales = load_scales(fp8_scales)
            self.fp8_linears = convert_fp8(module, fp8, fp8_scales, fp8_activations)
            paths = sorted({m.backend for m in fp8_linears(module)})
            log.info("cudagraph: %d linears in fp8 E4M3 (%s; %s activation scales; %s path)", self.fp8_linears,
                     fp8, fp8_activations or ("static" if fp8_scales else "dynamic"), "/".join(paths))
        self.use_graphs = graphs and self.device.type == "cuda"
        if graphs and not self.use_graphs:
            log.info("cudagraph engine on %s: CUDA graphs need a CUDA device; running the same code eagerly",
                     self.device)
        self._stages: dict[str, Callable[..., Any]] = {n: adapter.stage(n) for n in adapter.stage_names()}
        self._views: int | None = len(getattr(adapter, "camera_names", ()) or ()) or None
        self._stage_sets: dict[tuple[int, int | None], _StageSet] = {}
        if triton_backend is not None:
            # Around the model, not in it: the model's Triton stage functions replace its own
            # (same contract). Fused projections and fp8 linears are called as they are.
            from phyai_edge.layers.triton_ops import triton_status

            self._stages.update(module.triton_stages(triton_backend, gemm=True) if self.triton_gemm
                                else module.triton_stages(triton_backend))
            log.info("cudagraph: vision, prefix and action expert elementwise chains on the fused ops%s (%s)",
                     " and the action expert's projections on the small-M Triton GEMMs" if self.triton_gemm else "",
                     triton_status(self.device)[1] if self.triton_ops == "triton"
                     else f"reference path: {triton_status(self.device)[1]}")
        # A second prefix graph for batches with no padded prompt token and every camera present,
        # whose attention takes no mask (the fused prefix stage's `dense`), from DENSE_PREFIX_MIN_BATCH.
        # Chosen per call from the masks, on the host.
        self.dense_prefix = bool(dense_prefix and triton_backend is not None and not self.generic)
        # A twin of the loop graph for the same batches whose action expert attends with no mask to
        # a KV cache with room for its own keys, from DENSE_EXPERT_MIN_BATCH (not in exact RTC mode).
        self.dense_expert = bool(dense_expert and triton_backend is not None and not self.generic)
        # The first flow step beside the prefix (up to EARLY_STEP_MAX_BATCH), where the stages take its
        # hooks (the fused ones).
        self.early_step = bool(early_step and not self.generic and not compile
                               and _takes(self._stages.get("encode_prefix"), "kv_ready")
                               and _takes(self._stages.get("denoise_step"), "kv_wait"))
        self.last_early_step = False  # whether the last `run` ran its first flow step beside the prefix
        if compile:
            kw = {"mode": compile_mode} if compile_mode else {}
            # Compiled steps make their own context: a per-chunk attention callable handed in as an
            # argument would be a new guard (a recompile) every chunk run without graphs.
            self._stages.pop("step_context", None)
            self._stages.pop("fold_modulation", None)
            self._stages = {n: torch.compile(f, dynamic=False, **kw) for n, f in self._stages.items()}
        self._sets: dict[tuple[int, int, int], _GraphSet] = {}
        self._exact_lengths: dict[tuple[int, int], set[int]] = {}  # (batch, views) -> uniform prompt lengths kept
        self._tables: dict[SolverSpec, list[Any]] = {}
        self._rtc_weights: dict[tuple[SolverSpec, float], torch.Tensor] = {}  # guidance weight per step
        for batch, views in capture or []:
            self.warmup(batch, views)

    # -- public ---------------------------------------------------------------------------

    @property
    def graphs_built(self) -> int:
        """Graph sets and solver loops built so far, each a capture where graphs are on: compared
        across a call, it says whether that call met a shape or RTC mode for the first time."""
        sets = [*self._sets.values(), *self._stage_sets.values()]
        return len(sets) + sum(len(s.loops) + len(getattr(s, "prefix_steps", ())) for s in sets)

    def warmup(self, batch: int, views: int, prompt_tokens: int | None = None,
               modes: tuple[str, ...] = ("none",)) -> None:
        """Capture the graphs for a shape before the first real call (start-up, not first tick).
        `prompt_tokens` is PI0.5's (prompt trimming); the generic path has no prompt to trim."""
        if self.generic:
            ss = self._stage_set(batch, views)
            for mode in modes:
                self._stage_loop_graph(ss, mode, self.adapter.solver)
            return
        cfg = self.adapter.cfg
        length = cfg.max_token_len
        if prompt_tokens is not None and self.trim_prompt:
            mask = (torch.arange(length)[None, :] < prompt_tokens).expand(batch, length)
            length = self._prompt_length(mask, views)
        gs = self._graph_set(batch, views, length)
        dense_prefix, dense_expert = self._unmasked(batch)
        for mode in modes:
            # a padded batch's graphs, then a full batch's where they differ
            shapes = {(False, False), (dense_prefix, dense_expert and mode != "guided")}
            for prefix_dense, expert_dense in sorted(shapes):
                self._loop_graph(gs, mode, self.adapter.solver, expert_dense,
                                 self._first_step(gs, mode, prefix_dense, expert_dense))

    @property
    def prompt_room(self) -> int | None:
        """The most valid prompt tokens a batch may have and still run the graphs of the room kept
        (`min_prompt_positions` rounded up to the bucket, as `prompt_bucket` rounds it); None where
        no room is kept (any new length would build graphs) or nothing is trimmed."""
        floor = self.min_prompt_positions
        if self.generic or not self.trim_prompt or self.token_bucket <= 0 or floor <= 0:
            return None
        return _bucketed(floor, self.token_bucket, self.adapter.cfg.max_token_len)

    @torch.no_grad()
    def run(self, inputs: ModelInputs, noise: torch.Tensor | None = None, rtc: RTCGuidance | None = None) -> torch.Tensor:
        if self.generic:
            return self._run_generic(inputs, noise, rtc)
        a, b = self.adapter, inputs.batch_size
        x = inputs.tensors
        images, token_mask = x["images"], x["token_mask"]
        length = self._prompt_length(token_mask, images.shape[1]) if self.trim_prompt else token_mask.shape[1]
        gs = self._graph_set(b, images.shape[1], length)
        mode = rtc.mode if rtc is not None else "none"
        if mode not in LOOP_MODES:
            raise ValueError(f"RTC mode {mode!r} is not a solver mode; solver modes are {LOOP_MODES[1:]}")
        solver = a.solver
        # Every camera present and no padded prompt token (asked only where an unmasked graph exists:
        # each test waits for the device)
        dense_prefix, dense_expert = self._unmasked(b)
        dense_expert = dense_expert and mode != "guided"
        if dense_prefix or dense_expert:
            full = bool(x["image_mask"].all()) and bool(token_mask[:, :length].all())
            dense_prefix, dense_expert = dense_prefix and full, dense_expert and full
        first = self._first_step(gs, mode, dense_prefix, dense_expert)
        early = first is not None
        graph, out = self._loop_graph(gs, mode, solver, dense_expert, first)
        ins = gs.inputs
        bufs = gs.loop_bufs

        def copy_rest() -> None:
            ins["image_mask"].copy_(x["image_mask"])
            ins["tokens"].copy_(x["tokens"][:, :length])
            ins["token_mask"].copy_(token_mask[:, :length])
            if noise is None:
                bufs["noise"].copy_(self.sample_noise(b))
            if noise is not None or rtc is not None:
                self._load_host_values(gs, noise, rtc, solver, b)

        # Inputs already on the device are copied while the vision graph runs (stream order keeps
        # them before the graphs that read them). A copy from pageable host memory would block the
        # host until the stream reaches it, i.e. until vision ends, and delay the next launch: those
        # go first. Noise and RTC values given from the host pass through pinned buffers
        # (`_load_host_values`): late.
        late = all(t.device.type == self.device.type for t in (x["image_mask"], x["tokens"], token_mask))
        if not late:
            copy_rest()
        ins["images"].copy_(images)
        marks = [self._mark()]
        self._replay(gs, "vision")
        marks.append(self._mark())
        if late:
            copy_rest()
        prefix_start = self._mark()
        self._replay(gs, "prefix", dense_prefix, first)
        marks += [prefix_start, self._mark()]
        if graph is not None:
            graph.replay()
            chunk = out
        else:
            chunk = self._loop(gs, mode, solver, dense_expert, early)
        marks.append(self._mark())
        ms = _elapsed_ms(marks)
        # With the first step beside the prefix, the prefix's time holds what of it did not overlap
        # and the loop's the other steps.
        steps = solver.num_steps - 1 if early and solver.num_steps > 1 else solver.num_steps
        self.last_early_step = early
        self._stage_ms = {"embed_images": ms[0], "encode_prefix": ms[2], "solver_loop": ms[3],
                          "denoise_step": ms[3] / steps}
        return chunk.clone()

    def _unmasked(self, batch: int) -> tuple[bool, bool]:
        """Whether a batch of this size has the unmasked prefix graph and the unmasked action-expert
        loop (with the KV cache's room): the options, and the sizes from which they were measured
        faster. A call uses them only when its batch is full (`run`)."""
        return (self.dense_prefix and batch >= DENSE_PREFIX_MIN_BATCH,
                self.dense_expert and batch >= DENSE_EXPERT_MIN_BATCH)

    def _early_batch(self, batch: int) -> bool:
        return self.early_step and batch <= EARLY_STEP_MAX_BATCH

    def _first_step(self, gs: _GraphSet, mode: str, dense_prefix: bool,
                    dense_expert: bool) -> tuple[bool, bool, bool] | None:
        """Where a call runs its first flow step beside the prefix (`early_step`), the key of that
        prefix graph (unmasked prefix, unmasked expert, exact guidance: its step takes the
        gradient there too), captured here on first use; None where it does not (a batch above
        EARLY_STEP_MAX_BATCH, exact guidance without EARLY_STEP_GUIDED, or a failed capture).
        `warmup` and `run` both ask this, so a warm-up captures what a call will replay."""
        if not self._early_batch(gs.key[0]):
            return None
        key = (dense_prefix, dense_expert, mode == "guided")
        # the unmasked expert writes its cache in place: no gradient there
        if key[2] and (dense_expert or not EARLY_STEP_GUIDED):
            return None
        if gs.eager:
            return key
        if key not in gs.prefix_steps:
            self._capture_prefix_step(gs, key)
        return key if gs.prefix_steps[key] is not None else None

    def _prompt_length(self, token_mask: torch.Tensor, views: int) -> int:
        """The prompt positions this batch keeps (`prompt_bucket`). Exact, not rounded to the bucket,
        for a batch of one prompt length (evaluation, rollouts: one task for every robot) where an
        unmasked graph exists for its size, so it gets them; up to EXACT_PROMPT_LENGTHS such lengths
        per (batch, views), each a graph set of its own. Small batches (the daemon's) keep the
        buckets: a new length there would be a capture in the middle of a control loop. So does every
        batch where prompt room is kept (`min_prompt_positions`: the daemon, the server, whose robots'
        states move their prompts' lengths): its warm-up captured the room's graphs, and a batch
        whose prompts happened to share one length would capture its own while robots wait."""
        b = token_mask.shape[0]
        token_mask = token_mask.detach().to("cpu", torch.bool)  # one device-to-host copy for both calls
        floor = self.min_prompt_positions
        bucketed = prompt_bucket(token_mask, self.token_bucket, at_least=floor)
        if floor > 0 or not any(self._unmasked(b)):
            return bucketed
        exact = prompt_bucket(token_mask, self.token_bucket, exact=True)
        if exact == bucketed:
            return bucketed
        held = self._exact_lengths.setdefault((b, views), set())
        if exact in held or len(held) < EXACT_PROMPT_LENGTHS:
            held.add(exact)
            return exact
        return bucketed

    def _mark(self) -> torch.cuda.Event | float:
        """A point in time on the device's own clock: CUDA events on a GPU (no sync between
        stages), the host clock on CPU, where the code runs synchronously anyway."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    # -- graph sets -------------------------------------------------------------------------
    def _graph_set(self, batch: int, views: int, length: int) -> _GraphSet:
        key = (batch, views, length)
        gs = self._sets.get(key)
        if gs is not None:
            return gs
        cfg, dev = self.adapter.cfg, self.device
        s = cfg.vision.image_size
        gen = torch.Generator(device="cpu").manual_seed(0)
        # Capture on real-looking inputs: never on zeros (they can hide indexing errors).
        inputs = {
            "images": (torch.rand(batch, views, 3, s, s, generator=gen) * 2 - 1).to(dev),
            "image_mask": torch.ones(batch, views, dtype=torch.bool, device=dev),
            "tokens": torch.randint(0, cfg.vocab_size, (batch, length), generator=gen).to(dev),
            "token_mask": torch.ones(batch, length, dtype=torch.bool, device=dev),
        }
        gs = _GraphSet(key, inputs)
        gs.loop_bufs = self._loop_buffers(batch, gen)
        if self._unmasked(batch)[1]:
            gs.kv_room = self._kv_room(batch, views, length)
        if not self.use_graphs:
            gs.eager = True
            self._sets[key] = gs
            return gs
        try:
            gs.pool = torch.cuda.graph_pool_handle()
            gs.vision_graph, gs.image_embeds = self._capture(gs, lambda: self._vision(gs))
            gs.prefix_graph, gs.kv = self._capture(gs, lambda: self._prefix(gs, out=self._prefix_out(gs)))
            log.info("cudagraph: captured vision and prefix graphs for batch %d, %d views, %d prompt positions",
                     batch, views, length)
            if self._unmasked(batch)[0]:
                self._capture_dense_prefix(gs)
        except Exception as exc:  # capture can fail on unusual setups; stay correct, say so once
            log.warning("cudagraph: capture failed for batch %d, views %d (%s: %s); running eagerly",
                        batch, views, type(exc).__name__, exc)
            gs.eager, gs.vision_graph, gs.prefix_graph = True, None, None
        self._sets[key] = gs
        return gs

    def _kv_room(self, batch: int, views: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value buffers (layers, B, kv heads, P + chunk, head dim): the prefix cache's
        shape from the adapter's stage specs (P for the trimmed prompt) with room for the chunk."""
        spec = next(s for s in self.adapter.stage_specs(batch, views) if s.name == "encode_prefix")
        (layers, b, heads, p_full, dim), dtype = spec.outputs["k_cache"]
        p = p_full - self.adapter.cfg.max_token_len + length
        shape = (layers, b, heads, p + self.adapter.chunk_size, dim)
        return (torch.empty(shape, dtype=dtype, device=self.device),
                torch.empty(shape, dtype=dtype, device=self.device))

    def _prefix_out(self, gs: _GraphSet) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where the prefix writes its KV cache: the first positions of `kv_room`, else (None) its
        own buffers."""
        if gs.kv_room is None:
            return None
        room = self.adapter.chunk_size
        return gs.kv_room[0][..., :-room, :], gs.kv_room[1][..., :-room, :]

    def _loop_buffers(self, batch: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
        h, d, dev = self.adapter.chunk_size, self.adapter.model_action_dim, self.device
        early = {"first_velocity": torch.zeros(batch, h, d, device=dev)} if self._early_batch(batch) else {}
        return {
            **early,
            "noise": torch.randn(batch, h, d, generator=gen).to(dev),
            "target": torch.zeros(batch, h, d, device=dev),
            # Per-sample RTC: one soft mask and one hard-prefix mask per sample, so the same
            # captured loop serves any mix of delays and weights at this batch size.
            "mask": torch.zeros(batch, h, d, device=dev),
            "fixed": torch.zeros(batch, h, 1, dtype=torch.bool, device=dev),
            "weight": torch.zeros(max(self.adapter.solver.num_steps, 1), device=dev),
        }

    def _capture(self, gs: _GraphSet | _StageSet, fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        # Warm up on a side stream (allocator, cuBLAS handles, compilation), then capture; the
        # GEMMs a graph replays are chosen here, float32 ones in TF32 for a reduced-precision engine.
        with float32_matmuls_in_tf32(self.dtype != torch.float32):
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=gs.pool):
                out = fn()
            torch.cuda.synchronize(self.device)
        return graph, out

    def _capture_dense_prefix(self, gs: _GraphSet) -> None:
        """The unmasked prefix graph, writing its K/V straight into the masked graph's KV cache
        (the loop graph reads that one; a copy there cost 0.2 ms at batch 32, and a second cache
        its memory) and copying its mask over the masked graph's (which may still hold an earlier
        padded batch's). On failure the masked graph serves every batch."""
        try:
            gs.prefix_dense_graph, _ = self._capture(gs, lambda: self._prefix_into_cache(gs, dense=True))
        except Exception as exc:
            log.warning("cudagraph: unmasked prefix capture failed for %s (%s: %s); padded and full batches "
                        "share the masked prefix", gs.key, type(exc).__name__, exc)
            gs.prefix_dense_graph = None

    def _prefix_into_cache(self, gs: _GraphSet, dense: bool = False,
                           kv_ready: Callable[[int], None] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prefix of a second prefix graph (unmasked, or with the first step beside it) into the
        masked graph's KV cache, which the loop graphs read, and its mask over that graph's mask
        buffer (which may still hold an earlier batch's): (keys, values, this call's mask)."""
        k, v, mask = self._prefix(gs, dense=dense, out=(gs.kv[0], gs.kv[1]), kv_ready=kv_ready)
        if k is not gs.kv[0] or v is not gs.kv[1]:
            raise RuntimeError("the prefix stage did not write the given KV buffers")
        gs.kv[2].copy_(mask)
        return k, v, mask

    def _capture_prefix_step(self, gs: _GraphSet, key: tuple[bool, bool, bool]) -> None:
        """The prefix graph with the first flow step beside it (`early_step`) for `key` (see
        `_first_step`) into `gs.prefix_steps`. On failure those calls run the prefix and the whole
        loop, as without the option."""
        dense_prefix, dense_expert, guided = key
        what = ("unmasked prefix" if dense_prefix else "prefix") + (" (unmasked expert)" if dense_expert else "")
        graph = None
        if not dense_prefix or gs.prefix_dense_graph is not None:
            try:
                if gs.side is None:
                    gs.side = torch.cuda.Stream(self.device)
                self._grow_weights(gs, self.adapter.solver)  # the guided step reads its step's weight
                graph, _ = self._capture(gs, lambda: self._prefix_and_first_step(gs, *key))
                log.info("cudagraph: captured the %s with the first flow step%s beside it for %s", what,
                         " and its exact guidance" if guided else "", gs.key)
            except Exception as exc:
                log.warning("cudagraph: capture of the %s with the first flow step failed for %s (%s: %s); "
                            "those calls run every step in the loop", what, gs.key, type(exc).__name__, exc)
        gs.prefix_steps[key] = graph

    def _prefix_and_first_step(self, gs: _GraphSet, dense_prefix: bool = False, dense_expert: bool = False,
                               guided: bool = False) -> None:
        """The prefix into the set's KV cache, and the first flow step's velocity from the noise
        into loop_bufs["first_velocity"]. With a side stream (`gs.side`, graphs on a GPU) the step
        runs there, each expert block waiting for an event its prefix block records once its keys
        are written; eagerly, one after the other. Either way the same operations on the same
        inputs as the loop's own first step. `dense_prefix`: the unmasked prefix; `dense_expert`:
        the step on the unmasked expert over `kv_room` (a full batch's); `guided`: the step's
        exactly guided velocity (its gradient taken there too, from the RTC buffers)."""
        # The first step is at the solver's start time whatever its step count, so this velocity
        # serves a loop of any number of steps from the same start.
        bufs, solver = gs.loop_bufs, self.adapter.solver
        step, make_context = self._stages["denoise_step"], self._stages.get("step_context")
        table = self._table(solver)
        side = gs.side
        main = torch.cuda.current_stream(self.device) if side is not None else None
        events: list[Any] = []

        def keys_written(i: int) -> None:  # on the prefix's stream
            if main is not None:
                event = torch.cuda.Event()
                event.record(main)
                events.append(event)

        def wait_for_keys(i: int) -> None:  # on the step's stream
            if side is not None:
                side.wait_event(events[i])

        if gs.eager:
            gs.kv = k, v, mask = self._prefix(gs, dense_prefix, out=self._prefix_out(gs), kv_ready=keys_written)
        else:
            k, v, mask = self._prefix_into_cache(gs, dense_prefix, kv_ready=keys_written)

        def first_step() -> None:
            t0 = solver.times()[0]
            t = torch.full((bufs["noise"].shape[0],), t0, dtype=torch.float32, device=self.device)
            kw: dict[str, Any] = {"context": make_context(mask)} if make_context is not None else {}
            if dense_expert:
                kw["joined"] = gs.kv_room

            def velocity(x: torch.Tensor) -> torch.Tensor:
                return step(x, t, k, v, mask, modulation=table[0], kv_wait=wait_for_keys, **kw)

            noise = bufs["noise"]
            bufs["first_velocity"].copy_(guided_velocity(velocity, noise, t0, bufs) if guided else velocity(noise))

        if side is None:
            first_step()
            return
        side.wait_event(events[0])  # the mask and the rotary positions come before block 0's keys
        with torch.cuda.stream(side):
            first_step()
        main.wait_stream(side)

    def _replay(self, gs: _GraphSet, stage: str, dense: bool = False,
                first: tuple[bool, bool, bool] | None = None) -> None:
        """Replay (or run eagerly) `stage`; the prefix with `first` (`_first_step`'s key): with the
        first flow step beside it."""
        if gs.eager:
            if stage == "vision":
                gs.image_embeds = self._vision(gs)
            elif first is not None:
                self._prefix_and_first_step(gs, *first)
            else:
                gs.kv = self._prefix(gs, dense, self._prefix_out(gs))
            return
        if stage == "vision":
            gs.vision_graph.replay()
        elif first is not None:
            gs.prefix_steps[first].replay()
        elif dense and gs.prefix_dense_graph is not None:
            gs.prefix_dense_graph.replay()
        else:
            gs.prefix_graph.replay()

    def _loop_graph(self, gs: _GraphSet, mode: str, solver: SolverSpec, dense: bool = False,
                    first: tuple[bool, bool, bool] | None = None):
        # The loop reads the prefix graph's KV cache (and with `first` the first velocity): fill it
        # once before warming up.
        early = first is not None
        prefix = gs.prefix_steps.get(first) if early else None
        if prefix is None:
            prefix = gs.prefix_dense_graph if dense and gs.prefix_dense_graph is not None else gs.prefix_graph
        return self._cached_loop(gs, mode, solver, lambda: (gs.vision_graph.replay(), prefix.replay()),
                                 lambda: self._loop(gs, mode, solver, dense, early),
                                 variant=", ".join(n for n, on in (("dense", dense), ("early", early)) if on))

    def _cached_loop(self, sets: Any, mode: str, solver: SolverSpec, fill: Callable[[], Any],
                     body: Callable[[], torch.Tensor], variant: str = ""):
        """(graph, output) of the solver loop for one graph set (PI0.5's or the generic one), RTC
        mode and `variant` (PI0.5's unmasked expert: "dense"), captured on first use; (None, None)
        where it runs eagerly. `fill` replays what the loop reads before it is warmed up and
        captured."""
        key = (mode, solver, variant)
        if key in sets.loops:
            return sets.loops[key]
        self._grow_weights(sets, solver)
        entry: tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None] = (None, None)
        if not sets.eager:
            try:
                fill()
                entry = self._capture(sets, body)
                log.info("cudagraph: captured the %d-step solver loop (RTC %s%s) for %s", solver.num_steps, mode,
                         f", {variant}" if variant else "", sets.key)
            except Exception as exc:
                log.warning("cudagraph: loop capture failed for %s, RTC %s (%s: %s); running it eagerly",
                            sets.key, mode, type(exc).__name__, exc)
        sets.loops[key] = entry
        return entry

    def _grow_weights(self, sets: Any, solver: SolverSpec) -> None:
        """Room in the guidance-weight buffer for every step of `solver`. A new buffer leaves the
        graphs that read the old one stale: the prefix graphs with a guided first step go, to be
        captured again on first use (loops are per solver and read the buffer of their capture)."""
        if solver.num_steps > sets.loop_bufs["weight"].shape[0]:
            sets.loop_bufs["weight"] = torch.zeros(solver.num_steps, device=self.device)
            for key in [k for k in getattr(sets, "prefix_steps", {}) if k[2]]:
                del sets.prefix_steps[key]

    # -- stage bodies (shared by capture and the eager fallback) --------------------------
    def _vision(self, gs: _GraphSet) -> torch.Tensor:
        return self._stages["embed_images"](gs.inputs["images"])

    def _prefix(self, gs: _GraphSet, dense: bool = False, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_ready: Callable[[int], None] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        i = gs.inputs
        # only the fused stage takes these (`dense_prefix`, `dense_expert`, `early_step`)
        kw: dict[str, Any] = {"dense": True} if dense else {}
        if out is not None:
            kw["out"] = out
        if kv_ready is not None:
            kw["kv_ready"] = kv_ready
        return self._stages["encode_prefix"](gs.image_embeds, i["image_mask"], i["tokens"], i["token_mask"], **kw)

    def _table(self, solver: SolverSpec) -> list[Any]:
        """Adaptive-norm modulations for each time of the solver's grid (batch-independent)."""
        table = self._tables.get(solver)
        if table is None:
            # A stage set may extend each entry with work of its own done once per flow time
            # (PI0.5's small-M GEMMs: the folded norms' shift products).
            extend = self._stages.get("fold_modulation", lambda entry: entry)
            with torch.no_grad():
                table = [
                    extend(self.module.time_modulation(torch.full((1,), t, dtype=torch.float32, device=self.device)))
                    if self.modulation_tables else None
                    for t in solver.times()
                ]
            self._tables[solver] = table
        return table

    def _loop(self, gs: _GraphSet, mode: str, solver: SolverSpec, dense: bool = False,
              early: bool = False) -> torch.Tensor:
        k, v, pmask = gs.kv
        step = self._stages["denoise_step"]
        table = self._table(solver)
        # A stage set may share per-chunk work among its steps (PI0.5's fused path: rotary tables and
        # masks): made once here, inside the captured loop, so every replay remakes it.
        make_context = self._stages.get("step_context")
        kw: dict[str, Any] = {"context": make_context(pmask)} if make_context is not None else {}
        if dense:
            kw["joined"] = gs.kv_room
        first = gs.loop_bufs["first_velocity"] if early else None  # computed beside the prefix

        def velocity(i: int, xin: torch.Tensor, tt: torch.Tensor) -> torch.Tensor:
            return step(xin, tt, k, v, pmask, modulation=table[i], **kw)
        return static_euler(velocity, gs.loop_bufs, mode, solver, first)

    def _load_host_values(self, sets: _GraphSet | _StageSet, noise: torch.Tensor | None, rtc: RTCGuidance | None,
                          solver: SolverSpec, batch: int) -> None:
        """Copy the call's given noise and its RTC into the static buffers (in place: a captured
        loop reads them). Shared (H,) weights or one d broadcast over the batch; (B, H) weights
        and (B,) delays fill one row per sample. Values made on the host (the policy builds RTC
        there; the daemon's worker draws keyed noise there) go through pinned staging buffers, so
        the copies never block the host and `run` can issue them while the vision graph runs."""
        h, d = self.adapter.chunk_size, self.adapter.model_action_dim
        bufs = sets.loop_bufs
        values: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if noise is not None:
            values["noise"] = (bufs["noise"], noise)
        if rtc is not None:
            key = (solver, rtc.max_guidance_weight)
            weights = self._rtc_weights.get(key)
            if weights is None:
                weights = torch.tensor([guidance_weight(t, rtc.max_guidance_weight) for t in solver.times()],
                                       dtype=torch.float32)
                self._rtc_weights[key] = weights
            values.update({
                "target": (bufs["target"], rtc.target.to(torch.float32).expand(batch, h, d)),
                "mask": (bufs["mask"], rtc.mask.to(torch.float32).expand(batch, h, d)),
                "fixed": (bufs["fixed"], rtc.fixed_mask(h).expand(batch, h, 1)),
                "weight": (bufs["weight"][: weights.numel()], weights),
            })
        staging = sets.staging
        staging.wait()
        for name, (dst, src) in values.items():
            staging.copy(dst, src, name, stage=dst.is_cuda and not src.is_cuda)
        staging.queued(self.device)

    # -- the generic path: any adapter's stage graph, laid out from its stage_specs -------
    def _run_generic(self, inputs: ModelInputs, noise: torch.Tensor | None, rtc: RTCGuidance | None) -> torch.Tensor:
        a, b, g = self.adapter, inputs.batch_size, self._graph
        ss = self._stage_set(b, self._views)
        for name, buf in ss.inputs.items():
            given = inputs.tensors.get(name)
            if given is None:
                raise KeyError(f"stage input {name!r} is neither in the preprocessed tensors nor made by an earlier "
                               f"stage (preprocess gave {sorted(inputs.tensors)})")
            if tuple(given.shape) != tuple(buf.shape):
                raise ValueError(f"{name}: got shape {tuple(given.shape)}, the adapter's stage_specs({b}, "
                                 f"{self._views}) declare {tuple(buf.shape)}")
            buf.copy_(given)
        drawn = self.sample_noise(b) if noise is None else None
        mode = rtc.mode if rtc is not None else "none"
        if mode not in LOOP_MODES:
            raise ValueError(f"RTC mode {mode!r} is not a solver mode; solver modes are {LOOP_MODES[1:]}")
        graph, out = self._stage_loop_graph(ss, mode, a.solver)
        if drawn is not None:
            ss.loop_bufs["noise"].copy_(drawn)
        if noise is not None or rtc is not None:
            self._load_host_values(ss, noise, rtc, a.solver, b)

        marks: list[Any] = [self._mark()]
        if ss.eager:
            ss.context = self._chunk_stages(ss, marks)
        else:
            ss.chunk_graph.replay()
            marks.extend(ss.stage_events)
        if graph is not None:
            graph.replay()
            chunk = out
        else:
            chunk = self._stage_loop(ss, mode, a.solver)
        marks.append(self._mark())
        ms = _elapsed_ms(marks)
        names = [p[0] for p in g.prefix]
        self._stage_ms = {**dict(zip(names, ms)), "solver_loop": ms[-1], g.step: ms[-1] / a.solver.num_steps}
        return chunk.clone()

    def _stage_set(self, batch: int, views: int | None) -> _StageSet:
        key = (batch, views)
        ss = self._stage_sets.get(key)
        if ss is not None:
            return ss
        g, dev = self._graph, self.device
        specs = {s.name: s for s in self.adapter.stage_specs(batch, views)}
        # External inputs: what a per-chunk stage (or the step, besides x_t and t) reads that no
        # earlier stage writes; they come from ModelInputs.tensors by name on every call.
        made: set[str] = set()
        wanted: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name, ins, outs in g.prefix:
            wanted.update({n: specs[name].inputs[n] for n in ins if n not in made and n not in wanted})
            made.update(outs)
        step_ins = specs[g.step].inputs
        wanted.update({n: step_ins[n] for n in g.step_context if n not in made and n not in wanted})
        gen = torch.Generator(device="cpu").manual_seed(0)
        # Capture on real-looking inputs: never on zeros for floats (they can hide indexing errors);
        # integers stay 0, the one index every embedding table has.
        inputs = {}
        for n, (shape, dtype) in wanted.items():
            if dtype.is_floating_point:
                inputs[n] = (torch.rand(shape, generator=gen) * 2 - 1).to(dev, dtype)
            elif dtype == torch.bool:
                inputs[n] = torch.ones(shape, dtype=torch.bool, device=dev)
            else:
                inputs[n] = torch.zeros(shape, dtype=dtype, device=dev)
        ss = _StageSet(key, inputs, loop_bufs=self._loop_buffers(batch, gen))
        if not self.use_graphs:
            ss.eager = True
            self._stage_sets[key] = ss
            return ss
        try:
            ss.pool = torch.cuda.graph_pool_handle()

            def per_chunk() -> list[torch.Tensor]:
                # Fresh events each pass: the ones recorded during capture are the graph's own.
                ss.stage_events = []
                return self._chunk_stages(ss, ss.stage_events)

            ss.chunk_graph, ss.context = self._capture(ss, per_chunk)
            log.info("cudagraph: captured the per-chunk stages %s for batch %d, %s views", [p[0] for p in g.prefix],
                     batch, views)
        except Exception as exc:  # capture can fail on unusual setups; stay correct, say so once
            log.warning("cudagraph: capture failed for batch %d, views %s (%s: %s); running eagerly",
                        batch, views, type(exc).__name__, exc)
            ss.eager, ss.chunk_graph, ss.stage_events = True, None, []
        self._stage_sets[key] = ss
        return ss

    def _chunk_stages(self, ss: _StageSet, marks: list[Any]) -> list[torch.Tensor]:
        """Every per-chunk stage in order on the static inputs; returns the step's context."""
        env: dict[str, torch.Tensor] = dict(ss.inputs)
        for name, ins, outs in self._graph.prefix:
            out = self._stages[name](*(env[n] for n in ins))
            out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            if len(out) != len(outs):
                raise ValueError(f"stage {name!r} returned {len(out)} tensor(s), its spec declares {list(outs)}")
            env.update(zip(outs, out))
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # An external event is a node of the graph, so it records on every replay.
                event = torch.cuda.Event(enable_timing=True, external=True)
                event.record()
                marks.append(event)
            else:
                marks.append(self._mark())
        return [env[n] for n in self._graph.step_context]

    def _stage_loop_graph(self, ss: _StageSet, mode: str, solver: SolverSpec):
        # The loop reads the per-chunk outputs: fill them before warming up.
        return self._cached_loop(ss, mode, solver, lambda: ss.chunk_graph.replay(),
                                 lambda: self._stage_loop(ss, mode, solver))

    def _stage_loop(self, ss: _StageSet, mode: str, solver: SolverSpec) -> torch.Tensor:
        step, context = self._stages[self._graph.step], ss.context
        return static_euler(lambda i, xin, tt: step(xin, tt, *context), ss.loop_bufs, mode, solver)


def _elapsed_ms(marks: list[torch.cuda.Event | float]) -> list[float]:
    """Milliseconds between consecutive marks (waits for the last CUDA event)."""
    if isinstance(marks[-1], float):
        return [(b - a) * 1e3 for a, b in itertools.pairwise(marks)]
    marks[-1].synchronize()
    return [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
