"""The pages `features explain` writes, and their links into a feature browser site.

Why a module of its own: the pages are the site's image pages (`image_pages.py`) in a folder of their
own, and linking them to a site's atom pages is safe only when that site was built from the same SAE;
both are about the output, not about the backbone (`explain_backbone.py`) or the codes
(`explain_images.py`).

Output: `--out DIR` (default `SITE/explained` with `--site`), built in a staging folder
and swapped in whole like a site: `images/<n>.html`, `images/index.html` (with the images
that did not decode), `thumbs/`, `assets/`. With `--site` the atoms link to the site's
atom pages (relative links: keep the two folders side by side). A rerun of `features` into
the site replaces it whole, `explained/` included. A `--site` of another SAE (its `features.json`
`sae_sha256`: the atom links would point into another dictionary) is refused in one line; a site
from before that hash cannot be told apart and is used (the command warns once).
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any

FORMAT = "sae_pipeline.features.explain/1"


def check_site(site: Path, sae: Any) -> bool:
    """Refuse the site of another SAE; False when the site predates ``sae_sha256`` (cannot tell)."""
    from feature_extraction.file_checks import load_json, shown, terminal_text
    from feature_extraction.file_hashes import short_digest
    from sae_pipeline.features.site_dir import MARKER_FNAME

    fix = "build one with python -m sae_pipeline features, or leave --site out"
    try:
        summary = load_json(site / MARKER_FNAME, what="feature browser site record", fix=fix, kind=dict)
    except OSError:
        raise ValueError(f"--site {site}: not a feature browser site (no readable {MARKER_FNAME}); {fix}") from None
    if (summary.get("d_in"), summary.get("d_sae")) != (sae.d_in, sae.d_sae):
        raise ValueError(
            f"--site {site}: is the site of an SAE with d_in {shown(summary.get('d_in'))}, d_sae "
            f"{shown(summary.get('d_sae'))} (its {MARKER_FNAME}), not this one (d_in {sae.d_in}, d_sae "
            f"{sae.d_sae}); pass the site built from --sae"
        )
    recorded = summary.get("sae_sha256")
    if not recorded:
        return False
    if not isinstance(recorded, str):
        raise ValueError(f"--site {site}: its {MARKER_FNAME} sae_sha256 is {shown(recorded)}, not a digest; {fix}")
    if recorded != (ours := sae.content_sha256()):
        raise ValueError(
            f"--site {site}: is the site of another SAE ({MARKER_FNAME}: sae_sha256 "
            f"{short_digest(terminal_text(recorded))}, --sae has {short_digest(ours)}): its atom pages are another "
            "dictionary's; pass the site built from --sae, or "
            f"rebuild it: python -m sae_pipeline features --sae SAE_DIR --data.source DATA --out {site}"
        )
    return True


def site_atom_links(site: Path, sae: Any, images_dpath: Path) -> Any:
    """``atom -> href`` from ``images_dpath`` to the site's atom pages (None where the site has no page)."""
    from sae_pipeline.features.atom_pages import atom_fname

    check_site(site, sae)
    width = len(str(sae.d_sae - 1))

    def href(atom: int) -> str | None:
        page = site / "atoms" / atom_fname(atom, width)
        return os.path.relpath(page, images_dpath) if page.is_file() else None

    return href


def write_pages(out: Path, result: dict, backbone: Any, site: Path | None, sae: Any, summary: dict) -> Path:
    """The explained images' pages in ``out`` (staged, swapped in whole)."""
    from sae_pipeline.features.assets import CSS, JS
    from sae_pipeline.features.heatmaps import Layout
    from sae_pipeline.features.image_pages import image_fname, image_page, images_index
    from sae_pipeline.features.images import save_thumbnail
    from sae_pipeline.features.patch_atoms import write_patch_assets
    from sae_pipeline.features.site_dir import MARKER_FNAME, staged_site

    spec = backbone.spec
    n_cls = min(1, spec.n_prefix_tokens)
    layout = Layout("patches", spec.n_tokens, n_cls, spec.n_prefix_tokens - n_cls, tuple(spec.grid))
    final_images = out.resolve() / "images"
    atom_href = site_atom_links(site, sae, final_images) if site is not None else (lambda atom: None)
    nav = [("all explained images", "index.html")]
    if site is not None:
        nav.insert(0, ("site index", os.path.relpath(site.resolve() / "index.html", final_images)))
    with staged_site(out) as staging:
        for sub in ("images", "thumbs", "assets"):
            (staging / sub).mkdir(parents=True)
        (staging / "assets" / "site.css").write_text(CSS)
        (staging / "assets" / "site.js").write_text(JS)
        write_patch_assets(staging / "assets")
        rows = []
        for n, (record, top, view) in enumerate(result["explained"]):
            thumb = f"thumbs/{n}.jpg"
            save_thumbnail(view, staging / thumb)
            by = f"explained by {Path(summary['sae']).name}"
            page = image_page(record.image_id, by, thumb, top, layout, atom_href, nav)
            (staging / "images" / image_fname(n)).write_text(page)
            rows.append((image_fname(n), thumb, record.image_id, ""))
        note = ""
        if result["skipped"]:
            items = "".join(
                f"<li>{html.escape(i)} <span class='muted'>{html.escape(w)}</span></li>" for i, w in result["skipped"]
            )
            heading = f"Not decoded, skipped ({len(result['skipped'])})"
            note = f'<section class="changed"><h2>{heading}</h2><ul>{items}</ul></section>'
        (staging / "images" / "index.html").write_text(images_index("Explained images", rows, nav[:-1], note))
        (staging / MARKER_FNAME).write_text(json.dumps({"format": FORMAT, **summary}, indent=2) + "\n")
    return out
