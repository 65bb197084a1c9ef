"""How many of a variant's atoms come back when it is trained again from another seed.

Why: an atom that one seed learns and the others do not is a property of that run, not of the variant or
the data; a reader of an atom page should know which kind it is. The dictionaries of two seed replicas
are matched one to one (Hungarian assignment, `scipy.optimize.linear_sum_assignment`, on |cosine| between
decoder rows: the sign of a row is a convention of some variants, not of the concept), and an atom counts
as found again when its partner's |cosine| reaches `THRESHOLD`. Reported per variant: the share of atoms
found again, averaged over every pair of replicas; and for seed 0's atoms (the ones the report and the
feature pages show) in how many of the N seeds each is found (itself counted).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from scipy.optimize import linear_sum_assignment

THRESHOLD = 0.7


def unit_rows(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, np.float64)
    return w / np.maximum(np.linalg.norm(w, axis=1, keepdims=True), 1e-12)


def match_cosines(w_a: np.ndarray, w_b: np.ndarray) -> np.ndarray:
    """|cosine| of each row of ``w_a`` with its partner in ``w_b`` under the one-to-one matching that maximises
    their sum (0 for a row left without a partner when ``w_b`` has fewer rows)."""
    similarity = np.abs(unit_rows(w_a) @ unit_rows(w_b).T)
    rows, cols = linear_sum_assignment(similarity, maximize=True)
    matched = np.zeros(len(w_a))
    matched[rows] = similarity[rows, cols]
    return matched


def stability(decoders: list[np.ndarray], threshold: float = THRESHOLD) -> dict[str, Any]:
    """Replica matching of one variant's decoders ``[p, d]``, seed 0 first (see the module docstring)."""
    n = len(decoders)
    pairs = []
    found_in = np.ones(len(decoders[0]), dtype=np.int64)
    for i, j in itertools.combinations(range(n), 2):
        cosines = match_cosines(decoders[i], decoders[j])
        pairs.append(
            {
                "a": i,
                "b": j,
                "share": float((cosines >= threshold).mean()),
                "median_cosine": float(np.median(cosines)),
            }
        )
        if i == 0:
            found_in += cosines >= threshold
    return {
        "n_seeds": n,
        "threshold": threshold,
        "share_matched": float(np.mean([pair["share"] for pair in pairs])) if pairs else None,
        "pairs": pairs,
        "found_in_counts": {str(j): int((found_in == j).sum()) for j in range(1, n + 1)},
        "atoms_found_in": found_in.tolist(),
    }


def stability_study(decoders_by_variant: dict[str, list[np.ndarray]], k: int, p: int) -> dict[str, Any]:
    """`stability` of every variant with two replicas or more, at the setting (k, p) whose decoders are given."""
    return {
        "k": k,
        "p": p,
        "threshold": THRESHOLD,
        "variants": {v: stability(ds) for v, ds in decoders_by_variant.items() if len(ds) > 1},
    }
