"""One-to-one matching of two dictionaries' atoms by |cosine|: which atoms a seed replica learned again.

Why here: the study report (`sae_pipeline.evaluate.stability`) and the feature browser's atom pages
(`sae_pipeline.features.replicas`) both ask it, and neither may import the other; metrics sits below both.
The sign of a decoder row is a convention of some variants, not of the concept, hence |cosine|. The matching
maximises the sum of |cosine| over its pairs; an atom is found again when its partner reaches `THRESHOLD`.

Two solvers of that one optimum, chosen by `matched_cosines` (dense up to `DENSE_MAX_CELLS`):

- `match_cosines`: Hungarian assignment (`scipy.optimize.linear_sum_assignment`) on the dense |cosine|
  matrix, `d_a x d_b` float64, in about d³ time (65 536 atoms would need 32 GiB for the matrix alone).
- `match_cosines_sparse` (`sae_pipeline.metrics.sparse_match`): the same optimum from each atom's best
  candidates, certified by the assignment's duals against every other pair, never holding the dense matrix
  (the products on a GPU when given one).

Both timed against each other in BENCHMARKS.md, "Matching seed replicas" (`python -m benchmarks.dictionary_match`).
"""

from __future__ import annotations

import numpy as np
import torch

from sae_pipeline.metrics.sparse_match import match_cosines_sparse, unit_rows

__all__ = ["DENSE_MAX_CELLS", "THRESHOLD", "match_cosines", "match_cosines_sparse", "matched_cosines", "unit_rows"]

#: A partner's |cosine| from which an atom counts as found again (the study report's and the atom pages').
THRESHOLD = 0.7
#: Largest ``d_a * d_b`` solved densely (4 096²: 128 MiB of float64, about a second).
DENSE_MAX_CELLS = 4096 * 4096


def match_cosines(w_a: np.ndarray, w_b: np.ndarray) -> np.ndarray:
    """|cosine| of each row of ``w_a`` with its partner in ``w_b`` under the one-to-one matching that maximises
    their sum (0 for a row left without a partner when ``w_b`` has fewer rows); dense Hungarian, exact."""
    from scipy.optimize import linear_sum_assignment  # here: importing metrics (every `fit`) need not load scipy

    similarity = np.abs(unit_rows(w_a) @ unit_rows(w_b).T)
    rows, cols = linear_sum_assignment(similarity, maximize=True)
    matched = np.zeros(len(w_a))
    matched[rows] = similarity[rows, cols]
    return matched


def matched_cosines(w_a: np.ndarray, w_b: np.ndarray, device: str | torch.device = "cpu") -> np.ndarray:
    """`match_cosines` up to `DENSE_MAX_CELLS`, `match_cosines_sparse` beyond (memory and time, above); ``device``
    runs the latter's products."""
    if len(w_a) * len(w_b) <= DENSE_MAX_CELLS:
        return match_cosines(w_a, w_b)
    return match_cosines_sparse(w_a, w_b, device=device)
