"""The site parts of ``python -m benchmarks.features`` (its parts 3, 3c and 3d: the site's build time and
size, then the label statistics' and image pages' shares of one build and of one whole ``features`` run).
Apart from the pass parts because they build sites from synthetic tables, not from a pass; the driver,
its flags and the pass parts are in ``benchmarks/features/__main__.py``, the shared synthetic data in
``benchmarks/features/data.py``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.features.data import GRID, TPI, make_sae, write_photos, write_synthetic_shards

LABEL_PARTS = ("label_stats", "atom_section", "index_columns", "index_headers", "index_section", "index_data")
LABEL_PARTS += ("write_label_pages",)
IMAGE_PARTS = ("write_site_image_pages",)


class SiteData:
    """The datamodule's two attributes the site reads: the source's name and the backbone's preprocessing."""

    source = "synthetic"
    manifest = {
        "backbone": {
            "image_size": 224,
            "preprocess": {
                "library": "timm",
                "size": [224, 224],
                "crop": {"crop_pct": 0.875, "crop_mode": "center"},
                "mean": [0.5] * 3,
                "std": [0.5] * 3,
                "interpolation": "bicubic",
            },
        }
    }


def site_inputs(args: argparse.Namespace, work: Path) -> tuple:
    """A synthetic merged table, its images (JPEGs on disk, heatmaps) and label counts at the site's size.

    Returns ``(sae, state, labelled, collection)``: ``labelled`` is what the pass adds to ``state``
    where the images carry labels (``--site_labels`` of them)."""
    import torch

    d_sae, top, d, n_images = args.site_d_sae, 16, 768, args.site_images
    rng = np.random.default_rng(0)
    images_dpath = work / "site_images"
    write_photos(images_dpath, n_images, rng)
    value = -np.sort(-rng.gamma(2.0, 1.0, (d_sae, top)).astype(np.float32), axis=1)
    image = rng.integers(0, n_images, (d_sae, top))
    for row in image:  # one entry per image per atom
        row[:] = rng.choice(n_images, top, replace=False)
    position = rng.integers(0, TPI, (d_sae, top))
    state = {
        "value": torch.from_numpy(value),
        "token": torch.from_numpy(image * TPI + position),
        "image": torch.from_numpy(image),
        "position": torch.from_numpy(position),
        "fire_count": torch.from_numpy(rng.integers(1, 10**6, d_sae)),
        "value_sum": torch.from_numpy(rng.random(d_sae) * 1e5),
        "step_sum": torch.zeros(d_sae, dtype=torch.int64),
        "step_count": torch.zeros(d_sae, dtype=torch.int64),
        "n_tokens": torch.tensor(334_000_000),
    }
    atoms, ranks = np.nonzero(np.ones((d_sae, top), bool))
    heat = (rng.random((d_sae * top, TPI)) * value.reshape(-1, 1)).astype(np.float16)
    collection = {
        "images": {
            i: {"image_id": f"n0000/{i}.jpg", "label": i % 1000, "source": str(images_dpath / f"{i}.jpg")}
            for i in range(n_images)
        },
        "heat_atom": atoms,
        "heat_rank": ranks,
        "heat": heat,
    }

    sae = make_sae(d, d_sae, 32)
    n_labels = args.site_labels
    image_label = np.arange(n_images) % n_labels
    fire = rng.poisson(rng.gamma(0.3, 2.0, (d_sae, 1)) * np.ones(n_labels), (d_sae, n_labels))
    fire = np.minimum(fire, np.bincount(image_label, minlength=n_labels)[None, :])
    labelled = {
        "label_fire": torch.from_numpy(fire.astype(np.int64)),
        "label_fire_unlabelled": torch.zeros(d_sae, dtype=torch.int64),
        "label_images": torch.from_numpy(np.bincount(image_label, minlength=n_labels).astype(np.int64)),
        "label_images_unlabelled": torch.tensor(0),
    }
    activation = rng.gamma(2.0, 0.5, (d_sae, n_labels))  # each atom's mean activation on a label's images
    labelled["label_weight"] = torch.from_numpy(fire * activation)
    labelled["label_weight_sq"] = torch.from_numpy((fire * activation**2 * 1.5).sum(1))  # spread: E[a^2] = 1.5 E[a]^2
    labelled["label_weight_unlabelled"] = torch.zeros(d_sae, dtype=torch.float64)
    labelled["label_weight_sq_unlabelled"] = torch.zeros(d_sae, dtype=torch.float64)
    for i, meta in collection["images"].items():
        meta["label"], meta["class_name"] = int(image_label[i]), f"n{image_label[i]:08d}"
    return sae, state, labelled, collection


def site(args: argparse.Namespace, work: Path) -> None:
    from sae_pipeline.features.heatmaps import Layout
    from sae_pipeline.features.site import build_site

    d_sae, top, n_images, n_labels = args.site_d_sae, 16, args.site_images, args.site_labels
    sae, state, labelled, collection = site_inputs(args, work)
    print(
        f"3. site for d_sae = {d_sae}, N = {top} ({d_sae * top:,} entries over {n_images:,} distinct images, "
        f"DINOv2 layout)"
    )
    label_parts(work, {**state, **labelled}, collection, n_labels)
    times: dict[str, list[float]] = {}
    sides = (("without labels", {}), (f"with {n_labels} labels", labelled))
    for side, extra in [*sides, *sides][: 2 * args.site_rounds]:  # alternate; the best of each side
        out = work / f"site_{len(extra)}"
        shutil.rmtree(out, ignore_errors=True)
        start, cpu_start = time.perf_counter(), time.process_time()
        build_site(out, sae, {**state, **extra}, collection, Layout("patches", TPI, 1, 4, GRID), SiteData())
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        times.setdefault(side, []).append((seconds, cpu))  # CPU seconds too: a shared box's wall time is noisy
        files = [p for p in out.rglob("*") if p.is_file()]
        total = sum(p.stat().st_size for p in files)
        by_kind = {kind: sum(p.stat().st_size for p in files if kind in p.parts) for kind in ("atoms", "thumbs")}
        labels = sum(p.stat().st_size for p in files if "labels" in p.parts)
        print(
            f"   {side}: build {seconds:.1f} s ({cpu:.1f} s CPU); {len(files):,} files, {total / 1e6:,.0f} MB "
            f"(atom pages {by_kind['atoms'] / 1e6:,.0f} MB, thumbnails {by_kind['thumbs'] / 1e6:,.0f} MB, "
            f"label pages {labels / 1e6:,.1f} MB, index {(out / 'index.html').stat().st_size / 1e6:.1f} MB)"
        )
    if not times:
        return
    (base_wall, base_cpu), (wall, cpu) = ([min(t[i] for t in side) for i in (0, 1)] for side in times.values())
    print(
        f"   label statistics add {100 * (wall / base_wall - 1):+.0f} % to the build's wall time, "
        f"{100 * (cpu / base_cpu - 1):+.0f} % to its CPU time (best of each side)"
    )


def label_parts(work: Path, state: dict, collection: dict, n_labels: int) -> None:
    """CPU seconds of the site's label parts alone (what a labelled site adds; a whole build's time on a shared box
    varies more than that): the statistics, every atom's label section and index cells, the label pages."""
    from sae_pipeline.features import label_pages
    from sae_pipeline.features.selectivity import label_stats

    d_sae = state["value"].shape[0]
    marks = [time.process_time()]
    stats = label_stats(state, collection)
    marks.append(time.process_time())
    for atom in range(d_sae):
        label_pages.atom_section(stats, atom, state["value"].shape[1])
        label_pages.index_columns(stats, atom)
    label_pages.index_section(stats)
    marks.append(time.process_time())
    root = work / "label_parts"
    (root / "assets").mkdir(parents=True)
    thumbs = {key: f"thumbs/{key}.jpg" for key in collection["images"]}
    label_pages.write_label_pages(root, stats, state["image"].numpy(), thumbs, lambda a: f"{a}.html", False)
    marks.append(time.process_time())
    parts = np.diff(marks)
    print(
        f"   label parts alone ({n_labels} labels): {parts.sum():.1f} s CPU (statistics {parts[0]:.1f} s, atom "
        f"sections and index cells {parts[1]:.1f} s, label pages {parts[2]:.1f} s)"
    )


def timed_parts(names: tuple[str, ...], totals: dict[str, list[float]]) -> list[tuple[Any, str, Any]]:
    """Wrap every binding of the functions ``names`` in the features package with a timer adding
    ``[wall, CPU]`` seconds to ``totals[name]`` (wherever the site looks them up: a module's own
    import or another module's attribute); returns what to put back."""
    import functools

    import sae_pipeline.features as package

    originals = {}
    for module in [m for n, m in sorted(sys.modules.items()) if n.startswith(package.__name__ + ".")]:
        for name in names:
            if name in vars(module) and callable(vars(module)[name]):
                originals.setdefault(name, vars(module)[name])
    restore = []
    for name, function in originals.items():
        totals[name] = [0.0, 0.0]

        @functools.wraps(function)
        def timed(*a, _function=function, _total=totals[name], **kw):  # noqa: ANN002, ANN003, ANN202
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return _function(*a, **kw)
            finally:
                _total[0] += time.perf_counter() - start
                _total[1] += time.process_time() - cpu

        for module in [m for n, m in sys.modules.items() if n.startswith(package.__name__ + ".")]:
            if vars(module).get(name) is function:
                restore.append((module, name, function))
                setattr(module, name, timed)
    return restore


def site_shares(args: argparse.Namespace, work: Path) -> None:
    """One labelled build with image pages, its label statistics and image pages timed inside it.

    The images' own top atoms (``collect_images`` ranks them from each image's sparse codes, after the
    pass) come from synthetic sparse codes, ``k`` atoms per token: only the grouping per image
    (``split_images``) and the ranking are timed."""
    import torch

    from sae_pipeline.features import label_pages, site  # noqa: F401  (the modules whose bindings are timed)
    from sae_pipeline.features.heatmaps import Layout
    from sae_pipeline.features.image_codes import split_images
    from sae_pipeline.features.image_top import image_top_atoms
    from sae_pipeline.features.site import build_site
    from sae_pipeline.sae.inference_codes import from_dense

    d_sae, top, n_images, n_labels = args.site_d_sae, 16, args.site_images, args.site_labels
    sae, state, labelled, collection = site_inputs(args, work)
    print(
        f"3c. labelled site with image pages, d_sae = {d_sae}, N = {top}, {n_images:,} images, {n_labels} labels; "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    rng = np.random.default_rng(1)
    rank_wall = rank_cpu = 0.0
    positions = np.arange(TPI)
    for meta in collection["images"].values():
        codes = np.zeros((TPI, d_sae), np.float32)
        rows = np.repeat(np.arange(TPI), args.k)
        codes[rows, rng.integers(0, d_sae, len(rows))] = rng.gamma(2.0, 1.0, len(rows))
        entries = from_dense(torch.from_numpy(codes))  # what the SAE's encode_sparse gives
        start, cpu = time.perf_counter(), time.process_time()
        meta["top_atoms"] = image_top_atoms(split_images(entries, TPI)[0], positions, TPI)
        rank_wall, rank_cpu = rank_wall + time.perf_counter() - start, rank_cpu + time.process_time() - cpu
    totals: dict[str, list[float]] = {}
    restore = timed_parts(LABEL_PARTS + IMAGE_PARTS, totals)
    out = work / "site_shares"
    try:
        start, cpu = time.perf_counter(), time.process_time()
        build_site(out, sae, {**state, **labelled}, collection, Layout("patches", TPI, 1, 4, GRID), SiteData())
        build_wall, build_cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        for module, name, function in restore:
            setattr(module, name, function)
    print(f"    load average after the build {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    total = np.array([build_wall + rank_wall, build_cpu + rank_cpu])
    label = sum(np.array(totals[name]) for name in LABEL_PARTS)
    image = sum(np.array(totals[name]) for name in IMAGE_PARTS) + np.array([rank_wall, rank_cpu])
    rest = total - label - image
    print(
        f"    whole: build_site {build_wall:.1f} s ({build_cpu:.1f} s CPU) + image rankings {rank_wall:.1f} s "
        f"({rank_cpu:.1f} s CPU) = {total[0]:.1f} s ({total[1]:.1f} s CPU)"
    )
    for name in LABEL_PARTS + IMAGE_PARTS:
        print(f"      {name:<24} {totals[name][0]:8.2f} s ({totals[name][1]:.2f} s CPU)")
    print(f"      {'image_top_atoms':<24} {rank_wall:8.2f} s ({rank_cpu:.2f} s CPU)")
    print(f"    build without them: {rest[0]:.1f} s ({rest[1]:.1f} s CPU)")
    for what, part in (("label statistics", label), ("image pages", image), ("both", label + image)):
        print(
            f"    {what:<16} {part[0]:7.1f} s ({part[1]:.1f} s CPU): +{100 * part[0] / rest[0]:.1f} % wall, "
            f"+{100 * part[1] / rest[1]:.1f} % CPU of the build without them"
        )
    print(f"    target <= 25 % (both, CPU): {'met' if label[1] + image[1] <= 0.25 * rest[1] else 'NOT met'}")


def run_shares(args: argparse.Namespace, work: Path) -> None:
    """One whole ``features`` run in this process (pass, re-read for the heatmaps, site), its label statistics
    and image pages timed inside it: ``--site_images`` images of synthetic tokens in DINOv2's layout (each its
    own label of 1000), a TopK SAE of ``--site_d_sae`` atoms at d = 768, N = 16; no DataLoader workers, so
    the process's CPU time is the whole run's."""
    import torch
    from safetensors.torch import save_file

    from sae_pipeline.__main__ import main as sae_main
    from sae_pipeline.artifacts.export import EXPORT_FORMAT
    from sae_pipeline.features import cli, heatmaps, label_pages, labels, pass_module, site  # noqa: F401
    from sae_pipeline.sae.config import sae_config

    d, d_sae, n_images = 768, args.site_d_sae, args.site_images
    write_photos(work / "run_photos", n_images, np.random.default_rng(0))
    write_synthetic_shards(work / "run_shards", n_images, d, photos=work / "run_photos")
    sae = make_sae(d, d_sae, args.k)
    sae_dpath = work / "run_sae"
    sae_dpath.mkdir()
    config = {"format": EXPORT_FORMAT, **sae_config(sae), "d_in": sae.d_in, "d_sae": sae.d_sae}
    (sae_dpath / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in sae.state_dict().items()}, str(sae_dpath / "sae.safetensors"))
    print(
        f"3d. whole features run: {n_images:,} images x {TPI} tokens, d {d}, TopK d_sae {d_sae} k {args.k}, N 16, "
        f"1000 labels, {args.device}, torch threads {torch.get_num_threads()}; load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}",
        flush=True,
    )
    totals: dict[str, list[float]] = {}
    phases = ("collect_images", "build_site")
    restore = timed_parts(LABEL_PARTS + IMAGE_PARTS + ("split_images", "image_top_atoms") + phases, totals)
    update = labels.LabelCounts.update
    totals["LabelCounts.update"] = [0.0, 0.0]

    def timed_update(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return update(*a, **kw)
        finally:
            totals["LabelCounts.update"][0] += time.perf_counter() - start
            totals["LabelCounts.update"][1] += time.process_time() - cpu

    labels.LabelCounts.update = timed_update
    command = ["features", "--sae", str(sae_dpath), "--data.source", str(work / "run_shards")]
    command += ["--out", str(work / "run_site"), "--top", "16", "--data.num_workers", "0"]
    command += ["--data.batch_size", str(args.batch_size), "--trainer.accelerator", args.device]
    try:
        start, cpu = time.perf_counter(), time.process_time()
        assert sae_main(command) == 0
        total = np.array([time.perf_counter() - start, time.process_time() - cpu])
    finally:
        labels.LabelCounts.update = update
        for module, name, function in restore:
            setattr(module, name, function)
    print(f"    load average after the run {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    label_names = ("LabelCounts.update", *LABEL_PARTS)
    image_names = ("split_images", "image_top_atoms", *IMAGE_PARTS)
    label = sum(np.array(totals[name]) for name in label_names)
    image = sum(np.array(totals[name]) for name in image_names)
    pass_ = total - np.array(totals["collect_images"]) - np.array(totals["build_site"])
    print(
        f"    whole run {total[0]:.1f} s ({total[1]:.1f} s CPU): pass and setup {pass_[0]:.1f} s ({pass_[1]:.1f} s CPU)"
    )
    for name in (*phases, *label_names, *image_names):
        print(f"      {name:<24} {totals[name][0]:8.2f} s ({totals[name][1]:.2f} s CPU)")
    site_ = np.array(totals["build_site"]) + np.array(totals["split_images"]) + np.array(totals["image_top_atoms"])
    for base_name, base in (("whole run", total), ("site (build_site + image rankings)", site_)):
        rest = base - label - image
        if base_name != "whole run":
            rest = rest + np.array(totals["LabelCounts.update"])  # the counting is in the pass, not the site
        print(f"    against the {base_name} without them: {rest[0]:.1f} s ({rest[1]:.1f} s CPU)")
        for what, part in (("label statistics", label), ("image pages", image), ("both", label + image)):
            if base_name != "whole run":
                part = part - (np.array(totals["LabelCounts.update"]) if what != "image pages" else 0)
            print(
                f"      {what:<16} {part[0]:7.1f} s ({part[1]:.1f} s CPU): +{100 * part[0] / rest[0]:.1f} % wall, "
                f"+{100 * part[1] / rest[1]:.1f} % CPU"
            )
