"""Figures of the evaluation suite that compare variants (paper Figs. 2, 4, 5, 8 and the appendix).

Single-model figures (atom grids, one Babel curve, one R²-vs-k line) are in
:mod:`sae_pipeline.figures.model`; the ones here put every variant side by side, on the same
axes helpers (:mod:`sae_pipeline.figures.axes`), each named by its label in the variant registry
(:func:`sae_pipeline.sae.display_label`). Like those, they are built on
``matplotlib.figure.Figure`` (no pyplot state, headless) and return the figure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from sae_pipeline.figures.axes import finish, log2_axis, plot_babel, scatter_frequency_vs_mean, single_axes
from sae_pipeline.sae import display_label as _label


def _r2_line_figure(series: Mapping[str, list[dict]], x_key: str, ticks: list[int], xlabel: str, title: str) -> Figure:
    """Validation R² per variant against one quantity of the runs, on a log2 axis."""
    fig, ax = single_axes()
    for variant, rows in series.items():
        ax.plot(
            [row[x_key] for row in rows], [row["r2"] for row in rows], marker="o", markersize=4, label=_label(variant)
        )
    log2_axis(ax, ticks)
    finish(ax, xlabel, "validation R²", title, legend_fontsize=8)
    return fig


def expressivity_vs_k_figure(vs_k: Mapping[str, list[dict]], p: int) -> Figure:
    """R² against measured L0 (the training k for all but ReLU, whose L1 only aims at it), at fixed p."""
    return _r2_line_figure(
        vs_k,
        "l0",
        [row["k"] for rows in vs_k.values() for row in rows],
        "sparsity: measured L0 (active atoms per input)",
        f"Expressivity at p = {p}",
    )


def expressivity_vs_p_figure(vs_p: Mapping[str, list[dict]], k: int) -> Figure:
    """R² against the dictionary size p at fixed k (paper Fig. 2b)."""
    return _r2_line_figure(
        vs_p, "p", [row["p"] for rows in vs_p.values() for row in rows], "dictionary size p", f"Expressivity at k = {k}"
    )


def inference_by_train_k_figure(by_train_k: Mapping[str, Mapping[str, dict]]) -> Figure:
    """One panel per variant: R² against inference k, one line per training k (paper Fig. 8)."""
    variants = list(by_train_k)
    fig = Figure(figsize=(3.0 * len(variants), 3.0), layout="constrained")
    axes = fig.subplots(1, len(variants), squeeze=False, sharey=True)[0]
    for ax, variant in zip(axes, variants):
        for train_k, sweep in by_train_k[variant].items():
            line = ax.plot(sweep["ks"], sweep["r2"], marker="o", markersize=3, label=f"trained k = {train_k}")
            ax.axvline(int(train_k), color=line[0].get_color(), linestyle=":", linewidth=1)
        log2_axis(ax, [k for sweep in by_train_k[variant].values() for k in sweep["ks"]])
        finish(ax, "inference k", None, _label(variant))
    axes[0].set_ylabel("validation R²")
    axes[0].legend(fontsize=7)
    return fig


def babel_panels_figure(dictionary: Mapping[str, list[float]], coactive: Mapping[str, list[float]], k: int) -> Figure:
    """Babel μ₁(r) of the whole dictionary (left) and of the co-activated atoms (right), per variant.

    Curves are keyed by variant (shown by its registry label) or by the label of another dictionary."""
    fig = Figure(figsize=(9.0, 3.6), layout="constrained")
    left, right = fig.subplots(1, 2)
    plot_babel(left, {_label(variant): curve for variant, curve in dictionary.items()}, markers=False)
    plot_babel(right, {_label(variant): coactive[variant] for variant in dictionary}, markers=False)
    finish(left, "r", "μ₁(r)", "(a) dictionary", legend_fontsize=8)
    finish(right, "r", "μ₁(r)", f"(b) co-activated atoms (k = {k})")
    return fig


def _variant_panels(stats: Mapping[str, dict]) -> tuple[Figure, list]:
    """One small panel per variant, side by side."""
    fig = Figure(figsize=(3.0 * len(stats), 3.0), layout="constrained")
    return fig, list(fig.subplots(1, len(stats), squeeze=False)[0])


def _floats(values: list) -> np.ndarray:
    """A JSON list with nulls (atoms that never fired) as a float array with NaNs."""
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def frequency_vs_mean_panels(stats: Mapping[str, dict]) -> Figure:
    """Per variant: each atom's activation frequency against its mean value (paper Fig. 4a)."""
    fig, axes = _variant_panels(stats)
    for ax, variant in zip(axes, stats):
        n_fired = scatter_frequency_vs_mean(
            ax, _floats(stats[variant]["frequency"]), _floats(stats[variant]["mean_value"]), size=3
        )
        finish(ax, "activation frequency", None)
        ax.set_title(f"{_label(variant)} ({n_fired} atoms fired)", fontsize=9)
    axes[0].set_ylabel("mean activation E[z_j]")
    return fig


def selection_step_panels(stats: Mapping[str, dict]) -> Figure:
    """Per variant: mean selection step against mean value (paper Fig. 4b; shallow SAEs reordered by value)."""
    fig, axes = _variant_panels(stats)
    for ax, variant in zip(axes, stats):
        step, mean = _floats(stats[variant]["mean_step"]), _floats(stats[variant]["mean_value"])
        keep = np.isfinite(step)
        ax.scatter(mean[keep], step[keep], s=3, alpha=0.5, linewidths=0)
        rho = stats[variant].get("spearman_mean_vs_step")
        ax.set_title(f"{_label(variant)} (ρ = {rho:.2f})" if rho is not None else _label(variant), fontsize=9)
        finish(ax, "mean activation E[z_j]", None)
    axes[0].set_ylabel("mean selection step")
    return fig


def sequential_reconstruction_figure(sequences: Mapping[str, dict], image_shape: tuple[int, int]) -> Figure:
    """Rows: variants; columns: the input, then the reconstruction after 0 (b_pre), 1, 2, ... atoms."""
    variants = list(sequences)
    n_cols = 1 + max(len(sequences[v]["shown_steps"]) for v in variants)
    width, height = 0.9 * n_cols + 1.3, 1.05 * len(variants) + 0.5
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(
        left=1.25 / width, right=1 - 0.05 / width, bottom=0.05 / height, top=1 - 0.5 / height, wspace=0.05, hspace=0.35
    )
    axes = fig.subplots(len(variants), n_cols, squeeze=False)
    for row, variant in enumerate(variants):
        sequence = sequences[variant]
        images = [np.asarray(sequence["input"])] + [np.asarray(p) for p in sequence["partials"]]
        titles = ["input"] + [("b_pre" if s == 0 else f"{s}") for s in sequence["shown_steps"]]
        if len(sequence["shown_steps"]) > 1 and sequence["shown_steps"][-1] - sequence["shown_steps"][-2] > 1:
            titles[-1] = f"all {sequence['shown_steps'][-1]}"
        low, high = float(np.min(images[0])), float(np.max(images[0]))
        for col, ax in enumerate(axes[row]):
            ax.set_axis_off()
            if col < len(images):
                ax.imshow(images[col].reshape(image_shape), cmap="gray", vmin=low, vmax=high, interpolation="nearest")
                ax.set_title(titles[col], fontsize=7)
        axes[row][0].text(
            -0.1, 0.5, _label(variant), transform=axes[row][0].transAxes, ha="right", va="center", fontsize=8
        )
    fig.suptitle("Sequential reconstruction, atom by atom (shallow SAEs: atoms ordered by value)", fontsize=9)
    return fig


def probing_accuracy_figure(
    variants: Mapping[str, dict], raw: dict, reference: tuple[str, dict] | None = None
) -> Figure:
    """Sparse-probing accuracy (mean over one-vs-rest classes) against the number of latents k, per variant,
    with its 95 % interval over the SAE seeds as error bars where there are several (the draws of the tasks
    are Monte-Carlo error, not shown; the raw inputs and a fixed dictionary have no seeds); the raw inputs'
    k best dimensions dashed and all of them as a horizontal line (the references)."""
    fig, ax = single_axes()
    ks = raw["ks"]

    def draw(entry: dict, **style: Any) -> None:
        means = [entry["mean"][str(k)] for k in ks]
        intervals = [(entry.get("interval") or {}).get(str(k)) for k in ks]
        if all(intervals):
            errors = [[m - i[0] for m, i in zip(means, intervals)], [i[1] - m for m, i in zip(means, intervals)]]
            ax.errorbar(ks, means, yerr=errors, capsize=2, **style)
        else:
            ax.plot(ks, means, **style)

    for variant, entry in variants.items():
        draw(entry, marker="o", markersize=4, label=_label(variant))
    if reference is not None:
        label, entry = reference
        draw(entry, marker="s", markersize=4, linestyle=":", label=label)
    draw(raw, color="black", linestyle="--", label="raw inputs, top-k dims")
    ax.axhline(raw["mean"]["all"], color="grey", linewidth=1, label="raw inputs, all dims")
    log2_axis(ax, ks)
    finish(ax, "k (latents the probe may use)", "held-out accuracy", "Sparse probing (one-vs-rest)", 7)
    return fig
