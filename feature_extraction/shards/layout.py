"""Every name in a shard directory and the key scheme of its samples, in one place.

Why one module: the writer, the reader, finalize, the extraction and the training side all
have to agree on these names; when each spelt them itself they drifted apart. A directory
written by one extraction (``--out DIR``) holds:

- ``shard-NNNNNN.tar``: the samples of shard N (webdataset tar), written as
  ``shard-NNNNNN.tar.tmp`` and renamed when complete;
- ``shard-NNNNNN.json``: its sidecar (count, sizes, checksums, running sums), written after
  the rename; "tar and sidecar exist, sizes agree" is the completion test;
- ``skipped-NNNNNN.json``: the undecodable images of shard N, if any (merged by finalize);
- ``extraction.json``: what the directory holds (compared by every task and rerun);
- ``manifest.json``: written by finalize once every shard exists; what training reads;
- ``.finalize.lock``: held while a finalize writes the manifest.

Samples (one per image): ``__key__`` = the image id percent-escaped (``image_key``), members
``tokens.npy`` (float16 ``[n_tokens, d]``), ``meta.json`` (original id, label, source) and,
for a token subset, ``positions.npy``. Images go to shards by sorted key and a fixed shard
size (``assign_shards``); task t of T writes shards t, t + T, ... (``shards_for_task``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote

from feature_extraction.atomic_files import TMP_SUFFIX  # a file being written; a rerun overwrites it
from feature_extraction.store import location
from feature_extraction.validate import check_int

__all__ = [
    "DTYPE",
    "EXTRACTION_FNAME",
    "LOCK_FNAME",
    "MANIFEST_FNAME",
    "META_SUFFIX",
    "POSITIONS_SUFFIX",
    "SCHEMA_VERSION",
    "SHARD_FILES_GLOB",
    "SIDECAR_GLOB",
    "TAR_MTIME",
    "TMP_SUFFIX",
    "TOKENS_SUFFIX",
    "ShardFormatError",
    "assign_shards",
    "check_key",
    "image_id_from_key",
    "image_key",
    "member_key",
    "member_name_problem",
    "shard_fname",
    "shards_for_task",
    "sidecar_fname",
    "sidecar_fpath",
    "sidecar_index",
    "skipped_fname",
    "tmp_fpath",
]

SCHEMA_VERSION = 1  # of manifest.json
DTYPE = "float16"  # of every tokens.npy
TAR_MTIME = 0  # fixed header fields make two writes of the same samples byte-identical

MANIFEST_FNAME = "manifest.json"
EXTRACTION_FNAME = "extraction.json"
LOCK_FNAME = ".finalize.lock"
SHARD_FILES_GLOB = "shard-*"  # tars, sidecars and temporaries
SIDECAR_GLOB = "shard-*.json"

TOKENS_SUFFIX = "tokens.npy"
POSITIONS_SUFFIX = "positions.npy"  # only in samples of a token subset (feature_extraction.token_selection)
META_SUFFIX = "meta.json"


class ShardFormatError(ValueError):
    """A shard directory, manifest, sidecar or sample that does not follow the format."""


def shard_fname(index: int) -> str:
    """File name of shard ``index`` (``shard-000042.tar``); zero-padded so names sort by index."""
    check_int("shard index", index, 0)
    return f"shard-{int(index):06d}.tar"


def sidecar_fname(index: int) -> str:
    """File name of shard ``index``'s sidecar (``shard-000042.json``)."""
    return shard_fname(index)[: -len(".tar")] + ".json"


def sidecar_fpath(tar_fpath: Path) -> Path:
    """The sidecar beside a shard tar."""
    return location(tar_fpath).with_suffix(".json")


def sidecar_index(fpath: Path) -> int | None:
    """Shard index of a sidecar path (``shard-000042.json`` -> 42); None for any other name."""
    stem = location(fpath).stem  # a path, or an object in a store
    number = stem.split("-")[1] if stem.startswith("shard-") else ""
    return int(number) if number.isdigit() else None


def skipped_fname(index: int) -> str:
    """Per-shard list of undecodable images (``skipped-000042.json``), merged by finalize."""
    return f"skipped-{int(index):06d}.json"


def tmp_fpath(fpath: Path) -> Path:
    """Where ``fpath`` is written before it is renamed into place (``NAME.tmp``)."""
    return fpath.with_name(fpath.name + TMP_SUFFIX)


def image_key(image_id: str) -> str:
    """The webdataset ``__key__`` of an image id: '%', '.' in the file name and a leading '_' escaped.

    webdataset cuts a member name at the first '.' of its file name and reserves keys
    starting with '__'; percent-escaping keeps the key readable ('cls/img%2Epng') and
    one-to-one with the id.
    """
    head, sep, name = image_id.replace("%", "%25").rpartition("/")
    key = head + sep + name.replace(".", "%2E")
    return "%5F" + key[1:] if key.startswith("_") else key


def image_id_from_key(key: str) -> str:
    """Inverse of ``image_key``."""
    return unquote(key)


def member_key(name: str) -> tuple[str, str]:
    """``(key, suffix)`` of a tar member name, split as webdataset's ``group_by_keys`` splits it."""
    directory, _, base = name.rpartition("/")
    stem, dot, suffix = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), suffix


def member_name_problem(name: str) -> str | None:
    """What makes ``name`` no member of a shard (None: it is ``KEY.SUFFIX`` of the key scheme).

    A shard is read, never unpacked, but its names still travel: a key becomes an image id,
    a path in the feature browser, a line in a report. So a name must be what ``image_key``
    can produce: relative, no empty, ``.`` or ``..`` component, not reserved by webdataset,
    and with a suffix.
    """
    key, suffix = member_key(name)
    parts = key.split("/")
    if name.startswith("/"):
        return "is an absolute path"
    if any(part in ("", ".", "..") for part in parts):
        return "has an empty, '.' or '..' path component (a path outside its sample)"
    if key.startswith("__"):
        return "starts with '__' (reserved by webdataset)"
    if not suffix:
        return "has no suffix (KEY.tokens.npy, KEY.meta.json, KEY.positions.npy)"
    return None


def check_key(key: str) -> None:
    """Reject sample keys that webdataset could not group back into one sample.

    webdataset splits a member name at the first dot of its last path component
    (``member_key``) and skips names that look like ``__meta__``, so such keys would
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
    check_int("shard_size", shard_size, 1)
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
    check_int("n_shards", n_shards, 0)
    check_int("num_tasks", num_tasks, 1)
    check_int("task_index", task_index, 0, num_tasks - 1, note=f" for num_tasks={num_tasks}")
    return list(range(task_index, n_shards, num_tasks))
