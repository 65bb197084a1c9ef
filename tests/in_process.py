"""``python -m sae_pipeline ARGS`` run in the test's own process, and the small fits the tests train that way.

One interpreter start for a whole test module (seconds saved per run) on the same code path as the
command: ``sae_pipeline.__main__.main``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from sae_pipeline.__main__ import main

REPO_DPATH = Path(__file__).resolve().parents[1]
# No progress bar, no model summary, no figures: a test's output holds the product's own lines.
QUIET = [
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
    "--figures.every_n_val_epochs",
    "1000",
]


def run(args: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``python -m sae_pipeline ARGS``; a ``SystemExit`` is its status."""
    try:
        status = main(list(args))
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    out, err = capsys.readouterr()
    return status, out, err


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def fit_in(cwd: Path, *args: str) -> None:
    """``python -m sae_pipeline fit ARGS`` (quiet) with ``cwd`` as the working directory, so its runs/ land there."""
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        assert main(["fit", *args, *QUIET]) == 0
    finally:
        os.chdir(previous)
