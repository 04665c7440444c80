"""Strict safetensors loading shared by adapters: every expected tensor present, nothing
unexpected, shapes and dtypes right, and tensors nobody needs (language-model heads) never read.

Weights are assigned into a model built on the meta device, so loading a 3B model does not
first allocate 3B random parameters.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

KeyMap = Callable[[str], str | None]  # checkpoint name -> model name, or None to skip unread


class CheckpointError(ValueError):
    """A checkpoint that does not match the model. The message lists every offending name."""


def _listing(title: str, names: Iterable[str], limit: int = 20) -> str:
    names = sorted(names)
    shown = "\n    ".join(names[:limit])
    more = f"\n    ... and {len(names) - limit} more" if len(names) > limit else ""
    return f"  {title} ({len(names)}):\n    {shown}{more}"


def load_safetensors_strict(
    model: nn.Module,
    files: list[Path],
    key_map: KeyMap,
    device: torch.device | str = "cpu",
) -> list[str]:
    """Load `files` into `model` (which may live on the meta device) as float32 tensors on
    `device`; engines cast to their precision. Returns the checkpoint names skipped unread."""
    expected = {name: t for name, t in model.state_dict(keep_vars=True).items()}
    found: dict[str, tuple[Path, str]] = {}
    unexpected, skipped = [], []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                name = key_map(key)
                if name is None:
                    skipped.append(key)
                elif name in expected:
                    if name in found:
                        raise CheckpointError(f"{key} and {found[name][1]} both map to {name}")
                    found[name] = (f, key)
                else:
                    unexpected.append(key)
    missing = [n for n in expected if n not in found]
    problems = []
    if missing:
        problems.append(_listing("missing tensors", missing))
    if unexpected:
        problems.append(_listing("unexpected tensors", unexpected))
    bad_shape, bad_dtype = [], []
    handles = {f: safe_open(str(f), framework="pt") for f in {p for p, _ in found.values()}}
    try:
        for name, (f, key) in found.items():
            sl = handles[f].get_slice(key)
            shape = tuple(sl.get_shape())
            want = tuple(expected[name].shape)
            if shape != want:
                bad_shape.append(f"{key}: checkpoint {list(shape)}, model {list(want)}")
            if not _float_dtype(sl.get_dtype()):
                bad_dtype.append(f"{key}: {sl.get_dtype()} (expected a floating-point tensor)")
        if bad_shape:
            problems.append(_listing("mis-shaped tensors", bad_shape))
        if bad_dtype:
            problems.append(_listing("wrongly typed tensors", bad_dtype))
        if problems:
            raise CheckpointError("checkpoint does not match the model:\n" + "\n".join(problems))
        state = {}
        for name, (f, key) in found.items():
            state[name] = handles[f].get_tensor(key).to(device=device, dtype=torch.float32)
    finally:
        handles.clear()
    model.load_state_dict(state, strict=True, assign=True)
    return skipped


def _float_dtype(name: str) -> bool:
    return name in {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}


def regex_key_map(rules: list[tuple[str, str]], skip: list[str]) -> KeyMap:
    compiled = [(re.compile(p), r) for p, r in rules]
    skip_re = [re.compile(s) for s in skip]

    def key_map(key: str) -> str | None:
        if any(s.search(key) for s in skip_re):
            return None
        for pattern, repl in compiled:
            new, n = pattern.subn(repl, key, count=1)
            if n:
                return new
        return key

    return key_map


def checkpoint_keys(files: list[Path]) -> set[str]:
    keys: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            keys.update(sf.keys())
    return keys
