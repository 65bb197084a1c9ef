"""``manifest.json``: assembled from the sidecars once every shard exists, read by everything downstream.

Design choices:
- The manifest lists every shard (name, count, tokens, sha256, bytes), the backbone spec,
  the token layout (``tokens_per_image``, prefix tokens, grid, ``token_selection`` and
  ``token_kinds``) and the normalisation statistics merged from the sidecars' float64
  running sums (no re-read of the tokens). It is written atomically.
- ``load_manifest`` checks fields, each listed shard's existence and size (sha256 on
  request) and the statistics against the sidecars (``manifest_stats``); ``peek_manifest``
  only parses it, for commands that just want to know which backbone a directory holds.
- ``manifest_sha256`` names the data (``created_at`` left out), so exports and checkpoints
  record which manifest they were trained on.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from feature_extraction.atomic_files import write_json_atomic
from feature_extraction.file_checks import (
    INT,
    load_json,
)
from feature_extraction.file_hashes import file_sha256
from feature_extraction.running_stats import RunningStats
from feature_extraction.shards.layout import (
    DTYPE,
    EXTRACTION_FNAME,
    MANIFEST_FNAME,
    SCHEMA_VERSION,
    SIDECAR_GLOB,
    ShardFormatError,
    shard_fname,
    sidecar_fname,
    sidecar_index,
)
from feature_extraction.shards.manifest_checks import REQUIRED_FIELDS, SHARD_FIELDS, check_manifest_fields
from feature_extraction.shards.manifest_stats import check_manifest_stats
from feature_extraction.shards.sidecar import (
    incomplete_reason,
    read_json_object,
    read_sidecar,
    shard_is_complete,
)
from feature_extraction.store import location
from feature_extraction.token_selection import token_kinds
from feature_extraction.validate import check_int

__all__ = [
    "REQUIRED_FIELDS",
    "SHARD_FIELDS",
    "backbone_name",
    "extraction_record",
    "format_indices",
    "load_manifest",
    "manifest_sha256",
    "peek_manifest",
    "shard_fpaths",
    "write_manifest",
]


def format_indices(indices: list[int], limit: int = 20) -> str:
    shown = ", ".join(str(i) for i in indices[:limit])
    return shown + (f", ... ({len(indices)} in all)" if len(indices) > limit else "")


def write_manifest(
    shards_dpath: Path,
    *,
    n_shards: int,
    spec: dict,
    layer: int,
    tokens_per_image: int,
    n_prefix_tokens: int,
    grid: tuple[int, int],
    skipped: list[dict] | None = None,
    extra: dict | None = None,
    token_selection: dict | None = None,
) -> dict:
    """Merge all sidecars into ``manifest.json`` (written atomically) and return it.

    ``n_prefix_tokens`` and ``grid`` are the backbone's full layout; ``tokens_per_image``
    is what each sample stores: all tokens, or ``token_selection``'s subset
    (``feature_extraction.token_selection``). Raises ShardFormatError listing the missing
    shard indices when any shard is incomplete, and when the token counts disagree with
    ``tokens_per_image``.
    """
    from feature_extraction import __version__

    shards_dpath = location(shards_dpath)  # a folder, or a prefix in a store (the manifest is then one PUT)
    check_int("n_shards", n_shards, 1)
    grid = (int(grid[0]), int(grid[1]))
    kinds = token_kinds(n_prefix_tokens, grid, token_selection)
    if n_prefix_tokens < 0 or tokens_per_image != sum(kinds.values()):
        raise ValueError(
            f"tokens_per_image={tokens_per_image} must equal the stored token kinds {kinds} "
            f"(n_prefix_tokens={n_prefix_tokens}, grid {grid[0]}x{grid[1]}, "
            f"token_selection={token_selection})"
        )
    for name, value in (("spec", spec), ("skipped", skipped), ("extra", extra)):
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exn:
            raise ValueError(f"write_manifest {name} must be JSON-serialisable ({exn})") from None
    missing = [i for i in range(n_shards) if not shard_is_complete(shards_dpath, i)]
    for i in missing:
        if (shards_dpath / sidecar_fname(i)).is_file():
            read_sidecar(shards_dpath, i)  # a damaged sidecar is named, not counted as unfinished
    if missing:
        raise ShardFormatError(
            f"{shards_dpath}: shards {format_indices(missing)} of {n_shards} are incomplete (the first: "
            f"{incomplete_reason(shards_dpath, missing[0])}); run the extraction tasks that own them"
        )
    strays = sorted(i for p in shards_dpath.glob(SIDECAR_GLOB) if (i := sidecar_index(p)) is not None and i >= n_shards)
    if strays:
        raise ShardFormatError(
            f"{shards_dpath}: found shards {format_indices(strays)} beyond n_shards={n_shards}; "
            "pass the right n_shards or remove them"
        )
    stats = RunningStats(0)
    entries = []
    for i in range(n_shards):
        sidecar = read_sidecar(shards_dpath, i)
        if sidecar["n_tokens"] != sidecar["count"] * tokens_per_image:
            raise ShardFormatError(
                f"{shards_dpath / sidecar_fname(i)}: field 'n_tokens' is {sidecar['n_tokens']}, "
                f"expected count*tokens_per_image = {sidecar['count']}*{tokens_per_image}"
            )
        try:
            stats = stats.merge(RunningStats.from_json(sidecar["stats"]))
        except ValueError as exn:
            raise ShardFormatError(f"{shards_dpath / sidecar_fname(i)}: field 'stats': {exn}") from None
        entries.append({"fname": shard_fname(i), **{k: sidecar[k] for k in SHARD_FIELDS[1:]}})
    if stats.n_tokens == 0:
        raise ShardFormatError(f"{shards_dpath}: the shards hold no tokens; check the image source")
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "backbone": spec,
        "layer": int(layer),
        "d": stats.d,
        "dtype": DTYPE,
        "tokens_per_image": int(tokens_per_image),
        "n_prefix_tokens": int(n_prefix_tokens),
        "grid": list(grid),
        "token_selection": token_selection,
        "token_kinds": kinds,
        "n_images": sum(e["count"] for e in entries),
        "n_tokens": stats.n_tokens,
        "shards": entries,
        "stats": {"mean": stats.mean().tolist(), "mean_sq_norm": stats.mean_sq_norm(), "n_tokens": stats.n_tokens},
        "skipped": list(skipped or []),
        "package_version": __version__,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "extra": dict(extra or {}),
    }
    write_json_atomic(shards_dpath / MANIFEST_FNAME, manifest)
    return manifest


def load_manifest(shards_dpath: Path | str, verify: bool = False) -> dict:
    """Read and check ``manifest.json`` and the shard files it lists.

    Always checks fields, schema version, dtype, each shard's existence and size and the
    statistics against the sidecars (:mod:`~feature_extraction.shards.manifest_stats`);
    ``verify=True`` also recomputes every sha256 (reads all the data).
    """
    shards_dpath = location(shards_dpath)
    if not shards_dpath.is_dir():
        raise ShardFormatError(f"{shards_dpath}: shard directory not found; check the path or run the extraction")
    fpath = shards_dpath / MANIFEST_FNAME
    if not fpath.is_file():
        raise ShardFormatError(_no_manifest_advice(shards_dpath))
    manifest = read_json_object(fpath, "manifest")
    check_manifest_fields(manifest, fpath, shards_dpath)
    for entry in manifest["shards"]:
        shard_fpath = shards_dpath / entry["fname"]
        if not shard_fpath.is_file():
            raise ShardFormatError(
                f"{shard_fpath}: listed in {MANIFEST_FNAME} field 'shards' but missing; "
                "restore it or re-run its extraction task"
            )
        size = shard_fpath.stat().st_size
        if size != entry["bytes"]:
            raise ShardFormatError(
                f"{shard_fpath}: size {size} differs from field 'bytes' = {entry['bytes']} in "
                f"{MANIFEST_FNAME}; the file is truncated or replaced, re-extract it"
            )
        if verify and _sha256(shard_fpath) != entry["sha256"]:
            raise ShardFormatError(
                f"{shard_fpath}: sha256 differs from field 'sha256' in {MANIFEST_FNAME}; "
                "the file is corrupt, re-extract it"
            )
    check_manifest_stats(shards_dpath, manifest)  # a hand-edited 'stats' would train on the wrong scale
    return manifest


def _sha256(fpath: Path) -> str:
    """sha256 of a shard file, or of an object in a store (fetched whole)."""
    return hashlib.sha256(fpath.fetch()).hexdigest() if hasattr(fpath, "fetch") else file_sha256(fpath)


def manifest_sha256(manifest: dict) -> str:
    """sha256 of a shard manifest, ignoring ``created_at`` (which changes on every finalize),
    so the hash names the data, not the moment it was indexed."""
    content = {key: value for key, value in manifest.items() if key != "created_at"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode("utf-8")).hexdigest()


def peek_manifest(shards_dpath: Path | str) -> dict | None:
    """The manifest's fields, parsed but not checked (None: no readable ``manifest.json`` object there).

    For commands that only need to know what a directory holds (which backbone and layer),
    not to read its shards; ``load_manifest`` is the full check.
    """
    fpath = location(shards_dpath) / MANIFEST_FNAME
    try:
        return load_json(fpath, what="manifest", fix="", kind=dict)  # bounded: a forged one is None, not a crash
    except (OSError, ValueError):
        return None


def backbone_name(manifest: dict) -> str | None:
    """The registry name of the backbone a manifest's shards come from (``dinov2``, ...), if it says."""
    backbone = manifest.get("backbone")
    name = backbone.get("name") if isinstance(backbone, dict) else backbone
    return name if isinstance(name, str) and name else None


def extraction_record(manifest: dict) -> dict | None:
    """What turns an image into this manifest's tokens: the backbone record (spec, layer, preprocessing,
    pretrained flag, checkpoint path), the random weights' seed, and the token selection and layout.

    Kept in checkpoints and exports (their ``data.extraction``) so that ``features explain`` can run
    the same backbone on new images from the SAE alone. None when the manifest records no backbone
    that can be rebuilt (shards written by hand or by an older extraction).
    """
    backbone = manifest.get("backbone")
    if not isinstance(backbone, dict) or not backbone.get("library") or not INT.test(manifest.get("layer")):
        return None  # also a manifest only peeked at whose fields are of other kinds
    extra = manifest.get("extra")
    extraction = (extra.get("extraction") if isinstance(extra, dict) else None) or {}
    extraction = extraction if isinstance(extraction, dict) else {}
    weights = extraction.get("weights") if isinstance(extraction.get("weights"), dict) else None
    weights = weights or {
        "pretrained": bool(backbone.get("pretrained")),
        "checkpoint_path": backbone.get("checkpoint_path"),
        "seed": None,
    }
    return {
        "backbone": backbone,
        "layer": int(manifest["layer"]),
        "weights": weights,
        "token_selection": manifest.get("token_selection"),
        "tokens_per_image": manifest.get("tokens_per_image"),
        "n_prefix_tokens": manifest.get("n_prefix_tokens"),
        "grid": manifest.get("grid"),
        "d": manifest.get("d"),
    }


def _no_manifest_advice(shards_dpath: Path) -> str:
    """Why ``shards_dpath`` has no manifest, and the fix that works there (not a finalize that would fail)."""
    fpath = shards_dpath / MANIFEST_FNAME
    if (shards_dpath / EXTRACTION_FNAME).is_file():
        return (
            f"{fpath}: missing, the extraction is unfinished; finish its tasks (rerun the extraction) or run "
            f"`python -m feature_extraction finalize --out {shards_dpath}` once every shard exists"
        )
    if any(shards_dpath.glob(SIDECAR_GLOB)):
        return (
            f"{fpath}: missing, and without {EXTRACTION_FNAME} `finalize` cannot rebuild it; write it with "
            "feature_extraction.shards.write_manifest (as the code that wrote these shards should) or re-extract"
        )
    nested = sorted(p.parent for p in shards_dpath.glob(f"*/{MANIFEST_FNAME}"))
    if nested:
        names = ", ".join(str(p) for p in nested[:5]) + (", ..." if len(nested) > 5 else "")
        return f"{shards_dpath}: holds no {MANIFEST_FNAME} but its sub-directories do; pass one of them: {names}"
    return (
        f"{shards_dpath}: not a shard directory (no {MANIFEST_FNAME}); pass the --out directory of a "
        "finished `python -m feature_extraction` run, or extract into it first"
    )


def shard_fpaths(shards_dpath: Path | str, manifest: dict) -> list[Path]:
    """Absolute paths of the manifest's shards, in shard order."""
    shards_dpath = location(shards_dpath).resolve()
    return [shards_dpath / entry["fname"] for entry in manifest["shards"]]
