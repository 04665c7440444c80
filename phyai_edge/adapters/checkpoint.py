"""Strict safetensors loading shared by adapters: every expected tensor present, nothing
unexpected, shapes and dtypes right, and tensors nobody needs (language-model heads) never read.

Weights are assigned into a model built on the meta device, so loading a 3B model does not
first allocate 3B random parameters. Each tensor goes from the file's memory map straight to
its device: no CPU copy of the whole model is made first (safetensors maps the file, so the
bytes are only read when the copy to the device touches them).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping
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


def open_safetensors(path: Path, framework: str = "pt") -> safe_open:
    """`safe_open`, with a damaged file (an interrupted copy, a file that is not safetensors) a
    CheckpointError naming it: safetensors' own error names no file, so in a sharded checkpoint
    it does not say which shard to fetch again."""
    try:
        return safe_open(str(path), framework=framework)
    except Exception as exc:  # SafetensorError, or an OSError from the memory map
        raise CheckpointError(f"{path} is damaged or not a safetensors file "
                              f"({type(exc).__name__}: {exc}); copy it again") from exc


def load_safetensors_strict(
    model: nn.Module,
    files: list[Path],
    key_map: KeyMap,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = torch.float32,
    expect_dtypes: Mapping[str, torch.dtype] | None = None,
    timings: dict[str, float] | None = None,
) -> list[str]:
    """Load `files` into `model` (which may live on the meta device) on `device`. Returns the
    checkpoint names skipped unread.

    dtype: every tensor is converted to it (float32 by default: engines cast to their
        precision), or None to keep each as stored (a checkpoint already written in the
        engine's precision, e.g. a bf16 bundle: widening it would only be narrowed again).
    expect_dtypes: model name -> the dtype the file must store it in (a checkpoint that
        records the precision it was written for); anything else is a wrongly typed tensor.
    timings: if given, `read_s` (headers, checks, mapping the tensors) and `to_device_s`
        (copying them to `device` and converting; this is where the file's bytes are read)
        are added to it.

    Every tensor must be finite after the conversion (a float16 weight beyond 65504 is not): a
    NaN or Inf weight is refused by name, where it would load and make every action NaN.
    """
    t0 = time.perf_counter()
    expected = {name: t for name, t in model.state_dict(keep_vars=True).items()}
    found: dict[str, tuple[Path, str]] = {}
    unexpected, skipped = [], []
    for f in files:
        with open_safetensors(f) as sf:
            for key in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                name = key_map(key)
                if name is None:
                    skipped.append(key)
                elif name in expected:
                    if name in found:
                        # Often the same name in two shards: say which files, not just the name twice.
                        first_file, first_key = found[name]
                        raise CheckpointError(f"{key} in {f.name} and {first_key} in {first_file.name} "
                                              f"both map to {name}")
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
    handles = {f: open_safetensors(f) for f in {p for p, _ in found.values()}}
    device = torch.device(device)
    read_s = to_device_s = 0.0
    finite: dict[str, torch.Tensor] = {}
    try:
        for name, (f, key) in found.items():
            sl = handles[f].get_slice(key)
            shape = tuple(sl.get_shape())
            want = tuple(expected[name].shape)
            if shape != want:
                bad_shape.append(f"{key}: checkpoint {list(shape)}, model {list(want)}")
            stored = sl.get_dtype()
            if not _float_dtype(stored):
                bad_dtype.append(f"{key}: {stored} (expected a floating-point tensor)")
            elif expect_dtypes is not None and _ST_DTYPES.get(stored) != expect_dtypes.get(name):
                bad_dtype.append(f"{key}: {stored} (the checkpoint records it as {expect_dtypes.get(name)})")
        if bad_shape:
            problems.append(_listing("mis-shaped tensors", bad_shape))
        if bad_dtype:
            problems.append(_listing("wrongly typed tensors", bad_dtype))
        if problems:
            raise CheckpointError("checkpoint does not match the model:\n" + "\n".join(problems))
        read_s = time.perf_counter() - t0
        state = {}
        for name, (f, key) in found.items():
            t1 = time.perf_counter()
            t = handles[f].get_tensor(key)  # a view of the mapped file: nothing read yet
            t2 = time.perf_counter()
            # Move, then convert: a float32 conversion on the CPU would copy (and double) the
            # bytes before they cross to the device; a conversion there is nearly free.
            t = t.to(device)
            if dtype is not None and t.dtype != dtype:
                t = t.to(dtype)
            elif t.device.type == "cpu":
                # Still the file's mapped bytes (safetensors 0.8 hands out views): a parameter must own
                # its memory. A view starts wherever the file's header ends (8-byte, not 64-byte
                # aligned: CPU BLAS then rounds differently from the same weights in fresh memory),
                # and it would change under a running model if the file were rewritten in place.
                t = t.clone()
            state[name] = t
            t3 = time.perf_counter()
            if device.type != "meta":  # (no data there: a test's stand-in for a GPU)
                finite[key] = _all_finite(t)  # on the device: one transfer of flags at the end
            read_s += t2 - t1 + time.perf_counter() - t3
            to_device_s += t3 - t2
        if device.type == "cuda":
            t1 = time.perf_counter()
            torch.cuda.synchronize(device)
            to_device_s += time.perf_counter() - t1
        t1 = time.perf_counter()
        bad = [key for key, ok in zip(finite, torch.stack(list(finite.values())).cpu().tolist()) if not ok] \
            if finite else []
        read_s += time.perf_counter() - t1
        if bad:
            why = "a damaged or diverged checkpoint"
            if dtype is not None:
                why += f", or values beyond the range of {str(dtype).removeprefix('torch.')}, which it was converted to"
            raise CheckpointError(f"checkpoint holds NaN or Inf weights ({why}):\n" + _listing("non-finite tensors", bad))
    finally:
        handles.clear()
    model.load_state_dict(state, strict=True, assign=True)
    if timings is not None:
        timings["read_s"] = timings.get("read_s", 0.0) + read_s
        timings["to_device_s"] = timings.get("to_device_s", 0.0) + to_device_s
    return skipped


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on t's device: no NaN or Inf in t. In slices, so the mask never grows to the
    size of a large embedding (a CPU load of the full model would double its peak memory)."""
    flat = t.reshape(-1)
    if not flat.numel():
        return torch.ones((), dtype=torch.bool, device=t.device)
    return torch.stack([torch.isfinite(part).all() for part in flat.split(1 << 24)]).all()


_ST_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _float_dtype(name: str) -> bool:
    return name in _ST_DTYPES


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
        with open_safetensors(f) as sf:
            keys.update(sf.keys())
    return keys
