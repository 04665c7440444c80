"""Shared fixtures: small, generic, CPU-only. Nothing here touches the network.

- `tiny_adapter`: the seeded tiny PI0.5 adapter (fresh per test: tests may mutate it).
- `tiny_policy`: that adapter behind the eager engine in float32 on CPU.
- `make_obs`: builds a valid `Observation` for an adapter (uint8 HWC images of any size).
- `tiny_tokenizer_path`: the shipped tiny tokenizer file.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest
import torch

# Triton kernels (tests/test_triton_ops.py) run in Triton's CPU interpreter where there is no GPU.
# Triton reads this when it decorates kernels, its own library's included, so it is set here, before
# anything imports triton (torch._dynamo does, where triton is installed). (CI installs the pinned triton of the test extra.)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from phyai_edge.adapters.base import Observation
from phyai_edge.adapters.pi05.builtin import builtin_adapter
from phyai_edge.adapters.pi05.builtin import tiny_tokenizer_path as _tiny_tok
from phyai_edge.engines.eager import EagerEngine
from phyai_edge.engines.policy import Policy

# Two cores in CI: keep intra-op threads bounded so tests don't oversubscribe.
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def tiny_tokenizer_path():
    return _tiny_tok()


@pytest.fixture
def tiny_adapter():
    return builtin_adapter("tiny", seed=0)


@pytest.fixture
def tiny_policy(tiny_adapter):
    return Policy(tiny_adapter, EagerEngine(tiny_adapter, device="cpu", dtype="float32", seed=0))


@pytest.fixture
def make_obs() -> Callable[..., Observation]:
    def _make(adapter=None, seed: int = 0, size: tuple[int, int] = (96, 128), cameras=None,
              prompt: str = "pick up the red cube", state=None) -> Observation:
        rng = np.random.default_rng(seed)
        names = cameras if cameras is not None else (adapter.camera_names if adapter is not None else ["top"])
        state_dim = adapter.state_dim if adapter is not None else 14
        images = {n: rng.integers(0, 256, (*size, 3), dtype=np.uint8) for n in names}
        if state is None:
            state = rng.uniform(-0.9, 0.9, state_dim).astype(np.float32)
        return Observation(images=images, state=np.asarray(state, np.float32), prompt=prompt)

    return _make


def chunk_noise(adapter, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """Injected noise of the shape the solver integrates (B, H, D)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, adapter.chunk_size, adapter.model_action_dim, generator=g)


@pytest.fixture
def noise_for():
    return chunk_noise


@pytest.fixture
def restored_logging():
    """`phyai-edge run` sets up the daemon's logging (a handler on this test's captured stdout,
    no propagation): put it back for the tests after this one."""
    import logging

    from phyai_edge.control import log as log_mod

    root = logging.getLogger("phyai_edge")
    saved = list(root.handlers), root.level, root.propagate, list(log_mod._CONFIGURED)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    root.propagate = saved[2]
    log_mod._CONFIGURED[:] = saved[3]
