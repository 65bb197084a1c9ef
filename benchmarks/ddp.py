"""Benchmark: what DDP's synchronisation adds to an SAE step, N ranks against 1 rank, same run.

    python -m benchmarks.ddp                    # CPU, gloo, 2 ranks x 1 thread: d_in 256, d_sae 4096, B 1024, k 16
    python -m benchmarks.ddp --device cuda      # NCCL, one rank per visible GPU: d_in 768, d_sae 19200, B 4096, k 32
    python -m benchmarks.ddp --dry-run          # CPU, tiny shapes, a few steps (tests/test_benchmarks_peers.py)

Every side runs the same step on the same per-rank batch (`--batch-size` tokens per rank): forward,
loss, backward, the dead-latent clock's all-reduce (as `SAEModule.record_firing`), removal of the
gradient component parallel to each atom, fused Adam, unit-norm atoms. The sides, alternated for
`--repeats` rounds inside one process group:

- `1 rank`: rank 0 alone, no DDP (the other ranks wait at a barrier): the single-process step.
- `1 rank + DDP`: rank 0 alone in DDP over a one-rank group, with the product's settings
  (`sae_pipeline.training.ddp`): DDP's own cost (reducer hooks, buckets) without any traffic.
- `N ranks`: every rank, DDP with the product's settings: the step of a data-parallel run.
- `N ranks bf16`: the same with `--ddp.grad_compression bf16` (half the bytes on the wire).

`vs 1 rank` is a side's step time over the `1 rank` step time: what synchronisation adds per step
(1.00 would be free; the N ranks together then train N times the tokens). Tokens/s counts every
rank's tokens. On the CPU each rank gets `--threads` threads (default 1), so the N ranks use N times
the cores of the one rank: run it where N × threads cores are free. Steps are timed one by one and
the median is kept (a burst of interference spoils few steps); on CUDA a side is timed between two
device syncs. With one GPU only the two 1-rank sides can run: the all-reduce between GPUs is then
owed, and the table says so.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.fit_hooks import FitHooks
from benchmarks.gpu import make_sae
from sae_pipeline.sae import SAE_REGISTRY, SparseAutoencoder
from sae_pipeline.training.ddp import COMPRESSION_HOOKS, DDP_DEFAULTS
from sae_pipeline.training.optim import adam_implementation

LR = 5e-4


class StepLoss(nn.Module):
    """The SAE's forward and loss as one module, so DDP sees the loss's whole graph (as Lightning runs
    `training_step` inside the DDP wrapper's forward)."""

    def __init__(self, sae: SparseAutoencoder) -> None:
        super().__init__()
        self.sae = sae

    def forward(self, x: torch.Tensor, step: int) -> tuple[Any, torch.Tensor]:
        output = self.sae(x)
        return output, self.sae.loss(x, output, step=step).loss


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def side_durations(
    template: SparseAutoencoder,
    x: torch.Tensor,
    args: argparse.Namespace,
    group: Any,
    ddp: bool,
    compression: str = "none",
) -> list[float]:
    """Per-step seconds of `--steps` steps after `--warmup` (CPU: each step; CUDA: the mean between two syncs)."""
    sae = copy.deepcopy(template)
    module: nn.Module = StepLoss(sae)
    if ddp:
        device_ids = [x.device.index] if x.device.type == "cuda" else None
        module = DistributedDataParallel(module, device_ids=device_ids, process_group=group, **DDP_DEFAULTS)
        if compression != "none":
            module.register_comm_hook(group, COMPRESSION_HOOKS[compression])
    n_ranks = dist.get_world_size(group) if group is not None else 1
    optimizer = torch.optim.Adam(sae.parameters(), lr=LR, **adam_implementation(sae))
    marks: list[float] = []
    hooks = FitHooks(sae)  # the SAE's host-side hooks where SAEModule calls them (TopK's AuxK plan)
    for step in range(args.warmup + args.steps):
        if step >= args.warmup and (x.device.type != "cuda" or step == args.warmup):
            sync(x.device)
            marks.append(time.perf_counter())
        with hooks.step():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.device.type == "cuda"):
                output, loss = module(x, step)
            loss.backward()
            with torch.no_grad():
                fired = output.fired()
                counts = torch.cat([fired.to(torch.int64), fired.new_full((1,), x.shape[0], dtype=torch.int64)])
                if n_ranks > 1:
                    dist.all_reduce(counts, group=group)
                sae.record_firing(counts[:-1] > 0, counts[-1])
            sae.remove_parallel_grad()
            optimizer.step()
            sae.normalize_atoms()
    sync(x.device)
    marks.append(time.perf_counter())
    if x.device.type == "cuda":
        return [(marks[-1] - marks[0]) / args.steps] * args.steps
    return [stop - start for start, stop in zip(marks, marks[1:])]


def sides(world: int) -> list[tuple[str, int, bool, str]]:
    """(name, ranks, DDP, compression) of every side this world size can run."""
    solo = [("1 rank", 1, False, "none"), ("1 rank + DDP", 1, True, "none")]
    if world < 2:
        return solo
    return [*solo, (f"{world} ranks", world, True, "none"), (f"{world} ranks bf16", world, True, "bf16")]


def worker(rank: int, world: int, init_fpath: str, args: argparse.Namespace, out_fpath: str) -> None:
    """One rank: every side of every variant, `--repeats` alternating rounds; rank 0 writes the durations."""
    warnings.filterwarnings("ignore")
    cuda = args.device == "cuda"
    if not cuda:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
        torch.set_num_threads(args.threads)
    else:
        torch.cuda.set_device(rank)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_fpath}", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    solo_group = dist.new_group([0])  # every rank takes part in creating it
    results: dict[str, dict[str, list[float]]] = {}
    for variant in args.variants:
        generator = torch.Generator().manual_seed(rank)  # each rank its own batch, as in a real run
        x = (torch.randn(args.batch_size, args.d_in, generator=generator) + 0.5).to(device)
        template = make_sae(variant, args, x)
        results[variant] = {name: [] for name, *_ in sides(world)}
        for _ in range(args.repeats):
            for name, n_ranks, ddp, compression in sides(world):
                if n_ranks == 1:
                    if rank == 0:
                        group = solo_group if ddp else None
                        results[variant][name] += side_durations(template, x, args, group, ddp, compression)
                    dist.barrier()
                else:
                    results[variant][name] += side_durations(template, x, args, None, ddp, compression)
    if rank == 0:
        Path(out_fpath).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def table(results: dict[str, dict[str, list[float]]], args: argparse.Namespace, world: int) -> list[str]:
    lines = ["| variant | side | step (ms) | tokens/s, all ranks | vs 1 rank |", "| --- | --- | --- | --- | --- |"]
    for variant, by_side in results.items():
        solo = statistics.median(by_side["1 rank"])
        for name, n_ranks, _, _ in sides(world):
            seconds = statistics.median(by_side[name])
            tokens = n_ranks * args.batch_size / seconds
            lines.append(f"| {variant} | {name} | {seconds * 1e3:.3g} | {tokens:,.0f} | {seconds / solo:.2f} |")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--ranks", type=int, default=None, help="CPU: processes (default 2); CUDA: every visible GPU")
    parser.add_argument("--variants", nargs="+", default=["topk"], choices=list(SAE_REGISTRY))
    parser.add_argument("--d-in", type=int, default=None, help="default: 256 on CPU, 768 on CUDA")
    parser.add_argument("--d-sae", type=int, default=None, help="default: 4096 on CPU, 19200 on CUDA")
    parser.add_argument("--k", type=int, default=None, help="default: 16 on CPU, 32 on CUDA")
    parser.add_argument("--batch-size", type=int, default=None, help="tokens per rank (default: 1024 CPU, 4096 CUDA)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds (their steps are pooled)")
    parser.add_argument("--threads", type=int, default=1, help="CPU: torch threads per rank")
    parser.add_argument("--dry-run", action="store_true", help="CPU, 2 ranks, tiny shapes: checks the script runs")
    args = parser.parse_args(argv)
    cuda_shape, cpu_shape = (768, 19200, 32, 4096), (256, 4096, 16, 1024)
    for name, cpu_default, cuda_default in zip(("d_in", "d_sae", "k", "batch_size"), cpu_shape, cuda_shape):
        if getattr(args, name) is None:
            setattr(args, name, cuda_default if args.device == "cuda" else cpu_default)
    if args.dry_run:
        args.device, args.ranks, args.d_in, args.d_sae, args.k, args.batch_size = "cpu", 2, 16, 64, 4, 32
        args.steps, args.warmup, args.repeats = 3, 1, 1
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible; run on a GPU machine, or use the CPU")
    if args.ranks is None:
        args.ranks = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.device == "cuda" and args.ranks > torch.cuda.device_count():
        parser.error(f"--ranks {args.ranks}: only {torch.cuda.device_count()} GPU(s) visible (one rank per GPU)")
    for name in ("ranks", "d_in", "d_sae", "k", "batch_size", "steps", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.k > args.d_sae:
        parser.error(f"--k must be in [1, --d-sae={args.d_sae}], got {args.k}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    world = args.ranks
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU, {args.threads} thread(s) per rank"
    megabytes = 4 * 2 * args.d_in * args.d_sae / 1e6
    print(
        f"device: {name}; {world} rank(s), {'NCCL' if args.device == 'cuda' else 'gloo'}; d_in={args.d_in} "
        f"d_sae={args.d_sae} k={args.k} B={args.batch_size} per rank; {megabytes:.3g} MB of float32 gradients "
        f"per step; {args.warmup} warm-up + {args.steps} timed steps, median over {args.repeats} round(s)",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        out_fpath = os.path.join(tmp, "durations.json")
        # fork on the CPU: the ranks inherit the imports (seconds each); CUDA cannot be forked
        start_method = "spawn" if args.device == "cuda" else "fork"
        mp.start_processes(
            worker, args=(world, os.path.join(tmp, "init"), args, out_fpath), nprocs=world, start_method=start_method
        )
        results = json.loads(Path(out_fpath).read_text())
    print("\n".join(table(results, args, world)))
    if world < 2:
        print("one rank only (one GPU visible): the all-reduce between GPUs is owed; run it where 2+ GPUs are visible")
    else:
        overhead = statistics.median(results[args.variants[0]][f"{world} ranks"])
        solo = statistics.median(results[args.variants[0]]["1 rank"])
        print(f"synchronisation adds {overhead / solo - 1:+.0%} to the {args.variants[0]} step at {world} ranks")


if __name__ == "__main__":
    sys.exit(main())
