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

The file gets the mode a plain ``open()`` would give it (0666 less the user's umask), whatever
mode the writing library chose for its temporary file (safetensors: 0600). The temporary name is
``NAME.tmp`` by default: a file has one writer, so a rerun after a kill overwrites what the
killed run left instead of adding to it. Callers whose readers must not see the temporary file (checkpoints:
``.NAME.partial``) or whose writers may race (``exclusive``) pass their own.

A full disk (``ENOSPC``, or ``EDQUOT`` a full quota) is one error for every command:
:class:`DiskFullError` names the file being written and what was kept, the partial file is
removed, and the command prints ``error: no space left on device writing PATH; kept: ...; free
space and rerun the same command`` and exits 1 (``exit_status.run_command``, and
``python -m sae_pipeline`` for the Lightning commands). :func:`out_of_space` also recognises the
wrappings of that error by torch (a ``RuntimeError`` whose context is the ``OSError``) and HDF5
(``errno = 28`` in the message) and safetensors (``os error 28``). Writers whose errors do not
name their file (TensorBoard, matplotlib) run inside :func:`writing`. HDF5 cannot be told in time:
once a write fails, h5py may crash the interpreter, so HDF5 writers call :func:`check_free_space`
before each write instead.
"""

from __future__ import annotations

import errno
import json
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from feature_extraction.store import RemotePath

__all__ = [
    "DiskFullError",
    "atomic_path",
    "check_free_space",
    "disk_full_line",
    "free_bytes",
    "fsync_dir",
    "fsync_file",
    "out_of_space",
    "quiet_thread_disk_full",
    "write_json_atomic",
    "write_text_atomic",
    "writing",
]

TMP_SUFFIX = ".tmp"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # what open() gives a new file: the user's umask decides who may read
OUT_OF_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# torch's and HDF5's messages for a failed write: they keep errno only as text (or in __context__)
_OUT_OF_SPACE_TEXT = re.compile(
    r"No space left on device|Disk quota exceeded|(errno = |os error )(28|122)\b", re.IGNORECASE
)
# where the failed write went: HDF5's message, or our own line relayed by a parent process
_WRITTEN_TEXT = re.compile(r"filename = '([^']+)'|no space left on device writing (\S+?)(?: \(|;|$)")


class DiskFullError(OSError):
    """No space left on the device (or quota) while writing ``path``; ``kept`` says what is still there."""

    def __init__(self, path: Path | str | None, kept: str | None = None, detail: str = "") -> None:
        super().__init__(
            errno.ENOSPC,
            "No space left on device" + (f" ({detail})" if detail else ""),
            None if path is None else str(path),
        )
        self.path = None if path is None else Path(path)
        self.kept = kept
        self.detail = detail

    def __str__(self) -> str:
        return disk_full_message(self, self.kept)


def out_of_space(error: BaseException | None) -> bool:
    """Whether ``error`` (or one it was raised from or while handling) is a full disk or quota."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, DiskFullError):
            return True
        if isinstance(error, OSError) and error.errno in OUT_OF_SPACE_ERRNOS:
            return True
        if not isinstance(error, ValueError) and _OUT_OF_SPACE_TEXT.search(str(error)):  # also safetensors' error
            return True
        error = error.__cause__ or error.__context__
    return False


def _written_path(error: BaseException) -> str | None:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        path = getattr(error, "path", None) if isinstance(error, DiskFullError) else getattr(error, "filename", None)
        if path:
            return str(path)
        match = _WRITTEN_TEXT.search(str(error))
        if match:
            return match.group(1) or match.group(2)
        error = error.__cause__ or error.__context__
    return None


def disk_full_message(error: BaseException, kept: str | None = None) -> str:
    """``no space left on device writing PATH; kept: KEPT; free space and rerun the same command``."""
    path = _written_path(error)
    detail = getattr(error, "detail", "")
    kept = getattr(error, "kept", None) or kept or "the files written before this one"
    return (
        f"no space left on device writing {path or 'the output'}{f' ({detail})' if detail else ''}; "
        f"kept: {kept}; free space and rerun the same command"
    )


def disk_full_line(error: BaseException, kept: str | None = None) -> str | None:
    """The one ``error:`` line for a full disk (``kept``: the command's own words when the error has none),
    or None when ``error`` is something else."""
    return f"error: {disk_full_message(error, kept)}" if out_of_space(error) else None


@contextmanager
def writing(path: Path | str, kept: str | None = None) -> Iterator[None]:
    """Name ``path`` (a file or folder being written) in the :class:`DiskFullError` of a full disk inside the
    block, for writers whose own errors do not say where they were writing (TensorBoard, matplotlib)."""
    try:
        yield
    except Exception as exn:
        if out_of_space(exn) and not isinstance(exn, DiskFullError):
            raise DiskFullError(path, kept) from exn
        raise


def quiet_thread_disk_full(args: Any) -> None:
    """``threading.excepthook`` that leaves a full disk in a helper thread (TensorBoard's event writer) to the
    main thread, which meets the same error and prints the one line; other errors print as usual."""
    if not out_of_space(args.exc_value):
        threading.__excepthook__(args)


def free_bytes(dpath: Path | str) -> int:
    """Bytes an unprivileged writer may still use on ``dpath``'s file system."""
    stat = os.statvfs(dpath)
    return stat.f_bavail * stat.f_frsize


def check_free_space(fpath: Path | str, n_bytes: int, kept: str | None = None) -> None:
    """Raise `DiskFullError` for ``fpath`` unless ``n_bytes`` fit in its folder's file system (the nearest
    folder that exists: a writer checks before it creates any)."""
    fpath = Path(fpath)
    dpath = fpath.parent
    while not dpath.is_dir() and dpath != dpath.parent:
        dpath = dpath.parent
    free = free_bytes(dpath)
    if free < n_bytes:
        raise DiskFullError(fpath, kept, f"{free / 2**20:.1f} MiB free, {n_bytes / 2**20:.1f} MiB needed")


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
def atomic_path(fpath: Path | str, tmp_fpath: Path | str | None = None, kept: str | None = None) -> Iterator[Path]:
    """Yield the temporary path to write ``fpath`` through (``NAME.tmp`` unless ``tmp_fpath``).

    When the block ends without an exception the temporary file is fsynced, renamed over
    ``fpath`` and the folder synced; on an exception (Ctrl-C included) it is removed and
    ``fpath`` is left as it was. The folder must exist. A full disk becomes :class:`DiskFullError`
    naming ``fpath``; ``kept`` says what the caller keeps (default: the previous ``fpath``, if any).
    """
    fpath = Path(fpath)
    tmp = Path(tmp_fpath) if tmp_fpath is not None else fpath.with_name(fpath.name + TMP_SUFFIX)
    existed = fpath.exists()
    try:
        yield tmp
        with suppress(PermissionError):  # a file system without modes (vfat, some network mounts)
            os.chmod(tmp, FILE_MODE)  # some writers (safetensors) create their files 0600
        fsync_file(tmp)
        os.replace(tmp, fpath)
    except Exception as exn:
        if out_of_space(exn) and not isinstance(exn, DiskFullError):
            tmp.unlink(missing_ok=True)
            raise DiskFullError(fpath, kept or (f"the previous {fpath}, unchanged" if existed else None)) from exn
        raise
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(fpath.parent)


def write_text_atomic(fpath: Path | str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``fpath`` whole or not at all."""
    with atomic_path(fpath) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(fpath: Path | RemotePath, obj: Any, exclusive: bool = False) -> bool:
    """Write JSON (indent 1, no NaN) whole or not at all; ``exclusive``: only if ``fpath`` does not exist yet.

    An object in a store (``RemotePath``) is one PUT, whole by itself; ``exclusive`` is a conditional
    create there (``If-None-Match: *``).

    ``exclusive`` is for files that several tasks race to create (``extraction.json``): its
    temporary name is unique per host, process and thread, so racers never write into each
    other's file, and the file is created with a hard link (atomic create-if-absent, also on
    NFS). Returns False when it lost the race (the existing file is left as it is).
    """
    text = json.dumps(obj, indent=1, allow_nan=False)
    if isinstance(fpath, RemotePath):
        return fpath.write_bytes(text.encode("utf-8"), exclusive=exclusive)
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
