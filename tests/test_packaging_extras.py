"""A base install (`pip install phyai-edge`, no extras) that asks for something an extra brings
should be told, in one line, which extra to install: `pip install 'phyai-edge[NAME]'`.

The packages are hidden here (None in sys.modules, so importing them fails as if they were not
installed, and `importlib.util.find_spec` finds nothing), whatever this environment has.

Before 2026-12-06 (checked with a wheel in a fresh virtual environment) the onnxruntime backend,
`--check-config` of `model.backend = "onnxruntime"`, `serve --ray` and `eval --lerobot` ended in a
message without the extra, a traceback, or (the daemon) a worker that failed at load and was
restarted; `phyai_edge/extras.py` now names the extra for each.
"""

from __future__ import annotations

import sys

import pytest

from phyai_edge.cli import main as cli


def hide(monkeypatch: pytest.MonkeyPatch, *packages: str) -> None:
    """Make `packages` (and any of their modules already imported) unimportable for this test."""
    for name in packages:
        for key in [k for k in sys.modules if k.startswith(name + ".")]:
            monkeypatch.setitem(sys.modules, key, None)
        monkeypatch.setitem(sys.modules, name, None)


def exit_status(argv: list[str]) -> int:
    """The command's exit status, as the `phyai-edge` script would end with it."""
    try:
        return cli(argv)
    except SystemExit as exc:  # `fail` exits 2 from inside a command
        if isinstance(exc.code, str):  # the interpreter prints such a message and exits 1
            print(exc.code, file=sys.stderr)
            return 1
        return int(exc.code or 0)


def one_line_naming(err: str, extra: str) -> bool:
    lines = [line for line in err.splitlines() if line.strip()]
    return f"pip install 'phyai-edge[{extra}]'" in err and "Traceback" not in err and len(lines) <= 2


def test_roofline_plot_without_matplotlib_names_the_plot_extra(monkeypatch, capsys, tmp_path) -> None:
    hide(monkeypatch, "matplotlib")
    rc = exit_status(["roofline", "--device", "orin", "--plot", str(tmp_path / "r.png")])
    assert rc != 0
    assert one_line_naming(capsys.readouterr().err, "plot")


def test_sim_without_the_simulator_names_the_sim_extra(monkeypatch, capsys) -> None:
    hide(monkeypatch, "gym_aloha", "mujoco")
    assert exit_status(["sim", "--duration", "1"]) == 2
    assert one_line_naming(capsys.readouterr().err, "sim")


def test_bench_onnxruntime_without_onnx_names_the_onnx_extra(monkeypatch, capsys) -> None:
    hide(monkeypatch, "onnx", "onnxruntime")
    rc = exit_status(["bench", "--preset", "tiny", "--backend", "onnxruntime", "--iters", "1", "--warmup", "0"])
    assert rc == 2
    assert one_line_naming(capsys.readouterr().err, "onnx")


def test_check_config_onnxruntime_backend_without_onnxruntime_names_the_onnx_extra(monkeypatch, capsys,
                                                                                    tmp_path) -> None:
    hide(monkeypatch, "onnx", "onnxruntime")
    config = tmp_path / "robot.toml"
    config.write_text('[cameras.top]\nsource = "synthetic"\n\n[model]\nbackend = "onnxruntime"\n')
    assert exit_status(["run", "--check-config", str(config)]) == 2
    assert "pip install 'phyai-edge[onnx]'" in capsys.readouterr().err


def test_serve_ray_without_ray_says_which_extra_in_one_line(monkeypatch, capsys) -> None:
    hide(monkeypatch, "ray")
    rc = exit_status(["serve", "--ray", "--duration", "1"])
    assert rc == 2
    assert one_line_naming(capsys.readouterr().err, "ray")


def test_eval_lerobot_without_pyarrow_names_the_lerobot_extra(monkeypatch, capsys, tmp_path) -> None:
    hide(monkeypatch, "pyarrow")
    (tmp_path / "ds" / "meta").mkdir(parents=True)
    (tmp_path / "ds" / "meta" / "info.json").write_text("{}")
    rc = exit_status(["eval", str(tmp_path / "ds"), "--lerobot", "--preset", "tiny"])
    assert rc == 2
    assert one_line_naming(capsys.readouterr().err, "lerobot")


def test_the_extras_table_names_only_extras_the_package_declares() -> None:
    """A hint naming an extra pyproject.toml lacks would send the user to a pip error."""
    from test_packaging import PYPROJECT

    from phyai_edge.extras import BACKEND_NEEDS, EXTRA_OF, backend_install_hint, with_install_hint

    declared = set(PYPROJECT["project"]["optional-dependencies"])
    assert set(EXTRA_OF.values()) <= declared
    assert {m for needs in BACKEND_NEEDS.values() for m in needs} <= set(EXTRA_OF)
    assert backend_install_hint("tensorrt") == "pip install 'phyai-edge[tensorrt]'"
    # The hint follows a chain of causes, and is not said twice.
    try:
        try:
            raise ModuleNotFoundError("No module named 'onnx'", name="onnx")
        except ImportError as exc:
            raise RuntimeError("loading the bundle failed") from exc
    except RuntimeError as outer:
        assert with_install_hint(outer) == "loading the bundle failed (pip install 'phyai-edge[onnx]')"
    said = ImportError("needs ray: pip install 'phyai-edge[ray]'", name="ray")
    assert with_install_hint(said) == str(said)
    assert with_install_hint(ImportError("no module", name="not_an_extra")) == "no module"
