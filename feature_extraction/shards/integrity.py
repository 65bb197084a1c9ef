"""Shard integrity: per-sample checksums in each sidecar, whole-shard checks, and the repair command.

Why per-sample xxh3-64 (the ``xxhash`` package) and not only the shard's sha256: the training
stream reads shards at random (a worker reads part of a shard, ``read.py``), so a
whole-file hash cannot be checked on the way; a per-sample checksum is checked as each
``tokens.npy`` / ``positions.npy`` is read, over exactly the bytes read. Measured on the
2-core dev box (one 261 x 768 float16 sample, 400 KB): xxh3-64 63 GB/s, zlib's crc32
4.2 GB/s, sha256 1.8 GB/s, against a training stream of about 2 GB/s (1.3 M tokens/s x
1.5 KB). crc32 would have cost a third of the stream's throughput, xxh3 costs a few
percent (BENCHMARKS.md, ``python -m benchmarks.loader``).

What is recorded (``write_shard``): in the sidecar, ``xxh3_64`` of the whole tar (computed
while streaming, beside the sha256) and ``sample_checksums``: per sample, in tar order, the
xxh3-64 of its ``tokens.npy`` member bytes and, for a token subset, of its ``positions.npy``.

Who checks what:
- the training stream (``ShardUnit``): each sample it reads, against the sidecar, and
  that the sidecar is the one the manifest was built from (same sha256);
- an extraction rerun: every shard the task owns, whole file (``shard_is_intact``); a
  shard whose bytes no longer match its sidecar is written again;
- ``finalize``: every shard, whole file; it refuses to write the manifest over a corrupt one
  and names the extraction command that redoes it.

Shards written before these checksums (sidecar without ``sample_checksums``) stay readable:
the stream checks each one's sha256 once per process before reading it (slower, logged once),
and ``python -m feature_extraction finalize --out DIR`` adds the per-sample checksums to
their sidecars after checking the sha256 (one read of each shard).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import shlex
from pathlib import Path
from typing import NamedTuple

import xxhash

from feature_extraction.file_hashes import file_digests, file_xxh3
from feature_extraction.shards.layout import (
    EXTRACTION_FNAME,
    POSITIONS_SUFFIX,
    TOKENS_SUFFIX,
    ShardFormatError,
    member_key,
)
from feature_extraction.shards.tar_scan import iter_members
from feature_extraction.store import location

__all__ = [
    "ALGORITHM",
    "SampleChecksums",
    "add_sample_checksums",
    "digest",
    "load_sample_checksums",
    "repair_command",
    "shard_is_intact",
    "verify_sha256_once",
]

logger = logging.getLogger(__name__)

ALGORITHM = "xxh3_64"
_SHA256_VERIFIED: set[tuple] = set()  # (shard path, sha256, size, mtime) checked in this process


def digest(data: bytes | memoryview) -> str:
    """xxh3-64 of ``data`` as 16 hex digits (what sidecars record)."""
    return xxhash.xxh3_64_hexdigest(data)


class SampleChecksums(NamedTuple):
    """Expected xxh3-64 (as ints) of each sample's members, in tar order; ``positions`` None without a subset."""

    tokens: list[int]
    positions: list[int] | None


def shard_is_intact(sidecar: dict, tar_fpath: Path) -> bool:
    """True when the tar's bytes match its sidecar (size, then xxh3-64, or sha256 for old sidecars).

    An object in a store is fetched whole (parallel ranged GETs, or the read-ahead when planned).
    """
    try:
        if tar_fpath.stat().st_size != sidecar["bytes"]:
            return False
        if ALGORITHM in sidecar:
            return file_xxh3(tar_fpath) == sidecar[ALGORITHM]
        return file_digests(tar_fpath)[0] == sidecar["sha256"]
    except OSError:
        return False


def repair_command(shards_dpath: Path) -> str:
    """The extraction command that redoes corrupt shards of ``shards_dpath``, from its ``extraction.json``.

    A rerun with the same settings verifies every shard it owns and rewrites those whose bytes no
    longer match their sidecar, then writes the manifest again.
    """
    shards_dpath = location(shards_dpath)
    try:
        record = json.loads((shards_dpath / EXTRACTION_FNAME).read_text(encoding="utf-8"))
        weights = record.get("weights") or {}
        selection = record.get("token_selection")
        flags = [
            "--backbone",
            record["backbone"],
            "--images",
            str(record["images"]),
            "--out",
            str(shards_dpath),
            "--layer",
            str(record["layer"]),
            "--shard_size",
            str(record["shard_size"]),
        ]
        if weights.get("pretrained"):
            flags += ["--pretrained", "true"]
        if weights.get("checkpoint_path"):
            flags += ["--checkpoint_path", str(weights["checkpoint_path"])]
        seed = weights.get("seed") if weights.get("seed") is not None else (selection or {}).get("seed")
        if seed is not None:
            flags += ["--seed", str(seed)]
        if selection:
            flags += [
                "--tokens_per_image",
                str(selection["patches_per_image"]),
                "--keep_prefix_tokens",
                str(bool(selection["keep_prefix_tokens"])).lower(),
            ]
    except (OSError, ValueError, KeyError, TypeError):
        return (
            f"rerun the extraction that wrote {shards_dpath} with its settings (it redoes shards whose bytes no "
            "longer match their sidecar), then `python -m feature_extraction finalize --out "
            f"{shlex.quote(str(shards_dpath))}`"
        )
    return (
        "rerun `python -m feature_extraction " + shlex.join(flags) + "` (or the array job that wrote it; "
        "it redoes shards whose bytes no longer match their sidecar and rewrites the manifest)"
    )


def load_sample_checksums(sidecar: dict, where: Path) -> SampleChecksums | None:
    """The sidecar's per-sample checksums (None for a sidecar written before them)."""
    recorded = sidecar.get("sample_checksums")
    if recorded is None:
        return None
    try:
        if recorded["algorithm"] != ALGORITHM:
            raise ValueError(f"algorithm {recorded['algorithm']!r}")
        tokens = [int(h, 16) for h in recorded[TOKENS_SUFFIX]]
        positions = recorded.get(POSITIONS_SUFFIX)
        positions = None if positions is None else [int(h, 16) for h in positions]
        if len(tokens) != sidecar["count"] or (positions is not None and len(positions) != len(tokens)):
            raise ValueError(f"{len(tokens)} entries for {sidecar['count']} samples")
    except (KeyError, TypeError, ValueError) as exn:
        raise ShardFormatError(
            f"{where}: field 'sample_checksums' is malformed ({exn}); {repair_command(where.parent)}"
        ) from None
    return SampleChecksums(tokens, positions)


def verify_sha256_once(tar_fpath: Path, sha256: str) -> None:
    """For shards without per-sample checksums: check the whole file's sha256, once per process."""
    stat = tar_fpath.stat()
    # a file changed since is checked again (an object in a store has no mtime here: its size stands for it)
    key = (str(tar_fpath), sha256, stat.st_size, getattr(stat, "st_mtime_ns", 0))
    if key in _SHA256_VERIFIED:
        return
    if not _SHA256_VERIFIED:
        logger.warning(
            "%s: shards without per-sample checksums; checking each one's sha256 before reading it "
            "(slow). `python -m feature_extraction finalize --out %s` adds the checksums.",
            tar_fpath.parent,
            tar_fpath.parent,
        )
    if file_digests(tar_fpath)[0] != sha256:
        raise ShardFormatError(
            f"{tar_fpath}: corrupt shard (its sha256 differs from its sidecar's); {repair_command(tar_fpath.parent)}"
        )
    _SHA256_VERIFIED.add(key)


def add_sample_checksums(sidecar: dict, tar_fpath: Path) -> dict | None:
    """An old sidecar (no ``sample_checksums``) with them added, after checking the shard's sha256; None if corrupt.

    One read for the sha256 and one pass over the members; what ``finalize`` does to shards
    written before the checksums, so the training stream can check them sample by sample.
    """
    if hasattr(tar_fpath, "fetch"):  # an object in a store: read once, hashed and scanned in memory
        data = tar_fpath.fetch()
        sha256, xxh3, opened = hashlib.sha256(data).hexdigest(), digest(data), io.BytesIO(data)
    else:
        (sha256, xxh3), opened = file_digests(tar_fpath), open(tar_fpath, "rb")  # closed below
    if sha256 != sidecar["sha256"]:
        opened.close()
        return None
    checksums: dict[str, list[str]] = {TOKENS_SUFFIX: [], POSITIONS_SUFFIX: []}
    with opened as stream:
        for name, offset, size in list(iter_members(stream, tar_fpath)):
            suffix = member_key(name)[1]
            if suffix in checksums:
                stream.seek(offset)
                checksums[suffix].append(digest(stream.read(size)))
    if len(checksums[POSITIONS_SUFFIX]) != len(checksums[TOKENS_SUFFIX]):
        del checksums[POSITIONS_SUFFIX]
    return {**sidecar, ALGORITHM: xxh3, "sample_checksums": {"algorithm": ALGORITHM, **checksums}}
