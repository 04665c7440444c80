"""Python 3.10 compatibility, checked syntactically (JetPack 6 on Jetson Orin ships 3.10; CI runs 3.11).

Parses every .py file that runs on the robot (the package, benchmarks/, examples/, scripts/) and
fails on the 3.11+ constructs that can be seen in the syntax tree without guessing:

* `import tomllib` that is not under `if sys.version_info >= (3, 11)` or a `try` (tomli fallback);
* `except*` and starred subscripts (`a[*b]`);
* names that 3.10's standard library lacks, imported (`from typing import Self`) or reached
  through the module (`enum.StrEnum`, `datetime.UTC`), unless under `if TYPE_CHECKING:`;
* `int.to_bytes()` / `int.from_bytes(b)` relying on the 3.11 default length and byte order.

A semantic difference (e.g. how an enum with a mixin formats) is out of its reach; a real 3.10
interpreter is the full check. The pyproject's `requires-python` and tomli marker are checked too.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from phyai_edge.control.config import tomllib

ROOT = Path(__file__).resolve().parent.parent
CHECKED_DIRS = ("phyai_edge", "benchmarks", "examples", "scripts")

# Standard-library names added in 3.11 (a few 3.12 ones that are easy to reach for, too).
NEW_NAMES: dict[str, frozenset[str]] = {
    "typing": frozenset({
        "Self", "Never", "LiteralString", "assert_never", "assert_type", "reveal_type", "Required",
        "NotRequired", "Unpack", "TypeVarTuple", "dataclass_transform", "get_overloads",
        "clear_overloads", "override", "TypeAliasType",
    }),
    "enum": frozenset({
        "StrEnum", "ReprEnum", "verify", "member", "nonmember", "global_enum", "EnumCheck",
        "FlagBoundary", "property", "show_flag_values", "CONTINUOUS", "NAMED_FLAGS", "UNIQUE",
        "STRICT", "CONFORM", "EJECT", "KEEP",
    }),
    "datetime": frozenset({"UTC"}),
    "contextlib": frozenset({"chdir"}),
    "asyncio": frozenset({"TaskGroup", "timeout", "timeout_at", "Timeout", "Runner", "Barrier",
                          "BrokenBarrierError"}),
    "hashlib": frozenset({"file_digest"}),
    "logging": frozenset({"getLevelNamesMapping", "getHandlerByName", "getHandlerNames"}),
    "operator": frozenset({"call"}),
    "math": frozenset({"exp2", "cbrt", "sumprod"}),
    "re": frozenset({"NOFLAG"}),
    "inspect": frozenset({"getmembers_static", "markcoroutinefunction"}),
    "locale": frozenset({"getencoding"}),
    "sys": frozenset({"exception"}),
    "itertools": frozenset({"batched"}),
    "builtins": frozenset({"ExceptionGroup", "BaseExceptionGroup"}),
}
NEW_MODULES = frozenset({"tomllib", "wsgiref.types"})
NEW_BUILTINS = frozenset({"ExceptionGroup", "BaseExceptionGroup"})


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _ancestors(node: ast.AST, parents: dict[ast.AST, ast.AST]):
    while node in parents:
        node = parents[node]
        yield node


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Under `if TYPE_CHECKING:`, a `sys.version_info` test, or a `try` (an ImportError fallback)."""
    for anc in _ancestors(node, parents):
        if isinstance(anc, ast.If) and (_is_type_checking(anc.test) or "version_info" in ast.unparse(anc.test)):
            return True
        if isinstance(anc, ast.Try) and node in {n for stmt in anc.body for n in ast.walk(stmt)}:
            return True
    return False


def check_source(source: str, filename: str = "<src>") -> list[str]:
    """The 3.11+ constructs in `source`, one 'file:line: what' string each."""
    tree = ast.parse(source, filename)
    parents = _parents(tree)
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> stdlib module it is bound to

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', '?')}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in NEW_MODULES and not _guarded(node, parents):
                    report(node, f"import {a.name} (3.11+) without a 3.10 fallback")
                if a.name in NEW_NAMES:
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in NEW_MODULES and not _guarded(node, parents):
                report(node, f"from {node.module} import ... (3.11+) without a 3.10 fallback")
            for a in node.names:
                if f"{node.module}.{a.name}" in NEW_MODULES and not _guarded(node, parents):
                    report(node, f"from {node.module} import {a.name} (3.11+)")
                if a.name in NEW_NAMES.get(node.module, ()) and not _guarded(node, parents):
                    report(node, f"from {node.module} import {a.name} (not in 3.10)")
        elif getattr(ast, "TryStar", None) is not None and isinstance(node, ast.TryStar):
            report(node, "except* (3.11+)")
        elif isinstance(node, ast.Subscript):
            sl = node.slice
            elts = sl.elts if isinstance(sl, ast.Tuple) else [sl]
            if any(isinstance(e, ast.Starred) for e in elts):
                report(node, "starred subscript a[*b] (3.11+)")

    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr in NEW_NAMES[aliases[node.value.id]]
                and not _guarded(node, parents)):
            report(node, f"{aliases[node.value.id]}.{node.attr} (not in 3.10)")
        elif (isinstance(node, ast.Name) and node.id in NEW_BUILTINS and isinstance(node.ctx, ast.Load)
                and not _guarded(node, parents)):
            report(node, f"{node.id} (3.11+ builtin)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.keywords:
            if node.func.attr == "to_bytes" and not node.args:
                report(node, "int.to_bytes() without length/byteorder (3.11+ defaults)")
            elif (node.func.attr == "from_bytes" and len(node.args) == 1
                    and not isinstance(node.args[0], ast.Starred)):
                report(node, "int.from_bytes(b) without byteorder (3.11+ default)")
    return found


def _robot_files() -> list[Path]:
    return sorted(p for d in CHECKED_DIRS for p in (ROOT / d).rglob("*.py"))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="its example is 3.11 syntax, which 3.10 cannot parse; "
                    "there the interpreter itself is the check (the whole suite runs on it)")
def test_checker_catches_each_construct():
    bad = """
import tomllib
from typing import Self, Any
from enum import StrEnum
import datetime as dt
import asyncio, hashlib, contextlib, logging
x = dt.UTC
asyncio.TaskGroup(); hashlib.file_digest; contextlib.chdir; logging.getLevelNamesMapping()
try:
    pass
except* ValueError:
    pass
a[*b]
(5).to_bytes()
int.from_bytes(b"x")
raise ExceptionGroup("m", [])
"""
    found = check_source(bad)
    for needle in ("import tomllib", "import Self", "import StrEnum", "datetime.UTC", "asyncio.TaskGroup",
                   "hashlib.file_digest", "contextlib.chdir", "logging.getLevelNamesMapping", "except*",
                   "a[*b]", "to_bytes()", "from_bytes(b)", "ExceptionGroup"):
        assert any(needle in f for f in found), (needle, found)
    assert not any("Any" in f for f in found)


def test_checker_accepts_guarded_and_310_code():
    ok = """
import sys
from typing import TYPE_CHECKING, Literal, ParamSpec, TypeAlias, TypeGuard
if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib
try:
    from typing import Self
except ImportError:
    Self = object
if TYPE_CHECKING:
    from typing import Never
KeyMap: TypeAlias = "dict[str, int | None]"
isinstance(1, int | None)
(5).to_bytes(2, "little")
int.from_bytes(b"x", "big")
a[1:2, ...]
"""
    assert check_source(ok) == []


@pytest.mark.parametrize("path", _robot_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_311_only_constructs(path: Path):
    assert check_source(path.read_text(), str(path.relative_to(ROOT))) == []


def test_pyproject_declares_310():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert re.fullmatch(r">=\s*3\.10", project["requires-python"]), project["requires-python"]
    deps = [d.replace(" ", "") for d in project["dependencies"]]
    assert any(d.startswith("tomli") and "python_version<'3.11'" in d.replace('"', "'") for d in deps), deps
