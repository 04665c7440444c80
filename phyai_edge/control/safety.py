"""Last line before the socket: position and rate limits, hold targets, the no-NaN guarantee.

Everything the daemon publishes goes through `ActionGuard.finalize`, so no code path can put a
non-finite number or an unclamped value on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from phyai_edge.control.config import Limits
from phyai_edge.control.protocol import Flag


def _per_dim(value: float | tuple[float, ...] | None, dim: int, fill: float) -> np.ndarray:
    if value is None:
        return np.full(dim, fill, dtype=np.float32)
    if isinstance(value, tuple):
        return np.asarray(value, dtype=np.float32)
    return np.full(dim, value, dtype=np.float32)


@dataclass
class SafetyCounters:
    clamped_limit: int = 0
    clamped_rate: int = 0
    nonfinite: int = 0
    holds: dict[str, int] = field(default_factory=dict)

    def hold(self, reason: str) -> None:
        self.holds[reason] = self.holds.get(reason, 0) + 1


class ActionGuard:
    def __init__(self, dim: int, limits: Limits, period_s: float, hold_mode: str) -> None:
        self.dim = dim
        self.lo = _per_dim(limits.action_min, dim, -np.inf)
        self.hi = _per_dim(limits.action_max, dim, np.inf)
        self.max_step = _per_dim(limits.max_rate, dim, np.inf) * np.float32(period_s)
        self.hold_mode = hold_mode
        self.last: np.ndarray | None = None  # last published payload (always finite)
        # Which limits changed the last finalized action ("position", "rate"): the metrics count
        # each apart, since a rate clamp says the policy moves too fast and a position clamp that it
        # aims outside the workspace.
        self.last_clamps: tuple[str, ...] = ()
        self.counters = SafetyCounters()

    def hold_target(self, state: np.ndarray | None) -> np.ndarray:
        """Payload of a HOLD message, per `safety.hold`."""
        state_ok = state is not None and state.shape == (self.dim,) and bool(np.isfinite(state).all())
        if self.hold_mode == "zero":
            return np.zeros(self.dim, dtype=np.float32)
        if self.hold_mode == "state" and state_ok:
            return np.asarray(state, dtype=np.float32)
        if self.last is not None:
            return self.last.copy()
        # Nothing published yet: the measured state is the best "stay where you are" for position
        # control (when the action and state spaces match); zeros otherwise.
        if state_ok:
            return np.asarray(state, dtype=np.float32)
        return np.zeros(self.dim, dtype=np.float32)

    def preview(self, actions: np.ndarray) -> np.ndarray:
        """What `finalize` would publish for these actions, one per tick from now, without touching
        the guard: the position clip, then the rate limit from the last published action on. RTC's
        prefix is then what the robot is really commanded while the next chunk is computed, not
        the policy's raw values the limits cut. A non-finite row is left as it is (finalize would
        hold there)."""
        out = np.clip(np.asarray(actions, dtype=np.float32), self.lo, self.hi)  # NaN stays NaN
        if self.last is None or not np.isfinite(self.max_step).any():
            return out
        # This runs on the clock thread: the row loop (~4 us a row) only where the rate limit binds.
        # The test is finalize's own clip bounds, prev -/+ max_step rounded to float32, not
        # |a - prev| <= max_step: the two round differently, and a row 1 ulp past the rounded bound
        # would pass here while finalize moves it.
        prev_rows = np.vstack([self.last[None], out[:-1]])
        if np.isfinite(out).all() and ((out >= prev_rows - self.max_step) & (out <= prev_rows + self.max_step)).all():
            return out
        prev = self.last
        for i in range(out.shape[0]):
            if np.isfinite(out[i]).all():
                out[i] = prev = np.clip(out[i], prev - self.max_step, prev + self.max_step)
        return out

    def finalize(self, action: np.ndarray) -> tuple[np.ndarray, int]:
        """Clamp, rate-limit and check one action. Returns (payload, flags to add).

        A non-finite action is replaced by the hold target with HOLD | NONFINITE.
        """
        flags = 0
        clamps: list[str] = []
        a = np.asarray(action, dtype=np.float32)
        if a.shape != (self.dim,) or not np.isfinite(a).all():
            self.counters.nonfinite += 1
            flags |= Flag.HOLD | Flag.NONFINITE
            a = self.hold_target(None)
            if not np.isfinite(a).all():  # cannot happen (last is finite), but never publish NaN
                a = np.zeros(self.dim, dtype=np.float32)
        clamped = np.clip(a, self.lo, self.hi)
        if not np.array_equal(clamped, a):
            self.counters.clamped_limit += 1
            flags |= Flag.CLAMPED
            clamps.append("position")
        if self.last is not None:
            limited = np.clip(clamped, self.last - self.max_step, self.last + self.max_step)
            if not np.array_equal(limited, clamped):
                self.counters.clamped_rate += 1
                flags |= Flag.CLAMPED
                clamps.append("rate")
            clamped = limited
        out = np.ascontiguousarray(clamped, dtype=np.float32)
        self.last = out
        self.last_clamps = tuple(clamps)
        return out, flags
