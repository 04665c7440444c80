"""PI0.5 configuration: the published sizes (`full`) and a tiny seeded test size (`tiny`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any


def _check_fields(spec: Any, where: str) -> None:
    """Every int field a positive int and every float field a positive number, named on error: a
    checkpoint's JSON gives these, and a zero or a string there failed (or ran wrongly) only at
    the first inference."""
    for f in fields(spec):
        value = getattr(spec, f.name)
        if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{where}{f.name} = {value!r}: expected a positive integer")
        if f.type == "float" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"{where}{f.name} = {value!r}: expected a positive number")


@dataclass(frozen=True)
class SiglipSpec:
    image_size: int = 224
    patch_size: int = 14
    width: int = 1152
    depth: int = 27
    num_heads: int = 16
    mlp_dim: int = 4304
    ln_eps: float = 1e-6

    def __post_init__(self) -> None:
        _check_fields(self, "vision.")

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class GemmaSpec:
    width: int
    depth: int
    mlp_dim: int
    num_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int = 256
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        _check_fields(self, "")


@dataclass(frozen=True)
class PI05Config:
    """Everything that fixes PI0.5's structure and its input/output conventions."""

    vision: SiglipSpec = field(default_factory=SiglipSpec)
    prefix: GemmaSpec = field(default_factory=lambda: GemmaSpec(width=2048, depth=18, mlp_dim=16384))
    expert: GemmaSpec = field(default_factory=lambda: GemmaSpec(width=1024, depth=18, mlp_dim=4096))
    vocab_size: int = 257152
    chunk_size: int = 50
    max_action_dim: int = 32
    max_state_dim: int = 32
    max_token_len: int = 200
    num_steps: int = 10
    state_bins: int = 256
    time_min_period: float = 4e-3
    time_max_period: float = 4.0
    preset: str = "full"

    def __post_init__(self) -> None:
        _check_fields(self, "")
        if self.time_min_period >= self.time_max_period:
            raise ValueError(f"time_min_period {self.time_min_period} must be below time_max_period "
                             f"{self.time_max_period}")
        if self.prefix.depth != self.expert.depth:
            raise ValueError("PI0.5 pairs every prefix layer with an expert layer: depths must match")
        if (self.prefix.num_heads, self.prefix.num_kv_heads, self.prefix.head_dim) != (
            self.expert.num_heads,
            self.expert.num_kv_heads,
            self.expert.head_dim,
        ):
            raise ValueError("prefix and expert must share head layout (the expert reads the prefix KV cache)")
        if self.expert.width % 2:
            raise ValueError("expert width must be even (sinusoidal time embedding)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PI05Config:
        d = dict(d)
        vision = SiglipSpec(**d.pop("vision"))
        prefix = GemmaSpec(**d.pop("prefix"))
        expert = GemmaSpec(**d.pop("expert"))
        return cls(vision=vision, prefix=prefix, expert=expert, **d)

    def with_overrides(self, **kw: Any) -> PI05Config:
        return replace(self, **kw)


def full() -> PI05Config:
    """SigLIP so400m/14 at 224 px, Gemma-2B prefix, Gemma-300M-shaped action expert."""
    return PI05Config()


def tiny() -> PI05Config:
    """Same structure, small widths: a chunk runs in milliseconds on one CPU core."""
    return PI05Config(
        vision=SiglipSpec(image_size=224, patch_size=14, width=32, depth=2, num_heads=2, mlp_dim=64),
        prefix=GemmaSpec(width=64, depth=2, mlp_dim=128, num_heads=2, num_kv_heads=1, head_dim=16),
        expert=GemmaSpec(width=32, depth=2, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16),
        vocab_size=1024,
        chunk_size=50,
        max_token_len=128,
        preset="tiny",
    )


PRESETS = {"full": full, "tiny": tiny}


def preset(name: str) -> PI05Config:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown PI0.5 preset {name!r}; choose one of {sorted(PRESETS)}") from None
