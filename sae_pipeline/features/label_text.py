"""How the label statistics write their numbers on the pages: one notation for every figure, p-value and interval,
so that the atom page's count line, its weighted line and the index read alike."""

from __future__ import annotations

import numpy as np


def number(x: float) -> str:
    return "–" if not np.isfinite(x) else f"{x:.3f}"


def p_value(x: float) -> str:
    """A p-value, always in one notation (as the index's p column writes it): ``1.1e-4``, ``1.0e0``."""
    if not np.isfinite(x):
        return "–"
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def interval(low: float, high: float) -> str:
    return "" if not np.isfinite(low) else f" (95 % interval {low:.3f}–{high:.3f})"
