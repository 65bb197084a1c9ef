"""Selectivity against chance: the null of random atoms, the top label's p-value, Benjamini-Hochberg, and the
rate at which atoms firing on random images are flagged."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from scipy.stats import false_discovery_control

from sae_pipeline.features.chance import benjamini_hochberg, chance, min_images, null_selectivity, top_label_p


def selectivity_of(counts, images) -> float:
    """S of one atom's label counts, by the formula (float64)."""
    rate = np.asarray(counts, np.float64) / np.asarray(images, np.float64)
    q = rate / rate.sum()
    q = q[q > 0]
    return float(1 + (q * np.log(q)).sum() / math.log(len(images)))


def exact_null(images: list[int], n: int) -> tuple[float, float]:
    """E[S | n] and SD[S | n] over every label composition of n images drawn without replacement (exact weights)."""
    total, mean, square = math.comb(sum(images), n), 0.0, 0.0
    for counts in itertools.product(*(range(min(m, n) + 1) for m in images)):
        if sum(counts) != n:
            continue
        weight = math.prod(math.comb(m, c) for m, c in zip(images, counts)) / total
        s = selectivity_of(counts, images)
        mean, square = mean + weight * s, square + weight * s * s
    return mean, math.sqrt(max(square - mean * mean, 0.0))


def tail(count: int, total: int, of_label: int, n: int) -> Fraction:
    """P(X >= count), X ~ Hypergeometric(total, of_label, n), as an exact fraction."""
    ways = sum(math.comb(of_label, k) * math.comb(total - of_label, n - k) for k in range(count, min(of_label, n) + 1))
    return Fraction(ways, math.comb(total, n))


@pytest.mark.parametrize("images", [[5, 3, 7, 2], [6, 6, 6], [1, 9, 4]])
def test_null_selectivity_equals_exact_enumeration(images: list[int]) -> None:
    draws = 4000
    mean, sd = null_selectivity(np.array(images), sum(images), draws=draws, seed=1)
    assert np.isnan(mean[0]) and mean[1] == pytest.approx(1.0, abs=1e-12) and sd[1] == pytest.approx(0.0, abs=1e-7)
    assert mean[-1] == pytest.approx(0.0, abs=1e-9) and sd[-1] == pytest.approx(0.0, abs=1e-6)  # every image
    for n in range(2, sum(images)):
        want_mean, want_sd = exact_null(images, n)
        error = want_sd / math.sqrt(draws)  # the Monte-Carlo error of the mean
        assert abs(mean[n] - want_mean) <= 5 * error + 1e-12, (n, mean[n], want_mean)
        assert sd[n] == pytest.approx(want_sd, rel=0.1, abs=1e-9), n


def test_null_selectivity_is_seeded_and_only_as_long_as_asked() -> None:
    images = np.array([40, 25, 35])
    a, b = null_selectivity(images, 30, draws=300, seed=3), null_selectivity(images, 30, draws=300, seed=3)
    assert np.array_equal(a[0], b[0], equal_nan=True) and len(a[0]) == 31
    assert len(null_selectivity(images, 500, draws=10)[0]) == 101  # no more images than there are
    # the figures for ten equal digit classes: about 0.58 at n = 3 and 0.23 at n = 10
    mean, _ = null_selectivity(np.full(10, 50), 10, draws=2000)
    assert mean[3] == pytest.approx(0.58, abs=0.02) and mean[10] == pytest.approx(0.23, abs=0.02)


def test_top_label_p_equals_exact_hypergeometric_tail() -> None:
    """L times the smallest tail among the labels tied for the top rate c / m, on random counts with ties."""
    rng = np.random.default_rng(0)
    images = np.array([12, 4, 8, 8, 2])
    fire = np.stack([rng.binomial(images, rng.random()) for _ in range(300)])
    fire[0] = [0, 0, 0, 0, 0]  # never fires
    fire[1] = [6, 2, 4, 4, 1]  # every label tied at rate 1/2
    fire[2] = [0, 0, 8, 8, 0]  # two labels tied at rate 1, equal priors
    fire[3] = [12, 4, 0, 0, 0]  # tied at rate 1, unequal priors: the rarer label's tail is the larger
    got = top_label_p(fire, images)
    total, n_labels = int(images.sum()), len(images)
    for atom, row in enumerate(fire):
        if row.sum() == 0:
            assert np.isnan(got[atom])
            continue
        rates = [Fraction(int(c), int(m)) for c, m in zip(row, images)]
        tied = [label for label in range(n_labels) if rates[label] == max(rates)]
        want = min(1.0, n_labels * float(min(tail(int(row[i]), total, int(images[i]), int(row.sum())) for i in tied)))
        assert got[atom] == pytest.approx(want, rel=1e-9, abs=1e-300), atom
    assert got[3] == pytest.approx(5 * float(tail(12, 34, 12, 16)))


def bh_direct(p: list[float], alpha: float) -> set[int]:
    """Benjamini-Hochberg's step-up as written: reject the k smallest, k the largest with p_(k) <= k alpha / m."""
    order = sorted(range(len(p)), key=lambda i: p[i])
    passing = [k for k in range(1, len(p) + 1) if p[order[k - 1]] <= k * alpha / len(p)]
    return set(order[: max(passing)]) if passing else set()


def test_benjamini_hochberg_against_direct_step_up_and_scipy() -> None:
    rng = np.random.default_rng(4)
    for trial in range(30):
        p = np.concatenate([rng.random(40), rng.random(10) * 1e-3, [1.0, 0.0]])
        p[rng.random(len(p)) < 0.2] = np.nan  # untested atoms: left out of the family
        tested = np.flatnonzero(np.isfinite(p))
        adjusted = benjamini_hochberg(p)
        assert np.isnan(adjusted[np.isnan(p)]).all()
        np.testing.assert_allclose(adjusted[tested], false_discovery_control(p[tested]), rtol=1e-12)
        for alpha in (0.01, 0.05, 0.2):
            want = {int(tested[i]) for i in bh_direct(p[tested].tolist(), alpha)}
            assert set(np.flatnonzero(adjusted <= alpha).tolist()) == want, (trial, alpha)


def test_min_images_is_the_fewest_that_could_beat_chance() -> None:
    for images in ([50] * 10, [3, 200, 40], [1, 1, 1], [500, 2]):
        total, n_labels = sum(images), len(images)
        for fdr in (0.05, 0.01):
            best = [
                min((n_labels * tail(n, total, m, n) for m in images if m >= n), default=Fraction(1))
                for n in range(1, max(images) + 1)
            ]
            want = next((n + 1 for n, p in enumerate(best) if p <= Fraction(fdr)), None)
            assert min_images(np.array(images), fdr) == want, (images, fdr)
    assert min_images(np.array([50] * 10), 0.05) == 3  # two digits of one class are not enough to say


def random_atoms(rng, images: np.ndarray, n_atoms: int, n_range: tuple[int, int], planted: int = 0) -> np.ndarray:
    """Label counts of atoms firing on random images: each atom's ``n`` first images of its own random order of
    them; the first ``planted`` take half their images from label 0 first."""
    pool = np.repeat(np.arange(len(images)), images)
    n = rng.integers(*n_range, n_atoms)
    planted_n = np.where(np.arange(n_atoms) < planted, np.minimum(n // 2, images[0]), 0)
    ids = rng.permuted(np.broadcast_to(np.arange(len(pool)), (n_atoms, len(pool))), axis=1)
    order = pool[ids]
    skip = ids < planted_n[:, None]  # the label-0 images already taken (ids 0.. are label 0's): out of the order
    kept = np.cumsum(~skip, axis=1) <= (n - planted_n)[:, None]
    chosen = ~skip & kept
    fire = np.stack([((order == label) & chosen).sum(1) for label in range(len(images))], 1)
    fire[:, 0] += planted_n
    return fire


def test_random_atoms_are_flagged_at_most_at_the_nominal_rate() -> None:
    """Atoms that fire on random images: in runs of 60 such atoms, the share of runs with any atom said to beat
    chance (the false-discovery rate, every atom being null) stays within the nominal rate, while atoms that do
    prefer a label are found. Without the Bonferroni factor over the labels the null runs fail it."""
    rng = np.random.default_rng(7)
    images = np.array([60, 30, 30, 20, 10])
    fdr, runs = 0.1, 400
    flagged_runs, raw_runs = 0, 0
    for _ in range(runs):
        fire = random_atoms(rng, images, 60, (1, 40))
        result = chance(fire, images, np.zeros(len(fire)), fdr=fdr, draws=2)
        flagged_runs += bool(result.beats.any())
        testable = np.isfinite(result.p_adjusted)
        raw_runs += bool((benjamini_hochberg(np.where(testable, result.p / len(images), np.nan)) <= fdr).any())
        assert (result.too_few == ((fire.sum(1) > 0) & (fire.sum(1) < result.n_min))).all()
    margin = 3 * math.sqrt(fdr * (1 - fdr) / runs)
    assert flagged_runs / runs <= fdr + margin
    assert raw_runs / runs > fdr + margin  # the uncorrected top label: the test can fail
    # 40 null atoms and 20 that take half their images from label 0: the false discoveries stay within the rate
    shares, found = [], []
    for _ in range(60):
        fire = random_atoms(rng, images, 60, (20, 60), planted=20)
        beats = chance(fire, images, np.zeros(len(fire)), fdr=fdr, draws=2).beats
        shares.append(beats[20:].sum() / max(beats.sum(), 1))
        found.append(beats[:20].mean())
    assert np.mean(shares) <= fdr and np.mean(found) > 0.5


def test_chance_fields_per_atom() -> None:
    images = np.array([30, 30, 30])
    fire = np.array([[0, 0, 0], [1, 0, 0], [2, 0, 0], [12, 0, 0], [4, 4, 4], [10, 2, 0]])
    s = np.array([np.nan, *(selectivity_of(row, images) for row in fire[1:])])
    result = chance(fire, images, s, fdr=0.05, draws=500)
    mean, sd = null_selectivity(images, 16, draws=500)
    n = fire.sum(1)
    np.testing.assert_array_equal(result.mean[1:], mean[n[1:]])
    np.testing.assert_array_equal(result.sd[1:], sd[n[1:]])
    np.testing.assert_allclose(result.excess[1:], s[1:] - mean[n[1:]])
    assert np.isnan(result.mean[0]) and np.isnan(result.p[0]) and not result.too_few[0]
    assert result.n_min == min_images(images, 0.05) == 4
    assert result.too_few.tolist() == [False, True, True, False, False, False]
    assert result.beats.tolist() == [False, False, False, True, False, True]
    summary = result.summary()
    assert summary["tested"] == 3 and summary["beat_chance"] == 2 and summary["too_few"] == 2
    assert "n_min = 4" in result.formula() and "500 random draws" in result.formula()


def test_pages_state_the_verdict() -> None:
    """Each atom's section says what it is against chance, the index row carries it, the formula is on the page."""
    import torch

    from sae_pipeline.features import label_pages
    from sae_pipeline.features.selectivity import label_stats

    fire = np.array([[0, 0, 0], [2, 0, 0], [12, 0, 0], [4, 4, 4]], np.int64)
    state = {
        "label_fire": torch.from_numpy(fire),
        "label_images": torch.tensor([30, 30, 30]),
        "label_fire_unlabelled": torch.zeros(4, dtype=torch.int64),
        "label_images_unlabelled": torch.tensor(0),
        "image": torch.full((4, 2), -1),
    }
    stats = label_stats(state, {"images": {}})
    pages = [label_pages.atom_section(stats, atom, 2) for atom in range(4)]
    assert "Against chance" not in pages[0] and "Too few images to say" not in pages[0]
    assert "Too few images to say: it fires on 2 labelled images, fewer than n_min = 4" in pages[1]
    assert "<b>beats chance</b> at FDR 0.05" in pages[2] and "excess S − E[S] = " in pages[2]
    assert "<b>does not beat chance</b>" in pages[3] and "p = 1 (hypergeometric, × L)" in pages[3]
    assert all("Benjamini–Hochberg over the atoms with n ≥ n_min = 4" in page for page in pages)
    rows = [label_pages.index_columns(stats, atom) for atom in range(4)]
    verdicts = [row[label_pages.INDEX_COLUMNS.index("verdict")] for row in rows]
    assert verdicts == [None, label_pages.VERDICT_FEW, label_pages.VERDICT_BEATS, label_pages.VERDICT_CHANCE]
    excess = rows[2][label_pages.INDEX_COLUMNS.index("excess")]
    assert excess == pytest.approx(1 - stats.chance.by_n_mean[12], abs=1e-3) and excess > 0.5
    assert "1 of 2 atoms tested beat chance" in label_pages.index_section(stats)
    assert label_pages.index_data(stats)["sort"] == "excess" and label_pages.index_data(None) == {"labels": None}
