"""What `pip install phyai-edge` (not `-e`) gets: the sdist and the wheel, built here through
setuptools' PEP 517 hooks from a copy of the source tree, so that the tree gets no build/ or
egg-info and a stale build/lib/ (which setuptools does not clean) cannot put back a file the
package no longer has.

- every file the package reads at run time (each non-.py file under phyai_edge/) is in the wheel,
  and the package, unpacked from the wheel alone, finds its tokenizer and runs its CLI;
- nothing else is: no tests, benchmarks, virtual environments, wheels, caches or large files;
- the base requirements are the project's dependencies, no extra's package among them;
- the sdist carries what pyproject.toml names (README.md) and builds the same wheel;
- the build raises no setuptools deprecation: `project.license` as a `{ text = ... }` table was
  one, and setuptools says builds that still use it are unsupported after 2027-02-18;
- no module imports, at import time, a third-party package that is not a base dependency.
"""

from __future__ import annotations

import ast
import email
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10 only
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
NAME = PYPROJECT["project"]["name"].replace("-", "_")
VERSION = PYPROJECT["project"]["version"]
DIST_INFO = f"{NAME}-{VERSION}.dist-info/"

# What a clean clone does not have (.gitignore) or a build never needs, at the top of the tree.
TOP_LEVEL_SKIPPED = {".git", ".venv", "build", "dist", ".whl", ".gpu_stage", "runs", ".ruff_cache",
                     ".pytest_cache", "benchmarks", "roofline.png"}
# A wheel file larger than this is a leak (a checkpoint, an engine, a recording, a picture).
MAX_FILE_BYTES = 1 << 20

# Runs one setuptools build hook in the project folder it is started in; prints the file it wrote.
HOOK = "import sys; from setuptools import build_meta as b; print(getattr(b, sys.argv[1])(sys.argv[2]))"


@dataclass
class Built:
    sdist: Path
    wheel: Path  # built from the sdist, as pip does for a source install
    tree_wheel: Path  # built from the tree, as `pip wheel .` does
    warnings: str  # what the hooks wrote on stderr


def _copy_ignore(folder: str, names: list[str]) -> set[str]:
    skipped = {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".egg-info"))}
    if Path(folder).resolve() == ROOT:
        skipped |= TOP_LEVEL_SKIPPED & set(names)
    return skipped


def _run_hook(hook: str, project: Path, out: Path) -> tuple[Path, str]:
    out.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-c", HOOK, hook, str(out)], cwd=project, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"{hook} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return out / r.stdout.strip().splitlines()[-1], r.stderr


def _backend_missing() -> str | None:
    """None when this environment's setuptools is one [build-system] requires, else why not. (The
    hooks run here, not in pip's isolated environment: no index is needed.)"""
    requirements = pytest.importorskip("packaging.requirements")
    for text in PYPROJECT["build-system"]["requires"]:
        req = requirements.Requirement(text)
        if req.name != "setuptools":
            continue
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            return f"the build needs {text}, which is not installed here"
        if not req.specifier.contains(have, prereleases=True):
            return f"the build needs {text}; this environment has setuptools {have}"
    return None


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    why = _backend_missing()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("packaging")
    tree = tmp / "tree"
    shutil.copytree(ROOT, tree, ignore=_copy_ignore, symlinks=True)
    sdist, err_sdist = _run_hook("build_sdist", tree, tmp / "sdist")
    with tarfile.open(sdist) as tar:
        # Extraction filters came with Python 3.10.12; earlier 3.10 releases lack them.
        tar.extractall(tmp / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (unpacked,) = (tmp / "unpacked").iterdir()
    wheel, err_wheel = _run_hook("build_wheel", unpacked, tmp / "wheel")
    tree_wheel, err_tree = _run_hook("build_wheel", tree, tmp / "tree_wheel")
    return Built(sdist, wheel, tree_wheel, "\n".join((err_sdist, err_wheel, err_tree)))


def _wheel_files(wheel: Path) -> dict[str, int]:
    with zipfile.ZipFile(wheel) as z:
        return {i.filename: i.file_size for i in z.infolist() if not i.is_dir()}


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        return email.message_from_bytes(z.read(DIST_INFO + "METADATA"))


def _package_files() -> list[str]:
    """Every file of the package in the tree, as the wheel names it."""
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "phyai_edge").rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def test_the_wheel_holds_every_file_of_the_package(built: Built) -> None:
    files = _wheel_files(built.wheel)
    missing = [f for f in _package_files() if f not in files]
    assert not missing, f"in phyai_edge/ but not in the wheel (package-data in pyproject.toml): {missing}"
    # What the package reads at run time, by name: the tiny preset's tokenizer and the typing marker.
    assert "phyai_edge/assets/tiny_tokenizer.json" in files
    assert "phyai_edge/py.typed" in files


def test_the_wheel_holds_nothing_else(built: Built) -> None:
    files = _wheel_files(built.wheel)
    strays = [f for f in files if not f.startswith(("phyai_edge/", DIST_INFO))]
    assert not strays, f"outside the package in the wheel: {strays}"
    dev = [f for f in files if {"tests", "benchmarks", "examples", "scripts", ".venv", "__pycache__"} & set(f.split("/"))
           or f.endswith((".pyc", ".whl", ".so", ".onnx", ".safetensors", ".png", ".npz"))]
    assert not dev, f"development files in the wheel: {dev}"
    large = {f: n for f, n in files.items() if n > MAX_FILE_BYTES}
    assert not large, f"files over {MAX_FILE_BYTES} bytes in the wheel: {large}"


def test_the_wheel_declares_the_cli_and_only_the_base_dependencies(built: Built) -> None:
    with zipfile.ZipFile(built.wheel) as z:
        entry_points = z.read(DIST_INFO + "entry_points.txt").decode()
    assert re.search(r"^phyai-edge = phyai_edge\.cli:main$", entry_points, re.M), entry_points
    meta = _metadata(built.wheel)
    assert meta["Requires-Python"] == PYPROJECT["project"]["requires-python"]
    base = sorted(r for r in meta.get_all("Requires-Dist", []) if "extra ==" not in r)
    name = re.compile(r"^[A-Za-z0-9_.-]+")
    assert [name.match(r)[0] for r in base] == sorted(name.match(r)[0] for r in PYPROJECT["project"]["dependencies"])
    assert set(meta.get_all("Provides-Extra", [])) == set(PYPROJECT["project"]["optional-dependencies"])


def test_the_sdist_builds_the_same_wheel_as_the_tree(built: Built) -> None:
    with tarfile.open(built.sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "PKG-INFO", "LICENSE"} <= names
    assert sorted(_wheel_files(built.wheel)) == sorted(_wheel_files(built.tree_wheel))


def test_the_build_raises_no_setuptools_deprecation(built: Built) -> None:
    found = [line.strip() for line in built.warnings.splitlines() if "DeprecationWarning" in line]
    assert not found, "setuptools deprecates part of pyproject.toml (a future setuptools refuses it):\n" + "\n".join(found)
    assert _metadata(built.wheel)["License-Expression"] == PYPROJECT["project"]["license"]
    # Apache-2.0 asks that its text go with every copy: the wheel carries it beside its metadata.
    with zipfile.ZipFile(built.wheel) as z:
        text = z.read(DIST_INFO + "licenses/LICENSE").decode()
    assert "Apache License" in text and "Version 2.0" in text


def test_the_unpacked_wheel_alone_finds_its_assets_and_runs(built: Built, tmp_path: Path) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(built.wheel) as z:
        z.extractall(site)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))
    probe = ("import phyai_edge; from phyai_edge.adapters.pi05.builtin import tiny_tokenizer_path; "
             "print(phyai_edge.__file__); print(tiny_tokenizer_path())")
    r = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    package, tokenizer = (Path(line) for line in r.stdout.split())
    assert package.is_relative_to(site), f"imported {package}, not the wheel's copy"
    assert tokenizer.is_relative_to(site) and tokenizer.is_file()
    r = subprocess.run([sys.executable, "-m", "phyai_edge", "run", "--print-default-config"], cwd=elsewhere,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "[model]" in r.stdout and "[cameras.top]" in r.stdout


# Module-level imports the base install must satisfy: import name -> the dependency that gives it.
BASE_IMPORTS = {"torch": "torch", "numpy": "numpy", "safetensors": "safetensors", "tokenizers": "tokenizers",
                "zmq": "pyzmq", "tomli": "tomli"}


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether an import runs only on demand: inside a function, under `if TYPE_CHECKING`, or in a
    `try` that catches ImportError."""
    child, node = node, parents.get(node)
    while node is not None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return True
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
        if isinstance(node, ast.Try) and child in node.body:
            caught = " ".join(ast.unparse(h.type) for h in node.handlers if h.type is not None)
            if any(not h.type for h in node.handlers) or re.search(r"\b(ImportError|ModuleNotFoundError|Exception)\b",
                                                                      caught):
                return True
        child, node = node, parents.get(node)
    return False


def test_no_module_imports_a_package_outside_the_base_dependencies() -> None:
    deps = {re.match(r"^[A-Za-z0-9_.-]+", d)[0].lower() for d in PYPROJECT["project"]["dependencies"]}
    assert set(BASE_IMPORTS.values()) >= deps, "a new dependency: add its import name to BASE_IMPORTS"
    stdlib = set(sys.stdlib_module_names) | {"tomllib"}  # tomllib: 3.11's, imported where it exists
    offenders = []
    for path in sorted((ROOT / "phyai_edge").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - stdlib - {"phyai_edge", "__future__"}:
                if BASE_IMPORTS.get(top) not in deps and not _guarded(node, parents):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {top}")
    assert not offenders, ("imported when the module loads, but not a base dependency (import it where it is "
                           "used, and name the extra when it is missing):\n" + "\n".join(offenders))
