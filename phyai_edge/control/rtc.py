"""The daemon's side of Real-Time Chunking: the executing chunk, the delay estimate, the takeover.

Time is counted in clock slots. A chunk computed from the observation taken at slot t0 has its
action i meant for slot t0 + i. Inference for the next chunk starts when `s` actions of the
executing chunk have run (its index reaches s); the worker returns at slot t0 + d, and the new
chunk takes over at index d, the delay that really happened. For `inpaint`, `guided` and
`guided-approx` the engine's solver joined actions [0, d) to the executing chunk (we pass it the
executing chunk's remaining actions, aligned to the new chunk's indices, and the estimated d):
`inpaint` holds them on it exactly, the guided modes pull them towards it with full weight and
the following ones with a decaying one, which brings them close but not onto it. A real delay
above the estimate takes over at a row that was only softly guided, hence the estimate is a
maximum. `crossfade` blends the two over a few slots here; `none` switches.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

SOLVER_MODES = ("inpaint", "guided-approx", "guided")


@dataclass
class Chunk:
    actions: np.ndarray  # (H, action_dim) float32, robot units
    chunk_id: int
    start_slot: int  # slot of the observation: action i is for slot start_slot + i
    obs_time_s: float
    index: int = 0  # next action to publish
    instruction: int = 0  # the instruction it was computed with (task.py's count; 0: model.prompt)

    @property
    def remaining(self) -> int:
        return self.actions.shape[0] - self.index


class DelayEstimator:
    """d for the next request: a fixed value, or the maximum of the last `window` measured delays.

    The maximum, not the mean: under-estimating d leaves actions that will really execute
    unconstrained by the solver, which is what makes chunk boundaries jump. Only chunks that took
    over are measured (`ChunkQueue.adopt`).
    """

    def __init__(self, fixed: int = 0, initial: int = 3, window: int = 10) -> None:
        self.fixed = fixed
        self.initial = initial
        self.recent: deque[int] = deque(maxlen=window)

    def record(self, delay: int) -> None:
        self.recent.append(delay)

    def estimate(self) -> int:
        if self.fixed:
            return self.fixed
        return max(self.recent) if self.recent else self.initial


@dataclass
class RequestPlan:
    """What to send with one inference: the prefix (None for the first chunk) and d."""

    start_slot: int
    prefix: np.ndarray | None  # (n, action_dim): executing actions aligned to the new chunk's indices
    delay: int


class ChunkQueue:
    def __init__(self, mode: str, horizon: int, execution_horizon: int, crossfade_steps: int, delays: DelayEstimator) -> None:
        self.mode = mode
        self.horizon = horizon
        self.s = execution_horizon
        self.crossfade_steps = crossfade_steps
        self.delays = delays
        self.current: Chunk | None = None
        self.last_delay = -1

    def reset(self) -> None:
        """Forget the executing chunk (stale inputs, e-stop): the next chunk starts without a prefix."""
        self.current = None

    def wants_inference(self) -> bool:
        c = self.current
        return c is None or c.index >= self.s

    def plan(self, slot: int) -> RequestPlan:
        """Plan a request whose observation is taken at `slot` (the action at `current.index` runs then)."""
        c = self.current
        d = self.delays.estimate()
        if c is None or c.remaining <= 0:
            return RequestPlan(slot, None, d)
        prefix = c.actions[c.index :].copy()
        return RequestPlan(slot, prefix, min(d, prefix.shape[0]))

    def adopt(self, actions: np.ndarray, chunk_id: int, start_slot: int, now_slot: int, obs_time_s: float,
              instruction: int = 0) -> int | None:
        """Take over with a finished chunk at index `now_slot - start_slot`. None if it is already stale."""
        actions = actions[: self.horizon]
        delay = now_slot - start_slot
        self.last_delay = delay
        if delay >= actions.shape[0]:
            # Not an inference delay to plan for but a stall (a worker restart, a frozen process):
            # in the window it would freeze every prefix whole for the next `window` chunks.
            return None
        self.delays.record(delay)
        if self.mode == "crossfade" and self.current is not None:
            actions = self._crossfade(actions, delay, now_slot)
        self.current = Chunk(np.ascontiguousarray(actions, dtype=np.float32), chunk_id, start_slot, obs_time_s, delay,
                             instruction)
        return delay

    def _crossfade(self, new: np.ndarray, delay: int, now_slot: int) -> np.ndarray:
        """Blend the old chunk into the new one over `crossfade_steps` slots from the takeover."""
        old = self.current
        assert old is not None
        out = new.copy()
        old_index = now_slot - old.start_slot  # the old chunk's action for this slot
        steps = self.crossfade_steps
        for k in range(steps):
            i_new, i_old = delay + k, old_index + k
            if i_new >= out.shape[0] or i_old >= old.actions.shape[0] or i_old < 0:
                break
            w = (k + 1) / (steps + 1)  # weight of the new chunk: ramps towards 1
            out[i_new] = (1.0 - w) * old.actions[i_old] + w * new[i_new]
        return out

    def skip(self, slots: int) -> None:
        """Missed clock slots: skip their actions so the chunk stays aligned with time."""
        if self.current is not None and slots > 0:
            self.current.index += slots

    def next_action(self) -> tuple[np.ndarray, Chunk] | None:
        """The action for this slot (and advance), or None when there is no chunk or it ran out."""
        c = self.current
        if c is None or c.index >= c.actions.shape[0]:
            return None
        action = c.actions[c.index]
        c.index += 1
        return action, c
