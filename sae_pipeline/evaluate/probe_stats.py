"""How much a probing accuracy moves between draws, and which differences between models it can tell.

A probing figure is one draw: which rows of the other classes balance each task, in both splits. Each
seed redraws them (`evaluate probing --seeds N`); the SAE's own training / validation split stays, so
the held-out rows are never ones the SAE trained on. Per model and key (k, or all columns):

- the mean over seeds of the class-mean accuracy, and its 95 % interval: Student's t over the seeds'
  class means (`n − 1` degrees of freedom). It says how far the figure moves when the balancing is
  redrawn, not how it would move on other classes or other images.
- a paired comparison of two models at the same key: the seeds share their draws (the same rows in
  every task for every model), so each seed gives one difference of class means, `d_s`; the mean
  difference, its 95 % t-interval and a two-sided one-sample t-test of `d_s` against 0. The seeds are
  the independent units (the classes of one seed share its draw); the count of classes where the
  first model's accuracy, averaged over seeds, is higher says whether the difference is broad or
  carried by a few classes. The p-values of one study are corrected together (Holm), and a difference
  is called significant when its corrected p-value is below 0.05.

With one seed there is no spread to measure: intervals and tests are absent (None), not zero.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
from scipy import stats

LEVEL = 0.95
ALPHA = 0.05


def t_interval(values: list[float] | np.ndarray, level: float = LEVEL) -> tuple[float, float | None, list | None]:
    """``(mean, sd, [low, high])`` of ``values`` over draws; sd and interval None for a single draw."""
    values = np.asarray(values, dtype=np.float64)
    mean = float(values.mean())
    if len(values) < 2:
        return mean, None, None
    sd = float(values.std(ddof=1))
    half = float(stats.t.ppf(0.5 + level / 2, len(values) - 1)) * sd / math.sqrt(len(values))
    return mean, sd, [mean - half, mean + half]


def summarise_seeds(entry: dict[str, Any]) -> None:
    """Fill ``mean``, ``sd``, ``interval`` and the seed-averaged ``by_label`` of ``entry`` from its
    ``by_seed`` list (each ``{"mean": {key: acc}, "by_label": {label: {key: acc}}}``)."""
    seeds = entry["by_seed"]
    keys = list(seeds[0]["mean"])
    entry["mean"], entry["sd"], entry["interval"] = {}, {}, {}
    for key in keys:
        entry["mean"][key], entry["sd"][key], entry["interval"][key] = t_interval([s["mean"][key] for s in seeds])
    labels = list(seeds[0]["by_label"])
    entry["by_label"] = {
        label: {key: float(np.mean([s["by_label"][label][key] for s in seeds])) for key in keys} for label in labels
    }


def paired_comparison(a: dict[str, Any], b: dict[str, Any], key: str) -> dict[str, Any]:
    """Model ``a`` against ``b`` at ``key`` over the seeds they share (see the module docstring)."""
    differences = [sa["mean"][key] - sb["mean"][key] for sa, sb in zip(a["by_seed"], b["by_seed"], strict=True)]
    mean, _, interval = t_interval(differences)
    p_value = None
    if len(differences) > 1:
        spread = float(np.std(differences, ddof=1))
        if spread > 0:
            p_value = float(stats.ttest_1samp(differences, 0.0).pvalue)
        else:  # every seed gave the same difference: no spread to test against
            p_value = 1.0 if mean == 0 else 0.0
    labels = list(a["by_label"])
    higher = sum(a["by_label"][label][key] > b["by_label"][label][key] for label in labels)
    lower = sum(a["by_label"][label][key] < b["by_label"][label][key] for label in labels)
    return {
        "key": key,
        "difference": mean,
        "interval": interval,
        "p": p_value,
        "classes_higher": higher,
        "classes_lower": lower,
        "n_classes": len(labels),
    }


def holm(p_values: list[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of the p-values (None stays None and does not count)."""
    present = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    adjusted: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(present):
        running = max(running, min(1.0, (len(present) - rank) * p))
        adjusted[i] = running
    return adjusted


def compare_models(models: dict[str, dict[str, Any]], keys: list[str]) -> list[dict[str, Any]]:
    """Every pair of models at every key, with Holm-corrected p-values and the significance call."""
    comparisons = [
        {"a": name_a, "b": name_b, **paired_comparison(models[name_a], models[name_b], key)}
        for key in keys
        for name_a, name_b in itertools.combinations(models, 2)
    ]
    for comparison, p_holm in zip(comparisons, holm([c["p"] for c in comparisons]), strict=True):
        comparison["p_holm"] = p_holm
        comparison["significant"] = p_holm is not None and p_holm < ALPHA
    return comparisons
