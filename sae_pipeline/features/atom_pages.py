"""The atom pages, ``atoms/<id>.html``: an atom's statistics, nearest atoms and top images.

Each top image is a card: the thumbnail with the atom's heatmap over the patch grid (the levels
of :func:`_levels`, drawn by the shared script of :mod:`sae_pipeline.features.assets`; CLS and
register tokens as separate chips), the value, the image id (linked to its image page), label and
token position. Pages of pixel data show the atom itself as an image. The nearest atoms by cosine
(:func:`nearest_atoms`, computed blockwise so a large dictionary never holds ``d_sae x d_sae``)
link to their pages. :mod:`sae_pipeline.features.site` writes them.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from sae_pipeline.features.distribution_html import distribution_section
from sae_pipeline.features.heatmaps import Layout
from sae_pipeline.features.images import ImageChangedError, describe

LEVEL_MAX, NOT_STORED = 250, 255
COSINE_BLOCK = 2048


def nearest_atoms(W_dec: Tensor, m: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indices [d_sae, m], cosines [d_sae, m])`` of each atom's most similar other atoms, blockwise."""
    W = torch.nn.functional.normalize(W_dec.detach().float(), dim=1)
    d_sae = W.shape[0]
    m = min(m, d_sae - 1)
    indices = np.zeros((d_sae, max(m, 0)), np.int64)
    cosines = np.zeros((d_sae, max(m, 0)), np.float32)
    if m <= 0:
        return indices, cosines
    for start in range(0, d_sae, COSINE_BLOCK):
        sims = W[start : start + COSINE_BLOCK] @ W.T
        rows = torch.arange(sims.shape[0])
        sims[rows, rows + start] = -torch.inf
        values, index = sims.topk(m, dim=1)
        indices[start : start + len(rows)], cosines[start : start + len(rows)] = index.numpy(), values.numpy()
    return indices, cosines


def atom_fname(atom: int, width: int) -> str:
    return f"{atom:0{width}d}.html"


def _levels(heat: np.ndarray, scale: float) -> str:
    """A heatmap row as base64 of uint8 levels (0..250 of ``scale``, 255 where no token was stored)."""
    levels = np.full(heat.shape, NOT_STORED, np.uint8)
    stored = np.isfinite(heat)
    levels[stored] = np.round(np.clip(heat[stored] / max(scale, 1e-12), 0, 1) * LEVEL_MAX).astype(np.uint8)
    return base64.b64encode(levels.tobytes()).decode("ascii")


def _token_label(position: int, layout: Layout) -> str:
    if layout.kind != "patches":
        return ""
    if position < layout.n_cls:
        return "CLS token"
    if position < layout.n_prefix:
        return f"register {position - layout.n_cls + 1}"
    row, col = divmod(position - layout.n_prefix, layout.grid[1])
    return f"patch ({row}, {col})"


def _card(
    atom: int,
    slot: int,
    key: int,
    value: float,
    position: int,
    rank_text: str,
    collection: dict[str, Any],
    layout: Layout,
    thumbs: dict[int, str],
    heat_row: dict,
    scale: float,
    changed: dict[int, ImageChangedError],
    image_links: dict[int, str] | None,
    pixel_atoms: bool,
) -> str:
    """One example image as a card: thumbnail, heatmap of ``(atom, slot)`` when stored, value and caption."""
    esc = html.escape
    meta = collection["images"].get(key, {})
    image_id, label = meta.get("image_id", str(key)), describe(meta)
    heat_attr = ""
    if (atom, slot) in heat_row and key not in changed:
        heat = collection["heat"][heat_row[(atom, slot)]].astype(np.float32)
        heat_attr = f' data-heat="{_levels(heat, scale)}" data-top="{position}"'
    frame = ""
    if key in thumbs:
        cls = ' class="pixels"' if pixel_atoms else ""
        canvas = '<canvas class="heat"></canvas>' if layout.kind == "patches" else ""
        frame = f'<div class="frame"><img{cls} alt="{esc(image_id)}" src="../{thumbs[key]}">{canvas}</div>'
    elif key in changed:
        frame = '<div class="frame changed"><p class="muted">changed since extraction: not drawn</p></div>'
    prefix = ""
    if layout.kind == "patches" and layout.n_prefix:
        chips = ['<span class="tok" data-i="0">CLS</span>'] if layout.n_cls else []
        chips += [f'<span class="tok" data-i="{layout.n_cls + i}">R{i + 1}</span>' for i in range(layout.n_registers)]
        prefix = f'<div class="prefix">{"".join(chips)}</div>'
    where = _token_label(position, layout) or (f"token {position}" if layout.kind == "tokens" else "")
    name = esc(image_id)
    if image_links and key in image_links:
        name = f'<a class="image" href="../{image_links[key]}">{name}</a>'
    caption = (
        f'<span class="value">{value:.4g}</span> · {rank_text}<br>{name}'
        + (f" · label <b>{esc(label)}</b>" if label else "")
        + (f"<br>{esc(where)}" if where else "")
    )
    return f'<figure class="card"{heat_attr}>{frame}{prefix}<figcaption>{caption}</figcaption></figure>'


def atom_page(
    atom: int,
    state: dict[str, Tensor],
    collection: dict[str, Any],
    layout: Layout,
    thumbs: dict[int, str],
    heat_row: dict,
    width: int,
    with_page: set,
    prev_atom: int | None,
    next_atom: int | None,
    frequency: float,
    fire: float,
    n_tokens: int,
    mean_value: float,
    mean_step: float | None,
    near_index: np.ndarray,
    near_cos: np.ndarray,
    pixel_atoms: bool,
    layout_json: str,
    changed: dict[int, ImageChangedError],
    image_links: dict[int, str] | None = None,
    label_html: str = "",
    intervene_html: str = "",
    extra_stats: Sequence[tuple[str, str, str]] = (),
) -> str:
    """An atom's page: its statistics, label section, nearest atoms and top images with their heatmaps."""
    esc = html.escape
    values, tokens = state["value"][atom].numpy(), state["token"][atom].numpy()
    images, positions = state["image"][atom].numpy(), state["position"][atom].numpy()
    filled = [r for r in range(len(tokens)) if tokens[r] >= 0]
    rows = [heat_row[(atom, r)] for r in filled if (atom, r) in heat_row]
    scale = float(values[0]) if filled else 1.0
    if rows:
        scale = max(scale, float(np.nanmax(collection["heat"][rows].astype(np.float32), initial=0.0)))

    def card(slot: int, key: int, value: float, position: int, rank_text: str) -> str:
        return _card(
            atom,
            slot,
            key,
            value,
            position,
            rank_text,
            collection,
            layout,
            thumbs,
            heat_row,
            scale,
            changed,
            image_links,
            pixel_atoms,
        )

    cards = [card(r, int(images[r]), values[r], int(positions[r]), f"#{r + 1}") for r in filled]
    n_top = len(tokens)

    def band_card(band: int, example: int) -> str:
        slot = n_top + band * state["band_token"].shape[2] + example
        at = (atom, band, example)
        value, position = float(state["band_value"][at]), int(state["band_position"][at])
        return card(slot, int(state["band_image"][at]), value, position, "band example")

    distribution_html = distribution_section(state, atom, band_card)
    links = []
    for j, c in zip(near_index.tolist(), near_cos.tolist()):
        name = f'<a href="{atom_fname(j, width)}">#{j}</a>' if j in with_page else f"#{j}"
        links.append(f'<li>{name} <span class="muted">{c:.3f}</span></li>')
    nav = ['<a href="../index.html">index</a>']
    if prev_atom is not None:
        nav.append(f'<a class="prev" href="{atom_fname(prev_atom, width)}">← #{prev_atom}</a>')
    if next_atom is not None:
        nav.append(f'<a class="next" href="{atom_fname(next_atom, width)}">#{next_atom} →</a>')
    stats = [
        ("frequency", f"{frequency * 100:.3g} %", f"{int(fire)} of {n_tokens} tokens"),
        ("mean value when active", "–" if not np.isfinite(mean_value) else f"{mean_value:.4g}", ""),
        ("max value", f"{values[0]:.4g}" if filled else "–", ""),
    ]
    if mean_step is not None:
        stats.append(
            ("mean MP selection step", "–" if not np.isfinite(mean_step) else f"{mean_step:.2f}", "1 = picked first")
        )
    if len(near_cos):
        stats.append(("max cosine", f"{near_cos[0]:.3f}", f"with #{int(near_index[0])}"))
    stats += extra_stats  # features --replicas: found in j of N seeds
    stat_html = "".join(
        f'<div><span class="muted">{esc(a)}</span><b>{esc(b)}</b><span class="muted">{esc(c)}</span></div>'
        for a, b, c in stats
    )
    atom_img = (
        (
            f'<section class="atom-image"><h2>The atom</h2><img class="pixels" alt="atom {atom}" '
            f'src="img/{atom}.png"></section>'
        )
        if pixel_atoms
        else ""
    )
    toggle = (
        (
            '<label><input type="checkbox" id="show-heat" checked> heatmaps</label> '
            '<span class="legend"></span> <span class="muted">0 → max value; dark: token not stored</span>'
        )
        if layout.kind == "patches"
        else ""
    )
    empty = "" if cards else '<p class="muted">This atom never fired on the data (a dead atom).</p>'
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Atom {atom}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="../assets/site.css"></head>
<body><header><h1>Atom #{atom}</h1><nav>{" ".join(nav)}</nav>{toggle}</header>
<section class="stats">{stat_html}</section>
{label_html}<div class="row">{atom_img}<section class="nearest"><h2>Nearest atoms (cosine)</h2><ol>{"".join(links)}</ol></section></div>
<section class="top"><h2>Top {len(filled)} images</h2>{empty}<div class="grid">{"".join(cards)}</div></section>
{intervene_html}{distribution_html}
<script type="application/json" id="layout">{layout_json}</script>
<script src="../assets/site.js"></script></body></html>
"""
