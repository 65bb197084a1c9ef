"""The documentation site builds with ``mkdocs build --strict``: a broken link, a missing anchor, a page
left out of the nav or an API reference that names a missing object fails the build (mkdocs.yml's
``validation``). ``make docs`` runs the same command."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from docs_text import REPO_DPATH
from system_tools import REQUIRE_ENV


def require_mkdocs() -> None:
    if all(importlib.util.find_spec(name) for name in ("mkdocs", "material", "mkdocstrings")):
        return
    message = 'needs mkdocs, mkdocs-material and mkdocstrings; install with: pip install -e ".[docs]"'
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{message} ({REQUIRE_ENV}=1: CI must not skip this)")
    pytest.skip(message)


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_site_builds_strict(tmp_path: Path) -> None:
    require_mkdocs()
    result = build(REPO_DPATH, tmp_path / "site")
    assert result.returncode == 0, result.stderr[-4000:]
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "load_sae" in api and "ActivationDataModule" in api and "MatchingPursuitSAE" in api  # from docstrings
    assert "Matching Pursuit" in (tmp_path / "site" / "variants" / "index.html").read_text(encoding="utf-8")
    assert (tmp_path / "site" / "figures" / "evaluate" / "mnist" / "babel.png").is_file()


@pytest.mark.slow
def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The same build on a copy whose page links to a missing page: strict mode must refuse it."""
    require_mkdocs()
    root = tmp_path / "clone"
    root.mkdir()
    for name in ("mkdocs.yml", "BENCHMARKS.md"):
        shutil.copy(REPO_DPATH / name, root / name)
    for name in ("sae_pipeline", "feature_extraction"):  # the API reference reads their docstrings
        (root / name).symlink_to(REPO_DPATH / name, target_is_directory=True)
    shutil.copytree(REPO_DPATH / "docs", root / "docs")
    with open(root / "docs" / "index.md", "a", encoding="utf-8") as page:
        page.write("\n[gone](no-such-page.md)\n")
    result = build(root, tmp_path / "site")
    assert result.returncode != 0 and "no-such-page.md" in result.stderr
