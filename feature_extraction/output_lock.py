"""One writer per output: a lock file that lives with the output, so two processes never interleave.

Why: two extractions into one ``--out`` (or two ``features``, ``export``, ``evaluate`` runs on one
``--out``, or two ``fit --ckpt_path last`` of one run) would each write the same files and both
exit 0 with a mix of the two. `output_lock` is held around a command's write phase; the
second process is refused in one line naming the holder (bad input, exit 2):

    error: --out OUT is being written by pid N on host H since T (COMMAND); wait for it to finish,
    or delete LOCKFILE if that process is gone

- Where: ``OUT/.lock`` for folders written in place (shards, a study, a run, an export);
  ``PARENT/.OUT.lock`` beside a folder that is swapped in whole (the feature browser site), whose
  contents a lock inside would be swapped away with. A folder the lock had to create is removed
  again at release while still empty, so a refusal of bad input leaves nothing behind.
- How: ``open(O_CREAT | O_EXCL)``, then JSON ``{pid, host, started, command, slurm_job_id,
  slurm_restart_count, token}``. Released (deleted, if still ours) when the block ends, also on an
  error, Ctrl-C or SIGTERM (both raise through the block: ``exit_status`` and
  ``sae_pipeline.training.interrupts``). Only ``kill -9`` or a crashed node leave one behind, and a
  stop while the store holding a lock object does not answer (the stop does not wait out the
  store's retries: the rerun takes the object over).
- A lock left behind is taken over when its holder is surely gone: the same host and no process
  with its pid, or the same SLURM job at an earlier restart (a requeued job, maybe on another node).
  A holder on another host cannot be checked from here: the refusal names it and the manual fix.
  Takeovers go through a second lock (``LOCK.takeover``), so two starters never both remove it.
- Multi-process runs: only the launching process (rank 0) locks; the ranks Lightning, ``srun`` or
  torchrun start for the same run (``RANK``, ``LOCAL_RANK``, ``NODE_RANK``, ``SLURM_PROCID`` not 0)
  do not, so they never refuse each other. The extraction's tasks each write their own shards
  and lock their own part instead (``part=(task_index, num_tasks)``: ``OUT/.lock.K-of-N``); a live
  lock of another split (other N) of the same folder is refused too.
- Shared file systems: ``O_EXCL`` creation is atomic on NFSv3 and later (Linux clients) and on
  Lustre, GPFS and local disks; hosts must have distinct host names and a host's processes one pid
  namespace (containers that share a volume have their own host names, so they refuse each other
  rather than take over). The clock only dates the lock for the message.
- An output in an object store (``--out s3://bucket/prefix``, a ``RemotePath``): the lock is the
  object ``PREFIX/.lock`` (``.lock.K-of-N``), created by a conditional PUT (``If-None-Match: *``:
  atomic on S3 and SeaweedFS), holding the same record; the same refusal, release and takeover
  rules. An object has no mtime here, so a takeover lock's age is read from its ``started``.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from feature_extraction import stop_flag
from feature_extraction.atomic_files import DiskFullError, out_of_space
from feature_extraction.file_checks import COUNT, TEXT, Kind, check_fields, nullable, parse_json, terminal_text
from feature_extraction.output_dirs import dir_problem, prepare_output_dir
from feature_extraction.store import RemotePath, StoreError, location

__all__ = ["LOCK_FNAME", "OutputLocked", "is_launching_process", "lock_fpath", "output_lock"]

LOCK_FNAME = ".lock"
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")
MAX_LOCK_BYTES = 64 << 10  # a holder record is a few hundred bytes
# what a holder record must be (`_holder_record`) for its process to be checked
HOLDER_KINDS = {
    "pid": Kind(lambda v: COUNT.test(v) and 1 <= v < 1 << 31, "a process id (an integer in [1, 2^31))"),
    "host": TEXT,
    "started": TEXT,
    "command": TEXT,
    "slurm_job_id": nullable(TEXT),
    "slurm_restart_count": COUNT,
    "token": TEXT,
}
_TOO_LARGE = "\0too large"  # the key _read gives a file too large to be a lock
_OPTIONAL_HOLDER_FIELDS = ("started", "command", "slurm_job_id", "slurm_restart_count", "token")
UNREADABLE_STALE_S = 60.0  # a lock file still empty after this was left by a process killed while creating it
TAKEOVER_STALE_S = 30.0  # a takeover takes milliseconds; an older takeover lock was left by a killed process


class OutputLocked(ValueError):
    """Another process is writing the same output: bad input for this run (exit 2), the line names the holder."""


def is_launching_process(environ: dict[str, str] | None = None) -> bool:
    """Whether this process is rank 0 of its run, or alone: the process that holds a run's output lock."""
    env = os.environ if environ is None else environ
    return all(env.get(name, "0").strip() in ("", "0") for name in RANK_VARIABLES)


def _output(path: Path | RemotePath | str, what: str = "--out") -> Path | RemotePath:
    """``path`` as a local path (``~`` expanded) or, for a URL, the ``RemotePath`` of the prefix."""
    path = location(path, what)
    return path.expanduser() if isinstance(path, Path) else path


def lock_fpath(
    path: Path | RemotePath | str, beside: bool = False, part: tuple[int, int] | None = None
) -> Path | RemotePath:
    """The lock file of the output ``path`` (see the module docstring)."""
    path = _output(path)
    name = LOCK_FNAME + (f".{part[0]}-of-{part[1]}" if part is not None else "")
    return path.parent / f".{path.name}{name}" if beside else path / name


def _holder_record(command: str) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": command,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "token": uuid.uuid4().hex,
    }


def _read(fpath: Path | RemotePath) -> dict[str, Any] | None:
    """The holder written in ``fpath``; None when it is gone; ``{}`` when unreadable (being created, or garbled);
    parsed with bounds (`file_checks`), its fields checked by `_holder_problem`."""
    try:
        if isinstance(fpath, RemotePath):
            fpath.parent.refresh()  # another process may have created or removed it since this one listed
            if not fpath.is_file():
                return None
            if (size := fpath.stat().st_size) > MAX_LOCK_BYTES:
                return {_TOO_LARGE: size}  # not fetched
            try:
                text = fpath.read_bytes()
            except StoreError:
                fpath.parent.refresh()
                if fpath.is_file():
                    raise
                return None  # removed between the listing and the read
        else:
            with fpath.open("rb") as f:
                text = f.read(MAX_LOCK_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(text) > MAX_LOCK_BYTES:
        return {_TOO_LARGE: len(text)}  # no lock this program wrote: broken (_holder_problem)
    try:
        holder = parse_json(text, source=fpath, what="lock", fix="", max_depth=4)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _holder_problem(holder: dict[str, Any]) -> str | None:
    """Why ``holder`` (read from a lock file, not empty) is no record this program wrote; None when it is one.

    Such a lock names no process that can be checked, so it is neither a live holder nor taken over:
    the refusal names the file to delete (its text, escaped, only as the reason).
    """
    if _TOO_LARGE in holder:
        return f"over {MAX_LOCK_BYTES} bytes"
    try:
        check_fields(holder, HOLDER_KINDS, source="", what="", fix="", optional=_OPTIONAL_HOLDER_FIELDS)
    except ValueError as exn:
        return str(exn).strip(": ;")
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _age(fpath: Path | RemotePath, holder: dict[str, Any]) -> float:
    """Seconds since ``fpath`` was written: its mtime; for an object, its holder's ``started`` (inf: gone)."""
    if isinstance(fpath, RemotePath):
        try:
            started = datetime.strptime(str(holder.get("started")), "%Y-%m-%d %H:%M:%S UTC")
        except ValueError:
            return 0.0  # no readable date: never stale by age (the refusal names the object to delete)
        return time.time() - started.replace(tzinfo=timezone.utc).timestamp()
    try:
        return time.time() - fpath.stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def _gone(holder: dict[str, Any], fpath: Path | RemotePath) -> bool:
    """Whether the holder of ``fpath`` is surely not running any more."""
    if not holder:  # created and never written: its creator was killed in that instant, or is writing it now
        # (an object is created whole: an unreadable one was garbled by hand, and is not taken over)
        return not isinstance(fpath, RemotePath) and _age(fpath, holder) > UNREADABLE_STALE_S
    if _holder_problem(holder):
        return False  # broken: refused, naming the file to delete (_refusal)
    job = os.environ.get("SLURM_JOB_ID")
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if job and holder.get("slurm_job_id") == job and int(holder.get("slurm_restart_count") or 0) < restarts:
        return True  # an earlier run of this requeued job: SLURM ended it before starting this one
    if holder.get("host") != socket.gethostname():
        return False
    pid = holder.get("pid")
    return isinstance(pid, int) and pid != os.getpid() and not _pid_alive(pid)


def _create(fpath: Path | RemotePath, record: dict[str, Any]) -> bool:
    """Create ``fpath`` holding ``record`` if it does not exist; False when it does."""
    if isinstance(fpath, RemotePath):
        return fpath.write_bytes(json.dumps(record).encode("utf-8"), exclusive=True)
    try:
        fd = os.open(fpath, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps(record).encode("utf-8"))
        os.fsync(fd)
    except BaseException:
        fpath.unlink(missing_ok=True)  # never leave a lock that names no holder
        raise
    finally:
        os.close(fd)
    return True


def _take_over(fpath: Path | RemotePath, stale: dict[str, Any]) -> None:
    """Remove ``fpath`` if it still holds ``stale``; one taker at a time (the takeover lock), so a taker never
    removes the lock that another starter created after the stale one was removed."""
    guard = fpath.with_name(fpath.name + ".takeover")
    if not _create(guard, _holder_record("takeover")):
        guard_holder = _read(guard)
        if guard_holder is not None and (_gone(guard_holder, guard) or _age(guard, guard_holder) > TAKEOVER_STALE_S):
            guard.unlink(missing_ok=True)
        return  # the caller tries again
    try:
        if _read(fpath) == stale:
            fpath.unlink(missing_ok=True)
    finally:
        guard.unlink(missing_ok=True)


def _refusal(what: str, path: Path | RemotePath, fpath: Path | RemotePath, holder: dict[str, Any]) -> OutputLocked:
    if not holder:
        return OutputLocked(
            f"{what} {path} is locked by {fpath}, which another process is creating now; wait a minute and "
            f"rerun, or delete {fpath} if no other process writes {path}"
        )
    problem = _holder_problem(holder)
    if problem:
        return OutputLocked(
            f"{what} {path} is locked by {fpath}, which is broken ({problem}): no lock this program wrote, so "
            f"whose it is cannot be checked; delete {fpath} if no other process writes {path}"
        )
    where = f"pid {holder['pid']} on host {terminal_text(holder['host'], 100)}"
    if holder.get("host") != socket.gethostname():
        where += " (another host: whether it still runs cannot be checked from here)"
    started, command = (terminal_text(holder.get(k), 100) for k in ("started", "command"))
    return OutputLocked(
        f"{what} {path} is being written by {where} since {started} ({command}); "
        f"wait for it to finish, or delete {fpath} if that process is gone"
    )


def _clashing_split(fpath: Path | RemotePath, part: tuple[int, int]) -> tuple[Path | RemotePath, dict[str, Any]] | None:
    """A live lock of the same folder by a task of another split (other ``num_tasks``): its shards overlap ours."""
    if isinstance(fpath, RemotePath):
        fpath.parent.refresh()
    for other in sorted(fpath.parent.glob(f"{LOCK_FNAME}.*-of-*")):
        if other == fpath or other.name.endswith(f"-of-{part[1]}") or other.name.endswith(".takeover"):
            continue
        holder = _read(other)
        if holder is not None and not _gone(holder, other):
            return other, holder
    return None


@contextmanager
def output_lock(
    path: Path | RemotePath | str,
    command: str,
    *,
    what: str = "--out",
    beside: bool = False,
    part: tuple[int, int] | None = None,
) -> Iterator[Path | RemotePath | None]:
    """Hold the lock of the output folder ``path`` for the block; yields the lock file (None on ranks > 0).

    ``command`` names the holder's command in the refusal (never its arguments: they are not ours to
    print); ``what`` names the output (``--out``, ``the run``); ``beside``: the lock goes next to
    ``path`` (outputs swapped in whole); ``part``: ``(task_index, num_tasks)`` of an extraction task,
    which locks on every rank; a URL (``RemotePath``) locks with an object (module docstring). Raises
    `OutputLocked` when another live process holds it.
    """
    path = _output(path, what)
    if part is None and not is_launching_process():
        yield None
        return
    fpath = lock_fpath(path, beside, part)
    remote = isinstance(path, RemotePath)
    # removed again if left empty (a prefix in a store is no folder: nothing to create or remove)
    created = [] if remote else [p for p in (fpath.parent, *fpath.parent.parents) if not p.exists()]
    if remote:
        pass  # an unknown bucket or refused credentials: the store's one line, from the first request
    elif not beside:  # a file in the way, or not writable: the one line of output_dirs
        prepare_output_dir(path, what)
    else:
        problem = dir_problem(path.parent)
        if problem:  # the one line the site's own check gives
            raise ValueError(
                f"{what} {path}: its folder {path.parent} {problem}; choose a writable location for {what}"
            )
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exn:
            raise OutputLocked(
                f"{what} {path}: cannot create {path.parent} for its lock file ({exn.strerror or exn}); "
                "choose a writable location"
            ) from None
    record = _holder_record(command)
    try:
        for _ in range(5):
            try:
                if _create(fpath, record):
                    break
            except OSError as exn:
                if out_of_space(exn):
                    raise DiskFullError(fpath) from exn  # the command says what it kept
                raise OutputLocked(
                    f"{what} {path}: cannot create its lock file {fpath} ({exn.strerror or exn}); choose a "
                    "writable location or fix its permissions"
                ) from None
            holder = _read(fpath)
            if holder is None:
                continue  # released meanwhile
            if not _gone(holder, fpath):
                raise _refusal(what, path, fpath, holder)
            _take_over(fpath, holder)
            stop_flag.sleep(0.05)
        else:
            holder = _read(fpath) or {}
            raise _refusal(what, path, fpath, holder)
    except BaseException:
        _remove_created(created)
        raise
    try:
        if part is not None:
            clash = _clashing_split(fpath, part)
            if clash is not None:
                raise _refusal(what, path, clash[0], clash[1])
        yield fpath
    finally:
        try:
            if _read(fpath) == record:  # not taken over meanwhile (then it is another process's now)
                fpath.unlink(missing_ok=True)
        except stop_flag.Stopped:  # stopped while the store does not answer: the lock object stays, and the
            pass  # rerun on this host takes it over (its pid is gone) rather than wait out a retry window here
        _remove_created(created)


def _remove_created(created: list[Path]) -> None:
    for dpath in created:  # deepest first; a folder that holds anything stays, and so do its parents
        try:
            dpath.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            break
