"""Real-Time Chunking inside the solver (Black, Galliker, Levine 2025, "Real-Time Execution of
Action Chunking Flow Policies").

Conventions are the model's: x = t * noise + (1 - t) * actions, integrated from t = 1 to t = 0,
velocity v = noise - actions, so the predicted clean chunk at time t is x - t * v.

The paper runs tau = 1 - t from 0 (noise) to 1 (data) with v_paper = -v. Its guided velocity
is v_paper + w J^T W (Y - A1_hat), A1_hat = x + (1 - tau) v_paper (the same point as x - t v)
and J = dA1_hat/dx; negated into this convention it is v - w J^T W (Y - A1_hat), and an Euler
step x + dt * v with dt = -1/n is the paper's x + (1/n) v_paper. W is the soft mask
(`prefix_weights`) times the real-action-dim mask, w is `guidance_weight`.

Modes:
- `inpaint`: no guidance and no soft mask: after every Euler step the first d rows are replaced
  by t_next * noise + (1 - t_next) * Y, where the straight path from this chunk's own noise to
  the executing chunk is at the time the step reached (replacement inpainting, without
  RePaint's resampling), so they end on Y exactly. The rows after d see the prefix only
  through the model's attention.
- `guided-approx`: the guided velocity with J taken as the identity, i.e. the velocity
  network's own Jacobian dropped (J = I - t dv/dx): the correction is W (Y - A1_hat) itself.
  No backward pass, so it works with any engine, including ones without autograd (ONNX,
  TensorRT); it is not the paper's method, and how far it lands from it depends on the model.
- `guided`: the paper's exact vector-Jacobian product through the velocity network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

RTCMode = Literal["none", "crossfade", "inpaint", "guided-approx", "guided"]
RTC_MODES: tuple[str, ...] = get_args(RTCMode)
SOLVER_RTC_MODES = ("inpaint", "guided-approx", "guided")  # the rest are the daemon's business


def prefix_weights(horizon: int, delay: int, execution_horizon: int) -> torch.Tensor:
    """The paper's soft mask W over chunk indices: 1 for i < d, exponential decay on
    [d, H - s), 0 from max(H - s, d) on (no executing action overlaps those).

    d > H - s lies outside the paper (it assumes d <= s <= H - d); then the d actions that will
    execute keep weight 1 (the Kinetix code's `get_prefix_weights` would instead zero them from
    H - s on). `Policy` passes s' = max(s, H - n) so the decay also ends at a short prefix's end n."""
    h, d, s = horizon, delay, execution_horizon
    if not 0 <= d <= h:
        raise ValueError(f"RTC delay d={d} must lie in [0, H={h}]")
    if not 0 <= s <= h:
        raise ValueError(f"RTC execution horizon s={s} must lie in [0, H={h}]")
    w = torch.zeros(h)
    free_from = max(h - s, d)
    w[:d] = 1.0
    span = h - s - d + 1
    for i in range(d, free_from):
        c = (h - s - i) / span
        w[i] = c * math.expm1(c) / (math.e - 1.0)
    return w


def guidance_weight(t: float, max_weight: float) -> float:
    """min(beta, (1 - tau) / (tau r_tau^2)), r_tau^2 = (1 - tau)^2 / (tau^2 + (1 - tau)^2), with
    tau = 1 - t the paper's flow time (0: noise, 1: data).

    The unclipped weight equals (tau^2 + (1 - tau)^2) / (tau (1 - tau)). It is symmetric under
    tau <-> 1 - tau, so the weight cannot tell the two time conventions apart (A1_hat = x - t v
    is where they must be mapped right), and grows without bound at both ends, so the clip
    gives beta there. Both ends are taken as that limit
    rather than evaluated: tau = 0 and tau = 1 divide by zero. (At tau = 1 LeRobot's code gives
    0, from nan_to_num(0 * inf), and the Kinetix code NaN; neither loop, nor `integrate`, takes
    a step at t = 0, so no chunk depends on that end.)"""
    tau = 1.0 - t
    if tau <= 0.0 or tau >= 1.0:
        return max_weight
    inv_r2 = ((1 - tau) ** 2 + tau**2) / (1 - tau) ** 2
    return min(max_weight, (1 - tau) / tau * inv_r2)


@dataclass
class RTCGuidance:
    """What the solver needs, already in model space.

    target: (B, H, D) the executing chunk's actions at the new chunk's indices (zeros where
        nothing overlaps); weights: (H,) soft mask shared by the batch, or (B, H) one mask per
        sample (many robots or environments in one batch, each with its own delay; a row of
        zeros leaves that sample unguided); dim_mask: (D,) 1 on real action dims.
    delays: the hard-prefix length d for `inpaint`, one per sample: an int (shared by the
        batch) or a (B,) integer tensor; stored as a (1,) or (B,) int64 tensor. The solver
        applies it as a (B, H, 1) boolean mask (`fixed_mask`), never as a Python slice bound,
        so one batch (and one captured graph) can mix delays. Guided modes read only the weights.
    """

    mode: RTCMode
    target: torch.Tensor
    weights: torch.Tensor
    dim_mask: torch.Tensor
    delays: torch.Tensor | int
    max_guidance_weight: float

    def __post_init__(self) -> None:
        d = self.delays
        if not isinstance(d, torch.Tensor):
            d = torch.tensor([int(d)], dtype=torch.int64)
        elif d.dtype != torch.int64 or d.ndim != 1:
            d = d.to(torch.int64).reshape(-1)
        self.delays = d

    def to(self, device: torch.device) -> RTCGuidance:
        return RTCGuidance(
            self.mode, self.target.to(device), self.weights.to(device), self.dim_mask.to(device),
            self.delays.to(device), self.max_guidance_weight,
        )

    @property
    def delay(self) -> int:
        """The longest hard prefix in the batch (the single d of a batch that shares one)."""
        return int(self.delays.max())

    @property
    def per_sample(self) -> bool:
        return self.weights.ndim == 2

    @property
    def mask(self) -> torch.Tensor:
        """(1, H, D) combined weight, or (B, H, D) with per-sample weights."""
        if self.per_sample:
            return self.weights[:, :, None] * self.dim_mask[None, None, :]
        return (self.weights[:, None] * self.dim_mask[None, :])[None]

    def fixed_mask(self, horizon: int) -> torch.Tensor:
        """(B, H, 1) bool, or (1, H, 1) for a shared d: True on each sample's first d_i actions
        (the hard prefix `inpaint` holds on the executing chunk)."""
        idx = torch.arange(horizon, device=self.delays.device)
        return (idx[None, :] < self.delays[:, None])[:, :, None]


def batch_guidance(parts: list[RTCGuidance | None], horizon: int, model_dim: int) -> RTCGuidance | None:
    """Join single-sample guidances (each built for batch 1) into one with (B, H) weights and
    (B,) delays.

    `None` entries (samples without solver RTC) get zero weights, a zero target and d = 0,
    which leaves them untouched: the guided correction is `w * (target - x1) * 0` and `inpaint`
    holds no prefix of theirs. All non-None parts must share the mode and max guidance weight
    (the guidance schedule is one per call); delays may differ in every mode.
    """
    present = [p for p in parts if p is not None]
    if not present:
        return None
    first = present[0]
    for p in present[1:]:
        if p.mode != first.mode or p.max_guidance_weight != first.max_guidance_weight:
            raise ValueError(
                f"cannot batch RTC mode {p.mode!r} (beta {p.max_guidance_weight}) with {first.mode!r} "
                f"(beta {first.max_guidance_weight}); group requests by mode first"
            )
    targets, weights, delays = [], [], []
    for p in parts:
        if p is None:
            targets.append(torch.zeros(1, horizon, model_dim))
            weights.append(torch.zeros(horizon))
            delays.append(0)
        else:
            if p.target.shape[0] != 1:
                raise ValueError(f"batch_guidance joins batch-1 guidances, got a target of batch {p.target.shape[0]}")
            if p.delays.numel() != 1:
                raise ValueError(f"batch_guidance joins batch-1 guidances, got {p.delays.numel()} delays")
            targets.append(p.target.cpu())
            weights.append(p.weights.cpu().reshape(-1) if not p.per_sample else p.weights.cpu()[0])
            delays.append(p.delay)
    return RTCGuidance(first.mode, torch.cat(targets), torch.stack(weights), first.dim_mask.cpu(),
                       torch.tensor(delays, dtype=torch.int64), first.max_guidance_weight)
