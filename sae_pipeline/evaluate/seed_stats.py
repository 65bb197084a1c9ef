"""Comparisons between variants over SAE seeds (`--sae_seeds`), with a bootstrap over validation images.

Why seeds are the unit: two SAEs of one config trained from different seeds differ by about as much as
the gaps a single trained SAE per variant shows, so a figure of one SAE says little about its variant.
A draw of the probing tasks or a resample of the validation images varies what is measured on fixed
SAEs; only a new seed varies the SAE. So every comparison between variants here is a Welch t-test over
the per-seed values (unequal variances, scipy's `ttest_ind(equal_var=False)`), corrected together (Holm)
and called significant below 0.05; each value is reported as the mean over seeds with its 95 % t-interval.
The bootstrap over validation images (resampled with replacement, every seed's R² recomputed on the same
resample, the mean over seeds taken, a percentile interval) says how far a figure would move on other
validation images of the same data; on shard data it resamples tokens, not images (the tokens of one image
are not independent, so that interval is too narrow there). It is reported beside the test, not in it.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
from scipy import stats

LEVEL = 0.95
ALPHA = 0.05
BOOTSTRAP_RESAMPLES = 200
BOOTSTRAP_SEED = 0


def t_interval(values: list[float] | np.ndarray, level: float = LEVEL) -> tuple[float, float | None, list | None]:
    """``(mean, sd, [low, high])`` of ``values`` (over seeds, or draws); sd and interval None for one value."""
    values = np.asarray(values, dtype=np.float64)
    mean = float(values.mean())
    if len(values) < 2:
        return mean, None, None
    sd = float(values.std(ddof=1))
    half = float(stats.t.ppf(0.5 + level / 2, len(values) - 1)) * sd / math.sqrt(len(values))
    return mean, sd, [mean - half, mean + half]


def holm(p_values: list[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of the p-values (None stays None and does not count)."""
    present = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    adjusted: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(present):
        running = max(running, min(1.0, (len(present) - rank) * p))
        adjusted[i] = running
    return adjusted


def seed_summary(values: list[float]) -> dict[str, Any]:
    """``{"values", "mean", "sd", "interval"}`` over seeds (sd and interval None for one seed)."""
    mean, sd, interval = t_interval(values)
    return {"values": [float(v) for v in values], "mean": mean, "sd": sd, "interval": interval}


def welch(a: list[float], b: list[float], level: float = LEVEL) -> dict[str, Any]:
    """Welch's t-test of mean(a) − mean(b) over seeds: the difference, its Welch–Satterthwaite interval, p.

    None for p and interval when either side has fewer than two seeds (no spread to test against); when
    neither side varies at all, p is 1 for equal means and 0 otherwise (the t statistic is undefined).
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    difference = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return {"difference": difference, "interval": None, "p": None, "df": None}
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    if va + vb == 0:
        p_value = 1.0 if difference == 0 else 0.0
        return {"difference": difference, "interval": [difference, difference], "p": p_value, "df": None}
    df = float((va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)))
    half = float(stats.t.ppf(0.5 + level / 2, df)) * math.sqrt(va + vb)
    p_value = float(stats.ttest_ind(a, b, equal_var=False).pvalue)
    return {"difference": difference, "interval": [difference - half, difference + half], "p": p_value, "df": df}


def with_holm(comparisons: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds ``p_holm`` (Holm over the list) and ``significant`` (``p_holm`` < 0.05) to each comparison."""
    for comparison, p_holm in zip(comparisons, holm([c["p"] for c in comparisons]), strict=True):
        comparison["p_holm"] = p_holm
        comparison["significant"] = p_holm is not None and p_holm < ALPHA
    return comparisons


def resample_counts(n: int, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """``[resamples, n]``: how often each validation row is drawn in each bootstrap resample (the same
    resamples for every run of one data, so differences between variants are bootstrapped pairwise)."""
    return np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=resamples)


def bootstrap_denominators(x: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Σ‖x − μ‖² of each resample (μ the resample's own mean, as R² defines it), float64 ``[resamples]``."""
    x = np.asarray(x, np.float64)
    n = counts.sum(axis=1, keepdims=True)
    sums = counts @ x  # [B, d]
    return counts @ np.einsum("nd,nd->n", x, x) - np.einsum("bd,bd->b", sums, sums) / n[:, 0]


def bootstrap_r2(errors: np.ndarray, counts: np.ndarray, denominators: np.ndarray) -> np.ndarray:
    """R² of each seed on each resample, ``[resamples, seeds]``; ``errors`` ``[seeds, n]`` holds each row's
    Σ_d (x − x̂)² for each seed's SAE."""
    return 1.0 - (counts @ np.asarray(errors, np.float64).T) / denominators[:, None]


def percentile_interval(samples: np.ndarray, level: float = LEVEL) -> list[float]:
    tail = 100 * (1 - level) / 2
    return [float(np.percentile(samples, tail)), float(np.percentile(samples, 100 - tail))]


def r2_over_seeds(
    settings: dict[tuple[str, int, int], list[str]],
    entries: dict[str, dict],
    residuals: dict[str, tuple[str, np.ndarray]],
    tokens: dict[str, np.ndarray],
) -> dict[str, Any]:
    """R² per variant and setting over its seeds (mean, 95 % t-interval, image bootstrap), and Welch comparisons
    between variants at each setting (MP-SAE against each other variant when it is studied, else every pair).

    ``settings`` maps ``(variant, k, p)`` to its runs' names (seed 0 first); ``residuals`` a run's name to
    ``(data key, per-row squared error)``; ``tokens`` a data key to its validation rows.
    """
    counts_by_data = {key: resample_counts(len(x)) for key, x in tokens.items()}
    denominators = {key: bootstrap_denominators(x, counts_by_data[key]) for key, x in tokens.items()}
    cells: dict[tuple[str, int, int], dict[str, Any]] = {}
    boot: dict[tuple[str, int, int], np.ndarray] = {}
    for (variant, k, p), names in settings.items():
        cell = {"k": k, "p": p, "runs": names, **seed_summary([entries[name]["r2"] for name in names])}
        data_key = residuals[names[0]][0]
        errors = np.stack([residuals[name][1] for name in names])
        boot[(variant, k, p)] = bootstrap_r2(errors, counts_by_data[data_key], denominators[data_key]).mean(axis=1)
        cell["bootstrap_interval"] = percentile_interval(boot[(variant, k, p)])
        cells[(variant, k, p)] = cell
    comparisons = []
    points = list(dict.fromkeys((k, p) for _, k, p in settings))
    for k, p in points:
        variants = [v for v, vk, vp in settings if (vk, vp) == (k, p)]
        pairs = (
            [("mpsae", v) for v in variants if v != "mpsae"]
            if "mpsae" in variants
            else list(itertools.combinations(variants, 2))
        )
        for a, b in pairs:
            ca, cb = cells[(a, k, p)], cells[(b, k, p)]
            found = {"a": a, "b": b, "at": {"k": k, "p": p}, **welch(ca["values"], cb["values"])}
            same_rows = len(boot[(a, k, p)]) == len(boot[(b, k, p)])
            if same_rows and residuals[ca["runs"][0]][0] == residuals[cb["runs"][0]][0]:
                found["bootstrap_interval"] = percentile_interval(boot[(a, k, p)] - boot[(b, k, p)])
            comparisons.append(found)
    by_variant: dict[str, list[dict]] = {}
    for (variant, _, _), cell in cells.items():
        by_variant.setdefault(variant, []).append(cell)
    return {
        "resamples": BOOTSTRAP_RESAMPLES,
        "variants": by_variant,
        "comparisons": with_holm(comparisons),
    }


def babel_over_seeds(names_by_variant: dict[str, list[str]], entries: dict[str, dict], k: int) -> dict[str, Any]:
    """Dictionary Babel μ₁(k) (the claim's number) per variant over its seeds, and Welch comparisons of MP-SAE
    against each other variant (every pair without MP-SAE)."""
    values = {
        v: seed_summary([entries[n]["babel_dict"][min(k, len(entries[n]["babel_dict"])) - 1] for n in names])
        for v, names in names_by_variant.items()
    }
    variants = list(values)
    pairs = (
        [("mpsae", v) for v in variants if v != "mpsae"]
        if "mpsae" in variants
        else list(itertools.combinations(variants, 2))
    )
    comparisons = [{"a": a, "b": b, **welch(values[a]["values"], values[b]["values"])} for a, b in pairs]
    return {"r": k, "variants": values, "comparisons": with_holm(comparisons)}


def claim_over_seeds(comparisons: list[dict[str, Any]], higher_is_claimed: bool = True) -> bool | None:
    """True when every comparison is significant in the claimed direction (MP-SAE first), False when one is
    significant against it, None when the seeds cannot tell (or there are none)."""
    if not comparisons or any(c["p"] is None for c in comparisons):
        return None
    sign = 1 if higher_is_claimed else -1
    if any(c["significant"] and sign * c["difference"] < 0 for c in comparisons):
        return False
    return True if all(c["significant"] and sign * c["difference"] > 0 for c in comparisons) else None
