"""The site writer: ``OUT/index.html``, ``OUT/atoms/<id>.html``, thumbnails, and the raw table.

Layout of ``OUT`` (everything relative, so the folder opens from disk, can be copied, and is
served as is by ``python -m http.server``):

- ``index.html``: every atom (frequency, mean value when active, maximum value, maximum
  cosine to another atom and which, MP's mean selection step), sortable by any column and
  searchable by id; its data is one JSON block the script renders;
- ``atoms/<id>.html``: the atom's top images with the activation heatmap over the patch grid
  (CLS and register tokens as separate chips), value, image id, label and token position;
  its nearest atoms by cosine, linked; the atom itself as an image for pixel data;
- ``images/<key>.html``: each shown image with the atoms that fire most on it
  (:mod:`sae_pipeline.features.image_pages`), linked from the atom pages' cards; ``images/index.html``;
- ``thumbs/``: one thumbnail per image, written once however many atoms show it;
  ``atoms/img/``: the atoms of pixel data as images; ``assets/``: the stylesheet and script;
- ``features.npz`` (the merged table and statistics, numeric arrays only: no pickle) and
  ``features.json`` (what was run; also how a rerun recognises a site it may replace);
- wherever the images carry labels, the label statistics of each atom on its page and on the
  index, and ``labels/<id>.html`` per label (:mod:`sae_pipeline.features.label_pages`).

The site is built in a staging folder beside ``OUT`` and swapped in whole at the end
(:mod:`sae_pipeline.features.site_dir`: the checks of ``--out``, the staging folder, the swap).

An image whose bytes changed since extraction (its content hash no longer matches, see
``images``) is not drawn: its cards say so, the index page lists it under "Images changed
since extraction", and ``features.json`` records it in ``images_changed``
(``images_unchecked`` counts the images of older shards, drawn without a hash to check).
"""

from __future__ import annotations

import base64
import html
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

import sae_pipeline
from sae_pipeline.features import label_pages
from sae_pipeline.features.assets import CSS, JS
from sae_pipeline.features.heatmaps import Layout
from sae_pipeline.features.image_pages import write_site_image_pages
from sae_pipeline.features.images import (
    ImageChangedError,
    SourceImages,
    atom_image,
    describe,
    pixels_image,
    save_thumbnail,
    view_transform,
)
from sae_pipeline.features.selectivity import LabelStats, label_stats
from sae_pipeline.features.site_dir import MARKER_FNAME, staged_site
from sae_pipeline.training.interrupts import raise_if_interrupted

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


def _number(value: float) -> float | None:
    return None if not np.isfinite(value) else float(f"{value:.6g}")


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


def build_site(
    out: Path,
    sae: Any,
    state: dict[str, Tensor],
    collection: dict[str, Any],
    layout: Layout,
    datamodule: Any,
    images_dpath: str | None = None,
    atoms: Sequence[int] | None = None,
    n_neighbours: int = 8,
) -> Path:
    """Write the whole site for a merged table (``state``) and its images (``collection``); returns ``out``."""
    start = time.perf_counter()
    out = Path(out)
    with staged_site(out) as staging:
        (staging / "atoms").mkdir(parents=True)
        (staging / "assets").mkdir()
        (staging / "assets" / "site.css").write_text(CSS)
        (staging / "assets" / "site.js").write_text(JS)
        thumbs, changed, unchecked = write_thumbnails(staging, collection, layout, datamodule, images_dpath)
        raise_if_interrupted()
        labels = label_stats(state, collection)
        width, with_page = len(str(sae.d_sae - 1)), set(atoms) if atoms else set(range(sae.d_sae))
        image_links = write_site_image_pages(
            staging,
            collection,
            layout,
            thumbs,
            lambda a: f"atoms/{atom_fname(a, width)}" if a in with_page else None,
            changed,
        )
        _write_pages(
            staging,
            sae,
            state,
            collection,
            layout,
            datamodule,
            thumbs,
            atoms,
            n_neighbours,
            changed,
            unchecked,
            image_links,
            labels,
        )
        arrays = {name: value.numpy() for name, value in state.items()}
        np.savez(staging / "features.npz", **arrays, **(labels.arrays() if labels else {}))
        summary = {
            "format": "sae_pipeline.features/1",
            "package_version": sae_pipeline.__version__,
            "sae_class": type(sae).__name__,
            "d_in": sae.d_in,
            "d_sae": sae.d_sae,
            "k": sae.k,
            "top": int(state["value"].shape[1]),
            "n_tokens": int(state["n_tokens"]),
            "data_source": str(datamodule.source),
            "layout": layout.kind,
            "n_images_shown": len(thumbs),
            "images_changed": [
                {"image_id": error.image_id, "where": error.where} for _, error in sorted(changed.items())
            ],
            "images_unchecked": unchecked,
            "labels": labels.summary() if labels else None,
            "build_seconds": round(time.perf_counter() - start, 3),
        }
        (staging / MARKER_FNAME).write_text(json.dumps(summary, indent=2) + "\n")
        raise_if_interrupted()
    return out


def write_thumbnails(
    root: Path, collection: dict[str, Any], layout: Layout, datamodule: Any, images_dpath: str | None
) -> tuple[dict[int, str], dict[int, ImageChangedError], int]:
    """One thumbnail per shown image (``thumbs/<key>.jpg|png``).

    Returns key -> relative path, key -> why for the images changed since extraction (not
    drawn), and how many images were drawn without a recorded hash to check.
    """
    paths: dict[int, str] = {}
    changed: dict[int, ImageChangedError] = {}
    if layout.kind == "tokens":
        return paths, changed, 0
    if layout.kind == "pixels":
        for key, meta in collection["images"].items():
            rel = f"thumbs/{key}.png"
            save_thumbnail(pixels_image(meta["pixels"], layout.image_shape, 0.0, 1.0), root / rel)
            paths[key] = rel
        return paths, changed, 0
    backbone = datamodule.manifest.get("backbone") or {}
    view = view_transform(backbone.get("preprocess"), int(backbone.get("image_size") or 224))
    images = SourceImages(images_dpath)
    for key, meta in sorted(collection["images"].items()):
        rel = f"thumbs/{key}.jpg"
        try:
            image = images.open(meta)
        except ImageChangedError as error:
            changed[key] = error
            continue
        save_thumbnail(view(image), root / rel)
        paths[key] = rel
    return paths, changed, images.unchecked


def _write_pages(
    root: Path,
    sae: Any,
    state: dict[str, Tensor],
    collection: dict[str, Any],
    layout: Layout,
    datamodule: Any,
    thumbs: dict[int, str],
    atoms: Sequence[int] | None,
    n_neighbours: int,
    changed: dict[int, ImageChangedError] | None = None,
    unchecked: int = 0,
    image_links: dict[int, str] | None = None,
    labels: LabelStats | None = None,
) -> None:
    changed, image_links = changed or {}, image_links or {}
    d_sae, n = state["value"].shape
    width = len(str(d_sae - 1))
    chosen = sorted(set(atoms)) if atoms else list(range(d_sae))
    with_page = set(chosen)
    fire = state["fire_count"].double().numpy()
    n_tokens = max(int(state["n_tokens"]), 1)
    frequency = fire / n_tokens
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_value = state["value_sum"].numpy() / fire
        mean_step = state["step_sum"].double().numpy() / state["step_count"].double().numpy()
    has_steps = bool(state["step_count"].sum() > 0)
    max_value = state["value"][:, 0].numpy()
    near_index, near_cos = nearest_atoms(sae.W_dec, max(n_neighbours, 1))
    heat_row = {(int(a), int(r)): i for i, (a, r) in enumerate(zip(collection["heat_atom"], collection["heat_rank"]))}
    pixel_atoms = layout.kind == "pixels"
    if pixel_atoms:
        (root / "atoms" / "img").mkdir()
        W = sae.W_dec.detach().float().numpy()
        for atom in chosen:
            atom_image(W[atom], layout.image_shape).save(root / "atoms" / "img" / f"{atom}.png")
    layout_json = json.dumps({"grid": list(layout.grid), "n_prefix": layout.n_prefix, "kind": layout.kind})
    for i, atom in enumerate(chosen):
        raise_if_interrupted()  # Ctrl-C / SIGTERM: a long loop on big dictionaries (sae_pipeline.training.interrupts)
        prev_atom, next_atom = chosen[i - 1] if i > 0 else None, chosen[i + 1] if i + 1 < len(chosen) else None
        page = _atom_page(
            atom,
            state,
            collection,
            layout,
            thumbs,
            heat_row,
            width,
            with_page,
            prev_atom,
            next_atom,
            frequency[atom],
            fire[atom],
            n_tokens,
            mean_value[atom],
            mean_step[atom] if has_steps else None,
            near_index[atom][:n_neighbours],
            near_cos[atom][:n_neighbours],
            pixel_atoms,
            layout_json,
            changed,
            image_links,
            label_pages.atom_section(labels, atom, n),
        )
        (root / "atoms" / atom_fname(atom, width)).write_text(page)
    rows = []
    for atom in chosen:
        top_key = int(state["image"][atom, 0])
        rows.append(
            [
                atom,
                f"atoms/{atom_fname(atom, width)}",
                thumbs.get(top_key) if top_key >= 0 else None,
                _number(frequency[atom]),
                _number(mean_value[atom]),
                _number(float(max_value[atom])),
                _number(float(near_cos[atom][0])) if near_cos.shape[1] else None,
                int(near_index[atom][0]) if near_index.shape[1] else None,
                _number(mean_step[atom]) if has_steps else None,
                *label_pages.index_columns(labels, atom),
            ]
        )
    data = {
        "columns": [
            "id",
            "page",
            "thumb",
            "frequency",
            "mean_value",
            "max_value",
            "max_cosine",
            "nearest",
            "mean_step",
            *label_pages.INDEX_COLUMNS,
        ],
        "rows": rows,
        "has_steps": has_steps,
        "atom_images": "atoms/img/" if pixel_atoms else None,
        "thumb_class": "pixels" if pixel_atoms else "",
        **label_pages.index_data(labels),
    }
    (root / "index.html").write_text(
        _index_page(
            sae,
            datamodule,
            state,
            data,
            has_steps,
            pixel_atoms,
            layout,
            _image_checks(changed, unchecked),
            bool(image_links),
            labels,
        )
    )
    href = {atom: atom_fname(atom, width) for atom in with_page}.get
    label_pages.write_label_pages(root, labels, state["image"].numpy(), thumbs, href, pixel_atoms)


def _image_checks(changed: dict[int, ImageChangedError], unchecked: int) -> str:
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


def _atom_page(
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
) -> str:
    esc = html.escape
    values, tokens = state["value"][atom].numpy(), state["token"][atom].numpy()
    images, positions = state["image"][atom].numpy(), state["position"][atom].numpy()
    filled = [r for r in range(len(tokens)) if tokens[r] >= 0]
    rows = [heat_row[(atom, r)] for r in filled if (atom, r) in heat_row]
    scale = float(values[0]) if filled else 1.0
    if rows:
        scale = max(scale, float(np.nanmax(collection["heat"][rows].astype(np.float32), initial=0.0)))
    cards = []
    for r in filled:
        key, position = int(images[r]), int(positions[r])
        meta = collection["images"].get(key, {})
        image_id, label = meta.get("image_id", str(key)), describe(meta)
        heat_attr = ""
        if (atom, r) in heat_row and key not in changed:
            heat = collection["heat"][heat_row[(atom, r)]].astype(np.float32)
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
            chips += [
                f'<span class="tok" data-i="{layout.n_cls + i}">R{i + 1}</span>' for i in range(layout.n_registers)
            ]
            prefix = f'<div class="prefix">{"".join(chips)}</div>'
        where = _token_label(position, layout) or (f"token {position}" if layout.kind == "tokens" else "")
        name = esc(image_id)
        if image_links and key in image_links:
            name = f'<a class="image" href="../{image_links[key]}">{name}</a>'
        caption = (
            f'<span class="value">{values[r]:.4g}</span> · #{r + 1}<br>{name}'
            + (f" · label <b>{esc(label)}</b>" if label else "")
            + (f"<br>{esc(where)}" if where else "")
        )
        cards.append(f'<figure class="card"{heat_attr}>{frame}{prefix}<figcaption>{caption}</figcaption></figure>')
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
<script type="application/json" id="layout">{layout_json}</script>
<script src="../assets/site.js"></script></body></html>
"""


def _index_page(
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
) -> str:
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
