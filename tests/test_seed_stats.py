"""Comparisons over SAE seeds (Welch, the bootstrap over validation rows), the stability of dictionaries across
seeds, and how seed replicas are named and trained: each against a plain reference on fresh random inputs."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from sae_pipeline.evaluate.runs import plan_runs
from sae_pipeline.evaluate.seed_report import seeds_section
from sae_pipeline.evaluate.seed_stats import (
    bootstrap_denominators,
    bootstrap_r2,
    claim_over_seeds,
    r2_over_seeds,
    resample_counts,
    welch,
)
from sae_pipeline.evaluate.stability import match_cosines, stability

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def hand_welch(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """(p, low, high) of Welch's test from its definition."""
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    d = a.mean() - b.mean()
    half = stats.t.ppf(0.975, df) * np.sqrt(va + vb)
    return float(2 * stats.t.sf(abs(d) / np.sqrt(va + vb), df)), d - half, d + half


def test_welch_is_its_definition() -> None:
    rng = np.random.default_rng(0)
    for n_a, n_b in [(2, 2), (3, 5), (4, 3)]:
        a, b = rng.normal(0.80, 0.01, n_a), rng.normal(0.79, 0.02, n_b)
        found = welch(list(a), list(b))
        p, low, high = hand_welch(a, b)
        assert found["p"] == pytest.approx(p, rel=1e-9) and found["interval"] == pytest.approx([low, high])
        assert found["difference"] == pytest.approx(a.mean() - b.mean())
    assert welch([0.5], [0.4, 0.41])["p"] is None  # one seed: nothing to test against, not a zero spread


def test_bootstrap_r2_recomputes_each_seed_on_each_resample() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 6))
    x_hats = [x + rng.normal(0, s, x.shape) for s in (0.3, 0.5)]  # two seeds' reconstructions
    errors = np.stack([((x - xh) ** 2).sum(axis=1) for xh in x_hats])
    counts = resample_counts(len(x), resamples=25, seed=3)
    assert (counts.sum(axis=1) == len(x)).all()
    found = bootstrap_r2(errors, counts, bootstrap_denominators(x, counts))
    for b, row_counts in enumerate(counts):
        rows = np.repeat(np.arange(len(x)), row_counts)
        xs = x[rows]
        for s, xh in enumerate(x_hats):
            plain = 1 - ((xs - xh[rows]) ** 2).sum() / ((xs - xs.mean(axis=0)) ** 2).sum()
            assert found[b, s] == pytest.approx(plain, rel=1e-10)


def test_r2_over_seeds_compares_variants_by_welch_with_an_image_bootstrap() -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(30, 4))
    entries, residuals = {}, {}
    settings = {("mpsae", 4, 16): ["m0", "m1", "m2"], ("topk", 4, 16): ["t0", "t1", "t2"]}
    for name in itertools.chain(*settings.values()):
        x_hat = x + rng.normal(0, 0.2 if name[0] == "m" else 0.6, x.shape)
        errors = ((x - x_hat) ** 2).sum(axis=1)
        entries[name] = {"r2": 1 - errors.sum() / ((x - x.mean(0)) ** 2).sum()}
        residuals[name] = ("data", errors)
    found = r2_over_seeds(settings, entries, residuals, {"data": x})
    (comparison,) = found["comparisons"]
    values = {v: [entries[n]["r2"] for n in names] for (v, _, _), names in settings.items()}
    assert comparison["p"] == pytest.approx(stats.ttest_ind(values["mpsae"], values["topk"], equal_var=False).pvalue)
    assert comparison["at"] == {"k": 4, "p": 16} and comparison["significant"]
    low, high = comparison["bootstrap_interval"]
    assert low < comparison["difference"] < high and low > 0
    cell = found["variants"]["mpsae"][0]
    assert cell["mean"] == pytest.approx(np.mean(values["mpsae"])) and cell["values"] == values["mpsae"]
    assert claim_over_seeds(found["comparisons"]) is True
    assert claim_over_seeds([{**comparison, "significant": False}]) is None  # not separated from seed noise
    assert claim_over_seeds([{**comparison, "difference": -0.1}]) is False
    text = "\n".join(seeds_section({"seeds": {"n": 3, "r2": found}}))
    assert "| MP-SAE − TopK | 4, 16 |" in text and "Welch" in text
    # rows by (k, p), whatever order the study met the settings in (runs reused from an earlier study come first)
    shuffled = {**found, "variants": {"mpsae": [{**cell, "p": 32}, {**cell, "p": 16}]}}
    text = "\n".join(seeds_section({"seeds": {"n": 3, "r2": shuffled}}))
    assert text.index("| MP-SAE | 4, 16 |") < text.index("| MP-SAE | 4, 32 |")


def test_matching_is_the_best_one_to_one_assignment() -> None:
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(5, 4)), rng.normal(size=(5, 4))
    found = match_cosines(a, b)
    na, nb = a / np.linalg.norm(a, axis=1, keepdims=True), b / np.linalg.norm(b, axis=1, keepdims=True)
    cos = np.abs(na @ nb.T)
    best = max(sum(cos[i, j] for i, j in enumerate(perm)) for perm in itertools.permutations(range(5)))
    assert found.sum() == pytest.approx(best)


def test_stability_finds_a_permuted_dictionary_and_not_a_random_one() -> None:
    rng = np.random.default_rng(4)
    w = rng.normal(size=(24, 16))
    again = -w[rng.permutation(24)] + rng.normal(0, 0.05, w.shape)  # the same atoms, reordered, signs flipped
    other = rng.normal(size=(24, 16))
    found = stability([w, again, other])
    shares = {(pair["a"], pair["b"]): pair["share"] for pair in found["pairs"]}
    assert shares[(0, 1)] == 1.0 and shares[(0, 2)] < 0.2 and shares[(1, 2)] < 0.2
    assert found["share_matched"] == pytest.approx(np.mean(list(shares.values())))
    assert found["atoms_found_in"] == [2 + (c >= 0.7) for c in match_cosines(w, other)]
    assert sum(found["found_in_counts"].values()) == 24 and found["found_in_counts"]["2"] >= 20


def test_seed_replicas_are_named_and_seeded_and_seed_0_is_the_run_of_before() -> None:
    specs = plan_runs(["topk"], [(4, 16)], "digits", 20, CONFIGS, "digits", sae_seeds=3)
    assert [s.name for s in specs] == ["topk_p16_k4", "topk_p16_k4_s1", "topk_p16_k4_s2"]
    first = plan_runs(["topk"], [(4, 16)], "digits", 20, CONFIGS, "digits")[0]
    assert specs[0] == first and "seed" not in first.settings()  # an output written before seeds is reused
    assert specs[2].settings()["seed"] == 2
    args = specs[2].fit_args(Path("out"))
    assert args[args.index("--seed_everything") + 1] == "2" and "--seed_everything" not in first.fit_args(Path("o"))
    assert specs[2].member()["seed"] == 2 and "seed" not in first.member()
