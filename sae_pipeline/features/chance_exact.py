"""The null distribution of ``S`` exactly, by enumerating label compositions, where that is cheap.

Why: the simulation of :mod:`sae_pipeline.features.chance` resolves ``E[S | n]`` to
``SD / sqrt(draws)`` and a p-value no finer than ``1 / (1 + draws)``; at small ``n`` the null
of ``S`` is also very discrete (three images of ten digits give a handful of values), so a few
hundred draws say little about its tail. For ``n`` images drawn without replacement from the
``M`` labelled images, the label counts ``c`` are multivariate hypergeometric:
``P(c) = prod_l C(m[l], c[l]) / C(M, n)``. When the number of compositions of ``n`` into the
``L`` labels (at most ``C(n + L - 1, L - 1)``) is small, every one is listed with its
probability and its ``S``, which gives ``E[S | n]``, ``SD[S | n]`` and ``P(S_null >= s)``
exactly (float64).

``S = 1`` exactly when the atom fires on one label only, so ``P(S_null >= 1 | n)`` is the
probability that ``n`` random images all share a label, ``sum_l C(m[l], n) / C(M, n)``:
exact at any ``n``, and the smallest p-value an atom with ``n`` images can have.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import gammaln, logsumexp

EXACT_COMPOSITIONS = 1 << 17  # compositions listed for one n (float64 arrays of this size, a few at a time)
EXACT_TOTAL = 1 << 20  # compositions listed over all the n asked for
TIE = 1e-9  # S values this close count as equal (the atom's S and the enumerated ones are computed apart)


def _log_comb(a: np.ndarray | int, b: np.ndarray | int) -> np.ndarray:
    return gammaln(np.asarray(a) + 1.0) - gammaln(np.asarray(b) + 1.0) - gammaln(np.asarray(a) - np.asarray(b) + 1.0)


def composition_bound(n: int, n_labels: int) -> int:
    """How many label compositions of ``n`` there are at most (the labels' sizes cap some counts)."""
    return math.comb(n + n_labels - 1, n_labels - 1)


def enumerate_null(images: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(S, P)`` of every label composition of ``n`` images: the exact null of ``S``."""
    images = np.asarray(images, np.int64)
    n_labels, total = len(images), int(images.sum())
    used = np.zeros(1, np.int64)  # images placed so far, per partial composition
    rate_sum, term_sum, log_weight = np.zeros(1), np.zeros(1), np.zeros(1)
    for label, m in enumerate(images.tolist()):
        room = np.minimum(m, n - used)
        if label == n_labels - 1:  # the last label takes what is left, if it has that many images
            keep = (n - used) <= m
            used, rate_sum, term_sum, log_weight = used[keep], rate_sum[keep], term_sum[keep], log_weight[keep]
            c = n - used
        else:
            k = room + 1
            row = np.repeat(np.arange(len(used)), k)
            c = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
            used, rate_sum, term_sum, log_weight = used[row], rate_sum[row], term_sum[row], log_weight[row]
        rate = c / max(m, 1)
        log_ways = _log_comb(m, np.arange(min(m, n) + 1))  # log C(m, c), looked up
        with np.errstate(divide="ignore", invalid="ignore"):
            term = np.where(c > 0, rate * np.log(np.where(c > 0, rate, 1.0)), 0.0)
        used, rate_sum, term_sum = used + c, rate_sum + rate, term_sum + term
        log_weight = log_weight + log_ways[c]
    entropy = np.log(rate_sum) - term_sum / rate_sum
    s = np.clip(1.0 - entropy / math.log(n_labels), 0.0, 1.0)
    return s, np.exp(log_weight - _log_comb(total, n))


def exact_null(
    images: np.ndarray, sizes: np.ndarray, limit: int | None = None, total_limit: int | None = None
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The exact null ``{n: (S, P)}`` for those of ``sizes`` (the atoms' distinct ``n``, ascending) whose
    compositions stay within ``limit`` each and ``total_limit`` together; the others are left to the simulation."""
    images = np.asarray(images, np.int64)
    limit = EXACT_COMPOSITIONS if limit is None else limit
    total_limit = EXACT_TOTAL if total_limit is None else total_limit
    out, spent = {}, 0
    if len(images) < 2:
        return out
    for n in sorted(int(v) for v in np.unique(sizes) if 2 <= v <= int(images.sum())):
        bound = composition_bound(n, len(images))
        if bound > limit or spent + bound > total_limit:
            break
        out[n] = enumerate_null(images, n)
        spent += bound
    return out


def moments(s: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    """``(E[S], SD[S])`` of an enumerated null."""
    mean = float((p * s).sum())
    return mean, math.sqrt(max(float((p * (s - mean) ** 2).sum()), 0.0))


def tail(s: np.ndarray, p: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """``P(S_null >= observed)`` for each observed ``S`` (ties within ``TIE`` count as reached)."""
    observed = np.asarray(observed, np.float64) - TIE
    if len(observed) <= 16:  # a few atoms at this n: one pass each, no sort
        return np.minimum(1.0, np.array([p[s >= value].sum() for value in observed]))
    order = np.argsort(s, kind="stable")
    above = np.concatenate([np.cumsum(p[order][::-1])[::-1], [0.0]])
    return np.minimum(1.0, above[np.searchsorted(s[order], observed, side="left")])


def log_one_label(images: np.ndarray, n: np.ndarray) -> np.ndarray:
    """``log P(S_null = 1 | n) = log sum_l C(m[l], n) / C(M, n)`` (all ``n`` images of one label) for each ``n``."""
    images = np.asarray(images, np.int64)
    n = np.asarray(n, np.int64)
    total = int(images.sum())
    out = np.full(n.shape, -np.inf)
    for start in range(0, n.size, 4096):
        k = n.reshape(-1)[start : start + 4096, None]
        ways = np.where(images[None, :] >= k, _log_comb(np.maximum(images[None, :], k), k), -np.inf)
        out.reshape(-1)[start : start + 4096] = logsumexp(ways, axis=1) - _log_comb(total, k[:, 0])
    return out


__all__ = ["composition_bound", "enumerate_null", "exact_null", "log_one_label", "moments", "tail"]
