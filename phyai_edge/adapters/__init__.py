"""Model adapters: one module per model. The runtime finds them by name here."""

from __future__ import annotations

import importlib
from typing import Any

ADAPTERS = {"pi05": "phyai_edge.adapters.pi05"}


def load_adapter(name: str, **kwargs: Any):
    """`name` -> its module's `load_adapter(**kwargs)`."""
    try:
        module = importlib.import_module(ADAPTERS[name])
    except KeyError:
        raise ValueError(f"unknown adapter {name!r}; available: {sorted(ADAPTERS)}") from None
    return module.load_adapter(**kwargs)
