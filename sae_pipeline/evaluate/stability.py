"""How many of a variant's atoms come back when it is trained again from another seed.

Why: an atom that one seed learns and the others do not is a property of that run, not of the variant or
the data; a reader of an atom page should know which kind it is. The dictionaries of two seed replicas
are matched one to one on |cosine| between decoder rows (`sae_pipeline.metrics.dictionary_match`, which the
feature browser's atom pages use too: Hungarian assignment on the dense matrix, or on each atom's best
candidates for large dictionaries), and an atom counts as found again when its partner's |cosine| reaches
`THRESHOLD`. Reported per variant: the share of atoms
found again, averaged over every pair of replicas; and for seed 0's atoms (the ones the report and the
feature pages show) in how many of the N seeds each is found (itself counted).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from sae_pipeline.metrics.dictionary_match import THRESHOLD, match_cosines, matched_cosines, unit_rows

__all__ = ["THRESHOLD", "match_cosines", "stability", "stability_study", "unit_rows"]


def stability(decoders: list[np.ndarray], threshold: float = THRESHOLD) -> dict[str, Any]:
    """Replica matching of one variant's decoders ``[p, d]``, seed 0 first (see the module docstring)."""
    n = len(decoders)
    pairs = []
    found_in = np.ones(len(decoders[0]), dtype=np.int64)
    for i, j in itertools.combinations(range(n), 2):
        cosines = matched_cosines(decoders[i], decoders[j])
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
