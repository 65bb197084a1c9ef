"""Benchmark: the feature browser's pass against a bare ``predict`` pass, its memory, and the site's cost.

    python -m benchmarks.features                    # every part (CPU sizes below)
    python -m benchmarks.features --device cuda      # parts 1 and 2 on a GPU
    python -m benchmarks.features --quick            # tiny sizes (a smoke run)
    python -m benchmarks.features --parts explain    # features explain of one image
    python -m benchmarks.features --parts run_shares # issue 24: label statistics + image pages in one whole run

1. Throughput, same run, same data: synthetic shards in DINOv2's token layout (CLS + 4
   registers + 16x16 patches = 261 tokens per image), a TopK SAE, both sides through
   ``trainer.predict`` over ``ActivationDataModule``'s predict loader. "bare predict" is
   ``SAEModule.predict_step`` (encode + sparse codes, nothing kept or written); "features pass"
   is :class:`FeaturesModule` (encode + the exact top-N table + statistics) timed to the end of
   its streaming pass; "features all" adds the end of the run (rank merge and the re-read of
   the top images' tokens for the heatmaps). Sides alternate for ``--repeats`` rounds; the
   median tokens/s of each is compared (target: features pass >= 0.7 x bare predict).
2. Peak memory against the token count: the features pass over N and 4N tokens, each in a
   fresh process; peak RSS (CPU) or ``torch.cuda.max_memory_allocated`` (GPU). Flat means the
   4N/N ratio stays near 1 (the table is d_sae x N_top; no [tokens, d_sae] buffer).
3. The site for d_sae = 19 200, N = 16 (synthetic table and images): build time and size,
   without and with label statistics (``--site_labels`` labels, ImageNet's 1000 by default:
   atom sections, index columns and scatter, one page per label), each built from scratch.
3c. (``site_shares``) One labelled site of that size with image pages: the label statistics
   (``label_stats``, the atom sections with their label bars, index cells, headers, section and
   scatter data, the label pages) and the image pages (each image's top atoms ranked from
   synthetic sparse codes, as ``collect_images`` does, and ``write_site_image_pages``) timed
   inside the one build, wall and CPU, as shares of the build without them.
3d. (``run_shares``) The same shares in one whole ``features`` run in this process, pass and
   re-read included: synthetic shards of ``--site_images`` images (JPEG sources, 1000 labels),
   a TopK SAE of ``--site_d_sae`` atoms; the label counts in the pass (``LabelCounts.update``)
   join the label statistics. Shares of the whole run and of its site (``build_site`` plus the
   image rankings) without them; target: both together <= 25 %.
4. ``features explain`` of one image (a 256x256 JPEG) with ViT-B/16 (``vit``, random weights
   from a recorded seed: no download) and a TopK SAE (d_sae 6144): the whole command once (SAE,
   backbone build, one image, its page), then, with the backbone and SAE loaded, the cost of one
   image (forward, SAE encode, top atoms, page) against a bare backbone forward + SAE encode of
   the same image in the same run (median of ``--repeats`` alternated rounds; target about 1).
5. The label counts' cost in the pass, measured apart: ``LabelCounts.update`` against the
   top-N table's update on the same codes, and the shard read with and without ``meta.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.scaling_fit import run_measured

warnings.filterwarnings("ignore")
REPO_DPATH = Path(__file__).resolve().parents[1]  # the children run `python -m benchmarks.features` from here

N_PREFIX, GRID = 5, (16, 16)
TPI = N_PREFIX + GRID[0] * GRID[1]


def write_synthetic_shards(
    dpath: Path, n_images: int, d: int, images_per_shard: int = 64, seed: int = 0, photos: Path | None = None
) -> None:
    """Shards in DINOv2's layout; with ``photos``, each sample's source is ``photos/<i>.jpg`` (see write_photos)."""
    from feature_extraction import shards as S

    rng = np.random.default_rng(seed)
    n_shards = 0
    for index, start in enumerate(range(0, n_images, images_per_shard)):
        count = min(images_per_shard, n_images - start)
        samples = [
            (
                f"img{start + i:07d}",
                rng.standard_normal((TPI, d)).astype(np.float16),
                {"image_id": f"img{start + i:07d}", "label": (start + i) % 1000, "source": "skimage.data.astronaut"}
                if photos is None
                else {
                    "image_id": f"{start + i}.jpg",
                    "label": (start + i) % 1000,
                    "class_name": f"n{(start + i) % 1000:08d}",
                    "source": str(photos / f"{start + i}.jpg"),
                },
            )
            for i in range(count)
        ]
        S.write_shard(dpath, index, samples)
        n_shards += 1
    S.write_manifest(
        dpath,
        n_shards=n_shards,
        spec={"name": "synthetic", "image_size": 224},
        layer=0,
        tokens_per_image=TPI,
        n_prefix_tokens=N_PREFIX,
        grid=GRID,
    )


def make_sae(d: int, d_sae: int, k: int, seed: int = 0):  # noqa: ANN201
    import torch

    from sae_pipeline.sae import TopKSAE

    torch.manual_seed(seed)
    return TopKSAE(d_in=d, d_sae=d_sae, k=k).eval()


def timed_predict(side: str, shards: Path, sae, batch_size: int, device: str, top: int) -> dict:  # noqa: ANN001
    """One pass of ``side`` ("bare" or "features"); returns tokens and seconds (pass, and whole run)."""
    import lightning as L
    import torch

    from sae_pipeline.data import ActivationDataModule
    from sae_pipeline.features.heatmaps import layout_of
    from sae_pipeline.features.pass_module import FeaturesModule
    from sae_pipeline.training.module import SAEModule

    dm = ActivationDataModule(
        str(shards), batch_size=batch_size, num_workers=2, shuffle_buffer_tokens=batch_size, val_fraction=0.0
    )
    marks: dict[str, float] = {}

    class Bare(SAEModule):
        def on_predict_start(self) -> None:
            self.trainer.predict_loop.return_predictions = False

        def predict_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            super().predict_step(batch, batch_idx)

    class Features(FeaturesModule):
        def on_predict_end(self) -> None:
            if device == "cuda":
                torch.cuda.synchronize()
            marks["pass_end"] = time.perf_counter()
            super().on_predict_end()

    module = Bare(sae) if side == "bare" else Features(sae, top, layout_of(dm.data_source))
    if side == "bare":
        module.initialized_from_data.fill_(True)  # raw units, like the features side
    trainer = L.Trainer(
        accelerator=device,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.predict(module, datamodule=dm)
    if device == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    n_tokens = dm.data_source.manifest["n_tokens"]
    return {"tokens": n_tokens, "seconds": marks.get("pass_end", end) - start, "seconds_all": end - start}


def throughput(args: argparse.Namespace, work: Path) -> None:
    shards = work / "throughput"
    write_synthetic_shards(shards, args.images, args.d)
    sae = make_sae(args.d, args.d_sae, args.k)
    print(
        f"1. throughput: {args.images} images x {TPI} tokens = {args.images * TPI} tokens, d {args.d}, TopK d_sae "
        f"{args.d_sae} k {args.k}, batch {args.batch_size}, top {args.top}, device {args.device}"
    )
    rates: dict[str, list[float]] = {"bare predict": [], "features pass": [], "features all": []}
    timed_predict("features", shards, sae, args.batch_size, args.device, args.top)  # warm-up (caches, threads)
    for round_index in range(args.repeats):
        bare = timed_predict("bare", shards, sae, args.batch_size, args.device, args.top)
        feat = timed_predict("features", shards, sae, args.batch_size, args.device, args.top)
        rates["bare predict"].append(bare["tokens"] / bare["seconds"])
        rates["features pass"].append(feat["tokens"] / feat["seconds"])
        rates["features all"].append(feat["tokens"] / feat["seconds_all"])
        print(
            f"   round {round_index + 1}: bare {rates['bare predict'][-1]:,.0f} tok/s, features pass "
            f"{rates['features pass'][-1]:,.0f} tok/s, with end of run {rates['features all'][-1]:,.0f} tok/s"
        )
    medians = {name: statistics.median(values) for name, values in rates.items()}
    for name, value in medians.items():
        print(f"   {name:<14} {value:>12,.0f} tokens/s (median)")
    ratio = medians["features pass"] / medians["bare predict"]
    print(
        f"   features pass / bare predict = {ratio:.2f} (target >= 0.7); with the end of the run: "
        f"{medians['features all'] / medians['bare predict']:.2f}"
    )


def memory_child(shards: str, d: int, d_sae: int, k: int, batch_size: int, device: str, top: int) -> None:
    import torch

    result = timed_predict("features", Path(shards), make_sae(d, d_sae, k), batch_size, device, top)
    if device == "cuda":
        result["peak_bytes"] = torch.cuda.max_memory_allocated()
    else:
        result["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps(result))


def memory(args: argparse.Namespace, work: Path) -> None:
    measured = "GPU allocated" if args.device == "cuda" else "RSS"
    print(f"2. peak memory of the features pass (fresh process each; {measured})")
    peaks = []
    for factor in (1, 4):
        shards = work / f"memory{factor}"
        write_synthetic_shards(shards, args.memory_images * factor, args.d, seed=factor)
        command = [
            sys.executable,
            "-m",
            "benchmarks.features",
            "--memory-child",
            str(shards),
            "--d",
            str(args.d),
            "--d_sae",
            str(args.d_sae),
            "--k",
            str(args.k),
            "--batch_size",
            str(args.batch_size),
            "--device",
            args.device,
            "--top",
            str(args.top),
        ]
        # From a small launcher: a child forked straight from this driver would start its ru_maxrss at the
        # driver's RSS (Linux carries it across fork + exec) and hide the growth this part measures.
        out = run_measured(command, cwd=REPO_DPATH, timeout=None)["stdout"]
        result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        peaks.append(result["peak_bytes"])
        print(f"   {result['tokens']:>10,} tokens: peak {result['peak_bytes'] / 2**20:,.0f} MiB")
    print(f"   4x tokens / 1x tokens peak = {peaks[1] / peaks[0]:.3f}")


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


def write_photos(dpath: Path, n_images: int, rng: np.random.Generator) -> None:
    """``<i>.jpg``: smooth synthetic photos (gradients and a disc), 256x256 JPEG like ImageNet's."""
    from PIL import Image

    dpath.mkdir(exist_ok=True)  # parts run one after another in one work folder
    yy, xx = np.mgrid[0:256, 0:256] / 256.0
    for i in range(n_images):
        c = rng.random((3, 3))
        disc = ((xx - c[0, 0]) ** 2 + (yy - c[0, 1]) ** 2 < 0.05 + 0.1 * c[0, 2])[..., None]
        array = (np.stack([c[1, j] * xx + c[2, j] * yy for j in range(3)], -1) * 0.6 + disc * 0.4) * 255
        Image.fromarray(array.astype(np.uint8)).save(dpath / f"{i}.jpg", quality=90)


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


LABEL_PARTS = ("label_stats", "atom_section", "index_columns", "index_headers", "index_section", "index_data")
LABEL_PARTS += ("write_label_pages",)
IMAGE_PARTS = ("write_site_image_pages",)


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

    The images' own top atoms (``collect_images`` ranks them from each image's codes, after the
    pass) come from synthetic sparse codes, ``k`` atoms per token: only the ranking is timed."""
    from sae_pipeline.features import label_pages, site  # noqa: F401  (the modules whose bindings are timed)
    from sae_pipeline.features.heatmaps import Layout
    from sae_pipeline.features.image_top import image_top_atoms
    from sae_pipeline.features.site import build_site

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
        start, cpu = time.perf_counter(), time.process_time()
        meta["top_atoms"] = image_top_atoms(codes, positions, TPI)
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
    restore = timed_parts(LABEL_PARTS + IMAGE_PARTS + ("image_top_atoms",) + phases, totals)
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
    image_names = ("image_top_atoms", *IMAGE_PARTS)
    label = sum(np.array(totals[name]) for name in label_names)
    image = sum(np.array(totals[name]) for name in image_names)
    pass_ = total - np.array(totals["collect_images"]) - np.array(totals["build_site"])
    print(
        f"    whole run {total[0]:.1f} s ({total[1]:.1f} s CPU): pass and setup {pass_[0]:.1f} s ({pass_[1]:.1f} s CPU)"
    )
    for name in (*phases, *label_names, *image_names):
        print(f"      {name:<24} {totals[name][0]:8.2f} s ({totals[name][1]:.2f} s CPU)")
    site_ = np.array(totals["build_site"]) + np.array(totals["image_top_atoms"])
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


def label_cost(args: argparse.Namespace, work: Path) -> None:
    """The label counts' share of the pass, measured apart (the pass's tokens/s on a shared box is too noisy to
    show a few per cent): per batch, ``LabelCounts.update`` beside ``TopNTable.update_codes`` on the same codes,
    and the shard read with and without ``meta.json``; CPU seconds, sides alternated."""
    import torch

    from feature_extraction.shards import shard_fpaths
    from feature_extraction.shards.read import iter_shard_tokens
    from sae_pipeline.data.sources import ShardSource
    from sae_pipeline.features.labels import LabelCounts
    from sae_pipeline.features.topn import TopNTable

    shards = work / "label_cost"
    write_synthetic_shards(shards, args.images, args.d)
    sae = make_sae(args.d, args.d_sae, args.k)
    source = ShardSource(shards)
    tokens = np.concatenate([c.tokens for u in source.units("all", 0.0) for c in u.read(0, u.n_tokens)])
    batches = []
    with torch.no_grad():
        for start in range(0, len(tokens), args.batch_size):
            x = torch.from_numpy(tokens[start : start + args.batch_size].astype(np.float32))
            token = torch.arange(start, start + len(x))
            batches.append((sae.encode(x), token, token // TPI, (token // TPI) % 1000))
    table, counts = TopNTable(args.d_sae, args.top), LabelCounts(args.d_sae, TPI)
    table_cpu = counts_cpu = 0.0
    for codes, token, image, label in batches:
        start = time.process_time()
        rows, atoms = table.update_codes(codes, token, image, token % TPI)
        middle = time.process_time()
        counts.update(rows, atoms, image, label)
        table_cpu, counts_cpu = table_cpu + middle - start, counts_cpu + time.process_time() - middle
    print(
        f"5. label counts in the pass: {len(tokens):,} tokens ({len(batches)} batches of {args.batch_size}), "
        f"TopK d_sae {args.d_sae} k {args.k}, {TPI} tokens per image, 1000 labels"
    )
    print(
        f"   top-N table {table_cpu:.2f} s CPU, label counts {counts_cpu:.2f} s CPU "
        f"(+{100 * counts_cpu / table_cpu:.0f} % of the table's update; encoding not included)"
    )
    reads = {False: [], True: []}
    fpaths = shard_fpaths(source.name, source.manifest)
    for _ in range(max(args.repeats, 1)):
        for with_meta in (False, True):
            start = time.process_time()
            for fpath in fpaths:
                for _ in iter_shard_tokens(fpath, with_positions=True, with_meta=with_meta):
                    pass
            reads[with_meta].append(time.process_time() - start)
    plain, meta = min(reads[False]), min(reads[True])
    print(
        f"   shard read {plain:.3f} s CPU, with meta.json {meta:.3f} s CPU (+{100 * (meta / plain - 1):.0f} %; "
        f"best of {max(args.repeats, 1)})"
    )


def explain(args: argparse.Namespace, work: Path) -> None:
    import json

    import torch
    from PIL import Image
    from safetensors.torch import save_file

    from feature_extraction.backbones import load_backbone
    from sae_pipeline.__main__ import main as sae_main
    from sae_pipeline.artifacts.export import EXPORT_FORMAT
    from sae_pipeline.features.explain import build_backbone, dense_codes, explain_images, image_records, write_pages
    from sae_pipeline.sae.config import sae_config

    name = args.explain_backbone
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        backbone = load_backbone(name)
    spec = backbone.spec
    record = {
        "backbone": json.loads(json.dumps(backbone.to_json())),
        "layer": backbone.layer,
        "weights": {"pretrained": False, "checkpoint_path": None, "seed": 0},
        "token_selection": None,
        "d": spec.d,
    }
    sae = make_sae(spec.d, args.explain_d_sae, args.k)
    sae_dpath = work / "explain_sae"
    sae_dpath.mkdir()
    config = {"format": EXPORT_FORMAT, **sae_config(sae), "d_in": sae.d_in, "d_sae": sae.d_sae}
    (sae_dpath / "config.json").write_text(json.dumps({**config, "data": {"extraction": record}}))
    save_file({k: v.contiguous() for k, v in sae.state_dict().items()}, str(sae_dpath / "sae.safetensors"))
    yy, xx = np.mgrid[0:256, 0:256] / 256.0
    image_fpath = work / "photo.jpg"
    Image.fromarray((np.stack([xx, yy, xx * yy], -1) * 255).astype(np.uint8)).save(image_fpath, quality=90)
    start = time.perf_counter()
    code = sae_main(
        ["features", "explain", "--sae", str(sae_dpath), "--images", str(image_fpath), "--out", str(work / "ex0")]
    )
    command = time.perf_counter() - start
    assert code == 0
    backbone = build_backbone(record, None, sae.d_in)
    records = image_records([str(image_fpath)])
    summary = {
        "sae": str(sae_dpath),
        "site": None,
        "backbone": name,
        "layer": backbone.layer,
        "images": [],
        "skipped": [],
    }
    bare_s, explain_s = [], []
    with torch.no_grad():
        for i in range(args.repeats):
            start = time.perf_counter()
            with Image.open(image_fpath) as image:
                pixels = backbone.preprocess(image.convert("RGB"))[None]
            tokens = backbone(pixels)
            dense_codes(sae, tokens[0].float())
            bare_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            result = explain_images(sae, backbone, record, records, 1, "cpu")
            write_pages(work / f"ex{i + 1}", result, backbone, None, sae, summary)
            explain_s.append(time.perf_counter() - start)
            print(f"   round {i + 1}: bare forward + encode {bare_s[-1]:.3f} s, explain's image {explain_s[-1]:.3f} s")
    bare, ours = statistics.median(bare_s), statistics.median(explain_s)
    print(
        f"4. explain of one image: {name} ({spec.n_tokens} tokens of {spec.d}), TopK d_sae {sae.d_sae}, k {sae.k}, CPU"
    )
    print(f"   whole command (load SAE, build backbone, one image, its page): {command:.2f} s")
    print(f"   one image: bare forward + SAE encode {bare:.3f} s (median), explain {ours:.3f} s (median)")
    print(f"   explain / (bare forward + encode) = {ours / bare:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--parts", nargs="+", default=["throughput", "memory", "site", "explain", "labels"])
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--memory_images", type=int, default=200)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--d_sae", type=int, default=4096)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--top", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--site_d_sae", type=int, default=19_200)
    parser.add_argument("--site_images", type=int, default=4096)
    parser.add_argument("--site_labels", type=int, default=1000)
    parser.add_argument(
        "--site_rounds", type=int, default=2, help="builds per side, alternating (at most 2; 0: the label parts only)"
    )
    parser.add_argument("--explain_backbone", default="vit")
    parser.add_argument("--explain_d_sae", type=int, default=6144)
    parser.add_argument("--memory-child", dest="memory_child")
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child, args.d, args.d_sae, args.k, args.batch_size, args.device, args.top)
        return
    if args.quick:
        args.images, args.memory_images, args.d_sae, args.repeats = 20, 10, 512, 1
        args.site_d_sae, args.site_images, args.site_labels = 256, 64, 10
        args.explain_backbone, args.explain_d_sae = "vit_tiny", 512
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        parts = {
            "throughput": throughput,
            "memory": memory,
            "site": site,
            "site_shares": site_shares,
            "run_shares": run_shares,
            "explain": explain,
            "labels": label_cost,
        }
        for part in args.parts:
            parts[part](args, work)


if __name__ == "__main__":
    main()
