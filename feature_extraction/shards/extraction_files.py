"""An extraction's own files read back: its record (`extraction.json`) and each shard's `skipped-N.json`.

Both are written whole by the extraction, but they live in a folder (or a store's prefix) that anyone
may edit or PUT into, and `finalize` builds the manifest from them. So each is read with bounds
(`feature_extraction.file_checks`: size, nesting, UTF-8, no NaN) and every field `finalize` relies on
is checked before it is used: a damaged file is one `ShardFormatError` line naming it and the fix
(exit 2), never a `KeyError` or `TypeError` traceback, and a forged `n_shards` does not start a loop
over 10¹⁸ shards.
"""

from __future__ import annotations

from pathlib import Path

from feature_extraction.file_checks import (
    BOOL,
    COUNT,
    INT,
    OBJECT,
    TEXT,
    Kind,
    check_fields,
    list_of,
    load_json,
    nullable,
)
from feature_extraction.shards import integrity
from feature_extraction.shards.layout import EXTRACTION_FNAME, ShardFormatError, sidecar_fname
from feature_extraction.store import RemotePath, location

__all__ = ["MAX_RECORD_BYTES", "MAX_SHARDS", "MAX_SKIPPED_BYTES", "load_record", "read_record", "read_skipped"]

MAX_RECORD_BYTES = 1 << 20  # a record holds a backbone's description and a few settings: a few KB
MAX_SKIPPED_BYTES = 16 << 20  # a few hundred bytes per undecodable image of one shard
MAX_SHARDS = 1_000_000  # a billion images at 1000 per shard

_POSITIVE = Kind(lambda v: COUNT.test(v) and v >= 1, "an integer >= 1")
_GRID = Kind(lambda v: list_of(_POSITIVE).test(v) and len(v) == 2, "a list of two integers >= 1")
RECORD_FIELDS = {
    "backbone": TEXT,
    "layer": INT,
    "shard_size": _POSITIVE,
    "n_images": COUNT,
    "n_shards": COUNT,
    "ids_sha256": TEXT,
    "weights": OBJECT,
    "images": TEXT,
    "key_scheme": TEXT,
    "backbone_record": OBJECT,
    "token_selection": nullable(OBJECT),
}
BACKBONE_FIELDS = {"n_prefix_tokens": COUNT, "grid": _GRID}
SELECTION_FIELDS = {"patches_per_image": _POSITIVE, "keep_prefix_tokens": BOOL, "seed": INT}
SKIPPED_FIELDS = {"image_id": TEXT, "reason": TEXT, "source": TEXT, "shard": COUNT}
_OPTIONAL = ("source", "shard")


def load_record(out_dpath: Path | RemotePath, fix: str) -> dict:
    """`extraction.json` of `out_dpath` as a JSON object, parsed with bounds (its fields unchecked: a record
    another extraction wrote is compared field by field, `finalize.check_or_create_record`)."""
    fpath = location(out_dpath) / EXTRACTION_FNAME
    return load_json(
        fpath, what="extraction record", fix=fix, max_bytes=MAX_RECORD_BYTES, kind=dict, error=ShardFormatError
    )


def read_record(out_dpath: Path | RemotePath) -> dict:
    """`extraction.json` of `out_dpath` with every field `finalize` uses checked (module docstring)."""
    fpath = location(out_dpath) / EXTRACTION_FNAME
    if not fpath.is_file():
        raise ValueError(f"{fpath} not found: --out must be a directory written by `python -m feature_extraction`")
    fix = "rerun one extraction task with the same settings to rewrite it (delete it first)"
    record = load_record(out_dpath, fix)
    check = dict(source=fpath, fix=fix, error=ShardFormatError)
    check_fields(record, RECORD_FIELDS, what="extraction record", optional=("token_selection",), **check)
    check_fields(record["backbone_record"], BACKBONE_FIELDS, what="extraction record's 'backbone_record'", **check)
    selection = record.get("token_selection")
    if selection is not None:
        check_fields(selection, SELECTION_FIELDS, what="extraction record's 'token_selection'", **check)
        n_patches = record["backbone_record"]["grid"][0] * record["backbone_record"]["grid"][1]
        if selection["patches_per_image"] > n_patches:
            raise ShardFormatError(
                f"{fpath}: extraction record field 'token_selection' keeps {selection['patches_per_image']} patches "
                f"of the backbone's {n_patches}; {fix}"
            )
    n_images, shard_size, n_shards = record["n_images"], record["shard_size"], record["n_shards"]
    if n_shards != -(-n_images // shard_size) or not 1 <= n_shards <= MAX_SHARDS:
        raise ShardFormatError(
            f"{fpath}: extraction record field 'n_shards' is {n_shards}, but {n_images} images in shards of "
            f"{shard_size} make {-(-n_images // shard_size)} (at most {MAX_SHARDS}); {fix}"
        )
    return record


def read_skipped(fpath: Path | RemotePath, out_dpath: Path | RemotePath, index: int) -> list[dict]:
    """Shard ``index``'s list of undecodable images, as its writer wrote it: a JSON list of objects. Anything
    else (a truncated upload, someone else's file) is a one-line ShardFormatError naming the file and the fix:
    without its sidecar the shard is not whole, so the extraction's rerun writes both again."""
    fix = f"delete it and {out_dpath / sidecar_fname(index)}, then {integrity.repair_command(out_dpath)}"
    skipped = load_json(
        fpath, what="skipped list", fix=fix, max_bytes=MAX_SKIPPED_BYTES, kind=list, error=ShardFormatError
    )
    for number, entry in enumerate(skipped):
        if not isinstance(entry, dict):
            raise ShardFormatError(f"{fpath}: skipped list entry {number} must be a JSON object; {fix}")
        check = dict(source=fpath, what=f"skipped list entry {number}", fix=fix, error=ShardFormatError)
        check_fields(entry, SKIPPED_FIELDS, optional=_OPTIONAL, **check)
    return skipped
