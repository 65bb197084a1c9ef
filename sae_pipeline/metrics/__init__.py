"""Evaluation metrics for sparse autoencoders: R², sparsity, dead atoms and the Babel function.

- :mod:`.streaming`: the metrics a training run accumulates over its batches (``ReconstructionR2``,
  ``ActivationStats``: float64 sums that DDP reduces exactly), ``l0`` and ``dead_fraction``;
- :mod:`.babel_function`: the Babel function of the dictionary and of the co-active atoms, in blocks;
- :mod:`.measure`: every number and curve of one SAE on one sample (``evaluate_sae``), which the
  training callback logs and the evaluation suite reports;
- :mod:`.dictionary_match`: two dictionaries' atoms matched one to one by |cosine| (``matched_cosines``),
  for the seed-stability report and the feature browser's "found in j of N seeds".

The package sits on :mod:`sae_pipeline.sae` only, below training and the evaluation
(``tests/test_import_rules.py``); every name is importable from here.
"""

from __future__ import annotations

from sae_pipeline.metrics.babel_function import babel, babel_coactive
from sae_pipeline.metrics.dictionary_match import THRESHOLD, match_cosines, match_cosines_sparse, matched_cosines
from sae_pipeline.metrics.measure import default_inference_ks, evaluate_sae
from sae_pipeline.metrics.streaming import ActivationStats, ReconstructionR2, dead_fraction, l0

__all__ = [
    "ActivationStats",
    "ReconstructionR2",
    "THRESHOLD",
    "babel",
    "babel_coactive",
    "dead_fraction",
    "default_inference_ks",
    "evaluate_sae",
    "l0",
    "match_cosines",
    "match_cosines_sparse",
    "matched_cosines",
]
