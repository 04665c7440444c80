"""Model adapters: one module per model. The runtime finds them by name here.

Adding a model is one module and one line in ADAPTERS (tests/helpers/toy_adapter.py is a worked
example, run through the runtime by tests/test_second_adapter.py). The module provides:

- `load_adapter(checkpoint=None, preset_name="tiny", device="cpu", tokenizer=None,
  camera_names=None, seed=0, **_)` -> an object implementing `base.Adapter` (stages as methods
  of `adapter.module` named as in `stage_specs`, listed in execution order, the last one the
  solver's velocity step taking (x_t, t, ...) first: see `Adapter.stage_specs`);
- for engine bundles: `save_bundle_checkpoint(adapter, folder, with_weights)` and
  `load_bundle_adapter(folder, weights_included)` (the adapter's own metadata format).
  Optional keywords, passed only to functions that name them: `weight_dtype` (save: store the
  weights for an engine of that precision), `device` and `timings` (load: put the weights on
  that device; add `read_s` / `to_device_s` to the dict);
- optionally `OPTIONS`: {name: help} of the extra `load_adapter` keywords a user may set (the
  daemon's `[model.adapter_options]`, the CLI's `--adapter-option NAME=VALUE`); any other name
  is refused here, naming the ones there are.

Not yet model-agnostic: the cudagraph engine (PI0.5's graph, prompt-length buckets) and the
TensorRT engine's run loop (PI0.5's stage and tensor names).
"""

from __future__ import annotations

import importlib
from typing import Any

ADAPTERS = {"pi05": "phyai_edge.adapters.pi05"}


def load_adapter(name: str, options: dict[str, Any] | None = None, **kwargs: Any):
    """`name` -> its module's `load_adapter(**kwargs, **options)`. `options` are the user's
    (checked against the module's `OPTIONS`); `kwargs` the runtime's own."""
    try:
        module = importlib.import_module(ADAPTERS[name])
    except KeyError:
        raise ValueError(f"unknown adapter {name!r}; available: {sorted(ADAPTERS)}") from None
    known: dict[str, str] = getattr(module, "OPTIONS", {})
    unknown = sorted(set(options or {}) - set(known))
    if unknown:
        takes = "; ".join(f"{k}: {v}" for k, v in known.items()) or "none"
        raise ValueError(f"adapter {name!r} has no option {unknown[0]!r} (its options: {takes})")
    return module.load_adapter(**kwargs, **(options or {}))
