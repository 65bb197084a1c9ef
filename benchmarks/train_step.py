"""Benchmark: SAE training steps through the Lightning Trainer against a bare PyTorch loop, same run.

    python -m benchmarks.train_step                  # CPU: d_in=256, d_sae=4096, B=1024, k=16 (target: overhead ≤ 10 %)
    python -m benchmarks.train_step --device cuda    # the same on a GPU
    python -m benchmarks.train_step --quick          # tiny sizes, a few steps (a smoke run)
    python -m benchmarks.train_step --device cuda --cuda-graph   # adds the Trainer with the step as a CUDA graph

Both sides do the same work per step on the same SAE (same initial weights, same batches
already on the device): forward, loss (MSE + the variant's terms, AuxK for TopK), backward,
removal of the gradient component parallel to each atom, Adam, the warm-up + cosine
learning-rate schedule of ``SAEModule``, unit-norm atoms, the dead-latent clock, and the SAE's
host-side hooks where the module calls them (TopK's AuxK plan: benchmarks/fit_hooks.py). The
Lightning side is ``SAEModule`` in a ``Trainer`` with no logger, no checkpointing and no
progress bar, so what it adds is the Trainer's loop and the module's own per-step
bookkeeping (``self.log`` of the train metrics, train R²).

Timing: ``--warmup`` steps first (allocator, thread pools, autograd caches), then ``--steps``
timed steps. The sides alternate for ``--repeats`` rounds. On CPU each step is timed from its
start to the next one's (the Trainer's time between batches included) and steps/s is
1 / the median step time over all rounds: on a shared machine a burst of interference
spoils a few steps, which the median ignores, where a whole-run mean would absorb it. On
CUDA the device is synchronised only at both ends of a run. Each round's median is printed
too. Overhead = bare steps/s / Lightning steps/s − 1 (the issue's
target: <= 10 %). A third side, "bare+metrics", adds the module's per-step bookkeeping to the
bare loop; "loop only" = bare+metrics steps/s / Lightning steps/s − 1 is then what the
Trainer's loop itself costs. The module computes its train metrics (L0, R², MSE, …) only on
the steps Lightning writes logs (``--log-every``, Lightning's default 50), which the median
skips; "mean ovh." is the overhead from mean step times, so it counts those steps (and any
interference) in.

The "Trainer" side runs the eager step (``SAEModule(cuda_graph=False)``). ``--cuda-graph`` adds a
fourth side, "graph": the same Trainer with the step captured once and replayed
(``cuda_graph=True``, `sae_pipeline.training.graph_step`; its warm-up and capture fall in the
untimed steps), and "graph x" = graph steps/s / Trainer steps/s. On the CPU that side falls back to
the eager step, so it times that step again.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch

from benchmarks.fit_hooks import FitHooks
from sae_pipeline.metrics import ReconstructionR2, dead_fraction
from sae_pipeline.sae import SAE_REGISTRY, SparseAutoencoder
from sae_pipeline.training.graph_step import WARMUP_STEPS
from sae_pipeline.training.module import SAEModule
from sae_pipeline.training.optim import adam_implementation, param_groups, warmup_cosine_factor

LR, MIN_LR = 5e-4, 1e-6


class InMemoryBatches:
    """``n_steps`` batches ``{"x", "shards"}`` cycled from a few distinct device tensors (no loader cost)."""

    def __init__(self, tensors: list[torch.Tensor], n_steps: int) -> None:
        self.tensors, self.n_steps = tensors, n_steps

    def __len__(self) -> int:
        return self.n_steps

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for step in range(self.n_steps):
            yield {"x": self.tensors[step % len(self.tensors)], "shards": ["memory"]}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Step durations of one run. On CPU every step is timed (start to next start), so a burst
    of interference from other processes spoils single steps, which the median then ignores.
    On CUDA only the two ends are timed, with a device sync (a sync per step would stall the
    queue and measure something else); the run then counts as ``n_steps`` equal steps."""

    def __init__(self, warmup: int, n_steps: int, device: torch.device) -> None:
        self.warmup, self.n_steps, self.device = warmup, n_steps, device
        self.marks: list[float] = []

    def step_start(self, step: int) -> None:
        if step == self.warmup or (step > self.warmup and self.device.type != "cuda"):
            if step == self.warmup:
                synchronize(self.device)
            self.marks.append(time.perf_counter())

    def finish(self) -> None:
        synchronize(self.device)
        self.marks.append(time.perf_counter())

    def durations(self) -> list[float]:
        if self.device.type == "cuda":
            return [(self.marks[-1] - self.marks[0]) / self.n_steps] * self.n_steps
        return [stop - start for start, stop in zip(self.marks, self.marks[1:])]


class StepTimer(L.Callback):
    """Feeds a :class:`StepClock` from the Trainer's batch hooks."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.clock.step_start(batch_idx)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.clock.warmup + self.clock.n_steps - 1:
            self.clock.finish()


def lightning_step_durations(
    template: SparseAutoencoder,
    batches: list[torch.Tensor],
    args: argparse.Namespace,
    device: torch.device,
    cuda_graph: bool = False,
) -> list[float]:
    return lightning_steps(copy.deepcopy(template), batches, args, device, cuda_graph)


def lightning_steps(
    sae: SparseAutoencoder,
    batches: list[torch.Tensor],
    args: argparse.Namespace,
    device: torch.device,
    cuda_graph: bool = False,
) -> list[float]:
    """``SAEModule`` around ``sae`` (trained in place) in a ``Trainer``: the step durations."""
    module = SAEModule(
        sae, lr=LR, warmup_steps=args.warmup_lr_steps, min_lr=MIN_LR, normalize_input=False, cuda_graph=cuda_graph
    )
    module.init_from_data(batches[0].mean(0).cpu(), float(batches[0].square().sum(1).mean()))
    total = args.warmup + args.steps
    clock = StepClock(args.warmup, args.steps, device)
    trainer = L.Trainer(
        accelerator=device.type,
        devices=1,
        precision="32-true",
        max_steps=total,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[StepTimer(clock)],
        log_every_n_steps=args.log_every,
    )
    trainer.fit(module, train_dataloaders=InMemoryBatches(batches, total))
    if trainer.global_step != total:
        raise RuntimeError(f"the Trainer ran {trainer.global_step} steps, expected {total}")
    return clock.durations()


def bare_step_durations(
    template: SparseAutoencoder,
    batches: list[torch.Tensor],
    args: argparse.Namespace,
    device: torch.device,
    with_metrics: bool = False,
) -> list[float]:
    return bare_steps(copy.deepcopy(template).to(device), batches, args, device, with_metrics)


def bare_steps(
    sae: SparseAutoencoder,
    batches: list[torch.Tensor],
    args: argparse.Namespace,
    device: torch.device,
    with_metrics: bool = False,
) -> list[float]:
    """The same work as ``SAEModule.training_step`` + the optimiser hooks, written out by hand, on ``sae`` (on
    ``device``, trained in place): the step durations.

    The SAE's host-side hooks run where the module runs them (`benchmarks.fit_hooks`: TopK's AuxK plan), Adam
    has the module's parameter groups (JumpReLU's threshold at its own pace). ``with_metrics`` adds the module's
    per-step bookkeeping (finite checks, input scaling, L0, train R², dead fraction), so that the Trainer's own
    loop cost can be told apart from it.
    """
    sae.train()
    train_r2 = ReconstructionR2(sae.d_in).to(device)
    input_scale = torch.ones((), device=device)
    sae.init_b_pre(batches[0].mean(0))
    total = args.warmup + args.steps
    optimizer = torch.optim.Adam(param_groups(sae, LR), **adam_implementation(sae))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine_factor(step, min(args.warmup_lr_steps, total), total, MIN_LR / LR)
    )
    clock = StepClock(args.warmup, args.steps, device)
    hooks = FitHooks(sae)
    for step in range(total):
        clock.step_start(step)
        with hooks.step():
            x = batches[step % len(batches)]
            if with_metrics:
                if not torch.isfinite(x).all():
                    raise FloatingPointError(f"non-finite batch at step {step}")
                x = x * input_scale
            output = sae(x)
            losses = sae.loss(x, output, step=step)
            if with_metrics:
                if not torch.isfinite(losses.loss):
                    raise FloatingPointError(f"non-finite loss at step {step}")
            if with_metrics and (step + 1) % args.log_every == 0:
                _ = [
                    output.l0().float(),
                    train_r2(x, output.x_hat).float(),
                    dead_fraction(sae.tokens_since_fired, sae.dead_after_tokens).float(),
                ]
            optimizer.zero_grad(set_to_none=True)
            losses.loss.backward()
            with torch.no_grad():
                sae.record_firing(output.fired(), x.shape[0])
            sae.remove_parallel_grad()
            optimizer.step()
            schedule.step()
            sae.normalize_atoms()
    clock.finish()
    return clock.durations()


def make_batches(args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    """A few correlated, offset batches (low-rank plus noise, like token activations)."""
    generator = torch.Generator().manual_seed(0)
    mixing = torch.randn(args.d_in // 4, args.d_in, generator=generator)
    offset = torch.randn(args.d_in, generator=generator)
    batches = []
    for _ in range(args.n_distinct_batches):
        latent = torch.randn(args.batch_size, args.d_in // 4, generator=generator)
        noise = 0.1 * torch.randn(args.batch_size, args.d_in, generator=generator)
        batches.append((latent @ mixing + noise + offset).to(device))
    return batches


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["topk", "mpsae"],
        choices=list(SAE_REGISTRY),
        help="registry keys; each gets sparsity --k through its class's sparsity_init_args",
    )
    parser.add_argument("--d-in", type=int, default=256)
    parser.add_argument("--d-sae", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: 100 on CPU, 200 on CUDA)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before the timed ones")
    parser.add_argument("--warmup-lr-steps", type=int, default=10, help="SAEModule.warmup_steps")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds (their steps are pooled)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--log-every",
        type=int,
        default=50,
        help="Trainer.log_every_n_steps (Lightning's default, 50): train metrics are computed then",
    )
    parser.add_argument("--n-distinct-batches", type=int, default=4)
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help=f"also time the Trainer with the step as one CUDA graph (warm-up raised to {WARMUP_STEPS + 2} steps)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 5 steps, 1 round (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.d_in, args.d_sae, args.batch_size, args.k = 32, 256, 128, 4
        args.steps, args.warmup, args.repeats = 5, 2, 1
    if args.cuda_graph:  # the graph's eager warm-up steps and its capture are not timed
        args.warmup = max(args.warmup, WARMUP_STEPS + 2)
    if args.steps is None:
        args.steps = 200 if args.device.startswith("cuda") else 100
    for name in ("d_in", "d_sae", "batch_size", "k", "steps", "repeats", "n_distinct_batches", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_in < 4:
        parser.error(f"--d-in must be >= 4, got {args.d_in}")
    if not 1 <= args.k <= args.d_sae:
        parser.error(f"--k must be in [1, --d-sae={args.d_sae}], got {args.k}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")  # Lightning's advice on loaders/SLURM would bury the table
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    device = torch.device(args.device)
    if args.threads is not None:
        if args.threads < 1:
            sys.exit(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is visible; run on a GPU machine or use --device cpu")
    device_name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    )
    print(
        f"device: {device_name}; d_in={args.d_in} d_sae={args.d_sae} B={args.batch_size} k={args.k}; "
        f"{args.warmup} warm-up + {args.steps} timed steps, median step over {args.repeats} alternating rounds"
    )
    batches = make_batches(args, device)
    graph_header = f" {'graph':>8} {'graph x':>8}" if args.cuda_graph else ""
    print(
        f"{'variant':<8} {'bare':>8} {'bare+metrics':>13} {'Trainer':>8} {'overhead':>9} {'loop only':>10} "
        f"{'mean ovh.':>10}{graph_header}"
        f"   (steps/s; per round: bare/bare+metrics/Trainer{'/graph' if args.cuda_graph else ''})"
    )
    for variant in args.variants:
        torch.manual_seed(0)
        cls = SAE_REGISTRY[variant]
        template = cls(d_in=args.d_in, d_sae=args.d_sae, **cls.sparsity_init_args(args.k))
        sides: dict[str, list[float]] = {"bare": [], "bare+metrics": [], "Trainer": []}
        if args.cuda_graph:
            sides["graph"] = []
        rounds = []
        for _ in range(args.repeats):
            durations = {
                "bare": bare_step_durations(template, batches, args, device),
                "bare+metrics": bare_step_durations(template, batches, args, device, with_metrics=True),
                "Trainer": lightning_step_durations(template, batches, args, device),
            }
            if args.cuda_graph:
                durations["graph"] = lightning_step_durations(template, batches, args, device, cuda_graph=True)
            for side, values in durations.items():
                sides[side] += values
            rounds.append("/".join(f"{1 / statistics.median(values):.3g}" for values in durations.values()))
        rate = {side: 1 / statistics.median(values) for side, values in sides.items()}
        mean_rate = {side: 1 / statistics.fmean(values) for side, values in sides.items()}
        overhead = rate["bare"] / rate["Trainer"] - 1  # the figure: Trainer + module against the bare loop
        loop_only = rate["bare+metrics"] / rate["Trainer"] - 1  # once the module's metrics are in the bare loop too
        mean_overhead = mean_rate["bare"] / mean_rate["Trainer"] - 1  # logging steps and interference included
        graph = f" {rate['graph']:>8.3g} {rate['graph'] / rate['Trainer']:>7.2f}x" if args.cuda_graph else ""
        print(
            f"{variant:<8} {rate['bare']:>8.3g} {rate['bare+metrics']:>13.3g} {rate['Trainer']:>8.3g} "
            f"{overhead:>8.1%} {loop_only:>10.1%} {mean_overhead:>10.1%}{graph}   {', '.join(rounds)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
