"""Figures of one SAE: Babel curves, R² against inference k, atom grids, activation scatter.

Pure functions: each takes tensors or arrays and returns a ``matplotlib.figure.Figure``. They
are used by the training callback (:mod:`sae_pipeline.training.callbacks`, TensorBoard) and by the
evaluation suite for one exported SAE or dictionary (``fig.savefig("babel.png")``).

Each reproduces one of the paper's plots (Costa et al. 2025): Babel curves (Fig. "Coherence":
μ₁(r) of the whole dictionary and of the co-activated atoms), R² against the inference-time k
(Fig. "inference at k", trained k marked), the atom grid (Fig. "Feature Selection vs. Activation
Levels") and frequency against mean activation (Fig. "Activation distributions"). Built on
``matplotlib.figure.Figure``, never pyplot (see :mod:`sae_pipeline.figures`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from feature_extraction.validate import check_int
from sae_pipeline.figures.axes import (
    ArrayLike,
    finish,
    log2_axis,
    one_dimensional,
    plot_babel,
    scatter_frequency_vs_mean,
    single_axes,
    to_numpy,
)


def babel_curve_figure(curves: Mapping[str, ArrayLike], title: str = "Babel function μ₁(r)") -> Figure:
    """One line per named curve ``μ₁(1..R)`` (e.g. ``{"dictionary": ..., "co-active": ...}``).

    The Babel function (Tropp 2004) measures how well one atom is approximated by ``r`` others;
    the paper contrasts the whole dictionary (MP-SAE: more coherent) with the atoms co-active
    on a token (MP-SAE: less coherent), so both are drawn on the same axes.
    """
    if not curves:
        raise ValueError("curves must hold at least one named curve, got an empty mapping")
    fig, ax = single_axes()
    plot_babel(ax, curves)
    finish(ax, "r (number of other atoms)", "μ₁(r)", title)
    ax.legend()
    return fig


def r2_vs_k_figure(
    ks: Sequence[int],
    r2s: Mapping[str, Sequence[float]],
    trained_k: int | None = None,
    title: str = "R² against inference-time k",
) -> Figure:
    """R² of each named model against the inference k (MP-SAE: pursuit steps; TopK: kept latents).

    The paper's claim (Proposition 2, Fig. "inference at k"): MP-SAE's R² rises monotonically
    with k, TopK degrades when k differs from the trained k, ReLU plateaus. ``trained_k`` is
    marked with a dashed vertical line. The k axis is logarithmic (base 2) when ``ks`` spans
    more than a factor of 4.
    """
    k_values = one_dimensional(list(ks), "ks")
    if (k_values < 1).any() or (k_values != np.round(k_values)).any():
        raise ValueError(f"ks must be integers >= 1, got {list(ks)}")
    if not r2s:
        raise ValueError("r2s must hold at least one named list of R² values, got an empty mapping")
    fig, ax = single_axes()
    for label, values in r2s.items():
        r2 = one_dimensional(values, f"r2s[{label!r}]")
        if r2.size != k_values.size:
            raise ValueError(f"r2s[{label!r}] must have one value per k ({k_values.size}), got {r2.size}")
        ax.plot(k_values, r2, marker="o", markersize=4, label=str(label))
    if trained_k is not None:
        ax.axvline(trained_k, color="grey", linestyle="--", linewidth=1, label=f"trained k = {trained_k}")
    if k_values.max() / k_values.min() > 4:
        log2_axis(ax, k_values)
    finish(ax, "inference k", "R²", title)
    ax.legend()
    return fig


def atom_grid_figure(
    W_dec: ArrayLike,
    image_shape: tuple[int, int],
    n_atoms: int = 25,
    title: str = "atoms",
    labels: Sequence[str] | None = None,
) -> Figure:
    """The first ``n_atoms`` rows of ``W_dec [n, d]`` as images of ``image_shape`` in a square grid.

    Pass the rows in the order to show (the callback passes the most frequently active atoms
    first, as the paper's Fig. "Feature Selection vs. Activation Levels" does). Each atom has
    its own symmetric colour scale ``[-max|atom|, +max|atom|]`` on a diverging map, so 0 is
    white and the sign of every pixel is visible whatever the atom's contrast (atoms are
    unit-norm, so their scales are comparable anyway). ``labels`` (one per shown atom, e.g.
    atom indices) are drawn above the images.
    """
    atoms = to_numpy(W_dec, "W_dec")
    if atoms.ndim != 2 or atoms.shape[0] == 0:
        raise ValueError(f"W_dec must be a non-empty 2-D [n_atoms, d] tensor, got shape {tuple(atoms.shape)}")
    if len(image_shape) != 2 or any(int(side) < 1 for side in image_shape):
        raise ValueError(f"image_shape must be (height, width) with positive sides, got {tuple(image_shape)}")
    image_height, image_width = int(image_shape[0]), int(image_shape[1])
    if image_height * image_width != atoms.shape[1]:
        raise ValueError(
            f"image_shape {image_height}x{image_width} = {image_height * image_width} pixels does not match "
            f"the atom size d = {atoms.shape[1]}"
        )
    check_int("n_atoms", n_atoms, 1)
    n_shown = min(n_atoms, atoms.shape[0])
    if labels is not None and len(labels) < n_shown:
        raise ValueError(f"labels must have at least one entry per shown atom ({n_shown}), got {len(labels)}")
    n_cols = math.ceil(math.sqrt(n_shown))
    n_rows = math.ceil(n_shown / n_cols)
    # Fixed margins in inches rather than a layout engine: constrained layout over 25 axes costs
    # about a second per figure, paid at every validation.
    width, height_inches = 1.2 * n_cols + 0.2, 1.2 * n_rows + 0.5
    fig = Figure(figsize=(width, height_inches))
    fig.suptitle(title, y=1 - 0.12 / height_inches, va="top", fontsize=10)
    fig.subplots_adjust(
        left=0.1 / width,
        right=1 - 0.1 / width,
        bottom=0.1 / height_inches,
        top=1 - 0.45 / height_inches,
        wspace=0.08,
        hspace=0.25 if labels is not None else 0.08,
    )
    axes = fig.subplots(n_rows, n_cols, squeeze=False)
    for position, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if position >= n_shown:
            continue
        image = atoms[position].reshape(image_height, image_width)
        scale = float(np.abs(image).max()) or 1.0  # an all-zero atom is drawn white
        ax.imshow(image, cmap="RdBu_r", vmin=-scale, vmax=scale, interpolation="nearest")
        if labels is not None:
            ax.set_title(str(labels[position]), fontsize=7)
    return fig


def frequency_vs_mean_figure(
    freq: ArrayLike, mean: ArrayLike, title: str = "activation frequency vs mean value"
) -> Figure:
    """Scatter of each atom's activation frequency against its mean activation ``E[z_j]``.

    The paper's Fig. "Activation distributions" (a): shallow ℓ0 SAEs spread along frequency,
    MP-SAE along mean value. Frequency is on a log axis (it spans orders of magnitude); atoms
    that never fired (frequency 0) cannot be placed on it and are counted in the title.
    """
    frequency = one_dimensional(freq, "freq")
    mean_value = one_dimensional(mean, "mean")
    if frequency.shape != mean_value.shape:
        raise ValueError(f"freq and mean must have the same length, got {frequency.size} and {mean_value.size}")
    fig, ax = single_axes()
    n_never = frequency.size - scatter_frequency_vs_mean(ax, frequency, mean_value, size=4)
    finish(
        ax,
        "activation frequency (fraction of tokens)",
        "mean activation E[z_j]",
        title if n_never == 0 else f"{title}\n({n_never} of {frequency.size} atoms never fired, not shown)",
    )
    return fig
