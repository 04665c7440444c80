"""`Policy`: an adapter and an engine behind one call, observations in, robot actions out.

This is what the daemon, batch evaluation, RL rollouts and the multi-robot server all call,
so they give the same actions for the same observations and noise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from phyai_edge.adapters import load_adapter
from phyai_edge.adapters.base import Adapter, ModelInputs, Observation
from phyai_edge.engines import make_engine
from phyai_edge.engines.base import RTC_MODES, SOLVER_RTC_MODES, InferenceResult, RTCRequest
from phyai_edge.engines.bundle import optional_kwargs
from phyai_edge.engines.rtc import RTCGuidance, prefix_weights

log = logging.getLogger(__name__)



def _check_mode(rtc: RTCRequest) -> None:
    # A misspelt mode read as a daemon-side one: RTC silently off.
    if rtc.mode not in RTC_MODES:
        raise ValueError(f"RTC mode {rtc.mode!r} is not one of {', '.join(RTC_MODES)}")


def checked_noise(noise: torch.Tensor | np.ndarray, shape: tuple[int, int, int]) -> torch.Tensor:
    """`noise` as a float32 tensor, refused unless it has `shape` (observations, H, model action
    width) and, where it is on the host, is finite (reading a GPU tensor's values would wait for
    the device before every chunk)."""
    n = noise if isinstance(noise, torch.Tensor) else torch.as_tensor(np.asarray(noise))
    if tuple(n.shape) != shape:
        raise ValueError(f"noise must have shape {shape} (observations, H, model action width), got {tuple(n.shape)}")
    if n.device.type == "cpu" and not torch.isfinite(n).all():
        raise ValueError("noise has NaN or Inf values")
    return n.to(torch.float32)

class Policy:
    def __init__(self, adapter: Adapter, engine) -> None:
        self.adapter, self.engine = adapter, engine
        self.chunk_size = adapter.chunk_size
        self.action_dim = adapter.action_dim
        self.model_action_dim = adapter.model_action_dim  # the noise's width (`infer(noise=)`)
        self.state_dim = adapter.state_dim
        self.camera_names = list(adapter.camera_names)
        self.device = engine.device
        # Whether the engine takes per-sample RTC ((B, H) weights, (B,) delays): every built-in
        # backend does (`EngineBase.per_sample_rtc`); an engine that says False gets only
        # requests with equal masks (the batchers group them so).
        self.per_sample_rtc = bool(getattr(engine, "per_sample_rtc", False))
        # Cameras the caller never has (`set_absent_cameras`): their slots are left out of the model's
        # inputs where the adapter and engine allow it, instead of run masked.
        self.absent_cameras: frozenset[str] = frozenset()
        # The optional arguments of the adapter protocol (adapters/base.py), handed only to an
        # adapter that names them: one written before them runs unchanged.
        self._post_takes_inputs = "inputs" in optional_kwargs(adapter.postprocess, inputs=None)
        self._normalize_takes_states = "states" in optional_kwargs(adapter.normalize_actions, states=None)

    def postprocess(self, chunk: torch.Tensor, inputs: ModelInputs) -> np.ndarray:
        """The adapter's `postprocess`, given the `inputs` its chunk came from where it takes them
        (a policy whose actions are anchored to the observation: PI0.5 with relative actions)."""
        if self._post_takes_inputs:
            return self.adapter.postprocess(chunk, inputs=inputs)
        return self.adapter.postprocess(chunk)

    def _checked_states(self, states: np.ndarray | None, batch: int) -> np.ndarray | None:
        if states is None:
            return None
        states = np.asarray(states)
        if states.shape != (batch, self.state_dim):
            raise ValueError(f"RTC states must be ({batch}, {self.state_dim}), one per sample, got {states.shape}")
        return states

    def _normalize(self, actions: np.ndarray, states: np.ndarray | None) -> torch.Tensor:
        if states is not None and self._normalize_takes_states:
            return self.adapter.normalize_actions(actions, states=states)
        return self.adapter.normalize_actions(actions)

    def rtc_guidance(self, rtc: RTCRequest, batch: int, states: np.ndarray | None = None) -> RTCGuidance | None:
        """Robot-unit RTC request -> model-space guidance for the solver (None if daemon-side).
        `states`: the new observations' raw states, (batch, state_dim) (`preprocess`'s
        `extras["states"]`), which a relative policy's prefix is made relative to: the new chunk
        is predicted from them, not from the state the executing chunk started at."""
        _check_mode(rtc)
        if rtc.mode not in SOLVER_RTC_MODES:
            return None
        a = self.adapter
        h, d_model = a.chunk_size, a.model_action_dim
        prefix = self._checked_prefix(rtc, batch)
        n = prefix.shape[1]
        target = torch.zeros(batch, h, d_model)
        states = self._checked_states(states, batch)
        target[:, :n] = self._normalize(prefix, None if states is None else states[:, None, :])
        return RTCGuidance(rtc.mode, target, self._soft_mask(rtc, n), self._dim_mask(), rtc.delay,
                           rtc.max_guidance_weight)

    def _checked_prefix(self, rtc: RTCRequest, batch: int) -> np.ndarray:
        """rtc.prefix as a (batch, n, action_dim) array, checked against the chunk and delay."""
        a = self.adapter
        prefix = rtc.prefix.detach().cpu().numpy() if isinstance(rtc.prefix, torch.Tensor) else np.asarray(rtc.prefix)
        if prefix.ndim == 2:
            prefix = np.broadcast_to(prefix, (batch, *prefix.shape))
        if prefix.ndim != 3 or prefix.shape[0] != batch or prefix.shape[2] != a.action_dim:
            raise ValueError(f"RTC prefix must be (n, {a.action_dim}) or ({batch}, n, {a.action_dim}), got {prefix.shape}")
        n = prefix.shape[1]
        if n > a.chunk_size:
            raise ValueError(f"RTC prefix has {n} actions, more than the chunk length {a.chunk_size}")
        if rtc.delay > n:
            raise ValueError(f"RTC delay {rtc.delay} exceeds the {n} prefix actions given")
        if not np.isfinite(prefix).all():
            raise ValueError("RTC prefix has NaN or Inf values")
        return prefix

    def _soft_mask(self, rtc: RTCRequest, n: int) -> torch.Tensor:
        """The soft mask decays to 0 where the executing chunk ends: at H - s, or at the prefix's
        end n if that comes first. In the paper's Algorithm 1, s is the number of actions that
        really ran (A_prev = A_cur[s:], so H - s is the prefix length); a prefix shorter than
        H - s (the daemon's chunking.horizon below the policy's chunk, or its executing index past
        s after a late chunk or missed slots) means more ran than the configured s. Cutting the
        H - s mask off at n instead would leave a jump (about 0.25 to 0 for H=50, s=10, n=20)."""
        h = self.adapter.chunk_size
        return prefix_weights(h, rtc.delay, max(rtc.execution_horizon, h - n))

    def _dim_mask(self) -> torch.Tensor:
        dim_mask = torch.zeros(self.adapter.model_action_dim)
        dim_mask[: self.adapter.action_dim] = 1.0
        return dim_mask

    def rtc_guidance_per_sample(self, requests: list[RTCRequest | None],
                                states: np.ndarray | None = None) -> RTCGuidance | None:
        """One RTC request per sample (each robot or environment with its own prefix and delay)
        -> guidance with (B, H) weights and (B,) delays. Samples with None or a daemon-side
        mode are unguided. Solver modes and guidance weights must agree across the batch (the
        serve and rollout batchers group requests that way); delays may differ in every mode.
        `states`: as for `rtc_guidance`, one row per request, each sample's prefix made
        relative to its own.

        What joining one `rtc_guidance(r, 1)` per sample (`batch_guidance`) gives, built for the
        batch at once: one normalisation of every prefix row, one soft mask per distinct
        (d, s, prefix length)."""
        a = self.adapter
        h, d_model = a.chunk_size, a.model_action_dim
        rows: list[tuple[int, RTCRequest, np.ndarray]] = []
        masks: dict[tuple[int, int, int], torch.Tensor] = {}
        for i, r in enumerate(requests):
            if r is None:
                continue
            _check_mode(r)
            prefix = r.prefix.detach().cpu().numpy() if isinstance(r.prefix, torch.Tensor) else np.asarray(r.prefix)
            if prefix.ndim == 3 and prefix.shape[0] != 1:
                raise ValueError(f"sample {i}: a per-sample RTC prefix must be (n, A) or (1, n, A), got {prefix.shape}")
            if r.mode not in SOLVER_RTC_MODES:
                continue
            prefix = self._checked_prefix(RTCRequest(r.mode, prefix, r.delay, r.execution_horizon,
                                                     r.max_guidance_weight), 1)[0]
            key = (r.delay, r.execution_horizon, prefix.shape[0])
            if key not in masks:
                masks[key] = self._soft_mask(r, prefix.shape[0])
            rows.append((i, r, prefix))
        if not rows:
            return None
        first = rows[0][1]
        for _, p, _ in rows[1:]:
            if p.mode != first.mode or p.max_guidance_weight != first.max_guidance_weight:
                raise ValueError(
                    f"cannot batch RTC mode {p.mode!r} (beta {p.max_guidance_weight}) with {first.mode!r} "
                    f"(beta {first.max_guidance_weight}); group requests by mode first"
                )
        b = len(requests)
        target, weights = torch.zeros(b, h, d_model), torch.zeros(b, h)
        delays = torch.zeros(b, dtype=torch.int64)
        states, row_states = self._checked_states(states, b), None
        if states is not None:  # each prefix row with its sample's state
            row_states = np.repeat(states[[i for i, _, _ in rows]], [p.shape[0] for _, _, p in rows], axis=0)
        norm = self._normalize(np.concatenate([p for _, _, p in rows]), row_states)  # elementwise: rows as alone
        start = 0
        for i, r, p in rows:
            n = p.shape[0]
            target[i, :n] = norm[start:start + n]
            start += n
            weights[i] = masks[(r.delay, r.execution_horizon, n)]
            delays[i] = r.delay
        g = RTCGuidance(first.mode, target, weights, self._dim_mask(), delays, first.max_guidance_weight)
        same_weights = bool((g.weights == g.weights[:1]).all())
        if same_weights:
            # Every sample has the same soft mask (same d, s and prefix length): hand the engine
            # the shared (H,) form (bit-identical to the (B, H) one, and what an engine without
            # per-sample RTC takes).
            g.weights = g.weights[0].clone()
        if not self.per_sample_rtc and not (same_weights and bool((g.delays == g.delays[:1]).all())):
            raise ValueError(f"the {getattr(self.engine, 'backend', '?')} engine takes one RTC soft mask per batch; "
                             "batch only requests with the same delay and prefix length")
        return g

    @property
    def graphs_built(self) -> int | None:
        """The engine's count of graph sets and loops built so far (each a capture on a GPU), None
        where it keeps none. Compared across a call it says whether the call met a shape, prompt
        length or RTC mode its warm-up did not run."""
        built = getattr(self.engine, "graphs_built", None)
        return built if isinstance(built, int) else None

    @property
    def drops_cameras(self) -> bool:
        """Whether cameras declared absent are left out of the model (the adapter can drop slots,
        `drop_cameras`, and the engine takes any view count, `any_views`) rather than run masked."""
        return hasattr(self.adapter, "drop_cameras") and bool(getattr(self.engine, "any_views", False))

    def set_absent_cameras(self, names: Sequence[str]) -> frozenset[str]:
        """Declare the model's cameras that this caller never has (the daemon: policy cameras with
        no source). Where the adapter can leave their slots out (`drop_cameras`; PI0.5: an absent
        camera's tokens are masked everywhere and take no position, so the chunk is the same to
        rounding) and the engine takes any view count (`any_views`), they are no longer run masked:
        one camera of PI0.5's three saves about two thirds of the vision tower and of the prefix.
        A camera named here that an observation does have is still used. Only static absence
        belongs here: a camera that comes and goes (an optional one going stale) would change the
        view count, and so the engine's graphs, while it runs. Returns the cameras in effect
        (empty where the adapter or engine cannot)."""
        unknown = set(names) - set(self.camera_names)
        if unknown:
            raise ValueError(f"unknown cameras {sorted(unknown)}; the model's are {self.camera_names}")
        absent = frozenset(names) if self.drops_cameras else frozenset()
        if len(absent) == len(self.camera_names):
            raise ValueError("every camera is declared absent; the model needs at least one image")
        if absent != self.absent_cameras and absent:
            log.info("cameras %s are never present: the model runs without their slots (%d of %d views)",
                     ", ".join(sorted(absent)), len(self.camera_names) - len(absent), len(self.camera_names))
        self.absent_cameras = absent
        return absent

    def fix_prompt_positions(self, prompts: str | Sequence[str], at_least: int = 0) -> int | None:
        """For callers whose prompts stay these while the robot states change (the daemon, the
        server's warmed prompts): has the engine keep room for the longest of them with any state
        (and for `at_least` tokens: instructions set at run time), so every state runs the graphs
        captured at warm-up. Otherwise a state whose numbers take more tokens reaches a new prompt
        length, and its graphs would be captured inside the control loop (about a second of held
        ticks on an H200) or on a robot's request. Returns the prompt tokens kept, or None where the
        adapter's prompt does not follow the state or the engine keeps no prompt length (nothing to
        fix)."""
        longest = getattr(self.adapter, "longest_prompt_tokens", None)
        if longest is None or not hasattr(self.engine, "min_prompt_positions"):
            return None
        n = max([int(longest(p)) for p in ([prompts] if isinstance(prompts, str) else prompts)] + [int(at_least)])
        limit = getattr(self.adapter, "max_prompt_tokens", None)
        if limit is not None:
            n = min(n, int(limit))  # a longer prompt is truncated to this: `prompt_fit` says so
        if n != self.engine.min_prompt_positions:
            log.info("prompt: up to %d tokens with any robot state; the engine keeps room for them", n)
        self.engine.min_prompt_positions = n
        return n

    def observation_problem(self, obs: Observation, allow_truncation: bool = False) -> str | None:
        """Why the adapter cannot run `obs` as it is (its `observation_problem`; `allow_truncation`:
        a prompt longer than the model takes is not a problem), or None; None too for an adapter
        that does not say."""
        check = getattr(self.adapter, "observation_problem", None)
        return check(obs, allow_truncation=allow_truncation) if check is not None else None

    def prompt_fit(self, prompt: str) -> tuple[int | None, int | None, int | None]:
        """(the most prompt tokens `prompt` takes with any robot state, the most this policy runs
        as it was warmed up: without building graphs or truncating, the most the model takes at
        all). Each is None where the adapter or engine cannot say. For an instruction set while
        the robot runs: one that needs more than the room would be truncated, or have its graphs
        captured inside the control loop."""
        longest = getattr(self.adapter, "longest_prompt_tokens", None)
        tokens = int(longest(prompt)) if longest is not None else None
        most = getattr(self.adapter, "max_prompt_tokens", None)
        room = getattr(self.engine, "prompt_room", None)
        if room is None:
            room = most
        return tokens, (int(room) if room is not None else None), (int(most) if most is not None else None)

    def infer(
        self,
        observations: list[Observation] | Observation,
        rtc: RTCRequest | list[RTCRequest | None] | None = None,
        noise: torch.Tensor | np.ndarray | None = None,
    ) -> InferenceResult:
        """rtc: one request for the whole batch (a (B, n, A) prefix and one d), or a list with
        one request (or None) per observation. noise: the flow's starting point, (B, H, model
        action width), a tensor or an array; None: the engine's seeded draws."""
        obs = [observations] if isinstance(observations, Observation) else list(observations)
        t0 = time.perf_counter()
        inputs = self.adapter.preprocess(obs, device=self.device)
        if self.absent_cameras:
            inputs = self.adapter.drop_cameras(inputs, self.absent_cameras)  # type: ignore[attr-defined]
        t1 = time.perf_counter()
        states = inputs.extras.get("states")
        if isinstance(rtc, (list, tuple)):
            if len(rtc) != len(obs):
                raise ValueError(f"got {len(rtc)} RTC requests for {len(obs)} observations")
            guidance = self.rtc_guidance_per_sample(list(rtc), states)
        else:
            guidance = self.rtc_guidance(rtc, len(obs), states) if rtc is not None else None
        if noise is not None:  # checked as a server checks it: a wrong H changed the chunk's length
            noise = checked_noise(noise, (len(obs), self.adapter.chunk_size, self.adapter.model_action_dim))
        chunk = self.engine.run(inputs, noise=noise, rtc=guidance)
        t2 = time.perf_counter()
        actions = self.postprocess(chunk, inputs)
        t3 = time.perf_counter()
        stage_ms = {"preprocess": (t1 - t0) * 1e3, **self.engine.last_stage_ms,
                    "postprocess": (t3 - t2) * 1e3, "total": (t3 - t0) * 1e3}
        return InferenceResult(actions=actions, chunk=chunk, stage_ms=stage_ms)


def load_policy(
    adapter: str = "pi05",
    checkpoint: str | Path | None = None,
    preset: str = "tiny",
    backend: str = "eager",
    device: str = "cpu",
    dtype: str = "float32",
    bundle: str | Path | None = None,
    seed: int = 0,
    tokenizer: str | Path | None = None,
    camera_names: list[str] | None = None,
    engine_options: dict[str, Any] | None = None,
    adapter_options: dict[str, Any] | None = None,
    absent_cameras: Sequence[str] = (),
) -> Policy:
    """Build a ready Policy. `bundle` (an exported engine folder) takes precedence over backend.
    `engine_options`: extra keyword arguments for the engine (e.g. cudagraph's `fp8="expert"`);
    `adapter_options`: the adapter's user options (its module's OPTIONS, e.g. PI0.5's
    `prompt_state`). A bundle was exported with its own: it takes none. `absent_cameras`: the
    model's cameras the caller never has (`Policy.set_absent_cameras`)."""
    _check_device(device)
    if bundle is not None:
        if adapter_options:
            raise ValueError(f"adapter options ({', '.join(sorted(adapter_options))}) apply when a bundle is "
                             "exported (phyai-edge export --adapter-option), not when it is loaded")
        # A checkpoint given too is what the bundle must have been exported from (checked, not ignored).
        policy = load_bundle_policy(Path(bundle), device=device, checkpoint=checkpoint, seed=seed,
                                    **(engine_options or {}))
        policy.set_absent_cameras(absent_cameras)
        return policy
    # A checkpoint loads on the CPU and the engine moves it; a preset without one is drawn where it
    # runs (a full-size preset has no weights to load: random ones, drawn on the GPU in seconds).
    ad = load_adapter(adapter, adapter_options, checkpoint=checkpoint, preset_name=preset,
                      device="cpu" if checkpoint is not None else device, tokenizer=tokenizer,
                      camera_names=camera_names, seed=seed)
    engine = make_engine(backend, ad, device=device, dtype=dtype, seed=seed, **(engine_options or {}))
    policy = Policy(ad, engine)
    policy.set_absent_cameras(absent_cameras)
    return policy


def load_bundle_policy(bundle: str | Path, device: str | torch.device = "cpu", checkpoint: str | Path | None = None,
                       seed: int = 0, check_hashes: bool = True, **engine_kwargs: Any) -> Policy:
    """A ready `Policy` from an exported bundle (what `load_policy(bundle=...)` and `phyai-edge bench
    --engine` call). Refuses a bundle that fails its checks; the manifest is kept as `policy.manifest`
    and where the load's time went (`load_bundle_engine`'s timings) as `policy.load_timings`."""
    from phyai_edge.engines.bundle import load_bundle_engine

    _check_device(device)
    timings: dict[str, float] = {}
    adapter, engine, manifest = load_bundle_engine(bundle, device, checkpoint, seed, check_hashes=check_hashes,
                                                   timings=timings, **engine_kwargs)
    policy = Policy(adapter, engine)
    policy.manifest = manifest
    policy.load_timings = timings
    return policy


def _check_device(device: str | torch.device) -> None:
    """A device this machine cannot run, refused in one line before anything loads (the daemon's
    worker, `phyai-edge eval`, a user's script): otherwise a CPU-only torch answers `cuda` with a
    missing ATen_cuda library from deep inside the engine."""
    from phyai_edge.engines.device import device_problem

    problem = device_problem(str(device), allow_meta=True)
    if problem is not None:
        raise ValueError(problem)

