"""The activation-weighted label statistics on the site, beside the counts' (`sae_pipeline.features.label_weights`).

Why a module of its own: the atom page's label section (`sae_pipeline.features.label_pages`) calls it for
the weighted lines and formulas, the index for its weighted ``S_w`` column; it imports nothing of
``label_pages`` (which imports it), so the two formatters below repeat that module's notation: three
decimals for a statistic, ``1.1e-4`` for a p-value.
"""

from __future__ import annotations

import html

import numpy as np

from sae_pipeline.features.chance import METHODS
from sae_pipeline.features.label_text import interval as _interval
from sae_pipeline.features.label_text import number as _number
from sae_pipeline.features.label_text import p_value as _p
from sae_pipeline.features.label_weights import FORMULA, WeightedStats

esc = html.escape
INDEX_COLUMNS = ["weighted_selectivity", "weighted_selectivity_low", "weighted_selectivity_high"]


def atom_lines(weighted: WeightedStats | None, atom: int, label_name: str, label_href: str) -> str:
    """The atom's weighted line and its line against chance (empty without activation sums); ``label_name``,
    ``label_href``: the weighted top label's name and page."""
    if weighted is None:
        return ""
    if weighted.top_label[atom] < 0:
        return '<p class="weighted muted">Weighted by activation: it never fired positively on a labelled image.</p>'
    low, high, q_low, q_high = (bound[atom] for bound in weighted.interval)
    line = (
        f'<p class="weighted">Weighted by activation: top label <b><a href="{esc(label_href)}">{esc(label_name)}</a>'
        f"</b>: q_w = {_number(weighted.top_share[atom])}{_interval(q_low, q_high)}; "
        f"S_w = {_number(weighted.selectivity[atom])}{_interval(low, high)}; "
        f"Σ a = {weighted.weight[atom].sum():.4g} over its labelled images (+{weighted.weight_unlabelled[atom]:.4g} "
        f"unlabelled), as many as n_eff = {weighted.n_eff[atom]:.1f} equal images</p>"
    )
    return line + chance_line(weighted, atom)


def chance_line(weighted: WeightedStats, atom: int) -> str:
    """The weighted ``S_w`` against ⌊n_eff⌋ random images, or that there are too few effective images to say."""
    n = int(np.floor(weighted.n_eff[atom] + 1e-9))
    if weighted.too_few[atom]:
        return (
            f'<p class="chance few">Weighted, too few effective images to say: ⌊n_eff⌋ = {n}, fewer than '
            f"{weighted.n_min}.</p>"
        )
    if not np.isfinite(weighted.p_adjusted[atom]):
        return ""
    beats = bool(weighted.beats[atom])
    said = "beats chance" if beats else "does not beat chance"
    method = METHODS[weighted.method[atom]] if weighted.method[atom] >= 0 else "–"
    return (
        f'<p class="chance {"beats" if beats else "null"}">Weighted against chance (approximate): {n} random '
        f"images would score E[S] = {_number(weighted.mean[atom])} ± {_number(weighted.sd[atom])}; excess S_w − E[S] "
        f"= {_number(weighted.excess[atom])}; p ≈ {_p(weighted.p[atom])} ({method}), Benjamini–Hochberg "
        f"{_p(weighted.p_adjusted[atom])}: <b>{said}</b> at FDR {weighted.fdr:g}.</p>"
    )


def formulas(weighted: WeightedStats | None) -> str:
    """The weighted formulas, for the label section (empty without activation sums)."""
    if weighted is None:
        return ""
    return f'<p class="muted formula">{esc(FORMULA)}</p><p class="muted formula">{esc(weighted.formula())}</p>'


def index_cells(weighted: WeightedStats | None, atom: int) -> list:
    """The index row's weighted cells: ``S_w`` and its interval (None where undefined)."""
    if weighted is None:
        return [None] * len(INDEX_COLUMNS)
    values = (weighted.selectivity[atom], weighted.interval[0][atom], weighted.interval[1][atom])
    return [float(f"{x:.4g}") if np.isfinite(x) else None for x in values]


def index_header(weighted: WeightedStats | None) -> list[str]:
    if weighted is None:
        return []
    return [
        '<th data-key="weighted_selectivity" title="S_w: selectivity weighted by each image\'s activation, and its '
        '95 % interval">weighted S</th>'
    ]


__all__ = ["INDEX_COLUMNS", "atom_lines", "chance_line", "formulas", "index_cells", "index_header"]
