"""A shard's sidecar (``shard-NNNNNN.json``): reading it, and the completion and intactness tests.

Why the sidecar decides: it is written after the tar's rename, and records the tar's size
and checksums, so "tar and sidecar exist, sizes agree" is true only for a shard written to
its end; a rerun skips such shards and redoes every other one.
"""

from __future__ import annotations

import json
from pathlib import Path

from feature_extraction.shards import integrity
from feature_extraction.shards.layout import ShardFormatError, shard_fname, sidecar_fname

__all__ = ["read_json_object", "read_sidecar", "shard_is_complete", "shard_is_intact"]


def read_json_object(fpath: Path, what: str) -> dict:
    try:
        with open(fpath, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as exn:
        raise ShardFormatError(f"{fpath}: {what} is not valid JSON ({exn}); rewrite it") from None
    if not isinstance(obj, dict):
        raise ShardFormatError(f"{fpath}: {what} must be a JSON object")
    return obj


def read_sidecar(shards_dpath: Path, index: int) -> dict:
    """Read shard ``index``'s sidecar; ShardFormatError if missing or malformed."""
    fpath = Path(shards_dpath) / sidecar_fname(index)
    if not fpath.is_file():
        raise ShardFormatError(f"{fpath}: sidecar missing; shard {index} is unfinished, rerun its extraction task")
    sidecar = read_json_object(fpath, "sidecar")
    for field in ("index", "count", "n_tokens", "sha256", "bytes", "stats"):
        if field not in sidecar:
            raise ShardFormatError(f"{fpath}: sidecar lacks field {field!r}; delete it and rerun the shard")
    if sidecar["index"] != index:
        raise ShardFormatError(f"{fpath}: field 'index' is {sidecar['index']}, expected {index}")
    return sidecar


def shard_is_complete(shards_dpath: Path, index: int) -> bool:
    """True when the tar and its sidecar exist and the sidecar's ``bytes`` equals the tar size."""
    tar_fpath = Path(shards_dpath) / shard_fname(index)
    try:
        sidecar = read_sidecar(shards_dpath, index)
        return tar_fpath.is_file() and tar_fpath.stat().st_size == sidecar["bytes"]
    except (ShardFormatError, OSError):
        return False


def shard_is_intact(shards_dpath: Path, index: int) -> bool:
    """Complete, and the tar's bytes still match its sidecar (reads the whole tar: xxh3-64, or sha256 if older)."""
    if not shard_is_complete(shards_dpath, index):
        return False
    return integrity.shard_is_intact(read_sidecar(shards_dpath, index), Path(shards_dpath) / shard_fname(index))
