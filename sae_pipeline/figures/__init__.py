"""Every matplotlib figure of the project, in one package.

- :mod:`.axes`: what the figures share (input checks, the one-plot figure, the log2 k axis, the
  Babel and frequency-vs-mean axes);
- :mod:`.model`: figures of one SAE (the training callback's TensorBoard figures, and the
  evaluation of one exported SAE or dictionary); re-exported here;
- :mod:`.compare`: the evaluation suite's figures that put the variants side by side.

Design choices:

- Figures are built with ``matplotlib.figure.Figure`` directly, never through ``pyplot``: no
  GUI backend is selected, nothing is kept in pyplot's global figure registry (a long run
  logging figures every epoch does not leak them), and the functions work on headless
  training nodes. ``fig.savefig`` renders with Agg.
- Each figure reproduces one of the paper's plots (Costa et al. 2025).
"""

from __future__ import annotations

from sae_pipeline.figures.model import atom_grid_figure, babel_curve_figure, frequency_vs_mean_figure, r2_vs_k_figure

__all__ = ["atom_grid_figure", "babel_curve_figure", "frequency_vs_mean_figure", "r2_vs_k_figure"]
