"""Tests that need a system program (SLURM, Chromium, buildah) skip without it, except in CI.

A plain clone must pass ``make test`` on a machine that has only python3, venv and make, so a
missing program skips the test with the command that installs it. ``.ci/run`` installs every
such program and sets ``SAE_PIPELINE_REQUIRE_SYSTEM_TOOLS=1``, which turns the skip into a
failure: CI can never skip them silently.
"""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_ENV = "SAE_PIPELINE_REQUIRE_SYSTEM_TOOLS"
SBIN_PATH = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"


def missing(executables: tuple[str, ...] | list[str]) -> list[str]:
    """The names in ``executables`` that are not on PATH (also looked up in /usr/sbin)."""
    return [name for name in executables if shutil.which(name, path=SBIN_PATH) is None]


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
