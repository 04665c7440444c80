"""FP8 (E4M3) scales for the torch path, and a CPU-runnable fake-quantised check of them.

Per-tensor scales: for every nn.Linear, the largest |weight| and the largest |input| seen over
the calibration set (forward pre-hooks on the float32 eager model), each divided by 448, the
largest finite E4M3 value, so amax maps onto the top of the fp8 range. Saved as safetensors
(`<module>.weight_scale`, `<module>.input_scale`, float32 scalars) plus a JSON summary; a linear
layer with fp8 weights reads them as `w_fp8 = (w / weight_scale).to(float8_e4m3fn)`.

`fake_fp8` applies exactly that rounding in float32 (torch can cast to float8 on CPU), so the
accuracy cost of the scales can be measured on any machine before a GPU ever runs them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

FP8_E4M3_MAX = 448.0
SCALES_FORMAT = "phyai-edge/fp8-scales/1"


def _linears(module: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in module.named_modules() if isinstance(m, nn.Linear)}


@torch.no_grad()
def collect_amax(module: nn.Module, run: Callable[[], Any],
                 on_call: Callable[[str], None] | None = None) -> dict[str, dict[str, float]]:
    """{linear name: {"weight_amax", "input_amax", "calls"}} after calling `run()` once, which
    should push the calibration set through every stage of `module`. `on_call(name)` is told of
    every linear call as it happens."""
    stats: dict[str, dict[str, float]] = {}
    handles = []
    for name, lin in _linears(module).items():
        stats[name] = {"weight_amax": float(lin.weight.detach().abs().max()), "input_amax": 0.0, "calls": 0}

        def hook(_m: nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
            s = stats[name]
            s["input_amax"] = max(s["input_amax"], float(args[0].detach().abs().max()))
            s["calls"] += 1
            if on_call is not None:
                on_call(name)

        handles.append(lin.register_forward_pre_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    unused = [n for n, s in stats.items() if s["calls"] == 0]
    for n in unused:  # a layer the stages never call (e.g. a final norm's consumers) gets no scale
        del stats[n]
    return stats


def scales_from_amax(amax: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    tiny = 1e-12  # an all-zero tensor still gets a usable (non-zero) scale
    return {n: {"weight_scale": max(s["weight_amax"], tiny) / FP8_E4M3_MAX,
                "input_scale": max(s["input_amax"], tiny) / FP8_E4M3_MAX} for n, s in amax.items()}


def save_scales(path: str | Path, scales: dict[str, dict[str, float]], meta: dict[str, Any] | None = None) -> Path:
    """`path` (.safetensors) and `path` with .json: the same scales, for tools and for people."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {f"{n}.{k}": torch.tensor(v, dtype=torch.float32) for n, s in scales.items() for k, v in s.items()}
    info = {"format": SCALES_FORMAT, "fp8": "e4m3fn", "fp8_max": FP8_E4M3_MAX, **(meta or {})}
    save_file(tensors, str(path), metadata={k: json.dumps(v) for k, v in info.items()})
    path.with_suffix(".json").write_text(json.dumps({**info, "scales": scales}, indent=2))
    return path


def load_scales(path: str | Path) -> dict[str, dict[str, float]]:
    """The scales `save_scales` wrote: the .safetensors file, or its .json twin."""
    from safetensors.torch import load_file

    if Path(path).suffix == ".json":
        data = json.loads(Path(path).read_text())
        if data.get("format") != SCALES_FORMAT or not isinstance(data.get("scales"), dict):
            raise ValueError(f"{path}: not an fp8 scales file (format {data.get('format')!r}, want {SCALES_FORMAT!r})")
        return {n: {k: float(v) for k, v in s.items()} for n, s in data["scales"].items()}
    out: dict[str, dict[str, float]] = {}
    for key, t in load_file(str(path)).items():
        name, kind = key.rsplit(".", 1)
        out.setdefault(name, {})[kind] = float(t)
    return out


def quantize_dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x rounded through E4M3 at `scale` (saturating, as fp8 GEMMs with amax scaling do)."""
    q = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


@contextlib.contextmanager
def fake_fp8(module: nn.Module, scales: dict[str, dict[str, float]]) -> Iterator[nn.Module]:
    """Within the block, every scaled Linear sees fp8-rounded inputs and weights."""
    linears = _linears(module)
    saved: dict[str, torch.Tensor] = {}
    handles = []
    with torch.no_grad():
        for name, s in scales.items():
            lin = linears.get(name)
            if lin is None:
                continue
            saved[name] = lin.weight.detach().clone()
            lin.weight.copy_(quantize_dequantize(lin.weight, s["weight_scale"]))

            def hook(_m: nn.Module, args: tuple[torch.Tensor, ...], scale: float = s["input_scale"]) -> tuple:
                return (quantize_dequantize(args[0], scale), *args[1:])

            handles.append(lin.register_forward_pre_hook(hook))
    try:
        yield module
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for name, w in saved.items():
                linears[name].weight.copy_(w)
