"""What the commands that load a policy (bench, eval, serve, export) share: the checks a user's
mistake should meet before anything heavy runs, and one line on stderr instead of a traceback;
and the commands' JSON output to a file or stdout.

Not a command: `phyai_edge.cli` lists its commands by name, so this module is never one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from phyai_edge.engines.device import device_problem
from phyai_edge.extras import with_install_hint

if TYPE_CHECKING:
    from phyai_edge.engines.policy import Policy

# What loading a checkpoint, preset or bundle raises for a user's mistake: a missing folder
# (FileNotFoundError, OSError), a folder that is not a checkpoint or has wrong tensors
# (CheckpointError is a ValueError), an unknown adapter / preset / backend / dtype (ValueError),
# a bundle that fails its checks (BundleError is a RuntimeError), a backend whose library is
# missing (RuntimeError, ImportError). Each carries a message written for the user.
LOAD_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, RuntimeError, ImportError)


def _finite_or_null(data: object) -> object:
    """`data` with every NaN / Inf float as None: JSON has no NaN (Python writes one; jq, browsers
    and most parsers refuse it)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite_or_null(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite_or_null(v) for v in data]
    return data


def json_text(data: object) -> str:
    """`data` as indented JSON, numpy scalars as floats and NaN / Inf as null."""
    return json.dumps(_finite_or_null(json.loads(json.dumps(data, default=float))), indent=2, allow_nan=False)


def write_json(data: object, where: str) -> None:
    """`data` as indented JSON (`json_text`) to the file `where`, or to stdout for "-"."""
    text = json_text(data)
    if where == "-":
        print(text)
    else:
        with open(where, "w") as f:
            f.write(text + "\n")


def check_writable(command: str, flag: str, path: str | None, *, folder: bool = False) -> None:
    """`fail` now, not after a run, where `path` cannot be written: a file whose folder is missing or
    not writable, or (`folder`) a folder that cannot be made (it is made here). "-" and None pass."""
    if not path or path == "-":
        return
    target = Path(path)
    if folder:  # made now, as the run would make it later
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            fail(command, f"{flag} {path}: cannot make this folder ({exc.strerror or exc})")
        if not os.access(target, os.W_OK):
            fail(command, f"{flag} {path}: the folder is not writable")
        return
    parent = target.parent
    if not parent.is_dir():
        fail(command, f"{flag} {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        fail(command, f"{flag} {path}: the folder {parent} is not writable")


def fail(command: str, message: str) -> NoReturn:
    """End the command with one line on stderr and exit status 2 (a usage error, as argparse's)."""
    print(f"phyai-edge {command}: {message}", file=sys.stderr)
    sys.stderr.flush()
    raise SystemExit(2)


def check_at_least(command: str, *checks: tuple[str, float | None, float]) -> None:
    """`fail` at the first (flag, value, least) whose value is below least; None (not given)
    passes. For counts a zero would silently turn into the default (`args.x or default`)."""
    for flag, value, least in checks:
        if value is not None and not value >= least:  # NaN too
            kind = "an integer" if isinstance(value, int) else "a number"
            fail(command, f"{flag} {value:g}: expected {kind} >= {least:g}")


def check_positive(command: str, *checks: tuple[str, float | None]) -> None:
    """`fail` at the first (flag, value) that is not a finite number > 0; None passes."""
    for flag, value in checks:
        if value is not None and not (math.isfinite(value) and value > 0):
            fail(command, f"{flag} {value:g}: expected a finite number > 0")


def check_finite(command: str, *checks: tuple[str, float | None, float, str], hint: str = "") -> None:
    """`fail` at the first (flag, value, least, unit) whose value is not a finite number >= least;
    None passes. `check_at_least` takes "inf" (argparse's float does), which as a time or a size
    overflowed or ran forever; `unit` ("seconds", "GB", or "" for none) and `hint` go in the line."""
    for flag, value, least, unit in checks:
        if value is not None and not (math.isfinite(value) and value >= least):
            of = f" of {unit}" if unit else ""
            fail(command, f"{flag} {value:g}: expected a finite number{of} >= {least:g}" + (f" ({hint})" if hint else ""))


def check_seconds(command: str, flag: str, value: float | None) -> None:
    """`fail` unless `value` is None or a finite number of seconds >= 0 (argparse's float takes
    "inf" and "nan": the daemon then died after loading the model, without its SHUTDOWN message)."""
    check_finite(command, (flag, value, 0, "seconds"), hint="0: until stopped")


def check_device(command: str, device: str | None, *, allow_meta: bool = False, flag: str = "--device") -> None:
    """`fail` with `device_problem`'s line; None (the command picks a device itself) passes."""
    if device is None:
        return
    problem = device_problem(device, allow_meta=allow_meta, flag=flag)
    if problem is not None:
        fail(command, problem)


def load_policy_or_fail(command: str, device_flag: str = "--device", **kwargs: Any) -> Policy:
    """`load_policy(**kwargs)`, its errors as `fail` lines. A bundle given with a checkpoint is
    checked against it (`load_policy` refuses a bundle exported from other weights, naming both
    weight hashes). `device_flag` is the option the device came from, for the message."""
    from phyai_edge.engines.policy import load_policy

    check_device(command, kwargs.get("device"), flag=device_flag)
    try:
        return load_policy(**kwargs)
    except LOAD_ERRORS as exc:
        fail(command, with_install_hint(exc))


def add_adapter_option_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapter-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an option of the model adapter, repeatable (PI0.5: prompt_state=padded for a policy "
                   "fine-tuned with LeRobot v0.4.x, which wrote the state zero-padded to 32 values into the "
                   "prompt; prompt_state=none for openpi's discrete_state_input=False, e.g. pi05_libero; "
                   "relative_actions=6,-1,6,-1 for delta actions; robot_space=aloha for an openpi ALOHA policy on "
                   "a robot in standard ALOHA space; a wrong name lists the adapter's options)")


def adapter_options(command: str, args: argparse.Namespace) -> dict[str, str]:
    """`--adapter-option NAME=VALUE` flags as a dict (the adapter checks the names and values)."""
    out: dict[str, str] = {}
    for item in args.adapter_option:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            fail(command, f"--adapter-option {item!r}: expected NAME=VALUE")
        out[name.strip()] = value.strip()
    return out

