"""Check that an output path can be written before any work starts.

A read-only working directory or a file where a directory should be used to surface as a
traceback from deep inside Lightning or h5py, after the set-up. These checks run first and
raise a one-line ``ValueError`` naming the option to change; they leave nothing behind (a
probe file is made and removed in the nearest existing folder).
"""
from __future__ import annotations

import tempfile
from pathlib import Path


def dir_problem(dpath: Path) -> str | None:
    """Why ``dpath`` cannot be (created as) a writable directory, or None."""
    existing = dpath
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return "is a file" if existing == dpath else f"cannot be created: {existing} is a file"
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".write-probe-"):
            pass
    except OSError as exn:
        return f"cannot be written: {existing} is not writable ({exn.strerror or type(exn).__name__})"
    return None


def check_writable_dir(dpath: str | Path, option: str) -> None:
    """``dpath`` is, or can be created as, a writable directory; else a ``ValueError`` naming ``option``."""
    problem = dir_problem(Path(dpath))
    if problem:
        raise ValueError(f"{option} {dpath} {problem}; choose a writable directory for {option}")


def check_writable_file(fpath: str | Path, option: str) -> None:
    """``fpath`` can be written as a file: not a directory, its folder writable."""
    fpath = Path(fpath)
    if fpath.is_dir():
        raise ValueError(f"{option} {fpath} is a directory; give a file path, e.g. {fpath / 'codes.h5'}")
    problem = dir_problem(fpath.parent)
    if problem:
        raise ValueError(f"{option} {fpath}: its folder {fpath.parent} {problem}; choose another {option}")
