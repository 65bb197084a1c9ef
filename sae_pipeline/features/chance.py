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
- Exact where cheap (`sae_pipeline.features.chance_exact`): at the atoms' ``n`` whose label
  compositions are few (``n <= 10`` with 10 labels), ``E[S | n]``, ``SD[S | n]`` and the p-value
  below come from listing every composition with its hypergeometric probability instead.
- Excess ``S - E[S | n]``: what the index sorts by.
- The verdict tests ``S`` itself, the statistic the page shows: ``p = P(S_null >= S | n)``, one-sided
  (more selective than ``n`` random images), by the first that applies of
  (1) ``S = 1`` (one label only): exactly ``sum_l C(m[l], n) / C(M, n)``, the chance that ``n`` random
  images share a label; (2) the exact enumeration; (3) the simulation's empirical p-value
  ``(1 + b) / (1 + draws)``, ``b`` the draws of the same ``n`` with ``S_null >= S``, when ``b >= TAIL_MIN``;
  (4) beyond the simulation's resolution (``b < TAIL_MIN``: BH over thousands of atoms needs
  p-values far below ``1 / (1 + draws)``), a tail approximation: ``S`` as a scaled chi-square
  ``a · chi2(nu)`` with the simulated mean and variance at that ``n`` (``a = var / (2 mean)``,
  ``nu = 2 mean^2 / var``; for equal label sizes ``2 n log(L) S`` tends to ``chi2(L - 1)``), kept
  between the exact ``P(S_null = 1 | n)`` below and the empirical ``(1 + b) / (1 + draws)`` above.
  ``Chance.method`` says which, per atom. The top label's own hypergeometric p-value
  (``P(X >= c[top])``, ``X ~ Hypergeometric(M, m[top], n)``, times ``L``) is kept beside it (``top_p``)
  but decides nothing.
- Benjamini-Hochberg over the atoms that can be tested at all, at the false-discovery rate ``fdr``:
  an atom "beats chance" when its BH-adjusted p-value is at most ``fdr``. BH assumes the atoms'
  p-values independent or positively dependent (PRDS); it does not correct for arbitrary dependence.
- Too few images to say: an atom firing on fewer than ``n_min`` labelled images, the smallest ``n`` at
  which even ``n`` images all of one label (``S = 1``) reach a p-value at most ``fdr``
  (``sum_l C(m[l], n) / C(M, n) <= fdr``). Such atoms cannot beat chance whatever their
  labels, so they are left out of the BH family (a filter on ``n`` alone, which the null leaves
  untouched: the kept atoms' p-values stay valid) and greyed on the index.
- No ``n_min`` at all: the smallest p-value any atom can have (``k / C(M, m_max)``: it fires on every
  image of the largest label, of which there are ``k``, and on no other) is above ``fdr``, so no atom
  can beat chance; the page and the command say so, with that p-value (``Chance.unreachable``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import gammaln
from scipy.stats import chi2, hypergeom

from sae_pipeline.features import chance_exact
from sae_pipeline.features.chance_exact import TIE

DRAWS = 1000  # random orders of the labelled images (the null's Monte-Carlo draws), up to BUDGET images in all
BUDGET = 1 << 26  # draws x M above which fewer draws are made (not below MIN_DRAWS): ~10 s of numpy
MIN_DRAWS = 100
SEED = 0
FDR = 0.05
CHUNK = 1 << 20  # draws x images held at once (float64 arrays of this size, a few at a time)
TAIL_MIN = 10  # draws reaching S below which the p-value is the tail approximation's
METHODS = ("exact, one label", "exact", "simulation", "tail approximation")  # Chance.method's codes 0..3

FORMULA = (
    "against chance: E[S | n] and SD[S | n] are the mean and spread of S over {draws} random draws of the same "
    "number n of labelled images, without replacement (multivariate hypergeometric counts under the label prior; "
    "exact, by every label composition, where n is small); excess = S − E[S | n]; p = P(S_null ≥ S | n), "
    "one-sided: exact for S = 1 (Σ_l C(m[l], n) / C(M, n)) and small n, else (1 + b) / (1 + draws) with b the "
    "draws reaching S, or, when b < {tail_min}, a scaled chi-square with the null's mean and variance at n; "
    "Benjamini–Hochberg over the atoms with n ≥ n_min = {n_min} at false-discovery rate {fdr} (n_min: the fewest "
    "images that, all of one label, could reach p ≤ {fdr}; atoms below it have too few images to say)"
)


@dataclass
class Chance:
    """Each atom against the null (``[d_sae]`` arrays), the null itself by ``n``, and the settings."""

    mean: np.ndarray  # float64: E[S | n] at the atom's n (NaN: n = 0 or fewer than two labels)
    sd: np.ndarray  # float64: SD[S | n]
    excess: np.ndarray  # float64: S - E[S | n]
    p: np.ndarray  # float64: P(S_null >= S | n), the verdict's p-value (NaN: never fired)
    method: np.ndarray  # int8: how p was found, an index into METHODS (-1: no p)
    top_p: np.ndarray  # float64: the top label's hypergeometric p-value, Bonferroni over the labels
    p_adjusted: np.ndarray  # float64: Benjamini-Hochberg of p (NaN: not tested, n < n_min)
    beats: np.ndarray  # bool: p_adjusted <= fdr
    too_few: np.ndarray  # bool: 0 < n < n_min
    by_n_mean: np.ndarray  # float64 [n_max + 1]: E[S | n] for n = 0..n_max
    by_n_sd: np.ndarray
    exact_n: list[int]  # the n whose null was enumerated exactly
    fdr: float
    n_min: int | None  # None: no n reaches fdr (too few images in all)
    draws: int
    seed: int
    smallest_p: float | None = None  # the least p any atom can have (None: fewer than two labels)
    n_labelled: int = 0  # M

    def formula(self) -> str:
        n_min = self.n_min if self.n_min is not None else "–"
        return FORMULA.format(draws=self.draws, n_min=n_min, fdr=self.fdr, tail_min=TAIL_MIN)

    def unreachable(self) -> str | None:
        """Why no atom can beat chance at all, and what would let one (None: some can)."""
        if self.n_min is not None:
            return None
        if self.smallest_p is None:
            return f"all {self.n_labelled} labelled images carry one label: no atom can be tested against chance"
        return (
            f"no atom can beat chance at FDR {self.fdr:g} with {self.n_labelled} labelled images: the smallest "
            f"possible p is {self.smallest_p:.3g} (an atom firing on every image of one label and on no other); "
            f"pass --fdr above it, or use more labelled images"
        )

    def summary(self) -> dict[str, Any]:
        fired = self.method >= 0
        return {
            "fdr": self.fdr,
            "draws": self.draws,
            "seed": self.seed,
            "min_images": self.n_min,
            "smallest_p": self.smallest_p,
            "unreachable": self.unreachable(),
            "tested": int(np.isfinite(self.p_adjusted).sum()),
            "beat_chance": int(self.beats.sum()),
            "too_few": int(self.too_few.sum()),
            "exact_n": self.exact_n,
            "p_methods": {name: int((self.method[fired] == i).sum()) for i, name in enumerate(METHODS)},
            "formula": self.formula(),
        }


def null_selectivity(
    images: np.ndarray, n_max: int, draws: int = DRAWS, seed: int = SEED
) -> tuple[np.ndarray, np.ndarray]:
    """``(E[S | n], SD[S | n])`` for ``n = 0..n_max`` (NaN at 0) by ``draws`` random orders of the labelled images."""
    mean, sd, _ = simulate(images, n_max, draws, seed)
    return mean, sd


def simulate(
    images: np.ndarray,
    n_max: int,
    draws: int = DRAWS,
    seed: int = SEED,
    query_n: np.ndarray | None = None,
    query_s: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``null_selectivity``'s mean and SD, and for each query ``(n, S)`` the number of draws whose first ``n``
    images reach ``S_null >= S`` (within ``TIE``): the empirical p-value's count, from the same draws."""
    images = np.asarray(images, np.int64)
    total, n_labels = int(images.sum()), len(images)
    n_max = min(int(n_max), total)
    query_n = np.zeros(0, np.int64) if query_n is None else np.asarray(query_n, np.int64)
    query_s = np.zeros(0) if query_s is None else np.asarray(query_s, np.float64) - TIE
    exceed = np.zeros(len(query_n), np.int64)
    mean, sd = np.full(n_max + 1, np.nan), np.full(n_max + 1, np.nan)
    if n_max < 1 or n_labels < 2:
        return mean, sd, exceed
    label_dtype = np.int16 if n_labels < 1 << 15 else np.int64  # 16-bit keys: numpy's stable sort is a radix sort
    pool = np.repeat(np.arange(n_labels, dtype=label_dtype), images)
    rng = np.random.default_rng(seed)
    shift, sums, squares, done = None, np.zeros(n_max), np.zeros(n_max), 0
    column = np.clip(query_n, 1, n_max) - 1
    while done < draws:
        rows = max(1, min(draws - done, CHUNK // total, CHUNK // max(len(query_n), 1)))
        order = rng.permuted(np.broadcast_to(pool, (rows, total)), axis=1)[:, :n_max]
        s = _prefix_selectivity(order, images)
        if shift is None:
            shift = s.mean(0)  # shifted sums: no cancellation where SD is far below the mean
        sums += (s - shift).sum(0)
        squares += ((s - shift) ** 2).sum(0)
        if len(query_n):
            exceed += (s[:, column] >= query_s[None, :]).sum(0)
        done += rows
    centred = sums / draws
    mean[1:] = shift + centred
    sd[1:] = np.sqrt(np.maximum(squares - draws * centred**2, 0.0) / max(draws - 1, 1))
    return mean, sd, exceed


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


def tail_approximation(s: np.ndarray, mean: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """``P(S_null >= s)`` with ``S_null`` a scaled chi-square of the given mean and SD (moments matched)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = sd**2 / (2 * mean)
        dof = 2 * mean**2 / sd**2
        p = chi2.sf(s / scale, dof)
    return np.where(np.isfinite(p), p, 1.0)


def selectivity_p(
    fire: np.ndarray,
    images: np.ndarray,
    selectivity: np.ndarray,
    draws: int,
    seed: int = SEED,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """``(p, method, E[S | n] by n, SD[S | n] by n, exceed, exact n)``: each atom's ``P(S_null >= S | n)`` (see
    the module docstring) and the null it came from."""
    images = np.asarray(images, np.int64)
    n = np.asarray(fire, np.int64).sum(1)
    fired = n > 0
    p, method = np.full(len(n), np.nan), np.full(len(n), -1, np.int8)
    s = np.asarray(selectivity, np.float64)
    by_n_mean, by_n_sd, exceed = simulate(images, int(n.max(initial=0)), draws, seed, n[fired], s[fired])
    if len(images) < 2:
        return p, method, by_n_mean, by_n_sd, np.zeros(len(n), np.int64), []
    b = np.zeros(len(n), np.int64)
    b[fired] = exceed
    exact = chance_exact.exact_null(images, n[fired])
    for size, (values, weights) in exact.items():
        by_n_mean[size], by_n_sd[size] = chance_exact.moments(values, weights)
        atoms = np.flatnonzero(n == size)
        p[atoms], method[atoms] = chance_exact.tail(values, weights, s[atoms]), 1
    simulated = fired & (method < 0)
    empirical = (1.0 + b) / (1.0 + draws)
    p[simulated], method[simulated] = empirical[simulated], 2
    few = simulated & (b < TAIL_MIN)
    if few.any():
        floor = np.exp(chance_exact.log_one_label(images, n[few]))
        approx = tail_approximation(s[few], by_n_mean[n[few]], by_n_sd[n[few]])
        p[few], method[few] = np.clip(approx, floor, empirical[few]), 3
    one = fired & (s >= 1 - TIE)  # one label only: exact at any n (n = 1 gives 1)
    p[one], method[one] = np.minimum(1.0, np.exp(chance_exact.log_one_label(images, n[one]))), 0
    return p, method, by_n_mean, by_n_sd, b, sorted(exact)


def min_images(images: np.ndarray, fdr: float) -> int | None:
    """The fewest labelled images that, all of one label (``S = 1``), give a p-value at most ``fdr`` (None: none
    do): ``P(S_null = 1 | n)`` falls as ``n`` grows, so the first ``n`` below ``fdr``."""
    images = np.asarray(images, np.int64)
    largest = int(images.max(initial=0))
    if len(images) < 2 or largest < 1:
        return None
    log_fdr = math.log(fdr)
    for start in range(1, largest + 1, 256):
        sizes = np.arange(start, min(start + 256, largest + 1))
        below = np.flatnonzero(chance_exact.log_one_label(images, sizes) <= log_fdr)
        if len(below):
            return int(sizes[below[0]])
    return None


def smallest_p(images: np.ndarray) -> float | None:
    """The least p-value any atom can have (None: fewer than two labels): firing on all ``m_max`` images of the
    largest label and no other gives ``S = 1`` at the ``n`` where ``P(S_null = 1 | n)`` is least,
    ``k / C(M, m_max)`` with ``k`` the labels of that size."""
    images = np.asarray(images, np.int64)
    if len(images) < 2:
        return None
    largest = int(images.max())
    log_p = math.log(int((images == largest).sum())) - _log_comb(int(images.sum()), largest)
    return min(1.0, math.exp(log_p))


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
    p, method, by_n_mean, by_n_sd, _, exact_n = selectivity_p(fire, images, selectivity, draws, seed)
    fired = n > 0
    mean, sd = np.full(len(n), np.nan), np.full(len(n), np.nan)
    mean[fired], sd[fired] = by_n_mean[n[fired]], by_n_sd[n[fired]]
    top_p = top_label_p(fire, images) if len(images) > 1 else np.full(len(n), np.nan)
    n_min = min_images(images, fdr) if len(images) > 1 else None
    testable = fired & (n >= n_min) if n_min is not None else np.zeros(len(n), bool)
    adjusted = benjamini_hochberg(np.where(testable, p, np.nan))
    with np.errstate(invalid="ignore"):
        beats = adjusted <= fdr
    too_few = fired & ~testable & (len(images) > 1)
    return Chance(
        mean=mean,
        sd=sd,
        excess=selectivity - mean,
        p=p,
        method=method,
        top_p=top_p,
        p_adjusted=adjusted,
        beats=beats,
        too_few=too_few,
        by_n_mean=by_n_mean,
        by_n_sd=by_n_sd,
        exact_n=exact_n,
        fdr=fdr,
        n_min=n_min,
        draws=draws,
        seed=seed,
        smallest_p=smallest_p(images),
        n_labelled=int(np.sum(images)),
    )


__all__ = [
    "DRAWS",
    "FDR",
    "METHODS",
    "Chance",
    "benjamini_hochberg",
    "chance",
    "min_images",
    "null_selectivity",
    "selectivity_p",
    "simulate",
    "smallest_p",
    "tail_approximation",
    "top_label_p",
]
