"""The RL rollout API: N environments' observations in, N action chunks out, in as few engine
calls as the engine's captured batch sizes allow.

    policy = load_policy(preset="tiny")
    rollout = RolloutPolicy(policy, seed=0)
    chunks = RolloutChunks(num_envs, execution_horizon=25)
    ...
    out = rollout.act(observations, rtc=chunks.requests(delay=0))  # (N, H, A)
    chunks.update(out.actions, delay=0)
    actions = chunks.next_actions()                                # (N, A), one env step

Per-environment noise: each environment draws from its own generator, seeded from (seed,
environment index), so an environment's actions do not depend on how many other environments
share the batch or in which order (`noise=` overrides it). Per-environment RTC: every
environment keeps its own executing chunk and delay (`RolloutChunks`); every solver mode mixes
delays in one batch (per-sample weights and hard-prefix lengths, see `batching`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from phyai_edge.adapters.base import Observation
from phyai_edge.engines.base import SOLVER_RTC_MODES, RTCMode, RTCRequest
from phyai_edge.serve.batching import BatchItem, run_items


@dataclass
class RolloutResult:
    actions: np.ndarray  # (N, H, action_dim) float32, robot units
    stage_ms: dict[str, float] = field(default_factory=dict)
    batches: int = 0  # engine calls it took


class RolloutPolicy:
    """Batched inference for many environments over one `Policy` (same adapter and engine as
    the daemon and the server, so the same observation and noise give the same actions).

    batch_sizes: the engine's captured batch sizes (CUDA graphs, TensorRT profiles); a batch is
        padded up to the nearest one and split at the largest. None: any size in one call.
    """

    def __init__(self, policy: Any, batch_sizes: Sequence[int] | None = None, max_batch: int | None = None,
                 seed: int = 0) -> None:
        self.policy = policy
        self.batch_sizes = sorted(batch_sizes) if batch_sizes else None
        self.max_batch = max_batch
        self.seed = seed
        self._generators: list[torch.Generator] = []

    @property
    def chunk_size(self) -> int:
        return int(self.policy.chunk_size)

    @property
    def action_dim(self) -> int:
        return int(self.policy.action_dim)

    def env_noise(self, env_ids: Sequence[int]) -> torch.Tensor:
        """(len(env_ids), H, D) noise, each row from that environment's own stream."""
        a = self.policy.adapter
        while len(self._generators) <= max(env_ids, default=-1):
            i = len(self._generators)
            # Distinct, reproducible streams: one seed per (rollout seed, environment).
            self._generators.append(torch.Generator().manual_seed(self.seed * 1_000_003 + i))
        return torch.stack([torch.randn(a.chunk_size, a.model_action_dim, generator=self._generators[i])
                            for i in env_ids])

    def act(
        self,
        observations: Sequence[Observation],
        rtc: Sequence[RTCRequest | None] | None = None,
        noise: torch.Tensor | np.ndarray | None = None,
        env_ids: Sequence[int] | None = None,
    ) -> RolloutResult:
        """observations: one per environment; rtc: one request (or None) per environment;
        noise: (N, H, D) to override the per-environment streams; env_ids: which environments
        these are (default 0..N-1), for the noise streams when only some environments act."""
        n = len(observations)
        if n == 0:
            raise ValueError("act needs at least one observation")
        if rtc is not None and len(rtc) != n:
            raise ValueError(f"got {len(rtc)} RTC requests for {n} observations")
        ids = list(range(n)) if env_ids is None else list(env_ids)
        if len(ids) != n:
            raise ValueError(f"got {len(ids)} env_ids for {n} observations")
        if noise is None:
            nz = self.env_noise(ids)
        else:
            nz = torch.as_tensor(np.asarray(noise) if not isinstance(noise, torch.Tensor) else noise)
        items = [BatchItem([o], None if rtc is None else rtc[i], nz[i:i + 1], tag=i) for i, o in enumerate(observations)]
        results = run_items(self.policy, items, self.batch_sizes, self.max_batch)
        failed = [(i, r.error) for i, r in enumerate(results) if r.actions is None]
        if failed:
            i, err = failed[0]
            raise RuntimeError(f"environment {ids[i]}: inference failed: {err}"
                               + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""))
        actions = np.concatenate([r.actions for r in results], axis=0)
        calls = {id(r.stage_ms): r.stage_ms for r in results}  # one stage_ms dict per engine call
        stage_ms: dict[str, float] = {}
        for ms in calls.values():
            for k, v in ms.items():
                stage_ms[k] = stage_ms.get(k, 0.0) + v
        return RolloutResult(actions, stage_ms, len(calls))


class RolloutChunks:
    """Per-environment Real-Time Chunking state for synchronous rollouts: each environment's
    executing chunk, its cursor, and the RTC request that joins the next chunk onto it.

    Inference takes no simulated time, but to roll out under the robot's conditions pass the
    delay d the robot would see: `update` then lets the executing chunk run d more actions
    (they were already committed on the robot while the new chunk was computed) and switches
    to the new chunk at its index d, exactly as the daemon does. An environment without an
    executing chunk (first call, or after `reset`) starts the new chunk at index 0.

    A chunk can be asked for before the last one took over (an execution horizon s below d): the
    request's prefix then runs on through the chunk still waiting, and the new chunk replaces it
    from its own index d, so the actions that run are always the ones the requests promised.
    """

    def __init__(self, num_envs: int, mode: RTCMode = "guided-approx", execution_horizon: int = 25,
                 max_guidance_weight: float = 5.0) -> None:
        self.num_envs = num_envs
        self.mode = mode
        self.execution_horizon = execution_horizon
        self.max_guidance_weight = max_guidance_weight
        self.chunks: list[np.ndarray | None] = [None] * num_envs
        self.cursor = np.zeros(num_envs, dtype=np.int64)
        self._pending: list[tuple[np.ndarray, int] | None] = [None] * num_envs  # (chunk, d) waiting to take over
        self._countdown = np.zeros(num_envs, dtype=np.int64)

    def _delays(self, delay: int | Sequence[int]) -> np.ndarray:
        d = np.broadcast_to(np.asarray(delay, dtype=np.int64), (self.num_envs,))
        if (d < 0).any():
            raise ValueError("RTC delays must be >= 0")
        return d

    def requests(self, delay: int | Sequence[int] = 0) -> list[RTCRequest | None]:
        """One request per environment: the still-unexecuted rest of its chunk as the prefix
        (prefix[i] is what would run at index i of the new chunk). None where an environment
        has no chunk yet (first call, or after `reset`) or RTC is off. delay: one d for all
        environments or one per environment."""
        out: list[RTCRequest | None] = []
        for e, d in enumerate(self._delays(delay)):
            chunk = self.chunks[e]
            if chunk is None or self.mode not in SOLVER_RTC_MODES:
                out.append(None)
                continue
            rest = self._ahead(e)
            if len(rest) < d:
                raise ValueError(f"environment {e}: delay {d} exceeds the {len(rest)} actions left in its chunk")
            out.append(RTCRequest(self.mode, rest, int(d), self.execution_horizon, self.max_guidance_weight))
        return out

    def update(self, actions: np.ndarray, delay: int | Sequence[int] = 0, env_ids: Sequence[int] | None = None) -> None:
        """New chunks, (len(env_ids), H, A): each takes over at its index d after d more actions
        of the executing chunk. delay: one d or one per environment (num_envs values)."""
        ids = range(self.num_envs) if env_ids is None else env_ids
        d = self._delays(delay)
        for row, e in enumerate(ids):
            new = np.asarray(actions[row], dtype=np.float32)
            if self.chunks[e] is None or d[e] == 0:
                self.chunks[e], self.cursor[e], self._pending[e] = new, 0 if self.chunks[e] is None else d[e], None
            else:
                if self._pending[e] is not None:
                    # the chunk still waiting never runs past the new one's start: what runs until
                    # then (`_ahead`, as the request's prefix had it) becomes the executing chunk
                    self.chunks[e], self.cursor[e], self._pending[e] = self._ahead(e), 0, None
                self._pending[e], self._countdown[e] = (new, int(d[e])), int(d[e])

    def _ahead(self, e: int) -> np.ndarray:
        """The actions environment `e` runs from its next step on, as one array: the executing
        chunk's (its last held past its end) until a waiting chunk takes over, then that one's."""
        chunk = self.chunks[e]
        assert chunk is not None
        pending = self._pending[e]
        if pending is None:
            return chunk[self.cursor[e]:]
        steps = np.minimum(self.cursor[e] + np.arange(self._countdown[e]), len(chunk) - 1)
        return np.concatenate([chunk[steps], pending[0][pending[1]:]])

    def next_actions(self) -> np.ndarray:
        """(N, A): each environment's next action; advances every cursor by one."""
        if any(c is None for c in self.chunks):
            raise RuntimeError("an environment has no chunk; call update() after act()")
        out = []
        for e in range(self.num_envs):
            pending = self._pending[e]
            if pending is not None and self._countdown[e] == 0:
                self.chunks[e], self.cursor[e], self._pending[e] = pending[0], pending[1], None
            chunk = self.chunks[e]
            assert chunk is not None
            i = min(int(self.cursor[e]), len(chunk) - 1)  # hold the last action past the end
            out.append(chunk[i])
            self.cursor[e] += 1
            if self._pending[e] is not None:
                self._countdown[e] -= 1
        return np.stack(out)

    def reset(self, env_ids: Sequence[int]) -> None:
        """Episodes that ended: their next chunk starts fresh, without RTC."""
        for e in env_ids:
            self.chunks[e], self._pending[e] = None, None
            self.cursor[e] = self._countdown[e] = 0
