"""A manifest read back, its fields checked before any reader relies on them (a manifest is someone else's file).

Why apart from `manifest.py`: that module writes the manifest and reads it with its shard files; this one is the
list of what a manifest must hold and how each field is checked, the part a forged or damaged file meets first
(tests/test_fuzz_shard_files.py). Every failure is one `ShardFormatError` naming the file and the fix.
"""

from __future__ import annotations

from pathlib import Path

from feature_extraction.file_checks import (
    COUNT,
    INT,
    LIST,
    NUMBER,
    OBJECT,
    TEXT,
    Kind,
    check_fields,
    list_of,
    nullable,
    shown,
)
from feature_extraction.shards import integrity
from feature_extraction.shards.layout import (
    DTYPE,
    MANIFEST_FNAME,
    SCHEMA_VERSION,
    ShardFormatError,
    sidecar_fpath,
    sidecar_index,
)
from feature_extraction.shards.sidecar import MIN_SAMPLE_BYTES, read_sidecar
from feature_extraction.token_selection import full_token_count, token_kinds

__all__ = ["REQUIRED_FIELDS", "SHARD_FIELDS", "check_manifest_fields"]

REQUIRED_FIELDS = (
    "schema_version",
    "backbone",
    "layer",
    "d",
    "dtype",
    "tokens_per_image",
    "n_prefix_tokens",
    "grid",
    "n_images",
    "n_tokens",
    "shards",
    "stats",
    "skipped",
    "package_version",
    "created_at",
)
SHARD_FIELDS = ("fname", "count", "n_tokens", "sha256", "bytes")
# what the readers rely on, checked before it is used (a manifest is someone else's file)
_BACKBONE = Kind(lambda v: isinstance(v, (dict, str)), "a JSON object or a string")
_GRID = Kind(lambda v: list_of(COUNT).test(v) and len(v) == 2, "a list of two integers >= 0")
MANIFEST_KINDS = {
    "schema_version": INT,
    "backbone": _BACKBONE,
    "layer": INT,
    "d": COUNT,
    "dtype": TEXT,
    "tokens_per_image": COUNT,
    "n_prefix_tokens": COUNT,
    "grid": _GRID,
    "n_images": COUNT,
    "n_tokens": COUNT,
    "shards": LIST,
    "stats": OBJECT,
    "skipped": LIST,
    "token_selection": nullable(OBJECT),
    "extra": OBJECT,
}
STATS_KINDS = {"mean": list_of(NUMBER), "mean_sq_norm": NUMBER, "n_tokens": COUNT}
SHARD_KINDS = {"fname": TEXT, "count": COUNT, "n_tokens": COUNT, "sha256": TEXT, "bytes": COUNT}


def check_manifest_fields(manifest: dict, fpath: Path, shards_dpath: Path) -> None:
    """Every field a reader uses, of the manifest ``fpath`` parsed as ``manifest`` (filled in where an older
    manifest lacks the token layout)."""
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ShardFormatError(
            f"{fpath}: field 'schema_version' is {shown(manifest.get('schema_version'))}, this version "
            f"reads {SCHEMA_VERSION}; re-extract or use a matching feature_extraction"
        )
    for field in REQUIRED_FIELDS:
        if field not in manifest:
            raise ShardFormatError(f"{fpath}: missing field {field!r}; re-run finalize")
    fix = f"the manifest was edited or damaged: run `python -m feature_extraction finalize --out {shards_dpath}`"
    check = dict(source=fpath, fix=fix, error=ShardFormatError)
    check_fields(manifest, MANIFEST_KINDS, what="manifest", optional=("token_selection", "extra"), **check)
    if manifest["dtype"] != DTYPE:
        raise ShardFormatError(f"{fpath}: field 'dtype' is {shown(manifest['dtype'])}, must be {DTYPE!r}")
    _check_token_layout(manifest, fpath)
    stats = manifest["stats"]
    if not all(k in stats for k in ("mean", "mean_sq_norm", "n_tokens")):
        raise ShardFormatError(f"{fpath}: field 'stats' needs mean [d], mean_sq_norm, n_tokens; {fix}")
    check_fields(stats, STATS_KINDS, what="manifest's 'stats'", **check)
    if manifest["d"] != len(stats["mean"]):
        raise ShardFormatError(
            f"{fpath}: field 'd' is {manifest['d']!r} but the shards' statistics have "
            f"{len(stats['mean'])} dimensions; the manifest was edited: run "
            f"`python -m feature_extraction finalize --out {shards_dpath}` to rewrite it"
        )
    if not manifest["shards"]:
        raise ShardFormatError(f"{fpath}: field 'shards' must be a non-empty list")
    for number, entry in enumerate(manifest["shards"]):
        if not isinstance(entry, dict) or any(k not in entry for k in SHARD_FIELDS):
            raise ShardFormatError(f"{fpath}: field 'shards' entry {shown(entry)} needs {', '.join(SHARD_FIELDS)}")
        check_fields(entry, SHARD_KINDS, what=f"manifest's 'shards' entry {number}", **check)
        fname, longest = entry["fname"], 255  # bytes in a file name, on every file system here
        plain = Path(fname).name == fname and fname not in ("", ".", "..") and "\0" not in fname
        if not plain or len(fname.encode("utf-8", "surrogatepass")) > longest:
            raise ShardFormatError(f"{fpath}: field 'shards' fname {shown(entry['fname'])} must be a plain file name")
        _check_entry_sizes(entry, manifest, fpath)
    for field in ("n_images", "n_tokens"):
        total = sum(e["count" if field == "n_images" else "n_tokens"] for e in manifest["shards"])
        if manifest[field] != total:
            raise ShardFormatError(f"{fpath}: field {field!r} is {manifest[field]}, the shards sum to {total}")


def _check_entry_sizes(entry: dict, manifest: dict, fpath: Path) -> None:
    """A shard entry's samples and tokens must fit in its bytes: what a reader sizes its reads by, checked first."""
    sizes = [entry["count"], entry["n_tokens"], entry["bytes"], manifest["tokens_per_image"], manifest["d"]]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in sizes):
        raise ShardFormatError(
            f"{fpath}: shard {entry['fname']!r}: fields 'count', 'n_tokens', 'bytes', 'tokens_per_image', 'd' must "
            f"be integers >= 0, got {sizes}; re-run finalize"
        )
    count, n_tokens, n_bytes, tokens_per_image, d = sizes
    if n_tokens != count * tokens_per_image or count * (MIN_SAMPLE_BYTES + tokens_per_image * d * 2) > n_bytes:
        if _sidecar_agrees(fpath.parent, entry):  # finalize would write the same manifest: the shard is at fault
            raise ShardFormatError(
                f"{fpath.parent / entry['fname']}: its {n_bytes} bytes cannot hold the {count} samples of "
                f"[{tokens_per_image}, {d}] float16 tokens that its sidecar and {MANIFEST_FNAME} declare: the shard "
                f"was cut short; re-extract it: {integrity.repair_command(fpath.parent)}"
            )
        raise ShardFormatError(
            f"{fpath}: shard {entry['fname']!r} declares {count} samples of [{tokens_per_image}, {d}] float16 tokens "
            f"({n_tokens} tokens), more than its {n_bytes} bytes hold; the manifest is corrupt or forged, "
            f"run `python -m feature_extraction finalize --out {fpath.parent}` to rewrite it"
        )


def _sidecar_agrees(shards_dpath: Path, entry: dict) -> bool:
    """The shard's sidecar, itself sound, records what the manifest entry says (a rewritten manifest would
    say it again)."""
    index = sidecar_index(sidecar_fpath(shards_dpath / entry["fname"]))
    try:
        sidecar = read_sidecar(shards_dpath, index) if index is not None else {}
    except (OSError, ValueError):  # ShardFormatError and StoreError are ValueErrors: a forged sidecar
        return False
    return all(sidecar.get(field) == entry[field] for field in SHARD_FIELDS[1:])


def _check_token_layout(manifest: dict, fpath: Path) -> None:
    """Check ``token_selection`` / ``token_kinds``; a manifest older than them is filled in as all tokens."""
    selection = manifest.setdefault("token_selection", None)
    n_patches = int(manifest["grid"][0]) * int(manifest["grid"][1])
    if selection is not None and (
        not isinstance(selection, dict)
        or set(selection) != {"patches_per_image", "keep_prefix_tokens", "seed"}
        or not COUNT.test(selection["patches_per_image"])
        or not 1 <= selection["patches_per_image"] <= n_patches
        or not isinstance(selection["keep_prefix_tokens"], bool)
        or not INT.test(selection["seed"])
    ):
        raise ShardFormatError(
            f"{fpath}: field 'token_selection' must be null or {{patches_per_image in [1, "
            f"{n_patches}], keep_prefix_tokens, seed}}, got {shown(selection)}; re-run finalize"
        )
    kinds = token_kinds(manifest["n_prefix_tokens"], manifest["grid"], selection)
    if manifest.setdefault("token_kinds", kinds) != kinds or manifest["tokens_per_image"] != sum(kinds.values()):
        raise ShardFormatError(
            f"{fpath}: fields 'tokens_per_image' {manifest['tokens_per_image']} and "
            f"'token_kinds' {shown(manifest['token_kinds'])} disagree with the layout {kinds} of "
            f"'token_selection' ({full_token_count(manifest['n_prefix_tokens'], manifest['grid'])}"
            " tokens in all); re-run finalize"
        )
