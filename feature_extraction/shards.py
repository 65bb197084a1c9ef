"""The on-disk shard format: webdataset tars of float16 token activations plus a manifest.

This module and ``shard_reader`` (the reading side) are the only places that know the
format (DESIGN.md, "Shard format"); the extractor writes through this one.

Design choices:
- One sample per image: ``__key__`` = image id, ``tokens.npy`` = float16 ``[n_tokens, d]``
  (prefix tokens, then patches in row-major grid order), ``meta.json`` = label and source.
  ``.npy`` is written and read with ``allow_pickle=False``; nothing here unpickles.
- Images go to shards by sorted id and a fixed shard size, so every SLURM task can work
  out which shards it owns and a rerun rebuilds byte-identical tars (fixed mtime, owner
  and mode in every tar header; PAX format so long or non-ASCII ids fit).
- A shard is written to ``shard-NNNNNN.tar.tmp`` (sha256 and size computed while
  streaming), fsynced and renamed; only then is its sidecar ``shard-NNNNNN.json`` written
  (tmp + rename). "Tar and sidecar exist, sizes agree" is the completion test, so a job
  killed at any point leaves either a complete shard or one that the rerun redoes.
- Each sidecar also records an xxh3-64 of the tar and of every sample's ``tokens.npy`` and
  ``positions.npy``, checked by the training stream, reruns and finalize (``integrity``).
- Each sidecar carries float64 running sums, so ``finalize_manifest`` gets the
  normalisation statistics (per-dimension mean, mean squared norm) without re-reading
  the 0.5 TB of tokens.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import time
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Sequence

import numpy as np
import webdataset as wds
import xxhash

from feature_extraction import integrity
from feature_extraction.atomic_files import fsync_dir, write_json_atomic
from feature_extraction.running_stats import RunningStats
from feature_extraction.token_selection import full_token_count, token_kinds

SCHEMA_VERSION = 1
MANIFEST_FNAME = "manifest.json"
DTYPE = "float16"
TAR_MTIME = 0  # fixed header fields make two writes of the same samples byte-identical
REQUIRED_FIELDS = (
    "schema_version", "backbone", "layer", "d", "dtype", "tokens_per_image", "n_prefix_tokens",
    "grid", "n_images", "n_tokens", "shards", "stats", "skipped", "package_version", "created_at",
)
SHARD_FIELDS = ("fname", "count", "n_tokens", "sha256", "bytes")


class ShardFormatError(ValueError):
    """A shard directory, manifest, sidecar or sample that does not follow the format."""


def shard_fname(index: int) -> str:
    """File name of shard ``index`` (``shard-000042.tar``); zero-padded so names sort by index."""
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
        raise ValueError(f"shard index must be an integer >= 0, got {index!r}")
    return f"shard-{int(index):06d}.tar"


def sidecar_fname(index: int) -> str:
    """File name of shard ``index``'s sidecar (``shard-000042.json``)."""
    return shard_fname(index)[: -len(".tar")] + ".json"


def check_key(key: str) -> None:
    """Reject image ids that webdataset could not group back into one sample.

    webdataset splits a member name at the first dot of its last path component
    (``base_plus_ext``) and skips names that look like ``__meta__``, so such ids would
    silently merge or vanish on reading.
    """
    if not isinstance(key, str) or not key or key.startswith("/") or key.endswith("/"):
        raise ValueError(f"image id {key!r}: must be a non-empty string without a leading or trailing '/'")
    if "." in key.rsplit("/", 1)[-1]:
        raise ValueError(f"image id {key!r}: no '.' allowed after the last '/' (drop the file extension)")
    if key.startswith("__"):
        raise ValueError(f"image id {key!r}: must not start with '__' (reserved by webdataset)")


def assign_shards(image_ids: Sequence[str], shard_size: int) -> list[list[str]]:
    """Chunk the sorted image ids into shards of ``shard_size`` (the last may be smaller).

    Sorting makes the assignment independent of listing order, so every task and every
    rerun computes the same shards.
    """
    if isinstance(shard_size, bool) or not isinstance(shard_size, (int, np.integer)) or shard_size < 1:
        raise ValueError(f"shard_size must be an integer >= 1, got {shard_size!r}")
    ids = sorted(image_ids)
    for key in ids:
        check_key(key)
    for prev, cur in zip(ids, ids[1:]):
        if prev == cur:
            raise ValueError(f"image id {cur!r} appears twice; image ids must be unique")
    return [ids[start : start + shard_size] for start in range(0, len(ids), shard_size)]


def shards_for_task(n_shards: int, task_index: int, num_tasks: int) -> list[int]:
    """Shards owned by task ``task_index`` of ``num_tasks``: strided (``i % num_tasks == task_index``).

    Strided rather than contiguous so that the smaller last shard and any slow region of
    the sorted ids spread over tasks; every shard belongs to exactly one task.
    """
    if n_shards < 0:
        raise ValueError(f"n_shards must be >= 0, got {n_shards}")
    if num_tasks < 1:
        raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
    if not 0 <= task_index < num_tasks:
        raise ValueError(f"task_index must be in [0, {num_tasks - 1}] for num_tasks={num_tasks}, got {task_index}")
    return list(range(task_index, n_shards, num_tasks))


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


def _read_json(fpath: Path, what: str) -> dict:
    try:
        with open(fpath, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as exn:
        raise ShardFormatError(f"{fpath}: {what} is not valid JSON ({exn}); rewrite it") from None
    if not isinstance(obj, dict):
        raise ShardFormatError(f"{fpath}: {what} must be a JSON object")
    return obj


def _encode_positions(key: str, positions: np.ndarray, n_tokens: int) -> bytes:
    """``positions.npy`` of a sample holding a token subset: int16/int32 ``[n_tokens]``, strictly ascending."""
    if not isinstance(positions, np.ndarray) or positions.dtype not in (np.int16, np.int32) \
            or positions.shape != (n_tokens,):
        got = f"{positions.dtype} {list(positions.shape)}" if isinstance(positions, np.ndarray) else type(positions)
        raise ValueError(f"sample {key!r}: positions must be int16 or int32 [{n_tokens}], got {got}")
    if positions[0] < 0 or (n_tokens > 1 and not (np.diff(positions) > 0).all()):
        raise ValueError(f"sample {key!r}: positions must be >= 0 and strictly ascending")
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(positions), allow_pickle=False)
    return buf.getvalue()


def _encode_sample(key: str, tokens: np.ndarray, meta: dict, d: int | None, n_tokens: int | None,
                   positions: np.ndarray | None = None) -> dict:
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
    sample = {"__key__": key, "meta.json": meta_bytes, "tokens.npy": buf.getvalue()}
    if positions is not None:
        sample["positions.npy"] = _encode_positions(key, positions, tokens.shape[0])
    return sample


def write_shard(shards_dpath: Path, index: int, samples: Iterable[tuple]) -> dict:
    """Write shard ``index`` from ``(key, tokens float16 [n_tokens, d], meta)`` samples.

    A sample of a token subset is ``(key, tokens, meta, positions)``: ``positions.npy``
    (``token_selection.selected_positions``) is stored beside its tokens.

    Streams to ``shard-NNNNNN.tar.tmp`` while hashing, fsyncs, renames, then writes the
    sidecar atomically. On any exception the ``.tmp`` is removed (and the sidecar is not
    written), so other shards and a later rerun are unaffected. Returns the sidecar dict.
    """
    shards_dpath = Path(shards_dpath)
    shards_dpath.mkdir(parents=True, exist_ok=True)
    tar_fpath = shards_dpath / shard_fname(index)
    tmp_fpath = tar_fpath.with_name(tar_fpath.name + ".tmp")
    stats = RunningStats(0)
    seen: set[str] = set()
    d = n_tokens = None
    checksums: dict[str, list[str]] = {"tokens.npy": [], "positions.npy": []}
    try:
        with open(tmp_fpath, "wb") as f:
            hashing = _HashingWriter(f)
            # PAX is tarfile's default (TarWriter does not forward `format`): long and non-ASCII ids fit.
            with wds.TarWriter(hashing, encoder=False, mtime=TAR_MTIME) as writer:
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
                        raise ValueError(f"sample {key!r}: tokens contain inf/nan (float16 overflow?); "
                                         "check the backbone output")
                    stats = stats.merge(sample_stats)
                    for member in checksums:
                        if member in sample:
                            checksums[member].append(integrity.digest(sample[member]))
                    writer.write(sample)
            f.flush()
            os.fsync(f.fileno())
        # A stale sidecar must not vouch for the new tar, even for a moment.
        (shards_dpath / sidecar_fname(index)).unlink(missing_ok=True)
        os.replace(tmp_fpath, tar_fpath)
    except BaseException:
        tmp_fpath.unlink(missing_ok=True)
        raise
    fsync_dir(shards_dpath)
    if len(checksums["positions.npy"]) != len(seen):  # all-token extraction: no positions.npy
        del checksums["positions.npy"]
    sidecar = {"index": int(index), "count": len(seen), "n_tokens": stats.n_tokens,
               "sha256": hashing.sha256.hexdigest(), integrity.ALGORITHM: hashing.xxh3.hexdigest(),
               "bytes": hashing.n_bytes, "stats": stats.to_json(),
               "sample_checksums": {"algorithm": integrity.ALGORITHM, **checksums}}
    write_json_atomic(shards_dpath / sidecar_fname(index), sidecar)
    return sidecar


def read_sidecar(shards_dpath: Path, index: int) -> dict:
    """Read shard ``index``'s sidecar; ShardFormatError if missing or malformed."""
    fpath = Path(shards_dpath) / sidecar_fname(index)
    if not fpath.is_file():
        raise ShardFormatError(f"{fpath}: sidecar missing; shard {index} is unfinished, rerun its extraction task")
    sidecar = _read_json(fpath, "sidecar")
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


def format_indices(indices: list[int], limit: int = 20) -> str:
    shown = ", ".join(str(i) for i in indices[:limit])
    return shown + (f", ... ({len(indices)} in all)" if len(indices) > limit else "")


def finalize_manifest(shards_dpath: Path, *, n_shards: int, spec: dict, layer: int, tokens_per_image: int,
                      n_prefix_tokens: int, grid: tuple[int, int], skipped: list[dict] | None = None,
                      extra: dict | None = None, token_selection: dict | None = None) -> dict:
    """Merge all sidecars into ``manifest.json`` (written atomically) and return it.

    ``n_prefix_tokens`` and ``grid`` are the backbone's full layout; ``tokens_per_image``
    is what each sample stores: all tokens, or ``token_selection``'s subset
    (``feature_extraction.token_selection``). Raises ShardFormatError listing the missing
    shard indices when any shard is incomplete, and when the token counts disagree with
    ``tokens_per_image``.
    """
    from feature_extraction import __version__

    shards_dpath = Path(shards_dpath)
    if n_shards < 1:
        raise ValueError(f"n_shards must be >= 1, got {n_shards}")
    grid = (int(grid[0]), int(grid[1]))
    kinds = token_kinds(n_prefix_tokens, grid, token_selection)
    if n_prefix_tokens < 0 or tokens_per_image != sum(kinds.values()):
        raise ValueError(f"tokens_per_image={tokens_per_image} must equal the stored token kinds {kinds} "
                         f"(n_prefix_tokens={n_prefix_tokens}, grid {grid[0]}x{grid[1]}, "
                         f"token_selection={token_selection})")
    for name, value in (("spec", spec), ("skipped", skipped), ("extra", extra)):
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exn:
            raise ValueError(f"finalize_manifest {name} must be JSON-serialisable ({exn})") from None
    missing = [i for i in range(n_shards) if not shard_is_complete(shards_dpath, i)]
    if missing:
        raise ShardFormatError(f"{shards_dpath}: shards {format_indices(missing)} of {n_shards} are incomplete; "
                               "run the extraction tasks that own them")
    strays = sorted(int(p.stem.split("-")[1]) for p in shards_dpath.glob("shard-*.json")
                    if p.stem.split("-")[1].isdigit() and int(p.stem.split("-")[1]) >= n_shards)
    if strays:
        raise ShardFormatError(f"{shards_dpath}: found shards {format_indices(strays)} beyond n_shards={n_shards}; "
                               "pass the right n_shards or remove them")
    stats = RunningStats(0)
    entries = []
    for i in range(n_shards):
        sidecar = read_sidecar(shards_dpath, i)
        if sidecar["n_tokens"] != sidecar["count"] * tokens_per_image:
            raise ShardFormatError(f"{shards_dpath / sidecar_fname(i)}: field 'n_tokens' is {sidecar['n_tokens']}, "
                                   f"expected count*tokens_per_image = {sidecar['count']}*{tokens_per_image}")
        try:
            stats = stats.merge(RunningStats.from_json(sidecar["stats"]))
        except ValueError as exn:
            raise ShardFormatError(f"{shards_dpath / sidecar_fname(i)}: field 'stats': {exn}") from None
        entries.append({"fname": shard_fname(i), **{k: sidecar[k] for k in SHARD_FIELDS[1:]}})
    if stats.n_tokens == 0:
        raise ShardFormatError(f"{shards_dpath}: the shards hold no tokens; check the image source")
    manifest = {
        "schema_version": SCHEMA_VERSION, "backbone": spec, "layer": int(layer), "d": stats.d, "dtype": DTYPE,
        "tokens_per_image": int(tokens_per_image), "n_prefix_tokens": int(n_prefix_tokens), "grid": list(grid),
        "token_selection": token_selection, "token_kinds": kinds,
        "n_images": sum(e["count"] for e in entries), "n_tokens": stats.n_tokens, "shards": entries,
        "stats": {"mean": stats.mean().tolist(), "mean_sq_norm": stats.mean_sq_norm(), "n_tokens": stats.n_tokens},
        "skipped": list(skipped or []), "package_version": __version__,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "extra": dict(extra or {}),
    }
    write_json_atomic(shards_dpath / MANIFEST_FNAME, manifest)
    return manifest


def load_manifest(shards_dpath: Path | str, verify: bool = False) -> dict:
    """Read and check ``manifest.json`` and the shard files it lists.

    Always checks fields, schema version, dtype and each shard's existence and size;
    ``verify=True`` also recomputes every sha256 (reads all the data).
    """
    shards_dpath = Path(shards_dpath)
    if not shards_dpath.is_dir():
        raise ShardFormatError(f"{shards_dpath}: shard directory not found; check the path or run the extraction")
    fpath = shards_dpath / MANIFEST_FNAME
    if not fpath.is_file():
        raise ShardFormatError(_no_manifest_advice(shards_dpath))
    manifest = _read_json(fpath, "manifest")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ShardFormatError(f"{fpath}: field 'schema_version' is {manifest.get('schema_version')!r}, this version "
                               f"reads {SCHEMA_VERSION}; re-extract or use a matching feature_extraction")
    for field in REQUIRED_FIELDS:
        if field not in manifest:
            raise ShardFormatError(f"{fpath}: missing field {field!r}; re-run finalize")
    if manifest["dtype"] != DTYPE:
        raise ShardFormatError(f"{fpath}: field 'dtype' is {manifest['dtype']!r}, must be {DTYPE!r}")
    _check_token_layout(manifest, fpath)
    stats = manifest["stats"]
    if not isinstance(stats, dict) or not all(k in stats for k in ("mean", "mean_sq_norm", "n_tokens")) \
            or not isinstance(stats["mean"], list):
        raise ShardFormatError(f"{fpath}: field 'stats' needs mean [d], mean_sq_norm, n_tokens; the manifest was "
                               f"edited or damaged: run `python -m feature_extraction finalize --out {shards_dpath}`")
    if isinstance(manifest["d"], bool) or not isinstance(manifest["d"], int) or manifest["d"] != len(stats["mean"]):
        raise ShardFormatError(f"{fpath}: field 'd' is {manifest['d']!r} but the shards' statistics have "
                               f"{len(stats['mean'])} dimensions; the manifest was edited: run "
                               f"`python -m feature_extraction finalize --out {shards_dpath}` to rewrite it")
    if not isinstance(manifest["shards"], list) or not manifest["shards"]:
        raise ShardFormatError(f"{fpath}: field 'shards' must be a non-empty list")
    for entry in manifest["shards"]:
        if not isinstance(entry, dict) or any(k not in entry for k in SHARD_FIELDS):
            raise ShardFormatError(f"{fpath}: field 'shards' entry {entry!r} needs {', '.join(SHARD_FIELDS)}")
        if Path(entry["fname"]).name != entry["fname"]:
            raise ShardFormatError(f"{fpath}: field 'shards' fname {entry['fname']!r} must be a plain file name")
    for field in ("n_images", "n_tokens"):
        total = sum(e["count" if field == "n_images" else "n_tokens"] for e in manifest["shards"])
        if manifest[field] != total:
            raise ShardFormatError(f"{fpath}: field {field!r} is {manifest[field]}, the shards sum to {total}")
    for entry in manifest["shards"]:
        shard_fpath = shards_dpath / entry["fname"]
        if not shard_fpath.is_file():
            raise ShardFormatError(f"{shard_fpath}: listed in {MANIFEST_FNAME} field 'shards' but missing; "
                                   "restore it or re-run its extraction task")
        size = shard_fpath.stat().st_size
        if size != entry["bytes"]:
            raise ShardFormatError(f"{shard_fpath}: size {size} differs from field 'bytes' = {entry['bytes']} in "
                                   f"{MANIFEST_FNAME}; the file is truncated or replaced, re-extract it")
        if verify and integrity.file_sha256(shard_fpath) != entry["sha256"]:
            raise ShardFormatError(f"{shard_fpath}: sha256 differs from field 'sha256' in {MANIFEST_FNAME}; "
                                   "the file is corrupt, re-extract it")
    return manifest


def manifest_sha256(manifest: dict) -> str:
    """sha256 of a shard manifest, ignoring ``created_at`` (which changes on every finalize),
    so the hash names the data, not the moment it was indexed."""
    content = {key: value for key, value in manifest.items() if key != "created_at"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode("utf-8")).hexdigest()


def _no_manifest_advice(shards_dpath: Path) -> str:
    """Why ``shards_dpath`` has no manifest, and the fix that works there (not a finalize that would fail)."""
    fpath = shards_dpath / MANIFEST_FNAME
    if (shards_dpath / "extraction.json").is_file():
        return (f"{fpath}: missing, the extraction is unfinished; finish its tasks (rerun the extraction) or run "
                f"`python -m feature_extraction finalize --out {shards_dpath}` once every shard exists")
    if any(shards_dpath.glob("shard-*.json")):
        return (f"{fpath}: missing, and without extraction.json `finalize` cannot rebuild it; write it with "
                "feature_extraction.shards.finalize_manifest (as the code that wrote these shards should) or re-extract")
    nested = sorted(p.parent for p in shards_dpath.glob(f"*/{MANIFEST_FNAME}"))
    if nested:
        names = ", ".join(str(p) for p in nested[:5]) + (", ..." if len(nested) > 5 else "")
        return (f"{shards_dpath}: holds no {MANIFEST_FNAME} but its sub-directories do; pass one of them: {names}")
    return (f"{shards_dpath}: not a shard directory (no {MANIFEST_FNAME}); pass the --out directory of a "
            "finished `python -m feature_extraction` run, or extract into it first")


def _check_token_layout(manifest: dict, fpath: Path) -> None:
    """Check ``token_selection`` / ``token_kinds``; a manifest older than them is filled in as all tokens."""
    selection = manifest.setdefault("token_selection", None)
    n_patches = int(manifest["grid"][0]) * int(manifest["grid"][1])
    if selection is not None and (not isinstance(selection, dict) or set(selection) != {
            "patches_per_image", "keep_prefix_tokens", "seed"} or not isinstance(selection["patches_per_image"], int)
            or not 1 <= selection["patches_per_image"] <= n_patches):
        raise ShardFormatError(f"{fpath}: field 'token_selection' must be null or {{patches_per_image in [1, "
                               f"{n_patches}], keep_prefix_tokens, seed}}, got {selection!r}; re-run finalize")
    kinds = token_kinds(manifest["n_prefix_tokens"], manifest["grid"], selection)
    if manifest.setdefault("token_kinds", kinds) != kinds or manifest["tokens_per_image"] != sum(kinds.values()):
        raise ShardFormatError(f"{fpath}: fields 'tokens_per_image' {manifest['tokens_per_image']} and "
                               f"'token_kinds' {manifest['token_kinds']} disagree with the layout {kinds} of "
                               f"'token_selection' ({full_token_count(manifest['n_prefix_tokens'], manifest['grid'])}"
                               " tokens in all); re-run finalize")


def shard_fpaths(shards_dpath: Path | str, manifest: dict) -> list[Path]:
    """Absolute paths of the manifest's shards, in shard order."""
    shards_dpath = Path(shards_dpath).resolve()
    return [shards_dpath / entry["fname"] for entry in manifest["shards"]]
