"""Patch-level inspection (`features/patch_atoms.py`): each token's few largest atoms, from the sparse entries, equal
a plain dense computation (largest positive values first, ties by atom id, -1 / 0 past the positive ones)."""

from __future__ import annotations

import numpy as np
from test_features_sparse import random_codes

from sae_pipeline.features.heatmaps import Layout
from sae_pipeline.features.image_codes import ImageCodes
from sae_pipeline.features.image_top import image_top_atoms
from sae_pipeline.features.patch_atoms import PATCH_TOP, patch_data, significant, token_top_atoms


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


def test_patch_data_equals_a_plain_reference() -> None:
    """The page's JSON built with array operations equals a per-value loop: rows of varying length (-1 past
    a token's positive codes), values to 4 significant digits, hrefs only for atoms with a page."""
    rng = np.random.default_rng()
    n_tokens, k = 37, PATCH_TOP
    atoms = rng.integers(0, 50, (n_tokens, k)).astype(np.int32)
    lengths = rng.integers(0, k + 1, n_tokens)
    atoms[np.arange(k)[None, :] >= lengths[:, None]] = -1
    values = np.where(atoms >= 0, 10.0 ** rng.uniform(-5, 5, (n_tokens, k)), 0.0).astype(np.float32)
    top = {"token_atoms": atoms, "token_values": values, "positions": np.arange(n_tokens) + 5}
    layout = Layout("patches", n_tokens + 5, 1, 4, (6, 6))
    href = lambda a: None if a % 7 == 0 else f"../atoms/{a}.html"  # noqa: E731
    got = patch_data(top, layout, href)
    rows = list(zip(values.tolist(), atoms.tolist()))
    assert got["atoms"] == [[a for a in arow if a >= 0] for arow in atoms.tolist()]
    assert got["values"] == [[float(f"{v:.4g}") for v, a in zip(vrow, arow) if a >= 0] for vrow, arow in rows]
    listed = {int(a) for a in atoms[atoms >= 0]}
    assert got["href"] == {str(a): f"../atoms/{a}.html" for a in sorted(listed) if a % 7}
    assert got["positions"] == list(range(5, n_tokens + 5)) and got["prefix"] == ["CLS", "R1", "R2", "R3", "R4"]
    v = 10.0 ** rng.uniform(-8, 8, 10_000)
    assert significant(v, 4).tolist() == [float(f"{x:.4g}") for x in v]
