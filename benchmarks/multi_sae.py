"""Benchmark: N SAEs trained as one group (``SAEGroupModule``) against the same N SAEs each trained alone.

    python -m benchmarks.multi_sae                   # CPU: N = 1, 4, 16 TopK SAEs, d_in=64, d_sae=1024, B=512
    python -m benchmarks.multi_sae --device cuda --d_in 768 --d_sae 16384 --batch 4096
    python -m benchmarks.multi_sae --quick           # tiny sizes, a few steps (a smoke run)

Both sides run the real Lightning ``Trainer`` (no logger, no checkpointing, no progress bar) over the
same batches, read by a ``DataLoader`` from a tensor in memory (each batch copied out of it, as a
loader hands over a fresh batch). For each N it prints:

- ``ratio``: the group's median step time ÷ the sum of the N SAEs' median step times alone. The
  issue's target is ≤ 1.05: a group costs no more than its members, and saves the data path's
  cost N − 1 times (here the data path is a memory copy, so the ratio shows the group's own overhead).
- ``bytes/SAE-step``: bytes of batches the loader handed over ÷ (steps × N): the data read per SAE
  and step, which a group divides by N.

Median step times (start of one step to the start of the next) over ``--steps`` steps after
``--warmup`` steps, so a burst of interference on a shared machine spoils a few steps, not the figure;
the sides alternate for ``--rounds`` rounds and each keeps its fastest round's median.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from sae_pipeline.sae.config import build_sae
from sae_pipeline.training.group import SAEGroupModule
from sae_pipeline.training.module import SAEModule


class StepTimes(L.Callback):
    """Seconds from each training step's start to the next one's."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())

    def median(self, warmup: int) -> float:
        steps = [b - a for a, b in zip(self.starts[warmup:], self.starts[warmup + 1 :])]
        return statistics.median(steps)


class CountingLoader:
    """A DataLoader over ``data`` in batches of ``{"x"}``, counting the bytes it hands over."""

    def __init__(self, data: torch.Tensor, batch_size: int, n_steps: int) -> None:
        self.bytes = 0
        indices = [i % (len(data) // batch_size) for i in range(n_steps)]

        def collate(rows: list[int]) -> dict[str, torch.Tensor]:
            x = data[rows[0] * batch_size : (rows[0] + 1) * batch_size].clone()
            self.bytes += x.numel() * x.element_size()
            return {"x": x}

        self.loader = DataLoader(indices, batch_size=1, collate_fn=collate)


def member(args: argparse.Namespace, lr: float) -> dict[str, Any]:
    init_args = {"d_sae": args.d_sae, "k": args.k}
    return {"sae": {"class_path": "sae_pipeline.sae.TopKSAE", "init_args": init_args}, "lr": lr, "warmup_steps": 5}


def fit(module: L.LightningModule, data: torch.Tensor, args: argparse.Namespace) -> tuple[float, int]:
    """(median step seconds, bytes handed over) of one fit of ``module``."""
    n_steps = args.warmup + args.steps + 1
    times, loader = StepTimes(), CountingLoader(data, args.batch, n_steps)
    trainer = L.Trainer(
        accelerator=args.device,
        devices=1,
        max_steps=n_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[times],
    )
    trainer.fit(module, loader.loader)
    return times.median(args.warmup), loader.bytes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n", type=int, nargs="+", default=[1, 4, 16], help="group sizes")
    parser.add_argument("--d_in", type=int, default=64)
    parser.add_argument("--d_sae", type=int, default=1024)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per fit")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both sides; each side keeps its fastest")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.d_in, args.d_sae, args.k, args.batch, args.steps, args.warmup = [1, 2], 16, 64, 4, 64, 4, 1
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    data = torch.randn(8 * args.batch, args.d_in, generator=torch.Generator().manual_seed(0)).to(args.device)
    print(
        f"device {args.device}, TopK d_in={args.d_in} d_sae={args.d_sae} k={args.k} B={args.batch}, "
        f"{args.steps} timed steps; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print("   N | group ms/step | sum alone ms/step |  ratio | bytes/SAE-step group | alone")
    n_steps = args.warmup + args.steps + 1
    for n in args.n:
        members = {f"sae{i}": member(args, 1e-3 * (1 + i / 10)) for i in range(n)}
        group_s, alone_s = [], [[] for _ in members]
        for _ in range(args.rounds):  # the sides alternate; each keeps its least disturbed round
            torch.manual_seed(0)
            step_s, group_bytes = fit(SAEGroupModule(members, d_in=args.d_in), data, args)
            group_s.append(step_s)
            alone_bytes = 0
            for index, entry in enumerate(members.values()):
                torch.manual_seed(0)
                sae_config = {**entry["sae"], "init_args": {**entry["sae"]["init_args"], "d_in": args.d_in}}
                module = SAEModule(build_sae(sae_config), lr=entry["lr"], warmup_steps=5)
                step_s, n_bytes = fit(module, data, args)
                alone_s[index].append(step_s)
                alone_bytes += n_bytes
        group, alone = min(group_s), sum(min(times) for times in alone_s)
        print(
            f"{n:4d} | {1e3 * group:13.2f} | {1e3 * alone:17.2f} | {group / alone:6.3f} | "
            f"{group_bytes / (n_steps * n):20.0f} | {alone_bytes / (n_steps * n):.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
