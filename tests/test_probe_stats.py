"""Probing with its uncertainty: intervals over draws, paired comparisons, Holm, SAEBench's all-dimensions probe.

The statistics are checked against scipy on fresh random inputs and against a plain Holm written from its
definition; a simulation of models that do not differ checks that the comparisons call about the nominal
share of them significant; the all-dimensions probe is checked for the bias its epoch choice builds in.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from sae_pipeline.evaluate.linear_probe import probe_accuracy, saebench_all_probe_accuracy
from sae_pipeline.evaluate.probe_stats import compare_models, holm, paired_comparison, summarise_seeds, t_interval
from sae_pipeline.evaluate.report import probing_section


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


def entry(rng: np.random.Generator, seeds: int, labels: int, shift: float = 0.0) -> dict:
    """A model's per-draw accuracies: a class effect shared by every model, and noise per draw and class."""
    by_seed = []
    for _ in range(seeds):
        by_label = {str(c): {"1": float(0.8 + 0.01 * c + shift + rng.normal(0, 0.01))} for c in range(labels)}
        by_seed.append({"mean": {"1": float(np.mean([a["1"] for a in by_label.values()]))}, "by_label": by_label})
    found = {"by_seed": by_seed}
    summarise_seeds(found)
    return found


def test_paired_comparison_is_scipys_paired_t_test() -> None:
    rng = np.random.default_rng(2)
    a, b = entry(rng, 6, 5, shift=0.02), entry(rng, 6, 5)
    found = paired_comparison(a, b, "1")
    per_seed_a = [s["mean"]["1"] for s in a["by_seed"]]
    per_seed_b = [s["mean"]["1"] for s in b["by_seed"]]
    assert found["p"] == pytest.approx(stats.ttest_rel(per_seed_a, per_seed_b).pvalue, rel=1e-10)
    assert found["difference"] == pytest.approx(np.mean(per_seed_a) - np.mean(per_seed_b))
    assert found["interval"][0] < found["difference"] < found["interval"][1]
    assert found["classes_higher"] + found["classes_lower"] <= found["n_classes"] == 5
    assert a["mean"]["1"] == pytest.approx(np.mean(per_seed_a)) and len(a["by_label"]) == 5


def test_models_that_do_not_differ_are_called_significant_at_about_the_nominal_rate() -> None:
    rng = np.random.default_rng(3)
    calls = [compare_models({"x": entry(rng, 5, 10), "y": entry(rng, 5, 10)}, ["1"])[0] for _ in range(600)]
    rate = np.mean([c["p"] < 0.05 for c in calls])
    assert 0.025 < rate < 0.08  # 0.05 expected; binomial SD over 600 draws ~0.009
    shifted = compare_models({"x": entry(rng, 5, 10, shift=0.03), "y": entry(rng, 5, 10)}, ["1"])[0]
    assert shifted["significant"] and shifted["difference"] > 0  # a real difference is found


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
    raw = entry(rng, 4, 3)
    for found in (*models.values(), raw):
        found.update(ks=[1], n_columns=8, k=2, p=8, r2_train=0.5, r2_val=0.5)
    study = {"ks": [1], "seeds": 4, "labels": [0, 1, 2], "n_train_rows": 30, "n_val_rows": 9, "raw": raw}
    study.update(task_rows={"train": {"0": 10, "1": 10, "2": 10}, "val": {"0": 3, "1": 3, "2": 3}})
    study.update(variants=models, comparisons=compare_models(models, ["1"]))
    text = "\n".join(probing_section(study))
    low, high = models["topk"]["interval"]["1"]
    assert f"| TopK | 2, 8 | {models['topk']['mean']['1']:.3f} ± {(high - low) / 2:.3f} |" in text
    assert "mean over 4 draws" in text
    (row,) = [line for line in text.splitlines() if line.startswith("| TopK − MP-SAE")]
    assert " *" in row and "(3/3)" in row  # 0.05 apart against 0.01 noise: significant, in every class
