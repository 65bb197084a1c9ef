"""Files that are either whole or absent: a kill at any moment never leaves a half-written one.

The one way the product writes a file that something else will read (shards, sidecars,
manifests, token caches, codes, checkpoints, exports, study records): the bytes go to a
temporary name in the same folder, are fsynced, and the temporary file is renamed over the
target; the rename is made durable by syncing the folder. An exception on the way removes
the temporary file and leaves the previous file, if any, as it was.

- ``atomic_path``: for writers that want a path (h5py, safetensors, ``torch.save``, tar
  streams): write the yielded temporary path; it is renamed into place when the block ends
  without an exception. Nest two to replace two files together (the inner one is renamed first).
- ``write_text_atomic`` / ``write_json_atomic``: the common case in one call.

The temporary name is ``NAME.tmp`` by default: a file has one writer, so a rerun after a
kill overwrites what the killed run left instead of adding to it. Callers whose readers
must not see the temporary file (checkpoints: ``.NAME.partial``) or whose writers may race
(``exclusive``) pass their own.
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["atomic_path", "fsync_dir", "fsync_file", "write_json_atomic", "write_text_atomic"]

TMP_SUFFIX = ".tmp"


def fsync_dir(dpath: Path) -> None:
    """Make a rename inside ``dpath`` durable (a crash right after it must not bring back the old file)."""
    try:
        fd = os.open(dpath, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(fpath: Path) -> None:
    """Flush a file that another library wrote and closed (h5py, safetensors) to the disk."""
    with open(fpath, "rb") as f:
        os.fsync(f.fileno())


@contextmanager
def atomic_path(fpath: Path | str, tmp_fpath: Path | str | None = None) -> Iterator[Path]:
    """Yield the temporary path to write ``fpath`` through (``NAME.tmp`` unless ``tmp_fpath``).

    When the block ends without an exception the temporary file is fsynced, renamed over
    ``fpath`` and the folder synced; on an exception (Ctrl-C included) it is removed and
    ``fpath`` is left as it was. The folder must exist.
    """
    fpath = Path(fpath)
    tmp = Path(tmp_fpath) if tmp_fpath is not None else fpath.with_name(fpath.name + TMP_SUFFIX)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, fpath)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(fpath.parent)


def write_text_atomic(fpath: Path | str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``fpath`` whole or not at all."""
    with atomic_path(fpath) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(fpath: Path, obj: Any, exclusive: bool = False) -> bool:
    """Write JSON (indent 1, no NaN) whole or not at all; ``exclusive``: only if ``fpath`` does not exist yet.

    ``exclusive`` is for files that several tasks race to create (``extraction.json``): its
    temporary name is unique per host, process and thread, so racers never write into each
    other's file, and the file is created with a hard link (atomic create-if-absent, also on
    NFS). Returns False when it lost the race (the existing file is left as it is).
    """
    text = json.dumps(obj, indent=1, allow_nan=False)
    if not exclusive:
        write_text_atomic(fpath, text)
        return True
    fpath = Path(fpath)
    tmp = fpath.with_name(f".{fpath.name}.{os.uname().nodename}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
    try:
        tmp.write_text(text, encoding="utf-8")
        fsync_file(tmp)
        try:
            os.link(tmp, fpath)
        except FileExistsError:
            return False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(fpath.parent)
    return True
