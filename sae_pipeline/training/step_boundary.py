"""Signals acted on at a training-step boundary, agreed by every rank.

A signal handler may only record what it received: saving a checkpoint needs every DDP rank
at the same step, and collectives inside a handler can deadlock. :class:`StepBoundaryCallback`
gives SIGTERM/Ctrl-C (:mod:`sae_pipeline.training.interrupts`) and SLURM's requeue signal
(:mod:`sae_pipeline.training.requeue`) the same two moments to act (after each training batch and after
each real validation pass) and :func:`max_over_ranks` the one small all-reduce that makes a
signal seen by one rank stop them all at the same step.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.distributed as dist


def max_over_ranks(trainer: L.Trainer, value: int) -> int:
    """``value``'s maximum over the ranks (no collective in a single process)."""
    if not (dist.is_available() and dist.is_initialized() and trainer.world_size > 1):
        return value
    flag = torch.tensor([value], dtype=torch.int64, device=trainer.strategy.root_device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


class StepBoundaryCallback(L.Callback):
    """Calls ``self._check(trainer)`` after each training batch and each (non-sanity) validation pass."""

    def _check(self, trainer: L.Trainer) -> None:
        raise NotImplementedError

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._check(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._check(trainer)
