"""Random access to the rows of a row source (one row = one token): an in-memory array or an HDF5 token cache.

`sources.py` cuts any of them into row units; these say only how rows are read.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from feature_extraction.h5cache import TokenCache

__all__ = ["ArrayRows", "CacheRows", "RowReader"]


class RowReader(Protocol):
    """Random access to the rows of a row source (one row = one token)."""

    n_rows: int
    d: int
    dtype: np.dtype  # float16 or float32, what ``read`` returns

    def read(self, rows: np.ndarray) -> np.ndarray:
        """Tokens of the given increasing rows, ``[len(rows), d]`` of ``dtype``."""
        ...

    def image_ids(self, rows: np.ndarray) -> list[str]:
        """One image id per row."""
        ...

    def token_positions(self, rows: np.ndarray) -> np.ndarray:
        """One token position (int64) per row."""
        ...

    def labels(self, rows: np.ndarray) -> np.ndarray:
        """One class label (int64) per row, -1 where unknown."""
        ...


class ArrayRows:
    """Rows of an in-memory array, scaled to float32 on read (MNIST stays uint8 in memory: 4x smaller)."""

    def __init__(self, name: str, array: np.ndarray, scale: float, labels: np.ndarray | None = None) -> None:
        self.name = name
        self.array = array
        self._labels = None if labels is None else np.asarray(labels, np.int64)
        self.scale = np.float32(scale)
        self.n_rows, self.d = (int(s) for s in array.shape)
        self.dtype = np.dtype(np.float32)

    def read(self, rows: np.ndarray) -> np.ndarray:
        return self.array[rows].astype(np.float32) * self.scale

    def image_ids(self, rows: np.ndarray) -> list[str]:
        return [f"{self.name}/{row}" for row in rows.tolist()]

    def token_positions(self, rows: np.ndarray) -> np.ndarray:
        return np.zeros(len(rows), np.int64)  # one token per image

    def labels(self, rows: np.ndarray) -> np.ndarray:
        return np.full(len(rows), -1, np.int64) if self._labels is None else self._labels[rows]


class CacheRows:
    """Rows of an HDF5 token cache; reads one contiguous hyperslab per call (h5py point selections are slow)."""

    def __init__(self, cache: TokenCache) -> None:
        self.cache = cache
        self.name = str(cache.fpath)
        self.n_rows, self.d = len(cache), cache.d
        self.dtype = np.dtype(np.float16 if cache[0:0].dtype == np.float16 else np.float32)

    def _span(self, rows: np.ndarray) -> tuple[slice, np.ndarray]:
        return slice(int(rows[0]), int(rows[-1]) + 1), rows - rows[0]

    def read(self, rows: np.ndarray) -> np.ndarray:
        span, local = self._span(rows)
        tokens = self.cache[span][local]
        return tokens if tokens.dtype == np.float16 else tokens.astype(np.float32)

    def image_ids(self, rows: np.ndarray) -> list[str]:
        if not self.cache.has_image_ids:
            return [f"{self.cache.fpath.name}/{row}" for row in rows.tolist()]
        span, local = self._span(rows)
        return self.cache.image_ids(span)[local].tolist()

    def token_positions(self, rows: np.ndarray) -> np.ndarray:
        if not self.cache.has_token_positions:
            return np.zeros(len(rows), np.int64)
        span, local = self._span(rows)
        return self.cache.token_positions(span)[local].astype(np.int64)

    def labels(self, rows: np.ndarray) -> np.ndarray:
        return np.full(len(rows), -1, np.int64)  # a token cache records no labels
