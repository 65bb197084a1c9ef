"""The token-level shuffle buffer: tokens of whole images mixed across images with a fixed-size buffer.

Why its own module: it is the one part of the streams that holds memory (`shuffle_buffer_tokens` rows per loader
worker, on 2 MB pages where the kernel allows: `host_memory.py`) and draws randomness; the streams
(`streams.py`) decide which tokens flow through it, and `cache.py` runs it over token indices. Filled into free
slots; once full, a batch is `batch_size` slots drawn without replacement (one vectorised gather), and those slots
take the next tokens, so one image's tokens spread over about `capacity / batch_size` batches.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from feature_extraction.allocation import allocating
from sae_pipeline.data.host_memory import host_tensor


def check_shuffle_buffer(shuffle_buffer_tokens: int, batch_size: int) -> None:
    """The one check that a shuffle buffer holds at least a batch (it draws whole batches from itself)."""
    if shuffle_buffer_tokens < batch_size:
        raise ValueError(
            f"--data.shuffle_buffer_tokens={shuffle_buffer_tokens} must be >= --data.batch_size={batch_size}"
        )


def _buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The shuffle buffer's array: token rows on 2 MB pages where the kernel allows (`host_memory.py`: every
    batch fills and gathers random rows of it), cache indices (1-D, small) plainly. A refused allocation is one
    line naming the flag that sizes it (`feature_extraction.allocation`)."""
    n_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    fix = "lower --data.shuffle_buffer_tokens (each loader worker holds a buffer), or free memory"
    with allocating(f"the shuffle buffer ({shape[0]} tokens)", n_bytes, fix):
        if len(shape) != 2:
            return np.empty(shape, dtype)
        return host_tensor(shape[0], shape[1], torch.from_numpy(np.empty(0, dtype)).dtype, shared=False).numpy()


class ShuffleBuffer:
    """Shuffle tokens across images with a fixed-size buffer; every step is a vectorised numpy op."""

    def __init__(self, capacity: int, batch_size: int, rng: np.random.Generator) -> None:
        # capacity >= batch_size: the stream checks shuffle_buffer_tokens and sizes the buffer to at least a batch
        self.capacity, self.batch_size, self.rng = capacity, batch_size, rng
        self.tokens: np.ndarray | None = None
        self.units: np.ndarray | None = None

    def batches(self, chunks: Iterator[tuple[int, np.ndarray]], skip: int = 0) -> Iterator[np.ndarray]:
        """From ``(unit index, tokens)`` chunks, yield the buffer slots of each batch.

        The caller copies ``self.tokens[slots]`` (``gather``) before resuming: the slots
        then take new tokens. The first ``skip`` batches are drawn (the buffer's state
        depends on them) but not yielded. Leftover tokens (fewer than a batch) are dropped.
        """
        free, n_filled, n_drawn = np.arange(self.capacity), 0, 0
        for unit, part in chunks:
            if self.tokens is None:
                self.tokens = _buffer((self.capacity, *part.shape[1:]), part.dtype)  # rows, or cache indices
                self.units = np.empty(self.capacity, np.int32)
            pos = 0
            while pos < len(part):
                take = min(len(part) - pos, len(free) - n_filled)
                slots = free[n_filled : n_filled + take]
                self.tokens[slots] = part[pos : pos + take]
                self.units[slots] = unit
                n_filled += take
                pos += take
                if n_filled == len(free):  # full: draw a batch; its slots take the next tokens
                    free, n_filled = self.rng.choice(self.capacity, self.batch_size, replace=False), 0
                    if n_drawn >= skip:
                        yield free
                    n_drawn += 1
        if self.tokens is None:
            return
        left = np.ones(self.capacity, bool)
        left[free[n_filled:]] = False
        left = np.flatnonzero(left)
        self.rng.shuffle(left)
        for start in range(0, len(left) - self.batch_size + 1, self.batch_size):
            if n_drawn >= skip:
                yield left[start : start + self.batch_size]
            n_drawn += 1

    def gather(self, slots: np.ndarray, out: np.ndarray) -> None:
        """Copy the tokens of ``slots`` into ``out`` (one vectorised gather; torch's is the fastest here)."""
        torch.index_select(torch.from_numpy(self.tokens), 0, torch.from_numpy(slots), out=torch.from_numpy(out))
