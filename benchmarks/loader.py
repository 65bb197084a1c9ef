"""Benchmark: tokens/s of ActivationDataModule's training stream against a plain sequential read.

    python -m benchmarks.loader            # d=768, float16, 261 tokens/image, 32 shards x 128 images (target >= 0.7)
    python -m benchmarks.loader --quick    # tiny sizes; used by tests/test_data.py

Each DataModule row is run twice: with the per-sample checksum verification the training
stream always does (``feature_extraction/shards/integrity.py``) and without it; the last column is
their ratio (target >= 0.9: verification may cost at most a tenth of the throughput).

Both read the same shard files of a temporary directory. The reference is the least work
that still yields float32 tokens: ``tarfile`` over each shard, ``np.load`` of every
``tokens.npy``, one ``np.concatenate`` per shard, and torch's float16 -> float32
conversion per batch of ``--batch_size`` rows (numpy's ``astype`` is about 4x slower, and
converting a whole shard at once pays for fresh memory: either would flatter the ratio).
The DataModule stream adds what training needs: the rank/worker split, a token shuffle
buffer (>= 64K tokens), batches of 4096 and the hand-over from DataLoader workers; it is
run with 1 and 2 workers. Each figure is the best of ``--repeats`` runs, after one
untimed read that warms the page cache for both. The default 1.6 GB (32 shards) makes
the stream's fixed costs (worker start, filling the shuffle buffer before the first
batch) what they are in a real epoch: small; at 8 shards they are about a tenth.
"""

from __future__ import annotations

import argparse
import io
import json
import resource
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


def plain_read(fpaths: list[Path], batch_size: int) -> int:
    """The reference: sequential tarfile + numpy decode + concatenation, then float32 batches; returns tokens."""
    n_tokens = 0
    for fpath in fpaths:
        with tarfile.open(fpath) as tar:
            arrays = [
                np.load(io.BytesIO(tar.extractfile(m).read()), allow_pickle=False)
                for m in tar
                if m.name.endswith(".tokens.npy")
            ]
        tokens = np.concatenate(arrays)
        for start in range(0, len(tokens), batch_size):  # float32 per batch: a whole shard at once is slower
            n_tokens += len(torch.from_numpy(tokens[start : start + batch_size]).float())
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


def best_rates(fn, repeats: int) -> tuple[float, float]:  # noqa: ANN001
    """Tokens per wall-clock second and per CPU-second (all processes), best of ``repeats`` calls.

    The CPU figure is what the pipeline costs whatever else the machine runs; on a shared
    machine the wall-clock figure also measures the neighbours.
    """
    best_wall = best_cpu = 0.0
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), cpu_seconds()
        n_tokens = fn()
        best_wall = max(best_wall, n_tokens / (time.perf_counter() - start))
        best_cpu = max(best_cpu, n_tokens / (cpu_seconds() - start_cpu))
    return best_wall, best_cpu


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
    args = parser.parse_args(argv)
    if args.quick:
        args.n_shards, args.images_per_shard, args.d, args.repeats = 4, 4, 32, 1
        args.batch_size, args.buffer_tokens = 256, 1024
    torch.set_num_threads(1)  # DataLoader workers run single-threaded too
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        dpath = Path(tmp)
        write_shards(dpath, args.n_shards, args.images_per_shard, args.tokens_per_image, args.d)
        fpaths = S.shard_fpaths(dpath, S.load_manifest(dpath))
        size_mb = sum(f.stat().st_size for f in fpaths) / 2**20
        print(
            f"{args.n_shards} shards x {args.images_per_shard} images x {args.tokens_per_image} tokens, "
            f"d={args.d} float16 ({size_mb:.0f} MB); batch {args.batch_size}, buffer {args.buffer_tokens} tokens"
        )
        plain_read(fpaths, args.batch_size)  # warm the page cache
        results["plain"] = best_rates(lambda: plain_read(fpaths, args.batch_size), args.repeats)
        print(
            f"{'':32s} {'M tokens/s':>10s} {'ratio':>6s}   {'M tokens/CPU-s':>14s} {'ratio':>6s}   "
            f"{'verified/unverified (wall, CPU)':>31s}"
        )
        print(
            f"{'plain sequential read':32s} {results['plain'][0] / 1e6:10.3f} {'':6s}   "
            f"{results['plain'][1] / 1e6:14.3f}"
        )
        for workers in (1, 2):
            for verify in (False, True):
                rates = best_rates(
                    lambda: stream_read(dpath, workers, args.batch_size, args.buffer_tokens, verify),  # noqa: B023
                    args.repeats,  # (best_rates calls it before the loop moves on)
                )
                name = f"workers_{workers}" + ("" if verify else "_unverified")
                results[name] = rates
                ratios = [rate / plain for rate, plain in zip(rates, results["plain"])]
                label = f"DataModule, {workers} worker" + "s" * (workers > 1) + (", verified" if verify else "")
                line = f"{label:32s} {rates[0] / 1e6:10.3f} {ratios[0]:6.2f}   {rates[1] / 1e6:14.3f} {ratios[1]:6.2f}"
                if verify:
                    unverified = results[f"workers_{workers}_unverified"]
                    results[f"verify_ratio_{workers}"] = (rates[0] / unverified[0], rates[1] / unverified[1])
                    line += f"   {rates[0] / unverified[0]:15.2f} {rates[1] / unverified[1]:15.2f}"
                print(line)
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
        print("targets: wall-clock ratio to the plain read >= 0.7; verified/unverified >= 0.9")
    return results


if __name__ == "__main__":
    main()
