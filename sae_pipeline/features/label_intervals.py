"""How sure the label statistics are: a 95 % interval for each atom's ``S`` and ``q[top]``.

Why: ``S`` and ``q`` are computed from the atom's label counts ``c`` as if they were the atom's
true label distribution, so three images of one label show ``S = 1.000`` exactly as 67 do. The
interval is a Bayesian posterior one: the atom's share of images per label ``theta`` gets a
Dirichlet prior worth ``PRIOR_IMAGES`` image spread by the label prior (``alpha[l] = p[l]``), so
the posterior is ``Dirichlet(c + alpha)``; ``S`` and ``q[top]`` (``top`` the observed top label)
are computed on ``POSTERIOR_DRAWS`` draws of ``theta`` (rates ``theta[l] / m[l]``), and the interval
is their 2.5th to 97.5th percentile. Seeded: the same counts give the same interval.

Cost: a draw samples one Gamma per label only for the atom's ``EXACT_LABELS`` labels of most
images (its top label among them), so O(draws · d_sae · EXACT_LABELS), not O(draws · d_sae · L):
the other labels it fired on enter through the sums ``R = sum r`` and ``T = sum r log r`` of their
rates, drawn as a bivariate normal with the exact mean and covariance of those sums under the
posterior (the Gamma moments ``E[G log G] = a psi(a + 1)``, ``E[G^2 log G] = a (a + 1) psi(a + 2)``,
``E[(G log G)^2] = a (a + 1) (psi'(a + 2) + psi(a + 2)^2)``: a central-limit step, used only when
there are more than ``EXACT_LABELS`` of them); the labels it never fired on share one Gamma
(``Gamma(sum of their alpha)``, the Dirichlet's aggregation property), spread over them evenly by
the prior (each gets the same rate). That is the most even split of that mass, so it lowers ``S``
and ``q[top]`` at least as much as the full Dirichlet would: the interval's low end errs low.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import polygamma, psi

POSTERIOR_DRAWS = 200
PRIOR_IMAGES = 1.0  # the Dirichlet prior's total weight, in images, spread by the label prior
LEVEL = 0.95
SEED = 0
BLOCK_ENTRIES = 1 << 21  # non-zero counts x draws sampled at once
EXACT_LABELS = 8  # labels per atom whose Gamma is drawn; the rest of those it fired on: normal sums


def intervals(
    fire: np.ndarray, images: np.ndarray, top_column: np.ndarray, draws: int = POSTERIOR_DRAWS, seed: int = SEED
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(S low, S high, q[top] low, q[top] high)`` per atom (NaN: never fired on a labelled image, or fewer
    than two labels) from the counts ``fire [d_sae, L]`` (or pseudo-counts, `sae_pipeline.features.label_weights`),
    ``images [L]`` and each atom's top label column."""
    fire, images = np.asarray(fire, np.float64), np.asarray(images, np.int64)  # float: weighted pseudo-counts
    d_sae, n_labels = fire.shape
    out = [np.full(d_sae, np.nan) for _ in range(4)]
    if n_labels < 2:
        return tuple(out)
    prior = images / max(int(images.sum()), 1)
    alpha = PRIOR_IMAGES * prior
    tails = 100 * np.array([(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    rng = np.random.default_rng(seed)
    nnz = (fire > 0).sum(1)
    start = 0
    while start < d_sae:
        stop = start + 1
        budget = BLOCK_ENTRIES // draws
        spent = int(nnz[start])
        while stop < d_sae and spent + int(nnz[stop]) <= budget:
            spent += int(nnz[stop])
            stop += 1
        _block(fire[start:stop], images, alpha, top_column[start:stop], draws, rng, tails, [o[start:stop] for o in out])
        start = stop
    return tuple(out)


def _block(
    fire: np.ndarray,
    images: np.ndarray,
    alpha: np.ndarray,
    top: np.ndarray,
    draws: int,
    rng: np.random.Generator,
    tails: np.ndarray,
    out: list[np.ndarray],
) -> None:
    atoms, columns = np.nonzero(fire)
    if not len(atoms):
        return
    fired = np.unique(atoms)
    counts = fire[atoms, columns]
    order = np.lexsort((-counts, columns != top[atoms], atoms))  # per atom: the top label, then most images
    atoms, columns, counts = atoms[order], columns[order], counts[order]
    starts = np.searchsorted(atoms, fired)
    rank = np.arange(len(atoms)) - np.repeat(starts, np.diff(np.append(starts, len(atoms))))
    drawn = rank < EXACT_LABELS
    shape = counts + alpha[columns]
    gamma = rng.standard_gamma(shape[drawn][:, None], size=(int(drawn.sum()), draws))
    rate = gamma / images[columns[drawn]][:, None]
    drawn_starts = np.searchsorted(atoms[drawn], fired)
    rate_sum = np.add.reduceat(rate, drawn_starts, axis=0)
    term_sum = np.add.reduceat(rate * np.log(rate, out=np.zeros_like(rate), where=rate > 0), drawn_starts, axis=0)
    if (~drawn).any():
        sums = _normal_sums(atoms[~drawn], shape[~drawn], images[columns[~drawn]], fired, draws, rng)
        rate_sum, term_sum = rate_sum + sums[0], term_sum + sums[1]
    present = fire[fired] > 0
    rest_labels = (~present).sum(1)[:, None]
    rest_alpha = np.maximum(alpha.sum() - (present * alpha[None, :]).sum(1), 0.0)
    rest_images = np.maximum(images.sum() - (present * images[None, :]).sum(1), 1)[:, None]
    rest = rng.standard_gamma(np.maximum(rest_alpha, 1e-300)[:, None], size=(len(fired), draws))
    rest = np.where((rest_labels > 0) & (rest_alpha[:, None] > 0), rest, 0.0) / rest_images  # each rest label's rate
    rate_sum = rate_sum + rest_labels * rest
    term_sum = term_sum + rest_labels * rest * np.log(rest, out=np.zeros_like(rest), where=rest > 0)
    entropy = np.log(rate_sum) - term_sum / rate_sum
    s = np.clip(1.0 - entropy / math.log(fire.shape[1]), 0.0, 1.0)
    q_top = rate[drawn_starts] / rate_sum  # each atom's first drawn entry is its top label
    for array, low, high in ((s, out[0], out[1]), (q_top, out[2], out[3])):
        low[fired], high[fired] = np.percentile(array, tails, axis=1)


def _normal_sums(
    atoms: np.ndarray, shape: np.ndarray, images: np.ndarray, fired: np.ndarray, draws: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Draws of ``(R, T)`` over the given entries of each fired atom (zeros where it has none): a bivariate normal
    with the posterior mean and covariance of ``r = G / m`` and ``u = r log r``, ``G ~ Gamma(shape)``."""
    a, log_m = shape, np.log(images)
    g2 = a * (a + 1)
    distinct, inverse = np.unique(a, return_inverse=True)  # few distinct shapes: special functions once
    psi1, psi2, trigamma2 = psi(distinct + 1)[inverse], psi(distinct + 2)[inverse], polygamma(1, distinct + 2)[inverse]
    e_glogg, e_g2logg = a * psi1, g2 * psi2
    e_glogg2 = g2 * (trigamma2 + psi2**2)
    mean_r, mean_u = a / images, (e_glogg - a * log_m) / images
    var_r = a / images**2
    var_u = (e_glogg2 - 2 * log_m * e_g2logg + log_m**2 * g2) / images**2 - mean_u**2
    cov = (e_g2logg - log_m * g2) / images**2 - mean_r * mean_u
    row = np.searchsorted(fired, atoms)
    mu_r, mu_u, v_r, v_u, c = (
        np.bincount(row, weights=value, minlength=len(fired))
        for value in (mean_r, mean_u, var_r, np.maximum(var_u, 0.0), cov)
    )
    sd_r = np.sqrt(v_r)
    slope = np.divide(c, sd_r, out=np.zeros_like(c), where=sd_r > 0)
    rest = np.sqrt(np.maximum(v_u - slope**2, 0.0))
    z = rng.standard_normal((2, len(fired), draws))
    r = np.maximum(mu_r[:, None] + sd_r[:, None] * z[0], 0.0)
    u = mu_u[:, None] + slope[:, None] * z[0] + rest[:, None] * z[1]
    return r, u


__all__ = ["LEVEL", "POSTERIOR_DRAWS", "PRIOR_IMAGES", "intervals"]
