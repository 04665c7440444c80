"""A stand-in policy with the `Policy` shape, for daemon tests that are about timing, not the model.

Its chunk is a smooth function of the observation time, so consecutive chunks agree where they
overlap in time; in the solver RTC modes it copies the prefix's first d actions (what `inpaint`
guarantees). Hooks make it slow, fail, or return NaN on chosen calls. Tests that are about the
model's RTC behaviour use the real tiny PI0.5 through `load_policy` instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class FakeResult:
    actions: np.ndarray
    stage_ms: dict[str, float] = field(default_factory=dict)


class FakePolicy:
    def __init__(
        self,
        chunk_size: int = 50,
        action_dim: int = 6,
        state_dim: int = 6,
        camera_names: tuple[str, ...] = ("top",),
        latency_s: float = 0.03,
        nan_calls: tuple[int, ...] = (),
        fail_calls: tuple[int, ...] = (),
        fail_from: int = 0,
        period_s: float = 0.02,
        hang_if_exists: str = "",
    ) -> None:
        self.chunk_size = chunk_size
        self.action_dim = action_dim
        self.state_dim = state_dim
        self.camera_names = list(camera_names)
        self.latency_s = latency_s
        self.nan_calls = set(nan_calls)
        self.fail_calls = set(fail_calls)
        self.fail_from = fail_from  # every call from this one (1-based) on fails; 0: never
        self.period_s = period_s
        self.hang_if_exists = hang_if_exists  # a path; while it exists, inference never returns
        self.calls = 0
        self.requests: list[Any] = []  # the RTC requests received, for assertions

    def infer(self, observations: list[Any], rtc: Any = None, noise: Any = None) -> FakeResult:
        self.calls += 1
        self.requests.append(rtc)
        for obs in observations:
            for name, img in obs.images.items():
                if img is not None and (img.dtype != np.uint8 or img.ndim != 3):
                    raise ValueError(f"camera {name}: expected uint8 HWC, got {img.dtype} {img.shape}")
        if self.latency_s:
            time.sleep(self.latency_s)
        if self.hang_if_exists:
            import os

            while os.path.exists(self.hang_if_exists):  # a wedged driver call, say
                time.sleep(0.05)
        if self.calls in self.fail_calls or (self.fail_from and self.calls >= self.fail_from):
            raise RuntimeError(f"fake failure on call {self.calls}")
        t0 = observations[0].timestamp
        t = t0 + self.period_s * np.arange(self.chunk_size)[:, None]
        phase = np.arange(self.action_dim)[None, :]
        actions = (0.5 * np.sin(2 * np.pi * 0.5 * t + phase)).astype(np.float32)
        if rtc is not None and rtc.prefix is not None:
            prefix = np.asarray(rtc.prefix, dtype=np.float32).reshape(-1, self.action_dim)
            d = min(rtc.delay, prefix.shape[0], self.chunk_size)
            actions[:d] = prefix[:d]
        if self.calls in self.nan_calls:
            actions[:, 0] = np.nan
        return FakeResult(actions[None], {"preprocess": 0.1, "denoise": 1000 * self.latency_s})


def make_fake_policy(refuse_if_exists: str = "", load_s: float = 0.0, announce: str = "", **kwargs: Any) -> FakePolicy:
    """Factory for `PolicySpec(factory="phyai_edge.control.fakes:make_fake_policy", kwargs=...)`.

    `refuse_if_exists`: a path; while it exists, building fails (a worker restart that keeps failing).
    `load_s`: how long building takes (a full-size checkpoint's load and compile).
    `announce`: an INFO line to log while building (as an engine logs its graph captures).
    """
    import logging
    import os

    if announce:
        logging.getLogger("phyai_edge.engines").info(announce)

    time.sleep(load_s)
    if refuse_if_exists and os.path.exists(refuse_if_exists):
        raise RuntimeError(f"fake load failure ({refuse_if_exists} exists)")
    if "camera_names" in kwargs:
        kwargs["camera_names"] = tuple(kwargs["camera_names"])
    return FakePolicy(**kwargs)


# ---------------------------------------------------------------- test helpers


def free_tcp_endpoint() -> str:
    """tcp://127.0.0.1:<a port that was free a moment ago>."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_config(**sections: dict[str, Any]) -> Any:
    """A daemon config for tests: thread worker, no real-time setup, a free local endpoint.

    Keyword arguments are TOML sections merged over these defaults.
    """
    from phyai_edge.control.config import parse_config

    data: dict[str, Any] = {
        "robot": {"control_hz": 50.0},
        "cameras": {"top": {"source": "synthetic", "width": 32, "height": 32}},
        "state": {"source": "synthetic"},
        "model": {"worker": "thread", "warmup": 0},
        "chunking": {"mode": "inpaint", "execution_horizon": 10, "delay_initial": 3},
        "publish": {"endpoint": free_tcp_endpoint(), "chunk_topic": "chunk"},
        "clock": {"priority": 0, "mlock": False},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return parse_config(data, "<test>")


test_config.__test__ = False  # type: ignore[attr-defined]  # not a pytest test despite the name


def run_ticks(daemon: Any, ticks: int, timeout_s: float = 60.0) -> None:
    """Set up `daemon` and run it for `ticks` ticks on a thread of its own; AssertionError if it
    has not stopped within `timeout_s` (a loop that hangs fails the test instead of blocking it)."""
    import threading

    daemon.setup()
    thread = threading.Thread(target=daemon.run, kwargs={"max_ticks": ticks}, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"the daemon did not stop after {ticks} ticks within {timeout_s:g} s"
