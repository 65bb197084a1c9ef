"""Benchmark: blocked Babel function against the naive full-Gram computation, same run.

    python -m benchmarks.babel                 # d_sae=19200, d_in=768, r_max=64 (targets: < 60 s, < 2 GB)
    python -m benchmarks.babel --quick         # tiny sizes, in one process; used by tests/test_metrics.py

Each method runs in its own fresh child process so that its peak memory is measured alone
(``--quick`` runs both in this process instead: importing torchmetrics takes seconds):
the increase of ``ru_maxrss`` (peak resident set size, which sees torch's allocations where
tracemalloc does not) from just before the computation to just after it. The naive reference
forms the whole ``d_sae x d_sae`` Gram matrix (19200² float32 = 1.5 GB), then takes top-k per
row. The script checks that both give the same μ₁(1..r_max) and exits non-zero otherwise.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO_DPATH = Path(__file__).resolve().parents[1]  # the children run `python -m benchmarks.babel` from here


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def naive_babel(W_dec, r_max: int):  # noqa: ANN001, ANN201 (torch imported only in children)
    """Reference: the full Gram matrix at once, diagonal excluded, top-r per row, cumsum, max."""
    import torch

    W = W_dec / W_dec.norm(dim=1, keepdim=True)
    gram = (W @ W.T).abs_()
    gram.fill_diagonal_(-torch.inf)
    return gram.topk(r_max, dim=1).values.cumsum(dim=1).amax(dim=0)


def time_method(mode: str, args: argparse.Namespace) -> dict:
    """Time one method on a seeded random unit-norm float32 dictionary."""
    import torch

    from sae_pipeline.metrics import babel

    generator = torch.Generator().manual_seed(args.seed)
    W = torch.randn(args.d_sae, args.d_in, generator=generator)
    W.div_(W.norm(dim=1, keepdim=True))
    warm = torch.randn(64, 8, generator=generator)
    babel(warm, r_max=4, block_size=16)  # start BLAS threads before the baseline
    naive_babel(warm, r_max=4)

    before = peak_rss_bytes()
    start = time.perf_counter()
    if mode == "blocked":
        values = babel(W, r_max=args.r_max, block_size=args.block_size)
    else:
        values = naive_babel(W, r_max=args.r_max)
    seconds = time.perf_counter() - start
    peak_increase = peak_rss_bytes() - before
    return {
        "seconds": seconds,
        "peak_increase_bytes": peak_increase,
        "values": values.tolist(),
        "threads": torch.get_num_threads(),
    }


def measure(mode: str, args: argparse.Namespace) -> dict:
    """Run ``time_method`` in a fresh child process (or here with ``--quick``)."""
    if args.quick:
        return time_method(mode, args)
    command = [
        sys.executable,
        "-m",
        "benchmarks.babel",
        "--child",
        mode,
        "--d-sae",
        str(args.d_sae),
        "--d-in",
        str(args.d_in),
        "--r-max",
        str(args.r_max),
        "--block-size",
        str(args.block_size),
        "--seed",
        str(args.seed),
    ]
    completed = subprocess.run(command, cwd=REPO_DPATH, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        sys.exit(f"{mode} run failed (exit {completed.returncode}):\n{completed.stderr}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-sae", type=int, default=19200, help="number of atoms (default 19200 = 25 x 768)")
    parser.add_argument("--d-in", type=int, default=768, help="atom dimension (default 768)")
    parser.add_argument("--r-max", type=int, default=64, help="largest r of mu_1(r) (default 64)")
    parser.add_argument("--block-size", type=int, default=1024, help="atoms per block (default 1024)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (d_sae=600, d_in=32, r_max=8)")
    parser.add_argument("--child", choices=["blocked", "naive"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.d_sae, args.d_in, args.r_max, args.block_size = 600, 32, 8, 128
    if not 1 <= args.r_max <= args.d_sae - 1:
        parser.error(f"--r-max must be in [1, --d-sae - 1] = [1, {args.d_sae - 1}], got {args.r_max}")
    if args.child:
        print(json.dumps(time_method(args.child, args)))
        return

    blocked = measure("blocked", args)
    naive = measure("naive", args)
    max_diff = max(abs(a - b) for a, b in zip(blocked["values"], naive["values"]))
    mib = 2**20
    print(
        f"Babel mu_1(1..{args.r_max}), d_sae={args.d_sae}, d_in={args.d_in}, float32, CPU, "
        f"{blocked['threads']} threads, block_size={args.block_size}"
    )
    for name, result in (("blocked", blocked), ("naive", naive)):
        print(f"  {name:8s} {result['seconds']:8.2f} s   peak memory +{result['peak_increase_bytes'] / mib:8.1f} MiB")
    print(
        f"  ratio blocked/naive: time {blocked['seconds'] / naive['seconds']:.2f}x, "
        f"peak memory {blocked['peak_increase_bytes'] / max(naive['peak_increase_bytes'], 1):.3f}x"
    )
    print(
        f"  mu_1(1) = {blocked['values'][0]:.4f}, mu_1({args.r_max}) = {blocked['values'][-1]:.4f}, "
        f"max |blocked - naive| = {max_diff:.2e}"
    )
    met = blocked["seconds"] < 60 and blocked["peak_increase_bytes"] < 2 * 2**30
    if args.quick:
        print("  (--quick: both in one process, so the naive peak is measured above the blocked one)")
    print(f"  targets (blocked < 60 s, < 2 GiB): {'met' if met else 'NOT met'}")
    if max_diff > 1e-4 * args.r_max:
        sys.exit(f"blocked and naive Babel disagree: max difference {max_diff:.3e}")


if __name__ == "__main__":
    main()
