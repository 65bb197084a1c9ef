"""Patch-level inspection: per token of an image, its few largest atoms, shown when the patch is clicked.

An image page ranks atoms over the whole image; a researcher also asks "what fires on *this*
patch?" (PatchSAE, saev). The answer is taken where the image's codes are already at hand
(`image_top.py`, from the sparse entries of `image_codes.py`), so it costs no extra pass: per
token only the `PATCH_TOP` largest positive (atom, value) pairs are kept, O(tokens · PATCH_TOP)
per image, whatever `d_sae`. The page embeds them as one JSON block and `assets/patches.js`
draws the picker (a grid over the image, the prefix tokens as chips) and the list: no server,
no `fetch` (which a page opened from `file://` may not do), so it opens from disk.

Pixel data (digits, MNIST) has one token per image: no picker; its image page shows each
atom's decoder row as an image instead (`image_pages.py`).
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from sae_pipeline.features.image_codes import ImageCodes

#: heatmaps.py's `Layout` (where the patches sit); not imported, since heatmaps.py imports this file's callers.
Layout = Any

PATCH_TOP = 5  # atoms listed per token


def token_top_atoms(image: ImageCodes, k: int = PATCH_TOP) -> tuple[np.ndarray, np.ndarray]:
    """Each token's ``k`` largest positive codes, largest first, ties by atom id: ``(atoms int32 [tokens, k]``
    (-1 past the token's positive codes), ``values float32 [tokens, k])`` (0 there)."""
    atoms = np.full((image.n_tokens, k), -1, np.int32)
    values = np.zeros((image.n_tokens, k), np.float32)
    entry_atom = np.repeat(image.atoms, np.diff(image.crow))
    keep = image.value > 0
    token, atom, value = image.token[keep], entry_atom[keep], image.value[keep]
    # by token, then value (largest first), then atom id: the entries come by atom, so two stable sorts
    # (the second a radix sort of small ints) order them as a 3-key lexsort would, in about half its time
    order = np.argsort(-value, kind="stable")
    small = token[order].astype(np.int16 if image.n_tokens < 2**15 else np.int64)
    order = order[np.argsort(small, kind="stable")]
    token, atom, value = token[order], atom[order], value[order]
    count = np.bincount(token, minlength=image.n_tokens)
    first = np.repeat(np.cumsum(count) - count, count)  # each entry's token's first entry
    rank = np.arange(len(token)) - first
    mine = rank < k
    atoms[token[mine], rank[mine]] = atom[mine]
    values[token[mine], rank[mine]] = value[mine]
    return atoms, values


def patch_data(top: dict[str, Any], layout: Layout, atom_href: Callable[[int], str | None]) -> dict[str, Any]:
    """The page's JSON: per stored token its position in the full sequence and its atoms / values (4 digits),
    the prefix tokens' names and the href of every atom listed (those without a page are left out).

    Built with array operations (one page per image: thousands of pages, where per-value formatting cost
    7 ms a page, 30 s of a 4 096-image site)."""
    atoms, values = top["token_atoms"], top["token_values"]
    kept = atoms >= 0
    ends = np.cumsum(kept.sum(1)).tolist()
    flat_atoms, flat_values = atoms[kept].tolist(), significant(values[kept], 4).tolist()
    starts = [0, *ends[:-1]]
    hrefs = {str(a): href for a in np.unique(atoms[kept]).tolist() if (href := atom_href(a)) is not None}
    return {
        "positions": [int(p) for p in top["positions"]],
        "atoms": [flat_atoms[start:end] for start, end in zip(starts, ends)],
        "values": [flat_values[start:end] for start, end in zip(starts, ends)],
        "href": hrefs,
        "prefix": (["CLS"] if layout.n_cls else []) + [f"R{j + 1}" for j in range(layout.n_registers)],
    }


def significant(values: np.ndarray, digits: int) -> np.ndarray:
    """``values`` (float64) rounded to ``digits`` significant digits, as ``float(f"{v:.4g}")`` would give them
    but for the rare value a half-unit from a rounding boundary (the product with the power of ten rounds).
    The power of ten is always exact (positive, or applied as a divisor), so each result is the double
    nearest to a short decimal and JSON writes it in at most ``digits`` digits."""
    v = np.asarray(values, np.float64)
    out = np.zeros_like(v)
    finite = np.isfinite(v)
    nonzero = finite & (v != 0)
    part = v[nonzero]
    exponent = digits - 1 - np.floor(np.log10(np.abs(part))).astype(np.int64)
    scale = 10.0 ** np.abs(exponent)
    out[nonzero] = np.where(exponent >= 0, np.round(part * scale) / scale, np.round(part / scale) * scale)
    out[~finite] = v[~finite]
    return out


def patch_section(
    top: dict[str, Any], thumb: str | None, layout: Layout, atom_href: Callable[[int], str | None]
) -> str:
    """The picker: the image with a clickable grid over it, the prefix chips, the chosen token's list."""
    if thumb is None or layout.kind != "patches" or "token_atoms" not in top:
        return ""
    data = json.dumps(patch_data(top, layout, atom_href), separators=(",", ":")).replace("</", "<\\/")
    return (
        '<section class="patches"><h2>Click a patch: its top atoms</h2><div class="row">'
        f'<div class="pick"><div class="frame"><img alt="" src="../{html.escape(thumb)}">'
        '<canvas id="patch-grid"></canvas></div><div class="prefix" id="patch-prefix"></div></div>'
        '<div><p id="patch-name" class="muted"></p><ol id="patch-list"></ol></div></div>'
        f'<script type="application/json" id="patch-data">{data}</script></section>'
    )


PATCH_CSS = """
.patches .pick { width: 280px; }
.patches .frame { cursor: crosshair; }
.patches .prefix .tok { cursor: pointer; }
.patches .prefix .tok.chosen { outline: 2px solid #1d4ed8; }
#patch-list { margin: 4px 0; padding-left: 24px; min-width: 220px; }
#patch-list li { margin: 2px 0; }
"""

PATCH_JS = r"""
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  const block = document.getElementById("patch-data");
  if (!block) return;
  const data = JSON.parse(block.textContent), layout = JSON.parse(document.getElementById("layout").textContent);
  const [gh, gw] = layout.grid, cell = 16, canvas = document.getElementById("patch-grid");
  const row = {};  // full-sequence position -> index into data.atoms
  data.positions.forEach((p, i) => { row[p] = i; });
  const prefix = document.getElementById("patch-prefix");
  for (let j = 0; j < layout.n_prefix; j++) {
    const chip = document.createElement("span");
    chip.className = "tok"; chip.dataset.i = j; chip.textContent = data.prefix[j];
    if (!(j in row)) chip.title = "not stored by the extraction";
    chip.addEventListener("click", () => choose(j));
    prefix.appendChild(chip);
  }
  function draw(chosen) {
    const ctx = canvas.getContext("2d");
    canvas.width = gw * cell; canvas.height = gh * cell;
    for (let r = 0; r < gh; r++) for (let c = 0; c < gw; c++) {
      const p = layout.n_prefix + r * gw + c;
      if (!(p in row)) { ctx.fillStyle = "rgba(40,40,40,0.55)"; ctx.fillRect(c * cell, r * cell, cell, cell); }
      ctx.strokeStyle = "rgba(255,255,255,0.35)"; ctx.lineWidth = 1;
      ctx.strokeRect(c * cell + 0.5, r * cell + 0.5, cell - 1, cell - 1);
    }
    if (chosen >= layout.n_prefix) {
      const p = chosen - layout.n_prefix, r = Math.floor(p / gw), c = p % gw;
      ctx.strokeStyle = "#1d4ed8"; ctx.lineWidth = 2;
      ctx.strokeRect(c * cell + 1, r * cell + 1, cell - 2, cell - 2);
    }
    prefix.querySelectorAll(".tok").forEach(t => t.classList.toggle("chosen", Number(t.dataset.i) === chosen));
  }
  function choose(p) {
    const list = document.getElementById("patch-list"), name = document.getElementById("patch-name");
    const where = p < layout.n_prefix ? data.prefix[p] : "patch row " + Math.floor((p - layout.n_prefix) / gw)
      + ", col " + ((p - layout.n_prefix) % gw);
    list.innerHTML = "";
    list.dataset.position = p;
    if (!(p in row)) { name.textContent = where + ": not stored by the extraction"; draw(p); return; }
    const i = row[p], atoms = data.atoms[i];
    name.textContent = where + (atoms.length ? "" : ": no atom fires");
    atoms.forEach((a, j) => {
      const li = document.createElement("li"), href = data.href[a];
      const link = document.createElement(href ? "a" : "span");
      if (href) link.href = href;
      link.className = "atom"; link.textContent = "#" + a;
      const v = document.createElement("span");
      v.className = "num"; v.textContent = " " + data.values[i][j];
      li.append(link, v); list.appendChild(li);
    });
    draw(p);
  }
  canvas.addEventListener("click", e => {
    const box = canvas.getBoundingClientRect();
    const c = Math.min(gw - 1, Math.floor((e.clientX - box.left) / box.width * gw));
    const r = Math.min(gh - 1, Math.floor((e.clientY - box.top) / box.height * gh));
    choose(layout.n_prefix + r * gw + c);
  });
  // first shown: the token with the largest value on the image
  let best = data.positions[0], bestValue = -1;
  data.positions.forEach((p, i) => {
    const v = data.values[i][0];
    if (v !== undefined && v > bestValue) { best = p; bestValue = v; }
  });
  choose(best);
});
"""


def write_patch_assets(assets: Path) -> None:
    """``assets/patches.css|js``, beside the site's own (the image pages load them)."""
    assets.mkdir(parents=True, exist_ok=True)
    (assets / "patches.css").write_text(PATCH_CSS)
    (assets / "patches.js").write_text(PATCH_JS)
