"""The flow-matching Euler loop with Real-Time Chunking hooks. Every backend shares it.

`velocity(x, t)` is whatever the backend runs for one denoise step (eager module call,
CUDA-graph replay, ONNX session, TensorRT context); the loop itself is backend-agnostic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from phyai_edge.adapters.base import SolverSpec
from phyai_edge.engines.rtc import RTCGuidance, guidance_weight

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def exact_guidance(velocity: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, t: float,
                   target: torch.Tensor, mask: torch.Tensor, weight: float | torch.Tensor) -> torch.Tensor:
    """RTC's guided velocity in its exact vector-Jacobian form: the model's velocity at x minus
    `weight` times the gradient, with respect to x, of the masked error between `target` and the
    clean actions the velocity predicts (x - t v). `velocity(x)` is one denoise step at time t."""
    with torch.enable_grad():
        x_in = x.detach().requires_grad_(True)
        v = velocity(x_in)
        x1 = x_in - t * v
        err = ((target - x1) * mask).detach()
        (correction,) = torch.autograd.grad(x1, x_in, err)
    return v.detach() - weight * correction


def rtc_velocity(velocity: Velocity, x: torch.Tensor, tt: torch.Tensor, t: float, rtc: RTCGuidance) -> torch.Tensor:
    """Velocity corrected towards the executing chunk (guided modes)."""
    w = guidance_weight(t, rtc.max_guidance_weight)
    mask = rtc.mask
    if rtc.mode == "guided":
        return exact_guidance(lambda x_in: velocity(x_in, tt), x, t, rtc.target, mask, w)
    v = velocity(x, tt)
    err = (rtc.target - (x - t * v)) * mask
    return v - w * err


def integrate(
    velocity: Velocity,
    noise: torch.Tensor,
    solver: SolverSpec,
    rtc: RTCGuidance | None = None,
    on_step: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Euler from t_start (noise) to t_end; returns the chunk (B, H, D) in model space."""
    x = noise
    dt = solver.dt
    batch = noise.shape[0]
    mode = rtc.mode if rtc is not None else "none"
    times = solver.times()
    # The time after each step; the last is exactly t_end (t_start + n * dt accumulates rounding,
    # which would leave an inpainted prefix a few ulps off the executing chunk).
    next_times = [*times[1:], solver.t_end]
    # inpaint: each sample's own hard prefix (its first d_i actions) as a (B|1, H, 1) mask, so
    # one batch mixes delays and a captured loop reads them from a buffer (no Python slice).
    fixed = rtc.fixed_mask(noise.shape[1]).to(noise.device) if mode == "inpaint" else None
    for i, t in enumerate(times):
        tt = torch.full((batch,), t, dtype=torch.float32, device=noise.device)
        if mode in ("guided", "guided-approx"):
            v = rtc_velocity(velocity, x, tt, t, rtc)
        else:
            v = velocity(x, tt)
        x = x + dt * v
        if mode == "inpaint":
            # Put the fixed prefix where the straight noise->target path is at the next time.
            t_next = next_times[i]
            x = torch.where(fixed, (t_next * noise + (1.0 - t_next) * rtc.target).to(x.dtype), x)
        if on_step is not None:
            on_step(i)
    return x
