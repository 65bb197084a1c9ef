"""An image's top atoms, from the codes of its tokens (`image_codes.py`): the data of an image page.

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

from sae_pipeline.features.image_codes import ImageCodes
from sae_pipeline.features.patch_atoms import token_top_atoms

IMAGE_TOP = 16  # atoms per ranking on an image page
LEVEL_MAX, NOT_STORED = 250, 255  # as the atom pages (atom_pages.py, assets.JS)


def _ranking(atoms: np.ndarray, values: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` of ``atoms`` with the largest positive ``values``, largest first, ties by atom id (the atoms
    not listed are 0 and never ranked)."""
    keep = values > 0
    if np.count_nonzero(keep) > k:  # only those at or above the k-th largest value can rank (ties included)
        keep &= values >= np.partition(values[keep], -k)[-k]
    candidates = atoms[keep]
    order = np.lexsort((candidates, -values[keep]))
    return candidates[order[:k]]


def image_top_atoms(
    codes: ImageCodes | np.ndarray, positions: np.ndarray, n_full: int, k: int = IMAGE_TOP
) -> dict[str, Any]:
    """One image's top atoms from its codes (token ``i`` at ``positions[i]`` of ``n_full``): `ImageCodes`, or
    dense ``[tokens, d_sae]`` (read as entries first).

    Returns ``atoms`` (sorted), their ``max`` and ``sum`` over the tokens, ``top`` (position of the
    maximum), ``levels`` (uint8 ``[atoms, n_full]``, or None without a token grid), the two
    rankings ``by_max`` / ``by_sum`` as atom ids, and per token its few largest atoms
    (``token_atoms`` / ``token_values``, `patch_atoms.py`) with its ``positions``.
    """
    image = codes if isinstance(codes, ImageCodes) else ImageCodes.from_dense(codes)
    by_max, by_sum = _ranking(image.atoms, image.peak, k), _ranking(image.atoms, image.total, k)
    atoms = np.union1d(by_max, by_sum).astype(np.int64)
    pair, _ = image.lookup(atoms)  # every ranked atom is non-zero on some token
    peak = image.peak[pair]
    columns = image.columns(atoms)  # codes[:, atoms].T
    positions = np.asarray(positions, np.int64)
    token_atoms, token_values = token_top_atoms(image)
    levels = None
    if n_full > 0:
        levels = np.full((len(atoms), n_full), NOT_STORED, np.uint8)
        scale = np.maximum(peak, 1e-12)
        levels[:, positions] = np.round(np.clip(columns / scale[:, None], 0, 1) * LEVEL_MAX).astype(np.uint8)
    return {
        "atoms": atoms,
        "max": peak.astype(np.float32),
        "sum": image.total[pair].astype(np.float32),
        "top": positions[columns.argmax(axis=1)] if len(atoms) else np.zeros(0, np.int64),
        "levels": levels,
        "by_max": by_max.astype(np.int64),
        "by_sum": by_sum.astype(np.int64),
        "token_atoms": token_atoms,
        "token_values": token_values,
        "positions": positions,
    }
