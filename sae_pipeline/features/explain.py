"""`python -m sae_pipeline features explain`: the image pages of the user's own images.

    python -m sae_pipeline features explain --sae exported/ --images photo.jpg holiday/ --site site/

Each image goes through the backbone the SAE was trained on, exactly as the extraction ran it
(same registry entry, layer, preprocessing, weights and token selection), then through the SAE,
and gets the page the site's images get (`image_pages.py`): the atoms that fire most on it,
by maximum and by sum over its tokens, each with its heatmap.

This module is the command: its flags, and the order of its checks, so that bad input fails before
anything is loaded or written. Its parts live beside it:

- `explain_backbone.py`: the backbone the SAE records (its extraction record) and that backbone
  rebuilt with the extraction's weights;
- `explain_images.py`: the images through that backbone and the SAE, to each image's top atoms;
- `explain_pages.py`: their pages (`--out`, or `SITE/explained`), linked to a site's atom pages.

Bad input is one line, exit 2, before anything is written: an SAE that records no backbone
(trained on digits, MNIST, an `.h5` cache, or hand-made shards), a backbone whose weights
file is not here or whose pretrained weights cannot be downloaded (`--checkpoint_path FILE`),
weights other than the extraction's (the record's `weights_sha256`: same architecture, other
tokens), a backbone producing tokens of another width than the SAE's `d_in`, a `--site` of
another SAE (its `features.json` `sae_sha256`: the atom links would point into another
dictionary). Records and sites from before those hashes are used with one warning each. An image
that does not decode is skipped, named once on stderr and listed on the index page.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from feature_extraction.exit_status import flag_error
from feature_extraction.help_format import DefaultsHelpFormatter
from feature_extraction.validate import check_int
from sae_pipeline.features.explain_backbone import build_backbone, recorded_extraction
from sae_pipeline.features.explain_images import explain_images, image_records
from sae_pipeline.features.explain_pages import check_site, write_pages

PROG = "python -m sae_pipeline features explain"


def build_parser() -> Any:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(
        prog=PROG,
        formatter_class=DefaultsHelpFormatter,
        exit_on_error=False,
        description="Run the SAE's own backbone (recorded at extraction) and the SAE on your images, and write "
        "a page per image: the atoms that fire most on it, with their heatmaps, linked to the atom pages of "
        "--site when given.",
    )
    parser.add_argument("--sae", required=True, help="an exported SAE directory (python -m sae_pipeline export)")
    parser.add_argument(
        "--images", required=True, nargs="+", help="image files and folders (class sub-folders allowed), or samples"
    )
    parser.add_argument("--site", help="a feature browser site of this SAE: the atoms link to its pages")
    parser.add_argument("--out", help="output directory (default: SITE/explained with --site)")
    parser.add_argument(
        "--checkpoint_path",
        help="the backbone's weights (.safetensors or state dict), when the recorded file or download is unavailable",
    )
    parser.add_argument("--batch_size", type=int, default=16, help="images per backbone forward")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    return parser


def main(argv: list[str]) -> int:
    """Errors are ValueErrors, printed by ``python -m sae_pipeline`` (one line, exit 2)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except argparse.ArgumentError as error:
        raise ValueError(f"{flag_error(error)} (see {PROG} --help)") from None
    start = time.perf_counter()
    from sae_pipeline.artifacts import load_sae
    from sae_pipeline.features.site_dir import check_out_dir, remove_stale_partials

    check_int("--batch_size", args.batch_size, 1)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device} but no CUDA device is visible; use --device cpu")
    sae_dpath = Path(args.sae)
    if not sae_dpath.is_dir():
        raise ValueError(f"--sae {args.sae}: not a directory; pass an export (python -m sae_pipeline export)")
    if args.out is None and args.site is None:
        raise ValueError("pass --out DIR (where the pages go) or --site DIR (they then go to SITE/explained)")
    site = Path(args.site) if args.site else None
    out = Path(args.out) if args.out else Path(args.site) / "explained"
    record = recorded_extraction(sae_dpath)
    sae = load_sae(sae_dpath).eval()
    if site is not None and not check_site(site, sae):  # its one-line checks, before the backbone loads
        print(
            f"warning: --site {site}: built before sites recorded their SAE's hash, so it cannot be told from "
            "the site of another SAE of the same size; rebuild it with python -m sae_pipeline features to check",
            file=sys.stderr,
            flush=True,
        )
    records = image_records(args.images)
    check_out_dir(out)
    remove_stale_partials(out)
    backbone = build_backbone(record, args.checkpoint_path, sae.d_in)
    result = explain_images(sae, backbone, record, records, args.batch_size, args.device)
    for image_id, why in result["skipped"]:
        print(f"warning: {image_id}: does not decode, skipped ({why})", file=sys.stderr, flush=True)
    if not result["explained"]:
        raise ValueError(f"--images: none of the {len(records)} images decodes; give image files the extraction reads")
    summary = {
        "sae": str(sae_dpath),
        "site": None if site is None else str(site),
        "backbone": backbone.spec.name,
        "layer": backbone.layer,
        "images": [r.image_id for r, _, _ in result["explained"]],
        "skipped": [{"image_id": i, "why": w} for i, w in result["skipped"]],
    }
    write_pages(out, result, backbone, site, sae, summary)
    print(
        f"explained {len(result['explained'])} images ({len(result['skipped'])} skipped) in "
        f"{time.perf_counter() - start:.1f} s: open {out / 'images' / 'index.html'}",
        flush=True,
    )
    return 0
