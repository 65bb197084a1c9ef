"""The colour of each label, the same on every page of the site (bars, the index scatter and its legend).

Why a fixed colour per label id rather than per rank within an atom: a reader compares atoms by
colour, so a label must keep its colour from page to page, and no two labels may share one.
"""

from __future__ import annotations

import colorsys
import functools

# Tableau 20: one colour per label wherever it appears (bars, legends, the index scatter), none shared up to 20 labels
PALETTE = (
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
    "#a0cbe8", "#ffbe7d", "#ff9d9a", "#86bcb6", "#8cd17d", "#f1ce63", "#d4a6c8", "#fabfd2", "#d7b5a6", "#79706e",
)  # fmt: skip
OTHER = "#c9ccd1"


@functools.lru_cache(maxsize=8)
def label_colours(n_labels: int) -> tuple[str, ...]:
    """The colour of each label column: the palette up to 20 labels, beyond it distinct hues (golden-angle steps,
    three lightnesses), so that no two labels share a colour on any page."""
    if n_labels <= len(PALETTE):
        return PALETTE[:n_labels]
    colours: dict[str, None] = {}
    for i in range(n_labels):
        hue, light = (i * 137.508) % 360, (40, 55, 70)[i % 3]
        colour = _hsl_hex(hue, 65, light)
        while colour in colours:  # two hues that round to one 24-bit colour: nudge the lightness
            light += 0.4
            colour = _hsl_hex(hue, 65, light)
        colours[colour] = None
    return tuple(colours)


def _hsl_hex(hue: float, saturation: float, light: float) -> str:
    r, g, b = colorsys.hls_to_rgb(hue / 360, light / 100, saturation / 100)
    return "#" + "".join(f"{round(v * 255):02x}" for v in (r, g, b))


__all__ = ["OTHER", "PALETTE", "label_colours"]
