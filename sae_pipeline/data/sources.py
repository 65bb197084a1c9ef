"""Where training tokens come from: shard directories, HDF5 token caches, ``digits``, ``mnist``, ``mnist_sample``.

Every source is cut into *units* whose token counts are known before reading: a shard
(count from the manifest x tokens per image) or a block of rows (digits, MNIST, an HDF5
cache). A unit reads any token range ``[lo, hi)`` of itself as a stream of chunks. The
streams in ``streams.py`` see only units, so splitting by rank and worker, shuffling
and equal batch counts are one code path for every source.

Design choices:
- Shards are read through ``feature_extraction.shards.read`` (random access, one copy); a unit
  checks each sample's shape and the shard's sample count against the manifest, so a
  short or malformed shard raises ``ShardFormatError`` naming it.
- Train/validation split: by shard for shard directories (``val_fraction`` of the
  shards, at least one, spread evenly over the sorted image ids so the held-out set does
  not collect the last classes of an id-sorted dataset); by a fixed permutation of rows
  (seed ``SPLIT_SEED``, independent of the training seed) for row sources, so runs with
  different seeds are validated on the same rows.
- Normalisation statistics (docs/design.md: mean for ``b_pre``, E||x||^2 for the input scale)
  come from the manifest for shards (computed over *all* shards, validation included:
  re-reading 0.5 TB for a 10 % difference in the sample is not worth it), and are
  computed over the training rows for row sources.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np

from feature_extraction.h5cache import TokenCache
from feature_extraction.shards import MANIFEST_FNAME, ShardFormatError, load_manifest, shard_fpaths
from feature_extraction.shards.integrity import (
    SampleChecksums,
    load_sample_checksums,
    repair_command,
    verify_sha256_once,
)
from feature_extraction.shards.layout import sidecar_fpath
from feature_extraction.shards.read import iter_shard_tokens
from feature_extraction.shards.sidecar import load_sidecar
from feature_extraction.store import RemotePath, StoreError, fetch, is_url, location
from sae_pipeline.data.mnist import FIT_FLAGS, DataFlags, load_mnist, load_mnist_sample
from sae_pipeline.data.row_readers import ArrayRows, CacheRows, RowReader

SPLIT_SEED = 0  # the row permutation of the train/val split; fixed so every run holds out the same rows
MAX_ROWS_PER_UNIT = 65_536  # row blocks stay small enough to spread over many ranks x workers
ROWS_PER_CHUNK = 8_192  # bounds the memory of one read from a row source
SOURCE_FORMS = (
    "a shard directory (with manifest.json) or its URL (s3://bucket/prefix), an HDF5 token cache (*.h5 / *.hdf5), "
    "'digits', 'mnist' or 'mnist_sample'"
)


class Chunk(NamedTuple):
    """Consecutive tokens of one unit: ``tokens [n, d]`` (float16 or float32); ids, positions and labels on request.

    ``labels`` (int64, one per token) is the class label of the token's image, -1 where the
    source has none (a flat image folder, an ``.h5`` cache): the feature browser's label statistics.
    """

    tokens: np.ndarray
    image_ids: list[str] | None
    token_positions: np.ndarray | None
    labels: np.ndarray | None = None


class Unit(Protocol):
    """A piece of a source with a known token count that can read any token range of itself."""

    name: str
    n_tokens: int

    def read(self, lo: int, hi: int, with_ids: bool = False) -> Iterator[Chunk]:
        """Yield tokens ``[lo, hi)`` of this unit in order."""
        ...


class ShardUnit:
    """One webdataset shard; token ``t`` is stored token ``t % tokens_per_image`` of image ``t // tokens_per_image``.

    A token's position (``Chunk.token_positions``) is its place in the backbone's full
    sequence: the sample's ``positions.npy`` when the extraction stored a token subset
    (``subset``: it must be there), else its index in the sample.
    """

    verify = True  # check each sample against its sidecar's checksums (benchmarks/loader.py turns it off)

    def __init__(
        self, fpath: Path, n_images: int, tokens_per_image: int, d: int, subset: bool = False, sha256: str | None = None
    ) -> None:
        self.fpath = location(fpath)
        self.subset = subset
        self.sha256 = sha256  # the manifest's: the sidecar must be the one the manifest was built from
        self.verify = ShardUnit.verify
        self._checksums: SampleChecksums | None | bool = False  # False: not loaded yet (None: old sidecar)
        self.name = str(self.fpath)
        self.n_images = int(n_images)
        self.tokens_per_image = int(tokens_per_image)
        self.d = int(d)
        self.n_tokens = self.n_images * self.tokens_per_image

    def read(self, lo: int, hi: int, with_ids: bool = False) -> Iterator[Chunk]:
        """Yield one chunk per image overlapping ``[lo, hi)``; stops reading the tar after the last one."""
        if not 0 <= lo <= hi <= self.n_tokens:
            raise ValueError(f"{self.fpath}: token range [{lo}, {hi}) outside [0, {self.n_tokens}]")
        if lo == hi:
            return
        tpi = self.tokens_per_image
        first, last = lo // tpi, (hi - 1) // tpi
        checksums = self._sample_checksums() if self.verify else None
        with contextlib.closing(
            iter_shard_tokens(
                self.fpath,
                first,
                last,
                with_positions=with_ids,
                checksums=checksums,
                with_meta=with_ids,
                shape=(tpi, self.d),  # a forged header is refused before its tokens are allocated
            )
        ) as samples:
            for index, (key, tokens, *extra) in enumerate(samples, start=first):
                if tokens.shape != (tpi, self.d):
                    raise ShardFormatError(
                        f"{self.fpath}: sample {key!r} has tokens {list(tokens.shape)}, the "
                        f"manifest says [{tpi}, {self.d}]; re-extract the shard"
                    )
                start = index * tpi
                a, b = max(lo - start, 0), min(hi - start, tpi)
                yield Chunk(
                    tokens[a:b],
                    [key] * (b - a) if with_ids else None,
                    self._positions(key, extra[0], a, b) if with_ids else None,
                    np.full(b - a, _label_of(extra[1]), np.int64) if with_ids else None,
                )
                if index == last:
                    return
        raise ShardFormatError(
            f"{self.fpath}: ends before sample {last + 1} of the {self.n_images} the manifest "
            f"lists; re-extract the shard: {repair_command(self.fpath.parent)}"
        )

    def _sample_checksums(self) -> SampleChecksums | None:
        """The sidecar's per-sample checksums, loaded once per process (None: an old sidecar, sha256 checked)."""
        if self._checksums is False:
            sidecar_where = sidecar_fpath(self.fpath)
            try:
                sidecar = load_sidecar(sidecar_where)  # a forged size is refused before the parse
            except (ShardFormatError, StoreError):  # StoreError: the store's own line (a ValueError too)
                raise
            except (OSError, ValueError) as exn:
                raise ShardFormatError(
                    f"{sidecar_where}: unreadable sidecar ({type(exn).__name__}); {repair_command(self.fpath.parent)}"
                ) from None
            if self.sha256 is not None and sidecar.get("sha256") != self.sha256:
                raise ShardFormatError(
                    f"{sidecar_where}: sha256 differs from {self.fpath.parent / MANIFEST_FNAME}: "
                    "the shard was rewritten after the manifest; run `python -m feature_extraction "
                    f"finalize --out {self.fpath.parent}`"
                )
            self._checksums = load_sample_checksums(sidecar, sidecar_where)
            self.sha256 = sidecar.get("sha256")
        if self._checksums is None:
            verify_sha256_once(self.fpath, str(self.sha256))
        return self._checksums

    def _positions(self, key: str, stored: np.ndarray | None, a: int, b: int) -> np.ndarray:
        """Full-sequence positions of the sample's stored tokens ``[a, b)`` (int64)."""
        if stored is not None:
            return stored[a:b].astype(np.int64)
        if self.subset:
            raise ShardFormatError(
                f"{self.fpath}: sample {key!r} lacks positions.npy, but the manifest's "
                "token_selection says it holds a token subset; re-extract the shard"
            )
        return np.arange(a, b, dtype=np.int64)


def _label_of(meta: dict) -> int:
    """The integer ``label`` of a sample's ``meta.json``, -1 when it has none (or not an integer)."""
    label = meta.get("label")
    return label if isinstance(label, int) and not isinstance(label, bool) and label >= 0 else -1


def plan_reads(units: list[Unit]) -> None:
    """The units one reader is about to read, in order: shards in a store are fetched ahead (`store/fetch.py`)."""
    remote = [unit.fpath for unit in units if isinstance(getattr(unit, "fpath", None), RemotePath)]
    if remote:
        fetch.plan(remote)


class RowUnit:
    """A block of increasing rows of a row source."""

    def __init__(self, reader: RowReader, rows: np.ndarray, source_name: str) -> None:
        self.reader = reader
        self.rows = rows
        self.n_tokens = len(rows)
        self.name = f"{source_name} rows {rows[0]}-{rows[-1]}" if len(rows) else f"{source_name} (no rows)"

    def read(self, lo: int, hi: int, with_ids: bool = False) -> Iterator[Chunk]:
        if not 0 <= lo <= hi <= self.n_tokens:
            raise ValueError(f"{self.name}: row range [{lo}, {hi}) outside [0, {self.n_tokens}]")
        for start in range(lo, hi, ROWS_PER_CHUNK):
            rows = self.rows[start : min(hi, start + ROWS_PER_CHUNK)]
            yield Chunk(
                self.reader.read(rows),
                self.reader.image_ids(rows) if with_ids else None,
                self.reader.token_positions(rows) if with_ids else None,
                self.reader.labels(rows) if with_ids else None,
            )


def n_validation(n: int, val_fraction: float, what: str) -> int:
    """How many of ``n`` shards/rows to hold out: ``round(val_fraction * n)``, at least 1 unless 0 is asked."""
    n_val = 0 if val_fraction == 0 else max(1, round(val_fraction * n))
    if n - n_val < 1:
        raise ValueError(
            f"--data.val_fraction={val_fraction} leaves no training {what} out of {n}; "
            f"set --data.val_fraction 0 or provide more {what}"
        )
    return n_val


class ShardSource:
    """A finished shard directory; units are its shards in manifest order."""

    unit_kind = "shards"
    image_shape = None
    dtype = np.dtype(np.float16)

    def __init__(self, dpath: Path | RemotePath) -> None:
        self.manifest = load_manifest(dpath)
        self.name = str(dpath)
        self.d = int(self.manifest["d"])
        tpi = int(self.manifest["tokens_per_image"])
        subset = self.manifest["token_selection"] is not None  # load_manifest fills it in for old manifests
        self._units = [
            ShardUnit(fpath, entry["count"], tpi, self.d, subset, entry["sha256"])
            for fpath, entry in zip(shard_fpaths(dpath, self.manifest), self.manifest["shards"])
        ]

    def units(self, split: str, val_fraction: float) -> list[ShardUnit]:
        """Shards of ``split`` ("train", "val" or "all"); validation shards spread evenly over the id range."""
        if split == "all":
            return list(self._units)
        n = len(self._units)
        n_val = n_validation(n, val_fraction, "shards")
        val = {int((i + 0.5) * n / n_val) for i in range(n_val)}
        return [u for i, u in enumerate(self._units) if (i in val) == (split == "val")]

    def stats(self, val_fraction: float) -> tuple[np.ndarray, float]:
        """Mean ``[d]`` and E||x||^2 of the whole directory, from the manifest (see module docstring)."""
        stats = self.manifest["stats"]
        return np.asarray(stats["mean"], np.float64), float(stats["mean_sq_norm"])


class RowSource:
    """An array-like source (digits, MNIST, HDF5 cache); units are blocks of a fixed row permutation."""

    unit_kind = "row blocks"
    manifest = None

    def __init__(self, name: str, reader: RowReader, image_shape: tuple[int, int] | None) -> None:
        if reader.n_rows == 0:
            raise ValueError(f"--data.source {name}: holds no tokens; accepted sources: {SOURCE_FORMS}")
        self.name, self.reader, self.image_shape, self.d = name, reader, image_shape, reader.d
        self.dtype = reader.dtype
        self._perm = np.random.default_rng(SPLIT_SEED).permutation(reader.n_rows)

    def split_rows(self, split: str, val_fraction: float) -> np.ndarray:
        """Row indices of ``split``; validation rows in permutation order (a random sample of the rows)."""
        if split == "all":
            return np.arange(self.reader.n_rows)
        n_val = n_validation(self.reader.n_rows, val_fraction, "rows")
        return self._perm[:n_val] if split == "val" else self._perm[n_val:]

    def units(self, split: str, val_fraction: float) -> list[RowUnit]:
        """Blocks of at most MAX_ROWS_PER_UNIT increasing rows; about 256 blocks so many workers fit."""
        rows = np.sort(self.split_rows(split, val_fraction))
        size = max(1, min(MAX_ROWS_PER_UNIT, math.ceil(len(rows) / 256)))
        return [RowUnit(self.reader, rows[s : s + size], self.name) for s in range(0, len(rows), size)]

    def stats(self, val_fraction: float) -> tuple[np.ndarray, float]:
        """Mean ``[d]`` and E||x||^2 over the training rows, accumulated in float64."""
        total, sq_norm, n = np.zeros(self.d), 0.0, 0
        for unit in self.units("train", val_fraction):
            for chunk in unit.read(0, unit.n_tokens):
                x = chunk.tokens.astype(np.float64)
                total += x.sum(axis=0)
                sq_norm += float(np.einsum("nd,nd->", x, x))
                n += len(x)
        return total / n, sq_norm / n


def open_source(
    source: str, data_dpath: str | Path = "data", allow_download: bool = False, flags: DataFlags = FIT_FLAGS
) -> ShardSource | RowSource:
    """Resolve ``--data.source``; a one-line ValueError names a missing or empty source and the accepted forms
    (MNIST's in the running command's ``flags``)."""
    if source == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = digits.images.reshape(-1, 64).astype(np.float32) / 16.0  # pixel values 0..16
        return RowSource("digits", ArrayRows("digits", images, 1.0, digits.target), (8, 8))
    if source == "mnist_sample":
        images, labels = load_mnist_sample(with_labels=True, flags=flags)
        return RowSource("mnist_sample", ArrayRows("mnist_sample", images, 1 / 255, labels), (28, 28))
    if source == "mnist":
        images, labels = load_mnist(data_dpath, allow_download, with_labels=True, flags=flags)
        return RowSource("mnist", ArrayRows("mnist", images, 1 / 255, labels), (28, 28))
    if not isinstance(source, str) or not source:
        raise ValueError(f"--data.source is empty; pass {SOURCE_FORMS}")
    if is_url(source):
        return ShardSource(location(source))  # load_manifest names a missing bucket, object or unfinished extraction
    fpath = Path(source)
    if fpath.suffix in (".h5", ".hdf5"):
        if not fpath.is_file():
            raise ValueError(f"--data.source {source}: HDF5 file not found; pass {SOURCE_FORMS}")
        cache = TokenCache(fpath)
        return RowSource(str(fpath), CacheRows(cache), None)
    if fpath.is_dir():
        if not any(fpath.iterdir()):
            raise ValueError(f"--data.source {source}: empty directory; pass {SOURCE_FORMS}")
        return ShardSource(fpath)  # load_manifest names an unfinished extraction and its fix
    if fpath.name == "manifest.json" and fpath.parent.is_dir():
        raise ValueError(f"--data.source {source}: pass the shard directory ({fpath.parent}), not its manifest")
    if fpath.is_file():
        hint = (
            " (an .npy array of tokens [N, d]: save it as a cache with "
            "feature_extraction.h5cache.write_token_cache(PATH.h5, tokens))"
            if fpath.suffix == ".npy"
            else ""
        )
        raise ValueError(
            f"--data.source {source}: is a {fpath.suffix or 'extension-less'} file, not a data "
            f"source{hint}; pass {SOURCE_FORMS}"
        )
    raise ValueError(f"--data.source {source!r}: not found; pass {SOURCE_FORMS}")
