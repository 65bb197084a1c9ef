"""The ``predict_tokens`` part of ``python -m benchmarks.scaling``: the real ``python -m sae_pipeline predict`` against
the number of tokens it encodes (expected time slope 1, memory slope 0: codes stream to the HDF5 file).

One checkpoint (a TopK SAE fitted for one step with ``configs/demo_shards.yaml``'s settings, d_sae and k
raised) predicts over shard directories of 1, 2, 4, ... shards written by ``benchmarks/loader.py``'s
writer; each ``predict`` is a fresh process (``benchmarks.scaling.fit.run_point``), so its peak RSS is
its own. ``--quick`` runs the commands in this process instead (``sae_pipeline.__main__.main``, the same
code path) at tiny sizes: a smoke run whose memory column means nothing.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.loader import write_shards
from benchmarks.scaling.fit import Curve, run_measured

REPO_DPATH = Path(__file__).resolve().parents[2]
CONFIG = str(REPO_DPATH / "configs" / "demo_shards.yaml")
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def sae_pipeline(args: argparse.Namespace, argv: list[str], cwd: Path) -> dict:
    """``python -m sae_pipeline ARGV`` in ``cwd``: ``seconds`` (wall) and ``peak_rss_mib``."""
    if not args.quick:
        run = run_measured([sys.executable, "-m", "sae_pipeline", *argv], cwd=cwd)
        return {"seconds": run["wall_s"], "peak_rss_mib": run["peak_rss_mib"]}
    from sae_pipeline.__main__ import main

    previous = os.getcwd()
    os.chdir(cwd)
    start = time.perf_counter()
    try:
        status = main(argv)
    finally:
        os.chdir(previous)
    if status not in (0, None):
        raise RuntimeError(f"sae_pipeline {' '.join(argv)} exited {status}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": time.perf_counter() - start, "peak_rss_mib": peak}


def predict_tokens(args: argparse.Namespace) -> list[Curve]:
    if args.quick:
        shard_counts, images, tokens, d, d_sae, k, batch = [1, 2, 4], 2, 21, 16, 64, 4, 32
    else:
        shard_counts, images, tokens, d, d_sae, k, batch = [1, 2, 4, 8, 16, 32], 16, 261, 768, 4096, 32, 1024
    model = ["--model.sae.init_args.d_sae", str(d_sae), "--model.sae.init_args.k", str(k)]
    results, n_tokens = [], []
    with tempfile.TemporaryDirectory(prefix="scaling-predict-") as tmp:
        root = Path(tmp)
        for n in shard_counts:
            write_shards(root / f"shards{n}", n, images, tokens, d)
            n_tokens.append(n * images * tokens)
        common = ["--config", CONFIG, *model, *QUIET, "--data.val_fraction", "0"]
        common += ["--data.batch_size", str(batch), "--data.shuffle_buffer_tokens", str(4 * batch)]
        fit = ["fit", *common, "--data.source", str(root / "shards1"), "--trainer.max_steps", "1"]
        sae_pipeline(args, [*fit, "--trainer.limit_val_batches", "0"], root)
        ckpt = next((root / "runs").rglob("last.ckpt"))
        for n in shard_counts:
            predict = ["predict", *common, "--data.source", str(root / f"shards{n}"), "--ckpt_path", str(ckpt)]
            results.append(sae_pipeline(args, [*predict, "--codes.fpath", str(root / f"codes{n}.h5")], root))
        offset = 0.0 if args.quick else sae_pipeline(args, ["predict", "--help"], root)["peak_rss_mib"]
    return [
        Curve(
            stage="predict",
            x_name="tokens",
            xs=n_tokens,
            seconds=[r["seconds"] for r in results],
            expected_time_slope=1,
            peak_mib=[r["peak_rss_mib"] for r in results],
            expected_memory_slope=0,
            memory_offset_mib=offset,
            note=f"TopK d_in {d}, d_sae {d_sae}, k {k}, batch {batch}; wall time of the command, start-up included",
        )
    ]
