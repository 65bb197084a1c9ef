"""An image's top atoms, from the codes of its tokens: the data of an image page.

Two rankings of the atoms with a positive value: by the maximum over the image's tokens (one
patch that says "cat eye") and by the sum over its tokens (an atom spread over the whole
image: "grass"), ``IMAGE_TOP`` each, ties by atom id. The heatmap of an atom on the image is
kept as uint8 levels of its own maximum there (the atom pages' 0..250 scale, 255 where the
extraction stored no token): an image costs ``2 · IMAGE_TOP · n_full`` bytes at most, the
order of one float16 heatmap card of the atom pages per ranked atom.
"""

from __future__ import annotations

from typing import Any

import numpy as np

IMAGE_TOP = 16  # atoms per ranking on an image page
LEVEL_MAX, NOT_STORED = 250, 255  # as the atom pages (atom_pages.py, assets.JS)


def _ranking(values: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` atoms with the largest positive ``values``, largest first, ties by atom id."""
    positive = np.flatnonzero(values > 0)
    order = np.lexsort((positive, -values[positive]))
    return positive[order[:k]]


def image_top_atoms(codes: np.ndarray, positions: np.ndarray, n_full: int, k: int = IMAGE_TOP) -> dict[str, Any]:
    """One image's top atoms from its codes ``[tokens, d_sae]`` (token ``i`` at ``positions[i]`` of ``n_full``).

    Returns ``atoms`` (sorted), their ``max`` and ``sum`` over the tokens, ``top`` (position of the
    maximum), ``levels`` (uint8 ``[atoms, n_full]``, or None without a token grid), and the two
    rankings ``by_max`` / ``by_sum`` as atom ids.
    """
    codes = np.asarray(codes, np.float32)
    peak, total = codes.max(axis=0), codes.sum(axis=0)
    by_max, by_sum = _ranking(peak, k), _ranking(total, k)
    atoms = np.union1d(by_max, by_sum).astype(np.int64)
    positions = np.asarray(positions, np.int64)
    levels = None
    if n_full > 0:
        levels = np.full((len(atoms), n_full), NOT_STORED, np.uint8)
        scale = np.maximum(peak[atoms], 1e-12)
        levels[:, positions] = np.round(np.clip(codes[:, atoms].T / scale[:, None], 0, 1) * LEVEL_MAX).astype(np.uint8)
    return {
        "atoms": atoms,
        "max": peak[atoms].astype(np.float32),
        "sum": total[atoms].astype(np.float32),
        "top": positions[codes[:, atoms].argmax(axis=0)] if len(atoms) else np.zeros(0, np.int64),
        "levels": levels,
        "by_max": by_max.astype(np.int64),
        "by_sum": by_sum.astype(np.int64),
    }
