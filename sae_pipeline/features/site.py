"""The site's orchestration: one build writes every part of ``OUT`` from the merged table and its images.

Each page has its own module; this one computes what several share (each atom's statistics, its
nearest atoms, the thumbnails, the label statistics), calls them in order, and stages the whole.

Layout of ``OUT`` (everything relative, so the folder opens from disk, can be copied, and is
served as is by ``python -m http.server``):

- ``index.html`` (:mod:`sae_pipeline.features.index_page`): every atom (frequency, mean value
  when active, maximum value, maximum cosine to another atom and which, MP's mean selection
  step, with ``--replicas`` in how many seeds it is found: :mod:`sae_pipeline.features.replicas`),
  sortable by any column and searchable by id; its data is one JSON block the script renders;
- ``atoms/<id>.html`` (:mod:`sae_pipeline.features.atom_pages`): the atom's top images with the
  activation heatmap over the patch grid (CLS and register tokens as separate chips), value,
  image id, label and token position; its nearest atoms by cosine, linked; the atom itself as
  an image for pixel data;
- ``images/<key>.html``: each shown image with the atoms that fire most on it
  (:mod:`sae_pipeline.features.image_pages`), linked from the atom pages' cards; ``images/index.html``;
- ``thumbs/``: one thumbnail per image, written once however many atoms show it;
  ``atoms/img/``: the atoms of pixel data as images; ``assets/``: the stylesheet and script;
- ``features.npz`` (the merged table and statistics, numeric arrays only: no pickle) and
  ``features.json`` (what was run; also how a rerun recognises a site it may replace; its
  ``sae_sha256`` names the SAE, so that ``features explain --site`` links only into its own site);
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

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

import sae_pipeline
from sae_pipeline.features import label_pages
from sae_pipeline.features.assets import CSS, JS
from sae_pipeline.features.atom_pages import atom_fname, atom_page, nearest_atoms
from sae_pipeline.features.chance import FDR
from sae_pipeline.features.heatmaps import Layout
from sae_pipeline.features.image_pages import write_site_image_pages
from sae_pipeline.features.images import (
    ImageChangedError,
    SourceImages,
    atom_image,
    pixels_image,
    save_thumbnail,
    view_transform,
)
from sae_pipeline.features.index_page import image_checks_section, index_page, number
from sae_pipeline.features.interventions_html import atom_section as intervene_section
from sae_pipeline.features.interventions_html import image_ids_of
from sae_pipeline.features.replicas import INDEX_COLUMNS as REPLICA_COLUMNS
from sae_pipeline.features.replicas import ReplicaMatch
from sae_pipeline.features.replicas import index_cells as replica_cells
from sae_pipeline.features.replicas import page_stats as replica_stats
from sae_pipeline.features.selectivity import LabelStats, label_stats
from sae_pipeline.features.site_dir import MARKER_FNAME, staged_site
from sae_pipeline.training.interrupts import raise_if_interrupted


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
    fdr: float = FDR,
    interventions: Any = None,
    replicas: ReplicaMatch | None = None,
) -> Path:
    """Write the whole site for a merged table (``state``) and its images (``collection``); returns ``out``.

    ``fdr``: the false-discovery rate at which an atom's selectivity beats chance (`sae_pipeline.features.chance`);
    ``interventions``: `features --intervene`'s measurements (`sae_pipeline.features.interventions`), or None;
    ``replicas``: `features --replicas`'s matching (`sae_pipeline.features.replicas`), or None."""
    start = time.perf_counter()
    out = Path(out)
    with staged_site(out) as staging:
        (staging / "atoms").mkdir(parents=True)
        (staging / "assets").mkdir()
        (staging / "assets" / "site.css").write_text(CSS)
        (staging / "assets" / "site.js").write_text(JS)
        thumbs, changed, unchecked = write_thumbnails(staging, collection, layout, datamodule, images_dpath)
        raise_if_interrupted()
        labels = label_stats(state, collection, fdr)
        width, with_page = len(str(sae.d_sae - 1)), set(atoms) if atoms else set(range(sae.d_sae))
        image_links = write_site_image_pages(
            staging,
            collection,
            layout,
            thumbs,
            lambda a: f"atoms/{atom_fname(a, width)}" if a in with_page else None,
            changed,
            write_ranked_atom_images(staging, sae, collection, layout),
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
            interventions,
            replicas,
        )
        arrays = {name: value.numpy() for name, value in state.items()}
        arrays.update(interventions.arrays if interventions else {})
        arrays.update(replicas.arrays() if replicas else {})
        np.savez(staging / "features.npz", **arrays, **(labels.arrays() if labels else {}))
        summary = {
            "format": "sae_pipeline.features/1",
            "package_version": sae_pipeline.__version__,
            "sae_class": type(sae).__name__,
            "d_in": sae.d_in,
            "d_sae": sae.d_sae,
            "sae_sha256": sae.content_sha256(),
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
            "intervene": interventions.summary() if interventions else None,
            "replicas": replicas.summary() if replicas else None,
            "build_seconds": round(time.perf_counter() - start, 3),
        }
        (staging / MARKER_FNAME).write_text(json.dumps(summary, indent=2) + "\n")
        raise_if_interrupted()
    return out


def write_ranked_atom_images(root: Path, sae: Any, collection: dict[str, Any], layout: Layout) -> Any:
    """Pixel data: ``atoms/img/<atom>.png`` for every atom an image page ranks (atoms without a page included),
    so that those pages show the atoms' decoder rows; returns their href from ``images/`` (None otherwise)."""
    if layout.kind != "pixels":
        return None
    ranked = {
        int(a) for meta in collection["images"].values() if "top_atoms" in meta for a in meta["top_atoms"]["atoms"]
    }
    (root / "atoms" / "img").mkdir(parents=True, exist_ok=True)
    W = sae.W_dec.detach().float().numpy()
    for atom in sorted(ranked):
        atom_image(W[atom], layout.image_shape).save(root / "atoms" / "img" / f"{atom}.png")
    return lambda atom: f"../atoms/img/{atom}.png"


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
    interventions: Any = None,
    replicas: ReplicaMatch | None = None,
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
        (root / "atoms" / "img").mkdir(exist_ok=True)
        W = sae.W_dec.detach().float().numpy()
        for atom in chosen:
            atom_image(W[atom], layout.image_shape).save(root / "atoms" / "img" / f"{atom}.png")
    layout_json = json.dumps({"grid": list(layout.grid), "n_prefix": layout.n_prefix, "kind": layout.kind})
    for i, atom in enumerate(chosen):
        raise_if_interrupted()  # Ctrl-C / SIGTERM: a long loop on big dictionaries (sae_pipeline.training.interrupts)
        prev_atom, next_atom = chosen[i - 1] if i > 0 else None, chosen[i + 1] if i + 1 < len(chosen) else None
        page = atom_page(
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
            intervene_html=intervene_section(
                interventions,
                atom,
                image_ids_of(state, collection, atom),
                lambda j: atom_fname(j, width) if j in with_page else None,
            ),
            extra_stats=replica_stats(replicas, atom),
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
                number(frequency[atom]),
                number(mean_value[atom]),
                number(float(max_value[atom])),
                number(float(near_cos[atom][0])) if near_cos.shape[1] else None,
                int(near_index[atom][0]) if near_index.shape[1] else None,
                number(mean_step[atom]) if has_steps else None,
                *label_pages.index_columns(labels, atom),
                *replica_cells(replicas, atom),
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
            *(REPLICA_COLUMNS if replicas else []),
        ],
        "rows": rows,
        "has_steps": has_steps,
        "replicas": replicas.n if replicas else None,
        "atom_images": "atoms/img/" if pixel_atoms else None,
        "thumb_class": "pixels" if pixel_atoms else "",
        **label_pages.index_data(labels),
    }
    (root / "index.html").write_text(
        index_page(
            sae,
            datamodule,
            state,
            data,
            has_steps,
            pixel_atoms,
            layout,
            image_checks_section(changed, unchecked),
            bool(image_links),
            labels,
            replicas=replicas,
        )
    )
    href = {atom: atom_fname(atom, width) for atom in with_page}.get
    label_pages.write_label_pages(root, labels, state["image"].numpy(), thumbs, href, pixel_atoms)
