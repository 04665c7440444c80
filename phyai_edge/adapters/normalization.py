"""Normalisation statistics for state and actions: quantile (q01/q99) or mean/std.

Quantile mode maps [q01, q99] to [-1, 1]; mean/std mode is the usual z-score. The mode is a
property of how the checkpoint was trained and is read from its files, never guessed silently.
So is the convention, how the spread is kept off zero, which LeRobot and openpi do differently
(`NormStats.convention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

NormMode = Literal["quantile", "mean_std", "identity"]
_MODES = ("quantile", "mean_std", "identity")
NormConvention = Literal["lerobot", "openpi"]
_CONVENTIONS = ("lerobot", "openpi")
_EPS = 1e-8  # LeRobot's NormalizerProcessorStep.eps
_OPENPI_EPS = 1e-6  # openpi's transforms.Normalize / Unnormalize


def _indices(where: np.ndarray) -> str:
    return ", ".join(str(int(i)) for i in np.flatnonzero(where))


@dataclass
class NormStats:
    mode: NormMode
    mean: np.ndarray | None = None
    std: np.ndarray | None = None
    q01: np.ndarray | None = None
    q99: np.ndarray | None = None
    # The formulas of the trainer that wrote the statistics. "lerobot" (NormalizerProcessorStep):
    # quantiles divide by q99 - q01, by 1e-8 only where that is 0; mean/std by std + 1e-8, and
    # un-normalising multiplies by std alone. "openpi" (transforms.Normalize / Unnormalize): 1e-6
    # is added to every spread, both ways. It matters where a spread is small: at 0.04 (a gripper
    # in metres) about 0.3 % of the prompt's state bins differ, and a joint that never moved in
    # the data (q01 == q99) reported 2e-7 off reads bin 255 with one, 53 with the other.
    convention: NormConvention = "lerobot"

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"normalisation mode {self.mode!r} is not one of {', '.join(_MODES)}")
        if self.convention not in _CONVENTIONS:
            raise ValueError(f"normalisation convention {self.convention!r} is not one of {', '.join(_CONVENTIONS)}")
        for name in ("mean", "std", "q01", "q99"):
            val = getattr(self, name)
            if val is not None:
                setattr(self, name, np.asarray(val, dtype=np.float32).reshape(-1))
        if self.mode == "quantile" and (self.q01 is None or self.q99 is None):
            raise ValueError("quantile normalisation needs q01 and q99 statistics")
        if self.mode == "mean_std" and (self.mean is None or self.std is None):
            raise ValueError("mean/std normalisation needs mean and std statistics")
        # Checked here, not at the first observation: arrays of unequal length would broadcast (or
        # fail mid-run), and a NaN would only show as NaN actions.
        used = {n: getattr(self, n) for n in self.used_fields()}
        lengths = {n: v.shape[0] for n, v in used.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"{self.mode} statistics of unequal length: "
                             + ", ".join(f"{n} has {k}" for n, k in lengths.items()))
        bad = [n for n, v in used.items() if not np.isfinite(v).all()]
        if bad:
            raise ValueError(f"{self.mode} statistics hold NaN or Inf values in {', '.join(bad)}")
        # A zero spread is kept (a joint that never moved in the data; LeRobot and openpi divide by
        # an epsilon there too), an inverted one is not: it would mirror the robot's space.
        if self.mode == "mean_std" and (self.std < 0).any():
            raise ValueError(f"mean_std statistics: std is negative at index {_indices(self.std < 0)}")
        if self.mode == "quantile" and (self.q01 > self.q99).any():
            raise ValueError(f"quantile statistics: q01 is above q99 at index {_indices(self.q01 > self.q99)}")

    def used_fields(self) -> tuple[str, ...]:
        """The statistics this mode reads."""
        return {"quantile": ("q01", "q99"), "mean_std": ("mean", "std")}.get(self.mode, ())

    @property
    def dim(self) -> int | None:
        ref = self.q01 if self.mode == "quantile" else self.mean
        return None if ref is None else int(ref.shape[0])

    def normalize(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if self.mode == "identity":
            return x
        self._check(x)
        # Each in its trainer's order of operations, in float32 as LeRobot computes (openpi in
        # float64: a bin differs about once in 10^5 values, where a value lies within rounding
        # of a bin edge).
        if self.convention == "openpi":
            if self.mode == "quantile":
                return (x - self.q01) / (self.q99 - self.q01 + np.float32(_OPENPI_EPS)) * 2.0 - 1.0
            return (x - self.mean) / (self.std + np.float32(_OPENPI_EPS))
        if self.mode == "quantile":
            denom = self.q99 - self.q01
            denom = np.where(denom == 0, _EPS, denom)
            return 2.0 * (x - self.q01) / denom - 1.0
        return (x - self.mean) / (self.std + _EPS)

    def unnormalize(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if self.mode == "identity":
            return x
        self._check(x)
        if self.convention == "openpi":
            if self.mode == "quantile":
                return (x + 1.0) / 2.0 * (self.q99 - self.q01 + np.float32(_OPENPI_EPS)) + self.q01
            return x * (self.std + np.float32(_OPENPI_EPS)) + self.mean
        if self.mode == "quantile":
            denom = self.q99 - self.q01
            denom = np.where(denom == 0, _EPS, denom)
            return (x + 1.0) * denom / 2.0 + self.q01
        return x * self.std + self.mean  # LeRobot adds no epsilon on the way back

    def _check(self, x: np.ndarray) -> None:
        if x.shape[-1] != self.dim:
            raise ValueError(f"expected last dimension {self.dim} for these statistics, got shape {x.shape}")

    def to_json(self) -> dict:
        out: dict = {"mode": self.mode}
        for name in ("mean", "std", "q01", "q99"):
            val = getattr(self, name)
            if val is not None:
                out[name] = val.tolist()
        if self.convention != "lerobot":  # only then: LeRobot-convention files stay as they were
            out["convention"] = self.convention
        return out

    @classmethod
    def from_json(cls, d: dict) -> NormStats:
        return cls(d["mode"], d.get("mean"), d.get("std"), d.get("q01"), d.get("q99"),
                   d.get("convention", "lerobot"))
