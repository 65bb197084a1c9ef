"""ruff's lint and format checks over the whole repository, with the settings in ``pyproject.toml`` ([tool.ruff]).

Run as a test so that CI fails on a violation; fix with ``ruff check --fix .`` and ``ruff format .``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_DPATH = Path(__file__).resolve().parents[1]


def ruff() -> list[str]:
    """The ruff of this environment (the dev extra pins it): its binary beside the interpreter, else on PATH."""
    beside = Path(sys.executable).with_name("ruff")
    found = str(beside) if beside.exists() else shutil.which("ruff")
    if found is None:
        pytest.fail('ruff is not installed: pip install -e ".[dev]"')
    return [found]


def run_ruff(*args: str, cwd: Path = REPO_DPATH) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ruff(), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_ruff_check_passes() -> None:
    result = run_ruff("check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_format_leaves_every_file_as_it_is() -> None:
    result = run_ruff("format", "--no-cache", "--check", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_the_checks_fail_on_a_violation(tmp_path: Path) -> None:
    """The same settings catch an unused import, a long line and unformatted code in a planted file."""
    (tmp_path / "pyproject.toml").write_text((REPO_DPATH / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text("import os\nx = {'a':1}\ny = '" + "z" * 130 + "'\n")
    check = run_ruff("check", "--no-cache", "--output-format", "concise", ".", cwd=tmp_path)
    assert check.returncode == 1
    assert {"F401", "E501"} <= {word for word in check.stdout.split() if word[:1].isupper() and word[1:].isdigit()}
    assert run_ruff("format", "--no-cache", "--check", ".", cwd=tmp_path).returncode == 1
