"""Every command's `--help` explains every option and names its default, and the commands the
README, docs/ and examples/ show use options the commands have."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from phyai_edge.cli import COMMANDS, HelpFormatter
from phyai_edge.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent


def parser_for(name: str) -> tuple[argparse.ArgumentParser, object]:
    module = importlib.import_module(COMMANDS[name][0])
    p = argparse.ArgumentParser(prog=f"phyai-edge {name}", formatter_class=HelpFormatter)
    module.add_arguments(p)
    return p, module


def options_of(name: str) -> set[str]:
    p, _ = parser_for(name)
    return {s for a in p._actions for s in a.option_strings}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_is_explained_with_its_default(name: str) -> None:
    p, _ = parser_for(name)
    formatter = p._get_formatter()
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"phyai-edge {name} {'/'.join(action.option_strings) or action.dest}: no help"
        shown = formatter._get_help_string(action) or ""
        unsaid = action.default is None or action.default is False or action.default in ("", [])
        if action.option_strings and not unsaid:
            # The value itself (or the help's own wording of it) is on the line.
            assert "default" in shown.lower(), f"phyai-edge {name} {action.option_strings[0]}: {shown!r}"


def test_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--iters ITERS timed calls (default: 20)" in text
    assert "--backend BACKEND eager | cudagraph | onnxruntime | tensorrt (default: eager)" in text
    # An option whose help already words its default is not told twice.
    assert text.count("(default: pi05)") == 1


def _shown_commands() -> list[tuple[str, str, str]]:
    """(where, command, rest of the line) for every `phyai-edge CMD ...` the user is shown."""
    sources: list[tuple[str, str]] = []
    for name, (module_name, _) in COMMANDS.items():
        sources.append((f"phyai-edge {name} --help", getattr(importlib.import_module(module_name), "DESCRIPTION", "")))
    files = [ROOT / "README.md", ROOT / "systemd" / "INSTALL.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "examples").glob("*")), *sorted((ROOT / "adapters").glob("*"))]
    sources += [(str(f.relative_to(ROOT)), f.read_text()) for f in files if f.is_file()]
    found = []
    for where, text in sources:
        for line in text.replace("\\\n", " ").splitlines():
            # Up to the end of the command: a closing backquote, a table bar or a comment.
            for m in re.finditer(r"phyai-edge (\w+)([^`|#\n]*)", line):
                if m.group(1) in COMMANDS:
                    found.append((where, m.group(1), m.group(2)))
    return found


def test_documented_options_exist() -> None:
    shown = _shown_commands()
    assert len(shown) > 50  # the README, docs and every command's examples were read
    options = {name: options_of(name) for name in COMMANDS}
    wrong = [f"{where}: phyai-edge {cmd} {opt}" for where, cmd, rest in shown
             for opt in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest) if opt not in options[cmd]]
    assert not wrong, "\n".join(wrong)


def test_info_says_a_cpu_only_torch_is_one(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    assert cli(["info"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("cuda "))
    assert line.split(None, 1)[1] == "none: this torch is a CPU-only build"  # not "not installed"


def test_info_tells_a_module_that_fails_to_import_from_a_missing_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """TensorRT's Python package without its libnvinfer read "not installed", hiding what to fix."""
    (tmp_path / "tensorrt.py").write_text('raise ImportError("libnvinfer.so.10: cannot open shared object file")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "tensorrt", raising=False)
    assert cli(["info"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("tensorrt "))
    assert line.split(None, 1)[1] == ("installed, but fails to import (ImportError: libnvinfer.so.10: cannot open "
                                      "shared object file)")
    from phyai_edge.commands.info import _version

    assert _version("no_such_module_here") is None


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A unit file or script that lost its `run` must not exit 0 as if the daemon had run."""
    assert cli([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "COMMAND" in err and "run" in err
