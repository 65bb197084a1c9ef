"""Benchmark: the sparse products and BatchTopK's selection on a GPU, Triton kernels against the
`F.embedding_bag` path and the dense GEMM they replace, at the paper shape.

    python -m benchmarks.sparse_kernels              # CUDA: d_in 768, d_sae 19200, k 32, B 4096, bf16
    python -m benchmarks.sparse_kernels --dry-run    # CPU, tiny shapes, float32 (tests/test_benchmarks_peers.py)

Rows (each timed between two device syncs after ``--warmup`` calls, the same operands for every column):

- ``decode``: ``x_hat = Σ_e z_e · W_dec[j_e]`` per token; dense: ``codes @ W_dec``;
- ``dW_dec``: ``Σ_b z_bj · ∂x_hat[b]`` per latent (the latent-major order computed once, as a step
  shares it with ``dW_enc``); dense: ``codes.T @ ∂x_hat``;
- ``dvalues``: ``⟨∂x_hat[b], W_dec[j]⟩`` per entry; dense: ``∂x_hat @ W_dec.T`` then the gather;
- ``decode fwd+bwd``: `sparse_decode` through autograd (the three above); dense: ``codes @ W_dec`` with its
  two gradient GEMMs;
- ``batchtopk select``: the batch top ``B·k`` of ``[B, d_sae]``: the threshold search
  (`sae_pipeline/sae/batch_select.py`) against `torch.topk` over the flattened batch (today's).

The codes are a top-k support (k per token) of random scores; the columns' ratios are measured in the same
run. Without CUDA the Triton column reads "needs CUDA" (the dry run checks the rest runs).

``--sweep`` adds a line per product: `segment_sums` (the decode and ``dW_dec`` rows) at each tile size
and warp count of `SWEEP`, against its shipped setting, so a GPU session can choose them from one call.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.gpu import timed
from sae_pipeline.sae import sparse_decode
from sae_pipeline.sae.sparse_decode import SparseCodes


def with_bag(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with the products on `F.embedding_bag` (the path before the kernels) on any device."""

    def run() -> object:
        before, sparse_decode.use_triton = sparse_decode.use_triton, False
        try:
            return fn()
        finally:
            sparse_decode.use_triton = before

    return run


def rows(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, tuple]:
    """``{row: (triton or None, embedding_bag / topk, dense or None)}`` callables on shared operands."""
    g = torch.Generator(device=device).manual_seed(0)
    B, d_sae, d_in, k = args.batch_size, args.d_sae, args.d_in, args.k
    W_dec = torch.randn(d_sae, d_in, device=device, generator=g).to(dtype)
    grad = torch.randn(B, d_in, device=device, generator=g).to(dtype)
    scores = torch.randn(B, d_sae, device=device, generator=g)
    codes = SparseCodes.from_topk(scores.topk(k, dim=1).indices, d_sae)
    values = torch.rand(B * k, device=device, generator=g).to(dtype)
    codes = codes.with_values(values)
    order, sorted_rows, latent_crow = codes.by_latent()
    dense = codes.to_dense()
    kernels = None
    if device.type == "cuda":
        from sae_pipeline.sae import batch_select, triton_sparse

        kernels = triton_sparse
    W_leaf = W_dec.clone().requires_grad_(True)
    v_leaf = values.clone().requires_grad_(True)
    dense_leaf = dense.clone().requires_grad_(True)

    def sparse_fwd_bwd() -> None:
        sparse_decode.sparse_decode(codes.with_values(v_leaf), W_leaf).backward(grad)

    def dense_fwd_bwd() -> None:
        (dense_leaf @ W_leaf).backward(grad)

    table: dict[str, tuple] = {
        "decode": (
            kernels and (lambda: kernels.segment_sums(codes.crow, codes.indices, W_dec, values)),
            lambda: F.embedding_bag(
                codes.indices, W_dec, codes.crow, mode="sum", per_sample_weights=values, include_last_offset=True
            ),
            lambda: dense @ W_dec,
        ),
        "dW_dec": (
            kernels and (lambda: kernels.segment_sums(latent_crow, sorted_rows, grad, values, order)),
            with_bag(lambda: sparse_decode.latent_sums(codes, grad, values)),
            lambda: dense.T @ grad,
        ),
        "dvalues": (
            kernels and (lambda: kernels.entry_dots(codes.rows, codes.indices, grad, W_dec)),
            with_bag(lambda: sparse_decode.entry_dots(codes, grad, W_dec)),
            lambda: (grad @ W_dec.T).reshape(-1).index_select(0, codes.rows * d_sae + codes.indices),
        ),
        "decode fwd+bwd": (kernels and sparse_fwd_bwd, with_bag(sparse_fwd_bwd), dense_fwd_bwd),
    }
    if args.sweep and kernels is not None:
        sweep(
            {
                "decode": (codes.crow, codes.indices, W_dec, values, None),
                "dW_dec": (latent_crow, sorted_rows, grad, values, order),
            },
            kernels,
            args,
            device,
        )
    ranked = scores.to(dtype).flatten()
    table["batchtopk select"] = (
        kernels and (lambda: batch_select.radix_top_indices(ranked, B * k)),
        lambda: ranked.topk(B * k, sorted=False).indices,
        None,
    )
    return table


SWEEP = [(e, d, w) for e in (16, 32, 64) for d in (128, 256) for w in (2, 4, 8)]  # each one compile: few


def sweep(products: dict[str, tuple], kernels, args: argparse.Namespace, device: torch.device) -> None:  # noqa: ANN001
    """Prints each product's `segment_sums` time at every (BLOCK_E, BLOCK_D, num_warps) of `SWEEP`, best first."""
    for product, operands in products.items():
        shipped = kernels.TOKEN_MAJOR_TILE if operands[-1] is None else kernels.LATENT_MAJOR_TILE
        times = {}
        for tile in dict.fromkeys([shipped, *SWEEP]):
            timed(lambda: kernels.segment_sums(*operands, tile=tile), args.warmup, device)  # noqa: B023
            times[tile] = timed(lambda: kernels.segment_sums(*operands, tile=tile), args.steps, device)  # noqa: B023
        best = sorted(times, key=times.get)[:5]
        cells = ", ".join(f"E{e} D{d} w{w} {times[(e, d, w)] * 1e3:.3f} ms" for e, d, w in best)
        e, d, w = shipped
        print(f"sweep {product}: shipped E{e} D{d} w{w} {times[shipped] * 1e3:.3f} ms; best {cells}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-in", type=int, default=768)
    parser.add_argument("--d-sae", type=int, default=19200)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="also time segment_sums at each tile size and warp count")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, float32: checks the script runs")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.d_in, args.d_sae, args.k, args.batch_size, args.dtype = 32, 256, 4, 64, "float32"
        args.steps, args.warmup = 2, 1
    elif not torch.cuda.is_available():
        parser.error("no CUDA device is visible: run on a GPU machine, or use --dry-run for the CPU check")
    for name in ("d_in", "d_sae", "k", "batch_size", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.k > args.d_sae:
        parser.error(f"--k must be in [1, --d-sae={args.d_sae}], got {args.k}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU dry run"
    print(f"device: {name}; d_in={args.d_in} d_sae={args.d_sae} k={args.k} B={args.batch_size} {args.dtype}")
    print("| product | Triton | embedding_bag / topk | dense GEMM | bag / Triton | dense / Triton |")
    print("|---|---|---|---|---|---|")
    for product, (kernel, bag, dense) in rows(args, device, dtype).items():
        times = []
        for fn in (kernel, bag, dense):
            if fn:
                timed(fn, args.warmup, device)
                times.append(timed(fn, args.steps, device))
            else:
                times.append(None)
        cells = [f"{t * 1e3:.3f} ms" if t else "—" for t in times]
        if kernel is None:
            cells[0] = "needs CUDA"
        ratios = [f"{t / times[0]:.2f}x" if t and times[0] else "—" for t in times[1:]]
        print(f"| {product} | {' | '.join(cells)} | {' | '.join(ratios)} |", flush=True)


if __name__ == "__main__":
    main()
