"""The SAE codes file that ``predict`` writes (HDF5, format ``codes/1``): per token, its active atoms.

Per token: the active atoms' indices (int32) and values (float32), padded with index -1 /
value 0 to the widest token, the image id and the token position (int32); gzip-compressed,
resizable datasets ``image_ids``, ``token_positions``, ``indices``, ``values``. User attributes
(``d_sae``, ``variant``, ...) and the format attribute as in every HDF5 file of ours
(``feature_extraction.h5cache``). Design choices:
- Written under ``NAME.tmp`` and renamed when complete (``atomic_files.atomic_path``), so an
  interrupted ``predict`` leaves no half file under the real name.
- Padded to a common width that grows when a later chunk has more active atoms (ReLU/JumpReLU
  codes have no fixed k); chunks of 4096 x 32 keep a few tokens' codes cheap to read.
- A full disk is checked before each chunk is handed to HDF5 (room for the chunk's raw bytes plus
  ``H5_RESERVE_BYTES`` for HDF5's chunk caches and metadata): HDF5 cannot recover from a failed
  write (h5py then crashes the interpreter), so ``predict`` stops with one ``no space left on
  device`` line first, and the temporary file is removed.
- ``merge_codes`` joins the per-rank parts of a DDP ``predict`` in rank order, chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from feature_extraction.atomic_files import atomic_path, check_free_space, out_of_space
from feature_extraction.file_checks import terminal_text
from feature_extraction.h5cache import (
    FORMAT_ATTR,
    H5_RESERVE_BYTES,
    CacheFormatError,
    open_checked,
    read_attrs,
    write_attrs,
)
from feature_extraction.validate import check_int

__all__ = ["CODES_FORMAT", "CodesWriter", "count_codes", "merge_codes", "read_codes"]

CODES_FORMAT = "codes/1"
DATASETS = ("image_ids", "token_positions", "indices", "values")
WRITER = "python -m sae_pipeline predict"
MERGE_CHUNK_ROWS = 1 << 16
_CODES_CHUNK_ROWS = 4096
_CODES_CHUNK_COLS = 32


class CodesWriter:
    """Append sparse codes chunk by chunk to an HDF5 file (gzip-compressed, resizable).

    Use as a context manager: the file appears under its name only when the block exits
    without an exception; on an exception the temporary file is removed.
    ``d_sae`` (argument or ``attrs["d_sae"]``) enables the index range check.
    """

    def __init__(self, fpath: Path | str, attrs: dict | None = None, *, d_sae: int | None = None) -> None:
        self.fpath = Path(fpath)
        self.attrs = dict(attrs or {})
        if d_sae is not None:
            self.attrs.setdefault("d_sae", int(d_sae))
        self.d_sae = self.attrs.get("d_sae")
        if self.d_sae is not None:
            check_int("d_sae", self.d_sae, 1)
        self.n_rows = 0
        self._h5: h5py.File | None = None
        self._stack: ExitStack | None = None
        self._kept = ""

    def __enter__(self) -> CodesWriter:
        self.fpath.parent.mkdir(parents=True, exist_ok=True)
        self._kept = (
            f"the previous {self.fpath}, unchanged"
            if self.fpath.exists()
            else f"no codes file (the partial {self.fpath.name}.tmp was removed)"
        )
        check_free_space(self.fpath, H5_RESERVE_BYTES, self._kept)
        with ExitStack() as stack:  # unwound here (temporary file removed) only if setting up the file fails
            tmp = stack.enter_context(atomic_path(self.fpath, kept=self._kept))
            h5 = stack.enter_context(h5py.File(tmp, "w"))
            h5.attrs[FORMAT_ATTR] = CODES_FORMAT
            write_attrs(h5, self.attrs)
            rows, cols = _CODES_CHUNK_ROWS, _CODES_CHUNK_COLS
            opts = {"compression": "gzip", "compression_opts": 4}
            h5.create_dataset("image_ids", (0,), h5py.string_dtype(), maxshape=(None,), chunks=(rows,), **opts)
            h5.create_dataset("token_positions", (0,), np.int32, maxshape=(None,), chunks=(rows,), **opts)
            h5.create_dataset(
                "indices", (0, 0), np.int32, maxshape=(None, None), chunks=(rows, cols), fillvalue=-1, **opts
            )
            h5.create_dataset(
                "values", (0, 0), np.float32, maxshape=(None, None), chunks=(rows, cols), fillvalue=0.0, **opts
            )
            self._h5, self._stack = h5, stack.pop_all()
        return self

    def write(self, image_ids: list[str], token_positions: np.ndarray, indices: np.ndarray, values: np.ndarray) -> None:
        """Append ``n`` tokens: ids ``[n]``, positions ``[n]`` int, indices ``[n, k]`` int (-1 pads),
        values ``[n, k]`` float."""
        if self._h5 is None:
            raise ValueError(f"{self.fpath}: CodesWriter.write outside `with CodesWriter(...) as writer:`")
        indices, values = np.asarray(indices), np.asarray(values)
        token_positions = np.asarray(token_positions)
        n = len(image_ids)
        if indices.ndim != 2 or indices.shape[0] != n or not np.issubdtype(indices.dtype, np.integer):
            raise ValueError(f"indices must be integers [n={n}, k], got {indices.dtype} {list(indices.shape)}")
        if values.shape != indices.shape or not np.issubdtype(values.dtype, np.floating):
            raise ValueError(
                f"values must be floats of the indices' shape {list(indices.shape)}, "
                f"got {values.dtype} {list(values.shape)}"
            )
        if token_positions.shape != (n,) or not np.issubdtype(token_positions.dtype, np.integer):
            raise ValueError(
                f"token_positions must be integers [n={n}], got {token_positions.dtype} {list(token_positions.shape)}"
            )
        if indices.size and (indices.min() < -1 or (self.d_sae is not None and indices.max() >= self.d_sae)):
            raise ValueError(f"indices must be in [-1, d_sae={self.d_sae}), got [{indices.min()}, {indices.max()}]")
        n_bytes = indices.nbytes + values.nbytes + token_positions.nbytes + sum(len(str(i)) + 16 for i in image_ids)
        check_free_space(self.fpath, n_bytes + H5_RESERVE_BYTES, self._kept)  # before HDF5 can fail
        h5 = self._h5
        start, k = self.n_rows, indices.shape[1]
        width = max(h5["indices"].shape[1], k)
        for name in ("image_ids", "token_positions"):
            h5[name].resize((start + n,))
        for name in ("indices", "values"):
            h5[name].resize((start + n, width))  # new columns/rows take the fill value (-1 / 0)
        h5["image_ids"][start:] = list(image_ids)
        h5["token_positions"][start:] = token_positions.astype(np.int32)
        if n and k:
            h5["indices"][start:, :k] = indices.astype(np.int32)
            h5["values"][start:, :k] = values.astype(np.float32)
        self.n_rows += n

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Close the file; rename it into place if no exception, else remove it (``atomic_path``)."""
        stack, self._stack, self._h5 = self._stack, None, None
        if stack is not None:
            stack.__exit__(exc_type, exc, tb)


def check_layout(fpath: Path, h5: h5py.File) -> int:
    """The file's token count; a one-line CacheFormatError unless its four datasets are there with the
    shapes and kinds ``CodesWriter`` writes (a codes file may come from someone else: read it as data)."""
    missing = [name for name in DATASETS if not _dataset(h5, name)]
    if missing:
        raise CacheFormatError(f"{fpath}: no dataset {', '.join(missing)}: not a whole codes file; run predict again")
    ids, positions, indices, values = (h5[name] for name in DATASETS)
    n = positions.shape[0] if positions.ndim == 1 else -1
    problems = [
        (ids.ndim != 1 or ids.shape[0] != n or ids.dtype.kind not in "OSU", "image_ids must be n strings"),
        (n < 0 or positions.dtype.kind not in "iu", "token_positions must be n integers"),
        (
            indices.ndim != 2 or indices.shape[0] != n or indices.dtype.kind not in "iu",
            "indices must be [n, k] integers",
        ),
        (values.shape != indices.shape or values.dtype.kind != "f", "values must be [n, k] floats like indices"),
    ]
    for broken, what in problems:
        if broken:
            shapes = ", ".join(
                f"{d.name.lstrip('/')} {list(d.shape)} {d.dtype}" for d in (ids, positions, indices, values)
            )
            raise CacheFormatError(f"{fpath}: {what} ({shapes}); run predict again")
    check_stored(fpath, n, indices, (ids, positions, indices, values))
    return n


def check_stored(fpath: Path, n: int, indices: h5py.Dataset, datasets: Sequence[h5py.Dataset]) -> None:
    """Refuse a codes file whose declared size its stored data cannot back, before its arrays are allocated.

    HDF5 reads a chunk never written as its fill value, so a file of a few kB can declare 10^12 tokens, and
    `read_codes` would allocate them all. ``CodesWriter`` writes every row of the 1-D datasets and, in the
    widest block, every column of ``indices`` / ``values``: a file declaring more than its chunks hold was cut
    short or forged."""
    width = indices.shape[1]
    for dataset in datasets:
        if dataset.chunks is None:  # contiguous (no writer of ours): every element declared takes a stored byte
            short = dataset.id.get_storage_size() < dataset.size
        elif dataset.ndim == 1:
            short = dataset.id.get_num_chunks() < -(-n // dataset.chunks[0])
        else:
            short = n > 0 and dataset.id.get_num_chunks() < -(-width // dataset.chunks[1])
        if short:
            raise CacheFormatError(
                f"{fpath}: {dataset.name.lstrip('/')} declares {list(dataset.shape)} but stores less (cut short or "
                "not written by predict); run predict again"
            )


def _dataset(h5: h5py.File, name: str) -> bool:
    try:
        return isinstance(h5.get(name), h5py.Dataset)
    except (KeyError, OSError):  # a broken or external link
        return False


def read_codes(fpath: Path | str) -> dict[str, np.ndarray]:
    """Read a codes file: ``image_ids`` (str), ``token_positions``, ``indices`` (-1 pads), ``values``."""
    fpath = Path(fpath)
    with _damaged(fpath), open_checked(fpath, CODES_FORMAT, WRITER) as h5:
        n = check_layout(fpath, h5)
        check_fits_memory(fpath, n, [h5[name] for name in DATASETS])
        return {
            "image_ids": np.asarray(h5["image_ids"].asstr()[()], dtype=str),
            "token_positions": h5["token_positions"][()],
            "indices": h5["indices"][()],
            "values": h5["values"][()],
        }


@contextmanager
def _damaged(fpath: Path) -> Iterator[None]:
    """HDF5's own errors on a file whose structure opened but whose data does not read (cut short, bytes changed)
    as the one CacheFormatError line of every other damage."""
    try:
        yield
    except (OSError, KeyError, RuntimeError, UnicodeDecodeError) as exn:
        if out_of_space(exn):
            raise
        raise CacheFormatError(
            f"{fpath}: its data does not read ({type(exn).__name__}: {terminal_text(exn, 160)}); damaged: run "
            "predict again"
        ) from None


def check_fits_memory(fpath: Path, n: int, datasets: Sequence[h5py.Dataset]) -> None:
    """`read_codes` reads the file whole: what it declares must fit in the memory available now (one line, with the
    way to read a larger file, instead of the kernel's OOM kill)."""
    from sae_pipeline.data.cache import mem_available, size_text  # only here: the data layer is heavier

    declared = sum(dataset.size * (dataset.dtype.itemsize if dataset.dtype.kind != "O" else 64) for dataset in datasets)
    available = mem_available()
    if declared > available:
        raise CacheFormatError(
            f"{fpath}: holds {n} tokens ({size_text(declared)} to read whole), more than the {size_text(available)} "
            "of memory available; read it in row blocks with h5py (docs/formats.md) or free memory"
        )


def count_codes(fpath: Path | str) -> int:
    """How many tokens a codes file holds (reads no codes)."""
    with _damaged(Path(fpath)), open_checked(Path(fpath), CODES_FORMAT, WRITER) as h5:
        return check_layout(Path(fpath), h5)


def merge_codes(part_fpaths: Sequence[Path], out_fpath: Path) -> int:
    """Concatenate codes files in order into ``out_fpath`` (chunked; widths may differ).

    Returns the number of tokens. The attributes are the first part's.
    """
    attrs = read_attrs(part_fpaths[0]) if part_fpaths else {}
    n_rows = 0
    with CodesWriter(out_fpath, attrs) as writer:
        for fpath in part_fpaths:
            read_attrs(fpath)  # a one-line CacheFormatError for a missing part
            with h5py.File(fpath, "r") as h5:
                n = h5["token_positions"].shape[0]
                for start in range(0, n, MERGE_CHUNK_ROWS):
                    stop = min(start + MERGE_CHUNK_ROWS, n)
                    writer.write(
                        list(h5["image_ids"].asstr()[start:stop]),
                        h5["token_positions"][start:stop],
                        h5["indices"][start:stop],
                        h5["values"][start:stop],
                    )
                n_rows += n
    return n_rows
