"""What a probing figure's spread means, and which differences between variants it can tell.

Two kinds of repetition, kept apart:

- **draws** (`evaluate probing --seeds N`): which rows of the other classes balance each task, in both
  splits, with the trained SAE and the images fixed (the SAE's own training / validation split stays, so
  the held-out rows are never ones it trained on). Their spread is **Monte-Carlo error** of the figure,
  `mc_error` (the standard error of the mean over draws): how far it moves when the balancing is redrawn.
  It says nothing about the variant: two SAEs of one config trained from different seeds differ by more.
- **SAE seeds** (`--sae_seeds N`): the variant's SAEs trained again from other seeds. A variant's figure is
  the mean over its seeds of each seed's mean over draws, with a 95 % t-interval over the seeds
  (`interval`, `n − 1` degrees of freedom); two variants are compared by Welch's t-test over the
  per-seed figures (`.seed_stats.welch`), the p-values of one study corrected together (Holm), and a
  difference is called significant when its corrected p-value is below 0.05. The count of classes where
  the first variant's accuracy, averaged over seeds and draws, is higher says whether a difference is broad
  or carried by a few classes.

With one SAE seed there is no spread between SAEs: intervals and tests are absent (None), not zero; with one
draw, no Monte-Carlo error.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from sae_pipeline.evaluate.seed_stats import ALPHA, holm, t_interval, welch

__all__ = ["compare_models", "holm", "seed_comparison", "summarise_draws", "summarise_replicas", "t_interval"]


def summarise_draws(by_draw: list[dict[str, Any]]) -> dict[str, Any]:
    """One SAE's (or the raw inputs') figures over the draws, each ``{"mean": {key: acc}, "by_label": {label:
    {key: acc}}}``: ``{"mean", "mc_error", "by_label"}``, ``mc_error`` the standard error over draws (None for one)."""
    keys, labels = list(by_draw[0]["mean"]), list(by_draw[0]["by_label"])
    mean, mc_error = {}, {}
    for key in keys:
        values = np.asarray([d["mean"][key] for d in by_draw], np.float64)
        mean[key] = float(values.mean())
        mc_error[key] = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else None
    by_label = {
        label: {key: float(np.mean([d["by_label"][label][key] for d in by_draw])) for key in keys} for label in labels
    }
    return {"mean": mean, "mc_error": mc_error, "by_label": by_label}


def summarise_replicas(entry: dict[str, Any], replicas: list[dict[str, Any]]) -> None:
    """Fill ``mean``, ``sd``, ``interval`` (over SAE seeds), ``mc_error`` (of that mean, from the draws) and the
    averaged ``by_label`` of ``entry`` from its replicas' :func:`summarise_draws` results (seed 0 first)."""
    keys, labels = list(replicas[0]["mean"]), list(replicas[0]["by_label"])
    entry["mean"], entry["sd"], entry["interval"], entry["mc_error"] = {}, {}, {}, {}
    for key in keys:
        entry["mean"][key], entry["sd"][key], entry["interval"][key] = t_interval([r["mean"][key] for r in replicas])
        errors = [r["mc_error"][key] for r in replicas]
        entry["mc_error"][key] = (
            None if None in errors else float(math.sqrt(sum(e * e for e in errors)) / len(replicas))
        )
    entry["by_label"] = {
        label: {key: float(np.mean([r["by_label"][label][key] for r in replicas])) for key in keys} for label in labels
    }


def seed_comparison(a: dict[str, Any], b: dict[str, Any], key: str) -> dict[str, Any]:
    """Variant ``a`` against ``b`` at ``key``: Welch over their SAE seeds' figures (see the module docstring)."""
    found = welch([r["mean"][key] for r in a["sae_seeds"]], [r["mean"][key] for r in b["sae_seeds"]])
    labels = list(a["by_label"])
    higher = sum(a["by_label"][label][key] > b["by_label"][label][key] for label in labels)
    lower = sum(a["by_label"][label][key] < b["by_label"][label][key] for label in labels)
    return {
        "key": key,
        "test": "welch over SAE seeds",
        "n_seeds": [len(a["sae_seeds"]), len(b["sae_seeds"])],
        **found,
        "classes_higher": higher,
        "classes_lower": lower,
        "n_classes": len(labels),
    }


def compare_models(models: dict[str, dict[str, Any]], keys: list[str]) -> list[dict[str, Any]]:
    """Every pair of variants at every key (Welch over SAE seeds), with Holm-corrected p-values and the call."""
    comparisons = [
        {"a": name_a, "b": name_b, **seed_comparison(models[name_a], models[name_b], key)}
        for key in keys
        for name_a, name_b in itertools.combinations(models, 2)
    ]
    for comparison, p_holm in zip(comparisons, holm([c["p"] for c in comparisons]), strict=True):
        comparison["p_holm"] = p_holm
        comparison["significant"] = p_holm is not None and p_holm < ALPHA
    return comparisons
