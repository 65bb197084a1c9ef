"""Parts of ``python -m benchmarks.scaling``: the commands around the kernels, each point one fresh process.

- ``fit_startup_shards``: ``fit``'s start-up (the command's start to its first training step: flags,
  manifest, sidecars and integrity checks, the train/val split, the first batch) and peak RSS against
  the number of shards (10 -> 10 000 shards of 2 images x 9 tokens, d 16). Expected: time slope <= 1,
  memory slope <= 1 (a few hundred bytes of manifest entry and sidecar per shard).
- ``features_d_sae`` / ``features_n``: ``features``' streaming pass and site build, apart, against d_sae
  and against N (top images per atom). Expected: the pass ~ d_sae (the encoder) and flat in N; the site
  ~ d_sae (one page per atom) and ~ N (N cards per page); memory <= the d_sae x N table.
- ``extract_images``: ``python -m feature_extraction`` with the tiny random ViT against the number of
  images: time slope 1, memory flat (shards are written as they fill).
- ``memory_tokens``: ``fit`` (one epoch), ``features`` and ``python -m sae_pipeline.evaluate sae`` against
  the number of tokens (more shards of the same size): time slope 1, memory slope 0.

Times exclude the libraries' imports (the same at every size; see ``benchmarks/scaling/commands.py``),
and the memory slopes are fitted on the peak RSS above what those imports leave.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np

from benchmarks.scaling import commands
from benchmarks.scaling.fit import Curve, run_point

WRAPPER = "benchmarks.scaling.commands"
REPO_DPATH = Path(__file__).resolve().parents[2]
# No progress bar, summary, figures or sanity check: the curves measure the product's work, not the terminal's.
QUIET_FIT = [
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.num_sanity_val_steps=0",
    "--figures.every_n_val_epochs=1000",
]


@contextmanager
def _no_fsync():  # noqa: ANN202
    """The writers fsync every file (durability); scratch data for a benchmark needs none, and 10 000 shards
    written with it take minutes on this box."""
    with mock.patch("os.fsync", lambda fd: None):
        yield


def write_tiny_shards(dpath: Path, n_shards: int, images_per_shard: int = 2, tokens: int = 9, d: int = 16) -> None:
    from benchmarks.loader import write_shards

    with _no_fsync():
        write_shards(dpath, n_shards, images_per_shard, tokens, d)


def write_image_shards(dpath: Path, n_images: int, d: int, images_per_shard: int = 16) -> None:
    """Shards in DINOv2's token layout whose images are scikit-image's bundled astronaut (the site draws them)."""
    from benchmarks.features.data import write_synthetic_shards

    with _no_fsync():
        write_synthetic_shards(dpath, n_images, d, images_per_shard=images_per_shard)


def write_sae(dpath: Path, d_in: int, d_sae: int, k: int) -> Path:
    """A random TopK SAE as ``python -m sae_pipeline export`` writes it (config.json + sae.safetensors)."""
    from benchmarks.features.data import make_sae
    from sae_pipeline.artifacts.export import EXPORT_FORMAT
    from sae_pipeline.artifacts.export_files import CONFIG_FNAME, WEIGHTS_FNAME, write_export_files
    from sae_pipeline.sae.config import sae_config

    sae = make_sae(d_in, d_sae, k)
    config = {"format": EXPORT_FORMAT, **sae_config(sae), "d_in": d_in, "d_sae": d_sae}
    tensors = {name: value.contiguous() for name, value in sae.state_dict().items()}
    return write_export_files(dpath, WEIGHTS_FNAME, tensors, None, CONFIG_FNAME, config)


def write_images(dpath: Path, n_images: int, size: int = 64) -> None:
    """``n_images`` random-noise PNGs in a flat folder (no labels)."""
    from PIL import Image

    dpath.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n_images):
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(dpath / f"{i:06d}.png")


def command(kind: str, args: list[str], cwd: Path, in_process: bool = False) -> dict:
    """One point: ``kind`` run by the wrapper with ``cwd`` as working directory (runs/ land there).

    In a fresh process (each size's own peak RSS), or with ``in_process`` (``--quick``: the imports, most
    of a point's time, paid once; the peak is then this process's high-water mark, a smoke value)."""
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        if in_process:
            result = commands.run(kind, args)
            return {**result, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        path = os.pathsep.join(p for p in [str(REPO_DPATH), os.environ.get("PYTHONPATH", "")] if p)
        return run_point(WRAPPER, [kind, *args], env={"PYTHONPATH": path, "PYTHONWARNINGS": "ignore"})
    finally:
        os.chdir(previous)


def fit_args(source: Path, d_sae: int, k: int, batch_size: int, extra: list[str]) -> list[str]:
    return [
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--seed_everything=0",
        "--model.sae=sae_pipeline.sae.TopKSAE",
        f"--model.sae.init_args.d_sae={d_sae}",
        f"--model.sae.init_args.k={k}",
        f"--data.source={source}",
        f"--data.batch_size={batch_size}",
        "--data.num_workers=0",
        f"--data.shuffle_buffer_tokens={batch_size}",
        "--data.val_fraction=0.1",
        *QUIET_FIT,
        *extra,
    ]


def features_args(sae: Path, source: Path, out: Path, top: int) -> list[str]:
    return [
        "--sae",
        str(sae),
        "--data.source",
        str(source),
        "--out",
        str(out),
        "--top",
        str(top),
        "--data.batch_size",
        "4096",
        "--data.num_workers",
        "0",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "1",
    ]


def _offset(points: list[dict]) -> float:
    return min(p["rss_after_imports_mib"] for p in points)


def _peaks(points: list[dict]) -> list[float]:
    return [p["peak_rss_mib"] for p in points]


def fit_startup_shards(args: argparse.Namespace) -> list[Curve]:
    sizes = [10, 40] if args.quick else [10, 100, 1000, 10000]
    points = []
    with tempfile.TemporaryDirectory(prefix="scaling-fit-") as tmp:
        for n in sizes:
            shards = Path(tmp) / f"shards{n}"
            write_tiny_shards(shards, n)
            stop = ["--trainer.max_steps=1", "--trainer.limit_val_batches=0"]
            points.append(command("fit", fit_args(shards, 32, 4, 16, stop), Path(tmp), args.quick))
    return [
        Curve(
            "fit start-up (to step 1)",
            "shards",
            [float(n) for n in sizes],
            [p["first_step_s"] for p in points],
            1.0,
            _peaks(points),
            1.0,
            _offset(points),
            note="command start to the first training_step: flags, manifest, sidecars, split, first batch",
            extra={"imports_s": [p["imports_s"] for p in points], "command_s": [p["command_s"] for p in points]},
        )
    ]


def _features_curves(name: str, x_name: str, xs: list[int], points: list[dict], pass_slope: float) -> list[Curve]:
    extra = {"imports_s": [p["imports_s"] for p in points], "command_s": [p["command_s"] for p in points]}
    return [
        Curve(
            f"features pass vs {name}",
            x_name,
            [float(x) for x in xs],
            [p["pass_s"] for p in points],
            pass_slope,
            _peaks(points),
            1.0,
            _offset(points),
            note="SAE load, checks and the streaming pass (top-N table, statistics); peak RSS of the whole command",
            extra=extra,
        ),
        Curve(
            f"features site vs {name}",
            x_name,
            [float(x) for x in xs],
            [p["site_s"] for p in points],
            1.0,
            note="build_site: the re-read of the top images, atom pages, index, thumbnails, the swap into --out",
            extra=extra,
        ),
    ]


def _features_points(tmp: Path, n_images: int, d: int, configs: list[tuple[int, int]], quick: bool) -> list[dict]:
    shards = tmp / "shards"
    write_image_shards(shards, n_images, d)
    points = []
    for d_sae, top in configs:
        sae = write_sae(tmp / f"sae{d_sae}", d, d_sae, 8)
        points.append(command("features", features_args(sae, shards, tmp / f"site{d_sae}_{top}", top), tmp, quick))
    return points


def features_d_sae(args: argparse.Namespace) -> list[Curve]:
    sizes = [32, 64] if args.quick else [64, 128, 256, 512, 1024]
    top = 4 if args.quick else 8
    with tempfile.TemporaryDirectory(prefix="scaling-features-") as tmp:
        points = _features_points(Path(tmp), 8 if args.quick else 64, 32, [(s, top) for s in sizes], args.quick)
    return _features_curves("d_sae", "d_sae", sizes, points, 1.0)


def features_n(args: argparse.Namespace) -> list[Curve]:
    sizes = [2, 4] if args.quick else [2, 4, 8, 16, 32]
    d_sae = 32 if args.quick else 256
    with tempfile.TemporaryDirectory(prefix="scaling-features-") as tmp:
        points = _features_points(Path(tmp), 8 if args.quick else 64, 32, [(d_sae, n) for n in sizes], args.quick)
    return _features_curves("N", "N (top images per atom)", sizes, points, 0.0)


def extract_images(args: argparse.Namespace) -> list[Curve]:
    sizes = [16, 32] if args.quick else [256, 512, 1024, 2048, 4096]
    points = []
    with tempfile.TemporaryDirectory(prefix="scaling-extract-") as tmp:
        images = Path(tmp) / "images"
        for n in sizes:
            write_images(images, n)  # the first n images of one folder: the next size adds to it
            out = Path(tmp) / f"shards{n}"
            extract = [
                "--backbone=vit_tiny",
                f"--images={images}",
                f"--out={out}",
                "--pretrained=false",
                "--batch_size=64",
                "--shard_size=256",
                "--num_workers=0",
                "--num_writers=1",
                "--device=cpu",
                "--progress=false",
            ]
            points.append(command("extract", extract, Path(tmp), args.quick))
    return [
        Curve(
            "extract (vit_tiny)",
            "images",
            [float(n) for n in sizes],
            [p["command_s"] for p in points],
            1.0,
            _peaks(points),
            0.0,
            _offset(points),
            note="python -m feature_extraction: decode, forward, shard writes, manifest; peak of the process and its "
            "writer",
            extra={"imports_s": [p["imports_s"] for p in points]},
        )
    ]


def memory_tokens(args: argparse.Namespace) -> list[Curve]:
    """fit, features and evaluate over 16x the tokens. ``evaluate`` holds out half the shards (the more tokens,
    the sooner a growing memory shows) with a 2048-atom SAE, whose blocks (``metrics.measure``: 2**24 code
    entries, 8192 rows) the smallest split already fills: from there on, the memory must stay flat."""
    images = [16, 32] if args.quick else [64, 128, 256, 1024]
    d = 32 if args.quick else 128
    d_sae = 64 if args.quick else 512
    rows: dict[str, list[dict]] = {"fit": [], "features": [], "evaluate": []}
    tokens = []
    with tempfile.TemporaryDirectory(prefix="scaling-tokens-") as tmp_name:
        tmp = Path(tmp_name)
        sae = write_sae(tmp / "sae", d, d_sae, 8)
        sae_eval = write_sae(tmp / "sae_eval", d, 128 if args.quick else 2048, 8)
        for n in images:
            shards = tmp / f"shards{n}"
            write_image_shards(shards, n, d, images_per_shard=4 if args.quick else 8)
            tokens.append(json.loads((shards / "manifest.json").read_text())["n_tokens"])
            # the figures' validation sample (--data.eval_tokens, 16 384 by default) fills up as the split grows: a
            # fixed cap that would read as growth here, so it is set below the smallest split
            epoch = ["--trainer.max_epochs=1", "--trainer.limit_val_batches=4", "--data.eval_tokens=1024"]
            rows["fit"].append(command("fit", fit_args(shards, d_sae, 8, 1024, epoch), tmp, args.quick))
            pages = ["--atoms", *map(str, range(16))]  # the pass covers every atom; 16 pages keep the site small
            site = [*features_args(sae, shards, tmp / f"site{n}", 4), *pages]
            rows["features"].append(command("features", site, tmp, args.quick))
            evaluate = ["sae", "--sae", str(sae_eval), "--data", str(shards), "--out", str(tmp / f"eval{n}")]
            evaluate += ["--val_fraction", "0.5", "--k_infer", "8", "--r_max", "8"]
            rows["evaluate"].append(command("evaluate", evaluate, tmp, args.quick))
            for fpath in shards.glob("*.tar"):  # the disk holds one size at a time
                fpath.unlink()
    notes = {
        "fit": "fit, one epoch (validation capped at 4 batches, figures on 1024 tokens)",
        "features": "features, pass + site (top 4, 16 atom pages)",
        "evaluate": "python -m sae_pipeline.evaluate sae (R², L0, Babel on half the shards held out)",
    }
    return [
        Curve(
            f"{kind} vs tokens",
            "tokens",
            [float(t) for t in tokens],
            [p["command_s"] for p in points],
            1.0,
            _peaks(points),
            0.0,
            _offset(points),
            note=notes[kind],
            extra={"imports_s": [p["imports_s"] for p in points]},
        )
        for kind, points in rows.items()
    ]


PARTS: dict[str, Callable[[argparse.Namespace], list[Curve]]] = {
    "fit_startup_shards": fit_startup_shards,
    "features_d_sae": features_d_sae,
    "features_n": features_n,
    "extract_images": extract_images,
    "memory_tokens": memory_tokens,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options of their own: the sizes are fixed (full) or tiny (``--quick``)."""
