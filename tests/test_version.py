"""One version number: pyproject.toml's, read through the installed metadata, the same in both packages,
and still readable from an uninstalled checkout."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

import feature_extraction
import sae_pipeline
from feature_extraction import version

PYPROJECT_FPATH = Path(__file__).resolve().parents[1] / "pyproject.toml"


def pyproject_version() -> str:
    """The ``version = "..."`` line of the ``[project]`` table, read as plain text (not by the code under test)."""
    project = PYPROJECT_FPATH.read_text(encoding="utf-8").split("[project]", 1)[1].split("\n[", 1)[0]
    return re.search(r'^version\s*=\s*"([^"]+)"', project, re.MULTILINE).group(1)


def test_both_packages_carry_the_installed_version() -> None:
    assert version.DIST_NAME == re.search(r'^name\s*=\s*"([^"]+)"', PYPROJECT_FPATH.read_text(), re.MULTILINE).group(1)
    assert sae_pipeline.__version__ == feature_extraction.__version__ == metadata.version("sae-pipeline")
    assert sae_pipeline.__version__ == pyproject_version()


def test_uninstalled_checkout_reads_pyproject(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(version.metadata, "version", not_installed)
    assert version.read_version() == pyproject_version()
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "sae-pipeline"\nversion = "9.8.7"\n')
    assert version.read_version(pyproject_fpath=other) == "9.8.7"
    assert version.read_version(pyproject_fpath=tmp_path / "absent.toml") == version.UNKNOWN
    other.write_text("[project\n")  # not TOML
    assert version.read_version(pyproject_fpath=other) == version.UNKNOWN
