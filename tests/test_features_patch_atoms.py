"""Patch-level inspection (`features/patch_atoms.py`): each token's few largest atoms, from the sparse entries, equal
a plain dense computation (largest positive values first, ties by atom id, -1 / 0 past the positive ones)."""

from __future__ import annotations

import numpy as np
from test_features_sparse import random_codes

from sae_pipeline.features.image_codes import ImageCodes
from sae_pipeline.features.image_top import image_top_atoms
from sae_pipeline.features.patch_atoms import PATCH_TOP, token_top_atoms


def dense_reference(codes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    atoms = np.full((len(codes), k), -1, np.int64)
    values = np.zeros((len(codes), k), np.float64)
    for t, row in enumerate(codes.astype(np.float64)):
        ranked = sorted((a for a in range(len(row)) if row[a] > 0), key=lambda a: (-row[a], a))[:k]
        atoms[t, : len(ranked)] = ranked
        values[t, : len(ranked)] = row[ranked]
    return atoms, values


def test_token_top_atoms_equal_a_dense_reference() -> None:
    rng = np.random.default_rng(0)
    for trial in range(60):
        tokens, d_sae, k = int(rng.integers(1, 30)), int(rng.integers(1, 40)), int(rng.integers(1, 8))
        codes = random_codes(rng, tokens, d_sae, trial) * (trial % 9 != 0)  # rounded trials: ties; some all 0
        atoms, values = token_top_atoms(ImageCodes.from_dense(codes), k)
        want_atoms, want_values = dense_reference(codes, k)
        assert atoms.dtype == np.int32 and values.dtype == np.float32
        assert np.array_equal(atoms, want_atoms), trial
        assert np.array_equal(values.astype(np.float64), want_values), trial


def test_image_top_atoms_carry_the_token_lists_and_positions() -> None:
    rng = np.random.default_rng(1)
    codes = random_codes(rng, 9, 20, 1)
    positions = np.array([0, 1, 2, 5, 7, 8, 11, 12, 15])
    top = image_top_atoms(ImageCodes.from_dense(codes), positions, 16)
    want_atoms, want_values = dense_reference(codes, PATCH_TOP)
    assert np.array_equal(top["token_atoms"], want_atoms) and np.array_equal(top["token_values"], want_values)
    assert top["positions"].tolist() == positions.tolist()
