"""One point of a numerical-kernel cost curve, measured in this (fresh) process; prints one JSON line.

    python -m benchmarks.scaling.points train --variant topk --d-in 768 --d-sae 8192 --batch-size 1024 --k 32
    python -m benchmarks.scaling.points babel --d-in 768 --p 8192
    python -m benchmarks.scaling.points bare-train  # the imports and the input batches alone: the memory offset

``benchmarks/scaling/compute.py`` runs each point through ``fit.run_point``, so that a point's
peak RSS is its own and not the high-water mark of the sizes before it. The training step is the one of
``benchmarks/train_step.py``'s bare loop (forward, the variant's loss, backward, parallel-gradient
removal, Adam, the learning-rate schedule, unit-norm atoms, the dead-latent clock, the SAE's host-side
hooks of benchmarks/fit_hooks.py), i.e. what
``SAEModule.training_step`` and its optimiser hooks do, without the Trainer's loop around it. It is
written out here rather than imported from ``benchmarks/train_step.py`` because that module imports
Lightning, which costs ~5 s per point on a loaded 2-core machine and ~60 points are measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.fit_hooks import FitHooks
from sae_pipeline.sae import SAE_REGISTRY, SparseAutoencoder


def make_batches(args: argparse.Namespace) -> list[torch.Tensor]:
    """Two correlated, offset batches (low-rank plus noise, like token activations), as train_step's."""
    generator = torch.Generator().manual_seed(0)
    mixing = torch.randn(args.d_in // 4, args.d_in, generator=generator)
    offset = torch.randn(args.d_in, generator=generator)
    batches = []
    for _ in range(2):
        latent = torch.randn(args.batch_size, args.d_in // 4, generator=generator)
        noise = 0.1 * torch.randn(args.batch_size, args.d_in, generator=generator)
        batches.append(latent @ mixing + noise + offset)
    return batches


def step_durations(sae: SparseAutoencoder, batches: list[torch.Tensor], warmup: int, steps: int) -> list[float]:
    """Wall time of each of ``steps`` training steps after ``warmup`` untimed ones (fused Adam, as in training)."""
    sae.train()
    sae.init_b_pre(batches[0].mean(0))
    optimizer = torch.optim.Adam(sae.parameters(), lr=5e-4, fused=True)
    durations = []
    hooks = FitHooks(sae)  # the SAE's host-side hooks where SAEModule calls them (TopK's AuxK plan)
    for step in range(warmup + steps):
        start = time.perf_counter()
        with hooks.step():
            x = batches[step % len(batches)]
            output = sae(x)
            losses = sae.loss(x, output, step=step)
            optimizer.zero_grad(set_to_none=True)
            losses.loss.backward()
            with torch.no_grad():
                sae.record_firing(output.fired(), x.shape[0])
            sae.remove_parallel_grad()
            optimizer.step()
            sae.normalize_atoms()
        if step >= warmup:
            durations.append(time.perf_counter() - start)
    return durations


def train_point(args: argparse.Namespace) -> dict:
    """Median step time of one variant after ``--warmup`` untimed steps."""
    torch.manual_seed(0)
    batches = make_batches(args)
    cls = SAE_REGISTRY[args.variant]
    sae = cls(d_in=args.d_in, d_sae=args.d_sae, **cls.sparsity_init_args(args.k))
    durations = step_durations(sae, batches, args.warmup, args.steps)
    return {"seconds": statistics.median(durations), "steps": len(durations)}


def babel_point(args: argparse.Namespace) -> dict:
    """Babel μ₁(1..r_max) of a random unit-norm dictionary of ``--p`` atoms (the metric's blocked path)."""
    from sae_pipeline.metrics import babel  # torchmetrics comes with it: seconds the training points need not pay

    generator = torch.Generator().manual_seed(0)
    W = torch.randn(args.p, args.d_in, generator=generator)
    W.div_(W.norm(dim=1, keepdim=True))
    babel(torch.randn(64, 8, generator=generator), r_max=4, block_size=16)  # start the BLAS threads untimed
    start = time.perf_counter()
    babel(W, r_max=args.r_max)
    return {"seconds": time.perf_counter() - start}


def bare_train_point(args: argparse.Namespace) -> dict:
    """Everything a training point holds before it builds the SAE: the memory offset of its curves."""
    make_batches(args)
    return {"seconds": 0.0}


def bare_babel_point(args: argparse.Namespace) -> dict:
    """Everything a Babel point holds before it draws the dictionary: the memory offset of its curve."""
    from sae_pipeline.metrics import babel

    babel(torch.randn(64, 8), r_max=4, block_size=16)
    return {"seconds": 0.0}


POINTS = {"train": train_point, "babel": babel_point, "bare-train": bare_train_point, "bare-babel": bare_babel_point}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=list(POINTS))
    parser.add_argument("--variant", choices=list(SAE_REGISTRY), default="topk")
    parser.add_argument("--d-in", type=int, default=768)
    parser.add_argument("--d-sae", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2, help="timed steps (the median is reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--p", type=int, default=4096, help="atoms of the Babel dictionary")
    parser.add_argument("--r-max", type=int, default=64)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    point = POINTS[args.kind](args)
    print(json.dumps({**point, "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
