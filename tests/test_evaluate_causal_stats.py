"""``evaluate causal``'s statistics against plain references on fresh random inputs: the matched atom (ties
included), the per-atom paired t figures (scipy), the set ablations' choice of atoms and their targeted and
untargeted drops (loops over classes and images)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from sae_pipeline.evaluate.causal_stats import label_sets, matched_entries, per_atom_t, set_ablations, true_log_p


def random_entries(rng: np.random.Generator, n: int, d_sae: int, k: int) -> tuple[np.ndarray, ...]:
    """Image codes ``(image, atom, z)``: up to k distinct atoms per image, integer |z| (ties) of either sign."""
    rows = [(i, j) for i in range(n) for j in rng.choice(d_sae, rng.integers(1, k + 1), replace=False)]
    i, j = (np.array(a) for a in zip(*rows))
    z = rng.integers(1, 4, len(i)) * rng.choice([-1.0, 1.0], len(i))
    order = rng.permutation(len(i))  # any order: the function must not rely on it
    return i[order], j[order], z[order]


@pytest.mark.parametrize("seed", range(5))
def test_the_matched_atom_is_the_closest_code_of_the_same_image(seed: int) -> None:
    rng = np.random.default_rng(seed)
    i, j, z = random_entries(rng, n=30, d_sae=12, k=6)
    matched = matched_entries(i, j, z)
    for e in range(len(i)):
        mine = (abs(z[e]), j[e])
        others = [(abs(z[f]), j[f], f) for f in range(len(i)) if i[f] == i[e] and f != e]
        if not others:
            assert matched[e] == -1
            continue
        gap = min(abs(a - mine[0]) for a, _, _ in others)
        closest = [o for o in others if abs(o[0] - mine[0]) == gap]
        below = [o for o in closest if o[:2] < mine]
        expected = max(below)[2] if below else min(closest)[2]
        assert matched[e] == expected, (e, matched[e], expected)
    assert (matched == -1).any() and (matched >= 0).any()


def test_per_atom_t_equals_scipy() -> None:
    rng = np.random.default_rng(0)
    atom = rng.integers(0, 8, 200)
    atom[atom == 7] = 6  # atom 7: no entry
    atom[np.flatnonzero(atom == 5)[1:]] = 4  # atom 5: one entry
    values = rng.normal(0.2, 1.0, len(atom))
    values[atom == 3] = 0.5  # constant: no spread
    found = per_atom_t(values, atom, 8)
    for a in range(8):
        x = values[atom == a]
        assert found["n"][a] == len(x)
        if len(x) == 0:
            assert np.isnan(found["mean"][a]) and np.isnan(found["p"][a])
            continue
        assert np.isclose(found["mean"][a], x.mean())
        if len(x) < 2:
            assert np.isnan(found["low"][a]) and np.isnan(found["p"][a])
        elif np.ptp(x) == 0:
            assert found["p"][a] == 0.0 and np.isclose(found["low"][a], 0.5)
        else:
            low, high = stats.t.interval(0.95, len(x) - 1, x.mean(), stats.sem(x))
            assert np.allclose([found["low"][a], found["high"][a]], [low, high])
            assert np.isclose(found["p"][a], stats.ttest_1samp(x, 0.0, alternative="greater").pvalue)


def test_set_ablations_equal_plain_loops() -> None:
    rng = np.random.default_rng(1)
    n_classes, d_sae, n = 4, 10, 60
    y_train = rng.integers(0, n_classes, n)
    y_train[0] = -1  # a label the probe lacks: left out
    train = random_entries(rng, n, d_sae, 5)
    train = (train[0], train[1], np.abs(train[2]))
    sets = label_sets(train, y_train, n_classes, d_sae, m=3)
    dense = np.zeros((n, d_sae))
    dense[train[0], train[1]] = train[2]
    for c in range(n_classes):
        known = y_train >= 0
        diff = dense[known & (y_train == c)].mean(0) - dense[known & (y_train != c)].mean(0)
        expected = [a for a in sorted(range(d_sae), key=lambda a: (-diff[a], a))[:3] if diff[a] > 0]
        assert sets[c].tolist() == expected

    y = rng.integers(0, n_classes, n)
    y[3] = -1
    entries = random_entries(rng, n, d_sae, 5)
    logits, V = rng.normal(0, 1, (n, n_classes)), rng.normal(0, 1, (d_sae, n_classes))
    found = set_ablations(logits, V, y, entries, sets)
    codes = np.zeros((n, d_sae))
    codes[entries[0], entries[1]] = entries[2]
    scored = y >= 0
    logp0 = true_log_p(logits[scored], y[scored])
    for c, row in enumerate(found):
        moved = logits - codes[:, sets[c]] @ V[sets[c]]
        drops = []
        for k in range(n_classes):
            mine = y == k
            drops.append((logits[mine].argmax(1) == k).mean() - (moved[mine].argmax(1) == k).mean())
        assert np.isclose(row["targeted_accuracy_drop"], drops[c])
        assert np.isclose(row["untargeted_accuracy_drop"], np.mean([d for k, d in enumerate(drops) if k != c]))
        assert np.isclose(row["tpp"], row["targeted_accuracy_drop"] - row["untargeted_accuracy_drop"])
        logp_drop = logp0 - true_log_p(moved[scored], y[scored])
        assert np.isclose(row["targeted_logp_drop"], logp_drop[y[scored] == c].mean())
        assert np.isclose(row["untargeted_logp_drop"], logp_drop[y[scored] != c].mean())
        assert row["atoms"] == sets[c].tolist() and row["images"] == (y == c).sum()
    assert any(abs(row["tpp"]) > 0 for row in found)
