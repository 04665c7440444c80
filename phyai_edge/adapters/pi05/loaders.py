"""Load PI0.5 from the folders people have: a LeRobot `pi05` policy folder, an openpi PyTorch
folder, or our own native folder. Everything is local; nothing is downloaded.

LeRobot silently falls back to random weights when keys do not match; here any missing,
extra, mis-shaped or wrongly typed tensor is an error that lists the names.
"""

from __future__ import annotations

import json
import logging
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
from phyai_edge.adapters.pi05.adapter import PI05Adapter, RobotIO
from phyai_edge.adapters.pi05.config import PI05Config, full, preset
from phyai_edge.adapters.pi05.model import PI05Model
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


def detect_format(folder: Path) -> str:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    if (folder / NATIVE_MANIFEST).exists():
        return "native"
    cfg = folder / "config.json"
    if cfg.exists():
        try:
            kind = json.loads(cfg.read_text()).get("type")
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{cfg} is not valid JSON: {exc}") from exc
        if kind == "pi05":
            return "lerobot"
    if list(folder.glob("assets/*/norm_stats.json")) and (folder / "model.safetensors").exists():
        return "openpi"
    raise CheckpointError(
        f"{folder} is not a PI0.5 checkpoint folder I know: expected {NATIVE_MANIFEST} (native), "
        "config.json with type 'pi05' (LeRobot), or model.safetensors + assets/*/norm_stats.json (openpi)"
    )


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
    if fmt == "native":
        cfg, io, key_map_rules = _load_native(folder)
        stored_dtype = native_weight_dtype(folder)
        if base is not None and _architecture(base) != _architecture(cfg):
            raise CheckpointError(
                f"{folder} records a different structure than the one passed: "
                f"{_architecture(cfg)} vs {_architecture(base)}"
            )
    else:
        loader = {"lerobot": _load_lerobot, "openpi": _load_openpi}[fmt]
        cfg, io, key_map_rules = loader(folder, base if base is not None else full())
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
    return PI05Adapter(cfg, model, tok, io)


def _find_tokenizer(folder: Path) -> Path:
    for cand in (folder, folder / "tokenizer", *sorted(folder.glob("assets/*"))):
        if any((cand / f).exists() for f in TOKENIZER_FILES):
            return cand
    raise FileNotFoundError(
        f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {folder}; PI0.5 uses the PaliGemma "
        "tokenizer: copy its tokenizer.json or tokenizer.model into the checkpoint folder, or pass tokenizer="
    )


# -- native ------------------------------------------------------------------------------
def _load_native(folder: Path) -> tuple[PI05Config, RobotIO, list]:
    meta = json.loads((folder / NATIVE_MANIFEST).read_text())
    if meta.get("format") != NATIVE_FORMAT:
        raise CheckpointError(f"{folder / NATIVE_MANIFEST}: format {meta.get('format')!r}, expected {NATIVE_FORMAT!r}")
    stats = json.loads((folder / "norm_stats.json").read_text())
    io = meta["io"]
    robot = RobotIO(
        camera_names=io["camera_names"], state_dim=io["state_dim"], action_dim=io["action_dim"],
        state_stats=NormStats.from_json(stats["state"]), action_stats=NormStats.from_json(stats["action"]),
        pad_state_in_prompt=io.get("pad_state_in_prompt", False), default_prompt=io.get("default_prompt", ""),
        resize_antialias=io.get("resize_antialias", False),
    )
    return PI05Config.from_dict(meta["config"]), robot, []


def native_weight_dtype(folder: str | Path) -> torch.dtype | None:
    """The engine precision a native folder's weights were written for (`save_native(dtype=...)`),
    or None for a plain float32 folder."""
    meta = json.loads((Path(folder) / NATIVE_MANIFEST).read_text())
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
    c = json.loads((folder / "config.json").read_text())
    for key, want in (("paligemma_variant", "gemma_2b"), ("action_expert_variant", "gemma_300m")):
        if c.get(key, want) != want:
            raise CheckpointError(f"config.json {key} = {c[key]!r}; this adapter supports {want!r}")
    res = c.get("image_resolution", [224, 224])
    if list(res) != [224, 224]:
        raise CheckpointError(f"config.json image_resolution = {res}; PI0.5 uses [224, 224]")
    _refuse_unapplied_options(folder, c)
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
    pre = _read_stats(folder, "policy_preprocessor*normalizer_processor.safetensors")
    post = _read_stats(folder, "policy_postprocessor*unnormalizer_processor.safetensors")
    io = RobotIO(
        camera_names=cams, state_dim=state_dim, action_dim=action_dim,
        state_stats=_stats_for(pre, "observation.state", modes.get("STATE", "QUANTILES")),
        action_stats=_stats_for(post or pre, "action", modes.get("ACTION", "QUANTILES")),
        pad_state_in_prompt=False,
    )
    return cfg, io, PI_KEY_RULES


# LeRobot PI0.5 options (policies/pi05/configuration_pi05.py) that change what the policy reads
# or what its outputs mean, and that this runtime does not apply. Each loads and runs without any
# error, so a checkpoint trained with one would drive the robot with wrong actions.
_UNAPPLIED_OPTIONS = {
    "use_relative_actions": (
        "the policy predicts actions relative to the state, which LeRobot's postprocessor turns back "
        "into absolute ones (AbsoluteActionsProcessorStep adds the observed state); this runtime does "
        "not, so it would send the offsets as absolute targets"),
    "use_visual_memory": (
        "the policy reads a history of camera frames (MEM); this runtime gives it the latest frame only"),
    "use_proprioceptive_memory": (
        "the policy reads a history of states as continuous tokens, not the state in the prompt (MEM); "
        "this runtime writes the latest state into the prompt"),
}


def _refuse_unapplied_options(folder: Path, c: dict[str, Any]) -> None:
    """CheckpointError for a config.json option in `_UNAPPLIED_OPTIONS` set, or an enabled
    relative/absolute actions step in the processor files (what LeRobot actually runs)."""
    for key, why in _UNAPPLIED_OPTIONS.items():
        if c.get(key):
            raise CheckpointError(f"config.json {key} = true: {why}")
    for name, step in (("policy_preprocessor.json", "relative_actions_processor"),
                       ("policy_postprocessor.json", "absolute_actions_processor")):
        path = folder / name
        if not path.exists():
            continue
        try:
            pipeline = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
        steps = pipeline.get("steps") if isinstance(pipeline, dict) else None
        if not isinstance(steps, list):
            raise CheckpointError(f"{path} has no list of steps: not a LeRobot processor file")
        for entry in steps:
            if isinstance(entry, dict) and entry.get("registry_name") == step and (entry.get("config") or {}).get("enabled"):
                raise CheckpointError(f"{path}: step {step} is enabled: {_UNAPPLIED_OPTIONS['use_relative_actions']}")


def _read_stats(folder: Path, pattern: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob(pattern)):
        with open_safetensors(f, framework="np") as sf:
            for k in sf.keys():  # noqa: SIM118
                out[k] = sf.get_tensor(k)
    return out


def _stats_for(stats: dict[str, np.ndarray], feature: str, mode: str) -> NormStats:
    m = _LEROBOT_MODES.get(mode)
    if m is None:
        raise CheckpointError(f"normalisation mode {mode!r} for {feature} is not supported (use one of {sorted(_LEROBOT_MODES)})")
    if m == "identity":
        return NormStats("identity")
    need = ("q01", "q99") if m == "quantile" else ("mean", "std")
    missing = [f"{feature}.{n}" for n in need if f"{feature}.{n}" not in stats]
    if missing:
        raise CheckpointError(f"normaliser statistics missing from the processor files: {', '.join(missing)}")
    return NormStats(m, **{n: stats[f"{feature}.{n}"] for n in need})


# -- openpi ------------------------------------------------------------------------------
OPENPI_CAMERAS = ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"]


def _load_openpi(folder: Path, base: PI05Config) -> tuple[PI05Config, RobotIO, list]:
    stats_files = sorted(folder.glob("assets/*/norm_stats.json"))
    if len(stats_files) > 1:
        log.warning("several norm_stats.json files; using %s", stats_files[0])
    raw = json.loads(stats_files[0].read_text())
    raw = raw.get("norm_stats", raw)
    cfg = base
    meta_path = folder / "config.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        cfg = cfg.with_overrides(chunk_size=int(meta.get("action_horizon", cfg.chunk_size)),
                                 max_action_dim=int(meta.get("action_dim", cfg.max_action_dim)))
    try:
        s, a = raw["state"], raw["actions"]
    except KeyError as exc:
        raise CheckpointError(f"{stats_files[0]} has no {exc} statistics") from exc
    mode = "quantile" if "q01" in s and "q01" in a else "mean_std"
    io = RobotIO(
        camera_names=list(OPENPI_CAMERAS),
        state_dim=len(s["q01" if mode == "quantile" else "mean"]),
        action_dim=len(a["q01" if mode == "quantile" else "mean"]),
        state_stats=NormStats(mode, s.get("mean"), s.get("std"), s.get("q01"), s.get("q99")),
        action_stats=NormStats(mode, a.get("mean"), a.get("std"), a.get("q01"), a.get("q99")),
        # openpi's PI0.5 model transforms tokenise the prompt (TokenizePrompt) before padding
        # (PadStatesAndActions), and its robot input transforms no longer pad the state, so the
        # prompt carries the robot's own state dims, as in LeRobot.
        pad_state_in_prompt=False,
        # openpi resizes frames with PIL's BILINEAR (its client's image_tools, and the training
        # data pipeline's ResizeImages), which antialiases a downscale.
        resize_antialias=True,
    )
    return cfg, io, PI_KEY_RULES
