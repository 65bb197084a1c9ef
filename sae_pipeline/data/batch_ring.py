"""The hand-over of batches from DataLoader workers to the main process, through reused shared-memory slots."""

from __future__ import annotations

import os
import time

import numpy as np
import torch

__all__ = ["BatchRing"]


class BatchRing:
    """Shared-memory batch slots, ``n_slots`` per DataLoader worker, reused for every batch.

    Why: a tensor returned by a worker is copied into a *new* shared-memory segment for
    every batch (torch's default hand-over); creating and faulting in 12 MB of fresh
    shared memory per 4096 x 768 float32 batch (batches were float32 then) cost about
    13 ms on the 2-core benchmark machine, as much as reading the tokens. Here a worker writes each batch into a fixed
    slot and sends only its place; the main process copies it out (``take``) and releases
    the slot. A worker waits before reusing a slot the main process has not released, so
    correctness does not depend on the DataLoader's prefetch depth; with
    ``n_slots = prefetch_factor + 2`` it rarely waits. The loader makes a new ring for
    every iterator, before the workers start.
    """

    def __init__(self, n_workers: int, n_slots: int, batch_size: int, d: int, dtype: np.dtype) -> None:
        self.n_slots = int(n_slots)
        with torch.inference_mode(False):  # validate/predict iterate in inference mode; the counters change outside
            self.tokens = torch.empty(
                (n_workers, self.n_slots, batch_size, d), dtype=torch.from_numpy(np.empty(0, dtype)).dtype
            ).share_memory_()
            self.released = torch.zeros(n_workers + 1, dtype=torch.int64).share_memory_()  # last entry: closed
        self._owner_pid = os.getpid()

    def slot(self, worker: int, index: int) -> tuple[int, np.ndarray] | None:
        """Worker side: the free slot for this worker's ``index``-th batch (None once the loader closed)."""
        while index - int(self.released[worker]) >= self.n_slots:
            if int(self.released[-1]) or os.getppid() != self._owner_pid:
                return None
            time.sleep(1e-4)
        return index % self.n_slots, self.tokens[worker, index % self.n_slots].numpy()

    def take(self, worker: int, slot: int, n: int, pin_memory: bool = False) -> torch.Tensor:
        """Main side: a new tensor (the source dtype) from a filled slot; frees the slot for the worker."""
        x = torch.empty((n, self.tokens.shape[-1]), dtype=self.tokens.dtype, pin_memory=pin_memory)
        x.copy_(self.tokens[worker, slot, :n])
        self.released[worker] += 1
        return x

    def close(self) -> None:
        """Main side: wake and stop workers waiting for a slot (the iterator is being shut down)."""
        self.released[-1] = 1
