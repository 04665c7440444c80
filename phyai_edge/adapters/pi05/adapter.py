"""The PI0.5 Model Adapter: everything the runtime needs to know about PI0.5, and nothing else."""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from phyai_edge.adapters.base import ModelInputs, Observation, SolverSpec, StageSpec
from phyai_edge.adapters.normalization import NormStats
from phyai_edge.adapters.pi05.config import PI05Config
from phyai_edge.adapters.pi05.model import PI05Model
from phyai_edge.adapters.pi05.preprocess import (
    StagedImages,
    discretize_state,
    format_prompt,
    image_problem,
    image_to_float_chw,
    images_from_staged,
    images_to_model,
    resize_with_pad,
    stage_images,
    stateless_prompt,
)
from phyai_edge.adapters.pi05.robot_space import AlohaSpace, check_robot_space, robot_space
from phyai_edge.adapters.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)

STAGES = ("embed_images", "encode_prefix", "denoise_step")
# Distinct prompt texts kept tokenised: a fleet's prompts times the state-bin patterns that
# recur (a robot at rest, the padding copies of a batch); a miss costs one tokenisation.
TOKEN_CACHE_SIZE = 4096


@dataclass
class RobotIO:
    """How a robot's observations and actions map onto the model's fixed slots."""

    camera_names: list[str]
    state_dim: int
    action_dim: int
    state_stats: NormStats
    action_stats: NormStats
    # Write the state zero-padded (after normalising: bin 128) to the model's width into the
    # prompt. Older openpi robot transforms padded the state before tokenising, and so did LeRobot
    # v0.4.0-v0.4.4 (policies/pi05/processor_pi05.py: pad_vector(state, max_state_dim) before
    # np.digitize; removed in v0.5.0), so PI0.5 policies fine-tuned with those versions were
    # trained on 32 state values. Current LeRobot and openpi's PI0.5 model transforms write the
    # robot's own values; a LeRobot folder does not record which version wrote it, and the loader
    # assumes the current one (False).
    pad_state_in_prompt: bool = False
    # Whether the prompt carries the state at all. openpi's PI0.5 configs may turn it off
    # (`discrete_state_input=False`: pi05_libero), and then tokenise the bare instruction and "\n"
    # (`preprocess.stateless_prompt`); the model never sees the state. Its folders do not record it.
    state_in_prompt: bool = True
    # Resize camera frames with antialiasing (PIL's BILINEAR: openpi resizes so, on its client and
    # in its training transforms) or without (torch's plain bilinear: LeRobot's resize_with_pad).
    # A downscaled 640 x 480 frame differs by up to ~27 of 255 levels between the two, so each
    # checkpoint gets the one it was trained with: openpi folders True, LeRobot folders False.
    resize_antialias: bool = False
    default_prompt: str = ""
    # A policy trained on relative (delta) actions predicts, on the action dims marked True, offsets
    # from the observed state (LeRobot's use_relative_actions, openpi's DeltaActions): one bool per
    # action dim, each True dim i anchored to state value i; () for absolute actions. Kept in the
    # form `fit_relative_mask` gives.
    relative_action_mask: tuple[bool, ...] = ()
    # The robot's own convention where the policy was trained in another (`robot_space.py`: "aloha"
    # for openpi's ALOHA policies); "model": the robot speaks the policy's space.
    robot_space: str = "model"
    extra: dict[str, Any] = field(default_factory=dict)


def fit_relative_mask(mask: Sequence[bool], action_dim: int, state_dim: int) -> tuple[bool, ...]:
    """`mask` as `RobotIO.relative_action_mask` keeps it: one bool per action dim, False past the
    end of a shorter mask (openpi's DeltaActions leaves those dims absolute), () when no dim is
    relative. ValueError where the mask is longer than the action, or a relative dim has no state
    value to add back."""
    mask = tuple(bool(m) for m in mask)
    if len(mask) > action_dim:
        raise ValueError(f"the relative action mask has {len(mask)} entries, the action only {action_dim} dims")
    relative = [i for i, m in enumerate(mask) if m]
    if not relative:
        return ()
    if relative[-1] >= state_dim:
        raise ValueError(f"the relative action mask makes action dim {relative[-1]} relative to the state, "
                         f"which has only {state_dim} values")
    return mask + (False,) * (action_dim - len(mask))


class PI05Adapter:
    name = "pi05"

    def __init__(self, cfg: PI05Config, model: PI05Model, tokenizer: PromptTokenizer, io: RobotIO) -> None:
        if io.action_dim > cfg.max_action_dim:
            raise ValueError(f"action_dim {io.action_dim} exceeds the model's padded width {cfg.max_action_dim}")
        if io.state_dim > cfg.max_state_dim:
            raise ValueError(f"state_dim {io.state_dim} exceeds the model's padded width {cfg.max_state_dim}")
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model embeds {cfg.vocab_size}")
        for what, stats, dim in (("state", io.state_stats, io.state_dim), ("action", io.action_stats, io.action_dim)):
            # Here rather than at the first observation, which would fail (the daemon: at warm-up)
            # with a bare shape error.
            if stats.dim is not None and stats.dim != dim:
                raise ValueError(f"the {what} statistics have {stats.dim} values, the robot's {what} {dim}")
        io.relative_action_mask = fit_relative_mask(io.relative_action_mask, io.action_dim, io.state_dim)
        check_robot_space(io.robot_space, io.state_dim, io.action_dim)
        self.cfg, self.module, self.tokenizer, self.io = cfg, model, tokenizer, io
        self.chunk_size = cfg.chunk_size
        self.model_action_dim = cfg.max_action_dim
        self.action_dim = io.action_dim
        self.state_dim = io.state_dim
        self.camera_names = list(io.camera_names)
        self.solver = SolverSpec(cfg.num_steps)
        self._warned_truncation = False
        self._token_cache: OrderedDict[str | tuple[str, ...], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._slot_indices: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}  # drop_cameras'
        self._token_owner: tuple[PromptTokenizer, int] | None = None

    # -- stages ---------------------------------------------------------------------------
    def stage_names(self) -> list[str]:
        return list(STAGES)

    def stage(self, name: str) -> Callable[..., Any]:
        if name not in STAGES:
            raise KeyError(f"PI0.5 has no stage {name!r}; stages are {STAGES}")
        return getattr(self.module, name)

    def stage_specs(self, batch_size: int, num_views: int | None = None) -> list[StageSpec]:
        c = self.cfg
        nv = num_views or len(self.camera_names)
        s, t = c.vision.image_size, c.vision.tokens_per_image
        p_len = nv * t + c.max_token_len
        dt = self.module.compute_dtype
        b, layers, kvh, hd = batch_size, c.prefix.depth, c.prefix.num_kv_heads, c.prefix.head_dim
        kv = ((layers, b, kvh, p_len, hd), dt)
        return [
            StageSpec("embed_images", {"images": ((b, nv, 3, s, s), torch.float32)},
                      {"image_embeds": ((b, nv * t, c.prefix.width), dt)}),
            StageSpec(
                "encode_prefix",
                {"image_embeds": ((b, nv * t, c.prefix.width), dt), "image_mask": ((b, nv), torch.bool),
                 "tokens": ((b, c.max_token_len), torch.int64), "token_mask": ((b, c.max_token_len), torch.bool)},
                {"k_cache": kv, "v_cache": kv, "prefix_mask": ((b, p_len), torch.bool)},
            ),
            StageSpec(
                "denoise_step",
                {"x_t": ((b, c.chunk_size, c.max_action_dim), torch.float32), "t": ((b,), torch.float32),
                 "k_cache": kv, "v_cache": kv, "prefix_mask": ((b, p_len), torch.bool)},
                {"velocity": ((b, c.chunk_size, c.max_action_dim), torch.float32)},
            ),
        ]

    # -- pre / post -----------------------------------------------------------------------
    def preprocess(self, observations: list[Observation], device: torch.device | str = "cpu") -> ModelInputs:
        """Equal to `preprocess_per_sample` (bit for bit but for frames a GPU resizes); faster:
        see `preprocess.images_to_model` and `prompt_tokens`."""
        if not observations:
            raise ValueError("preprocess needs at least one observation")
        device = torch.device(device)
        # On a GPU the frames' copy and conversion are queued here and run while the host
        # tokenises below.
        images, present = self.images(observations, device)
        states = self._checked_states(observations)
        ids, mask = self._batch_prompt_tokens(observations, states)
        tokens, token_mask = torch.from_numpy(ids), torch.from_numpy(mask)
        pin = device.type == "cuda"
        if pin:
            tokens, token_mask = tokens.pin_memory(), token_mask.pin_memory()
        tensors = {
            "images": images,
            "image_mask": present,
            "tokens": tokens.to(device, non_blocking=pin),
            "token_mask": token_mask.to(device, non_blocking=pin),
        }
        # The camera mask also on the host, so `drop_cameras` decides without waiting for the device.
        on_host = np.array([[obs.images.get(n) is not None for n in self.camera_names] for obs in observations])
        # The raw states too: a relative policy's chunk is anchored to them (`postprocess`).
        return ModelInputs(tensors, len(observations), {"cameras_present": on_host, "states": states})

    def drop_cameras(self, inputs: ModelInputs, names: Collection[str]) -> ModelInputs:
        """`inputs` without the slots of cameras in `names` that no observation of the batch has.
        The chunk is the same (to rounding): an absent camera's image tokens are masked out of
        every attention and take no position (positions count valid tokens), so the model
        computes 256 tokens a slot for nothing, through the vision tower, the prefix and every
        step's attention. A camera in `names` that some observation does have is kept, so the
        result never changes; the engine then sees a different view count (other graphs)."""
        present = inputs.extras.get("cameras_present")
        if present is None:
            raise ValueError("drop_cameras needs inputs from this adapter's preprocess (no cameras_present)")
        keep = [v for v, n in enumerate(self.camera_names) if n not in names or bool(present[:, v].any())]
        if len(keep) == len(self.camera_names):
            return inputs
        t = dict(inputs.tensors)
        for key in ("images", "image_mask"):
            t[key] = t[key].index_select(1, self._slot_index(tuple(keep), t[key].device))
        return ModelInputs(t, inputs.batch_size, {**inputs.extras, "cameras_present": present[:, keep]})

    def _slot_index(self, keep: tuple[int, ...], device: torch.device) -> torch.Tensor:
        # Made once per device: a fresh index copied from pageable host memory would make the host
        # wait for the frames' conversion already queued on the stream.
        index = self._slot_indices.get((keep, device))
        if index is None:
            index = self._slot_indices[(keep, device)] = torch.tensor(keep, dtype=torch.long, device=device)
        return index

    def images(self, observations: list[Observation], device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """The images input (B, views, 3, S, S) float32 and the (B, views) camera mask, on `device`."""
        return images_to_model(self._camera_slots(observations), self.camera_names, self.cfg.vision.image_size,
                               torch.device(device), self.io.resize_antialias)

    def _camera_slots(self, observations: list[Observation]) -> list[list[Any]]:
        """Each observation's images in camera order (None where missing), checked."""
        per_obs = []
        for i, obs in enumerate(observations):
            unknown = set(obs.images) - set(self.camera_names)
            if unknown:
                raise ValueError(f"observation {i}: unknown cameras {sorted(unknown)}; the model expects {self.camera_names}")
            views = [obs.images.get(name) for name in self.camera_names]
            if all(v is None for v in views):
                raise ValueError(f"observation {i}: every camera is missing; at least one image is required")
            per_obs.append(views)
        return per_obs

    def stage_images(self, observations: list[Observation], pin: bool = False) -> StagedImages:
        """The device path's first step, on the host (what `preprocess` does for a GPU; exposed
        for benchmarks/serve_host_overhead.py): the batch's frames gathered, still uint8."""
        return stage_images(self._camera_slots(observations), self.camera_names, self.cfg.vision.image_size, pin=pin,
                            antialias=self.io.resize_antialias)

    def images_from_staged(self, staged: StagedImages) -> torch.Tensor:
        """The device path's last step: staged frames on their device -> the images input."""
        return images_from_staged(staged)

    def prompt_tokens(self, observations: list[Observation]) -> tuple[np.ndarray, np.ndarray]:
        """Every observation's state and prompt -> (B, max_token_len) int64 ids and bool mask.
        The state arithmetic runs on the whole batch at once (elementwise, so each row is what
        it would be alone); tokenisations are cached by their exact text."""
        return self._batch_prompt_tokens(observations, self._checked_states(observations))

    def _batch_prompt_tokens(self, observations: list[Observation], states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        bins = self._state_bins(states)
        n = self.cfg.max_token_len
        ids = np.empty((len(observations), n), dtype=np.int64)
        mask = np.empty((len(observations), n), dtype=bool)
        for i, obs in enumerate(observations):
            prompt = obs.prompt or self.io.default_prompt
            if not prompt:
                raise ValueError(f"observation {i}: empty prompt and no default prompt configured")
            ids[i], mask[i] = self._tokenize(self._prompt_input(prompt, bins[i]))
        return ids, mask

    def _state_bins(self, states: np.ndarray) -> np.ndarray:
        """(..., state_dim) raw states -> the bins the prompt writes: normalised, zero-padded to the
        model's state width where `pad_state_in_prompt` (LeRobot v0.4.x padded to max_state_dim,
        older openpi to its one width, which its loader makes max_state_dim too)."""
        norm = self.io.state_stats.normalize(self._model_states(states))
        if self.io.pad_state_in_prompt:
            norm = np.pad(norm, [(0, 0)] * (norm.ndim - 1) + [(0, self.cfg.max_state_dim - norm.shape[-1])])
        return discretize_state(norm, self.cfg.state_bins)

    def _prompt_input(self, prompt: str, bins: np.ndarray) -> str | tuple[str, ...]:
        """What the tokenizer reads for one observation: the text with the state's bins, or for a
        policy without the state in its prompt the pieces `stateless_prompt` gives."""
        if not self.io.state_in_prompt:
            return stateless_prompt(prompt)
        return format_prompt(prompt, bins)

    def longest_prompt_tokens(self, prompt: str = "") -> int:
        """The most valid prompt tokens (BOS included) `prompt` (empty: the default prompt) takes with
        any robot state. Each state value is written as its bin's number, one to a few tokens, so the
        prompt's length follows the state. The numbers are separated by spaces (no token spans two),
        so trying every bin in every free position at once finds the longest; padded positions keep
        the bin of 0."""
        prompt = prompt or self.io.default_prompt
        if not prompt:
            raise ValueError("empty prompt and no default prompt configured")
        if not self.io.state_in_prompt:
            return self.tokenizer.count(stateless_prompt(prompt))
        written = self.cfg.max_state_dim if self.io.pad_state_in_prompt else self.state_dim
        pad_bin = int(discretize_state(np.zeros(1), self.cfg.state_bins)[0])
        longest = 0
        for b in range(-1, self.cfg.state_bins):
            bins = np.array([b] * self.state_dim + [pad_bin] * (written - self.state_dim))
            # Counted before truncation, so a prompt too long for `max_prompt_tokens` shows as such.
            longest = max(longest, self.tokenizer.count(format_prompt(prompt, bins)))
        return longest

    @property
    def max_prompt_tokens(self) -> int:
        """The prompt tokens (BOS and state included) the model takes; a longer prompt is truncated."""
        return self.cfg.max_token_len

    def _tokenize(self, text: str | tuple[str, ...], warn: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """`warn`: log (once) when a text is truncated; `observation_problem` refuses it instead."""
        n = self.cfg.max_token_len
        # Keyed by the exact text, for the tokenizer and length it was filled with: a tokenizer
        # maps a text to one id sequence, so a hit returns what tokenising again would.
        owner = self._token_owner
        if owner is None or owner[0] is not self.tokenizer or owner[1] != n:
            self._token_cache.clear()
            self._token_owner = (self.tokenizer, n)
        cache = self._token_cache
        hit = cache.get(text)
        if hit is not None:
            # Server workers may share this adapter: another thread may evict the entry meanwhile.
            with contextlib.suppress(KeyError):
                cache.move_to_end(text)
            return hit
        tok = self.tokenizer(text, n)
        if tok.truncated and warn and not self._warned_truncation:
            log.warning("prompt longer than %d tokens was truncated; raise max_token_len", n)
            self._warned_truncation = True
        entry = (np.asarray(tok.ids, dtype=np.int64), np.asarray(tok.mask, dtype=bool))
        cache[text] = entry
        while len(cache) > TOKEN_CACHE_SIZE:
            with contextlib.suppress(KeyError):
                cache.popitem(last=False)
        return entry

    def _checked_states(self, observations: list[Observation]) -> np.ndarray:
        """(B, state_dim) float32: every observation's raw state, checked."""
        return np.stack([self._checked_state(obs, i) for i, obs in enumerate(observations)])

    def _checked_state(self, obs: Observation, i: int) -> np.ndarray:
        state = np.asarray(obs.state, dtype=np.float32).reshape(-1)
        if state.shape[0] != self.state_dim:
            raise ValueError(f"observation {i}: state has {state.shape[0]} values, the robot config says {self.state_dim}")
        if not np.isfinite(state).all():
            raise ValueError(f"observation {i}: state has NaN or Inf values")
        return state

    def preprocess_per_sample(self, observations: list[Observation], device: torch.device | str = "cpu") -> ModelInputs:
        """The reference path: each observation and camera on its own, float32 on the host,
        then one copy to `device`. `preprocess` is tested against it."""
        if not observations:
            raise ValueError("preprocess needs at least one observation")
        size = self.cfg.vision.image_size
        images, image_mask, tokens, token_mask = [], [], [], []
        for i, obs in enumerate(observations):
            views, present = [], []
            unknown = set(obs.images) - set(self.camera_names)
            if unknown:
                raise ValueError(f"observation {i}: unknown cameras {sorted(unknown)}; the model expects {self.camera_names}")
            for name in self.camera_names:
                img = obs.images.get(name)
                if img is None:
                    views.append(torch.full((3, size, size), -1.0))
                    present.append(False)
                else:
                    views.append(resize_with_pad(image_to_float_chw(img, name), size, self.io.resize_antialias) * 2.0 - 1.0)
                    present.append(True)
            if not any(present):
                raise ValueError(f"observation {i}: every camera is missing; at least one image is required")
            images.append(torch.stack(views))
            image_mask.append(present)
            ids, mask = self._prompt_tokens(obs, i)
            tokens.append(ids)
            token_mask.append(mask)
        tensors = {
            "images": torch.stack(images).to(device),
            "image_mask": torch.tensor(image_mask, dtype=torch.bool, device=device),
            "tokens": torch.tensor(tokens, dtype=torch.int64, device=device),
            "token_mask": torch.tensor(token_mask, dtype=torch.bool, device=device),
        }
        return ModelInputs(tensors, len(observations), {"states": self._checked_states(observations)})

    def _prompt_text(self, obs: Observation, i: int) -> str | tuple[str, ...]:
        """The text one observation's prompt is tokenised from: its instruction and its state's bins."""
        bins = self._state_bins(self._checked_state(obs, i))
        prompt = obs.prompt or self.io.default_prompt
        if not prompt:
            raise ValueError(f"observation {i}: empty prompt and no default prompt configured")
        return self._prompt_input(prompt, bins)

    def observation_problem(self, obs: Observation, allow_truncation: bool = False) -> str | None:
        """Why `obs` cannot run as it is, or None: what preprocess would refuse (an unknown camera,
        an empty image, a state of the wrong width or not finite, no prompt), and unless
        `allow_truncation`, a prompt longer than the model takes, which preprocess truncates: with
        the state written last, the robot's state is what it cuts off. A server checks each request
        with this before batching it."""
        try:
            self._camera_slots([obs])  # unknown cameras, or none at all
        except ValueError as exc:
            return str(exc).removeprefix("observation 0: ")
        for name, img in obs.images.items():
            if img is not None and (problem := image_problem(img, self.cfg.vision.image_size)) is not None:
                return f"camera {name!r}: {problem}"
        try:
            text = self._prompt_text(obs, 0)
        except ValueError as exc:
            return str(exc).removeprefix("observation 0: ")
        if allow_truncation:
            return None
        # Tokenised as preprocess will tokenise it (whose cache then hits); only a prompt that fills
        # every position may have been cut: that one is counted whole.
        _, mask = self._tokenize(text, warn=False)
        if mask.all() and (n := self.tokenizer.count(text)) > self.cfg.max_token_len:
            return (f"prompt: {n} tokens with this state (BOS included), the model takes {self.cfg.max_token_len}: "
                    "it would be truncated, the state with it")
        return None

    def _prompt_tokens(self, obs: Observation, i: int) -> tuple[list[int], list[bool]]:
        tok = self.tokenizer(self._prompt_text(obs, i), self.cfg.max_token_len)
        if tok.truncated and not self._warned_truncation:
            log.warning("prompt longer than %d tokens was truncated; raise max_token_len", self.cfg.max_token_len)
            self._warned_truncation = True
        return tok.ids, tok.mask

    @property
    def relative_actions(self) -> bool:
        """Whether the policy predicts some action dims as offsets from the observed state."""
        return bool(self.io.relative_action_mask)

    def postprocess(self, chunk: torch.Tensor, inputs: ModelInputs | None = None) -> np.ndarray:
        """(B, H, D) model-space chunk -> (B, H, action_dim) robot units, float32. `inputs`: what
        `preprocess` made for the chunk, needed by a relative policy: after un-normalising, each
        observation's raw state is added back on the relative dims, as LeRobot's postprocessor
        (AbsoluteActionsProcessorStep) and openpi's AbsoluteActions do."""
        arr = chunk[..., : self.action_dim].detach().float().cpu().numpy()
        actions = self.io.action_stats.unnormalize(arr).astype(np.float32)
        if self.relative_actions:
            states = None if inputs is None else inputs.extras.get("states")
            if states is None:
                raise ValueError("this policy predicts actions relative to the robot state (relative_action_mask): "
                                 "postprocess needs `inputs`, the ModelInputs preprocess made for the chunk")
            if len(states) != actions.shape[0]:
                raise ValueError(f"postprocess: {len(states)} states in `inputs` for a chunk of {actions.shape[0]}")
            actions = actions + self._state_offsets(states)[:, None, :]
        space = self._robot_space
        return actions if space is None else space.actions_from_model(actions)

    def normalize_actions(self, actions: np.ndarray | torch.Tensor, states: np.ndarray | None = None) -> torch.Tensor:
        """Robot-unit actions (..., action_dim) -> model space (..., D), zero-padded. A relative
        policy's actions are first made relative to `states`, the raw states of the observations
        the new chunk is predicted from ((..., state_dim), broadcast against the actions' leading
        dims: (B, 1, state_dim) for (B, n, action_dim) actions)."""
        arr = actions.detach().cpu().numpy() if isinstance(actions, torch.Tensor) else np.asarray(actions)
        arr = arr.astype(np.float32)
        space = self._robot_space
        if space is not None:
            arr = space.actions_to_model(arr)
        if self.relative_actions:
            if states is None:
                raise ValueError("this policy predicts actions relative to the robot state (relative_action_mask): "
                                 "normalize_actions needs the states the actions are to be made relative to")
            arr = arr - self._state_offsets(states)
        norm = self.io.action_stats.normalize(arr)
        pad = [(0, 0)] * (norm.ndim - 1) + [(0, self.model_action_dim - norm.shape[-1])]
        return torch.from_numpy(np.pad(norm, pad))

    @property
    def _robot_space(self) -> AlohaSpace | None:
        """The conversion `io.robot_space` names (None: the robot speaks the policy's space); read
        per call, since `load_adapter` sets the option after the adapter is built."""
        return robot_space(self.io.robot_space)

    def _model_states(self, states: np.ndarray) -> np.ndarray:
        """Raw robot states -> the space the policy was trained in (`io.robot_space`)."""
        space = self._robot_space
        return states if space is None else space.state_to_model(states)

    def _state_offsets(self, states: np.ndarray) -> np.ndarray:
        """(..., state_dim) raw states -> (..., action_dim): the state (in the policy's space) on
        the relative dims, 0 elsewhere."""
        states = np.asarray(states, dtype=np.float32)
        if states.shape[-1] != self.state_dim:
            raise ValueError(f"states have {states.shape[-1]} values, the robot config says {self.state_dim}")
        states = self._model_states(states)
        mask = np.asarray(self.io.relative_action_mask, dtype=bool)
        k = min(self.action_dim, self.state_dim)  # `fit_relative_mask`: no relative dim lies past the state
        offsets = np.zeros((*states.shape[:-1], self.action_dim), dtype=np.float32)
        offsets[..., :k] = np.where(mask[:k], states[..., :k], np.float32(0))
        return offsets
