"""Benchmark: matching a seed replica's dictionary, the candidate-graph solver against the dense Hungarian, same run.

    python -m benchmarks.dictionary_match                       # d_sae 4 096 and 19 200, d_in 768
    python -m benchmarks.dictionary_match --d_sae 1024 --d_in 64   # a quick run

A replica is the dictionary with its rows permuted, their signs flipped at random, 3 % noise added and a fifth of
them replaced by random directions (what a second training seed looks like to the matching: most atoms found again,
some not); a second pair is two independent random dictionaries (nothing found again: the worst case for the
candidate graph, whose first solve is rarely certified). Each solver runs in a fresh child process, so its peak
resident memory is its own: `match_cosines` (scipy's `linear_sum_assignment` on the dense |cosine| matrix, the
reference) and `match_cosines_sparse` (`sae_pipeline/metrics/sparse_match.py`). The script checks that both give
the same sum of |cosine| (to float32's rounding) and the same found-again decisions, and exits non-zero otherwise.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_DPATH = Path(__file__).resolve().parents[1]


def dictionaries(kind: str, d_sae: int, d_in: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(w_a, w_b)``: a dictionary and its replica (``kind`` "replica") or another random one ("random")."""
    rng = np.random.default_rng(seed)
    w_a = rng.standard_normal((d_sae, d_in))
    w_a /= np.linalg.norm(w_a, axis=1, keepdims=True)
    if kind == "random":
        return w_a, rng.standard_normal((d_sae, d_in))
    w_b = w_a[rng.permutation(d_sae)] * rng.choice([-1.0, 1.0], (d_sae, 1))
    w_b += rng.standard_normal(w_b.shape) * 0.03 / np.sqrt(d_in)  # noise of 3 % of each (unit) row's norm
    replaced = rng.random(d_sae) < 0.2
    w_b[replaced] = rng.standard_normal((int(replaced.sum()), d_in))
    return w_a, w_b


def child(solver: str, kind: str, d_sae: int, d_in: int) -> None:
    """One solve in this process; prints its seconds, peak RSS growth and result as JSON."""
    from sae_pipeline.metrics.dictionary_match import match_cosines, match_cosines_sparse

    w_a, w_b = dictionaries(kind, d_sae, d_in)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    cosines = (match_cosines if solver == "dense" else match_cosines_sparse)(w_a, w_b)
    seconds = time.perf_counter() - start
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    np.save(sys.argv[-1], cosines)
    print(json.dumps({"seconds": seconds, "peak_bytes": peak}))


def run_child(solver: str, kind: str, d_sae: int, d_in: int, out: Path) -> tuple[dict, np.ndarray]:
    args = ["--child", solver, "--kind", kind, "--d_sae", str(d_sae), "--d_in", str(d_in), str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.dictionary_match", *args],
        cwd=REPO_DPATH,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1]), np.load(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d_sae", type=int, nargs="+", default=[4096, 19_200])
    parser.add_argument("--d_in", type=int, default=768)
    parser.add_argument("--kinds", nargs="+", default=["replica", "random"], choices=["replica", "random"])
    parser.add_argument("--child", choices=["dense", "sparse"])
    parser.add_argument("--kind", default="replica")
    parser.add_argument("out", nargs="?")
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.kind, args.d_sae[0], args.d_in)
        return 0
    from sae_pipeline.metrics.dictionary_match import THRESHOLD

    print(f"d_in {args.d_in}; each solver in a fresh process; peak = growth of its resident memory")
    print("| d_sae | pair | dense s | dense peak | sparse s | sparse peak | dense ÷ sparse | found again | equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for d_sae in args.d_sae:
            for kind in args.kinds:
                dense, c_dense = run_child("dense", kind, d_sae, args.d_in, Path(tmp) / "dense.npy")
                sparse, c_sparse = run_child("sparse", kind, d_sae, args.d_in, Path(tmp) / "sparse.npy")
                same_sum = abs(c_dense.sum() - c_sparse.sum()) <= 1e-5 * max(c_dense.sum(), 1.0)
                flips = int(((c_dense >= THRESHOLD) != (c_sparse >= THRESHOLD)).sum())
                equal = same_sum and flips == 0
                sums = f"sum {c_dense.sum():.6f} vs {c_sparse.sum():.6f}"
                verdict = "equal" if equal else f"DIFFERS ({sums}, {flips} flips)"
                failed |= not equal
                print(
                    f"| {d_sae} | {kind} | {dense['seconds']:.2f} | {dense['peak_bytes'] / 2**30:.2f} GiB | "
                    f"{sparse['seconds']:.2f} | {sparse['peak_bytes'] / 2**30:.2f} GiB | "
                    f"{dense['seconds'] / max(sparse['seconds'], 1e-9):.2f} | {(c_dense >= THRESHOLD).mean():.3f} | "
                    f"{verdict} |"
                )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
