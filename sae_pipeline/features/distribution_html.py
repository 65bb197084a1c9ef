"""An atom page's activation distribution: the histogram as an inline SVG, and a row of example cards per band.

The bars are the columns of `sae_pipeline.features.distribution` between the first and the last
non-empty one, pooled into at most ``MAX_BARS`` bars, on a log-spaced value axis labelled in the
code's units at round values (decades, else 1-2-5, else every digit: two ticks at least, none
clipped at the edges); each bar's tooltip gives its value range and count, and its shade its
quantile band. Pages of an older
``features.npz`` (no ``hist_counts``) simply have no such section.
"""

from __future__ import annotations

import html
from collections.abc import Callable

import numpy as np
from torch import Tensor

from sae_pipeline.features.distribution import HIST_EDGES, N_BINS

WIDTH, HEIGHT, LEFT, RIGHT, BOTTOM, TOP = 560, 150, 46, 22, 34, 8
BAND_SHADES = ("#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c")
MAX_BARS = 48  # the fine columns are drawn pooled, aligned groups of 1, 2, 4, .. 32, into at most this many bars
NICE = ((1,), (1, 2, 5), tuple(range(1, 10)), tuple(np.arange(10, 100) / 10))  # tick mantissas, sparsest first


def column_range(column: int) -> tuple[float, float]:
    """The value range ``[low, high)`` of a histogram column (0 underflow, N_BINS - 1 overflow)."""
    low = 0.0 if column == 0 else float(HIST_EDGES[column - 1])
    high = float("inf") if column == N_BINS - 1 else float(HIST_EDGES[column])
    return low, high


def value_text(value: float) -> str:
    """A value to three significant digits in one short notation: ``0.002``, ``1.78``, ``10000``; ``1e-4``,
    ``3.16e-5``, ``2e5`` beyond (never ``%g``'s ``1e+04``)."""
    rounded = float(f"{value:.3g}")
    if rounded == 0 or 1e-3 <= abs(rounded) < 1e5:
        return np.format_float_positional(rounded, trim="-")
    exponent = int(np.floor(np.log10(abs(rounded))))
    return f"{float(f'{rounded / 10.0**exponent:.3g}'):g}e{exponent}"


def _range_text(first: int, last: int) -> str:
    low, high = column_range(first)[0], column_range(last)[1]
    return f"[{value_text(low)}, {value_text(high)})" if np.isfinite(high) else f"≥ {value_text(low)}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def display_bars(counts: np.ndarray, band_of: np.ndarray) -> list[tuple[int, int, int, int]]:
    """``(first column, last column, count, band)`` per drawn bar over the non-empty span: regular columns pooled in
    aligned groups (at most ``MAX_BARS`` bars), the underflow and overflow columns alone; a bar's band is the one
    holding most of its count."""
    nonzero = np.flatnonzero(counts)
    first, last = int(nonzero[0]), int(nonzero[-1])
    low, high = max(first, 1), min(last, N_BINS - 2)
    group = 1
    while high >= low and (high // group - low // group + 1) > MAX_BARS:
        group *= 2
    spans = [(0, 0)] if first == 0 else []
    if high >= low:
        starts = range((low - 1) // group * group + 1, high + 1, group)
        spans += [(max(start, low), min(start + group - 1, high)) for start in starts]
    if last == N_BINS - 1:
        spans.append((N_BINS - 1, N_BINS - 1))
    bars = []
    for a, b in spans:
        part = counts[a : b + 1]
        bands = band_of[a : b + 1]
        mass = {int(k): int(part[bands == k].sum()) for k in np.unique(bands[part > 0])} or {-1: 0}
        bars.append((a, b, int(part.sum()), max(mass, key=lambda k: (mass[k], -k))))
    return bars


def ticks(low: float, high: float) -> list[float]:
    """Round values in ``[low, high]`` to label a log axis: decades, else 1-2-5, else every digit, else every
    tenth (the first of these giving two ticks at least), else the two ends."""
    found: list[float] = []
    for mantissas in NICE:
        found = [
            float(f"{m * 10.0**e:.3g}")
            for e in range(int(np.floor(np.log10(low))) - 1, int(np.ceil(np.log10(high))) + 1)
            for m in mantissas
            if low * (1 - 1e-9) <= m * 10.0**e <= high * (1 + 1e-9)
        ]
        if len(found) >= 2:
            return found
    return [low, high]


def histogram_svg(counts: np.ndarray, band_of: np.ndarray) -> str:
    """The bars of ``counts [N_BINS]`` (non-empty span only), shaded by ``band_of [N_BINS]`` (-1: none)."""
    if not counts.any():
        return ""
    bars = display_bars(counts, band_of)
    width, height = (WIDTH - LEFT - RIGHT) / len(bars), HEIGHT - BOTTOM - TOP
    peak = max(count for _, _, count, _ in bars)
    parts = []
    for i, (a, b, count, band) in enumerate(bars):
        h = height * count / peak
        x, shade = LEFT + i * width, BAND_SHADES[max(band, 0) % len(BAND_SHADES)]
        tip = f"{_range_text(a, b)}: {_plural(count, 'token')}"
        parts.append(
            f'<rect x="{x:.1f}" y="{TOP + height - h:.1f}" width="{max(width - 1, 1):.1f}" height="{h:.1f}" '
            f'fill="{shade}"><title>{html.escape(tip)}</title></rect>'
        )
    axis_y = TOP + height
    regular = [i for i, (a, _, _, _) in enumerate(bars) if 0 < a < N_BINS - 1]
    if regular:  # a log axis over the regular bars: x of a value by interpolation in log10
        lo, hi = column_range(bars[regular[0]][0])[0], column_range(bars[regular[-1]][1])[1]
        x0, x1 = LEFT + regular[0] * width, LEFT + (regular[-1] + 1) * width
        for value in ticks(lo, hi):
            x = x0 + (np.log10(value) - np.log10(lo)) / (np.log10(hi) - np.log10(lo)) * (x1 - x0)
            anchor = "end" if x > WIDTH - RIGHT - 8 else "start" if x < LEFT + 8 else "middle"
            parts.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" stroke="#555"/>')
            parts.append(
                f'<text class="tick" x="{x:.1f}" y="{axis_y + 15}" font-size="10" text-anchor="{anchor}">'
                f"{value_text(value)}</text>"
            )
    parts.append(f'<line x1="{LEFT}" y1="{axis_y}" x2="{WIDTH - RIGHT}" y2="{axis_y}" stroke="#555"/>')
    parts.append(f'<text x="{LEFT - 4}" y="{TOP + 8}" font-size="10" text-anchor="end">{peak}</text>')
    parts.append(f'<text x="{LEFT - 4}" y="{axis_y}" font-size="10" text-anchor="end">0</text>')
    parts.append(
        f'<text x="{(LEFT + WIDTH - RIGHT) / 2:.0f}" y="{HEIGHT - 4}" font-size="11" text-anchor="middle">'
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
    note = f" ({_plural(negative, 'negative value')} not drawn)" if negative else ""
    rows, below = [], 0
    for b, (first, last) in enumerate(band_bins.tolist()):
        if first < 0:
            continue
        quantiles = f"{100 * below / max(total, 1):.0f}–{100 * (below + band_count[b]) / max(total, 1):.0f} %"
        below += int(band_count[b])
        cards = [card(b, e) for e in range(state["band_token"].shape[2]) if int(state["band_token"][atom, b, e]) >= 0]
        rows.append(
            f'<div class="band"><h3>Values {html.escape(_range_text(first, last))}: quantiles {quantiles} '
            f'<span class="muted">({_plural(int(band_count[b]), "token")})</span></h3>'
            f'<div class="grid">{"".join(cards)}</div></div>'
        )
    return (
        f'<section class="distribution"><h2>Activation distribution</h2>'
        f'<p class="muted">{_plural(total, "positive value")}{note}, in bins of a 32nd of a decade (drawn '
        "pooled); the bands split them into quantile fifths by whole bins (shades), each shown by images from a "
        "uniform sample of the atom's values (a fixed hash), not the top.</p>"
        f"{histogram_svg(counts, band_of)}{''.join(rows)}</section>"
    )
