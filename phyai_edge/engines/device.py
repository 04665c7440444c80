"""Whether a torch device can run on this machine, said in one line before anything loads."""

from __future__ import annotations


def device_problem(device: str, *, allow_meta: bool = False, flag: str = "device") -> str | None:
    """Why `device` cannot run here, or None. Checked before loading anything: without it, a
    CPU-only torch reports `--device cuda` as a missing ATen_cuda library deep in the engine."""
    import torch

    kinds = "cpu, cuda, cuda:N or meta" if allow_meta else "cpu, cuda or cuda:N"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        return f"{flag} {device}: not a device; expected {kinds}"
    if dev.type == "meta" and allow_meta:
        return None
    if dev.type not in ("cpu", "cuda"):
        return f"{flag} {device}: not supported; expected {kinds}"
    if dev.type == "cpu":
        return None
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:  # ROCm torch says "cuda" too
        return (f"{flag} {device}: this torch ({torch.__version__}) is a CPU-only build; install a CUDA build "
                f"(on a Jetson, JetPack's torch wheel) or use {flag} cpu")
    if not torch.cuda.is_available():
        return (f"{flag} {device}: torch {torch.__version__} has CUDA {torch.version.cuda} but sees no GPU "
                "(driver loaded? CUDA_VISIBLE_DEVICES?)")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        return f"{flag} {device}: this machine has {count} GPU(s) (cuda:0 .. cuda:{count - 1})"
    return None
