"""PI0.5 (Physical Intelligence): SigLIP + Gemma-2B prefix + Gemma-300M-shaped flow-matching expert."""

from phyai_edge.adapters.pi05.adapter import PI05Adapter, RobotIO
from phyai_edge.adapters.pi05.builtin import builtin_adapter
from phyai_edge.adapters.pi05.config import PI05Config, full, preset, tiny
from phyai_edge.adapters.pi05.loaders import detect_format, load_pi05, save_native
from phyai_edge.adapters.pi05.model import PI05Model


def load_adapter(checkpoint=None, preset_name: str = "tiny", device="cpu", tokenizer=None, camera_names=None,
                 seed: int = 0, structure=None) -> PI05Adapter:
    """A checkpoint folder if given, else the built-in seeded preset. `structure` (a preset name
    or PI05Config) sizes LeRobot/openpi checkpoints, which do not record it (default: full)."""
    if checkpoint is not None:
        return load_pi05(checkpoint, device=device, tokenizer=tokenizer, camera_names=camera_names,
                         structure=structure)
    return builtin_adapter(preset_name, seed=seed, camera_names=camera_names)


__all__ = [
    "PI05Adapter", "PI05Config", "PI05Model", "RobotIO", "builtin_adapter", "detect_format", "full",
    "load_adapter", "load_pi05", "preset", "save_native", "tiny",
]
