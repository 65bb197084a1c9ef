"""Output directories given on the command line (`--out`): checked before any work, in one line.

Why a check up front: a long extraction or study that reaches its first write and only then
finds that `--out` is a file or read-only wastes the compute and ends in `[Errno 17] File
exists` or a traceback. `prepare_output_dir` creates the directory (and its parents) and
writes and removes a probe file, so every way of being unwritable (permissions, a read-only
mount, a path through a file) is found before anything runs. Used by the extraction,
`evaluate` and `export`.
"""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

__all__ = ["check_output_path", "prepare_output_dir"]


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
        raise ValueError(f"{flag} {dpath}: is a file, not a directory; pass a directory path (created if missing) "
                         "or move the file away")
    for existing in (dpath, *dpath.parents):
        if existing.exists():
            if not existing.is_dir():
                raise ValueError(f"{flag} {dpath}: {existing} is a file, not a directory; choose another path")
            try:  # a probe that leaves nothing behind: os.access says yes to root on a read-only tree
                with tempfile.TemporaryFile(dir=existing, prefix=".write-test-"):
                    pass
            except OSError as exn:
                raise ValueError(f"{flag} {dpath}: {existing} is not writable ({_reason(exn)}); choose a "
                                 "writable location or fix its permissions") from None
            break
    return dpath


def prepare_output_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Create ``path`` (parents too) and check that files can be written in it; returns it.

    Raises a one-line ValueError naming ``flag``, the path and the fix when it is a file,
    lies under a file, or cannot be created or written.
    """
    dpath = Path(path).expanduser()
    if dpath.exists() and not dpath.is_dir():
        raise ValueError(f"{flag} {dpath}: is a file, not a directory; pass a directory path (created if missing) "
                         "or move the file away")
    for parent in dpath.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {dpath}: {parent} is a file, not a directory; choose another path")
            break
    try:
        dpath.mkdir(parents=True, exist_ok=True)
    except OSError as exn:
        raise ValueError(f"{flag} {dpath}: cannot create the directory ({_reason(exn)}); "
                         "choose a writable location") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=dpath)
    except OSError as exn:
        raise ValueError(f"{flag} {dpath}: cannot write into the directory ({_reason(exn)}); "
                         "choose a writable location or fix its permissions") from None
    os.close(fd)
    os.unlink(probe)
    return dpath
