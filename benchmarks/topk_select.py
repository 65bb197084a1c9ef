"""Benchmark: the top-k selection kernels (`sae_pipeline/sae/triton_topk.py`) against `torch.topk` and against
reading the pre-activations once from memory, at the paper's shape.

    python -m benchmarks.topk_select                 # CUDA: B 4096, d_sae 19200, k 32, bf16
    python -m benchmarks.topk_select --dtype float32 --sweep
    python -m benchmarks.topk_select --dry-run       # CPU, tiny shapes (tests/test_topk_select.py)

Rows: ``per-token top-k`` (TopK's support: the k largest of each of B rows; `torch.topk(k, dim=1, sorted=False)`)
and ``batch top-k`` (BatchTopK's: the B·k largest of the flattened batch; `torch.topk` over the flattened values,
and the threshold search of `sae_pipeline/sae/batch_select.py` it replaced). Columns: the kernel replayed from a
CUDA graph (as a captured training step runs it: no launch overhead), each other contender the same way, ``read
floor`` (`amax` over the values: one read of ``B·d_sae`` values, the bound the kernels aim at; the bandwidth it
reached is printed), the kernel launched eagerly, then ``torch.topk / Triton`` and ``Triton / floor`` (the goal:
at most 2). Each time is the mean over ``--steps`` replays between CUDA events, after ``--warmup`` calls.

Also printed: how many rows took the per-token kernel's exact path (its candidates could miss one, a NaN, a
threshold of ±0), and with ``--sweep`` the per-token kernel at each ``(G, UNROLL, num_warps, STAGES)`` of `SWEEP`
and the batch selection at each of `BATCH_SWEEP` (its per-token kernel's tile). Without
CUDA the kernel's columns read "needs CUDA" (the dry run checks the rest runs).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.gpu import timed

#: ``(G, UNROLL, num_warps, STAGES)`` of `triton_topk.row_top_k` that ``--sweep`` times (each one compile)
SWEEP = [
    (g, u, w, s)
    for g, u, w in ((256, 8, 2), (512, 4, 1), (512, 4, 2), (512, 8, 2), (512, 8, 4), (1024, 2, 2), (1024, 4, 4))
    for s in (1, 3)
]
#: the same for the per-token kernel inside `triton_batch_topk.batch_top_k` (R = 2k per row)
BATCH_SWEEP = [(512, 4, 2, 1), (1024, 2, 2, 1), (1024, 2, 4, 1), (1024, 4, 4, 1), (1024, 2, 4, 3), (2048, 1, 4, 1)]


def measure(fn: Callable[[], object], args: argparse.Namespace, device: torch.device) -> float:
    """Seconds per call: on CUDA replayed from a graph (eagerly when it cannot be captured), timed by events."""
    timed(fn, args.warmup, device)
    if device.type != "cuda":
        return timed(fn, args.steps, device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except RuntimeError:  # not capturable: eager
        run = fn  # type: ignore[assignment]
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / args.steps


def eager(fn: Callable[[], object], args: argparse.Namespace, device: torch.device) -> float:
    timed(fn, args.warmup, device)
    return timed(fn, args.steps, device)


def ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.3f} ms"


def ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None else f"{a / b:.2f}x"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = getattr(torch, args.dtype)
    B, d_sae, k = args.batch_size, args.d_sae, args.k
    values = torch.randn(B, d_sae, device=device, generator=torch.Generator(device).manual_seed(0)).to(dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU dry run"
    print(f"device: {name}; B={B} d_sae={d_sae} k={k} {args.dtype}; {values.numel() * values.element_size():,} bytes")
    kernels = batch_select = triton_batch_topk = None
    if device.type == "cuda":
        from sae_pipeline.sae import batch_select, triton_batch_topk, triton_topk

        kernels = triton_topk
    floor = measure(lambda: values.amax(), args, device)
    print(f"read floor: {values.numel() * values.element_size() / floor / 1e12:.2f} TB/s (amax)")
    flat = values.reshape(-1)
    rows: dict[str, tuple] = {
        "per-token top-k": (
            kernels and (lambda: kernels.row_top_k(values, k)),
            lambda: values.topk(k, dim=1, sorted=False).indices,
            None,
        ),
        "batch top-k": (
            kernels and (lambda: triton_batch_topk.batch_top_k(values, B * k)),
            lambda: flat.topk(B * k, sorted=False).indices,
            batch_select and (lambda: batch_select.radix_top_indices(flat, B * k)),
        ),
    }
    header = ["selection", "Triton", "torch.topk", "batch_select", "read floor", "Triton eager", "topk / Triton"]
    print(f"| {' | '.join(header)} | Triton / floor |")
    print("|---|---|---|---|---|---|---|---|")
    for selection, (kernel, topk, radix) in rows.items():
        t_kernel = measure(kernel, args, device) if kernel else None
        t_topk = measure(topk, args, device)
        t_radix = measure(radix, args, device) if radix else None
        t_eager = eager(kernel, args, device) if kernel else None
        cells = [
            ms(t_kernel) if kernel else "needs CUDA",
            ms(t_topk),
            ms(t_radix) if radix or selection == "per-token top-k" else "needs CUDA",
            ms(floor),
            ms(t_eager) if kernel else "needs CUDA",
            ratio(t_topk, t_kernel),
            ratio(t_kernel, floor),
        ]
        print(f"| {selection} | {' | '.join(cells)} |", flush=True)
    if kernels is None:
        print("exact-path rows: needs CUDA")
        return
    fallbacks = torch.zeros(1, dtype=torch.int32, device=device)
    kernels.row_top_k(values, k, fallbacks=fallbacks)
    print(f"exact-path rows: {int(fallbacks)} of {B} ({int(fallbacks) / B:.1%}); tile {kernels.tile_for(k)}")
    if args.sweep:
        times = {tile: measure(lambda t=tile: kernels.row_top_k(values, k, tile=t), args, device) for tile in SWEEP}
        fastest = sorted(times.items(), key=lambda item: item[1])
        cells = ", ".join(f"G{g} U{u} w{w} s{s} {t * 1e3:.3f} ms" for (g, u, w, s), t in fastest)
        print(f"sweep per-token (G, UNROLL, warps, STAGES), fastest first: {cells}")
        times = {
            tile: measure(lambda t=tile: triton_batch_topk.batch_top_k(values, B * k, tile=t), args, device)
            for tile in BATCH_SWEEP
        }
        fastest = sorted(times.items(), key=lambda item: item[1])
        cells = ", ".join(f"G{g} U{u} w{w} s{s} {t * 1e3:.3f} ms" for (g, u, w, s), t in fastest)
        r = 2 * k
        print(f"sweep batch (its per-token kernel at R={r}: {kernels.tile_for(r)} by default), fastest first: {cells}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-sae", type=int, default=19200)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="also time the per-token kernel at each tile of SWEEP")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks the script runs")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.d_sae, args.k, args.batch_size, args.steps, args.warmup = 256, 4, 64, 2, 1
    elif not torch.cuda.is_available():
        parser.error("no CUDA device is visible: run on a GPU machine, or use --dry-run for the CPU check")
    for name in ("d_sae", "k", "batch_size", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.k >= args.d_sae:
        parser.error(f"--k must be in [1, --d-sae={args.d_sae}), got {args.k}")
    return args


if __name__ == "__main__":
    main()
