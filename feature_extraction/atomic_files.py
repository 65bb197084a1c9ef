"""Files that are either whole or absent: a kill at any moment never leaves a half-written one.

Shards, sidecars, manifests and checkpoints are all written to a temporary name, fsynced, and
renamed into place, and the rename itself is made durable by syncing the folder.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


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


def write_json_atomic(fpath: Path, obj: Any, exclusive: bool = False) -> bool:
    """Write JSON through a private temporary file; `exclusive`: only if `fpath` does not exist yet.

    `exclusive` is for files that several tasks race to create (`extraction.json`): its
    temporary name is unique per host, process and thread, so racers never write into each
    other's file. Returns False when it lost the race (the existing file is left as it is).
    Otherwise the file has one writer and the temporary name is fixed (`NAME.tmp`), so a
    rerun after a kill overwrites what the killed run left instead of adding to it.
    """
    if exclusive:
        tmp_fpath = fpath.with_name(f".{fpath.name}.{os.uname().nodename}.{os.getpid()}.{threading.get_ident()}.tmp")
    else:
        tmp_fpath = fpath.with_name(fpath.name + ".tmp")
    try:
        with open(tmp_fpath, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            try:
                os.link(tmp_fpath, fpath)  # atomic create-if-absent, also on NFS
            except FileExistsError:
                return False
        else:
            os.replace(tmp_fpath, fpath)
    finally:
        tmp_fpath.unlink(missing_ok=True)
    fsync_dir(fpath.parent)
    return True
