"""Benchmark: GB/s of ActivationDataModule's training loader per worker against a plain sequential read.

    python -m benchmarks.loader            # d=768, float16, 261 tokens/image, 32 shards x 128 images (1.6 GB)
    python -m benchmarks.loader --quick    # tiny sizes; used by tests/test_data.py
    python -m benchmarks.loader --source seaweedfs   # from an object store (benchmarks/loader_store.py)

Why: at paper scale a GPU eats float16 tokens faster than one process reads them (the README's
GPU section); this gives the loader's rate per worker, the figure that says how many workers
and what disk bandwidth one GPU needs. All rows read the same shard files, written by the
project's shard writer into a temporary directory:

- raw sequential read: every file's bytes, in order, ``readinto`` a reused 16 MB buffer (the
  disk's or page cache's bytes/s: no loader can beat it);
- plain tar decode: ``tarfile`` over each shard, ``np.load`` of every ``tokens.npy``, one
  ``np.concatenate`` per shard, float16 batches of ``--batch_size`` rows (the straightforward
  standard-library decode, without the loader's split, shuffle and checks);
- the DataModule's training loader with 0 (main process), 1 and 2 workers: the rank/worker
  split, per-sample checksums, the shuffle buffer (>= 64K tokens), batches of 4096 in float16
  and the hand-over from the workers (what a ``fit`` reads).

GB/s counts token bytes (tokens x d x 2) for the loaders and file bytes for the raw read (the
tokens are all but a fraction of a percent of a shard). Warm: the page cache holds the files
(best of ``--repeats`` after one untimed read). Cold: each run after evicting the files from the
page cache (``posix_fadvise(DONTNEED)``, no root needed); on a virtual machine the host's cache
may still serve them, so the cold rows say how the loader does when the files are not in this
machine's cache, not how fast a disk is.
The verification section reruns the 1- and 2-worker loader without checksums (target: verified
>= 0.9 of unverified), and times the shard reader alone both ways.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from feature_extraction import shards as S
from feature_extraction.shards.integrity import load_sample_checksums
from feature_extraction.shards.layout import sidecar_fpath
from feature_extraction.shards.read import iter_shard_tokens
from sae_pipeline.data import ActivationDataModule
from sae_pipeline.data.sources import ShardUnit


def write_shards(dpath: Path, n_shards: int, images_per_shard: int, tokens_per_image: int, d: int) -> None:
    """Random float16 tokens in ``n_shards`` shards, finalised with a manifest."""
    rng = np.random.default_rng(0)
    grid = int(np.sqrt(tokens_per_image - 5))  # 5 prefix tokens (CLS + 4 registers), like DINOv2
    for index in range(n_shards):
        samples = [
            (f"img{index:04d}_{i:04d}", rng.standard_normal((tokens_per_image, d), np.float32).astype(np.float16), {})
            for i in range(images_per_shard)
        ]
        S.write_shard(dpath, index, samples)
    S.write_manifest(
        dpath,
        n_shards=n_shards,
        spec={"name": "benchmark"},
        layer=0,
        tokens_per_image=tokens_per_image,
        n_prefix_tokens=tokens_per_image - grid * grid,
        grid=(grid, grid),
    )


def raw_read(fpaths: list[Path]) -> int:
    """Every byte of every file, in order, into one reused buffer; returns bytes."""
    buffer, n_bytes = bytearray(16 * 2**20), 0
    for fpath in fpaths:
        with open(fpath, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                n_bytes += n
    return n_bytes


def evict(fpaths: list[Path]) -> None:
    """Drop the files' pages from the page cache (clean pages only: the writer's are synced first)."""
    for fpath in fpaths:
        fd = os.open(fpath, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(fpaths: list[Path], batch_size: int) -> int:
    """The reference: sequential tarfile + numpy decode + concatenation, then float16 batches; returns tokens."""
    n_tokens = 0
    for fpath in fpaths:
        with tarfile.open(fpath) as tar:
            arrays = [
                np.load(io.BytesIO(tar.extractfile(m).read()), allow_pickle=False)
                for m in tar
                if m.name.endswith(".tokens.npy")
            ]
        tokens = np.concatenate(arrays)
        for start in range(0, len(tokens), batch_size):  # batches in the shard dtype, as the loader yields them
            n_tokens += len(torch.from_numpy(tokens[start : start + batch_size]))
    return n_tokens


def stream_read(dpath: Path, num_workers: int, batch_size: int, buffer_tokens: int, verify: bool = True) -> int:
    """One epoch of the DataModule's training loader (``verify``: check each sample's checksum); returns tokens."""
    ShardUnit.verify = verify  # read by each ShardUnit the DataModule creates
    dm = ActivationDataModule(
        str(dpath),
        batch_size=batch_size,
        num_workers=num_workers,
        shuffle_buffer_tokens=buffer_tokens,
        val_fraction=0.0,
    )
    n_tokens = 0
    for batch in dm.train_dataloader():
        n_tokens += len(batch["x"])
    return n_tokens


def reader_read(fpaths: list[Path], verify: bool) -> int:
    """Every token of every shard through the training stream's shard reader, checksums checked or not."""
    n_tokens = 0
    for fpath in fpaths:
        checksums = None
        if verify:
            checksums = load_sample_checksums(json.loads(sidecar_fpath(fpath).read_text()), fpath)
        for _, tokens in iter_shard_tokens(fpath, checksums=checksums):
            n_tokens += len(tokens)
    return n_tokens


def interleaved_best(fns: dict[str, Callable[[], int]], repeats: int) -> dict[str, float]:
    """Best tokens per CPU-second of each function, run in turns so that a loaded machine slows all alike."""
    best = dict.fromkeys(fns, 0.0)
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.process_time()
            n_tokens = fn()
            best[name] = max(best[name], n_tokens / (time.process_time() - start))
    return best


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the DataLoader workers, once joined)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def best_rates(fn, repeats: int, before: Callable[[], None] | None = None) -> tuple[float, float]:  # noqa: ANN001
    """Units (tokens, bytes) per wall-clock second and per CPU-second (all processes), best of ``repeats`` calls;
    ``before`` runs untimed before each call (the cold runs' eviction).

    The CPU figure is what the pipeline costs whatever else the machine runs; on a shared
    machine the wall-clock figure also measures the neighbours.
    """
    best_wall = best_cpu = 0.0
    for _ in range(repeats):
        if before is not None:
            before()
        start, start_cpu = time.perf_counter(), cpu_seconds()
        n_tokens = fn()
        best_wall = max(best_wall, n_tokens / (time.perf_counter() - start))
        best_cpu = max(best_cpu, n_tokens / (cpu_seconds() - start_cpu))
    return best_wall, best_cpu


def throughput(dpath: Path, fpaths: list[Path], args: argparse.Namespace) -> dict[str, tuple[float, ...]]:
    """Warm GB/s and tokens/CPU-s, and cold GB/s, of the raw read, the plain decode and the loader with 0-2 workers.

    Returns, per row, ``(warm units/s, warm units/CPU-s, cold units/s)`` (units: bytes for ``raw``, tokens
    otherwise; the plain decode has no cold run: it is the warm reference for the loader's decode)."""
    runs: dict[str, tuple[Callable[[], int], int]] = {
        "raw": (lambda: raw_read(fpaths), 1),
        "plain": (lambda: plain_read(fpaths, args.batch_size), 1),
    }
    for workers in (0, 1, 2):
        runs[f"workers_{workers}"] = (
            lambda w=workers: stream_read(dpath, w, args.batch_size, args.buffer_tokens),
            max(1, workers),
        )
    labels = {"raw": "raw sequential read (bytes)", "plain": "plain tar decode (float16)"}
    print(
        f"{'':28s} {'warm GB/s':>9s} {'/reader':>7s} {'ratio':>6s} {'M tokens/CPU-s':>14s}   "
        f"{'cold GB/s':>9s} {'/reader':>7s} {'ratio':>6s}"
    )
    results: dict[str, tuple[float, ...]] = {}
    for name, (fn, readers) in runs.items():
        per_unit = 1 if name == "raw" else args.d * 2  # bytes per unit: float16 tokens
        warm = best_rates(fn, args.repeats)
        cold = best_rates(fn, args.repeats, before=lambda: evict(fpaths))[0] if name != "plain" else float("nan")
        results[name] = (*warm, cold)
        warm_gb, cold_gb = warm[0] * per_unit / 1e9, cold * per_unit / 1e9
        raw_warm_gb, raw_cold_gb = results["raw"][0] / 1e9, results["raw"][2] / 1e9
        workers = name.removeprefix("workers_")
        label = labels.get(name, f"DataModule, {workers} worker{'' if workers == '1' else 's'}")
        tokens_cpu = "" if name == "raw" else f"{warm[1] / 1e6:14.3f}"
        line = f"{label:28s} {warm_gb:9.3f} {warm_gb / readers:7.3f} {warm_gb / raw_warm_gb:6.2f} {tokens_cpu:>14s}"
        if name != "plain":
            line += f"   {cold_gb:9.3f} {cold_gb / readers:7.3f} {cold_gb / raw_cold_gb:6.2f}"
        print(line)
    return results


def verification(dpath: Path, fpaths: list[Path], args: argparse.Namespace, results: dict) -> None:
    """The 1- and 2-worker loader without checksums against the verified runs of ``throughput``, and the
    shard reader alone both ways (the checks' CPU time per token)."""
    for workers in (1, 2):
        unverified = best_rates(
            lambda: stream_read(dpath, workers, args.batch_size, args.buffer_tokens, verify=False),  # noqa: B023
            args.repeats,  # (best_rates calls it before the loop moves on)
        )
        results[f"workers_{workers}_unverified"] = unverified
        verified = results[f"workers_{workers}"]
        results[f"verify_ratio_{workers}"] = (verified[0] / unverified[0], verified[1] / unverified[1])
        print(
            f"{workers} worker{'s' * (workers > 1)}: unverified {unverified[0] / 1e6:.3f} M tokens/s, "
            f"{unverified[1] / 1e6:.3f} M tokens/CPU-s; verified/unverified {verified[0] / unverified[0]:.2f} "
            f"(wall), {verified[1] / unverified[1]:.2f} (CPU)"
        )
    ShardUnit.verify = True
    reader = interleaved_best(
        {"off": lambda: reader_read(fpaths, False), "on": lambda: reader_read(fpaths, True)}, max(3, args.repeats)
    )
    results["reader"] = (reader["off"], reader["on"])
    print(
        f"shard reader alone (one process, interleaved best of {max(3, args.repeats)}): "
        f"{reader['off'] / 1e6:.3f} M tokens/CPU-s unverified, {reader['on'] / 1e6:.3f} verified, "
        f"ratio {reader['on'] / reader['off']:.2f}"
    )
    # The checks' CPU time per token, against what the whole stream spends per token (1 worker, unverified):
    # a figure that a loaded machine disturbs far less than the wall-clock ratios above.
    extra = 1 / reader["on"] - 1 / reader["off"]
    stream = 1 / results["workers_1_unverified"][1]
    print(
        f"verification's CPU time per token: {extra * 1e9:.0f} ns, {extra / stream:.1%} of the stream's "
        f"{stream * 1e9:.0f} ns: the verified stream keeps {1 / (1 + extra / stream):.2f} of its throughput"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the test suite")
    parser.add_argument("--n_shards", type=int, default=32)
    parser.add_argument("--images_per_shard", type=int, default=128)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--tokens_per_image", type=int, default=261)
    parser.add_argument("--batch_size", type=int, default=4096)
    parser.add_argument("--buffer_tokens", type=int, default=65_536)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--source",
        default=None,
        help="s3://bucket/prefix, or 'seaweedfs' (one on loopback): read from a store (benchmarks/loader_store.py)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.n_shards, args.images_per_shard, args.d, args.repeats = 4, 4, 32, 1
        args.batch_size, args.buffer_tokens = 256, 1024
    torch.set_num_threads(1)  # DataLoader workers run single-threaded too
    if args.source is not None:
        from benchmarks.loader_store import run_store

        return run_store(args.source, args, sys.modules[__name__])
    with tempfile.TemporaryDirectory() as tmp:
        dpath = Path(tmp)
        write_shards(dpath, args.n_shards, args.images_per_shard, args.tokens_per_image, args.d)
        fpaths = S.shard_fpaths(dpath, S.load_manifest(dpath))
        n_tokens = args.n_shards * args.images_per_shard * args.tokens_per_image
        print(
            f"{args.n_shards} shards x {args.images_per_shard} images x {args.tokens_per_image} tokens, d={args.d} "
            f"float16: files {sum(f.stat().st_size for f in fpaths) / 1e9:.3f} GB, "
            f"tokens {n_tokens * args.d * 2 / 1e9:.3f} GB; batch {args.batch_size}, "
            f"buffer {args.buffer_tokens} tokens; best of {args.repeats}"
        )
        raw_read(fpaths)  # warm the page cache
        results = throughput(dpath, fpaths, args)
        print("ratio: to the raw read in the same cache state; /reader: per worker (the main process for 0 workers)")
        plain = results["plain"][0]
        print(
            "loader / plain tar decode, warm: "
            + ", ".join(f"{w} worker(s) {results[f'workers_{w}'][0] / plain:.2f}" for w in (0, 1, 2))
        )
        verification(dpath, fpaths, args, results)
        print("targets: warm loader / plain decode >= 0.7 (1 and 2 workers); verified/unverified >= 0.9")
    return results


if __name__ == "__main__":
    main()
