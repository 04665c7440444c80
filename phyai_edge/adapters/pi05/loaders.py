"""Load PI0.5 from the folders people have: a LeRobot `pi05` policy folder, an openpi PyTorch
folder, or our own native folder. Everything is local; nothing is downloaded.

LeRobot silently falls back to random weights when keys do not match; here any missing,
extra, mis-shaped or wrongly typed tensor is an error that lists the names.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from phyai_edge.adapters.checkpoint import (
    CheckpointError,
    checkpoint_keys,
    load_safetensors_strict,
    open_safetensors,
    regex_key_map,
)
from phyai_edge.adapters.normalization import NormStats
from phyai_edge.adapters.pi05.adapter import PI05Adapter, RobotIO, fit_relative_mask
from phyai_edge.adapters.pi05.config import PI05Config, full, preset
from phyai_edge.adapters.pi05.model import PI05Model
from phyai_edge.adapters.pi05.robot_space import AlohaSpace, check_robot_space
from phyai_edge.adapters.tokenizer import TOKENIZER_FILES, PromptTokenizer

log = logging.getLogger(__name__)

NATIVE_MANIFEST = "phyai_edge.json"
NATIVE_FORMAT = "phyai-edge/pi05/1"

# Both the transformers-5 layout (paligemma.model.language_model...) and the transformers-4
# layout (paligemma.language_model.model...) occur in checkpoints people have. Likewise the
# vision tower: `vision_tower.vision_model.` (SiglipVisionModel wrapping a transformer) or
# `vision_tower.` (newer transformers, where SiglipVisionModel holds the layers itself).
_P = r"^(?:model\.)?paligemma_with_expert\."
PI_KEY_RULES = [
    (_P + r"paligemma\.(?:model\.)?vision_tower\.(?:vision_model\.)?", "vision."),
    (_P + r"paligemma\.(?:model\.)?multi_modal_projector\.linear\.", "projector."),
    (_P + r"paligemma\.(?:model\.language_model|language_model\.model|language_model)\.embed_tokens\.", "embed_tokens."),
    (_P + r"paligemma\.(?:model\.language_model|language_model\.model|language_model)\.layers\.", "prefix_layers."),
    (_P + r"paligemma\.(?:model\.language_model|language_model\.model|language_model)\.norm\.", "prefix_norm."),
    (_P + r"gemma_expert\.model\.layers\.", "expert_layers."),
    (_P + r"gemma_expert\.model\.norm\.", "expert_norm."),
    (r"^(?:model\.)?(?:action_)?time_mlp_(in|out)\.", r"time_mlp_\1."),
    (r"^(?:model\.)?action_(in|out)_proj\.", r"action_\1_proj."),
]
LM_HEAD = r"lm_head\.weight$"


def _read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file, which must hold an object; refused naming the file otherwise."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def detect_format(folder: Path) -> str:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    if (folder / NATIVE_MANIFEST).exists():
        return "native"
    cfg = folder / "config.json"
    if cfg.exists() and _read_json(cfg).get("type") == "pi05":
        return "lerobot"
    if list(folder.glob("assets/*/norm_stats.json")) and (folder / "model.safetensors").exists():
        return "openpi"
    pickles = sorted(p.name for pattern in ("*.pt", "*.pth", "*.bin", "*.ckpt", "*.pkl") for p in folder.glob(pattern))
    if pickles and not list(folder.glob("*.safetensors")):
        raise CheckpointError(
            f"{folder} holds {', '.join(pickles[:3])}: pickled weights are never loaded (loading one runs "
            "whatever code it carries); convert them to safetensors (safetensors.torch.save_file) in a "
            "LeRobot, openpi or native folder"
        )
    raise CheckpointError(
        f"{folder} is not a PI0.5 checkpoint folder I know: expected {NATIVE_MANIFEST} (native), "
        "config.json with type 'pi05' (LeRobot), or model.safetensors + assets/*/norm_stats.json (openpi)"
        + _folder_hint(folder)
    )


def _folder_hint(folder: Path) -> str:
    """Where the checkpoint probably is, for the folders people point at instead of it."""
    if (folder / "pretrained_model" / "config.json").exists():
        # LeRobot's training output: checkpoints/<step>/ holds pretrained_model/ and training_state/.
        return f"; LeRobot keeps the policy in {folder / 'pretrained_model'}"
    if (folder / "config.json").exists():
        try:
            kind = json.loads((folder / "config.json").read_text()).get("type")
        except (json.JSONDecodeError, AttributeError):
            kind = None
        if kind is not None:
            return f"; its config.json is a LeRobot {kind!r} policy, not 'pi05'"
    if (folder / "params").is_dir() or (folder / "_CHECKPOINT_METADATA").exists():
        return ("; it looks like an openpi JAX checkpoint: convert it with openpi's "
                "examples/convert_jax_model_to_pytorch.py first")
    return ""


def load_pi05(
    folder: str | Path,
    device: str | torch.device = "cpu",
    tokenizer: str | Path | None = None,
    camera_names: list[str] | None = None,
    structure: PI05Config | str | None = None,
    dtype: torch.dtype | None = torch.float32,
    timings: dict[str, float] | None = None,
) -> PI05Adapter:
    """Load a PI0.5 checkpoint folder (native, LeRobot or openpi) into an adapter.

    dtype: float32 (the default) gives every weight in float32, whatever the file stores;
        None keeps them as stored: for a native folder written in an engine's precision
        (`save_native(dtype=...)`, what cudagraph bundles carry), whose engine would only cast
        them back. A native folder that records its precision must store every tensor in the
        dtype `PI05Model.precision_dtypes` gives it.
    timings: filled with the weight loading's `read_s` and `to_device_s` (see
        `load_safetensors_strict`).

    structure: the network's shape, as a `PI05Config` or a preset name. LeRobot and openpi
        folders do not record widths and depths (LeRobot's config.json only names the variants
        `gemma_2b` / `gemma_300m`, i.e. the `full` preset, which is the default). Pass another
        structure for checkpoints of other sizes, e.g. the tiny ones tests write. Only the
        architecture (vision tower, prefix, expert, vocabulary) is taken from it; chunk length,
        padded widths, prompt length and steps still come from the folder, and the strict loader
        checks every tensor's shape against the result. Native folders record their structure:
        a `structure` that disagrees with it is an error.
    """
    folder = Path(folder)
    fmt = detect_format(folder)
    base = preset(structure) if isinstance(structure, str) else structure
    stored_dtype = None
    try:
        if fmt == "native":
            cfg, io, key_map_rules = _load_native(folder)
            stored_dtype = native_weight_dtype(folder)
        else:
            loader = {"lerobot": _load_lerobot, "openpi": _load_openpi}[fmt]
            cfg, io, key_map_rules = loader(folder, base if base is not None else full())
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        # The files parsed but hold something of another shape than the format's (a missing
        # section, a string where a number goes, a value out of range): say so, naming the folder,
        # instead of a traceback from deep in the reader.
        what = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
        raise CheckpointError(f"{folder}: its {fmt} metadata does not fit the format: {what}") from exc
    if fmt == "native" and base is not None and _architecture(base) != _architecture(cfg):
        raise CheckpointError(
            f"{folder} records a different structure than the one passed: "
            f"{_architecture(cfg)} vs {_architecture(base)}"
        )
    if camera_names is not None:
        if len(camera_names) != len(io.camera_names):
            raise ValueError(f"camera_names has {len(camera_names)} entries, the checkpoint has {len(io.camera_names)} views")
        io.camera_names = list(camera_names)
    tok = PromptTokenizer(tokenizer if tokenizer is not None else _find_tokenizer(folder))
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"no model*.safetensors in {folder}")
    model = PI05Model.skeleton(cfg)
    keys = checkpoint_keys(files)
    rules = list(key_map_rules)
    skip = [LM_HEAD]
    if fmt != "native" and not any("embed_tokens" in k for k in keys):
        # Tied embeddings saved only as the language-model head: read it as the embedding.
        rules.insert(0, (_P + r"paligemma\.lm_head\.weight$", "embed_tokens.weight"))
        skip = [_P + r"gemma_expert\.lm_head\.weight$"]
    expect = model.precision_dtypes(stored_dtype) if stored_dtype is not None else None
    try:
        skipped = load_safetensors_strict(model, files, regex_key_map(rules, skip), device=device, dtype=dtype,
                                          expect_dtypes=expect, timings=timings)
    except CheckpointError as exc:
        if fmt != "native" and base is None and "mis-shaped" in str(exc):
            raise CheckpointError(
                f"{exc}\n  (the {fmt} format does not record the model's size; it was read as the published "
                "`full` size. For another size pass structure=, e.g. structure='tiny'.)"
            ) from None
        raise
    if skipped:
        log.info("skipped %d unused tensors without reading them: %s", len(skipped), ", ".join(sorted(skipped)))
    _check_tokenizer_fits(tok, cfg)
    try:
        return PI05Adapter(cfg, model, tok, io)
    except ValueError as exc:
        raise CheckpointError(f"{folder}: {exc}") from None


# PaliGemma's vocabulary, which every PI0.5 of the published size embeds: Gemma's 256000 text
# tokens, then 1024 <loc> and 128 <seg> tokens; BOS is 2.
_PALIGEMMA_VOCAB, _GEMMA_TEXT_VOCAB, _GEMMA_BOS = 257152, 256000, 2


def _check_tokenizer_fits(tok: PromptTokenizer, cfg: PI05Config) -> None:
    """A tokenizer that is not PaliGemma's (Gemma's text part will do) for a model with its
    embedding: its ids would index rows trained for other tokens, and the prompt would read as
    noise to the policy, with no error anywhere."""
    if cfg.vocab_size != _PALIGEMMA_VOCAB:
        return  # a test-sized model with its own tokenizer
    if tok.bos_id != _GEMMA_BOS or tok.vocab_size < _GEMMA_TEXT_VOCAB:
        raise CheckpointError(
            f"{tok.path} is not the PaliGemma tokenizer (it has {tok.vocab_size} tokens and BOS id {tok.bos_id}; "
            f"PaliGemma's has {_PALIGEMMA_VOCAB} and BOS {_GEMMA_BOS}): PI0.5 reads its prompt with PaliGemma's "
            "tokenizer.json or tokenizer.model (openpi's paligemma_tokenizer.model)"
        )


def _find_tokenizer(folder: Path) -> Path:
    for cand in (folder, folder / "tokenizer", *sorted(folder.glob("assets/*"))):
        if any((cand / f).exists() for f in TOKENIZER_FILES):
            return cand
    raise FileNotFoundError(
        f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {folder} (nor its tokenizer/ or assets/*/); "
        "PI0.5 uses the PaliGemma tokenizer: copy its tokenizer.json or tokenizer.model into the checkpoint "
        "folder, or name it (--tokenizer; the daemon's model.tokenizer; tokenizer= in Python)"
    )


# -- native ------------------------------------------------------------------------------
def _load_native(folder: Path) -> tuple[PI05Config, RobotIO, list]:
    meta = _read_json(folder / NATIVE_MANIFEST)
    if meta.get("format") != NATIVE_FORMAT:
        raise CheckpointError(f"{folder / NATIVE_MANIFEST}: format {meta.get('format')!r}, expected {NATIVE_FORMAT!r}")
    stats = _read_json(folder / "norm_stats.json")
    io = meta["io"]
    try:
        state_stats, action_stats = NormStats.from_json(stats["state"]), NormStats.from_json(stats["action"])
    except ValueError as exc:
        raise CheckpointError(f"{folder / 'norm_stats.json'}: {exc}") from None
    robot = RobotIO(
        camera_names=io["camera_names"], state_dim=io["state_dim"], action_dim=io["action_dim"],
        state_stats=state_stats, action_stats=action_stats,
        pad_state_in_prompt=io.get("pad_state_in_prompt", False), default_prompt=io.get("default_prompt", ""),
        state_in_prompt=io.get("state_in_prompt", True),
        resize_antialias=io.get("resize_antialias", False),
        relative_action_mask=_native_relative_mask(folder / NATIVE_MANIFEST, io),
        robot_space=io.get("robot_space", "model"),
    )
    try:
        check_robot_space(robot.robot_space, robot.state_dim, robot.action_dim)
    except ValueError as exc:
        raise CheckpointError(f"{folder / NATIVE_MANIFEST}: io.{exc}") from None
    return PI05Config.from_dict(meta["config"]), robot, []


def _native_relative_mask(path: Path, io: dict[str, Any]) -> tuple[bool, ...]:
    mask = io.get("relative_action_mask", [])
    if not isinstance(mask, list) or not all(isinstance(m, bool) for m in mask) or (mask and len(mask) != io["action_dim"]):
        raise CheckpointError(f"{path}: io.relative_action_mask must be a list of {io['action_dim']} booleans, got {mask!r}")
    try:
        return fit_relative_mask(mask, io["action_dim"], io["state_dim"])
    except ValueError as exc:
        raise CheckpointError(f"{path}: io.relative_action_mask: {exc}") from None


def native_weight_dtype(folder: str | Path) -> torch.dtype | None:
    """The engine precision a native folder's weights were written for (`save_native(dtype=...)`),
    or None for a plain float32 folder."""
    meta = _read_json(Path(folder) / NATIVE_MANIFEST)
    name = meta.get("weight_dtype")
    if name is None:
        return None
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(f"{Path(folder) / NATIVE_MANIFEST}: weight_dtype {name!r} is not a float dtype")
    return dtype


def save_native(adapter: PI05Adapter, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `adapter` as a native folder (our tensor names). Weights in float32, unless `dtype`
    names the precision an engine will run them in: then each is stored in the dtype
    `PI05Model.set_precision(dtype)` would give it (big matmul weights in `dtype`, norms, time MLP
    and action projections in float32; `PI05Model.precision_dtypes`), which halves a bf16 / fp16
    bundle and spares its loader the cast. `adapter`'s own tensors are only read.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if dtype == torch.float32:
        dtype = None  # the plain format: its files stay byte-identical to what they always were
    io = adapter.io
    meta: dict[str, Any] = {
        "format": NATIVE_FORMAT,
        "adapter": "pi05",
        "config": adapter.cfg.to_dict(),
        "io": {"camera_names": io.camera_names, "state_dim": io.state_dim, "action_dim": io.action_dim,
               "pad_state_in_prompt": io.pad_state_in_prompt, "default_prompt": io.default_prompt,
               "resize_antialias": io.resize_antialias},
    }
    if io.relative_action_mask:  # only then: an absolute policy's folder stays byte-identical to older ones
        meta["io"]["relative_action_mask"] = list(io.relative_action_mask)
    if not io.state_in_prompt:  # likewise
        meta["io"]["state_in_prompt"] = False
    if io.robot_space != "model":  # likewise
        meta["io"]["robot_space"] = io.robot_space
    if dtype is not None:
        meta["weight_dtype"] = str(dtype).removeprefix("torch.")
    (folder / NATIVE_MANIFEST).write_text(json.dumps(meta, indent=2))
    (folder / "norm_stats.json").write_text(
        json.dumps({"state": io.state_stats.to_json(), "action": io.action_stats.to_json()}, indent=2)
    )
    state = adapter.module.state_dict()
    want = adapter.module.precision_dtypes(dtype) if dtype is not None and state else {}
    # Each tensor gets its own copy when it changes (dtype or device), never an in-place cast:
    # the caller's float32 model stays as it was (the exporter validates against it).
    state = {k: v.detach().to(device="cpu", dtype=want.get(k, torch.float32)).contiguous() for k, v in state.items()}
    save_file(state, str(folder / "model.safetensors"))
    tok_src = adapter.tokenizer.path
    # Under the canonical name the loader looks for (the source may be e.g. tiny_tokenizer.json).
    tok_name = "tokenizer.json" if tok_src.suffix == ".json" else "tokenizer.model"
    (folder / tok_name).write_bytes(tok_src.read_bytes())
    return folder


# -- LeRobot -----------------------------------------------------------------------------
_LEROBOT_MODES = {"QUANTILES": "quantile", "MEAN_STD": "mean_std", "IDENTITY": "identity"}


def _architecture(cfg: PI05Config) -> dict[str, Any]:
    d = cfg.to_dict()
    return {k: d[k] for k in ("vision", "prefix", "expert", "vocab_size")}


def _load_lerobot(folder: Path, base: PI05Config) -> tuple[PI05Config, RobotIO, list]:
    c = _read_json(folder / "config.json")
    for key, want in (("paligemma_variant", "gemma_2b"), ("action_expert_variant", "gemma_300m")):
        if c.get(key, want) != want:
            raise CheckpointError(f"config.json {key} = {c[key]!r}; this adapter supports {want!r}")
    res = c.get("image_resolution", [224, 224])
    if list(res) != [224, 224]:
        raise CheckpointError(f"config.json image_resolution = {res}; PI0.5 uses [224, 224]")
    _refuse_unapplied_options(c)
    cfg = base.with_overrides(
        chunk_size=int(c.get("chunk_size", 50)),
        max_action_dim=int(c.get("max_action_dim", 32)),
        max_state_dim=int(c.get("max_state_dim", 32)),
        max_token_len=int(c.get("tokenizer_max_length", 200)),
        num_steps=int(c.get("num_inference_steps", 10)),
        time_min_period=float(c.get("min_period", 4e-3)),
        time_max_period=float(c.get("max_period", 4.0)),
    )
    inputs = c.get("input_features") or {}
    outputs = c.get("output_features") or {}
    cams = [k.removeprefix("observation.images.") for k, f in inputs.items() if f.get("type") == "VISUAL"]
    cams += [f"empty_camera_{i}" for i in range(int(c.get("empty_cameras", 0)))
             if f"observation.images.empty_camera_{i}" not in inputs]
    if not cams:
        raise CheckpointError("config.json input_features has no VISUAL features (cameras)")
    try:
        state_dim = int(inputs["observation.state"]["shape"][0])
        action_dim = int(outputs["action"]["shape"][0])
    except KeyError as exc:
        raise CheckpointError(f"config.json lacks the feature {exc} (need observation.state and action shapes)") from exc
    modes = c.get("normalization_mapping", {"STATE": "QUANTILES", "ACTION": "QUANTILES"})
    pre = _read_stats(folder, _PRE_STATS)
    post = _read_stats(folder, _POST_STATS)
    io = RobotIO(
        camera_names=cams, state_dim=state_dim, action_dim=action_dim,
        state_stats=_stats_for(pre, "observation.state", modes.get("STATE", "QUANTILES"), state_dim),
        # A relative policy's statistics are the offsets' own (LeRobot computes them so): as they are.
        action_stats=_stats_for(post or pre, "action", modes.get("ACTION", "QUANTILES"), action_dim),
        pad_state_in_prompt=False,
        relative_action_mask=_lerobot_relative_mask(folder, c, action_dim, state_dim),
    )
    return cfg, io, PI_KEY_RULES


# LeRobot PI0.5 options (policies/pi05/configuration_pi05.py) that change what the policy reads,
# and that this runtime does not apply. Each loads and runs without any error, so a checkpoint
# trained with one would drive the robot with wrong actions.
_UNAPPLIED_OPTIONS = {
    "use_visual_memory": (
        "the policy reads a history of camera frames (MEM); this runtime gives it the latest frame only"),
    "use_proprioceptive_memory": (
        "the policy reads a history of states as continuous tokens, not the state in the prompt (MEM); "
        "this runtime writes the latest state into the prompt"),
}


def _refuse_unapplied_options(c: dict[str, Any]) -> None:
    for key, why in _UNAPPLIED_OPTIONS.items():
        if c.get(key):
            raise CheckpointError(f"config.json {key} = true: {why}")


def lerobot_relative_mask(exclude_joints: list[str] | None, action_names: list[str] | None,
                          action_dim: int) -> tuple[bool, ...]:
    """LeRobot's rule (RelativeActionsProcessorStep): an action dim stays absolute where an
    exclude token, lower-cased, equals or is part of its lower-cased name; without names or
    tokens every dim is relative, and so is every dim past the end of the names."""
    tokens = [str(t).lower() for t in exclude_joints or [] if t]
    if not tokens or action_names is None:
        return (True,) * action_dim
    mask = tuple(not any(t in str(name).lower() for t in tokens) for name in action_names[:action_dim])
    return mask + (True,) * (action_dim - len(mask))


_MISSING = object()


def _lerobot_relative_mask(folder: Path, c: dict[str, Any], action_dim: int, state_dim: int) -> tuple[bool, ...]:
    """The relative-action mask a LeRobot folder's policy was trained with, () for absolute.

    The processor files are what LeRobot runs: the postprocessor's absolute_actions_processor
    step adds the state back, on the dims its paired relative_actions_processor step (in the
    preprocessor) builds the mask for. config.json, from which LeRobot built those steps, speaks
    where they are silent (files older than the option), and must not contradict them."""
    post = _processor_step(folder / "policy_postprocessor.json", "absolute_actions_processor")
    pre = _processor_step(folder / "policy_preprocessor.json", "relative_actions_processor")
    step = "relative_actions_processor"
    enabled = _setting(folder, [
        ("policy_postprocessor.json absolute_actions_processor.enabled", post.get("enabled", _MISSING)),
        (f"policy_preprocessor.json {step}.enabled", pre.get("enabled", _MISSING)),
        ("config.json use_relative_actions", c.get("use_relative_actions", _MISSING)),
    ], _read_bool, default=False)
    if not enabled:
        return ()
    exclude = _setting(folder, [
        (f"policy_preprocessor.json {step}.exclude_joints", pre.get("exclude_joints", _MISSING)),
        ("config.json relative_exclude_joints", c.get("relative_exclude_joints", _MISSING)),
    ], _read_joint_tokens, default=["gripper"])  # LeRobot's default
    # A processor step without names made every dim relative in training: config.json naming
    # them then contradicts it, rather than filling them in.
    names = _setting(folder, [
        (f"policy_preprocessor.json {step}.action_names", pre.get("action_names", _MISSING)),
        ("config.json action_feature_names", c.get("action_feature_names", _MISSING)),
    ], _read_names, default=None)
    if names is not None and len(names) != action_dim:
        log.warning("%s: %d action names for %d action dims; the relative-action mask is built as LeRobot "
                    "builds it (names past the action ignored, dims past the names relative)",
                    folder, len(names), action_dim)
    try:
        return fit_relative_mask(lerobot_relative_mask(exclude, names, action_dim), action_dim, state_dim)
    except ValueError as exc:
        raise CheckpointError(f"{folder}: relative actions (policy_preprocessor.json {step}, config.json "
                              f"relative_exclude_joints / action_feature_names): {exc}") from None


def _processor_step(path: Path, registry_name: str) -> dict[str, Any]:
    """The config of the step `registry_name` in a LeRobot processor file ({} if none)."""
    if not path.exists():
        return {}
    steps = _read_json(path).get("steps")
    if not isinstance(steps, list):
        raise CheckpointError(f"{path} has no list of steps: not a LeRobot processor file")
    found = [e for e in steps if isinstance(e, dict) and e.get("registry_name") == registry_name]
    if len(found) > 1:
        raise CheckpointError(f"{path}: {len(found)} {registry_name} steps, LeRobot writes one")
    config = found[0].get("config", {}) if found else {}
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: step {registry_name} has config {config!r}, not an object")
    return config


def _setting(folder: Path, said: list[tuple[str, Any]], read: Callable[[Any], Any], default: Any) -> Any:
    """The value every place in `said` (where, raw value or _MISSING) that states it agrees on,
    as `read` gives it (TypeError naming the kind expected); `default` where none states it."""
    values = []
    for where, raw in said:
        if raw is _MISSING:
            continue
        try:
            values.append((where, read(raw)))
        except TypeError as exc:
            raise CheckpointError(f"{folder}: {where} = {raw!r}, expected {exc}") from None
    for where, value in values[1:]:
        if value != values[0][1]:
            raise CheckpointError(f"{folder}: {values[0][0]} = {values[0][1]!r} but {where} = {value!r}; "
                                  "which dims of the policy's actions are relative to the state is ambiguous")
    return values[0][1] if values else default


def _read_bool(raw: Any) -> bool:
    if not isinstance(raw, bool):
        raise TypeError("true or false")
    return raw


def _read_names(raw: Any) -> list[str] | None:
    if raw is not None and not (isinstance(raw, list) and all(isinstance(x, str) for x in raw)):
        raise TypeError("a list of strings or null")
    return raw


def _read_joint_tokens(raw: Any) -> list[str]:
    return _read_names(raw) or []  # LeRobot excludes nothing for null, as for []


_PRE_STATS = "policy_preprocessor*normalizer_processor.safetensors"
_POST_STATS = "policy_postprocessor*unnormalizer_processor.safetensors"


def _read_stats(folder: Path, pattern: str) -> dict[str, tuple[np.ndarray, Path]]:
    """Every tensor of the files matching `pattern`, with the file it came from (for messages)."""
    out: dict[str, tuple[np.ndarray, Path]] = {}
    for f in sorted(folder.glob(pattern)):
        with open_safetensors(f, framework="np") as sf:
            for k in sf.keys():  # noqa: SIM118
                out[k] = (sf.get_tensor(k), f)
    return out


def _stats_for(stats: dict[str, tuple[np.ndarray, Path]], feature: str, mode: str, dim: int) -> NormStats:
    """`feature`'s statistics for `mode`, each checked to hold `dim` values (config.json's shape of
    the feature): otherwise the load would pass and the first observation fail, naming neither
    the file nor the feature."""
    m = _LEROBOT_MODES.get(mode)
    if m is None:
        raise CheckpointError(f"normalisation mode {mode!r} for {feature} is not supported (use one of {sorted(_LEROBOT_MODES)})")
    if m == "identity":
        return NormStats("identity")
    need = ("q01", "q99") if m == "quantile" else ("mean", "std")
    missing = [f"{feature}.{n}" for n in need if f"{feature}.{n}" not in stats]
    if missing:
        raise CheckpointError(f"normaliser statistics missing from the processor files ({_PRE_STATS}, "
                              f"{_POST_STATS}): {', '.join(missing)}")
    for n in need:
        arr, f = stats[f"{feature}.{n}"]
        if arr.size != dim:
            raise CheckpointError(f"{f}: {feature}.{n} has {arr.size} values, but config.json gives {feature} "
                                  f"the shape [{dim}]")
    try:
        return NormStats(m, **{n: stats[f"{feature}.{n}"][0] for n in need})
    except ValueError as exc:
        raise CheckpointError(f"{stats[f'{feature}.{need[0]}'][1]}: {feature}: {exc}") from None


# -- openpi ------------------------------------------------------------------------------
OPENPI_CAMERAS = ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"]


def _load_openpi(folder: Path, base: PI05Config) -> tuple[PI05Config, RobotIO, list]:
    stats_files = sorted(folder.glob("assets/*/norm_stats.json"))
    if len(stats_files) > 1:
        log.warning("several norm_stats.json files; using %s", stats_files[0])
    raw = _read_json(stats_files[0])
    raw = raw.get("norm_stats", raw)
    cfg = base
    meta_path = folder / "config.json"
    if meta_path.exists():
        meta = _read_json(meta_path)
        width = int(meta.get("action_dim", cfg.max_action_dim))
        # openpi has one width for both: PadStatesAndActions pads the state to action_dim too.
        cfg = cfg.with_overrides(chunk_size=int(meta.get("action_horizon", cfg.chunk_size)),
                                 max_action_dim=width, max_state_dim=width)
    else:
        # openpi's converter writes config.json; its PyTorch trainer keeps the config only in
        # metadata.pt, a pickle never opened here. The horizon is not in the weights' shapes, and a
        # policy run at another one than it was trained with still runs, with other actions.
        log.warning("%s has no config.json: the action horizon (openpi's action_horizon) is assumed to be %d and "
                    "the padded width %d; if the policy was trained with others (pi05_libero: 10, pi05_droid: "
                    "15), write them there: {\"action_horizon\": N, \"action_dim\": 32}",
                    folder, cfg.chunk_size, cfg.max_action_dim)
    try:
        s, a = raw["state"], raw["actions"]
    except KeyError as exc:
        raise CheckpointError(f"{stats_files[0]} has no {exc} statistics") from exc
    # openpi normalises PI0.5's state and actions with quantiles (its data config's use_quantile_norm
    # is on for every model but PI0), whatever else the file holds: without them, reading its
    # mean/std instead would give the model inputs and actions on another scale, without an error.
    missing = [f"{part}.{q}" for part, block in (("state", s), ("actions", a)) for q in ("q01", "q99")
               if q not in block]
    if missing:
        raise CheckpointError(f"{stats_files[0]}: no {', '.join(missing)}: openpi normalises PI0.5's state and "
                              "actions with the q01/q99 quantiles (compute_norm_stats.py writes them)")
    try:
        # With openpi's formulas (its epsilon, `NormStats.convention`): the policy was trained with them.
        state_stats = NormStats("quantile", s.get("mean"), s.get("std"), s["q01"], s["q99"], convention="openpi")
        action_stats = NormStats("quantile", a.get("mean"), a.get("std"), a["q01"], a["q99"], convention="openpi")
    except ValueError as exc:
        raise CheckpointError(f"{stats_files[0]}: {exc}") from None
    io = RobotIO(
        camera_names=list(OPENPI_CAMERAS),
        state_dim=int(state_stats.dim or 0),
        action_dim=int(action_stats.dim or 0),
        state_stats=state_stats,
        action_stats=action_stats,
        # openpi's PI0.5 model transforms tokenise the prompt (TokenizePrompt) before padding
        # (PadStatesAndActions), and its robot input transforms no longer pad the state, so the
        # prompt carries the robot's own state dims, as in LeRobot.
        pad_state_in_prompt=False,
        # openpi resizes frames with PIL's BILINEAR (its client's image_tools, and the training
        # data pipeline's ResizeImages), which antialiases a downscale.
        resize_antialias=True,
    )
    asset = stats_files[0].parent.name
    if io.state_dim == io.action_dim == AlohaSpace.width and ("trossen" in asset or "aloha" in asset):
        # openpi's ALOHA configs convert to their own joint space (adapt_to_pi) and train the joints
        # as offsets (pi05_aloha): neither is in the folder, and a wrong guess moves the arms wrongly.
        log.warning("%s looks like an openpi ALOHA policy (assets/%s, 14 values): those are trained in openpi's "
                    "joint space; a robot or gym-aloha in standard ALOHA space needs the adapter option "
                    "robot_space=aloha, and relative_actions=6,-1,6,-1 where it was trained on delta joints "
                    "(openpi's pi05_aloha)", folder, asset)
    return cfg, io, PI_KEY_RULES
