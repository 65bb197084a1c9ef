"""Cost curves of the numerical kernels: the parts of ``python -m benchmarks.scaling`` that time the training
step, Babel, ``predict`` and the training loader (the commands around them are in ``pipeline.py`` beside this).

Expected slopes, from each algorithm (B tokens per batch, k atoms per token, d_in x d_sae dictionary):

- ``train_d_sae`` (every variant, d_sae 4096 -> 65536 at d_in 768): time 1, memory 1. ReLU, JumpReLU and
  Matryoshka compute the dense ``B x d_sae`` pre-activations and decode densely: O(B·d_in·d_sae).
  TopK and BatchTopK encode densely and decode k atoms per token: O(B·d_in·d_sae). MP-SAE takes k
  greedy steps, each a correlation matmul O(B·d_in·d_sae) (``pursuit_cost.prefer_gram`` picks the Gram
  path instead only when ``2·d_sae²·d_in < (k−1)·B·d_sae·(2·d_in − c)``, i.e. only while it is the
  cheaper one, so time stays at most linear; it is never chosen at the sizes here, see below). OMP-SAE
  takes k steps of one ``q_t @ W_decᵀ`` matmul each plus O(t·d_in) per token for its QR update:
  O(k·B·d_in·d_sae). Memory: the parameters, their gradients and Adam's two moments (6·d_in·d_sae
  floats) and ``B x d_sae`` buffers: linear; the offset is a bare process with the same imports and batches.
  B = 256 and k = 16 keep the 35 points under ~10 minutes on a 2-core machine: MP-SAE and OMP-SAE
  cost k encoder matmuls per step, 113 s per step at B = 1024, k = 32, d_sae = 65536. B·k scales every
  point's time alike, so it does not change the slopes. At B = 256, k = 16 MP-SAE's cost model picks
  the matmul path at every d_sae >= 3 780 (its Gram matrix, d_sae² floats, would pay off only above that
  B·(k−1)), so no d_sae² buffer is formed.
- ``train_k`` (TopK, BatchTopK, MP-SAE, OMP-SAE vs k at d_sae 8192): TopK and BatchTopK spend
  O(B·d_in·d_sae) on the dense encoder whatever k and O(B·k·d_in) on the sparse decode, so ~0 until
  k·d_in rivals d_sae·d_in: expected 0. MP-SAE: k correlation matmuls: 1 (from k ≈ 34 its cost model
  switches to Gram updates, a one-off 2·d_sae²·d_in plus O(B·d_sae) per step, which bends the curve down).
  OMP-SAE: k matmuls plus O(k²·d_in) per token: 1 while d_sae ≫ k. Memory: k-sized buffers
  (``[B, k]`` indices, OMP's ``[B, k, k]`` factor and ``[B, k, d_in]`` atoms) are small next to
  the parameters: expected 0, except MP-SAE's d_sae² Gram matrix once it is chosen (a step, not a slope).
- ``babel_p``: μ₁ needs every pair's |<d_i, d_j>|: time 2 (p²·d_in FLOPs, in blocks); memory 1 (a
  ``block x p`` slice and the running top-r_max per row, never the p x p Gram).
- ``predict_tokens``: the real ``python -m sae_pipeline predict`` command: time 1 in tokens (its
  fixed start-up, the imports and the Trainer, flattens the small sizes); peak memory 0: codes go to the
  HDF5 file batch by batch, never kept in RAM. The memory offset is the command's imports (``--help``).
- ``loader_workers``: seconds to read a fixed set of shards through the training loader with 1-16
  workers. Ideal slope −1 up to the number of cores and 0 beyond; on the 2-core benchmark machine the
  curve flattens from 2 workers, so the expectation is 0 (a flag = more workers made it slower).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from benchmarks.scaling.fit import Curve, run_point
from benchmarks.scaling.predict import predict_tokens

TRAIN_VARIANTS = ("relu", "jumprelu", "topk", "batchtopk", "matryoshka", "mpsae", "ompsae")
K_VARIANTS = ("topk", "batchtopk", "mpsae", "ompsae")


def peak_mib_self() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def point(args: argparse.Namespace, argv: list[str]) -> dict:
    """One point of ``benchmarks.scaling.points``: in a fresh process, or (``--quick``) here, where peak RSS is
    this process's high-water mark (a smoke run: its memory slopes mean nothing)."""
    if not args.quick:
        return run_point("benchmarks.scaling.points", argv)
    from benchmarks.scaling import points

    start = time.perf_counter()
    result = points.POINTS[argv[0]](points.parse_args(argv))
    return {**result, "wall_s": time.perf_counter() - start, "peak_rss_mib": peak_mib_self()}


def train_sizes(args: argparse.Namespace) -> dict:
    if args.quick:
        return {"d_in": 32, "batch": 64, "k": 4, "d_sae": [256, 512, 1024], "k_d_sae": 512, "ks": [2, 4, 8]}
    return {
        "d_in": 768,
        "batch": args.train_batch,
        "k": args.train_k,
        "d_sae": [4096, 8192, 16384, 32768, 65536],
        "k_d_sae": 8192,
        "ks": [8, 16, 32, 64, 128],
    }


def train_argv(sizes: dict, variant: str, d_sae: int, k: int, args: argparse.Namespace) -> list[str]:
    return [
        "train",
        "--variant",
        variant,
        "--d-in",
        str(sizes["d_in"]),
        "--d-sae",
        str(d_sae),
        "--batch-size",
        str(sizes["batch"]),
        "--k",
        str(k),
        "--steps",
        str(args.train_steps),
        "--warmup",
        "1",
    ]


def bare_offset(args: argparse.Namespace, kind: str, sizes: dict) -> float:
    argv = [kind, "--d-in", str(sizes["d_in"]), "--batch-size", str(sizes["batch"])]
    return 0.0 if args.quick else point(args, argv)["peak_rss_mib"]


def train_d_sae(args: argparse.Namespace) -> list[Curve]:
    sizes = train_sizes(args)
    offset = bare_offset(args, "bare-train", sizes)
    curves = []
    for variant in args.train_variants:
        results = [point(args, train_argv(sizes, variant, d, sizes["k"], args)) for d in sizes["d_sae"]]
        curves.append(
            Curve(
                stage=f"train step {variant}",
                x_name="d_sae",
                xs=sizes["d_sae"],
                seconds=[r["seconds"] for r in results],
                expected_time_slope=1,
                peak_mib=[r["peak_rss_mib"] for r in results],
                expected_memory_slope=1,
                memory_offset_mib=offset,
                note=f"d_in {sizes['d_in']}, B {sizes['batch']}, k {sizes['k']}; median of {args.train_steps} steps",
            )
        )
    return curves


def train_k(args: argparse.Namespace) -> list[Curve]:
    sizes = train_sizes(args)
    offset = bare_offset(args, "bare-train", sizes)
    expected = {"topk": 0, "batchtopk": 0, "mpsae": 1, "ompsae": 1}
    curves = []
    for variant in [v for v in args.train_variants if v in K_VARIANTS]:
        results = [point(args, train_argv(sizes, variant, sizes["k_d_sae"], k, args)) for k in sizes["ks"]]
        curves.append(
            Curve(
                stage=f"train step {variant}",
                x_name="k",
                xs=sizes["ks"],
                seconds=[r["seconds"] for r in results],
                expected_time_slope=expected[variant],
                peak_mib=[r["peak_rss_mib"] for r in results],
                expected_memory_slope=0,
                memory_offset_mib=offset,
                note=f"d_in {sizes['d_in']}, d_sae {sizes['k_d_sae']}, B {sizes['batch']}",
            )
        )
    return curves


def babel_p(args: argparse.Namespace) -> list[Curve]:
    d_in, ps, r_max = (16, [64, 128, 256], 4) if args.quick else (768, [2048, 4096, 8192, 16384, 32768], 64)
    offset = bare_offset(args, "bare-babel", {"d_in": d_in, "batch": 1})
    results = [point(args, ["babel", "--d-in", str(d_in), "--p", str(p), "--r-max", str(r_max)]) for p in ps]
    return [
        Curve(
            stage="babel",
            x_name="p (atoms)",
            xs=ps,
            seconds=[r["seconds"] for r in results],
            expected_time_slope=2,
            peak_mib=[r["peak_rss_mib"] for r in results],
            expected_memory_slope=1,
            memory_offset_mib=offset,
            note=f"d_in {d_in}, r_max {r_max}, block 1024 (the metric's default)",
        )
    ]


def loader_workers(args: argparse.Namespace) -> list[Curve]:
    from benchmarks.loader import stream_read, write_shards

    n_shards, images, tokens, d = (4, 4, 21, 16) if args.quick else (32, 32, 261, 768)
    workers = [1, 2, 4] if args.quick else [1, 2, 4, 8, 16]
    batch, buffer = (64, 256) if args.quick else (4096, 65_536)
    seconds = []
    with tempfile.TemporaryDirectory(prefix="scaling-loader-") as tmp:
        write_shards(Path(tmp), n_shards, images, tokens, d)
        stream_read(Path(tmp), 1, batch, buffer)  # the page cache and the imports, untimed
        for w in workers:
            warnings.filterwarnings("ignore", message=".*worker processes in total")  # torch's advice: 2 cores
            best = math.inf
            for _ in range(1 if args.quick else 2):  # best of 2: a shared machine's bursts only slow a run down
                start = time.perf_counter()
                n_tokens = stream_read(Path(tmp), w, batch, buffer)
                best = min(best, time.perf_counter() - start)
            seconds.append(best)
    return [
        Curve(
            stage="loader",
            x_name="num_workers",
            xs=workers,
            seconds=seconds,
            expected_time_slope=0,
            note=(
                f"{n_tokens} tokens, d {d}, float16, warm page cache, best of 2; "
                f"{os.cpu_count()} cores: ideal slope -1 up to "
                "the core count, 0 beyond"
            ),
            extra={"tokens_per_s": [n_tokens / s for s in seconds]},
        )
    ]


PARTS: dict[str, Callable[[argparse.Namespace], list[Curve]]] = {
    "train_d_sae": train_d_sae,
    "train_k": train_k,
    "babel_p": babel_p,
    "predict_tokens": predict_tokens,
    "loader_workers": loader_workers,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("numerical kernels (scaling.compute)")
    group.add_argument("--train-variants", nargs="+", default=list(TRAIN_VARIANTS), choices=TRAIN_VARIANTS)
    group.add_argument("--train-batch", type=int, default=256, help="tokens per training step (default 256)")
    group.add_argument("--train-k", type=int, default=16, help="k of the d_sae curves (default 16)")
    group.add_argument("--train-steps", type=int, default=2, help="timed steps per point, after 1 warm-up")
