"""Output directories given on the command line (`--out`): checked before any work, in one line.

Why a check up front: a long extraction or study that reaches its first write and only then
finds that `--out` is a file or read-only wastes the compute and ends in `[Errno 17] File
exists` or a traceback. `prepare_output_dir` creates the directory (and its parents) and
writes and removes a probe file, so every way of being unwritable (permissions, a read-only
mount, a path through a file) is found before anything runs. Used by the extraction,
`evaluate` and `export`; the training CLI checks its run folder, `--checkpoint.dirpath` and
`--codes.fpath` with `dir_problem`, `check_writable_dir` and `check_writable_file`, which create
nothing (Lightning creates the folders later). Writing the files themselves is `atomic_files`';
one writer at a time, `output_lock`'s.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

__all__ = ["check_output_path", "check_writable_dir", "check_writable_file", "dir_problem", "prepare_output_dir"]


def _reason(exn: OSError) -> str:
    if exn.errno == errno.EROFS:
        return "the file system is read-only"
    if exn.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exn.errno == errno.ENOSPC:
        return "no space left on the device"
    return exn.strerror or type(exn).__name__


def check_output_path(path: str | os.PathLike, flag: str = "--out") -> Path:
    """The checks of ``prepare_output_dir`` that leave nothing behind, for commands that must create
    nothing before their other input is validated: not a directory, under a file, or the nearest
    existing directory not writable (a temporary file is opened there and removed at once)."""
    dpath = Path(path).expanduser()
    if dpath.exists() and not dpath.is_dir():
        raise ValueError(
            f"{flag} {dpath}: is a file, not a directory; pass a directory path (created if missing) "
            "or move the file away"
        )
    for existing in (dpath, *dpath.parents):
        if existing.exists():
            if not existing.is_dir():
                raise ValueError(f"{flag} {dpath}: {existing} is a file, not a directory; choose another path")
            try:  # a probe that leaves nothing behind: os.access says yes to root on a read-only tree
                with tempfile.TemporaryFile(dir=existing, prefix=".write-test-"):
                    pass
            except OSError as exn:
                raise ValueError(
                    f"{flag} {dpath}: {existing} is not writable ({_reason(exn)}); choose a "
                    "writable location or fix its permissions"
                ) from None
            break
    return dpath


def prepare_output_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Create ``path`` (parents too) and check that files can be written in it; returns it.

    Raises a one-line ValueError naming ``flag``, the path and the fix when it is a file,
    lies under a file, or cannot be created or written.
    """
    dpath = Path(path).expanduser()
    if dpath.exists() and not dpath.is_dir():
        raise ValueError(
            f"{flag} {dpath}: is a file, not a directory; pass a directory path (created if missing) "
            "or move the file away"
        )
    for parent in dpath.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {dpath}: {parent} is a file, not a directory; choose another path")
            break
    try:
        dpath.mkdir(parents=True, exist_ok=True)
    except OSError as exn:
        raise ValueError(
            f"{flag} {dpath}: cannot create the directory ({_reason(exn)}); choose a writable location"
        ) from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=dpath)
    except OSError as exn:
        raise ValueError(
            f"{flag} {dpath}: cannot write into the directory ({_reason(exn)}); "
            "choose a writable location or fix its permissions"
        ) from None
    os.close(fd)
    os.unlink(probe)
    return dpath


def dir_problem(dpath: Path) -> str | None:
    """Why ``dpath`` cannot be (created as) a writable directory, or None; creates nothing.

    A probe file is made and removed in the nearest existing folder: ``os.access`` says yes
    to root on a read-only tree.
    """
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
