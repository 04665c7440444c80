"""Which optional extra (`pip install 'phyai-edge[NAME]'`, pyproject.toml) brings which import.

A base install that reaches for an optional package should say, in one line, which extra to
install; this table is the one place that knows. Imports nothing beyond the standard library.
"""

from __future__ import annotations

# Top-level import name -> the extra that installs it.
EXTRA_OF: dict[str, str] = {
    "onnx": "onnx",
    "onnxruntime": "onnx",
    "tensorrt": "tensorrt",
    "cv2": "camera",
    "prometheus_client": "metrics",
    "matplotlib": "plot",
    "sentencepiece": "sentencepiece",
    "pyarrow": "lerobot",
    "tqdm": "progress",
    "gymnasium": "rl",
    "ray": "ray",
    "gym_aloha": "sim",
    "mujoco": "sim",
    "dm_control": "sim",
}

# What a backend imports to build its engines from a checkpoint (an ONNX export first).
BACKEND_NEEDS: dict[str, tuple[str, ...]] = {"onnxruntime": ("onnx", "onnxruntime"), "tensorrt": ("onnx", "tensorrt")}


def backend_install_hint(backend: str) -> str | None:
    """How to get what `backend` needs: its own extra (tensorrt's brings onnx too)."""
    needs = BACKEND_NEEDS.get(backend)
    return install_hint(needs[-1]) if needs else None


def install_hint(module: str) -> str | None:
    """`pip install 'phyai-edge[NAME]'` for the extra that brings `module` (a dotted name is
    looked up by its top-level package); None for a module no extra brings."""
    extra = EXTRA_OF.get(module.partition(".")[0])
    return f"pip install 'phyai-edge[{extra}]'" if extra else None


def missing_module(exc: BaseException) -> str | None:
    """The module an ImportError (or the ImportError that caused `exc`) could not import."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ImportError) and exc.name:
            return exc.name
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None


def with_install_hint(exc: BaseException) -> str:
    """`exc`'s message, ending with the extra to install when a missing optional package caused it
    (once: a message that already names it is left as it is)."""
    text = str(exc) or type(exc).__name__
    module = missing_module(exc)
    hint = install_hint(module) if module else None
    if hint is None or hint in text:
        return text
    return f"{text} ({hint})"
