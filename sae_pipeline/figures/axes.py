"""What every figure shares: input checks, the single-axes figure, the log2 k axis, the Babel and
frequency-vs-mean axes. One place, so the training figures and the evaluation suite's figures of the
same quantity look alike and are fixed once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullLocator
from torch import Tensor

ArrayLike = Tensor | np.ndarray | Sequence[float]


def to_numpy(values: ArrayLike, name: str) -> np.ndarray:
    """A float64 numpy copy of a tensor / array / list, for plotting."""
    if isinstance(values, Tensor):
        return values.detach().to(device="cpu", dtype=torch.float64).numpy()
    try:
        return np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(
            f"{name} must be a tensor, array or sequence of numbers, got {type(values).__name__}"
        ) from None


def one_dimensional(values: ArrayLike, name: str) -> np.ndarray:
    array = to_numpy(values, name)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D tensor or array, got shape {tuple(array.shape)}")
    return array


def single_axes() -> tuple[Figure, Axes]:
    """The 5 x 3.6 inch one-plot figure of every line and scatter plot."""
    fig = Figure(figsize=(5.0, 3.6), layout="constrained")
    return fig, fig.add_subplot()


def finish(
    ax: Axes, xlabel: str, ylabel: str | None, title: str | None = None, legend_fontsize: float | None = None
) -> None:
    """Axis labels, title, the light grid, and a legend when ``legend_fontsize`` is given."""
    ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if legend_fontsize is not None:
        ax.legend(fontsize=legend_fontsize)


def log2_axis(ax: Axes, ticks: Sequence[float]) -> None:
    """A base-2 log x axis labelled with the plotted values as plain numbers (not 2^n)."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(float(tick) for tick in ticks))))
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_locator(NullLocator())


def plot_babel(ax: Axes, curves: Mapping[str, ArrayLike], markers: bool = True) -> None:
    """One line ``μ₁(1..R)`` per named curve, against r; markers on short curves (≤ 20 points)."""
    for label, values in curves.items():
        curve = one_dimensional(values, f"curves[{label!r}]")
        r = np.arange(1, curve.size + 1)
        ax.plot(r, curve, marker="o" if markers and curve.size <= 20 else None, markersize=3, label=str(label))


def scatter_frequency_vs_mean(ax: Axes, frequency: np.ndarray, mean_value: np.ndarray, size: float) -> int:
    """Each atom's activation frequency (log axis) against its mean value; returns how many fired.

    Atoms that never fired (frequency 0, or NaN for a missing value) cannot sit on a log axis and
    are left out; the caller says so in its title.
    """
    fired = frequency > 0
    ax.scatter(frequency[fired], mean_value[fired], s=size, alpha=0.5, linewidths=0)
    if fired.any():
        ax.set_xscale("log")
    return int(fired.sum())
