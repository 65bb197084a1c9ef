"""An atom page's activation distribution: the histogram as an inline SVG, and a row of example cards per band.

The bars are the columns of `sae_pipeline.features.distribution` between the first and the last
non-empty one, on a log-spaced value axis labelled in the code's units at each decade; each bar's
tooltip gives its value range and count, and its shade its quantile band. Pages of an older
``features.npz`` (no ``hist_counts``) simply have no such section.
"""

from __future__ import annotations

import html
from collections.abc import Callable

import numpy as np
from torch import Tensor

from sae_pipeline.features.distribution import HIST_EDGES, N_BINS

WIDTH, HEIGHT, LEFT, BOTTOM, TOP = 560, 150, 46, 34, 8
BAND_SHADES = ("#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c")


def column_range(column: int) -> tuple[float, float]:
    """The value range ``[low, high)`` of a histogram column (0 underflow, N_BINS - 1 overflow)."""
    low = 0.0 if column == 0 else float(HIST_EDGES[column - 1])
    high = float("inf") if column == N_BINS - 1 else float(HIST_EDGES[column])
    return low, high


def _range_text(first: int, last: int) -> str:
    low, high = column_range(first)[0], column_range(last)[1]
    return f"[{low:.3g}, {high:.3g})" if np.isfinite(high) else f"≥ {low:.3g}"


def histogram_svg(counts: np.ndarray, band_of: np.ndarray) -> str:
    """The bars of ``counts [N_BINS]`` (non-empty span only), shaded by ``band_of [N_BINS]`` (-1: none)."""
    nonzero = np.flatnonzero(counts)
    if not len(nonzero):
        return ""
    first, last = int(nonzero[0]), int(nonzero[-1])
    span = last - first + 1
    width, height = (WIDTH - LEFT - 4) / span, HEIGHT - BOTTOM - TOP
    peak = int(counts.max())
    parts = []
    for i, column in enumerate(range(first, last + 1)):
        h = height * counts[column] / peak
        x, shade = LEFT + i * width, BAND_SHADES[max(int(band_of[column]), 0) % len(BAND_SHADES)]
        tip = f"{_range_text(column, column)}: {int(counts[column])} tokens"
        parts.append(
            f'<rect x="{x:.1f}" y="{TOP + height - h:.1f}" width="{max(width - 1, 1):.1f}" height="{h:.1f}" '
            f'fill="{shade}"><title>{html.escape(tip)}</title></rect>'
        )
    axis_y = TOP + height
    step = 1 if span <= 8 else 4  # a tick at every edge of a narrow span, else at each decade
    for i, column in enumerate(range(first, last + 2)):
        if 1 <= column <= len(HIST_EDGES) and (column - 1) % step == 0:
            x = LEFT + i * width
            parts.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" stroke="#555"/>')
            parts.append(
                f'<text x="{x:.1f}" y="{axis_y + 15}" font-size="10" text-anchor="middle">'
                f"{HIST_EDGES[column - 1]:g}</text>"
            )
    parts.append(f'<line x1="{LEFT}" y1="{axis_y}" x2="{WIDTH - 4}" y2="{axis_y}" stroke="#555"/>')
    parts.append(f'<text x="{LEFT - 4}" y="{TOP + 8}" font-size="10" text-anchor="end">{peak}</text>')
    parts.append(f'<text x="{LEFT - 4}" y="{axis_y}" font-size="10" text-anchor="end">0</text>')
    parts.append(
        f'<text x="{(LEFT + WIDTH) / 2:.0f}" y="{HEIGHT - 4}" font-size="11" text-anchor="middle">'
        "activation value (log scale; under 1e-4 and from 1e4 on pooled at the ends)</text>"
    )
    parts.append(
        f'<text x="12" y="{TOP + height / 2:.0f}" font-size="11" text-anchor="middle" '
        f'transform="rotate(-90 12 {TOP + height / 2:.0f})">tokens</text>'
    )
    return (
        f'<svg class="histogram" role="img" aria-label="activation histogram" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}">{"".join(parts)}</svg>'
    )


def distribution_section(state: dict[str, Tensor], atom: int, card: Callable[[int, int], str]) -> str:
    """The histogram and one row of example cards per band; ``card(band, example)`` renders one example."""
    if "hist_counts" not in state:
        return ""
    counts = state["hist_counts"][atom].numpy()
    band_bins, band_count = state["band_bins"][atom].numpy(), state["band_count"][atom].numpy()
    band_of = np.full(N_BINS, -1, np.int64)
    for b, (first, last) in enumerate(band_bins.tolist()):
        if first >= 0:
            band_of[first : last + 1] = b
    total, negative = int(counts.sum()), int(state["hist_negative"][atom])
    note = f" ({negative} negative values not drawn)" if negative else ""
    rows, below = [], 0
    for b, (first, last) in enumerate(band_bins.tolist()):
        if first < 0:
            continue
        quantiles = f"{100 * below / max(total, 1):.0f}–{100 * (below + band_count[b]) / max(total, 1):.0f} %"
        below += int(band_count[b])
        cards = [card(b, e) for e in range(state["band_token"].shape[2]) if int(state["band_token"][atom, b, e]) >= 0]
        rows.append(
            f'<div class="band"><h3>Values {html.escape(_range_text(first, last))}: quantiles {quantiles} '
            f'<span class="muted">({int(band_count[b])} tokens)</span></h3>'
            f'<div class="grid">{"".join(cards)}</div></div>'
        )
    return (
        f'<section class="distribution"><h2>Activation distribution</h2>'
        f'<p class="muted">{total} positive values{note}, in bins of a quarter decade; the bands split them '
        "into quantile fifths by whole bins (shades), each shown by images drawn by a fixed hash, not the top.</p>"
        f"{histogram_svg(counts, band_of)}{''.join(rows)}</section>"
    )
