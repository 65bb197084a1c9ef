"""HDF5 token caches: a small random-access set of tokens, and what every HDF5 file of ours shares.

The webdataset shards are for streaming the full 0.5 TB; HDF5 is the second format
(docs/formats.md) for what needs random access: a token subset for evaluation or plots here, and
the per-token sparse codes that ``predict`` writes (``sae_pipeline/artifacts/codes.py``, which uses the
attribute and format-check helpers below).

Design choices:
- Every file is written under ``NAME.tmp`` and renamed when complete (``atomic_files``), so an
  interrupted write leaves no half file under the real name.
- User attributes are stored one HDF5 attribute per key, each a JSON string, so any JSON
  value (dicts, lists, None) round-trips exactly and ``h5dump`` still shows them.
- ``TokenCache`` opens its h5py handle lazily and per process: h5py handles are not
  fork-safe, so each DataLoader worker opens its own on first access.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from feature_extraction.atomic_files import atomic_path, check_free_space

FORMAT_ATTR = "sae_pipeline_format"
TOKEN_CACHE_FORMAT = "token_cache/1"
_TOKENS_CHUNK_BYTES = 1 << 20
# what HDF5 may write beyond the data's raw bytes: up to 1 MiB of chunk cache per dataset, and metadata
H5_RESERVE_BYTES = 5 << 20
_STRING_BYTES = 16  # HDF5's own record of each variable-length string (its heap entry), beside its bytes


class CacheFormatError(ValueError):
    """An HDF5 cache or codes file that is missing or does not follow the format."""


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


def write_attrs(h5: h5py.File, attrs: dict | None) -> None:
    for key, value in (attrs or {}).items():
        if not isinstance(key, str) or key == FORMAT_ATTR:
            raise ValueError(f"attrs key {key!r}: must be a string other than {FORMAT_ATTR!r}")
        try:
            h5.attrs[key] = json.dumps(value, default=_json_default, allow_nan=False)
        except (TypeError, ValueError) as exn:
            raise ValueError(f"attrs[{key!r}] is not JSON-serialisable ({exn})") from None


def read_h5_attrs(h5: h5py.File) -> dict:
    out = {}
    for key, value in h5.attrs.items():
        if key != FORMAT_ATTR:
            out[key] = json.loads(value.decode() if isinstance(value, bytes) else value)
    return out


def open_checked(
    fpath: Path, expected_format: str, writer: str = "feature_extraction.h5cache.write_token_cache"
) -> h5py.File:
    """Open ``fpath`` for reading; a one-line CacheFormatError unless ``writer`` wrote it in ``expected_format``."""
    if not fpath.is_file():
        raise CacheFormatError(f"{fpath}: file not found; check the path or write it first")
    try:
        h5 = h5py.File(fpath, "r")
    except OSError as exn:
        raise CacheFormatError(f"{fpath}: not a readable HDF5 file ({exn}); rewrite it") from None
    found = h5.attrs.get(FORMAT_ATTR)
    found = found.decode() if isinstance(found, bytes) else found
    if found != expected_format:
        h5.close()
        raise CacheFormatError(
            f"{fpath}: attribute {FORMAT_ATTR!r} is {found!r}, expected {expected_format!r}: "
            f"not a file written by {writer}; write it with that"
        )
    return h5


def cache_bytes(tokens: np.ndarray, image_ids: list[str] | None, token_positions: np.ndarray | None) -> int:
    """What `write_token_cache` may write: the tokens as stored, ids and positions, and HDF5's reserve."""
    ids = 0 if image_ids is None else sum(len(str(i).encode()) + _STRING_BYTES for i in image_ids)
    positions = 0 if token_positions is None else 4 * len(token_positions)  # stored as int32
    return tokens.nbytes + ids + positions + H5_RESERVE_BYTES


def write_token_cache(
    fpath: Path | str,
    tokens: np.ndarray,
    image_ids: list[str] | None = None,
    token_positions: np.ndarray | None = None,
    attrs: dict | None = None,
) -> None:
    """Write tokens ``[N, d]`` (float16/32/64, stored as given) with optional per-row ids and positions.

    Rows are chunked in about 1 MiB blocks, uncompressed, so random row reads stay cheap. The free space is
    checked first (`cache_bytes`): HDF5 cannot recover from a failed write, so a cache that does not fit
    is one ``DiskFullError`` naming what it needs and what is free, and nothing is written.
    """
    fpath = Path(fpath)
    if (
        not isinstance(tokens, np.ndarray)
        or tokens.ndim != 2
        or tokens.shape[1] < 1
        or not np.issubdtype(tokens.dtype, np.floating)
    ):
        got = f"{tokens.dtype} {list(tokens.shape)}" if isinstance(tokens, np.ndarray) else type(tokens).__name__
        raise ValueError(f"tokens must be a float numpy array [N, d >= 1], got {got}")
    n = tokens.shape[0]
    if image_ids is not None and len(image_ids) != n:
        raise ValueError(f"image_ids has {len(image_ids)} entries, tokens has {n} rows; pass one id per row")
    if token_positions is not None:
        token_positions = np.asarray(token_positions)
        if token_positions.shape != (n,) or not np.issubdtype(token_positions.dtype, np.integer):
            raise ValueError(
                f"token_positions must be integers of shape [{n}], got "
                f"{token_positions.dtype} {list(token_positions.shape)}"
            )
    kept = f"the previous {fpath}, unchanged" if fpath.exists() else "nothing, no file was written"
    check_free_space(fpath, cache_bytes(tokens, image_ids, token_positions), kept)
    fpath.parent.mkdir(parents=True, exist_ok=True)
    rows_per_chunk = max(1, min(n, _TOKENS_CHUNK_BYTES // (tokens.shape[1] * tokens.dtype.itemsize)))
    with atomic_path(fpath) as tmp, h5py.File(tmp, "w") as h5:
        h5.attrs[FORMAT_ATTR] = TOKEN_CACHE_FORMAT
        write_attrs(h5, attrs)
        h5.create_dataset("tokens", data=tokens, chunks=(rows_per_chunk, tokens.shape[1]) if n else None)
        if image_ids is not None:
            h5.create_dataset("image_ids", data=list(image_ids), dtype=h5py.string_dtype())
        if token_positions is not None:
            h5.create_dataset("token_positions", data=token_positions.astype(np.int32))


def _check_sizes(fpath: Path, h5: h5py.File) -> None:
    """A cache's datasets must hold what their shapes declare, checked before a row is read.

    HDF5 lets a dataset declare any shape and store nothing (unwritten chunks read as zeros), and
    the readers size their reads and index arrays by that shape, so a cache of someone else's is
    refused unless its tokens are floats, uncompressed as ``write_token_cache`` writes them, and
    fit in the file, and ``image_ids`` / ``token_positions`` have one entry per token row.
    """
    tokens = h5["tokens"]
    fix = "rewrite it with feature_extraction.h5cache.write_token_cache"
    if tokens.dtype.kind != "f":
        raise CacheFormatError(f"{fpath}: dataset 'tokens' is {tokens.dtype}, expected floats; {fix}")
    if tokens.compression is not None:
        raise CacheFormatError(f"{fpath}: dataset 'tokens' is compressed ({tokens.compression}); {fix}")
    size = fpath.stat().st_size
    if tokens.nbytes > size:
        raise CacheFormatError(
            f"{fpath}: dataset 'tokens' declares {list(tokens.shape)} {tokens.dtype} = {tokens.nbytes} bytes in a "
            f"file of {size} bytes; the cache is corrupt or forged, {fix}"
        )
    for name in ("image_ids", "token_positions"):
        if name in h5 and (not isinstance(h5[name], h5py.Dataset) or h5[name].shape != (tokens.shape[0],)):
            found = list(h5[name].shape) if isinstance(h5[name], h5py.Dataset) else "a group"
            raise CacheFormatError(
                f"{fpath}: dataset {name!r} is {found}, expected [{tokens.shape[0]}] (one per token row); {fix}"
            )


class TokenCache:
    """Random-access reader of a file from ``write_token_cache``.

    ``cache[i]`` -> ``[d]``; ``cache[a:b]``, ``cache[idx_array]`` or a boolean mask ->
    ``[n, d]`` in the requested order (duplicates allowed). Safe to pass to DataLoader
    workers: the handle is opened per process on first access.
    """

    def __init__(self, fpath: Path | str) -> None:
        self.fpath = Path(fpath)
        with open_checked(self.fpath, TOKEN_CACHE_FORMAT) as h5:
            if "tokens" not in h5:
                raise CacheFormatError(f"{self.fpath}: dataset 'tokens' [N, d] missing; rewrite the cache")
            if h5["tokens"].ndim != 2:
                raise CacheFormatError(
                    f"{self.fpath}: dataset 'tokens' is {h5['tokens'].ndim}-D "
                    f"{list(h5['tokens'].shape)}, expected [N, d] (one row per token); "
                    "rewrite it with write_token_cache(fpath, tokens.reshape(-1, d))"
                )
            self._n, self.d = (int(s) for s in h5["tokens"].shape)
            _check_sizes(self.fpath, h5)
            self.attrs = read_h5_attrs(h5)
            self.has_image_ids = "image_ids" in h5
            self.has_token_positions = "token_positions" in h5
        self._h5: h5py.File | None = None
        self._pid: int | None = None

    def _file(self) -> h5py.File:
        if self._h5 is None or self._pid != os.getpid():
            self._h5 = h5py.File(self.fpath, "r")  # a handle inherited over fork is dropped, never used
            self._pid = os.getpid()
        return self._h5

    def __len__(self) -> int:
        return self._n

    def _rows(self, index: Any) -> np.ndarray | int:
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            if not -self._n <= index < self._n:
                raise IndexError(f"index {index} out of range for {self.fpath} with {self._n} rows")
            return int(index) % self._n
        if isinstance(index, slice):
            return np.arange(*index.indices(self._n))  # the rows asked for, not an index of every row
        idx = np.asarray(index)
        if idx.dtype == bool:
            if idx.shape != (self._n,):
                raise IndexError(f"boolean index must have shape [{self._n}], got {list(idx.shape)}")
            return np.flatnonzero(idx)
        if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
            raise IndexError(f"index must be an int, a slice or a 1-D integer array, got {idx.dtype} {list(idx.shape)}")
        if idx.size and (idx.min() < -self._n or idx.max() >= self._n):
            raise IndexError(f"index out of range for {self.fpath} with {self._n} rows")
        return idx.astype(np.int64) % max(self._n, 1)

    def _read(self, name: str, index: Any) -> np.ndarray:
        rows = self._rows(index)
        ds = self._file()[name]
        as_str = h5py.check_string_dtype(ds.dtype) is not None
        view = ds.asstr() if as_str else ds
        if isinstance(rows, int):
            return np.asarray(view[rows], dtype=str if as_str else ds.dtype)
        if rows.size == 0:
            out = np.empty((0, *ds.shape[1:]), ds.dtype)
        elif np.all(np.diff(rows) == 1):
            out = view[rows[0] : rows[-1] + 1]  # one hyperslab: the common contiguous case
        else:
            unique, inverse = np.unique(rows, return_inverse=True)  # h5py wants increasing, unique
            out = view[unique][inverse]
        return np.asarray(out, dtype=str) if as_str else out

    def __getitem__(self, index: Any) -> np.ndarray:
        return self._read("tokens", index)

    def image_ids(self, index: Any = slice(None)) -> np.ndarray:
        """Image ids of the given rows (str array); CacheFormatError if none were stored."""
        if not self.has_image_ids:
            raise CacheFormatError(f"{self.fpath}: no 'image_ids' stored; pass image_ids to write_token_cache")
        return self._read("image_ids", index)

    def token_positions(self, index: Any = slice(None)) -> np.ndarray:
        """Token positions of the given rows; CacheFormatError if none were stored."""
        if not self.has_token_positions:
            raise CacheFormatError(f"{self.fpath}: no 'token_positions' stored; pass them to write_token_cache")
        return self._read("token_positions", index)

    def close(self) -> None:
        """Close this process's handle (reopened on the next access)."""
        if self._h5 is not None and self._pid == os.getpid():
            self._h5.close()
        self._h5 = None
        self._pid = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_h5"] = None
        state["_pid"] = None
        return state

    def __enter__(self) -> TokenCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_attrs(fpath: Path | str) -> dict:
    """The user attributes of a token cache or codes file (e.g. ``d_sae``, ``variant``)."""
    fpath = Path(fpath)
    if not fpath.is_file():
        raise CacheFormatError(f"{fpath}: file not found; check the path or write it first")
    with h5py.File(fpath, "r") as h5:
        return read_h5_attrs(h5)
