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
import logging
import shlex
import tarfile
from pathlib import Path
from typing import NamedTuple

import xxhash

from feature_extraction.file_checks import load_json
from feature_extraction.file_hashes import file_digests
from feature_extraction.shards.layout import (
    EXTRACTION_FNAME,
    POSITIONS_SUFFIX,
    TOKENS_SUFFIX,
    ShardFormatError,
    member_key,
)
from feature_extraction.shards.tar_scan import check_members, check_tar_end, iter_members
from feature_extraction.store import RemotePath, location

__all__ = [
    "ALGORITHM",
    "MISMATCH",
    "SampleChecksums",
    "add_sample_checksums",
    "digest",
    "load_sample_checksums",
    "repair_command",
    "shard_is_intact",
    "shard_problem",
    "verify_sha256_once",
]

logger = logging.getLogger(__name__)

ALGORITHM = "xxh3_64"
_CHUNK_BYTES = 8 << 20
_SHA256_VERIFIED: set[tuple] = set()  # (shard path, sha256, size, mtime) checked in this process


def digest(data: bytes | memoryview) -> str:
    """xxh3-64 of ``data`` as 16 hex digits (what sidecars record)."""
    return xxhash.xxh3_64_hexdigest(data)


class SampleChecksums(NamedTuple):
    """Expected xxh3-64 (as ints) of each sample's members, in tar order; ``positions`` None without a subset."""

    tokens: list[int]
    positions: list[int] | None


def shard_is_intact(sidecar: dict, tar_fpath: Path) -> bool:
    """True when the tar's bytes match its sidecar and every reader accepts its members (``shard_problem``)."""
    return shard_problem(sidecar, tar_fpath) is None


MISMATCH = "no longer matches its sidecar"


def shard_problem(sidecar: dict, tar_fpath: Path) -> str | None:
    """Why shard ``tar_fpath`` cannot be used as ``sidecar`` describes it; None when it can.

    :data:`MISMATCH` when its bytes differ from the sidecar's record (size, then xxh3-64, or sha256
    for old sidecars) or cannot be read; otherwise the reader's one line when a member is one that
    every reader refuses (a link, a device, a name that is absolute or holds ``..``: ``tar_scan``),
    so that ``finalize`` and an extraction's rerun refuse what the readers refuse, even in a shard
    whose sidecar was forged to match it. One read: an object in a store is fetched once.
    """
    try:
        if tar_fpath.stat().st_size != sidecar["bytes"]:
            return MISMATCH
        hasher, expected = (
            (xxhash.xxh3_64(), sidecar[ALGORITHM]) if ALGORITHM in sidecar else (hashlib.sha256(), sidecar["sha256"])
        )
        with tar_fpath.open("rb") as stream:
            while chunk := stream.read(_CHUNK_BYTES):
                hasher.update(chunk)
            if hasher.hexdigest() != expected:
                return MISMATCH
            check_tar_end(tar_fpath, stream)
            check_members(tar_fpath, stream)
    except OSError:
        return MISMATCH
    except (ShardFormatError, tarfile.TarError) as exn:
        return str(exn) if isinstance(exn, ShardFormatError) else f"{tar_fpath}: corrupt tar ({exn}); re-extract it"
    return None


def repair_command(shards_dpath: Path) -> str:
    """The extraction command that redoes corrupt shards of ``shards_dpath``, from its ``extraction.json``.

    A rerun with the same settings verifies every shard it owns and rewrites those whose bytes no
    longer match their sidecar or that no reader accepts (a tar cut short: ``shard_problem``), then
    writes the manifest again. In a bucket a rerun trusts the shards there (it compares sizes, it
    does not download them), so the advice starts with deleting the damaged shard's sidecar: a
    shard without one is extracted again.
    """
    shards_dpath = location(shards_dpath)
    first = (
        f"delete the damaged shard's sidecar (shard-NNNNNN.json) from {shards_dpath}, then "
        if isinstance(shards_dpath, RemotePath)
        else ""
    )
    redoes = (
        "it extracts again each shard without its sidecar"
        if first
        else "it redoes shards that are cut short or whose bytes no longer match their sidecar"
    )
    try:
        record = load_json(shards_dpath / EXTRACTION_FNAME, what="record", fix="", max_bytes=1 << 20, kind=dict)
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
            f"{first}rerun the extraction that wrote {shards_dpath} with its settings ({redoes}), then "
            f"`python -m feature_extraction finalize --out {shlex.quote(str(shards_dpath))}`"
        )
    return (
        f"{first}rerun `python -m feature_extraction " + shlex.join(flags) + "` (or the array job that wrote it; "
        f"{redoes}, and rewrites the manifest)"
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
