"""The label parts of the site: a label section on every atom page and on the index, and one page per label.

- atom page: the atom's top label, its prior-corrected share and selectivity
  (:mod:`sae_pipeline.features.selectivity`, formula on the page), and an inline SVG bar of label
  shares for the images it fires on, its top-N images and all images (the prior), side by side;
- atom page and label pages: the atom against chance (`sae_pipeline.features.chance`): the ``S`` of
  as many random images, the excess over it, the p-value of ``S`` and whether it beats chance, and
  95 % posterior intervals for ``S`` and ``q[top]`` (`sae_pipeline.features.label_intervals`);
- atom page and index: the same weighted by activation beside them, a bar of its shares and its
  lines (`sae_pipeline.features.label_weight_pages`), and a weighted ``S_w`` column;
- index: selectivity, excess over chance, adjusted p-value and top-label columns (sortable; sorted
  by the excess at first), atoms that do not beat chance marked and those with too few images to say
  greyed, a top-label filter, links to every label page and a scatter of ``S`` against the labelled
  images ``n`` with the curve ``E[S | n]``, drawn by ``assets/labels.js`` on a canvas (no CDN);
- ``labels/<id>.html``: the atoms that match the label best (by F1 of precision and recall, see
  :mod:`sae_pipeline.features.selectivity`), each with its label bar and top images, the images of
  this label outlined.

Unlabelled data (an ``.h5`` cache, a flat image folder): the pages say so and nothing else changes.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path

import numpy as np

from sae_pipeline.features import label_weight_pages
from sae_pipeline.features.chance import METHODS
from sae_pipeline.features.label_assets import LABELS_CSS, LABELS_JS
from sae_pipeline.features.label_colours import OTHER, PALETTE, label_colours
from sae_pipeline.features.label_intervals import POSTERIOR_DRAWS
from sae_pipeline.features.label_text import interval as _interval
from sae_pipeline.features.label_text import number as _number
from sae_pipeline.features.label_text import p_value as _p
from sae_pipeline.features.selectivity import FORMULA, LabelStats

SHOWN = 9  # labels drawn in colour in one bar; the atom's other labels are one grey "other"
NO_LABELS = "The images carry no labels: no label statistics."
esc = html.escape


def label_fname(label: int) -> str:
    return f"{label}.html"


def _pct(x: float) -> str:
    return f"{x * 100:.3g} %"


VERDICT_FEW, VERDICT_CHANCE, VERDICT_BEATS = 0, 1, 2


def verdict(stats: LabelStats, atom: int) -> int | None:
    """2: beats chance at the FDR; 1: tested, does not; 0: too few images to say; None: no label statistics."""
    chance = stats.chance
    if chance.beats[atom]:
        return VERDICT_BEATS
    if np.isfinite(chance.p_adjusted[atom]):
        return VERDICT_CHANCE
    return VERDICT_FEW if chance.too_few[atom] else None


def chance_line(stats: LabelStats, atom: int) -> str:
    """The atom against as many random images (``<p>``), or that it has too few images to say."""
    chance, n = stats.chance, int(stats.fire[atom].sum())
    kind = verdict(stats, atom)
    if kind is None:
        return ""
    if kind == VERDICT_FEW and chance.n_min is None:
        return f'<p class="chance few">Too few images to say: {esc(str(chance.unreachable()))}.</p>'
    if kind == VERDICT_FEW:
        return (
            f'<p class="chance few">Too few images to say: it fires on {n} labelled images, fewer than n_min = '
            f"{chance.n_min}, the fewest that, all of one label, could beat chance at FDR {chance.fdr:g}.</p>"
        )
    said = (
        f"<b>beats chance</b> at FDR {chance.fdr:g}"
        if kind == VERDICT_BEATS
        else f"<b>does not beat chance</b> at FDR {chance.fdr:g}"
    )
    exact = n in chance.exact_n or n == 1
    spread = "exact, over every label composition" if exact else f"SD over {chance.draws} draws"
    method = METHODS[chance.method[atom]] if chance.method[atom] >= 0 else "–"
    return (
        f'<p class="chance {"beats" if kind == VERDICT_BEATS else "null"}">Against chance: {n} random labelled '
        f"images would score E[S] = {_number(chance.mean[atom])} ± {_number(chance.sd[atom])} ({spread}); "
        f"excess S − E[S] = {_number(chance.excess[atom])}; p = P(S_null ≥ S) = {_p(chance.p[atom])} ({method}), "
        f"Benjamini–Hochberg {_p(chance.p_adjusted[atom])}: {said}.</p>"
    )


def _amount(value: float) -> str:
    """A bar segment's size: a count as it is, an activation sum to four digits."""
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def share_bars(stats: LabelStats, rows: list[tuple[str, np.ndarray]], order: np.ndarray) -> str:
    """Stacked bars (one per ``(caption, counts [L])``): the first ``SHOWN`` labels of ``order`` each in its own
    colour (`label_colours`: the same on every page), the rest grey."""
    palette = label_colours(len(stats.labels))
    colours = {int(c): palette[int(c)] for c in order[:SHOWN]}
    parts = []
    for caption, counts in rows:
        total = counts.sum()
        rects, x = [], 0.0
        if total > 0:
            for column in [*colours, -1]:
                if column >= 0:
                    value, name, colour = counts[column], stats.names[column], colours[column]
                else:
                    value = total - sum(counts[c] for c in colours)
                    name, colour = "other labels", OTHER
                if value <= 0:
                    continue
                width = 100.0 * value / total
                rects.append(
                    f'<rect x="{x:.3f}" width="{width:.3f}" height="10" fill="{colour}">'
                    f"<title>{esc(name)}: {_pct(value / total)} ({_amount(value)})</title></rect>"
                )
                x += width
        svg = (
            f'<svg class="lbar" viewBox="0 0 100 10" preserveAspectRatio="none" role="img" '
            f'aria-label="{esc(caption)}">{"".join(rects)}</svg>'
        )
        parts.append(f'<div class="lbar-row"><span class="muted">{esc(caption)}</span>{svg}</div>')
    legend = (
        "".join(f'<span><i style="background:{colours[c]}"></i>{esc(stats.names[c])}</span>' for c in colours)
        + f'<span><i style="background:{OTHER}"></i>other</span>'
    )
    return f'<div class="lbars">{"".join(parts)}<div class="legend-labels">{legend}</div></div>'


def atom_bars(stats: LabelStats, atom: int, n_top: int, prefix: str) -> tuple[str, str]:
    """The atom's summary line and its bars (``prefix``: the way from the page to the site root)."""
    q = stats.q(atom)
    order = np.argsort(-q, kind="stable")
    order = order[q[order] > 0]
    fire, top, weighted = stats.fire[atom], stats.top_counts(atom), stats.weighted
    rows = [
        (f"images it fires on ({int(fire.sum())})", fire),
        (f"its top {n_top} images ({int(top.sum())} labelled)", top),
        (f"all images, the prior ({int(stats.images.sum())})", stats.images),
    ]
    if weighted is not None:  # the same images, each by its activation
        rows.insert(1, (f"weighted by activation (Σ a = {weighted.weight[atom].sum():.4g})", weighted.weight[atom]))
    bars = share_bars(stats, rows, order)
    label = int(stats.top_label[atom])
    if label < 0:
        return '<p class="muted">It never fired on a labelled image.</p>', bars
    name = f'<a href="{prefix}labels/{label_fname(label)}">{esc(stats.name(label))}</a>'
    column = stats.column(label)
    tied = [int(c) for c in np.flatnonzero(q == q[column]) if c != column]
    if tied:
        names = ", ".join(
            f'<a href="{prefix}labels/{label_fname(int(stats.labels[c]))}">{esc(stats.names[c])}</a>' for c in tied
        )
        name += f' <span class="tie">(tied with {names}: equal c / m; the lowest label id is shown)</span>'
    line = (
        f"top label <b>{name}</b>: prior-corrected share q = {_number(stats.top_share[atom])}"
        f"{_interval(stats.interval[2][atom], stats.interval[3][atom])} "
        f"(1/L = {1 / len(stats.labels):.3g}); fires on {int(fire[column])} of its {int(stats.images[column])} "
        f"images; selectivity S = {_number(stats.selectivity[atom])}"
        f"{_interval(stats.interval[0][atom], stats.interval[1][atom])}; "
        f"fires on {int(fire.sum())} labelled images (+{int(stats.fire_unlabelled[atom])} unlabelled)"
    )
    return f"<p>{line}</p>{chance_line(stats, atom)}", bars


def atom_section(stats: LabelStats | None, atom: int, n_top: int) -> str:
    """The label section of ``atoms/<id>.html``."""
    if stats is None:
        return f'<section class="labels"><h2>Labels</h2><p class="muted no-labels">{NO_LABELS}</p></section>'
    line, bars = atom_bars(stats, atom, n_top, "../")
    weighted = stats.weighted
    label_w = int(weighted.top_label[atom]) if weighted is not None else -1
    weighted_line = label_weight_pages.atom_lines(
        weighted, atom, stats.name(label_w), f"../labels/{label_fname(label_w)}"
    )
    return (
        '<link rel="stylesheet" href="../assets/labels.css">'
        f'<section class="labels"><h2>Labels</h2>{line}{weighted_line}{bars}<p class="muted formula">{esc(FORMULA)}</p>'
        f'<p class="muted formula">{esc(stats.chance.formula())}</p>'
        f'<p class="muted formula">{esc(INTERVAL)}</p>{label_weight_pages.formulas(weighted)}</section>'
    )


def _cell(x: float, digits: int = 4) -> float | None:
    return float(f"{x:.{digits}g}") if np.isfinite(x) else None


def index_columns(stats: LabelStats | None, atom: int) -> list:
    """The index row's label cells: selectivity, top label id, its share, the excess over chance, the adjusted
    p-value and the verdict (`verdict`; None where undefined)."""
    if stats is None:
        return [None] * len(INDEX_COLUMNS)
    label = int(stats.top_label[atom])
    return [
        _cell(stats.selectivity[atom]),
        label if label >= 0 else None,
        _cell(stats.top_share[atom]),
        _cell(stats.chance.excess[atom]),
        _cell(stats.chance.p_adjusted[atom], 3),
        verdict(stats, atom),
        ties(stats, atom),
        *(_cell(bound[atom], 3) for bound in stats.interval),
        int(stats.fire[atom].sum()),
        *label_weight_pages.index_cells(stats.weighted, atom),
    ]


def ties(stats: LabelStats, atom: int) -> int:
    """How many other labels share the top label's ``q`` (0: a single top label)."""
    q = stats.q(atom)
    return int((q == q.max()).sum() - 1) if q.max() > 0 else 0


INDEX_COLUMNS = [
    "selectivity",
    "top_label",
    "top_share",
    "excess",
    "p_adjusted",
    "verdict",
    "top_ties",
    "selectivity_low",
    "selectivity_high",
    "top_share_low",
    "top_share_high",
    "n_labelled",
    *label_weight_pages.INDEX_COLUMNS,
]
INTERVAL = (
    f"95 % intervals: the 2.5th–97.5th percentiles of S and q[top] over {POSTERIOR_DRAWS} draws of the atom's "
    "label shares from their Dirichlet posterior, Dirichlet(c + p) (a prior worth one image, spread by the label "
    "prior p)"
)


def index_headers(stats: LabelStats | None) -> list[str]:
    if stats is None:
        return []
    return [
        '<th data-key="selectivity" title="S and its 95 % posterior interval">selectivity</th>',
        '<th data-key="excess" title="S − E[S | n]: above an atom firing on as many random images">excess over '
        "chance</th>",
        '<th data-key="p_adjusted" title="P(S_null ≥ S), Benjamini–Hochberg over the atoms">p (BH)</th>',
        '<th data-key="top_share">top label (q)</th>',
        *label_weight_pages.index_header(stats.weighted),
    ]


def index_section(stats: LabelStats | None) -> str:
    """Above the index table: the labels, the filter, the scatter, the formula (or that there are no labels)."""
    if stats is None:
        return f'<p class="muted no-labels">{NO_LABELS}</p>'
    options = "".join(
        f'<option value="{int(label)}">{esc(name)}</option>' for label, name in zip(stats.labels, stats.names)
    )
    links = " · ".join(
        f'<a href="labels/{label_fname(int(label))}">{esc(name)}</a>' for label, name in zip(stats.labels, stats.names)
    )
    n_labelled = int(stats.images.sum())
    return (
        '<link rel="stylesheet" href="assets/labels.css">'
        f'<section class="labels"><h2>Labels</h2><p>{len(stats.labels)} labels over {n_labelled} images'
        f" ({stats.n_unlabelled} unlabelled). Label pages: {links}</p>"
        f'<p class="muted formula">{esc(FORMULA)}</p>{chance_summary(stats)}'
        f'<p class="muted formula">{esc(stats.chance.formula())}</p>'
        '<figure class="scatter"><canvas id="scatter" width="720" height="300"></canvas>'
        '<figcaption class="muted">selectivity S against the labelled images n it fires on (log scale), one dot '
        "per atom, coloured by top label; the grey curve is E[S | n], what n random images score (the excess is "
        f"the height above it); click a dot for its page</figcaption>{scatter_legend(stats)}</figure>"
        f'<div class="controls"><label>top label <select id="label-filter"><option value="">any</option>{options}'
        "</select></label></div></section>"
        '<script src="assets/labels.js"></script>'
    )


def scatter_legend(stats: LabelStats) -> str:
    """The scatter's legend: every label's colour (the same as in every bar), up to the palette's 20 labels."""
    colours = label_colours(len(stats.labels))
    if len(stats.labels) > len(PALETTE):
        return (
            f'<p class="muted legend-note">{len(stats.labels)} labels, each its own hue (the colour of its bars); '
            "filter by top label to pick one out</p>"
        )
    items = "".join(
        f'<span><i style="background:{colour}"></i>{esc(name)}</span>' for colour, name in zip(colours, stats.names)
    )
    return f'<div class="legend-labels scatter-legend">{items}<span><i style="background:#888"></i>none</span></div>'


def chance_summary(stats: LabelStats) -> str:
    """How many atoms beat chance, how many could be tested, how many have too few images."""
    summary = stats.chance.summary()
    if summary["unreachable"]:
        greyed = f"; the {summary['too_few']} atoms that fire on them are greyed" if summary["too_few"] else ""
        return f'<p class="chance-summary">{esc(summary["unreachable"])}{greyed}. Sorted by the excess over chance.</p>'
    return (
        f'<p class="chance-summary">{summary["beat_chance"]} of {summary["tested"]} atoms tested beat chance at '
        f"FDR {summary['fdr']:g} (Benjamini–Hochberg; the others are marked “chance”); {summary['too_few']} fire "
        f"on fewer than n_min = {summary['min_images']} labelled images: too few to say (greyed). Sorted by the "
        "excess over chance.</p>"
    )


def index_data(stats: LabelStats | None) -> dict:
    """What the index's JSON adds for ``assets/labels.js`` (and the first sort: by the excess over chance)."""
    if stats is None:
        return {"labels": None}
    colours = label_colours(len(stats.labels))
    return {
        "labels": {str(int(label)): name for label, name in zip(stats.labels, stats.names)},
        "colours": {str(int(label)): colour for label, colour in zip(stats.labels, colours)},
        "sort": "excess",
        "weighted": stats.weighted is not None,
        "chance_curve": chance_curve(stats),
    }


def chance_curve(stats: LabelStats, points: int = 200) -> list[list[float]]:
    """``[n, E[S | n]]`` at up to ``points`` log-spaced ``n`` (every ``n`` up to the largest atom's), for the
    scatter's curve."""
    by_n = stats.chance.by_n_mean
    if len(by_n) < 2:
        return []
    sizes = np.unique(np.geomspace(1, len(by_n) - 1, points).round().astype(np.int64))
    return [[int(n), round(float(by_n[n]), 4)] for n in sizes if np.isfinite(by_n[n])]


def write_label_pages(
    root: Path,
    stats: LabelStats | None,
    top_image: np.ndarray,
    thumbs: dict[int, str],
    atom_href: Callable[[int], str | None],
    pixel_atoms: bool,
) -> None:
    """``labels/<id>.html`` per label, and ``assets/labels.css|js`` (``top_image [d_sae, N]``: image keys)."""
    (root / "assets" / "labels.css").write_text(LABELS_CSS)
    (root / "assets" / "labels.js").write_text(LABELS_JS)
    if stats is None:
        return
    (root / "labels").mkdir()
    n_top = top_image.shape[1]
    thumb_class = "t pixels" if pixel_atoms else "t"
    for i, label in enumerate(stats.labels.tolist()):
        prev_label, next_label = (
            stats.labels[i - 1] if i else None,
            stats.labels[i + 1] if i + 1 < len(stats.labels) else None,
        )
        nav = ['<a href="../index.html">index</a>']
        if prev_label is not None:
            nav.append(
                f'<a class="prev" href="{label_fname(int(prev_label))}">← {esc(stats.name(int(prev_label)))}</a>'
            )
        if next_label is not None:
            nav.append(
                f'<a class="next" href="{label_fname(int(next_label))}">{esc(stats.name(int(next_label)))} →</a>'
            )
        atoms = []
        for atom in stats.per_label[label]:
            q, f1 = stats.q(atom)[i], stats.f1(atom, i)
            href = atom_href(atom)
            title = f'<a href="../atoms/{href}">#{atom}</a>' if href else f"#{atom}"
            line, bars = atom_bars(stats, atom, n_top, "../")
            images = []
            for r, key in enumerate(top_image[atom].tolist()):
                if key < 0 or key not in thumbs:
                    continue
                mine = " mine" if stats.top_images[atom, r] == label else ""
                images.append(f'<img class="{thumb_class}{mine}" alt="" src="../{thumbs[key]}">')
            atoms.append(
                f'<article class="label-atom"><h3>{title} <span class="muted">F1 = {f1:.3f} · q = {q:.3f} · '
                f"fires on {int(stats.fire[atom, i])} of {int(stats.images[i])} images of this label "
                f"(precision {stats.fire[atom, i] / max(stats.fire[atom].sum(), 1):.3f})</span></h3>"
                f'{line}{bars}<div class="thumbs">{"".join(images)}</div></article>'
            )
        empty = "" if atoms else '<p class="muted">No atom fires on images of this label.</p>'
        page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Label {esc(stats.name(label))}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="../assets/site.css"><link rel="stylesheet" href="../assets/labels.css"></head>
<body><header><h1>Label {esc(stats.name(label))}</h1><nav>{" ".join(nav)}</nav>
<span class="muted">id {label}; {int(stats.images[i])} images, prior {_pct(stats.prior[i])}</span></header>
<section class="labels"><h2>The atoms that match it best</h2><p class="muted">Ranked by F1 = 2 c / (n + m), with c the
images of this label the atom fires on, n all labelled images it fires on and m this label's images: the harmonic
mean of precision c / n and recall c / m (then by q). Top images of this label are outlined.</p>
<p class="muted formula">{esc(FORMULA)}</p>{empty}{"".join(atoms)}</section></body></html>
"""
        (root / "labels" / label_fname(label)).write_text(page)
