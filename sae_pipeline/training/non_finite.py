"""NaN/Inf in a training batch or its loss: the one-line error, and the device-side watch that finds it
without a host read per step.

Why: testing ``torch.isfinite(x).all()`` in Python reads a device value on the host, so on a GPU every
step would wait for the previous one to finish. On such devices the training module notes each step's
finiteness on the device instead (a few scalar kernels) and reads it on the steps Lightning logs and
before every checkpoint is written: the error still names the first bad step and its shards, and no
checkpoint holds weights that saw the bad batch. On the CPU, where the read is free, the module
checks each batch at once (`SparseAutoencoder.avoids_host_reads`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class NonFiniteBatchError(FloatingPointError, ValueError):
    """A batch (or the loss on it) holds NaN or Inf; the message names the global step and the shards."""


def batch_sources(batch: dict[str, Any], shown: int = 3) -> str:
    """The shards (or row blocks) of a batch for an error message: a few names, then how many more."""
    names = [str(name) for name in batch.get("shards", [])]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"shards {', '.join(names[:shown])}{more}" if names else "an unnamed source"


def non_finite_batch(where: str, step: int, sources: str, n_bad: int) -> NonFiniteBatchError:
    return NonFiniteBatchError(
        f"{where} at global step {step}: batch from {sources} holds {n_bad} NaN/Inf values; "
        "re-extract or drop those shards"
    )


def non_finite_loss(where: str, step: int, sources: str, loss: float, lr_setting: str) -> NonFiniteBatchError:
    return NonFiniteBatchError(
        f"{where} at global step {step}: loss is {loss} on the batch from {sources}; training diverged, "
        f"lower {lr_setting}"
    )


class NonFiniteWatch:
    """The first step since the last read whose batch or loss was not finite, kept on the device.

    ``note`` runs in the training step (device-side ``torch.where`` only); ``raise_if_seen`` reads the
    three scalars (one host sync) and raises for that step, naming its shards (kept on the host, per
    step, until the next read).
    """

    def __init__(self) -> None:
        self._step: Tensor | None = None  # -1: none yet
        self._n_bad: Tensor | None = None
        self._loss: Tensor | None = None
        self._sources: dict[int, str] = {}

    def note(self, step: int | Tensor, batch: dict[str, Any], x: Tensor, loss: Tensor) -> None:
        """Record ``x`` (the batch as loaded) and ``loss`` of global step ``step`` (a device scalar in a
        captured step: its shards are then recorded by `remember`, on the host)."""
        n_bad = (~torch.isfinite(x)).sum()
        loss = loss.detach().to(torch.float64)
        bad = (n_bad > 0) | ~torch.isfinite(loss)
        if self._step is None or self._n_bad is None or self._loss is None:
            self._step = torch.full((), -1, dtype=torch.int64, device=x.device)
            self._n_bad = torch.zeros((), dtype=n_bad.dtype, device=x.device)
            self._loss = torch.zeros((), dtype=torch.float64, device=x.device)
        first = bad & (self._step < 0)
        # in place: a CUDA graph replays the update on the same three scalars
        self._step.copy_(torch.where(first, step, self._step))
        self._n_bad.copy_(torch.where(first, n_bad, self._n_bad))
        self._loss.copy_(torch.where(first, loss, self._loss))
        if not isinstance(step, Tensor):
            self.remember(step, batch)

    def remember(self, step: int, batch: dict[str, Any]) -> None:
        """The shards of global step ``step``'s batch, for the message."""
        self._sources[step] = batch_sources(batch)

    def raise_if_seen(self, where: str, lr_setting: str) -> None:
        """Raise `NonFiniteBatchError` for the first bad step noted since the last call, if any
        (``where``: "training of SAE 'a'"; ``lr_setting``: the learning rate to lower and its value)."""
        if self._step is None or self._n_bad is None or self._loss is None:
            return
        step = int(self._step)
        sources, self._sources = self._sources.get(step, "an unnamed source"), {}
        if step < 0:
            return
        n_bad = int(self._n_bad)
        if n_bad:
            raise non_finite_batch(where, step, sources, n_bad)
        raise non_finite_loss(where, step, sources, float(self._loss), lr_setting)
