"""Train and evaluate sparse autoencoders on vision-model token activations."""

import os

# OpenBLAS's idle threads spin for ~0.1 s after each call before they sleep (its thread timeout,
# 2^28 cycles), and take the cores from torch's next operations: after MP-SAE's Gram matrix by
# SciPy's syrk (sae_pipeline.sae.gram) that cost ~10 % of a training step (0.80 → 0.73 s, BENCHMARKS.md).
# OpenBLAS reads this once, when it loads (SciPy's on the first `scipy.linalg` import), hence here;
# 2^4 cycles: the threads sleep at once. A value the user set wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from feature_extraction.version import __version__  # noqa: E402 (after the environment above)

__all__ = ["__version__"]
