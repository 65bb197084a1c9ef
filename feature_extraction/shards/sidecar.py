"""A shard's sidecar (``shard-NNNNNN.json``): reading it, and the completion and intactness tests.

Why the sidecar decides: it is written after the tar's rename, and records the tar's size
and checksums, so "tar and sidecar exist, sizes agree" is true only for a shard written to
its end; a rerun skips such shards and redoes every other one.

A sidecar is parsed whole, so its size is checked first (``sidecar_limit``): a few dozen bytes
per sample and the d running sums, never more than its tar plus 1 MiB; and what it declares
(samples, tokens) must fit in the bytes it says the tar holds.
"""

from __future__ import annotations

import json
from pathlib import Path

from feature_extraction.shards import integrity
from feature_extraction.shards.layout import ShardFormatError, shard_fname, sidecar_fname
from feature_extraction.store import location

__all__ = [
    "MIN_SAMPLE_BYTES",
    "load_sidecar",
    "read_json_object",
    "read_sidecar",
    "shard_is_complete",
    "shard_is_intact",
    "sidecar_limit",
]

MIN_SAMPLE_BYTES = 1024  # a sample's tokens.npy takes at least a tar header and a data block


def read_json_object(fpath: Path, what: str, max_bytes: int | None = None, fix: str = "rewrite it") -> dict:
    """A JSON object file; with ``max_bytes``, a larger file is refused before it is read."""
    if max_bytes is not None and (size := fpath.stat().st_size) > max_bytes:
        raise ShardFormatError(
            f"{fpath}: {what} is {size} bytes, more than the {max_bytes} it can take beside its shard; "
            f"the file is corrupt or forged, {fix}"
        )
    try:
        with fpath.open("r", encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as exn:
        raise ShardFormatError(f"{fpath}: {what} is not valid JSON ({exn}); rewrite it") from None
    if not isinstance(obj, dict):
        raise ShardFormatError(f"{fpath}: {what} must be a JSON object")
    return obj


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
    for field in ("index", "count", "n_tokens", "sha256", "bytes", "stats"):
        if field not in sidecar:
            raise ShardFormatError(f"{fpath}: sidecar lacks field {field!r}; delete it and rerun the shard")
    if sidecar["index"] != index:
        raise ShardFormatError(f"{fpath}: field 'index' is {sidecar['index']}, expected {index}")
    sizes = [sidecar[field] for field in ("count", "n_tokens", "bytes")]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in sizes):
        raise ShardFormatError(
            f"{fpath}: fields 'count', 'n_tokens', 'bytes' must be integers >= 0, got {sizes}; delete it and rerun "
            "the shard"
        )
    count, n_tokens, n_bytes = sizes
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


def shard_is_intact(shards_dpath: Path, index: int) -> bool:
    """Complete, and the tar's bytes still match its sidecar (reads the whole tar: xxh3-64, or sha256 if older)."""
    if not shard_is_complete(shards_dpath, index):
        return False
    return integrity.shard_is_intact(read_sidecar(shards_dpath, index), location(shards_dpath) / shard_fname(index))
