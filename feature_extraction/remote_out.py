"""Shards into an object store: `python -m feature_extraction --out s3://bucket/prefix`.

Why stage locally and upload whole: the shard writers stream a tar, hashing it on the way, and
rename it into place; an object store has no rename and no append. So with a URL `--out` the
unchanged local extraction writes into a staging folder (`--stage DIR`; default
`<system temp>/sae-pipeline-stage-<12 hex of the URL's sha256>`, shared by the tasks of one
node), and each shard is uploaded as soon as its writer reports it complete: `skipped-N.json`
if any, then the tar, then its sidecar. An object appears whole or not at all (one PUT, or a
multipart upload that shows nothing until it completes), and the sidecar goes last, so "tar and
sidecar exist, sizes agree" (`shard_is_complete`) marks a whole shard in the bucket exactly as
on a disk. `manifest.json` is the last object written (`finalize`), so a reader never sees a
half-written set; `extraction.json` is created first by a conditional PUT, as locally, so every
task and rerun compares its settings before it writes a shard.

- Uploads run in `UPLOAD_THREADS` background threads of the main process (network I/O releases
  the GIL; the GPU loop does not wait for them) fed by a queue of at most `QUEUE_DEPTH` shards;
  when the store is slower than the GPU the queue fills and the extraction waits, so the stage
  never grows past the shards being written (`--num_writers`), waiting and uploading: about
  `num_writers + QUEUE_DEPTH + UPLOAD_THREADS` shards (~5 GB for a ViT-B at `--shard_size 1000`).
  An uploaded tar is deleted from the stage; its sidecar (a few KB) stays until the task's uploads have
  all succeeded, when the task deletes what it staged and, unless another task of the host still uses
  it, the folder (`stage_lease.py`). A stage whose disk fills up ends the command with one line naming
  the stage, what the bucket keeps and the room a stage needs, exit 2 (`StageSpace`): not the full-disk
  line of a local `--out`, which would say the shards are kept in the folder.
- Resume (a rerun after Ctrl-C, SIGTERM or kill -9): the prefix is listed once; a shard whose
  sidecar and tar objects exist with the sidecar's size is done and not downloaded again; a
  staged shard that is complete and intact but not uploaded is uploaded, not recomputed; every
  other shard is extracted again, after its stale sidecar and skipped list are deleted (a tar
  without its sidecar is a shard killed between its two uploads). Shards in the bucket are not
  re-read at resume: every reader checks each sample against its sidecar, and
  `finalize --verify true` reads them all.
- One writer per task: the lock is an object (`PREFIX/.lock.K-of-N`, `output_lock`).
- Several tasks (a SLURM array) each stage and upload their own shards; the task that finds every
  shard's tar and sidecar in the prefix after its own uploads writes the manifest
  (`finalize_if_last`, under a lock object).
- Nothing secret is written: the URL carries no credentials (`store.location` refuses them) and
  the records hold what a local extraction's hold.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

from feature_extraction import stop_flag
from feature_extraction.atomic_files import DiskFullError, free_bytes
from feature_extraction.shards import shard_is_complete, shard_is_intact
from feature_extraction.shards.finalize import check_or_create_record
from feature_extraction.shards.layout import shard_fname, sidecar_fname, skipped_fname
from feature_extraction.store import RemotePath

__all__ = [
    "QUEUE_DEPTH",
    "UPLOAD_THREADS",
    "ShardUploader",
    "StageFull",
    "StageSpace",
    "default_stage",
    "prepare_stage",
    "resume_plan",
]

logger = logging.getLogger(__name__)

UPLOAD_THREADS = 4  # shards uploaded at once (each a multipart upload of parallel parts)
QUEUE_DEPTH = 4  # complete shards waiting for an upload thread before the extraction waits
STAGE_PREFIX = "sae-pipeline-stage-"
ABORT_WAIT_S = 3.0  # on an interruption, how long the uploads in flight may finish (a stop ends within 5 s)


def default_stage(target: RemotePath) -> Path:
    """The staging folder of `target` when `--stage` is not given: the same for every task and rerun on a host."""
    return Path(tempfile.gettempdir()) / (STAGE_PREFIX + hashlib.sha256(target.url.encode()).hexdigest()[:12])


def prepare_stage(stage_dpath: Path, record: dict) -> None:
    """Give the stage this extraction's record; a stage holding another extraction's shards is refused."""
    try:
        check_or_create_record(stage_dpath, record)
    except ValueError:
        raise ValueError(
            f"--stage {stage_dpath} holds the staged shards of another extraction; delete that folder (a staging "
            "copy: its shards are in their bucket or redone by a rerun) or pass another --stage"
        ) from None


class StageFull(ValueError):
    """The disk of `--stage` filled up: the shards are safe in the bucket, and the fix is another `--stage` or
    room on its disk; one line, exit 2, as for a flag that cannot work (`StageSpace`)."""


class StageSpace:
    """Around the extraction into the stage: a full disk there ends the command with `StageFull`'s line (what was
    being written, what is kept in the bucket, the room the stage needs) instead of the full-disk line of a local
    `--out`, whose shards would be kept in the folder (`raise_if_full` raises it after the block, so that it is
    not chained to the disk's error)."""

    def __init__(self, stage_dpath: Path, target: RemotePath, num_writers: int) -> None:
        self.stage, self.target, self.num_writers = stage_dpath, target, num_writers
        self.full: StageFull | None = None

    def __enter__(self) -> StageSpace:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, tb: TracebackType | None) -> bool:
        path = Path(str(getattr(error, "path", ""))) if isinstance(error, DiskFullError) else None
        if path is None or not path.is_relative_to(self.stage):
            return False
        try:
            free = f" ({free_bytes(self.stage) / 2**20:.1f} MiB free)"
        except OSError:
            free = ""
        shards = self.num_writers + QUEUE_DEPTH + UPLOAD_THREADS
        self.full = StageFull(
            f"--stage {self.stage} is full{free}: no space left on device writing {path}; kept: the shards uploaded "
            f"to {self.target} and the complete ones staged (a rerun skips or uploads them; the partial shard was "
            f"removed); pass --stage DIR on a disk with room for about {shards} shards (--num_writers + "
            f"{QUEUE_DEPTH + UPLOAD_THREADS}), or free space there, and rerun the same command"
        )
        return True  # raised by raise_if_full, outside this exception's handling

    def raise_if_full(self) -> None:
        if self.full is not None:
            raise self.full


def resume_plan(target: RemotePath, stage_dpath: Path, owned: Iterable[int]) -> tuple[list[int], list[int], list[int]]:
    """`(in the bucket, staged but not uploaded, to extract)` of the shards `owned` (module docstring)."""
    owned = list(owned)
    target.refresh()
    names = {p.name for p in target.iterdir()}
    listed = [i for i in owned if shard_fname(i) in names and sidecar_fname(i) in names]
    with ThreadPoolExecutor(16) as pool:  # one small GET per sidecar
        try:
            whole = {i for i, ok in zip(listed, pool.map(lambda i: shard_is_complete(target, i), listed)) if ok}
        except BaseException:  # a stop: the GETs not started are dropped, not each made and waited for
            pool.shutdown(cancel_futures=True)
            raise
    for i in whole:  # uploaded, then killed before its staged copy was deleted
        (stage_dpath / shard_fname(i)).unlink(missing_ok=True)
    rest = [i for i in owned if i not in whole]
    stale = [name for i in rest for name in (sidecar_fname(i), skipped_fname(i)) if name in names]
    for name in stale:  # a stale sidecar must not vouch for the tar uploaded next
        (target / name).unlink(missing_ok=True)
    staged = [i for i in rest if shard_is_complete(stage_dpath, i) and shard_is_intact(stage_dpath, i)]
    todo = [i for i in rest if i not in staged]
    logger.info(
        "%s: %d of %d owned shards already there, %d staged here to upload (%s), %d to extract",
        target,
        len(whole),
        len(owned),
        len(staged),
        stage_dpath,
        len(todo),
    )
    return sorted(whole), staged, todo


class ShardUploader:
    """Background uploads of complete staged shards: `skipped-N.json`, the tar, then the sidecar.

    `submit(index)` queues a shard (waiting while `QUEUE_DEPTH` wait already) and raises the first
    upload error; `close()` waits for every upload; `abort()` drops the queue. As a context manager:
    `close` on success, `abort` on an exception. The threads start at the first `submit` or at
    `close`, after the shard writers have forked. Those waits, and an upload's retries, end on a
    stop (`stop_flag`): a store that has died holds no SIGTERM up.
    """

    def __init__(self, stage_dpath: Path, target: RemotePath, staged: Iterable[int] = ()) -> None:
        self.stage = stage_dpath
        self.target = target
        self.pending: deque[int] = deque(staged)  # staged shards of an earlier run go first
        self.cond = threading.Condition()
        self.threads: list[threading.Thread] = []
        self.closing = self.stopped = False
        self.error: BaseException | None = None
        self.uploaded: list[int] = []

    def __enter__(self) -> ShardUploader:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None):
        if kind is None:
            self.close()
        else:
            self.abort()

    def submit(self, index: int) -> None:
        with self.cond:
            self._start()
            stop_flag.wait_for(self.cond, lambda: len(self.pending) < QUEUE_DEPTH or self.error is not None, "uploads")
            self._raise()
            self.pending.append(index)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            if self.pending:
                self._start()
            self.closing = True
            self.cond.notify_all()
        for thread in self.threads:
            stop_flag.join(thread, where="uploads")  # an upload retrying a dead store ends on a stop
        self._raise()

    def abort(self) -> None:
        with self.cond:
            self.stopped = True
            self.pending.clear()
            self.cond.notify_all()
        for thread in self.threads:  # a PUT cut short leaves no object; let the ones in flight land if quick
            thread.join(timeout=ABORT_WAIT_S / len(self.threads))

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _start(self) -> None:
        if not self.threads:
            self.threads = [
                threading.Thread(target=self._run, name=f"shard-upload-{n}", daemon=True) for n in range(UPLOAD_THREADS)
            ]
            for thread in self.threads:
                thread.start()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.pending and not self.closing and not self.stopped:
                    self.cond.wait()
                if self.stopped or not self.pending:
                    return
                index = self.pending.popleft()
                self.cond.notify_all()
            try:
                self._upload(index)
            except BaseException as exn:  # noqa: BLE001 (raised in the main thread by submit or close)
                with self.cond:
                    self.error = self.error or exn
                    self.stopped = True
                    self.cond.notify_all()
                return
            with self.cond:
                self.uploaded.append(index)

    def _upload(self, index: int) -> None:
        tar, sidecar, skipped = (self.stage / name(index) for name in (shard_fname, sidecar_fname, skipped_fname))
        if skipped.is_file():  # before the sidecar: a complete shard always has its list
            (self.target / skipped.name).upload(skipped)
        (self.target / tar.name).upload(tar)
        (self.target / sidecar.name).write_bytes(sidecar.read_bytes())  # last: the shard is complete in the bucket
        tar.unlink()  # the stage stays small; the sidecar stays as the record of what was uploaded
        logger.debug("shard %d uploaded to %s", index, self.target)
