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
- ``batchtopk select``: the batch top ``B·k`` of ``[B, d_sae]``: the selection kernels
  (`sae_pipeline/sae/triton_batch_topk.py`, what BatchTopK runs on a GPU) against `torch.topk` over the flattened batch;
- ``topk select`` (CUDA only): TopK's per-token top ``k``, the per-token kernel against `torch.topk` (the memory
  floor and the other contenders: `python -m benchmarks.topk_select`).

The codes are a top-k support (k per token) of random scores; the columns' ratios are measured in the same
run. Without CUDA the Triton column reads "needs CUDA" (the dry run checks the rest runs).

``--sweep`` adds a line per product: `segment_sums` (the decode and ``dW_dec`` rows) at each tile size
and warp count of `SWEEP`, against its shipped setting, so a GPU session can choose them from one call.

A second table (CUDA only: the dry run prints one line instead) is the chooser of `sae_pipeline/sae/product_choice.py`
(each product as the Triton kernel or as cuBLAS, whichever it measured faster here): per product (``dW_enc`` too:
``Σ ∂pre · (x − b_pre)`` per latent) and for the encoder's and decoder's forward and backward together
(``encode+decode fwd+bwd``: all four through autograd), what it picked and the two times it measured (dense:
the scatter into ``[B, d_sae]`` and the GEMM), then the product through `sae_pipeline.sae.sparse_decode` as a
step runs it (``chosen``) and forced onto each path, and ``chosen / best``: the chosen time over the better
forced one, which should stay at most 1.05.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.gpu import timed
from sae_pipeline.sae import product_choice, sparse_decode
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


def forced(path: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with every sparse product on ``path`` ("sparse": the Triton kernels; "dense": cuBLAS), not the
    chooser's pick."""

    def run() -> object:
        with product_choice.CHOOSER.forcing(path):
            return fn()

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
        from sae_pipeline.sae import triton_batch_topk, triton_sparse, triton_topk

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
        "decode fwd+bwd": (kernels and forced("sparse", sparse_fwd_bwd), with_bag(sparse_fwd_bwd), dense_fwd_bwd),
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
    ranked = scores.to(dtype)
    table["batchtopk select"] = (
        kernels and (lambda: triton_batch_topk.batch_top_k(ranked, B * k)),
        lambda: ranked.flatten().topk(B * k, sorted=False).indices,
        None,
    )
    if kernels is not None:
        table["topk select"] = (
            lambda: triton_topk.row_top_k(ranked, k),
            lambda: ranked.topk(k, dim=1, sorted=False).indices,
            None,
        )
    return table


def chooser_rows(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[str]:
    """The chooser's table (see the module's docstring): Markdown lines, header first. Each product's first call
    (the warm-up of its ``chosen`` column) is where the chooser measures it."""
    g = torch.Generator(device=device).manual_seed(1)
    B, d_sae, d_in, k = args.batch_size, args.d_sae, args.d_in, args.k
    W_dec = torch.randn(d_sae, d_in, device=device, generator=g).to(dtype)
    W_enc = W_dec.T.clone()
    b_enc, b_pre = torch.zeros(d_sae, device=device, dtype=dtype), torch.zeros(d_in, device=device, dtype=dtype)
    x = torch.randn(B, d_in, device=device, generator=g).to(dtype)
    grad = torch.randn(B, d_in, device=device, generator=g).to(dtype)
    pre = torch.addmm(b_enc, x - b_pre, W_enc)
    codes = SparseCodes.from_topk(pre.topk(k, dim=1).indices, d_sae)
    values = torch.rand(B * k, device=device, generator=g).to(dtype)
    grad_pre = torch.randn(B * k, device=device, generator=g).to(dtype)
    codes, centred = codes.with_values(values), x - b_pre
    codes.by_latent()  # computed once per batch and shared, as in a step (the table above too)
    leaves = [t.clone().requires_grad_(True) for t in (W_enc, b_enc, b_pre, W_dec)]

    def step() -> None:
        W_enc_, b_enc_, b_pre_, W_dec_ = leaves
        entries = sparse_decode.sparse_encode(x, b_pre_, W_enc_, b_enc_, pre, codes)
        sparse_decode.sparse_decode(codes.with_values(entries), W_dec_, b_pre_).backward(grad)

    products: dict[str, Callable[[], object]] = {
        "decode": lambda: sparse_decode.token_sums(codes, W_dec, values),
        "dW_dec": lambda: sparse_decode.latent_sums(codes, grad, values),
        "dW_enc": lambda: sparse_decode.latent_sums(codes, centred, grad_pre, "dW_enc").T,
        "dvalues": lambda: sparse_decode.entry_dots(codes, grad, W_dec),
        "encode+decode fwd+bwd": step,
    }
    lines = [
        "| product (chooser) | picked | measured Triton | measured cuBLAS | chosen | forced Triton | forced cuBLAS "
        "| chosen / best |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for product, fn in products.items():
        times = []
        for run in (fn, forced("sparse", fn), forced("dense", fn)):
            timed(run, args.warmup, device)
            times.append(timed(run, args.steps, device))
        choice = picked(product, B, d_sae, d_in)
        cells = [{"sparse": "Triton", "dense": "cuBLAS"}[choice.path] if choice else "per product"]
        for seconds in (choice.sparse_seconds, choice.dense_seconds) if choice else (None, None):
            cells.append(f"{seconds * 1e3:.3f} ms" if seconds is not None else "—")
        cells += [f"{t * 1e3:.3f} ms" for t in times]
        cells.append(f"{times[0] / min(times[1:]):.2f}x")
        lines.append(f"| {product} | {' | '.join(cells)} |")
    return lines


def picked(product: str, batch: int, d_sae: int, d_in: int) -> product_choice.Choice | None:
    """What `product_choice.CHOOSER` keeps for ``product`` at this shape (None: a composite row, or not asked)."""
    found = [
        choice
        for key, choice in product_choice.CHOOSER.choices.items()
        if (key.product, key.batch, key.d_sae, key.width) == (product, batch, d_sae, d_in)
    ]
    return found[-1] if found else None


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
    if device.type != "cuda":
        print("chooser (Triton kernel or cuBLAS per product): needs CUDA")
        return
    print()
    for line in chooser_rows(args, device, dtype):
        print(line, flush=True)


if __name__ == "__main__":
    main()
