"""Probing with its uncertainty: intervals over SAE seeds, Monte-Carlo error over draws, Welch comparisons over
seeds, Holm, SAEBench's all-dimensions probe.

The statistics are checked against scipy and a hand-written Welch on fresh random inputs and against a plain Holm
written from its definition; a simulation of variants that do not differ (each SAE seed with its own offset, as
trained SAEs have) checks that the comparisons over seeds call about the nominal share of them significant, where
a test over draws would not; the all-dimensions probe is checked for the bias its epoch choice builds in.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from sae_pipeline.evaluate.linear_probe import probe_accuracy, saebench_all_probe_accuracy
from sae_pipeline.evaluate.probe_stats import (
    compare_models,
    holm,
    seed_comparison,
    summarise_draws,
    summarise_replicas,
    t_interval,
)
from sae_pipeline.evaluate.probing_report import probing_section


def test_t_interval_is_scipys() -> None:
    values = np.random.default_rng(0).normal(0.9, 0.01, 7)
    mean, sd, (low, high) = t_interval(values)
    expected = stats.t.interval(0.95, 6, loc=values.mean(), scale=stats.sem(values))
    assert (low, high) == pytest.approx(expected, rel=1e-12) and sd == pytest.approx(values.std(ddof=1))
    assert mean == pytest.approx(values.mean())
    assert t_interval([0.5]) == (0.5, None, None)  # one draw: no spread, not a zero one


def test_holm_matches_its_definition() -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        p = list(rng.uniform(0, 0.2, 8))
        p[3] = None
        present = [(v, i) for i, v in enumerate(p) if v is not None]
        order = sorted(present)
        plain = {}
        for rank, (_, i) in enumerate(order):  # max over the earlier steps of (m - rank) p, capped at 1
            plain[i] = max(min(1.0, (len(order) - r) * order[r][0]) for r in range(rank + 1))
        adjusted = holm(p)
        assert adjusted[3] is None
        assert all(adjusted[i] == pytest.approx(plain[i]) for i in plain)


def entry(rng: np.random.Generator, seeds: int, labels: int, shift: float = 0.0, draws: int = 3) -> dict:
    """A variant's accuracies: a class effect shared by every variant, an offset per SAE seed (SD 0.01, the
    seed-to-seed spread), and a small noise per draw and class (SD 0.002, the re-balancing)."""
    replicas = []
    for _ in range(seeds):
        offset = rng.normal(0, 0.01)
        by_draw = []
        for _ in range(draws):
            by_label = {
                str(c): {"1": float(0.8 + 0.01 * c + shift + offset + rng.normal(0, 0.002))} for c in range(labels)
            }
            by_draw.append({"mean": {"1": float(np.mean([a["1"] for a in by_label.values()]))}, "by_label": by_label})
        replicas.append(summarise_draws(by_draw))
    found = {"sae_seeds": [{"seed": i, "mean": r["mean"], "mc_error": r["mc_error"]} for i, r in enumerate(replicas)]}
    summarise_replicas(found, replicas)
    return found


def plain_welch(a: list[float], b: list[float]) -> float:
    """Welch's two-sided p-value from its definition (Welch-Satterthwaite degrees of freedom)."""
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    t = (np.mean(a) - np.mean(b)) / np.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return float(2 * stats.t.sf(abs(t), df))


def test_seed_comparison_is_welch_over_the_seeds() -> None:
    rng = np.random.default_rng(2)
    a, b = entry(rng, 4, 5, shift=0.02), entry(rng, 3, 5)
    found = seed_comparison(a, b, "1")
    per_seed_a = [s["mean"]["1"] for s in a["sae_seeds"]]
    per_seed_b = [s["mean"]["1"] for s in b["sae_seeds"]]
    assert found["p"] == pytest.approx(plain_welch(per_seed_a, per_seed_b), rel=1e-9)
    assert found["p"] == pytest.approx(stats.ttest_ind(per_seed_a, per_seed_b, equal_var=False).pvalue, rel=1e-12)
    assert found["difference"] == pytest.approx(np.mean(per_seed_a) - np.mean(per_seed_b))
    assert found["interval"][0] < found["difference"] < found["interval"][1]
    assert found["classes_higher"] + found["classes_lower"] <= found["n_classes"] == 5
    assert a["mean"]["1"] == pytest.approx(np.mean(per_seed_a)) and len(a["by_label"]) == 5
    low, high = a["interval"]["1"]
    assert (low, high) == pytest.approx(stats.t.interval(0.95, 3, loc=np.mean(per_seed_a), scale=stats.sem(per_seed_a)))
    # the draws' spread is Monte-Carlo error of the mean, far below the seeds' spread here
    assert 0 < a["mc_error"]["1"] < a["sd"]["1"]


def test_summarise_draws_is_the_mean_and_its_standard_error() -> None:
    rng = np.random.default_rng(6)
    values = rng.uniform(0.7, 0.9, 5)
    by_draw = [{"mean": {"1": float(v)}, "by_label": {"0": {"1": float(v)}}} for v in values]
    found = summarise_draws(by_draw)
    assert found["mean"]["1"] == pytest.approx(values.mean())
    assert found["mc_error"]["1"] == pytest.approx(stats.sem(values))
    assert summarise_draws(by_draw[:1])["mc_error"]["1"] is None  # one draw: no Monte-Carlo error known


def test_variants_that_do_not_differ_are_called_significant_at_about_the_nominal_rate() -> None:
    rng = np.random.default_rng(3)
    calls = [compare_models({"x": entry(rng, 4, 10), "y": entry(rng, 4, 10)}, ["1"])[0] for _ in range(600)]
    rate = np.mean([c["p"] < 0.05 for c in calls])
    assert 0.025 < rate < 0.08  # 0.05 expected; binomial SD over 600 draws ~0.009
    # what the earlier test did (one SAE per variant, paired over draws) calls most such pairs different
    earlier = []
    for _ in range(200):
        draws = rng.normal(0, 0.01, (2, 1)) + rng.normal(0, 0.002, (2, 5))  # each SAE's offset, then its draws
        earlier.append(stats.ttest_rel(draws[0], draws[1]).pvalue < 0.05)
    assert np.mean(earlier) > 0.5
    shifted = compare_models({"x": entry(rng, 4, 10, shift=0.05), "y": entry(rng, 4, 10)}, ["1"])[0]
    assert shifted["significant"] and shifted["difference"] > 0  # a real difference is found
    assert compare_models({"x": entry(rng, 1, 10), "y": entry(rng, 1, 10)}, ["1"])[0]["p"] is None  # one seed


def test_saebench_probe_is_seeded_and_reads_high_on_noise() -> None:
    rng = np.random.default_rng(4)
    x = rng.normal(size=(240, 16)).astype(np.float32)
    y = (x[:, 0] + 0.3 * rng.normal(size=240) > 0).astype(np.int64)
    train, test = slice(0, 160), slice(160, 240)
    first = saebench_all_probe_accuracy(x[train], y[train], x[test], y[test], seed=0)
    assert first == saebench_all_probe_accuracy(x[train], y[train], x[test], y[test], seed=0)
    assert first > 0.65  # learns (one batch per epoch here: it stops after few steps, as SAEBench's would)
    # labels unrelated to the inputs: scikit-learn's probe sits at chance, the best epoch above it
    noise = [rng.integers(0, 2, 240) for _ in range(12)]
    best = [saebench_all_probe_accuracy(x[train], n[train], x[test], n[test], seed=s) for s, n in enumerate(noise)]
    plain = [probe_accuracy(x[train], n[train], x[test], n[test]) for n in noise]
    assert np.mean(best) > np.mean(plain) + 0.03 and np.mean(best) > 0.53


def test_report_shows_intervals_and_the_comparisons() -> None:
    rng = np.random.default_rng(5)
    models = {"topk": entry(rng, 4, 3, shift=0.05), "mpsae": entry(rng, 4, 3)}
    raw = entry(rng, 1, 3)
    for found in (*models.values(), raw):
        found.update(ks=[1], n_columns=8, k=2, p=8, r2_train=0.5, r2_val=0.5)
    study = {
        "ks": [1],
        "seeds": 3,
        "draws": 3,
        "sae_seeds": 4,
        "labels": [0, 1, 2],
        "n_train_rows": 30,
        "n_val_rows": 9,
        "raw": raw,
    }
    study.update(task_rows={"train": {"0": 10, "1": 10, "2": 10}, "val": {"0": 3, "1": 3, "2": 3}})
    study.update(variants=models, comparisons=compare_models(models, ["1"]))
    text = "\n".join(probing_section(study))
    low, high = models["topk"]["interval"]["1"]
    assert f"| TopK | 2, 8 | {models['topk']['mean']['1']:.3f} ± {(high - low) / 2:.3f} |" in text
    assert "mean over 3 draws" in text and "mean over its 4 SAE seeds" in text and "Monte-Carlo error" in text
    assert "Welch's t-test over the SAE seeds" in text
    (row,) = [line for line in text.splitlines() if line.startswith("| TopK − MP-SAE")]
    assert " *" in row and "(3/3)" in row  # 0.05 apart against 0.01 noise: significant, in every class
