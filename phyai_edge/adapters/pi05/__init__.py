"""PI0.5 (Physical Intelligence): SigLIP + Gemma-2B prefix + Gemma-300M-shaped flow-matching expert."""

from phyai_edge.adapters.pi05.adapter import PI05Adapter, RobotIO, fit_relative_mask
from phyai_edge.adapters.pi05.builtin import builtin_adapter
from phyai_edge.adapters.pi05.config import PI05Config, full, preset, tiny
from phyai_edge.adapters.pi05.loaders import detect_format, load_pi05, save_native
from phyai_edge.adapters.pi05.model import PI05Model
from phyai_edge.adapters.pi05.robot_space import check_robot_space
from phyai_edge.adapters.pi05.robot_space import robot_space as space_named

PROMPT_STATES = ("robot", "padded", "none")
OPTIONS = {
    "prompt_state": "robot | padded | none: the state values the prompt carries, the robot's own (LeRobot "
                    "v0.5.0 and later, openpi), zero-padded to 32 (policies fine-tuned with LeRobot "
                    "v0.4.x, whose folders do not say so), or none (openpi configs with "
                    "discrete_state_input=False, e.g. pi05_libero: the bare instruction); default: the "
                    "checkpoint's own convention",
    "relative_actions": "none | openpi's make_bool_mask notation, e.g. 6,-1,6,-1 (n > 0: n dims relative to "
                        "the state, n < 0: |n| dims absolute; dims past the end absolute): which action dims "
                        "the policy predicts as offsets from the observed state (openpi's DeltaActions, which "
                        "its folders do not record); default: the checkpoint's own (LeRobot: "
                        "use_relative_actions)",
    "robot_space": "model | aloha: the convention the robot's state and actions are in, where the policy was "
                   "trained in another that its folder does not record: aloha for openpi's ALOHA policies "
                   "(adapt_to_pi: shoulder and elbow flipped, grippers rescaled) on a robot or gym-aloha in "
                   "standard ALOHA space; default: the checkpoint's own (model: the policy's space)",
}


def parse_relative_actions(value: str) -> tuple[bool, ...]:
    """The `relative_actions` option -> a mask, one bool per action dim it covers (() for none),
    as openpi's `make_bool_mask(*dims)` builds it."""
    bad = f"relative_actions {value!r}: expected 'none' or comma-separated non-zero integers such as '6,-1,6,-1'"
    if not isinstance(value, str):
        raise ValueError(bad)
    if value.strip().lower() == "none":
        return ()
    try:
        dims = [int(part) for part in value.split(",")]
    except ValueError:
        raise ValueError(bad) from None
    if 0 in dims:
        raise ValueError(bad)
    return tuple(b for n in dims for b in [n > 0] * abs(n))


def load_adapter(checkpoint=None, preset_name: str = "tiny", device="cpu", tokenizer=None, camera_names=None,
                 seed: int = 0, structure=None, prompt_state: str | None = None,
                 relative_actions: str | None = None, robot_space: str | None = None) -> PI05Adapter:
    """A checkpoint folder if given, else the built-in seeded preset (the full one with random
    weights drawn on `device`, or on the meta device for `device="meta"`: `builtin_adapter`).
    `structure` (a preset name or PI05Config) sizes LeRobot/openpi checkpoints, which do not
    record it (default: full). `prompt_state`, `relative_actions`, `robot_space`: see OPTIONS."""
    if prompt_state is not None and prompt_state not in PROMPT_STATES:
        raise ValueError(f"prompt_state {prompt_state!r}: choose one of {', '.join(PROMPT_STATES)}")
    if robot_space is not None:
        space_named(robot_space)  # an unknown name fails here, before the weights load
    # Parsed before the weights load, so a typo fails at once.
    relative_mask = parse_relative_actions(relative_actions) if relative_actions is not None else None
    if checkpoint is not None:
        adapter = load_pi05(checkpoint, device=device, tokenizer=tokenizer, camera_names=camera_names,
                            structure=structure)
    else:
        adapter = builtin_adapter(preset_name, seed=seed, camera_names=camera_names, device=device)
    if prompt_state is not None:
        adapter.io.pad_state_in_prompt = prompt_state == "padded"
        adapter.io.state_in_prompt = prompt_state != "none"
    if relative_mask is not None:
        try:
            adapter.io.relative_action_mask = fit_relative_mask(relative_mask, adapter.action_dim, adapter.state_dim)
        except ValueError as exc:
            raise ValueError(f"relative_actions {relative_actions!r}: {exc}") from None
    if robot_space is not None:
        check_robot_space(robot_space, adapter.state_dim, adapter.action_dim)
        adapter.io.robot_space = robot_space
    return adapter


def save_bundle_checkpoint(adapter: PI05Adapter, folder, with_weights: bool, weight_dtype=None) -> None:
    """The native folder (metadata, statistics, tokenizer) an engine bundle carries, weights only
    if asked (what `phyai-edge export` calls), stored for an engine running in `weight_dtype`
    (see `save_native`; None: float32).

    save_native stays the only writer of the native format; without weights it is handed a
    module with no tensors, and the empty weight file it writes is removed.
    """
    import types
    from pathlib import Path

    folder = Path(folder)
    if with_weights:
        save_native(adapter, folder, dtype=weight_dtype)
    else:
        proxy = types.SimpleNamespace(cfg=adapter.cfg, io=adapter.io, tokenizer=adapter.tokenizer, module=_NoWeights())
        save_native(proxy, folder)
        (folder / "model.safetensors").unlink(missing_ok=True)
    # save_native keeps the tokenizer's own file name (the built-in one is tiny_tokenizer.json);
    # the tokenizer loader looks for the standard names, so store it under one.
    tok = folder / adapter.tokenizer.path.name
    standard = folder / ("tokenizer.model" if tok.suffix == ".model" else "tokenizer.json")
    if tok != standard and tok.exists() and not standard.exists():
        tok.replace(standard)


def load_bundle_adapter(folder, weights_included: bool, device="cpu", timings=None) -> PI05Adapter:
    """The adapter from a bundle's checkpoint folder; without weights the model is built on the
    meta device (the stages run from the compiled artefacts). Weights go straight to `device`
    in the dtypes they were stored in (the engine's own: nothing to widen and cast back);
    `timings` gets their `read_s` / `to_device_s`."""
    from phyai_edge.adapters.pi05.loaders import _load_native  # the native folder reader, sans weights
    from phyai_edge.adapters.tokenizer import PromptTokenizer

    if weights_included:
        return load_pi05(folder, device=device, dtype=None, timings=timings)
    cfg, io, _ = _load_native(folder)
    return PI05Adapter(cfg, PI05Model.skeleton(cfg), PromptTokenizer(folder), io)


class _NoWeights:
    def state_dict(self, *args, **kwargs):
        return {}


__all__ = [
    "PI05Adapter", "PI05Config", "PI05Model", "RobotIO", "builtin_adapter", "detect_format", "full",
    "load_adapter", "load_bundle_adapter", "load_pi05", "parse_relative_actions", "preset", "save_bundle_checkpoint",
    "save_native", "tiny",
]
