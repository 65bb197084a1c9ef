"""A device count read on the host a fixed number of steps late, without a read in the step.

Why: a sync-free step (`SparseAutoencoder.avoids_host_reads`) must not read a device value, yet some
work is worth doing only when a count is not 0 (AuxK with no dead latent), and a step captured as a CUDA
graph (`sae_pipeline.training.graph_step`) can only follow a value the host knows before it runs. A count
that moves slowly (dead latents change over millions of tokens, not steps) can be known late instead:
after each step it is copied, non-blocking, into pinned host memory (an event recorded after the copy),
and read ``lag`` steps later, when the device has long finished that step.

The lag is exact: before step ``t`` the host reads the count pushed after step ``t − 1 − lag``, so step
``t`` follows the count as it was at the start of step ``t − lag``. If the device is still more than
``lag`` steps behind the host, the read waits for that step's event: the host never runs more than
``lag`` steps ahead of the device, which then still has ``lag`` steps queued and does not idle. That keeps
every run, eager or captured, and every DDP rank (whose dead-latent clocks are merged) on the same values.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


class LateCount:
    """A device scalar's value as it was ``lag`` pushes ago (see the module docstring).

    Use: `reset` once before the first step (with a value read now, one host read per fit, or None);
    `read` before each step; `push` after each step.
    """

    def __init__(self, lag: int) -> None:
        if lag < 1:
            raise ValueError(f"lag must be at least 1 (0 would wait for the step just queued), got {lag}")
        self.lag = lag
        self.value: int | None = None
        self._host: Tensor | None = None  # lag + 1 slots, pinned when the counts live on a GPU
        self._slots: np.ndarray | None = None  # numpy view of _host: read without a torch call
        self._events: list[torch.cuda.Event] | None = None
        self._pushed = 0
        self._read = 0

    def reset(self, value: int | None, device: torch.device) -> None:
        """Forget every copy; ``value``: what `read` returns until the first push is ``lag`` steps old."""
        self.value = value
        self._pushed = self._read = 0
        pinned = device.type == "cuda"
        self._host = torch.zeros(self.lag + 1, dtype=torch.int64, pin_memory=pinned)
        self._slots = self._host.numpy()
        self._events = [torch.cuda.Event() for _ in range(self.lag + 1)] if pinned else None

    def push(self, count: Tensor) -> None:
        """Copy the device scalar ``count`` into the next slot, non-blocking (outside a captured graph)."""
        if self._host is None or (self._events is not None) != count.is_cuda:
            self.reset(self.value, count.device)
        assert self._host is not None
        while self._pushed - self._read > self.lag:  # every slot holds an unread copy: the oldest is read first
            self._consume()
        slot = self._pushed % (self.lag + 1)
        self._host[slot].copy_(count, non_blocking=True)
        if self._events is not None:
            self._events[slot].record(torch.cuda.current_stream(count.device))
        self._pushed += 1

    def read(self) -> int | None:
        """The newest count pushed more than ``lag`` pushes ago (None: none yet and no value at `reset`)."""
        while self._pushed - self._read > self.lag:
            self._consume()
        return self.value

    def _consume(self) -> None:
        slot = self._read % (self.lag + 1)
        if self._events is not None:
            self._events[slot].synchronize()  # done already unless the host is `lag` steps ahead of the device
        assert self._slots is not None
        self.value = int(self._slots[slot])
        self._read += 1

    def __getstate__(self) -> dict[str, int]:
        """Copies and pickles keep the lag only: the slots and events belong to this process's run."""
        return {"lag": self.lag}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(state["lag"])  # type: ignore[misc]
