"""``evaluate intervene``'s outputs: ``OUT/intervene.json`` (every image's figures, plain JSON) and
``OUT/intervene.md`` (the images the intervention changes most), and the command itself (:mod:`.intervene` holds
the measurement)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from feature_extraction.atomic_files import write_text_atomic
from feature_extraction.output_dirs import prepare_output_dir

JSON_FNAME, MD_FNAME = "intervene.json", "intervene.md"
TABLE_IMAGES = 20


def run_intervene(args: Any) -> Path:
    """Check the input (one line each), rebuild the backbone, measure, write both files; returns the Markdown."""
    from feature_extraction.file_checks import terminal_text
    from sae_pipeline.artifacts import load_sae
    from sae_pipeline.evaluate.causal_report import check_atoms
    from sae_pipeline.evaluate.intervene import hooked_module, intervene_images, summary
    from sae_pipeline.features.explain_backbone import build_backbone, recorded_extraction
    from sae_pipeline.features.explain_images import image_records

    if not Path(args.sae).is_dir():
        raise ValueError(
            f"--sae {args.sae}: not a directory; pass an export (config.json + sae.safetensors) or a "
            "SAELens directory (cfg.json + sae_weights.safetensors)"
        )
    if not math.isfinite(args.scale):
        raise ValueError(f"--scale {args.scale}: not a finite number; pass 0 to remove the atoms, 2 to double them")
    try:
        device = str(__import__("torch").device(args.device))
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a torch device; pass cpu or cuda") from None
    try:
        record = recorded_extraction(Path(args.sae))
    except ValueError as exn:
        raise ValueError(str(exn).replace("explain needs", "intervene needs")) from None
    records = image_records(args.images)
    if not records:
        raise ValueError(f"--images {' '.join(args.images)}: no images found; give image files or folders of images")
    sae = load_sae(args.sae)
    check_atoms(args.atoms, sae.d_sae, args.sae)
    backbone = build_backbone(record, args.checkpoint_path, sae.d_in)
    hooked_module(backbone)  # one line now, before any image is read, for a layer that cannot be hooked
    atoms = sorted(set(args.atoms))
    result = {
        "sae": str(args.sae),
        "backbone": backbone.spec.name,
        "layer": backbone.layer,
        "atoms": atoms,
        "scale": args.scale,
        **intervene_images(sae, backbone, records, atoms, args.scale, args.batch_size, device),
    }
    if not result["rows"]:
        raise ValueError(f"--images: none of the {len(records)} images decodes; give readable image files")
    for image_id, why in result["skipped"]:
        print(f"warning: skipped image {terminal_text(image_id)}: {terminal_text(why)}", file=sys.stderr)
    result["skipped"] = [{"id": image_id, "why": why} for image_id, why in result["skipped"]]
    out_dpath = prepare_output_dir(args.out, "--out")
    write_text_atomic(out_dpath / JSON_FNAME, json.dumps(result, indent=1, allow_nan=False) + "\n")
    write_text_atomic(out_dpath / MD_FNAME, intervene_markdown(result, summary(result)))
    for row in result["rows"][:TABLE_IMAGES]:  # in the order given; every image is in intervene.json
        print(f"{terminal_text(row['id'])}: change {row['change']:.6g} (x̂ only: {row['xhat_change']:.6g})")
    if len(result["rows"]) > TABLE_IMAGES:
        print(f"... {len(result['rows']) - TABLE_IMAGES} more images in {out_dpath / JSON_FNAME}")
    print(summary(result))
    return out_dpath / MD_FNAME


def intervene_markdown(result: dict[str, Any], line: str) -> str:
    """The images whose output moves most, with the reference of x̂ alone beside each."""
    from feature_extraction.file_checks import terminal_text

    head = result["output"] == "class logits"
    rows = sorted(result["rows"], key=lambda r: (-r["change"], r["id"]))[:TABLE_IMAGES]
    measure = "KL(p ‖ p′) of the class distribution" if head else "cosine distance 1 − cos(e, e′) of the embedding"
    lines = [
        "# Interventions in the backbone",
        "",
        line + ".",
        "",
        f"At layer {result['layer']}, every token x is replaced by x + (s − 1) Σ_j z_j d_j: the SAE's reconstruction "
        f"with atoms {', '.join(map(str, result['atoms']))} scaled by s = {result['scale']:g}, the error x − x̂ kept, "
        f"and the rest of the model runs. Change: {measure}. Baseline: with no atom changed the tokens are x and the "
        "output is the model's own (change 0, exactly); x̂ only: the change when the tokens are x̂ (the error "
        "dropped), the SAE's own cost, for scale. Active tokens: tokens where one of the atoms has a nonzero code. "
        'docs/evaluation.md, "Interventions in the backbone", says more.',
        "",
        "| image | change | x̂ only | active tokens | Σ |z| |" + (" top class (before → after) |" if head else ""),
        "|---|---|---|---|---|" + ("---|" if head else ""),
    ]
    for r in rows:
        name = terminal_text(r["id"]).replace("|", "\\|")
        top = f" {r['top_before']} → {r['top_after']} |" if head else ""
        lines.append(
            f"| {name} | {r['change']:.6g} | {r['xhat_change']:.6g} | {r['active_tokens']} | {r['code_sum']:.4g} |{top}"
        )
    if result["skipped"]:
        lines += ["", f"Skipped (not decodable): {len(result['skipped'])} images, listed in intervene.json."]
    lines += [
        "",
        "This command's output is per image, for the atoms you choose; `features --intervene` shows each atom removed "
        "on its own top images, against a matched removal, on its page.",
        "",
    ]
    return "\n".join(lines)
