"""The shard format, as one unit: webdataset tars of float16 token activations plus a manifest.

Nothing outside this package spells a shard file name or parses a shard, sidecar or
manifest (docs/formats.md, "Shards"); the extraction writes through it and the training
side, the feature browser and the evaluation read through it.

- ``layout.py``: every file name of a shard directory and the key scheme of its samples;
  which image goes to which shard and which task writes it.
- ``write.py``: one shard and its sidecar, whole or absent (``write_shard``);
  ``writers.py``: the extraction's writer processes that call it.
- ``read.py``: random-access reading of a shard's samples (the training stream's reader)
  and webdataset's decoding for any other pipeline (its readers are importable from here:
  ``from feature_extraction.shards import iter_shard_samples``); ``tar_scan.py``: where each
  member of a shard's tar lies (what the reader and the integrity checks share), each member
  checked first; ``npy.py``: a member's ``.npy`` header, its declared size checked before anything
  is allocated (docs/formats.md, "What a reader refuses"); ``meta.py``: a sample's ``meta.json``, the one
  reader of both.
- ``sidecar.py``: a shard's sidecar, and the completion and intactness tests.
- ``integrity.py``: the checksums in each sidecar, who checks them, the repair command.
- ``manifest.py``: ``manifest.json``, assembled from the sidecars (``write_manifest``),
  checked (``load_manifest``), hashed (``manifest_sha256``).
- ``finalize.py``: the extraction's record (``extraction.json``) and ``finalize``: verify
  the shards and write the manifest once, under a lock, when every shard exists;
  ``extraction_files.py``: ``extraction.json`` and ``skipped-N.json`` read back, their fields checked.
"""

from feature_extraction.shards.layout import (
    DTYPE,
    EXTRACTION_FNAME,
    LOCK_FNAME,
    MANIFEST_FNAME,
    SCHEMA_VERSION,
    ShardFormatError,
    assign_shards,
    check_key,
    image_id_from_key,
    image_key,
    shard_fname,
    shards_for_task,
    sidecar_fname,
    skipped_fname,
)
from feature_extraction.shards.manifest import (
    REQUIRED_FIELDS,
    SHARD_FIELDS,
    backbone_name,
    extraction_record,
    format_indices,
    load_manifest,
    manifest_sha256,
    peek_manifest,
    shard_fpaths,
    write_manifest,
)
from feature_extraction.shards.read import decode_sample, iter_shard_samples, iter_shard_tokens, read_shard_samples
from feature_extraction.shards.sidecar import read_sidecar, shard_is_complete, shard_is_intact
from feature_extraction.shards.write import write_shard

__all__ = [
    "DTYPE",
    "EXTRACTION_FNAME",
    "LOCK_FNAME",
    "MANIFEST_FNAME",
    "REQUIRED_FIELDS",
    "SCHEMA_VERSION",
    "SHARD_FIELDS",
    "ShardFormatError",
    "assign_shards",
    "backbone_name",
    "check_key",
    "decode_sample",
    "extraction_record",
    "format_indices",
    "image_id_from_key",
    "image_key",
    "iter_shard_samples",
    "iter_shard_tokens",
    "load_manifest",
    "manifest_sha256",
    "peek_manifest",
    "read_shard_samples",
    "read_sidecar",
    "shard_fname",
    "shard_fpaths",
    "shard_is_complete",
    "shard_is_intact",
    "shards_for_task",
    "sidecar_fname",
    "skipped_fname",
    "write_manifest",
    "write_shard",
]
