"""Writing one shard: samples -> ``shard-NNNNNN.tar`` + its sidecar, whole or absent.

Design choices:
- One sample per image: ``__key__`` = image key, ``tokens.npy`` = float16 ``[n_tokens, d]``
  (prefix tokens, then patches in row-major grid order), ``meta.json`` = label and source.
  ``.npy`` is written with ``allow_pickle=False``.
- Reruns rebuild byte-identical tars (fixed mtime, owner and mode in every tar header;
  PAX format so long or non-ASCII ids fit).
- The tar is streamed to its temporary name (sha256 and size computed on the way), fsynced
  and renamed; only then is its sidecar written (atomically). "Tar and sidecar exist, sizes
  agree" is the completion test (``sidecar.shard_is_complete``), so a job killed at any
  point leaves either a complete shard or one that the rerun redoes.
- The sidecar also records an xxh3-64 of the tar and of every sample's ``tokens.npy`` and
  ``positions.npy`` (``integrity``), and float64 running sums, so the manifest gets the
  normalisation statistics without re-reading the tokens.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import numpy as np
import xxhash

from feature_extraction.atomic_files import atomic_path, write_json_atomic
from feature_extraction.running_stats import RunningStats
from feature_extraction.shards import integrity
from feature_extraction.shards.layout import (
    META_SUFFIX,
    POSITIONS_SUFFIX,
    TAR_MTIME,
    TOKENS_SUFFIX,
    check_key,
    shard_fname,
    sidecar_fname,
    tmp_fpath,
)

__all__ = ["write_shard"]


def webdataset():  # noqa: ANN201
    """webdataset, imported on first write: it loads torch, which readers of a manifest do not need."""
    import webdataset as wds

    return wds


class _HashingWriter:
    """File wrapper that hashes and counts bytes as tarfile streams them out."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.sha256 = hashlib.sha256()
        self.xxh3 = xxhash.xxh3_64()  # integrity.ALGORITHM: what reruns and finalize check quickly
        self.n_bytes = 0

    def write(self, data: bytes) -> int:
        self.f.write(data)
        self.sha256.update(data)
        self.xxh3.update(data)
        self.n_bytes += len(data)
        return len(data)


def _encode_positions(key: str, positions: np.ndarray, n_tokens: int) -> bytes:
    """``positions.npy`` of a sample holding a token subset: int16/int32 ``[n_tokens]``, strictly ascending."""
    if (
        not isinstance(positions, np.ndarray)
        or positions.dtype not in (np.int16, np.int32)
        or positions.shape != (n_tokens,)
    ):
        got = f"{positions.dtype} {list(positions.shape)}" if isinstance(positions, np.ndarray) else type(positions)
        raise ValueError(f"sample {key!r}: positions must be int16 or int32 [{n_tokens}], got {got}")
    if positions[0] < 0 or (n_tokens > 1 and not (np.diff(positions) > 0).all()):
        raise ValueError(f"sample {key!r}: positions must be >= 0 and strictly ascending")
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(positions), allow_pickle=False)
    return buf.getvalue()


def _encode_sample(
    key: str, tokens: np.ndarray, meta: dict, d: int | None, n_tokens: int | None, positions: np.ndarray | None = None
) -> dict:
    check_key(key)
    if not isinstance(tokens, np.ndarray) or tokens.dtype != np.float16:
        got = tokens.dtype if isinstance(tokens, np.ndarray) else type(tokens).__name__
        raise ValueError(f"sample {key!r}: tokens must be a float16 numpy array, got {got}")
    if tokens.ndim != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 1:
        raise ValueError(f"sample {key!r}: tokens must have shape [n_tokens >= 1, d >= 1], got {list(tokens.shape)}")
    if d is not None and tokens.shape[1] != d:
        raise ValueError(f"sample {key!r}: tokens have d={tokens.shape[1]} but earlier samples have d={d}")
    if n_tokens is not None and tokens.shape[0] != n_tokens:
        raise ValueError(f"sample {key!r}: {tokens.shape[0]} tokens but earlier samples have {n_tokens}")
    if not isinstance(meta, dict):
        raise ValueError(f"sample {key!r}: meta must be a dict, got {type(meta).__name__}")
    try:
        meta_bytes = json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exn:
        raise ValueError(f"sample {key!r}: meta is not JSON-serialisable ({exn})") from None
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(tokens), allow_pickle=False)
    sample = {"__key__": key, META_SUFFIX: meta_bytes, TOKENS_SUFFIX: buf.getvalue()}
    if positions is not None:
        sample[POSITIONS_SUFFIX] = _encode_positions(key, positions, tokens.shape[0])
    return sample


def write_shard(shards_dpath: Path, index: int, samples: Iterable[tuple]) -> dict:
    """Write shard ``index`` from ``(key, tokens float16 [n_tokens, d], meta)`` samples.

    A sample of a token subset is ``(key, tokens, meta, positions)``: ``positions.npy``
    (``token_selection.selected_positions``) is stored beside its tokens.

    Streams to ``shard-NNNNNN.tar.tmp`` while hashing, then ``atomic_path`` fsyncs and renames
    it; then the sidecar is written atomically. On any exception the ``.tmp`` is removed (and the sidecar is not
    written), so other shards and a later rerun are unaffected. Returns the sidecar dict.
    """
    shards_dpath = Path(shards_dpath)
    shards_dpath.mkdir(parents=True, exist_ok=True)
    tar_fpath = shards_dpath / shard_fname(index)
    stats = RunningStats(0)
    seen: set[str] = set()
    d = n_tokens = None
    checksums: dict[str, list[str]] = {TOKENS_SUFFIX: [], POSITIONS_SUFFIX: []}
    with atomic_path(tar_fpath, tmp_fpath(tar_fpath)) as tmp:
        with open(tmp, "wb") as f:
            hashing = _HashingWriter(f)
            # PAX is tarfile's default (TarWriter does not forward `format`): long and non-ASCII ids fit.
            with webdataset().TarWriter(hashing, encoder=False, mtime=TAR_MTIME) as writer:
                for key, tokens, meta, *positions in samples:
                    sample = _encode_sample(key, tokens, meta, d, n_tokens, positions[0] if positions else None)
                    if key in seen:
                        raise ValueError(f"sample {key!r} appears twice in shard {index}; image ids must be unique")
                    seen.add(key)
                    if d is None:
                        n_tokens, d = tokens.shape
                    sample_stats = RunningStats(d)
                    sample_stats.update(tokens)
                    if not np.isfinite(sample_stats.sum_sq_norm):  # cheaper than np.isfinite(tokens).all()
                        raise ValueError(
                            f"sample {key!r}: tokens contain inf/nan (float16 overflow?); check the backbone output"
                        )
                    stats = stats.merge(sample_stats)
                    for member in checksums:
                        if member in sample:
                            checksums[member].append(integrity.digest(sample[member]))
                    writer.write(sample)
        # A stale sidecar must not vouch for the new tar, even for a moment (the tar is renamed after this).
        (shards_dpath / sidecar_fname(index)).unlink(missing_ok=True)
    if len(checksums[POSITIONS_SUFFIX]) != len(seen):  # all-token extraction: no positions.npy
        del checksums[POSITIONS_SUFFIX]
    sidecar = {
        "index": int(index),
        "count": len(seen),
        "n_tokens": stats.n_tokens,
        "sha256": hashing.sha256.hexdigest(),
        integrity.ALGORITHM: hashing.xxh3.hexdigest(),
        "bytes": hashing.n_bytes,
        "stats": stats.to_json(),
        "sample_checksums": {"algorithm": integrity.ALGORITHM, **checksums},
    }
    write_json_atomic(shards_dpath / sidecar_fname(index), sidecar)
    return sidecar
