"""Label statistics weighted by activation: how strongly, not only how often, an atom fires on each label.

Why: the counts ``c`` of `sae_pipeline.features.selectivity` give an image on which the atom barely
fires as much say as its best image; an atom that fires weakly on every label and strongly on one
shows ``S`` near 0. Here each image the atom fires on adds its activation ``a`` (the image's largest
positive code over its tokens, the value its top-N images are ranked by; `sae_pipeline.features.labels`)
to its label: ``w[l] = sum a`` over the label's images, and ``v[l] = sum a^2``. Then, as for the counts,

- ``rate_w[l] = w[l] / m[l]``, ``q_w = rate_w / sum rate_w`` (the label prior divided out), the top
  label ``argmax q_w`` and ``S_w = 1 - H(q_w) / log L``;
- ``n_eff = (sum_l w[l])^2 / sum_l v[l]``, Kish's effective number of images: ``n`` when every image
  weighs alike, near 1 when one image dominates.

Against chance, approximately: the null of ``S_w`` (labels permuted among the images, the atom's
activations kept) depends on every activation, which the pass does not keep, so ``S_w`` is set
against the null of the counts' ``S`` (`sae_pipeline.features.chance`, the same draws and exact
enumerations) at ``n = floor(n_eff)`` images: ``E[S | n]``, its SD, the excess and ``p``. Measured
against a Monte-Carlo permutation reference (900 random atoms of 2 to 150 images, 4 000
permutations each; exponential, log-normal and uniform activations; ten equal and five unequal
labels; half the atoms drawing up to a third of their images from one label): ``n_eff`` rounded
to the nearest integer gave p-values 10 times too small for 15 % of the atoms below ``n_eff = 3``
(one dominant image makes ``S_w`` high whatever the labels); the floor is conservative by a little
(median 1.1 to 1.4 times the reference in every range of ``n_eff``) and fell more than 1.26 times
below it for 1 to 3 % of the atoms, by at most 1.8 times from ``n_eff = 3`` (within the reference's
Monte-Carlo error), 2.8 times below it. So atoms with ``floor(n_eff) < max(n_min, MIN_EFFECTIVE)``
get no weighted verdict (too few effective images), and Benjamini-Hochberg runs over the others.
Where the counts' null itself falls back to its chi-square tail (``p`` beyond what its draws
resolve), that approximation's error carries over: one atom of the 900 read 7.8 times below the
reference there.

Interval: the counts' Dirichlet posterior (`sae_pipeline.features.label_intervals`) on pseudo-counts
``c_eff[l] = w[l] · n_eff / sum w``: ``n_eff`` images spread as ``w``, so its width is that of
``n_eff`` images, not of ``n``. Also an approximation, for the same reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import Tensor

from sae_pipeline.features.chance import benjamini_hochberg, selectivity_p
from sae_pipeline.features.label_intervals import intervals

MIN_EFFECTIVE = 3  # effective images below which the weighted p-value is not given (measured: see above)
BLOCK = 2048  # atoms per block

FORMULA = (
    "weighted by activation: q_w[l] = (w[l] / m[l]) / Σ_l' (w[l'] / m[l']), with w[l] the sum over the images of "
    "label l the atom fires on of its activation a (its largest code on the image, 0 if negative) and m[l] the "
    "images of label l; top label = argmax q_w; S_w = 1 − H(q_w) / log L; n_eff = (Σ a)² / Σ a² (Kish's "
    "effective number of images, over its labelled images)"
)
CHANCE = (
    "weighted against chance (an approximation): S_w set against the null of S for n = ⌊n_eff⌋ random images "
    "(E[S | n], SD, p = P(S_null ≥ S_w | n), found as for the counts); Benjamini–Hochberg at false-discovery rate "
    "{fdr} over the atoms with ⌊n_eff⌋ ≥ {n_min} (fewer: too few effective images to say); 95 % interval from the "
    "Dirichlet posterior of pseudo-counts c_eff[l] = w[l] · n_eff / Σ w"
)


@dataclass
class WeightedStats:
    """Per-atom weighted label statistics (``[d_sae]`` arrays unless said; columns follow ``LabelStats.labels``)."""

    weight: np.ndarray  # float64 [d_sae, L]: w
    weight_sq: np.ndarray  # float64 [d_sae]: Σ v, over every labelled image
    weight_unlabelled: np.ndarray  # float64: w over images without a label
    n_eff: np.ndarray  # float64: (Σ w)² / Σ v (NaN: no positive activation on a labelled image)
    top_label: np.ndarray  # int64: a label id, -1 where n_eff is NaN
    top_share: np.ndarray  # float64: q_w[top]
    selectivity: np.ndarray  # float64: S_w
    mean: np.ndarray  # float64: E[S | floor(n_eff)]
    sd: np.ndarray
    p: np.ndarray  # float64: P(S_null >= S_w | floor(n_eff)) (NaN: too few effective images)
    method: np.ndarray  # int8: as Chance.method (-1: no p)
    p_adjusted: np.ndarray  # float64: Benjamini-Hochberg over the atoms with a p
    beats: np.ndarray  # bool
    too_few: np.ndarray  # bool: has a weighted S but floor(n_eff) < n_min
    interval: tuple[np.ndarray, ...]  # S_w low, S_w high, q_w[top] low, q_w[top] high (95 %)
    n_min: int
    fdr: float

    @property
    def excess(self) -> np.ndarray:
        return self.selectivity - self.mean

    def formula(self) -> str:
        return CHANCE.format(fdr=self.fdr, n_min=self.n_min)

    def arrays(self) -> dict[str, np.ndarray]:
        """What ``features.npz`` adds (the raw sums: ``label_weight`` by label id, ``label_weight_sq`` per atom)."""
        return {
            "label_weighted_n_eff": self.n_eff,
            "label_weighted_top": self.top_label,
            "label_weighted_top_share": self.top_share,
            "label_weighted_selectivity": self.selectivity,
            "label_weighted_chance_selectivity": self.mean,
            "label_weighted_chance_selectivity_sd": self.sd,
            "label_weighted_selectivity_excess": self.excess,
            "label_weighted_selectivity_p": self.p,
            "label_weighted_selectivity_p_method": self.method,
            "label_weighted_selectivity_p_adjusted": self.p_adjusted,
            "label_weighted_beats_chance": self.beats,
            "label_weighted_too_few": self.too_few,
            "label_weighted_selectivity_low": self.interval[0],
            "label_weighted_selectivity_high": self.interval[1],
            "label_weighted_top_share_low": self.interval[2],
            "label_weighted_top_share_high": self.interval[3],
        }

    def summary(self) -> dict[str, Any]:
        """What ``features.json`` records under ``labels.weighted``."""
        return {
            "min_effective_images": self.n_min,
            "tested": int(np.isfinite(self.p_adjusted).sum()),
            "beat_chance": int(self.beats.sum()),
            "too_few": int(self.too_few.sum()),
            "formula": FORMULA,
            "chance": self.formula(),
        }


def weighted_q(weight: np.ndarray, images: np.ndarray) -> np.ndarray:
    """``q_w [.., L]`` from ``w [.., L]`` and ``m [L]`` (zeros where the atom has no weight)."""
    rate = np.asarray(weight, np.float64) / np.maximum(images, 1)
    total = rate.sum(-1, keepdims=True)
    return np.divide(rate, total, out=np.zeros_like(rate), where=total > 0)


def effective_images(weight: np.ndarray, weight_sq: np.ndarray) -> np.ndarray:
    """Kish's ``n_eff = (Σ w)² / Σ v`` per atom (NaN where ``Σ v = 0``); ``weight_sq [d_sae]``: Σ v already."""
    total, squares = np.asarray(weight).sum(-1), np.asarray(weight_sq)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(squares > 0, total**2 / squares, np.nan)


def weighted_stats(
    state: dict[str, Tensor], labels: np.ndarray, images: np.ndarray, n_min: int | None, fdr: float, draws: int
) -> WeightedStats | None:
    """The weighted statistics of a merged state, over the label ids ``labels`` with ``images`` each (None: the
    state has no activation sums, as sites built before them); ``n_min``: the counts' fewest images that could beat
    chance (None: none can), ``draws``: the counts' null draws."""
    if "label_weight" not in state:
        return None
    weight = state["label_weight"].numpy()[:, labels].astype(np.float64)
    weight_sq = state["label_weight_sq"].numpy().astype(np.float64)
    d_sae, n_labels = weight.shape
    n_eff = effective_images(weight, weight_sq)
    top_label, top_share, selectivity = np.full(d_sae, -1, np.int64), np.full(d_sae, np.nan), np.full(d_sae, np.nan)
    for start in range(0, d_sae, BLOCK):
        q = weighted_q(weight[start : start + BLOCK], images)
        rows, top, fired = np.arange(len(q)), q.argmax(1), q.sum(1) > 0
        top_label[start : start + len(q)] = np.where(fired, labels[top], -1)
        top_share[start : start + len(q)] = np.where(fired, q[rows, top], np.nan)
        if n_labels > 1:
            with np.errstate(divide="ignore", invalid="ignore"):
                entropy = -np.where(q > 0, q * np.log(q), 0.0).sum(1)
            selectivity[start : start + len(q)] = np.where(fired, 1 - entropy / math.log(n_labels), np.nan)
    n = np.where(np.isfinite(n_eff), np.floor(np.nan_to_num(n_eff) + 1e-9), 0).astype(np.int64)
    least = max(n_min, MIN_EFFECTIVE) if n_min is not None else None
    testable = (n >= least) if least is not None else np.zeros(d_sae, bool)
    # selectivity_p reads only the row sums of its counts: n = floor(n_eff) images per atom
    p, method, by_n_mean, by_n_sd, _, _ = selectivity_p(n[:, None], images, selectivity, draws)
    mean, sd = np.full(d_sae, np.nan), np.full(d_sae, np.nan)
    has_n = (n > 0) & (n < len(by_n_mean)) & (n_labels > 1)
    mean[has_n], sd[has_n] = by_n_mean[n[has_n]], by_n_sd[n[has_n]]
    adjusted = benjamini_hochberg(np.where(testable, p, np.nan))
    with np.errstate(invalid="ignore"):
        beats = adjusted <= fdr
    pseudo = weight * np.divide(n_eff, weight.sum(1), out=np.zeros(d_sae), where=weight.sum(1) > 0)[:, None]
    top_column = np.searchsorted(labels, np.maximum(top_label, 0))
    return WeightedStats(
        weight=weight,
        weight_sq=weight_sq,
        weight_unlabelled=state["label_weight_unlabelled"].numpy().astype(np.float64),
        n_eff=n_eff,
        top_label=top_label,
        top_share=top_share,
        selectivity=selectivity,
        mean=mean,
        sd=sd,
        p=np.where(testable, p, np.nan),
        method=np.where(testable, method, -1).astype(np.int8),
        p_adjusted=adjusted,
        beats=beats,
        too_few=np.isfinite(selectivity) & ~testable & (least is not None),
        interval=intervals(pseudo, images, top_column),
        n_min=least if least is not None else MIN_EFFECTIVE,
        fdr=fdr,
    )


__all__ = ["CHANCE", "FORMULA", "MIN_EFFECTIVE", "WeightedStats", "effective_images", "weighted_q", "weighted_stats"]
