"""What an extraction's output directory holds: its record (`extraction.json`) and its manifest.

Every task of an array job checks the record before writing a shard (another backbone,
layer, image list or shard size is refused rather than mixed in), and the task that
finds every shard complete assembles `manifest.json` (`finalize`, also a subcommand; run as
a command it first reads every shard and checks it against its sidecar, `integrity`).
Several tasks may finish at once, so the manifest is written under a lock file.

The same for a prefix in an object store (`--out s3://bucket/prefix`, `remote_out.py`): every
object is written whole by one PUT, `extraction.json` by a conditional create, the lock is an
object created the same way (dated inside it: an object has no mtime here) and `manifest.json`
is the last object written. `finalize --verify true` of a store reads every shard (whole, with
read-ahead); the last task's finalize (`verify=False`) checks each shard's size against its
sidecar and trusts the per-sample checksums that every reader checks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from feature_extraction.atomic_files import write_json_atomic
from feature_extraction.file_checks import NUMBER, check_fields, parse_json, shown
from feature_extraction.shards import integrity
from feature_extraction.shards.extraction_files import load_record, read_record, read_skipped
from feature_extraction.shards.layout import (
    EXTRACTION_FNAME,
    LOCK_FNAME,
    SHARD_FILES_GLOB,
    ShardFormatError,
    shard_fname,
    sidecar_fname,
    skipped_fname,
)
from feature_extraction.shards.manifest import format_indices, load_manifest, write_manifest
from feature_extraction.shards.record import check_sealed, seal
from feature_extraction.shards.sidecar import read_sidecar, shard_is_complete
from feature_extraction.store import RemotePath, fetch, location
from feature_extraction.token_selection import token_kinds

__all__ = ["check_or_create_record", "finalize", "finalize_if_last", "ids_digest", "verify_shards"]

logger = logging.getLogger(__name__)

STALE_LOCK_SECONDS = 600  # a finalize takes seconds; an older lock belongs to a dead process
# What a rerun must agree on with the directory's extraction.json.
# An extraction.json written before token subsets has no "token_selection": it held all tokens (None).
_COMPARED_FIELDS = ("backbone", "layer", "weights", "shard_size", "n_images", "ids_sha256", "token_selection")
_FLAG_HINTS = {"token_selection": "token_selection (--tokens_per_image, --keep_prefix_tokens, --seed)"}


def ids_digest(keys: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(keys).encode("utf-8")).hexdigest()


def check_or_create_record(out_dpath: Path, record: dict) -> None:
    """Write `extraction.json`, or refuse a directory that holds another extraction."""
    fpath = out_dpath / EXTRACTION_FNAME
    if isinstance(out_dpath, RemotePath):
        out_dpath.refresh()  # another task may have written it since this process listed the prefix
    if not fpath.exists():
        if any(out_dpath.glob(SHARD_FILES_GLOB)):
            raise ValueError(
                f"--out {out_dpath} holds shard files but no {EXTRACTION_FNAME}: it was not written "
                "by this command; use an empty --out directory"
            )
        write_json_atomic(fpath, seal(record), exclusive=True)  # another task may have won: compare below
    old = load_record(out_dpath, "delete it if --out holds no shards")
    check_sealed(old, fpath, record)  # an edited record would be believed below
    if (old.get("backbone"), old.get("layer")) != (record["backbone"], record["layer"]):
        raise ValueError(
            f"--out {out_dpath} holds shards of backbone {shown(old.get('backbone'))} layer {shown(old.get('layer'))} "
            f"but this run extracts backbone {record['backbone']!r} layer {record['layer']}; "
            "use another --out (e.g. one directory per backbone and layer)"
        )
    differ = [
        f"{_FLAG_HINTS.get(k, k)}: {shown(old.get(k))} there, {record[k]!r} now"
        for k in _COMPARED_FIELDS
        if old.get(k) != record[k]
    ]
    if differ:
        raise ValueError(
            f"--out {out_dpath} was extracted with other settings ({'; '.join(differ)}); "
            "rerun with the same settings and images, or use another --out"
        )


def _manifest_is_current(out_dpath: Path, n_shards: int) -> bool:
    try:
        manifest = load_manifest(out_dpath)
        return [e["sha256"] for e in manifest["shards"]] == [
            read_sidecar(out_dpath, i)["sha256"] for i in range(n_shards)
        ]
    except (ShardFormatError, OSError, KeyError):
        return False


def verify_shards(out_dpath: Path, n_shards: int) -> None:
    """Check every complete shard's bytes against its sidecar; add per-sample checksums to old sidecars.

    Raises a one-line ShardFormatError naming the corrupt shards and the extraction command
    that redoes them (a rerun verifies the shards it owns and writes corrupt ones again), or the
    first shard holding a member that every reader refuses (a link, a device, a name with ``..``
    or an absolute one: ``tar_scan``), even when its sidecar matches it.
    """
    corrupt, refused = [], []
    if isinstance(out_dpath, RemotePath):  # the next shards download while this one is hashed
        fetch.plan([out_dpath / shard_fname(i) for i in range(n_shards) if shard_is_complete(out_dpath, i)])
    for index in range(n_shards):
        if not shard_is_complete(out_dpath, index):
            continue  # write_manifest lists the missing ones
        sidecar, tar_fpath = read_sidecar(out_dpath, index), out_dpath / shard_fname(index)
        if "sample_checksums" in sidecar:
            problem = integrity.shard_problem(sidecar, tar_fpath)  # also a member every reader refuses
            if problem == integrity.MISMATCH:
                corrupt.append(index)
            elif problem is not None:
                refused.append(problem)
        elif (upgraded := integrity.add_sample_checksums(sidecar, tar_fpath)) is None:
            corrupt.append(index)
        else:
            write_json_atomic(out_dpath / sidecar_fname(index), upgraded)
            logger.info("shard %d: per-sample checksums added to its sidecar", index)
    if corrupt:
        what = (
            f"shard {corrupt[0]} no longer matches its sidecar {sidecar_fname(corrupt[0])}"
            if len(corrupt) == 1
            else f"shards {format_indices(corrupt)} no longer match their sidecars ({sidecar_fname(corrupt[0])}, ...)"
        )
        raise ShardFormatError(f"{out_dpath}: {what} (corrupt on disk); {integrity.repair_command(out_dpath)}")
    if refused:  # its sidecar vouches for it, yet no reader would read it: the manifest must not list it
        raise ShardFormatError(f"{refused[0]}; or {integrity.repair_command(out_dpath)}")


def finalize(out: str, force: bool = False, verify: bool = True) -> dict:
    """Assemble `manifest.json` of `--out` once all its shards are complete and intact; returns the manifest.

    Several tasks may finish together: a lock file (created with O_EXCL, which is atomic on
    NFS too; in a store, a conditional PUT) lets one of them write the manifest. A lock older than
    ten minutes, or `--force true`, is taken over.

    Args:
        out: the extraction's output directory (holding extraction.json and the shards), or its URL
            (s3://bucket/prefix: there --verify reads every shard).
        force: take over a finalize lock held by another process.
        verify: read every shard and check it against its sidecar's checksums (refusing corrupt
            ones, naming the command that redoes them); adds per-sample checksums to sidecars
            written before them. False: trust the shards (each extraction task checked its own).
    """
    out_dpath = location(out, "--out")
    if isinstance(out_dpath, Path):
        out_dpath = out_dpath.expanduser()
    record = read_record(out_dpath)
    check_sealed(record, out_dpath / EXTRACTION_FNAME)
    n_shards = record["n_shards"]
    lock_fpath = _lock(out_dpath / LOCK_FNAME, force)
    try:
        if verify:
            verify_shards(out_dpath, n_shards)
        skipped = []
        for index in range(n_shards):
            fpath = out_dpath / skipped_fname(index)
            if fpath.is_file():
                skipped += read_skipped(fpath, out_dpath, index)
        backbone = record["backbone_record"]
        selection = record.get("token_selection")
        return write_manifest(
            out_dpath,
            n_shards=n_shards,
            spec=backbone,
            layer=record["layer"],
            tokens_per_image=sum(token_kinds(backbone["n_prefix_tokens"], backbone["grid"], selection).values()),
            n_prefix_tokens=backbone["n_prefix_tokens"],
            grid=tuple(backbone["grid"]),
            skipped=skipped,
            token_selection=selection,
            extra={
                "extraction": {
                    k: record[k] for k in ("images", "shard_size", "weights", "key_scheme", "ids_sha256", "n_images")
                }
            },
        )
    finally:
        lock_fpath.unlink(missing_ok=True)


class FinalizeBusy(RuntimeError):
    """Another process holds the finalize lock (exit 1); not a failure of the store, which must not pass for it."""


def _lock(lock_fpath: Path | RemotePath, force: bool) -> Path | RemotePath:
    """Create the finalize lock, or take over a stale one (or any, with `force`); `FinalizeBusy` if it is held."""
    if isinstance(lock_fpath, RemotePath):
        stamp = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}).encode()
        if lock_fpath.write_bytes(stamp, exclusive=True):
            return lock_fpath
        try:
            held = parse_json(lock_fpath.read_bytes(), source=lock_fpath, what="lock", fix="", kind=dict, max_depth=2)
            check_fields(held, {"time": NUMBER}, source=lock_fpath, what="lock", fix="")
            age = time.time() - held["time"]
        except ValueError:  # released meanwhile (StoreError), or not a lock a finalize wrote
            age = math.inf
    else:
        try:
            os.close(os.open(lock_fpath, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return lock_fpath
        except FileExistsError:
            try:
                age = time.time() - lock_fpath.stat().st_mtime
            except FileNotFoundError:  # released meanwhile
                age = math.inf
    if not force and age < STALE_LOCK_SECONDS:
        raise FinalizeBusy(
            f"{lock_fpath}: another process is finalizing (lock {age:.0f} s old); wait, or pass --force true if it died"
        ) from None
    if isinstance(lock_fpath, RemotePath):
        lock_fpath.write_bytes(stamp)
    else:
        lock_fpath.touch()
    return lock_fpath


def _all_listed(out_dpath: RemotePath, n_shards: int) -> bool:
    """Every shard's tar and sidecar is in the prefix's listing (one request; their sizes are checked after)."""
    out_dpath.refresh()  # other tasks uploaded since this process listed it
    names = {p.name for p in out_dpath.iterdir()}
    return all(shard_fname(i) in names and sidecar_fname(i) in names for i in range(n_shards))


def finalize_if_last(out_dpath: Path | RemotePath, n_shards: int) -> bool:
    """Called by every task at its end: the one that sees all shards complete writes the manifest."""
    out_dpath = location(out_dpath)
    if isinstance(out_dpath, RemotePath) and not _all_listed(out_dpath, n_shards):
        return False
    if not all(shard_is_complete(out_dpath, i) for i in range(n_shards)):
        return False
    if _manifest_is_current(out_dpath, n_shards):
        return True
    try:
        finalize(str(out_dpath), verify=False)  # each task verified the complete shards it owns at its start
    except FinalizeBusy:  # another task holds the lock and is writing the same manifest (a store's failure is not)
        logger.info("another task is finalizing %s", out_dpath)
        return False
    return True
