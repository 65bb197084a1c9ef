"""How long an extraction's staging folder lives (`--out s3://...`): held while a task uses it, removed after.

Why a lease: the default stage is shared by the tasks of one host (`remote_out.default_stage`), so a task
that has finished must not remove it under a task that is starting or still writing there. Every task
holds a shared `flock` on `STAGE/.stage.lease` from before it writes anything there until it ends. Once
its uploads have all succeeded, it deletes what it staged (its shards' sidecars and skipped lists: each
tar went when it was uploaded) and, when it can take the lease exclusively (no other task holds it) and
nothing else is staged, it deletes the record and the lease and removes the folder, which it never does
recursively: a `--stage` folder holding anything else stays. A task that stops (Ctrl-C, SIGTERM, an
error, `kill -9`) keeps its stage for its rerun, which uploads what is staged and removes the folder once
it succeeds. A lock that `flock` cannot take (a file system without it) keeps the folder, as before.

A task that finds the lease file replaced while it waited for it (the last holder removed the folder)
starts again on the new folder, so a task never stages into a folder that is being removed.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from feature_extraction.shards.layout import EXTRACTION_FNAME, shard_fname, sidecar_fname, skipped_fname

__all__ = ["LEASE_FNAME", "StageLease"]

logger = logging.getLogger(__name__)

LEASE_FNAME = ".stage.lease"


class StageLease:
    """A task's hold on a staging folder (module docstring): `acquire`, then `release` or `finish`; as a context
    manager, held while the block runs."""

    def __init__(self, stage_dpath: Path) -> None:
        self.stage = Path(stage_dpath)
        self.fd: int | None = None

    def acquire(self) -> StageLease:
        """Create the folder if needed and hold it (shared with the other tasks of this host)."""
        lease = self.stage / LEASE_FNAME
        while True:
            self.stage.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(lease, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:  # removed between the mkdir and the open: start again
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            except OSError as exn:  # no flock here: the folder is never removed
                logger.debug("%s: no lock (%s); the stage will be kept", lease, exn)
                os.close(fd)
                return self
            try:
                if os.stat(lease).st_ino == os.fstat(fd).st_ino:
                    self.fd = fd
                    return self
            except FileNotFoundError:
                pass
            os.close(fd)  # the folder's last holder removed it while this task waited: a new one is made

    def __enter__(self) -> StageLease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Stop holding the folder (it is kept: a stopped task's shards wait there for its rerun)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def finish(self, owned: Iterable[int]) -> bool:
        """After a successful upload: delete this task's staged files, then the folder if no other task holds
        it and nothing else is staged there; True when the folder is gone."""
        for index in owned:
            for name in (shard_fname(index), sidecar_fname(index), skipped_fname(index)):
                (self.stage / name).unlink(missing_ok=True)
        if self.fd is None:
            return False
        try:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # another task holds it (or starts to)
                return False
            if any(p.name not in (EXTRACTION_FNAME, LEASE_FNAME) for p in self.stage.iterdir()):
                return False  # another task's staged shards (or a user's files in --stage): kept
            (self.stage / EXTRACTION_FNAME).unlink(missing_ok=True)
            (self.stage / LEASE_FNAME).unlink()  # a task waiting on it sees a new lease file and starts again
            self.stage.rmdir()
            logger.info("%s: staging folder removed (every staged shard is in the bucket)", self.stage)
            return True
        except OSError as exn:
            logger.debug("%s: staging folder kept (%s)", self.stage, exn)
            return False
        finally:
            self.release()
