"""Start the daemon and the sim as two processes on free local ports (tests, benchmarks/sim_loop.py).

Both read one config written here: the repository's ALOHA config with its endpoints moved to
ports that are free now, so parallel runs and a developer's own daemon do not collide.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10 only
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parents[2]
ALOHA_CONFIG = REPO_ROOT / "adapters" / "pi05_aloha.toml"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def dump_toml(data: dict[str, Any], prefix: str = "") -> str:
    """Enough TOML for a daemon config: scalars, lists, nested tables (no arrays of tables)."""
    lines, tables = [], []
    for k, v in data.items():
        if isinstance(v, dict):
            tables.append((k, v))
        else:
            lines.append(f"{k} = {_toml_value(v)}")
    out = ""
    if prefix and (lines or not tables):
        out += f"[{prefix}]\n"
    out += "".join(line + "\n" for line in lines)
    for k, v in tables:
        out += ("\n" if out else "") + dump_toml(v, f"{prefix}.{k}" if prefix else k)
    return out


def loop_config(path: str | Path, base: str | Path = ALOHA_CONFIG, **sections: dict[str, Any]) -> dict[str, int]:
    """Write `base` with fresh ports (and `sections` merged over it, e.g. safety={...}) to `path`.
    Returns the ports: {"action", "state", "camera", "metrics"}."""
    data = tomllib.loads(Path(base).read_text())
    ports = {"action": free_port(), "state": free_port(), "camera": free_port(), "metrics": free_port()}
    data["publish"]["endpoint"] = f"tcp://127.0.0.1:{ports['action']}"
    data["state"]["endpoint"] = f"tcp://127.0.0.1:{ports['state']}"
    for cam in data["cameras"].values():
        if cam.get("source") == "zmq":
            cam["endpoint"] = f"tcp://127.0.0.1:{ports['camera']}"
    data.setdefault("metrics", {})["port"] = ports["metrics"]
    for name, values in sections.items():
        table = data.setdefault(name, {})
        for k, v in values.items():
            if isinstance(v, dict):
                table.setdefault(k, {}).update(v)
            else:
                table[k] = v
    Path(path).write_text(dump_toml(data))
    return ports


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # Run this checkout's package whatever is installed, and keep MuJoCo headless.
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("MUJOCO_GL", "egl")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start(command: str, args: list[str], log_path: str | Path) -> subprocess.Popen[bytes]:
    """`python -m phyai_edge COMMAND ARGS...` with stdout and stderr to `log_path`."""
    out = open(log_path, "wb")  # noqa: SIM115 - the child owns it for its lifetime
    try:
        return subprocess.Popen([sys.executable, "-m", "phyai_edge", command, *args], stdout=out,
                                stderr=subprocess.STDOUT, env=_env(), cwd=REPO_ROOT)
    finally:
        out.close()  # the child has its own descriptor


def stop(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> int:
    """SIGINT (both programs shut down cleanly on it), then SIGKILL if it does not exit."""
    if proc.poll() is None:
        proc.send_signal(2)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return int(proc.returncode)


def fetch_metrics(port: int, timeout: float = 5.0) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        return r.read().decode("utf-8", "replace")
