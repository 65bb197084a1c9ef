"""The index page, ``index.html``: every atom in one sortable, searchable table.

Its columns: frequency, mean value when active, maximum value, maximum cosine to another atom and
which, MP's mean selection step, in how many seeds it is found (``--replicas``), and the label statistics where the images carry labels
(:mod:`sae_pipeline.features.label_pages`); the rows are one JSON block that the shared script
(:mod:`sae_pipeline.features.assets`) renders, so the page stays small at any ``d_sae``. Above the
table, the images changed since extraction (not drawn) and the count of unchecked ones.
:mod:`sae_pipeline.features.site` builds the rows and writes the page.
"""

from __future__ import annotations

import html
import json
from typing import Any

import numpy as np
from torch import Tensor

from sae_pipeline.features import label_pages
from sae_pipeline.features.heatmaps import Layout
from sae_pipeline.features.images import ImageChangedError
from sae_pipeline.features.replicas import ReplicaMatch
from sae_pipeline.features.replicas import index_headers as replica_headers
from sae_pipeline.features.selectivity import LabelStats


def number(value: float) -> float | None:
    """A table cell: six significant digits, None (JSON null) where not finite."""
    return None if not np.isfinite(value) else float(f"{value:.6g}")


def image_checks_section(changed: dict[int, ImageChangedError], unchecked: int) -> str:
    """The index page's list of images changed since extraction, and the count of unchecked ones."""
    esc = html.escape
    parts = []
    if changed:
        items = "".join(
            f'<li>{esc(error.image_id)} <span class="muted">{esc(error.where)}</span></li>'
            for _, error in sorted(changed.items())
        )
        parts.append(
            f'<section class="changed"><h2>Images changed since extraction ({len(changed)}): not drawn</h2>'
            f'<p class="muted">Their bytes no longer match the hash recorded at extraction; restore them, '
            f"or re-extract and retrain.</p><ul>{items}</ul></section>"
        )
    if unchecked:
        parts.append(
            f'<p class="muted unchecked">{unchecked} images drawn unchecked: their shards predate content '
            "hashes (re-extract to check them).</p>"
        )
    return "".join(parts)


def index_page(
    sae: Any,
    datamodule: Any,
    state: dict[str, Tensor],
    data: dict,
    has_steps: bool,
    pixel_atoms: bool,
    layout: Layout,
    image_checks: str = "",
    image_pages: bool = False,
    labels: LabelStats | None = None,
    replicas: ReplicaMatch | None = None,
) -> str:
    """The index page: every atom's row of ``data`` (one JSON block the shared script renders)."""
    esc = html.escape
    n_fired = int((state["fire_count"] > 0).sum())
    headers = ['<th class="id" data-key="id">atom</th>']
    if pixel_atoms:
        headers.append("<th>atom image</th>")
    headers += [
        "<th>top image</th>",
        '<th data-key="frequency">frequency</th>',
        '<th data-key="mean_value">mean value when active</th>',
        '<th data-key="max_value">max value</th>',
        '<th data-key="max_cosine">max cosine (nearest)</th>',
    ]
    if has_steps:
        headers.append('<th data-key="mean_step">mean MP step</th>')
    headers += replica_headers(replicas)  # features --replicas, before the label columns (as the script draws)
    headers += label_pages.index_headers(labels)
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Feature browser: {esc(type(sae).__name__)} on {esc(str(datamodule.source))}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="assets/site.css"></head>
<body><header><h1>Feature browser</h1>{'<nav><a href="images/index.html">images</a></nav>' if image_pages else ""}<span>{esc(type(sae).__name__)}: d_in {sae.d_in}, d_sae {sae.d_sae}, k {sae.k}</span>
<span class="muted">{esc(str(datamodule.source))}: {int(state["n_tokens"])} tokens ({esc(layout.kind)}); top {state["value"].shape[1]} images per atom; {n_fired} atoms fired</span></header>
<div class="controls"><input id="search" type="search" placeholder="atom id" aria-label="search atom id">
<span id="count"></span><span class="muted">click a column to sort</span></div>
{image_checks}{label_pages.index_section(labels)}<table id="atoms"><thead><tr>{"".join(headers)}</tr></thead><tbody></tbody></table>
<script type="application/json" id="atom-data">{payload}</script>
<script src="assets/site.js"></script></body></html>
"""
