"""Selectivity against chance: the null of random atoms, the top label's p-value, Benjamini-Hochberg, and the
rate at which atoms firing on random images are flagged."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import numpy as np
import pytest
from scipy.stats import false_discovery_control

from sae_pipeline.features import chance_exact
from sae_pipeline.features.chance import (
    TAIL_MIN,
    benjamini_hochberg,
    chance,
    min_images,
    null_selectivity,
    selectivity_p,
    simulate,
    top_label_p,
)


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


def exact_tail(images: list[int], n: int, s: float) -> float:
    """P(S_null >= s) over every label composition of n images (ties within 1e-9 count as reached)."""
    total, p = math.comb(sum(images), n), 0.0
    for counts in itertools.product(*(range(min(m, n) + 1) for m in images)):
        if sum(counts) == n and selectivity_of(counts, images) >= s - 1e-9:
            p += math.prod(math.comb(m, c) for m, c in zip(images, counts)) / total
    return p


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


def one_label(images: list[int], n: int) -> Fraction:
    """P(n random images all share a label), exactly: the least p-value S = 1 can have at n."""
    return Fraction(sum(math.comb(m, n) for m in images), math.comb(sum(images), n))


def test_min_images_is_the_fewest_that_could_beat_chance() -> None:
    for images in ([50] * 10, [3, 200, 40], [1, 1, 1], [500, 2]):
        for fdr in (0.05, 0.01):
            want = next((n for n in range(1, max(images) + 1) if one_label(images, n) <= Fraction(fdr)), None)
            assert min_images(np.array(images), fdr) == want, (images, fdr)
    assert min_images(np.array([50] * 10), 0.05) == 3  # two digits of one class are not enough to say
    assert min_images(np.array([3, 200, 40]), 0.05) == 15  # one image is never enough, whatever its label


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


def selectivities(fire: np.ndarray, images: np.ndarray) -> np.ndarray:
    return np.array([selectivity_of(row, images) if row.sum() else np.nan for row in fire])


def test_random_atoms_are_flagged_at_most_at_the_nominal_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Atoms that fire on random images: in runs of 60 such atoms, the share of runs with any atom said to beat
    chance (the false-discovery rate, every atom being null) stays within the nominal rate, while atoms that do
    prefer a label are found. Every way of finding p is used (exact up to n = 12 here, simulation and tail
    beyond); without Benjamini-Hochberg the null runs fail it."""
    monkeypatch.setattr(chance_exact, "EXACT_COMPOSITIONS", 2000)
    rng = np.random.default_rng(7)
    images = np.array([60, 30, 30, 20, 10])
    fdr, runs = 0.1, 120
    flagged_runs, raw_runs, methods = 0, 0, set()
    for _ in range(runs):
        fire = random_atoms(rng, images, 60, (1, 40))
        result = chance(fire, images, selectivities(fire, images), fdr=fdr, draws=200)
        flagged_runs += bool(result.beats.any())
        raw_runs += bool((np.where(np.isfinite(result.p_adjusted), result.p, 1.0) <= fdr).any())
        methods |= set(result.method[result.method >= 0].tolist())
        assert (result.too_few == ((fire.sum(1) > 0) & (fire.sum(1) < result.n_min))).all()
    margin = 3 * math.sqrt(fdr * (1 - fdr) / runs)
    assert flagged_runs / runs <= fdr + margin
    assert raw_runs / runs > fdr + margin  # each atom at its own p: the test can fail
    assert methods >= {0, 1, 2}
    # 40 null atoms and 20 that take half their images from label 0: the false discoveries stay within the rate
    shares, found = [], []
    for _ in range(30):
        fire = random_atoms(rng, images, 60, (20, 60), planted=20)
        beats = chance(fire, images, selectivities(fire, images), fdr=fdr, draws=200).beats
        shares.append(beats[20:].sum() / max(beats.sum(), 1))
        found.append(beats[:20].mean())
    assert np.mean(shares) <= fdr and np.mean(found) > 0.3  # S weighs every label: a planted one is found less


def test_chance_fields_per_atom() -> None:
    images = np.array([30, 30, 30])
    fire = np.array([[0, 0, 0], [1, 0, 0], [2, 0, 0], [12, 0, 0], [4, 4, 4], [10, 2, 0]])
    s = np.array([np.nan, *(selectivity_of(row, images) for row in fire[1:])])
    result = chance(fire, images, s, fdr=0.05, draws=500)
    n = fire.sum(1)
    assert result.exact_n == [2, 12] and result.mean[1] == 1.0 and result.sd[1] == 0.0  # three labels: all exact
    for atom in range(2, len(fire)):
        mean, sd = exact_null(images.tolist(), int(n[atom]))
        assert result.mean[atom] == pytest.approx(mean, abs=1e-12) and result.sd[atom] == pytest.approx(sd, abs=1e-9)
        assert result.p[atom] == pytest.approx(exact_tail(images.tolist(), int(n[atom]), s[atom]), rel=1e-9)
    np.testing.assert_allclose(result.excess[1:], s[1:] - result.mean[1:])
    assert np.isnan(result.mean[0]) and np.isnan(result.p[0]) and not result.too_few[0]
    assert result.n_min == min_images(images, 0.05) == 4
    assert result.too_few.tolist() == [False, True, True, False, False, False]
    assert result.beats.tolist() == [False, False, False, True, False, True]
    summary = result.summary()
    assert summary["tested"] == 3 and summary["beat_chance"] == 2 and summary["too_few"] == 2
    assert "n_min = 4" in result.formula() and "500 random draws" in result.formula()
    assert summary["p_methods"] == {"exact, one label": 3, "exact": 2, "simulation": 0, "tail approximation": 0}


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
    assert "<b>does not beat chance</b>" in pages[3] and "p = P(S_null ≥ S) = 1.0e0 (exact)" in pages[3]
    assert "(exact, over every label composition)" in pages[3]
    assert all("Benjamini–Hochberg over the atoms with n ≥ n_min = 4" in page for page in pages)
    rows = [label_pages.index_columns(stats, atom) for atom in range(4)]
    verdicts = [row[label_pages.INDEX_COLUMNS.index("verdict")] for row in rows]
    assert verdicts == [None, label_pages.VERDICT_FEW, label_pages.VERDICT_BEATS, label_pages.VERDICT_CHANCE]
    excess = rows[2][label_pages.INDEX_COLUMNS.index("excess")]
    assert excess == pytest.approx(1 - stats.chance.by_n_mean[12], abs=1e-3) and excess > 0.5
    assert "1 of 2 atoms tested beat chance" in label_pages.index_section(stats)
    assert label_pages.index_data(stats)["sort"] == "excess" and label_pages.index_data(None) == {"labels": None}


def test_an_fdr_no_atom_can_reach_is_said_not_n_min_none(tmp_path, capsys) -> None:
    """Two labels of 3 images: the best an atom can do (all 3 of one label) is p = 2 / C(6, 3) = 0.1, above
    the default FDR; the page and the command's output say so instead of printing ``n_min = None``."""
    import json

    import torch

    from sae_pipeline.features import label_pages
    from sae_pipeline.features.chance import smallest_p
    from sae_pipeline.features.cli import report_image_checks
    from sae_pipeline.features.selectivity import label_stats
    from sae_pipeline.features.site_dir import MARKER_FNAME

    for images in ([3, 3], [50] * 10, [3, 200, 40], [1, 1, 1], [500, 2], [2, 1]):
        exact = Fraction(images.count(max(images)), math.comb(sum(images), max(images)))  # all of the largest label
        assert smallest_p(np.array(images)) == pytest.approx(float(min(exact, 1)), rel=1e-9)
        for fdr in (0.05, 0.2):  # no n_min exactly when even the best atom misses the rate
            assert (min_images(np.array(images), fdr) is None) == (exact > Fraction(fdr)), (images, fdr)
    fire = np.array([[0, 0], [3, 0], [2, 1]], np.int64)
    state = {
        "label_fire": torch.from_numpy(fire),
        "label_images": torch.tensor([3, 3]),
        "label_fire_unlabelled": torch.zeros(3, dtype=torch.int64),
        "label_images_unlabelled": torch.tensor(0),
        "image": torch.full((3, 2), -1),
    }
    stats = label_stats(state, {"images": {}})
    said = "no atom can beat chance at FDR 0.05 with 6 labelled images: the smallest possible p is 0.1 "
    pages = [label_pages.atom_section(stats, atom, 2) for atom in range(3)] + [label_pages.index_section(stats)]
    assert all("None" not in page for page in pages)
    assert said in pages[1] and said in pages[2] and said in pages[3] and "the 2 atoms that fire on them" in pages[3]
    (tmp_path / MARKER_FNAME).write_text(json.dumps({"labels": stats.summary()}))
    report_image_checks(tmp_path)
    err = capsys.readouterr().err
    assert err.startswith(f"warning: {said}") and "pass --fdr above it" in err and err.count("\n") == 1
    assert stats.summary()["chance"]["min_images"] is None
    assert chance(fire, np.array([3, 3]), np.zeros(3), fdr=0.2).n_min == 3  # a rate the best atom reaches


def test_empirical_p_of_s_against_a_plain_count_of_the_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh random label sizes and atoms: the simulation's count of draws reaching each atom's S (the empirical
    p-value's b) equals a plain loop over the same draws, and p = (1 + b) / (1 + draws) where b >= TAIL_MIN."""
    monkeypatch.setattr(chance_exact, "EXACT_COMPOSITIONS", 0)  # every n by simulation
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    images = rng.integers(5, 40, 6)
    fire = random_atoms(rng, images, 30, (2, 25))
    fire[0] = 0  # never fires
    s = selectivities(fire, images)
    draws, seed = 150, int(rng.integers(1 << 30))
    n = fire.sum(1)
    _, _, counted = simulate(images, int(n.max()), draws, seed, n[1:], s[1:])
    pool = np.repeat(np.arange(len(images), dtype=np.int16), images)
    orders = np.random.default_rng(seed).permuted(np.broadcast_to(pool, (draws, len(pool))), axis=1)
    for atom in range(1, len(fire)):
        null = [selectivity_of(np.bincount(order[: n[atom]], minlength=len(images)), images) for order in orders]
        assert counted[atom - 1] == sum(value >= s[atom] - 1e-9 for value in null), atom
    p, method, *_ = selectivity_p(fire, images, s, draws, seed)
    b = np.concatenate([[0], counted])
    simulated = method == 2
    assert simulated.any() and (b[simulated] >= TAIL_MIN).all()
    np.testing.assert_allclose(p[simulated], (1 + b[simulated]) / (1 + draws))
    tailed = method == 3
    assert (b[tailed] < TAIL_MIN).all() and (p[tailed] <= (1 + b[tailed]) / (1 + draws)).all()
    assert np.isnan(p[0]) and method[0] == -1


@pytest.mark.parametrize("images", [[5, 3, 7, 2], [6, 6, 6, 1, 9], [3, 3, 3, 3, 3, 3, 3, 3]])
def test_exact_null_equals_brute_force_enumeration(images: list[int]) -> None:
    """E[S | n], SD[S | n] and P(S_null >= s) from the composition listing equal a brute force over every count
    vector; the listing's probabilities sum to 1."""
    for n in (2, 3, 5):
        values, weights = chance_exact.enumerate_null(np.array(images), n)
        assert weights.sum() == pytest.approx(1.0, abs=1e-12)
        mean, sd = chance_exact.moments(values, weights)
        want_mean, want_sd = exact_null(images, n)
        assert mean == pytest.approx(want_mean, abs=1e-12) and sd == pytest.approx(want_sd, abs=1e-9)
        observed = np.unique(values)[:: max(1, len(np.unique(values)) // 5)]
        got = chance_exact.tail(values, weights, observed)
        assert got == pytest.approx([exact_tail(images, n, value) for value in observed], rel=1e-9)
        one = float(np.exp(chance_exact.log_one_label(np.array(images), np.array([n]))[0]))
        assert one == pytest.approx(float(one_label(images, n)), rel=1e-9)


def test_the_four_and_four_atom_beats_chance() -> None:
    """Issue 42's atom: 4 images of one digit and 4 of another (S 0.699 against E[S] ~0.29): about 1 in 9 000
    random atoms of 8 images score as high, so among 200 random atoms it beats chance. The old verdict (the top
    label's hypergeometric tail, x L) said it did not."""
    rng = np.random.default_rng(3)
    images = np.full(10, 1000)
    fire = random_atoms(rng, images, 200, (8, 30))
    fire[0] = [4, 0, 4, 0, 0, 0, 0, 0, 0, 0]
    result = chance(fire, images, selectivities(fire, images), draws=300)
    assert 8 in result.exact_n and result.method[0] == 1
    assert selectivities(fire[:1], images)[0] == pytest.approx(0.699, abs=1e-3)
    simulated, spread = null_selectivity(images, 8, draws=2000, seed=5)
    assert abs(result.mean[0] - simulated[8]) < 5 * spread[8] / math.sqrt(2000)  # exact, against a simulation
    assert 1e-4 < result.p[0] < 2e-4 and result.beats[0] and result.excess[0] > 0.4
    assert benjamini_hochberg(np.where(np.isfinite(result.p_adjusted), result.top_p, np.nan))[0] > 0.05
    assert result.beats[1:].mean() <= 0.05  # the random ones mostly do not


def test_interval_is_wide_for_three_images_and_narrow_for_67() -> None:
    """Three images and 67 images of one label both show S = 1 and q[top] = 1; their 95 % posterior intervals say
    how sure that is; an atom spread over every label has an interval near 0; the intervals are seeded."""
    from sae_pipeline.features.label_intervals import intervals

    images = np.full(10, 100)
    fire = np.zeros((4, 10), np.int64)
    fire[0, 2], fire[1, 2], fire[2] = 3, 67, 5
    fire[3, 2], fire[3, 5] = 27, 40  # 67 images over two labels
    s_low, s_high, q_low, q_high = intervals(fire, images, np.array([2, 2, 0, 5]))
    assert s_high[0] - s_low[0] > 0.5 and s_high[1] - s_low[1] < 0.2 and s_low[1] > 0.8
    assert q_high[0] - q_low[0] > 0.3 and q_low[1] > 0.9
    s_two = selectivity_of(fire[3], images)  # 0.707: inside its interval, which is far narrower than n = 3's
    assert s_high[2] < 0.1 and s_low[3] < s_two < s_high[3] and s_high[3] - s_low[3] < 0.25 and q_low[3] < 0.6
    for bound in intervals(fire, images, np.array([2, 2, 0, 5])) + (s_low, s_high, q_low, q_high):
        assert (0 <= bound).all() and (bound <= 1).all()
    again = intervals(fire, images, np.array([2, 2, 0, 5]))
    assert np.array_equal(again[0], s_low) and np.isnan(intervals(np.zeros((1, 10)), images, np.zeros(1, int))[0][0])


def test_p_values_have_one_notation_on_the_pages_and_in_the_index() -> None:
    """The atom pages and the index's p column write every p-value the same way (1.1e-4, 5.0e-2, 1.0e0: no mix of
    0.0012 and 1.2e-07); the index's script, run by node, agrees with the pages character for character."""
    import re
    import shutil
    import subprocess

    from sae_pipeline.features.label_assets import LABELS_JS
    from sae_pipeline.features.label_pages import _p

    values = [1.0, 0.05, 0.0012, 1.234e-4, 3e-30, 0.999]
    written = [_p(v) for v in values]
    assert all(re.fullmatch(r"\d\.\de-?\d+", text) for text in written), written
    assert written[:3] == ["1.0e0", "5.0e-2", "1.2e-3"] and _p(float("nan")) == "–"
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the index's script is checked by the browser tests")
    script = (
        "const window = {}; const document = {addEventListener() {}};\n"
        + LABELS_JS
        + f"\nconsole.log(JSON.stringify({values}.map(window.labelsPValue)));"
    )
    out = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(out) == written
