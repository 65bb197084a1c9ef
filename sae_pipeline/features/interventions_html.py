"""The atom page's section "Removed inside the backbone" (`features --intervene`, :mod:`.interventions`).

Why its wording: the matched removal is a baseline of the same size on the same images, not chance, and the
verdict reads the paired difference's interval only: above 0 (this atom's removal moves the output more), below 0
(less than the matched atoms' do), or containing 0 (no difference shown on these images).
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import numpy as np

from sae_pipeline.features.interventions import AtomInterventions


def _number(value: float) -> str:
    return "–" if not np.isfinite(value) else f"{value:.3g}"


def _interval(low: float, high: float) -> str:
    return "–" if not (np.isfinite(low) and np.isfinite(high)) else f"[{low:.3g}, {high:.3g}]"


def _share(value: float) -> str:
    return "–" if not np.isfinite(value) else f"{value * 100:.0f} %"


def verdict(n: int, low: float, high: float) -> str:
    """What the paired difference's 95 % interval says, in words that compare two removals, not a removal and chance."""
    if n < 2 or not (np.isfinite(low) and np.isfinite(high)):
        return "Too few images with a matched atom for an interval of the difference."
    if low > 0:
        return "Removing this atom changes the output more than removing a matched atom (the interval is above 0)."
    if high < 0:
        return (
            "Removing this atom changes the output less than removing the matched atoms does (the interval is "
            "below 0): on these images the model leans on it less than on codes of the same size."
        )
    return "No difference from removing a matched atom is shown on these images (the interval contains 0)."


def atom_section(
    found: AtomInterventions | None,
    atom: int,
    image_ids: list[str],
    href: Callable[[int], str | None],
) -> str:
    """The section of ``atom``'s page; "" without ``--intervene``. ``image_ids`` of its top slots, ``href`` an atom's
    page (None: it has none)."""
    if found is None:
        return ""
    esc, a = html.escape, found.arrays
    head = '<section class="intervene"><h2>Removed inside the backbone</h2>'
    if not a["intervene_measured"][atom]:
        return (
            f'{head}<p class="muted">Not measured: --intervene measured {esc(found.rule)} '
            f"({len(found.atoms)}); pass --intervene_atoms 0 for every atom with a page, or --atoms "
            f"{atom}.</p></section>\n"
        )
    measure = "the cosine distance 1 − cos(e, e′) of the final embedding"
    measure = "KL(p ‖ p′) of the class distribution" if found.head else measure
    rows = [
        ("this atom removed", "effect", "top", "images"),
        ("a matched atom removed", "matched", "matched_top", "matched images"),
        ("this − matched, paired", "excess", None, "matched images"),
        ("x̂ only (the SAE's error dropped)", "xhat", "xhat_top", "images"),
    ]
    top_head = "<th>top class changed</th>" if found.head else ""
    table = [f"<tr><th></th><th>mean change</th><th>95 % interval</th><th>images</th>{top_head}</tr>"]
    for label, name, top, count in rows:
        n = int(a["intervene_n_matched" if count == "matched images" else "intervene_n"][atom])
        top_cell = f"<td>{_share(a[f'intervene_{top}_changed'][atom]) if top else ''}</td>" if found.head else ""
        table.append(
            f"<tr><td>{esc(label)}</td><td>{_number(a[f'intervene_{name}'][atom])}</td>"
            f"<td>{_interval(a[f'intervene_{name}_low'][atom], a[f'intervene_{name}_high'][atom])}</td>"
            f"<td>{n}</td>{top_cell}</tr>"
        )
    per_image = ["<tr><th>image</th><th>change</th><th>matched atom</th><th>its change</th><th>x̂ only</th></tr>"]
    for slot, image_id in enumerate(image_ids):
        effect = a["intervene_image_effect"][atom, slot]
        if not np.isfinite(effect):
            continue
        other = int(a["intervene_image_matched_atom"][atom, slot])
        link = href(other) if other >= 0 else None
        name = "–" if other < 0 else (f'<a href="{link}">#{other}</a>' if link else f"#{other}")
        per_image.append(
            f"<tr><td>{esc(image_id)}</td><td>{_number(effect)}</td><td>{name}</td>"
            f"<td>{_number(a['intervene_image_matched'][atom, slot])}</td>"
            f"<td>{_number(a['intervene_image_xhat'][atom, slot])}</td></tr>"
        )
    n_matched = int(a["intervene_n_matched"][atom])
    return (
        f"{head}<p>At layer {found.layer} of {esc(found.backbone)}, this atom's part z·d is taken out of every token "
        "of each of its top images (x′ = x − z d, the SAE's error x − x̂ kept, so with nothing removed the output "
        f"is the model's own, change 0), and the rest of the model runs. Change: {esc(measure)}.</p>"
        f'<table class="intervene">{"".join(table)}</table>'
        f"<p><b>{esc(verdict(n_matched, a['intervene_excess_low'][atom], a['intervene_excess_high'][atom]))}</b></p>"
        '<p class="muted">Matched atom: on each image, the other atom active on it whose |code| summed over the '
        "image's tokens is closest to this atom's: a removal of the same size, the baseline of the difference "
        "(not chance). Intervals: 95 %, t over images. x̂ only: every token replaced by the SAE's reconstruction, "
        "the SAE's own cost, for scale.</p>"
        f"<details><summary>Per image</summary><table>{''.join(per_image)}</table></details></section>\n"
    )


def image_ids_of(state: dict[str, Any], collection: dict[str, Any], atom: int) -> list[str]:
    """The image id shown for each of ``atom``'s top slots ("" where the slot is empty)."""
    keys = state["image"][atom].tolist()
    return [str(collection["images"].get(int(k), {}).get("image_id", k)) if k >= 0 else "" for k in keys]
