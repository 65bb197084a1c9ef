"""Benchmark: tokens/s of the training stream from memory (``--data.cache ram``) against reading the source every epoch.

    python -m benchmarks.data_cache                # digits, then 25 000 DINOv2-shaped images (1/50 ImageNet, ~10 GB)
    python -m benchmarks.data_cache --images 2000  # a smaller second size (0.8 GB)
    python -m benchmarks.data_cache --quick        # digits + 40 images x 261 x 64 (tests/test_benchmarks_data_cache.py)

Why: ``--data.cache`` pays one read of the training split to make every later epoch a gather
from memory; this says what an epoch then costs against the uncached stream, at the two sizes
the rehearsal names (``python -m benchmarks.rehearsal``):

- ``digits``: the bundled 8x8 digits (1 617 training rows of 64 float32) with
  ``configs/mpsae_digits.yaml``'s data settings (batch 256, shuffle buffer 2 048, no workers);
  an epoch takes milliseconds, so this row runs at least ``DIGITS_EPOCHS`` epochs;
- ``imagenet/50``: the rehearsal's synthetic DINOv2-shaped shards (``benchmarks/rehearsal/shards.py``:
  261 tokens x 768 float16 per image, 1 000 images per shard, one shard held out) with the
  rehearsal's data settings (batch 4 096, shuffle buffer 16 batches, 1 worker), then the same
  without workers (the cache's gather is a memory copy, as is the workers' hand-over).

Each row runs ``--epochs`` epochs of the ``ActivationDataModule``'s training loader (the loader
``fit`` uses, without a model) and times each one. ``fill`` is the one read into memory (the
first ``train_dataloader()``); epoch 1 is left out of the rate for both rows (it warms the page
cache for the uncached row), so "epochs 2+" is the steady state and the ratio is the cached
rate over the uncached one, measured in the same run. The uncached rows read shards the page
cache holds (the best case for them: a split larger than the page cache reads the disk). Rates
are tokens per wall-clock second and per CPU-second of all processes (workers included), the
figure a shared machine disturbs least. ``--cache gpu`` measures the device cache instead (both
rows then end each batch on the device, the uncached one through pinned memory).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.loader import cpu_seconds
from sae_pipeline.data import ActivationDataModule

DIGITS_EPOCHS = 100


def datasets(args: argparse.Namespace, tmp: Path) -> list[tuple[str, dict, int]]:
    """``(name, ActivationDataModule kwargs, epochs)`` of each row pair: digits, then the rehearsal's shards
    read by a worker and in the main process."""
    from benchmarks.rehearsal.__main__ import sizes as rehearsal_sizes
    from benchmarks.rehearsal.shards import write as write_rehearsal_shards

    digits = {"source": "digits", "batch_size": 256, "num_workers": 0, "shuffle_buffer_tokens": 2048}
    sizes = argparse.Namespace(quick=args.quick, images=args.images, d_sae=None, k=None, batch_size=None)
    size = rehearsal_sizes(sizes)
    manifest = write_rehearsal_shards(tmp, size["images"], size["d"], size["shard_size"])
    shards = {
        "source": str(tmp / "shards"),
        "batch_size": size["batch_size"],
        "num_workers": size["workers"],
        "shuffle_buffer_tokens": 16 * size["batch_size"],
        "val_fraction": 1 / len(manifest["shards"]),  # one shard held out, as in the rehearsal
    }
    name = "imagenet/50" if size["images"] == 25_000 else f"{size['images']} images x 261 x {size['d']}"
    digits_epochs = args.epochs if args.quick else max(args.epochs, DIGITS_EPOCHS)
    with_workers = {**shards, "num_workers": 0 if size["workers"] else 1}  # the other setting: in process or not
    return [("digits", digits, digits_epochs), (name, shards, args.epochs), (name, with_workers, args.epochs)]


def run_epochs(dm: ActivationDataModule, n_epochs: int, device: torch.device | None) -> dict:
    """Fill time (the first ``train_dataloader()``) and ``(tokens, wall s, CPU s)`` of each epoch."""
    start = time.perf_counter()
    loader = dm.train_dataloader()  # no trainer: the loader counts its own epochs
    fill_s = time.perf_counter() - start
    epochs = []
    for _ in range(n_epochs):
        start, start_cpu, n_tokens = time.perf_counter(), cpu_seconds(), 0
        for batch in loader:
            x = batch["x"]
            if device is not None:
                x = x.to(device, non_blocking=True)
            n_tokens += len(x)
        if device is not None:
            torch.cuda.synchronize(device)
        epochs.append((n_tokens, time.perf_counter() - start, cpu_seconds() - start_cpu))
    return {"fill_s": fill_s, "epochs": epochs}


def steady(run: dict) -> tuple[float, float]:
    """Tokens per wall-clock second and per CPU-second over epochs 2 onward."""
    later = run["epochs"][1:]
    n_tokens = sum(e[0] for e in later)
    return n_tokens / sum(e[1] for e in later), n_tokens / sum(e[2] for e in later)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the test suite")
    parser.add_argument("--images", type=int, default=25_000, help="images of the shard set (1/50 ImageNet: 25 000)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per row; the first is not in the rate")
    parser.add_argument("--cache", choices=("ram", "gpu"), default="ram")
    parser.add_argument("--dir", help="where the shards are written (default: the system's temporary folder)")
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error(f"--epochs must be >= 2 (the first is not in the rate), got {args.epochs}")
    if args.quick:
        args.epochs = 2
    device = torch.device("cuda", torch.cuda.current_device()) if args.cache == "gpu" else None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # DataLoader workers run single-threaded too
    try:
        return measure(args, device)
    finally:
        torch.set_num_threads(threads)  # the caller's (the test suite runs this in its own process)


def measure(args: argparse.Namespace, device: torch.device | None) -> dict:
    """Print the table's rows as they are measured; returns each size's runs and ratio."""
    results: dict = {}
    print(
        "| data | train tokens | cache | workers | fill | epoch 1 | epochs 2+: M tokens/s | M tokens/CPU-s | ratio |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        flush=True,
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for name, kwargs, n_epochs in datasets(args, Path(tmp)):
            workers = kwargs["num_workers"]
            key = name if kwargs["source"] == "digits" else f"{name}, {workers} worker{'s' * (workers != 1)}"
            rows = {}
            for cache in ("none", args.cache):
                dm = ActivationDataModule(**kwargs, cache=cache)
                run = run_epochs(dm, n_epochs, device)
                rows[cache] = run
                rate, cpu_rate = steady(run)
                ratio = rate / steady(rows["none"])[0]
                n_tokens, first_s = run["epochs"][0][0], run["epochs"][0][1]
                fill = f"{run['fill_s']:.1f} s" if cache != "none" else "-"
                print(
                    f"| {name} | {n_tokens:,} | {cache} | {kwargs['num_workers']} | {fill} | {first_s:.2f} s "
                    f"| {rate / 1e6:.3f} | {cpu_rate / 1e6:.3f} | {ratio:.2f} |",
                    flush=True,
                )
                del dm
                if not args.quick:
                    gc.collect()  # the cache goes before the next row allocates (seconds in a big process)
            results[key] = rows
            results[key]["ratio"] = steady(rows[args.cache])[0] / steady(rows["none"])[0]
    print("ratio: the row's epochs-2+ tokens/s over the uncached row's of the same data, in this run")
    return results


if __name__ == "__main__":
    main()
