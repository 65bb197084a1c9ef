"""What an install carries beyond the code: the console scripts of ``[project.scripts]`` and the PEP 561
``py.typed`` markers.

The scripts are checked the way pip's wrapper runs them, ``sys.exit(main())`` with the arguments in
``sys.argv``, in this process: the editable install of a checkout may point elsewhere, so its
installed metadata is not what this checkout declares. The wheel test builds this checkout (a copy,
so no ``build/`` is left here) with setuptools' own PEP 517 backend and reads what the wheel holds.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO_DPATH = Path(__file__).resolve().parents[1]
SCRIPTS = {"sae-pipeline": "sae_pipeline.__main__:main", "sae-extract": "feature_extraction.__main__:main"}
PACKAGES = ("sae_pipeline", "feature_extraction")


def declared_scripts() -> dict[str, str]:
    return tomllib.loads((REPO_DPATH / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]


def entry_point(target: str) -> Callable[[], object]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def run_as_console_script(name: str, *args: str, monkeypatch: pytest.MonkeyPatch) -> int:
    """The exit status of ``sys.exit(main())`` with ``sys.argv = [name, *args]``, as the installed script."""
    monkeypatch.setattr(sys, "argv", [name, *args])
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)  # sae_pipeline's main sets its own
    try:
        sys.exit(entry_point(declared_scripts()[name])())
    except SystemExit as stop:
        code = stop.code
    return 0 if code is None else code if isinstance(code, int) else 1


def test_pyproject_declares_both_console_scripts() -> None:
    assert declared_scripts() == SCRIPTS


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_console_script_help_exits_0(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_as_console_script(name, "--help", monkeypatch=monkeypatch) == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize(("name", "args"), [("sae-pipeline", ["trian"]), ("sae-extract", ["--no_such_flag", "1"])])
def test_console_script_bad_input_exits_2_with_one_error_line(
    name: str, args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_as_console_script(name, *args, monkeypatch=monkeypatch) == 2  # main's int reaches the exit status
    err = capsys.readouterr().err
    assert err.startswith("error: ") and args[0] in err


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_has_a_py_typed_marker_declared_as_package_data(package: str) -> None:
    assert (REPO_DPATH / package / "py.typed").is_file()
    package_data = tomllib.loads((REPO_DPATH / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data.get(package, [])


def test_the_wheel_holds_the_markers_and_the_console_scripts(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_DPATH / name, source / name)
    for package in PACKAGES:
        shutil.copytree(REPO_DPATH / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path / "dist")], cwd=source, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with zipfile.ZipFile(tmp_path / "dist" / done.stdout.strip().splitlines()[-1]) as wheel:
        names = wheel.namelist()
        entry_points = next(wheel.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    for package in PACKAGES:
        assert f"{package}/py.typed" in names
    scripts = entry_points.split("[console_scripts]", 1)[1].split("\n[", 1)[0]
    assert {
        line.split("=")[0].strip(): line.split("=")[1].strip() for line in scripts.splitlines() if "=" in line
    } == SCRIPTS
