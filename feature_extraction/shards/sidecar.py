"""A shard's sidecar (``shard-NNNNNN.json``): reading it, and the completion and intactness tests.

Why the sidecar decides: it is written after the tar's rename, and records the tar's size
and checksums, so "tar and sidecar exist, sizes agree" is true only for a shard written to
its end; a rerun skips such shards and redoes every other one.

A sidecar is parsed whole, so its size is checked first (``sidecar_limit``): a few dozen bytes
per sample and the d running sums, never more than its tar plus 1 MiB; and what it declares
(samples, tokens) must fit in the bytes it says the tar holds.
"""

from __future__ import annotations

from pathlib import Path

from feature_extraction.file_checks import COUNT, DEFAULT_MAX_BYTES, OBJECT, TEXT, check_fields, load_json
from feature_extraction.shards import integrity
from feature_extraction.shards.integrity import ALGORITHM
from feature_extraction.shards.layout import ShardFormatError, shard_fname, sidecar_fname
from feature_extraction.store import location

__all__ = [
    "MIN_SAMPLE_BYTES",
    "incomplete_reason",
    "load_sidecar",
    "read_json_object",
    "read_sidecar",
    "shard_is_complete",
    "shard_is_intact",
    "sidecar_limit",
]

MIN_SAMPLE_BYTES = 1024  # a sample's tokens.npy takes at least a tar header and a data block
# what every reader of a sidecar relies on (``stats`` is checked by RunningStats.from_json, ``sample_checksums``
# by integrity.load_sample_checksums)
SIDECAR_FIELDS = {"index": COUNT, "count": COUNT, "n_tokens": COUNT, "sha256": TEXT, "bytes": COUNT, "stats": OBJECT}


def read_json_object(fpath: Path, what: str, max_bytes: int | None = None, fix: str = "rewrite it") -> dict:
    """A JSON object file, parsed with bounds (`file_checks.load_json`); a larger file than ``max_bytes`` is
    refused before it is read, as corrupt or forged."""
    if max_bytes is not None and (size := fpath.stat().st_size) > max_bytes:
        raise ShardFormatError(
            f"{fpath}: {what} is {size} bytes, more than the {max_bytes} it can take beside its shard; "
            f"the file is corrupt or forged, {fix}"
        )
    limit = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    return load_json(fpath, what=what, fix=fix, max_bytes=limit, kind=dict, error=ShardFormatError)


def sidecar_limit(tar_fpath: Path) -> int:
    """The most bytes the sidecar of ``tar_fpath`` can take: its tar's size plus 1 MiB (module docstring)."""
    try:
        return (1 << 20) + location(tar_fpath).stat().st_size
    except OSError:
        return 1 << 20


def load_sidecar(fpath: Path) -> dict:
    """The sidecar at ``fpath`` as a dict, its size checked before it is parsed (fields unchecked)."""
    tar_fpath = location(fpath).with_suffix(".tar")
    return read_json_object(
        fpath, "sidecar", sidecar_limit(tar_fpath), f"delete it and rerun the extraction task of {tar_fpath.name}"
    )


def read_sidecar(shards_dpath: Path, index: int) -> dict:
    """Read shard ``index``'s sidecar; ShardFormatError if missing or malformed."""
    fpath = location(shards_dpath) / sidecar_fname(index)
    if not fpath.is_file():
        raise ShardFormatError(f"{fpath}: sidecar missing; shard {index} is unfinished, rerun its extraction task")
    sidecar = load_sidecar(fpath)
    fix = f"delete it and rerun the extraction task of shard {index}"
    check = dict(source=fpath, what="sidecar", fix=fix, error=ShardFormatError)
    check_fields(sidecar, {**SIDECAR_FIELDS, ALGORITHM: TEXT}, optional=(ALGORITHM,), **check)
    if sidecar["index"] != index:
        raise ShardFormatError(f"{fpath}: field 'index' is {sidecar['index']}, expected {index}; {fix}")
    count, n_tokens, n_bytes = (sidecar[field] for field in ("count", "n_tokens", "bytes"))
    if count * MIN_SAMPLE_BYTES > n_bytes or n_tokens * 2 > n_bytes:
        raise ShardFormatError(
            f"{fpath}: declares {count} samples of {n_tokens} float16 tokens in all, more than its tar's {n_bytes} "
            "bytes can hold; the sidecar is corrupt or forged, delete it and rerun the shard"
        )
    return sidecar


def shard_is_complete(shards_dpath: Path, index: int) -> bool:
    """True when the tar and its sidecar exist and the sidecar's ``bytes`` equals the tar size."""
    tar_fpath = location(shards_dpath) / shard_fname(index)
    try:
        sidecar = read_sidecar(shards_dpath, index)
        return tar_fpath.is_file() and tar_fpath.stat().st_size == sidecar["bytes"]
    except (ShardFormatError, OSError):
        return False


def incomplete_reason(shards_dpath: Path, index: int) -> str:
    """Why shard ``index`` is not complete, naming the file at fault (for the line that lists unfinished shards)."""
    shards_dpath = location(shards_dpath)
    tar_fpath, fpath = shards_dpath / shard_fname(index), shards_dpath / sidecar_fname(index)
    if not fpath.is_file():
        return f"{fpath} is missing"
    if not tar_fpath.is_file():
        return f"{tar_fpath} is missing"
    try:
        recorded = read_sidecar(shards_dpath, index)["bytes"]
    except (ShardFormatError, OSError) as exn:
        return str(exn)
    return f"{fpath} records {recorded} bytes, {tar_fpath.name} holds {tar_fpath.stat().st_size}"


def shard_is_intact(shards_dpath: Path, index: int) -> bool:
    """Complete, and the tar's bytes still match its sidecar (reads the whole tar: xxh3-64, or sha256 if older)."""
    if not shard_is_complete(shards_dpath, index):
        return False
    return integrity.shard_is_intact(read_sidecar(shards_dpath, index), location(shards_dpath) / shard_fname(index))
