"""Run many independent requests as one engine call, giving each the actions it would get alone.

Shared by the multi-robot server, the RL rollout API and the Ray Serve deployment, so all three
batch the same way. A request is one or more observations with its own RTC request and noise;
`run_items` concatenates compatible requests, pads to one of the engine's captured batch sizes
if it has any, runs `Policy.infer` once per compatible group and slices the actions back.

Per-sample RTC: every built-in engine takes one (B, H) weight row and one hard-prefix length
d per sample (`inpaint` holds each sample's own first d_i actions through a (B, H, 1) mask),
so requests with different delays share a batch in every mode; requests are grouped by mode
and max guidance weight only. Requests without solver RTC ride along with any such group
(zero weights and d = 0 leave them untouched). An engine that says `per_sample_rtc = False`
gets only requests with equal soft masks (same mode, beta, d, s and prefix length), without
riders.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from phyai_edge.adapters.base import Observation
from phyai_edge.engines.base import SOLVER_RTC_MODES, RTCRequest
from phyai_edge.engines.policy import checked_noise
from phyai_edge.serve.scheduler import compatible, pad_size  # pad_size: also imported from here

log = logging.getLogger(__name__)

# (mode, beta, delay, execution horizon, prefix length); None: no solver RTC. For an engine
# with per-sample RTC the last three are -1 (requests group by mode and beta only).
GroupKey = tuple[str, float, int, int, int] | None


@dataclass
class BatchItem:
    """One request: k observations, an optional RTC request for them, optional (k, H, D) noise."""

    observations: list[Observation]
    rtc: RTCRequest | None = None
    noise: torch.Tensor | np.ndarray | None = None
    tag: Any = None  # whatever the caller needs to route the answer back

    @property
    def size(self) -> int:
        return len(self.observations)


@dataclass
class ItemResult:
    actions: np.ndarray | None  # (k, H, A) float32, None if the group's inference failed
    error: str = ""
    batch: int = 0  # observations in the engine call that produced it (after padding)
    stage_ms: dict[str, float] = field(default_factory=dict)
    # Its group's engine call failed and it ran again alone: the batch cost one engine call per
    # request on top of the failed one (the server counts these; it is easy to miss otherwise).
    rerun: bool = False
    # The request itself is wrong (`Policy.observation_problem`): refused before any batch, never run.
    bad_request: bool = False


def group_key(rtc: Any, per_sample: bool = True) -> GroupKey:
    """Which requests may share one engine call (see the module docstring). per_sample: the
    engine takes one RTC soft mask per sample (`Policy.per_sample_rtc`); without it requests
    batch only when their masks are equal (same d, s and prefix length)."""
    if rtc is None or getattr(rtc, "mode", "none") not in SOLVER_RTC_MODES:
        return None
    if not per_sample:
        n = int(np.shape(rtc.prefix)[-2])
        return (rtc.mode, float(rtc.max_guidance_weight), int(rtc.delay), int(rtc.execution_horizon), n)
    return (rtc.mode, float(rtc.max_guidance_weight), -1, -1, -1)


def group_items(items: Sequence[BatchItem], per_sample: bool = True) -> list[list[int]]:
    """Indices of items, grouped so that each group is one valid engine call. Order inside a
    group follows the input order (the caller already sorted by deadline)."""
    groups: list[tuple[GroupKey, list[int]]] = []
    loose: list[int] = []
    for i, it in enumerate(items):
        k = group_key(it.rtc, per_sample)
        if k is None:
            loose.append(i)
            continue
        for gk, members in groups:
            if gk == k:
                members.append(i)
                break
        else:
            groups.append((k, [i]))
    # Unguided requests join the largest RTC group instead of costing an engine call of their
    # own; groups keyed by one shared mask cannot take them (see `scheduler.compatible`).
    hosts = [g for g in groups if compatible(g[0], None)]
    if loose and hosts:
        max(hosts, key=lambda g: len(g[1]))[1].extend(loose)
    elif loose:
        groups.append((None, loose))
    return [sorted(members) for _, members in groups]


def split_rtc(rtc: RTCRequest | None, k: int) -> list[RTCRequest | None]:
    """A request's RTC (prefix (n, A) shared or (k, n, A) per observation) -> one per observation."""
    if rtc is None or rtc.mode not in SOLVER_RTC_MODES:
        return [None] * k
    prefix = rtc.prefix.detach().cpu().numpy() if isinstance(rtc.prefix, torch.Tensor) else np.asarray(rtc.prefix)
    if prefix.ndim == 2:
        rows = [prefix] * k
    elif prefix.ndim == 3 and prefix.shape[0] == k:
        rows = list(prefix)
    else:
        raise ValueError(f"RTC prefix must be (n, A) or ({k}, n, A) for a request of {k} observations, got {prefix.shape}")
    return [RTCRequest(rtc.mode, r, rtc.delay, rtc.execution_horizon, rtc.max_guidance_weight) for r in rows]


def item_noise(policy: Any, item: BatchItem) -> torch.Tensor:
    """The item's own noise, checked, or fresh draws from the engine's seeded generator, on the
    engine's device (drawn noise stays there: a round trip through the host would cost a
    device sync per request)."""
    a = policy.adapter
    shape = (item.size, a.chunk_size, a.model_action_dim)
    device = torch.device(policy.device)
    if item.noise is None:
        return policy.engine.sample_noise(item.size).to(device, torch.float32)
    return checked_noise(item.noise, shape).to(device)


def run_group(policy: Any, items: Sequence[BatchItem], batch_sizes: Sequence[int] | None = None) -> list[ItemResult]:
    """One engine call for compatible items (a group from `group_items`)."""
    obs: list[Observation] = []
    rtcs: list[RTCRequest | None] = []
    noises: list[torch.Tensor] = []
    for it in items:
        obs.extend(it.observations)
        rtcs.extend(split_rtc(it.rtc, it.size))
        noises.append(item_noise(policy, it))
    n = len(obs)
    padded = pad_size(n, batch_sizes)
    if padded > n:
        # Pad with copies of the first sample (observation and RTC request, so an engine with one
        # RTC mask per batch still sees equal masks) and zero noise; their actions are dropped.
        # Samples do not interact inside the model, so padding changes no real sample's actions.
        extra = padded - n
        obs.extend([obs[0]] * extra)
        rtcs.extend([rtcs[0]] * extra)
        noises.append(torch.zeros(extra, *noises[0].shape[1:], device=noises[0].device))
    use_rtc = any(r is not None for r in rtcs)
    res = policy.infer(obs, rtc=rtcs if use_rtc else None, noise=torch.cat(noises))
    out, start = [], 0
    stage_ms = dict(res.stage_ms)  # one dict per engine call, shared by its items (callers count calls by it)
    for it in items:
        out.append(ItemResult(res.actions[start:start + it.size], batch=padded, stage_ms=stage_ms))
        start += it.size
    return out


def run_items(policy: Any, items: Sequence[BatchItem], batch_sizes: Sequence[int] | None = None,
              max_batch: int | None = None, strict_prompts: bool = False) -> list[ItemResult]:
    """Run every item; an engine error fails only the items of the group it happened in. An item
    whose observations the policy refuses (`observation_problem`: a state of the wrong width, an
    unknown camera, an empty image; with `strict_prompts`, a prompt the model would truncate) is
    answered at once and joins no batch, so it never costs its neighbours a failed call and a rerun
    each. The server is strict (a robot must hear that its state was cut off its prompt); offline
    evaluation and rollouts truncate as preprocess does, with its one warning."""
    results: list[ItemResult | None] = [None] * len(items)
    problem = getattr(policy, "observation_problem", None)
    a = getattr(policy, "adapter", None)
    if problem is not None:
        for i, it in enumerate(items):
            why = next((f"obs[{j}]: {p}" for j, o in enumerate(it.observations)
                        if (p := problem(o, allow_truncation=not strict_prompts))), None)
            if why is None and it.noise is not None and a is not None:
                try:  # a request's own noise of another shape: its mistake, not the engine's
                    checked_noise(it.noise, (it.size, a.chunk_size, a.model_action_dim))
                except ValueError as exc:
                    why = str(exc)
            if why is not None:
                results[i] = ItemResult(None, error=why, bad_request=True)
    todo = [i for i, r in enumerate(results) if r is None]
    for i, r in zip(todo, _run_grouped(policy, [items[i] for i in todo], batch_sizes, max_batch)):
        results[i] = r
    return [r if r is not None else ItemResult(None, error="not run") for r in results]


def _run_grouped(policy: Any, items: Sequence[BatchItem], batch_sizes: Sequence[int] | None,
                 max_batch: int | None) -> list[ItemResult]:
    """`run_items` for items that passed the policy's checks."""
    results: list[ItemResult | None] = [None] * len(items)
    # The largest call: max_batch, but never past the largest captured size, which is all an
    # engine with captured shapes runs (a larger group would fail and rerun one by one).
    limits = [b for b in (max_batch, max(batch_sizes) if batch_sizes else None) if b]
    limit = min(limits) if limits else None
    for group in group_items(items, bool(getattr(policy, "per_sample_rtc", True))):
        # Split a group that exceeds the largest batch the engine takes.
        chunks: list[list[int]] = [[]]
        for i in group:
            if limit and chunks[-1] and sum(items[j].size for j in chunks[-1]) + items[i].size > limit:
                chunks.append([])
            chunks[-1].append(i)
        for chunk in chunks:
            try:
                got = run_group(policy, [items[i] for i in chunk], batch_sizes)
            except Exception as exc:
                # One malformed request (wrong state width, unknown camera) must not cost its
                # batch neighbours their answers: rerun one by one so only it fails.
                log.warning("engine call for %d requests failed (%s: %s); running them one by one",
                            len(chunk), type(exc).__name__, exc)
                got = [_run_alone(policy, items[i], batch_sizes) for i in chunk]
                for r in got:
                    r.rerun = True
            for i, r in zip(chunk, got):
                results[i] = r
    return [r if r is not None else ItemResult(None, error="not run") for r in results]


def _run_alone(policy: Any, item: BatchItem, batch_sizes: Sequence[int] | None) -> ItemResult:
    try:
        return run_group(policy, [item], batch_sizes)[0]
    except Exception as exc:
        return ItemResult(None, error=f"{type(exc).__name__}: {exc}")


def warm_up(policy: Any, batch_sizes: Sequence[int], observations: Sequence[Observation],
            rtcs: Sequence[RTCRequest | None] = (None,), repeats: int = 2) -> dict[int, float]:
    """Run every batch size once per observation and RTC request before serving, so that no
    robot's request pays for the engine's first call at a shape (a CUDA-graph capture: about a
    second at full size). The cudagraph engine keeps graphs per batch size, prompt bucket (the
    batch's longest prompt, rounded up) and RTC mode: give one observation per prompt-length
    class and one request per RTC mode the robots will send (None: no solver RTC, as a robot's
    first request, which has no executing chunk yet). Returns, per batch size, the slowest RTC
    request's last run with the first observation: a first estimate for the latency rule."""
    if not observations:
        raise ValueError("warm_up needs at least one observation")
    if not rtcs:
        raise ValueError("warm_up needs at least one RTC request (None for none)")
    times: dict[int, float] = {}
    for b in sorted(set(batch_sizes)):
        for i, obs in enumerate(observations):
            for rtc in rtcs:
                for _ in range(repeats if i == 0 else 1):
                    t0 = time.perf_counter()
                    got = run_items(policy, [BatchItem([obs], rtc) for _ in range(b)], batch_sizes)
                    if got[0].actions is None:
                        raise RuntimeError(f"warm-up at batch {b} failed: {got[0].error}")
                    took = time.perf_counter() - t0
                if i == 0:
                    times[b] = max(times.get(b, 0.0), took)
    return times
