"""The image view: per image, the atoms that fire most on it, each with its heatmap over this image.

An image's top atoms (:mod:`sae_pipeline.features.image_top`) are taken where its codes are
already at hand: the site's images while :func:`sae_pipeline.features.heatmaps.collect_images`
re-reads them (every token of every top image is encoded there), and a new image in
``features explain``.

Pages: ``images/<key>.html`` (the image with a patch picker, `patch_atoms.py`, then the two
rankings as heatmap cards linking to each atom's page; pixel data: one ranking of the atoms'
decoder images) and ``images/index.html`` listing them; the atom pages link each top image
to its page. ``features explain`` writes the same pages for the user's images
(:mod:`sae_pipeline.features.explain_pages`).
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from sae_pipeline.features.heatmaps import Layout
from sae_pipeline.features.patch_atoms import patch_section, write_patch_assets


def image_fname(key: int | str) -> str:
    return f"{key}.html"


def _cards(
    ranking: np.ndarray,
    top: dict[str, Any],
    thumb: str | None,
    layout: Layout,
    atom_href: Callable[[int], str | None],
    atom_image: Callable[[int], str] | None = None,
) -> str:
    esc = html.escape
    row_of = {int(a): i for i, a in enumerate(top["atoms"].tolist())}
    cards = []
    for atom in ranking.tolist():
        i = row_of[atom]
        heat_attr = ""
        if top["levels"] is not None:
            levels = base64.b64encode(top["levels"][i].tobytes()).decode("ascii")
            heat_attr = f' data-heat="{levels}" data-top="{int(top["top"][i])}"'
        frame = ""
        if atom_image is not None:  # one token per image: the atom's decoder row, not the input again
            frame = (
                f'<div class="frame"><img class="pixels decoder" alt="atom {atom}" src="{esc(atom_image(atom))}"></div>'
            )
        elif thumb is not None:
            canvas = '<canvas class="heat"></canvas>' if layout.kind == "patches" else ""
            cls = ' class="pixels"' if layout.kind == "pixels" else ""
            frame = f'<div class="frame"><img{cls} alt="atom {atom}" src="../{esc(thumb)}">{canvas}</div>'
        chips = ""
        if layout.kind == "patches" and layout.n_prefix:
            names = (["CLS"] if layout.n_cls else []) + [f"R{j + 1}" for j in range(layout.n_registers)]
            chips = (
                '<div class="prefix">'
                + "".join(f'<span class="tok" data-i="{j}">{name}</span>' for j, name in enumerate(names))
                + "</div>"
            )
        href = atom_href(atom)
        name = f'<a class="atom" href="{esc(href)}">#{atom}</a>' if href else f"#{atom}"
        caption = (
            f'{name} · <span class="num">max <span class="value">{top["max"][i]:.4g}</span></span> · '
            f'<span class="num">sum {top["sum"][i]:.4g}</span>'
        )
        cards.append(f'<figure class="card"{heat_attr}>{frame}{chips}<figcaption>{caption}</figcaption></figure>')
    if not cards:
        return '<p class="muted">No atom fires on this image.</p>'
    return f'<div class="grid">{"".join(cards)}</div>'


def image_page(
    title: str,
    subtitle: str,
    thumb: str | None,
    top: dict[str, Any],
    layout: Layout,
    atom_href: Callable[[int], str | None],
    nav: list[tuple[str, str]],
    atom_image: Callable[[int], str] | None = None,
) -> str:
    """One image page (``images/<name>.html``: assets and thumbnails one folder up).

    ``atom_image(atom)``: the href of the atom's decoder row drawn as an image, for pixel data (one token per
    image: the cards show it instead of repeating the input, and one ranking, as max and sum are equal)."""
    esc = html.escape
    layout_json = json.dumps({"grid": list(layout.grid), "n_prefix": layout.n_prefix, "kind": layout.kind})
    links = " ".join(f'<a href="{esc(href)}">{esc(text)}</a>' for text, href in nav)
    cls = ' class="pixels"' if layout.kind == "pixels" else ""
    picture = (
        f'<section class="atom-image"><img{cls} alt="{esc(title)}" src="../{esc(thumb)}"></section>' if thumb else ""
    )
    patches = patch_section(top, thumb, layout, atom_href)
    toggle = (
        '<label><input type="checkbox" id="show-heat" checked> heatmaps</label> '
        '<span class="legend"></span> <span class="muted">0 → the atom\'s max on this image</span>'
        if layout.kind == "patches"
        else ""
    )
    by_max, by_sum = (_cards(top[name], top, thumb, layout, atom_href, atom_image) for name in ("by_max", "by_sum"))
    if layout.tokens_per_image == 1:
        rankings = (
            f'<section class="by-max"><h2>Top atoms (one token: its value), as decoder images</h2>{by_max}</section>'
        )
    else:
        rankings = (
            f'<section class="by-max"><h2>Top atoms by maximum activation</h2>{by_max}</section>\n'
            f'<section class="by-sum"><h2>Top atoms by summed activation over the tokens</h2>{by_sum}</section>'
        )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Image {esc(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="../assets/site.css"><link rel="stylesheet" href="../assets/patches.css"></head>
<body><header><h1>Image {esc(title)}</h1><nav>{links}</nav><span class="muted">{esc(subtitle)}</span>{toggle}</header>
{patches or f'<div class="row">{picture}</div>'}
{rankings}
<script type="application/json" id="layout">{layout_json}</script>
<script src="../assets/site.js"></script><script src="../assets/patches.js"></script></body></html>
"""


def images_index(
    title: str, rows: list[tuple[str, str | None, str, str]], nav: list[tuple[str, str]], note: str = ""
) -> str:
    """``images/index.html``: one row per image page ``(page, thumb, name, label)``."""
    esc = html.escape
    links = " ".join(f'<a href="{esc(href)}">{esc(text)}</a>' for text, href in nav)
    body = "".join(
        f'<tr><td class="id"><a href="{esc(page)}">{esc(name)}</a></td>'
        + (f'<td><img alt="" src="../{esc(thumb)}"></td>' if thumb else "<td></td>")
        + f"<td>{esc(label)}</td></tr>"
        for page, thumb, name, label in rows
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="../assets/site.css"></head>
<body><header><h1>{esc(title)}</h1><nav>{links}</nav><span class="muted">{len(rows)} images</span></header>
{note}<table class="images"><thead><tr><th class="id">image</th><th>thumbnail</th><th>label</th></tr></thead>
<tbody>{body}</tbody></table></body></html>
"""


def write_site_image_pages(
    root: Path,
    collection: dict[str, Any],
    layout: Layout,
    thumbs: dict[int, str],
    atom_page: Callable[[int], str | None],
    changed: dict | None = None,
    atom_image: Callable[[int], str] | None = None,
) -> dict[int, str]:
    """The site's image pages (``images/<key>.html`` and ``images/index.html``); returns key -> page path.

    ``atom_page(atom)`` is the atom's page relative to the site root, or None (no page); images
    changed since extraction get no page (they are not drawn); ``atom_image``: see `image_page`.
    """
    from sae_pipeline.features.images import describe

    changed = changed or {}
    write_patch_assets(root / "assets")
    pages: dict[int, str] = {}
    rows = []
    hrefs: dict[int, str | None] = {}  # the same atoms recur on many pages

    def href(atom: int) -> str | None:
        if atom not in hrefs:
            page = atom_page(atom)
            hrefs[atom] = None if page is None else f"../{page}"
        return hrefs[atom]

    for key, meta in sorted(collection["images"].items()):
        top = meta.get("top_atoms")
        if top is None or key in changed:
            continue
        (root / "images").mkdir(exist_ok=True)
        image_id, label = str(meta.get("image_id", key)), describe(meta)
        nav = [("index", "../index.html"), ("all images", "index.html")]
        subtitle = f"label {label}" if label else ""
        page = image_page(image_id, subtitle, thumbs.get(key), top, layout, href, nav, atom_image)
        (root / "images" / image_fname(key)).write_text(page)
        pages[key] = f"images/{image_fname(key)}"
        rows.append((image_fname(key), thumbs.get(key), image_id, label))
    if pages:
        (root / "images" / "index.html").write_text(
            images_index("Images of the site", rows, [("index", "../index.html")])
        )
    return pages
