"""``python -m sae_pipeline features explain``: the image pages of the user's own images.

    python -m sae_pipeline features explain --sae exported/ --images photo.jpg holiday/ --site site/

Each image goes through the backbone the SAE was trained on, exactly as the extraction ran it
(same registry entry, layer, preprocessing, weights and token selection), then through the SAE,
and gets the page the site's images get (:mod:`sae_pipeline.features.image_pages`): the atoms
that fire most on it, by maximum and by sum over its tokens, each with its heatmap.

Where the backbone comes from: the SAE's ``config.json`` keeps the extraction's record
(``data.extraction``: backbone spec and preprocessing, layer, pretrained flag, checkpoint path,
the random weights' seed, token selection; :func:`feature_extraction.shards.extraction_record`),
copied from the shard manifest by ``fit`` and ``export`` (a SAELens export: ``metadata.extraction``),
so explain needs neither the shards nor the folder the export was made in: moved or deleted
shards change nothing. Exports from before that record fall back to ``manifest.json`` in the
recorded ``data.source``, if its sha256 still matches the one the SAE records (a SAELens export:
its ``metadata.dataset_path`` and ``manifest_sha256``); when it is not there (the shards moved, or
the path was relative to the folder the export ran in) one line names it, and exporting the
checkpoint again stores the record (taken from the manifest when the checkpoint predates it).
Nothing the artifact names is imported: the backbone is looked up by name in
the registry (``feature_extraction.backbones.BACKBONES``) and must match the recorded spec.
Random weights (test backbones) are drawn from the recorded seed as the extraction drew them, so
an image's tokens here equal the extraction's (the tests check it). The token subset of an
extraction with ``--tokens_per_image`` is chosen from the seed and the image id, as there
(ids: paths relative to a folder given, file names of files given, names of ``samples``).

Output: ``--out DIR`` (default ``SITE/explained`` with ``--site``), built in a staging folder
and swapped in whole like a site: ``images/<n>.html``, ``images/index.html`` (with the images
that did not decode), ``thumbs/``, ``assets/``. With ``--site`` the atoms link to the site's
atom pages (relative links: keep the two folders side by side). A rerun of ``features`` into
the site replaces it whole, ``explained/`` included.

Bad input is one line, exit 2, before anything is written: an SAE that records no backbone
(trained on digits, MNIST, an ``.h5`` cache, or hand-made shards), a backbone whose weights
file is not here or whose pretrained weights cannot be downloaded (``--checkpoint_path FILE``),
weights other than the extraction's (the record's ``weights_sha256``: same architecture, other
tokens), a backbone producing tokens of another width than the SAE's ``d_in``, a ``--site`` of
another SAE (its ``features.json`` ``sae_sha256``: the atom links would point into another
dictionary). Records and sites from before those hashes are used with one warning each. An image
that does not decode is skipped, named once on stderr and listed on the index page.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from feature_extraction.exit_status import flag_error
from feature_extraction.help_format import DefaultsHelpFormatter
from feature_extraction.validate import check_int

PROG = "python -m sae_pipeline features explain"
FORMAT = "sae_pipeline.features.explain/1"


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


def read_json(fpath: Path) -> dict:
    """A JSON object from ``fpath``; {} when it is missing or not one."""
    try:
        value = json.loads(fpath.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def recorded_extraction(sae_dpath: Path) -> dict:
    """The extraction record of the SAE in ``sae_dpath`` (see the module docstring); one line when there is none."""
    from feature_extraction.shards import extraction_record, manifest_sha256, peek_manifest
    from sae_pipeline.artifacts.export_files import CONFIG_FNAME
    from sae_pipeline.artifacts.saelens import SAELENS_CFG_FNAME

    config, data = read_json(sae_dpath / CONFIG_FNAME), {}
    if isinstance(config.get("data"), dict):
        data = config["data"]
    elif isinstance(metadata := read_json(sae_dpath / SAELENS_CFG_FNAME).get("metadata"), dict):
        data = {key: metadata.get(key) for key in ("extraction", "manifest_sha256")}
        data["source"] = metadata.get("dataset_path")
    if isinstance(data.get("extraction"), dict):
        return data["extraction"]
    source, sha = data.get("source"), data.get("manifest_sha256") or config.get("manifest_sha256")
    why = "records no backbone (trained on digits, MNIST, an .h5 cache or shards without one)"
    if source and sha:
        manifest = peek_manifest(source)
        if manifest is None:
            where = "" if Path(source).is_absolute() else ", a path relative to the folder it was exported in"
            why = f"records no backbone and its shards' manifest {Path(source) / 'manifest.json'} is not there{where}"
        elif manifest_sha256(manifest) != sha:
            why = f"records no backbone and the manifest at {source} is not the one it was trained on (sha256 differs)"
        elif (record := extraction_record(manifest)) is not None:
            return record
    raise ValueError(
        f"--sae {sae_dpath}: {why}; explain needs an SAE trained on shards of python -m feature_extraction "
        "(an export from before this version: export its checkpoint again, which stores the backbone in the export)"
    )


def build_backbone(record: dict, checkpoint_path: str | None, d_in: int) -> Any:
    """The recorded backbone, rebuilt from the registry with the recorded (or given) weights."""
    from feature_extraction.backbones import get_backbone_spec, load_backbone

    recorded = record["backbone"]
    name = str(recorded.get("name"))
    try:
        spec = get_backbone_spec(name)
    except ValueError as exn:
        raise ValueError(f"the SAE's backbone: {exn}") from None
    differs = [k for k, v in spec.to_json().items() if recorded.get(k) != json.loads(json.dumps(v))]
    if differs:
        raise ValueError(
            f"backbone {name!r}: the registry's entry differs from the one the SAE was trained on in {differs}; "
            "use the package version that extracted its shards"
        )
    if int(record.get("d") or spec.d) != d_in:
        raise ValueError(
            f"backbone {name!r} gives {record.get('d') or spec.d}-d tokens but the SAE takes d_in = {d_in}; "
            "pass the SAE trained on this backbone"
        )
    weights = record.get("weights") or {}
    fpath = checkpoint_path or weights.get("checkpoint_path")
    pretrained = bool(weights.get("pretrained")) and checkpoint_path is None
    if fpath is not None and not Path(fpath).is_file():
        raise ValueError(
            f"backbone {name!r}: its weights file {fpath} is not here; pass --checkpoint_path FILE, "
            "the weights the extraction used (.safetensors or state dict)"
        )
    if not pretrained and fpath is None and weights.get("seed") is None:
        raise ValueError(
            f"backbone {name!r}: random weights whose seed was not recorded; pass --checkpoint_path FILE "
            "with the extraction's weights"
        )
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(weights.get("seed") or 0))
            backbone = load_backbone(name, pretrained=pretrained, checkpoint_path=fpath, layer=int(record["layer"]))
    except RuntimeError as exn:  # a failed download (feature_extraction.backbones.hub)
        raise ValueError(
            f"backbone {name!r}: pretrained weights not available offline ({str(exn).split(':')[0]}); pass "
            "--checkpoint_path FILE (the same weights as a local .safetensors or state dict), or set "
            "HF_HUB_OFFLINE=1 with them in the Hugging Face cache"
        ) from None
    check_weights(backbone, recorded, checkpoint_path, fpath)
    if json.loads(json.dumps(backbone.preprocess_config)) != recorded.get("preprocess"):
        raise ValueError(
            f"backbone {name!r}: its preprocessing now differs from the recorded one ({recorded.get('preprocess')}); "
            "use the library versions that extracted the shards"
        )
    return backbone


def check_weights(backbone: Any, recorded: dict, checkpoint_path: str | None, fpath: str | None) -> None:
    """Refuse weights other than the extraction's (same architecture, other numbers: other tokens).

    A record from before ``weights_sha256`` cannot tell: a ``--checkpoint_path`` then gets one warning.
    """
    from feature_extraction.file_hashes import short_digest

    name, expected = recorded.get("name"), recorded.get("weights_sha256")
    if not expected:
        if checkpoint_path is not None:
            print(
                f"warning: --checkpoint_path {checkpoint_path}: not checked, the SAE's extraction record predates "
                "weights hashes (re-extract and retrain to have it checked)",
                file=sys.stderr,
                flush=True,
            )
        return
    actual = backbone.weights_sha256()
    if actual == expected:
        return
    theirs, ours = short_digest(expected), short_digest(actual)
    if checkpoint_path is not None:
        raise ValueError(
            f"--checkpoint_path {checkpoint_path}: other weights than the extraction's (sha256 {ours}, the extraction "
            f"used {theirs}); pass the weights file the extraction of backbone {name!r} used"
        )
    source = f"the weights file {fpath}" if fpath else "the recorded weights (download or seed)"
    raise ValueError(
        f"backbone {name!r}: {source} are not the extraction's now (sha256 {ours}, the extraction used {theirs}); "
        "pass --checkpoint_path FILE with the extraction's weights"
    )


def image_records(paths: list[str]) -> list[Any]:
    """The images to explain: files as given (id: file name), folders and ``samples`` as the extraction lists them."""
    from feature_extraction.images import ImageRecord, list_images

    records = []
    for path in paths:
        if path == "samples" or Path(path).is_dir():
            records += list_images(path)
        elif Path(path).is_file():
            records.append(ImageRecord(Path(path).name, str(Path(path).resolve()), None))
        else:
            raise ValueError(f"--images {path}: not found; give image files, folders of images, or samples")
    return records


def image_tokens(
    backbone: Any, selection: dict | None, pixels: torch.Tensor, ids: list[str], device: torch.device
) -> tuple[torch.Tensor, np.ndarray | None]:
    """The tokens the extraction stores for these images (float16 ``[B, t, d]``) and their positions (None: all)."""
    from feature_extraction.shard_loop import forward_tokens
    from feature_extraction.token_selection import selected_positions

    spec = backbone.spec
    positions = None
    if selection is not None:
        positions = selected_positions(ids, selection=selection, n_prefix_tokens=spec.n_prefix_tokens, grid=spec.grid)
    tokens, event = forward_tokens(backbone, pixels, device, None if positions is None else torch.from_numpy(positions))
    if event is not None:  # CUDA: the copy to the host is asynchronous
        event.synchronize()
    return tokens, positions


@torch.no_grad()
def explain_images(sae: Any, backbone: Any, record: dict, records: list[Any], batch_size: int, device: str) -> dict:
    """Every decodable image's top atoms and view: ``{"explained": [(record, top, view)], "skipped": [(id, why)]}``."""
    from feature_extraction.images import ImageDataset
    from sae_pipeline.features.image_codes import split_images
    from sae_pipeline.features.image_top import image_top_atoms
    from sae_pipeline.features.images import view_transform
    from sae_pipeline.training.interrupts import raise_if_interrupted

    spec = backbone.spec
    view = view_transform(record["backbone"].get("preprocess"), spec.image_size)
    dataset = ImageDataset(records, lambda image: (backbone.preprocess(image), view(image)), log_skips=False)
    selection = record.get("token_selection")
    torch_device = torch.device(device)
    backbone.to(torch_device)
    sae = sae.to(torch_device)
    explained, skipped = [], []
    for start in range(0, len(records), batch_size):
        raise_if_interrupted()
        items = [dataset[i] for i in range(start, min(start + batch_size, len(records)))]
        ok = [(i, pair) for i, pair, _ in items if pair is not None]
        skipped += [(records[i].image_id, why) for i, pair, why in items if pair is None]
        if not ok:
            continue
        ids = [records[i].image_id for i, _ in ok]
        tokens, positions = image_tokens(
            backbone, selection, torch.stack([pair[0] for _, pair in ok]), ids, torch_device
        )
        b, t, d = tokens.shape
        x = tokens.reshape(b * t, d).to(torch_device).float()
        codes = split_images(sae.encode_sparse(x), t)  # as the features pass: the sparse entries, per image
        for j, (i, pair) in enumerate(ok):
            stored = np.arange(spec.n_tokens) if positions is None else positions[j].astype(np.int64)
            explained.append((records[i], image_top_atoms(codes[j], stored, spec.n_tokens), pair[1]))
    return {"explained": explained, "skipped": skipped}


def check_site(site: Path, sae: Any) -> bool:
    """Refuse the site of another SAE; False when the site predates ``sae_sha256`` (cannot tell)."""
    from feature_extraction.file_hashes import short_digest
    from sae_pipeline.features.site_dir import MARKER_FNAME

    try:
        summary = json.loads((site / MARKER_FNAME).read_text())
    except (OSError, ValueError):
        summary = None
    if not isinstance(summary, dict):
        raise ValueError(
            f"--site {site}: not a feature browser site (no readable {MARKER_FNAME}); build one with "
            "python -m sae_pipeline features, or leave --site out"
        )
    if (summary.get("d_in"), summary.get("d_sae")) != (sae.d_in, sae.d_sae):
        raise ValueError(
            f"--site {site}: is the site of an SAE with d_in {summary.get('d_in')}, d_sae {summary.get('d_sae')}, "
            f"not this one (d_in {sae.d_in}, d_sae {sae.d_sae}); pass the site built from --sae"
        )
    recorded = summary.get("sae_sha256")
    if not recorded:
        return False
    if recorded != (ours := sae.content_sha256()):
        raise ValueError(
            f"--site {site}: is the site of another SAE (sae_sha256 {short_digest(str(recorded))}, --sae has "
            f"{short_digest(ours)}): its atom pages are another dictionary's; pass the site built from --sae, or "
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
