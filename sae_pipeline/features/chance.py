"""Selectivity against chance: the S an atom would score by firing on random images, and whether it beats that.

Why: ``S`` (:mod:`sae_pipeline.features.selectivity`) grows as the number of images an atom fires
on shrinks, whatever the atom encodes: an atom that fires on one image has ``S = 1``, on three
random digits about 0.58, on ten about 0.23. Ranking atoms by ``S`` ranks them by rarity. So each
atom is compared with the null of an atom that fires on the same number ``n`` of labelled images
drawn at random, without replacement, from the ``M`` labelled images (``m[l]`` of label ``l``): its
label counts are then multivariate hypergeometric.

- Expected S and its spread, ``E[S | n]`` and ``SD[S | n]``: by simulation, seeded, ``DRAWS``
  draws (fewer, down to ``MIN_DRAWS``, where ``DRAWS · M`` would pass ``BUDGET``: a million
  labelled images get 100), for every ``n`` at once. One draw is a random order of the ``M`` labelled images; its first
  ``n`` images are a uniform random ``n``-subset for every ``n``, and ``S`` of each prefix follows
  from running sums (``H(q) = log R - T / R`` with ``R = sum_l c[l] / m[l]`` and
  ``T = sum_l (c[l] / m[l]) log(c[l] / m[l])``, each image changing one term), so a draw costs
  O(M log M) whatever the number of distinct ``n``. Exact at the ends (``n = 1``: ``S = 1``;
  ``n = M``: ``S = 0``); elsewhere the Monte-Carlo error of the mean is ``SD / sqrt(DRAWS)``.
- Excess ``S - E[S | n]``: what the index sorts by.
- p-value of the top label: ``P(X >= c[top])`` with ``X ~ Hypergeometric(M, m[top], n)`` (one-sided:
  the atom fires on its top label more often than chance), times ``L`` (Bonferroni over the labels,
  since the top label is chosen after looking: a valid p-value for "some label is over-represented").
  Labels tied for the top (equal ``c / m``) take the smallest tail among them.
- Benjamini-Hochberg over the atoms that can be tested at all, at the false-discovery rate ``fdr``:
  an atom "beats chance" when its BH-adjusted p-value is at most ``fdr``. BH assumes the atoms'
  p-values independent or positively dependent (PRDS); it does not correct for arbitrary dependence.
- Too few images to say: an atom firing on fewer than ``n_min`` labelled images, the smallest ``n`` at
  which even ``n`` images all of one label reach a p-value at most ``fdr``
  (``L · C(m[l], n) / C(M, n) <= fdr`` for some label). Such atoms cannot beat chance whatever their
  labels, so they are left out of the BH family (a filter on ``n`` alone, which the null leaves
  untouched: the kept atoms' p-values stay valid) and greyed on the index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import gammaln
from scipy.stats import hypergeom

DRAWS = 1000  # random orders of the labelled images (the null's Monte-Carlo draws), up to BUDGET images in all
BUDGET = 1 << 26  # draws x M above which fewer draws are made (not below MIN_DRAWS): ~10 s of numpy
MIN_DRAWS = 100
SEED = 0
FDR = 0.05
CHUNK = 1 << 20  # draws x images held at once (float64 arrays of this size, a few at a time)

FORMULA = (
    "against chance: E[S | n] and SD[S | n] are the mean and spread of S over {draws} random draws of the same "
    "number n of labelled images, without replacement (multivariate hypergeometric counts under the label prior); "
    "excess = S − E[S | n]; p = L · P(X ≥ c[top]), X ~ Hypergeometric(M, m[top], n) (one-sided, × L for choosing "
    "the top label among L; labels tied for the top take the smallest tail); Benjamini–Hochberg over the atoms "
    "with n ≥ n_min = {n_min} at false-discovery rate {fdr} (n_min: the fewest images that, all of one label, "
    "could reach p ≤ {fdr}; atoms below it have too few images to say)"
)


@dataclass
class Chance:
    """Each atom against the null (``[d_sae]`` arrays), the null itself by ``n``, and the settings."""

    mean: np.ndarray  # float64: E[S | n] at the atom's n (NaN: n = 0 or fewer than two labels)
    sd: np.ndarray  # float64: SD[S | n]
    excess: np.ndarray  # float64: S - E[S | n]
    p: np.ndarray  # float64: the top label's p-value, Bonferroni over the labels (NaN: never fired)
    p_adjusted: np.ndarray  # float64: Benjamini-Hochberg (NaN: not tested, n < n_min)
    beats: np.ndarray  # bool: p_adjusted <= fdr
    too_few: np.ndarray  # bool: 0 < n < n_min
    by_n_mean: np.ndarray  # float64 [n_max + 1]: E[S | n] for n = 0..n_max
    by_n_sd: np.ndarray
    fdr: float
    n_min: int | None  # None: no n reaches fdr (too few images in all)
    draws: int
    seed: int

    def formula(self) -> str:
        return FORMULA.format(draws=self.draws, n_min=self.n_min if self.n_min is not None else "–", fdr=self.fdr)

    def summary(self) -> dict[str, Any]:
        return {
            "fdr": self.fdr,
            "draws": self.draws,
            "seed": self.seed,
            "min_images": self.n_min,
            "tested": int(np.isfinite(self.p_adjusted).sum()),
            "beat_chance": int(self.beats.sum()),
            "too_few": int(self.too_few.sum()),
            "formula": self.formula(),
        }


def null_selectivity(
    images: np.ndarray, n_max: int, draws: int = DRAWS, seed: int = SEED
) -> tuple[np.ndarray, np.ndarray]:
    """``(E[S | n], SD[S | n])`` for ``n = 0..n_max`` (NaN at 0) by ``draws`` random orders of the labelled images."""
    images = np.asarray(images, np.int64)
    total, n_labels = int(images.sum()), len(images)
    n_max = min(int(n_max), total)
    mean, sd = np.full(n_max + 1, np.nan), np.full(n_max + 1, np.nan)
    if n_max < 1 or n_labels < 2:
        return mean, sd
    label_dtype = np.int16 if n_labels < 1 << 15 else np.int64  # 16-bit keys: numpy's stable sort is a radix sort
    pool = np.repeat(np.arange(n_labels, dtype=label_dtype), images)
    rng = np.random.default_rng(seed)
    shift, sums, squares, done = None, np.zeros(n_max), np.zeros(n_max), 0
    while done < draws:
        rows = max(1, min(draws - done, CHUNK // total))
        order = rng.permuted(np.broadcast_to(pool, (rows, total)), axis=1)[:, :n_max]
        s = _prefix_selectivity(order, images)
        if shift is None:
            shift = s.mean(0)  # shifted sums: no cancellation where SD is far below the mean
        sums += (s - shift).sum(0)
        squares += ((s - shift) ** 2).sum(0)
        done += rows
    centred = sums / draws
    mean[1:] = shift + centred
    sd[1:] = np.sqrt(np.maximum(squares - draws * centred**2, 0.0) / max(draws - 1, 1))
    return mean, sd


def _prefix_selectivity(order: np.ndarray, images: np.ndarray) -> np.ndarray:
    """S of every prefix of each row of labels ``order [rows, n]``, by running sums over the images.

    Image ``t`` of label ``l`` (its ``c``-th) adds ``1 / m[l]`` to ``R`` and, to ``T``,
    ``(c / m) log(c / m) - ((c - 1) / m) log((c - 1) / m) = (phi(c) - log m) / m`` with
    ``phi(c) = c log c - (c - 1) log(c - 1)``: a table look-up, no logarithm per image."""
    rows, n = order.shape
    sort = np.argsort(order, axis=1, kind="stable")
    ranked = np.take_along_axis(order, sort, 1)
    steps = np.broadcast_to(np.arange(n, dtype=np.int64), (rows, n))
    starts = np.where(np.concatenate([np.ones((rows, 1), bool), ranked[:, 1:] != ranked[:, :-1]], 1), steps, 0)
    count = np.empty((rows, n), np.int64)  # c[l] just after each image: 1 + earlier images of its label
    np.put_along_axis(count, sort, steps - np.maximum.accumulate(starts, axis=1) + 1, 1)
    c = np.arange(int(images.max()) + 1, dtype=np.float64)
    phi = np.zeros_like(c)
    phi[1:] = c[1:] * np.log(c[1:]) - np.concatenate([[0.0], c[1:-1] * np.log(c[1:-1])])
    inverse_m = 1.0 / np.maximum(images, 1)
    inv = inverse_m[order]
    rate_sum = np.cumsum(inv, 1)
    term_sum = np.cumsum((phi[count] - np.log(np.maximum(images, 1))[order]) * inv, 1)
    entropy = np.log(rate_sum) - term_sum / rate_sum
    return np.clip(1.0 - entropy / math.log(len(images)), 0.0, 1.0)


def top_label_p(fire: np.ndarray, images: np.ndarray) -> np.ndarray:
    """Each atom's top-label p-value ``[d_sae]``: ``L · min over the tied top labels of P(X >= c)``, at most 1."""
    fire, images = np.asarray(fire, np.int64), np.asarray(images, np.int64)
    d_sae, n_labels = fire.shape
    p = np.full(d_sae, np.nan)
    n = fire.sum(1)
    rate = fire / np.maximum(images, 1)[None, :]
    top = (rate == rate.max(1, keepdims=True)) & (fire > 0)
    atoms, columns = np.nonzero(top)
    if len(atoms):
        # one tail per distinct (c, m, n): many labels tie at small counts (ImageNet's 1000 labels at c = 1), and
        # SciPy's tail costs up to ~60 us each
        c, m, k = fire[atoms, columns], images[columns], n[atoms]
        order = np.lexsort((c, m, k))
        new = np.ones(len(order), bool)
        new[1:] = (np.diff(c[order]) != 0) | (np.diff(m[order]) != 0) | (np.diff(k[order]) != 0)
        first = order[new]
        tail = np.empty(len(order))
        tail[order] = hypergeom.sf(c[first] - 1, int(images.sum()), m[first], k[first])[np.cumsum(new) - 1]
        best = np.full(d_sae, np.inf)
        np.minimum.at(best, atoms, tail)
        fired = n > 0
        p[fired] = np.minimum(1.0, n_labels * best[fired])
    return p


def benjamini_hochberg(p: np.ndarray) -> np.ndarray:
    """BH-adjusted p-values over the finite entries of ``p`` (NaN stays NaN): ``min_{k >= i} p_(k) · m / k``."""
    p = np.asarray(p, np.float64)
    adjusted = np.full(p.shape, np.nan)
    tested = np.flatnonzero(np.isfinite(p))
    if len(tested):
        order = tested[np.argsort(p[tested], kind="stable")]
        scaled = p[order] * len(order) / np.arange(1, len(order) + 1)
        adjusted[order] = np.minimum(1.0, np.minimum.accumulate(scaled[::-1])[::-1])
    return adjusted


def min_images(images: np.ndarray, fdr: float) -> int | None:
    """The fewest labelled images that, all of one label, give a top-label p-value at most ``fdr`` (None: none do)."""
    images = np.asarray(images, np.int64)
    total, n_labels = int(images.sum()), len(images)
    sizes = np.sort(images[images > 0])
    for n in range(1, int(sizes[-1]) + 1 if len(sizes) else 1):
        smallest = sizes[np.searchsorted(sizes, n)]  # the rarest label with at least n images: the smallest tail
        log_tail = _log_comb(smallest, n) - _log_comb(total, n)
        if math.log(n_labels) + log_tail <= math.log(fdr):
            return n
    return None


def _log_comb(a: int, b: int) -> float:
    return float(gammaln(a + 1) - gammaln(b + 1) - gammaln(a - b + 1))


def draws_for(total: int) -> int:
    """``DRAWS``, or fewer where they would pass ``BUDGET`` (the null's cost is O(draws · M log M))."""
    return int(min(DRAWS, max(MIN_DRAWS, BUDGET // max(total, 1))))


def chance(
    fire: np.ndarray, images: np.ndarray, selectivity: np.ndarray, fdr: float = FDR, draws: int | None = None
) -> Chance:
    """Every atom of the label counts ``fire [d_sae, L]`` (over the ``images [L]``) against the null above."""
    n = np.asarray(fire, np.int64).sum(1)
    draws = draws_for(int(np.sum(images))) if draws is None else draws
    seed = SEED
    by_n_mean, by_n_sd = null_selectivity(images, int(n.max(initial=0)), draws, seed)
    fired = n > 0
    mean, sd = np.full(len(n), np.nan), np.full(len(n), np.nan)
    mean[fired], sd[fired] = by_n_mean[n[fired]], by_n_sd[n[fired]]
    p = top_label_p(fire, images) if len(images) > 1 else np.full(len(n), np.nan)
    n_min = min_images(images, fdr) if len(images) > 1 else None
    testable = fired & (n >= n_min) if n_min is not None else np.zeros(len(n), bool)
    adjusted = benjamini_hochberg(np.where(testable, p, np.nan))
    with np.errstate(invalid="ignore"):
        beats = adjusted <= fdr
    too_few = fired & ~testable & (len(images) > 1)
    excess = selectivity - mean
    return Chance(mean, sd, excess, p, adjusted, beats, too_few, by_n_mean, by_n_sd, fdr, n_min, draws, seed)


__all__ = ["DRAWS", "FDR", "Chance", "benjamini_hochberg", "chance", "min_images", "null_selectivity", "top_label_p"]
