"""Two dictionaries' atoms matched one to one by |cosine| (`sae_pipeline.metrics.dictionary_match`): the dense
Hungarian against every assignment, the candidate solver (`sae_pipeline.metrics.sparse_match`) against the dense."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import scipy.sparse.csgraph

from sae_pipeline.metrics import dictionary_match, sparse_match
from sae_pipeline.metrics.dictionary_match import THRESHOLD, match_cosines, match_cosines_sparse, matched_cosines


def unit(w: np.ndarray) -> np.ndarray:
    return w / np.linalg.norm(w, axis=1, keepdims=True)


def replica_pair(seed: int, n: int = 90, d: int = 24) -> tuple[np.ndarray, np.ndarray]:
    """A dictionary of near-duplicate families (3 atoms around each direction) and a replica of it: rows permuted,
    signs flipped, noise, a fifth replaced by random rows. Many pairs sit near the threshold and one atom has
    several partners of nearly its best |cosine|: where a matching restricted to candidates goes wrong."""
    rng = np.random.default_rng(seed)
    a = np.repeat(unit(rng.normal(size=(n // 3, d))), 3, axis=0) + rng.normal(0, 0.45 / np.sqrt(d), (n, d))
    b = a[rng.permutation(n)] * rng.choice([-1, 1], (n, 1)) + rng.normal(0, 0.35 / np.sqrt(d), (n, d))
    replaced = rng.random(n) < 0.2
    b[replaced] = rng.normal(size=(int(replaced.sum()), d))
    return a, b


def best_assignment(cos: np.ndarray) -> np.ndarray:
    """Per row, its partner's |cosine| in the best one-to-one assignment, by trying every one (tiny sizes)."""
    n_a, n_b = cos.shape
    if n_a <= n_b:
        best = max(itertools.permutations(range(n_b), n_a), key=lambda p: sum(cos[i, j] for i, j in enumerate(p)))
        return np.array([cos[i, j] for i, j in enumerate(best)])
    best = max(itertools.permutations(range(n_a), n_b), key=lambda p: sum(cos[i, j] for j, i in enumerate(p)))
    matched = np.zeros(n_a)
    for j, i in enumerate(best):
        matched[i] = cos[i, j]
    return matched


@pytest.mark.parametrize("shape", [(6, 6), (6, 4), (4, 6)])
def test_both_solvers_find_the_best_assignment(shape) -> None:
    rng = np.random.default_rng(sum(shape))
    a, b = rng.normal(size=(shape[0], 5)), rng.normal(size=(shape[1], 5))
    expected = best_assignment(np.abs(unit(a) @ unit(b).T))
    np.testing.assert_allclose(match_cosines(a, b), expected, rtol=1e-12)
    for m in (1, 2, 6):  # one candidate a row: the duals must bring in the rest
        np.testing.assert_allclose(match_cosines_sparse(a, b, m=m), expected, rtol=1e-6)


def test_candidates_give_the_dense_decisions(monkeypatch) -> None:
    """Few candidates: the same optimum as the dense solver, so the same found-again decisions, on dictionaries
    made to mislead a matching on candidates only."""
    solves = []
    real_solve = scipy.sparse.csgraph.min_weight_full_bipartite_matching
    monkeypatch.setattr(
        scipy.sparse.csgraph, "min_weight_full_bipartite_matching", lambda g: solves.append(g.nnz) or real_solve(g)
    )
    rounds = []
    for seed in range(8):
        a, b = replica_pair(seed)
        dense = match_cosines(a, b)
        assert 0.3 < (dense >= THRESHOLD).mean() < 0.95  # both kinds of atoms, many near the threshold
        for m in (1, 3, 32):
            solves.clear()
            sparse = match_cosines_sparse(a, b, m=m)
            rounds.append(len(solves))
            assert sparse.sum() == pytest.approx(dense.sum(), abs=1e-9), (seed, m)
            assert ((sparse >= THRESHOLD) == (dense >= THRESHOLD)).all(), (seed, m)
            np.testing.assert_allclose(sparse, dense, atol=1e-9)
    assert max(rounds) > 1  # the first candidate graph was not always the optimum: the certificate's rounds ran


def test_candidates_in_blocks(monkeypatch) -> None:
    """Blocks of 16 rows: each column's best rows merged across blocks, the rows scanned again in blocks."""
    a, b = replica_pair(4)
    expected = match_cosines(a, b)
    monkeypatch.setattr(sparse_match, "BLOCK", 16)
    np.testing.assert_allclose(match_cosines_sparse(a, b, m=3), expected, atol=1e-9)


def test_candidates_rectangular_and_larger() -> None:
    rng = np.random.default_rng(5)
    a = rng.normal(size=(40, 16))
    b = a[rng.permutation(40)[:25]] + rng.normal(0, 0.1, (25, 16))
    for x, y in ((a, b), (b, a)):
        np.testing.assert_allclose(match_cosines_sparse(x, y, m=2), match_cosines(x, y), atol=1e-9)
    a, b = replica_pair(11, n=600, d=48)
    np.testing.assert_allclose(match_cosines_sparse(a, b, m=8), match_cosines(a, b), atol=1e-9)


def test_matched_cosines_goes_sparse_beyond_the_dense_size(monkeypatch) -> None:
    a, b = replica_pair(3)
    used = []
    monkeypatch.setattr(dictionary_match, "match_cosines_sparse", lambda *x, **k: used.append(1) or np.zeros(len(a)))
    matched_cosines(a, b)
    assert used == []
    monkeypatch.setattr(dictionary_match, "DENSE_MAX_CELLS", len(a) * len(b) - 1)
    matched_cosines(a, b)
    assert used == [1]
