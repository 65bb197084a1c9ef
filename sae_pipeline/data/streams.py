"""Token streams: split units over ranks and workers, shuffle tokens, yield equal batch counts.

Design choices:
- Splitting is by *token span*, not by whole unit: the units of an epoch (in a seeded
  order) are laid end to end and every (rank, worker) reader gets one contiguous span of
  that concatenation. A shard at a span boundary is read by both neighbours, each
  keeping its own images (the second stops reading the tar after its last image). So a
  reader opens its own shards plus at most two shared ones, and the spans are exact.
- Training: every rank gets ``n_batches = n_tokens // (world_size * batch_size)`` batches,
  computed from the unit token counts alone (the manifest), so every rank knows the
  count without communication and DDP never waits on a rank with fewer tokens. The
  rank's batches are dealt to its workers (``n // W`` each, one more for the first
  ``n % W``) and each worker's span holds exactly its quota of tokens. At most
  ``world_size * batch_size - 1`` tokens (the tail of the epoch's order, so different
  tokens every epoch) are left out of an epoch.
- Shuffle: a reservoir-style buffer of ``shuffle_buffer_tokens`` rows, filled with whole
  images' tokens into free slots; once full, a batch is ``batch_size`` slots drawn without
  replacement (one vectorised gather), and those slots take the next tokens. Tokens of
  one image thus spread over about ``capacity / batch_size`` batches. The unit order and
  the buffer's draws are seeded by (seed, epoch[, rank, worker]): deterministic, and new
  every epoch.
- Hand-over from DataLoader workers through a ``BatchRing`` of reused shared-memory slots
  (see there): a worker gathers a batch straight into a slot in the source dtype and the
  main process copies it out (into pinned memory for a CUDA device). Batches stay in the
  source dtype (float16 for shards) up to the device: the datamodule converts them there
  (``ActivationDataModule.on_after_batch_transfer``), so the host moves and the PCIe bus
  carries half the bytes of float32.
- The training plan (``ShuffledTokenStream._reader_batches``) does not care what flows through
  the buffer: ``cache.py`` runs it over token indices into an in-memory copy of the split.
- Validation/test/predict: the concatenated units are cut into ``world_size`` contiguous
  spans without padding (each token once across ranks; exact R^2 sums), then into worker
  spans that are whole batches except for the rank's last batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from sae_pipeline.data.batch_ring import BatchRing
from sae_pipeline.data.shuffle_buffer import ShuffleBuffer, check_shuffle_buffer
from sae_pipeline.data.sources import Chunk, Unit, plan_reads


def deal(n_batches: int, n_parts: int) -> list[int]:
    """Split ``n_batches`` over ``n_parts`` as evenly as possible, larger shares first."""
    return [n_batches // n_parts + (1 if part < n_batches % n_parts else 0) for part in range(n_parts)]


def batches_already_taken(quotas: Sequence[int], n_done: int) -> list[int]:
    """Per worker, how many of its batches are among the first ``n_done`` a DataLoader returns.

    A DataLoader over an IterableDataset takes one batch from each live worker in turn
    (worker 0 first); ``deal`` gives the earlier workers the larger quotas, so the order
    is round by round. Used to resume mid-epoch without repeating or losing batches: with
    the roles rotated by ``n_done % W`` the workers' remaining counts are non-increasing
    again, so the resumed DataLoader continues in exactly the original order.
    """
    taken = [0] * len(quotas)
    while n_done > 0:
        live = [w for w, quota in enumerate(quotas) if quota > taken[w]]
        if not live:
            break
        for w in live[:n_done]:
            taken[w] += 1
        n_done -= min(n_done, len(live))
    return taken


def span_pieces(counts: Sequence[int], start: int, stop: int) -> list[tuple[int, int, int]]:
    """Cover tokens ``[start, stop)`` of the concatenated units by ``(unit index, lo, hi)`` pieces."""
    offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    pieces = []
    unit = int(np.searchsorted(offsets, start, side="right")) - 1
    while start < stop and unit < len(counts):
        lo, hi = start - int(offsets[unit]), min(stop, int(offsets[unit + 1])) - int(offsets[unit])
        if hi > lo:
            pieces.append((unit, lo, hi))
            start = int(offsets[unit]) + hi
        unit += 1
    return pieces


class TokenStream(IterableDataset):
    """Common part of the streams: units, batch size, and this reader's place among ranks x workers.

    ``rank`` / ``world_size`` are explicit so that tests can build every rank's stream in
    one process; the datamodule passes torch.distributed's (or the trainer's) values.
    ``num_workers`` must equal the DataLoader's (0 = read in the main process).
    """

    def __init__(
        self,
        units: Sequence[Unit],
        batch_size: int,
        d: int,
        dtype: np.dtype,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"rank must be in [0, {world_size}) and world_size >= 1, got rank={rank}, world_size={world_size}"
            )
        if batch_size < 1 or num_workers < 0:
            raise ValueError(f"batch_size must be >= 1 and num_workers >= 0, got {batch_size}, {num_workers}")
        self.units, self.batch_size = list(units), int(batch_size)
        self.d, self.dtype = int(d), np.dtype(dtype)
        self.rank, self.world_size = int(rank), int(world_size)
        self.num_workers = int(num_workers)
        self.n_readers = max(1, self.num_workers)  # readers per rank
        self.names = [unit.name for unit in self.units]
        self.n_tokens = sum(unit.n_tokens for unit in self.units)
        self.ring: BatchRing | None = None

    def open_ring(self, n_slots: int) -> BatchRing | None:
        """A new ``BatchRing`` for the DataLoader iterator about to start (None without workers).

        Called in the main process before the workers start: they receive the stream, ring
        included, when the iterator starts them; batches then go through this ring.
        """
        self.ring = (
            BatchRing(self.num_workers, n_slots, self.batch_size, self.d, self.dtype) if self.num_workers > 0 else None
        )
        return self.ring

    def _worker(self) -> int:
        info = get_worker_info()
        n_workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        if n_workers != self.n_readers:
            raise ValueError(
                f"this stream was planned for num_workers={self.num_workers} but runs in a DataLoader "
                f"with {n_workers if info else 0}; build both with the same --data.num_workers"
            )
        return worker

    def _chunks(
        self, order: Sequence[int], pieces: list[tuple[int, int, int]], with_ids: bool
    ) -> Iterator[tuple[int, Chunk]]:
        plan_reads([self.units[order[position]] for position, _, _ in pieces])
        for position, lo, hi in pieces:
            unit = order[position]
            for chunk in self.units[unit].read(lo, hi, with_ids):
                yield unit, chunk

    def _shard_names(self, units: np.ndarray) -> list[str]:
        return [self.names[u] for u in np.unique(units).tolist()]

    def _output(self, worker: int, index: int, n: int, write: Callable[[np.ndarray], None]) -> dict | None:
        """The ``index``-th batch of this worker, ``n`` rows that ``write`` fills into a source-dtype array.

        In a DataLoader worker with a ring: ``{"ring": (worker, slot, n)}`` (the loader
        turns it into ``x``); otherwise ``{"x": tensor in the source dtype}``. None: the loader closed.
        """
        if self.ring is not None and get_worker_info() is not None:
            place = self.ring.slot(worker, index)
            if place is None:
                return None
            write(place[1][:n])
            return {"ring": (worker, place[0], n)}
        out = np.empty((n, self.d), self.dtype)
        write(out)
        return {"x": torch.from_numpy(out)}


class ShuffledTokenStream(TokenStream):
    """Training stream: exactly ``len(self)`` shuffled batches ``{"x", "shards"}`` per epoch on every rank."""

    def __init__(
        self,
        units: Sequence[Unit],
        batch_size: int,
        d: int,
        dtype: np.dtype,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        shuffle_buffer_tokens: int = 262_144,
        seed: int = 0,
        unit_kind: str = "shards",
    ) -> None:
        super().__init__(units, batch_size, d, dtype, rank, world_size, num_workers)
        n_readers = self.world_size * self.n_readers
        if len(self.units) < n_readers:
            raise ValueError(
                f"{len(self.units)} training {unit_kind} < ranks x workers = {self.world_size} x "
                f"{self.n_readers} = {n_readers}; lower --data.num_workers or write more, smaller shards"
            )
        self.n_batches = self.n_tokens // (self.world_size * self.batch_size)
        if self.n_batches == 0:
            raise ValueError(
                f"the training split has {self.n_tokens} tokens, fewer than ranks x batch_size = "
                f"{self.world_size} x {self.batch_size}; lower --data.batch_size"
            )
        check_shuffle_buffer(shuffle_buffer_tokens, batch_size)
        self.shuffle_buffer_tokens, self.seed = int(shuffle_buffer_tokens), int(seed)
        self.quotas = deal(self.n_batches, self.n_readers)
        self.epoch, self.skip_batches = 0, 0

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Select the epoch's order; ``skip_batches`` resumes after that many of this rank's batches."""
        self.epoch, self.skip_batches = int(epoch), int(skip_batches)

    def __len__(self) -> int:
        return self.n_batches

    def __iter__(self) -> Iterator[dict]:
        # After a resume the DataLoader polls worker 0 first, but the next batch of the interrupted
        # epoch belongs to worker skip % W: DataLoader worker i plays the role of worker (i + skip) % W.
        yield from self._reader_batches((self._worker() + self.skip_batches) % self.n_readers)

    def _reader_batches(self, worker: int) -> Iterator[dict]:
        """The batches of reader ``worker`` (its role) this epoch: the plan every training stream shares.

        The order, span, shuffle buffer, seeds and skip are fixed here; what flows through the
        buffer (``_token_parts``) and how a batch is gathered (``_gathered``) are the subclass's
        (``cache.py`` passes token indices into its in-memory copy of the split).
        """
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.units))
        quota = self.quotas[worker]
        start = (self.rank * self.n_batches + sum(self.quotas[:worker])) * self.batch_size
        stop = start + quota * self.batch_size
        pieces = span_pieces([self.units[u].n_tokens for u in order], start, stop)
        chunks = self._token_parts(order, pieces)
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, worker])
        buffer = ShuffleBuffer(
            max(self.batch_size, min(self.shuffle_buffer_tokens, stop - start)), self.batch_size, rng
        )
        skip = batches_already_taken(self.quotas, self.skip_batches)[worker]
        n_yielded = skip
        for index, slots in enumerate(buffer.batches(chunks, skip)):
            batch = self._gathered(worker, index, buffer, slots)
            if batch is None:
                return
            batch["shards"] = self._shard_names(buffer.units[slots])
            yield batch
            n_yielded += 1
        if n_yielded != quota:  # only a source that broke its own token count gets here
            raise ValueError(
                f"rank {self.rank} worker {worker} made {n_yielded} of {quota} batches from "
                f"{sorted({self.names[order[p]] for p, _, _ in pieces})}; the source changed while read"
            )

    def _token_parts(
        self, order: Sequence[int], pieces: list[tuple[int, int, int]]
    ) -> Iterator[tuple[int, np.ndarray]]:
        """``(unit index, tokens)`` of the reader's span, in order, for the shuffle buffer."""
        return ((unit, chunk.tokens) for unit, chunk in self._chunks(order, pieces, with_ids=False))

    def _gathered(self, worker: int, index: int, buffer: ShuffleBuffer, slots: np.ndarray) -> dict | None:
        """The batch of the buffer's ``slots`` (see ``_output``), copied before the buffer refills them."""
        return self._output(worker, index, len(slots), lambda out: buffer.gather(slots, out))


class OrderedTokenStream(TokenStream):
    """Validation / test / predict stream: every token once across ranks, in order, last batch may be short.

    With ``with_ids`` (predict) batches add ``image_ids`` (one per token), ``token_positions``
    (int64), ``labels`` (int64, the image's class label, -1 when unknown) and ``token_index``
    (int64: the token's place in the whole split, the units laid end to end, the same whatever
    the world size or worker count; the feature browser breaks ties by it). With several
    workers the DataLoader interleaves their batches, so batches are
    sequential per worker; ids and positions place every token.
    """

    def __init__(
        self,
        units: Sequence[Unit],
        batch_size: int,
        d: int,
        dtype: np.dtype,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        with_ids: bool = False,
    ) -> None:
        super().__init__(units, batch_size, d, dtype, rank, world_size, num_workers)
        self.with_ids = with_ids
        self.start = self.n_tokens * self.rank // self.world_size
        self.stop = self.n_tokens * (self.rank + 1) // self.world_size
        self.quotas = deal(math.ceil((self.stop - self.start) / self.batch_size), self.n_readers)

    def __len__(self) -> int:
        return sum(self.quotas)

    def __iter__(self) -> Iterator[dict]:
        worker = self._worker()
        start = self.start + sum(self.quotas[:worker]) * self.batch_size
        stop = min(self.stop, start + self.quotas[worker] * self.batch_size)
        pieces = span_pieces([unit.n_tokens for unit in self.units], start, stop) if stop > start else []
        pending: list[tuple[int, Chunk]] = []
        n_pending = index = 0
        for unit, chunk in self._chunks(range(len(self.units)), pieces, self.with_ids):
            pos = 0
            while pos < len(chunk.tokens):
                take = min(self.batch_size - n_pending, len(chunk.tokens) - pos)
                pending.append((unit, Chunk(*(None if f is None else f[pos : pos + take] for f in chunk))))
                n_pending, pos = n_pending + take, pos + take
                if n_pending == self.batch_size:
                    batch = self._batch(worker, index, pending, n_pending, start + index * self.batch_size)
                    if batch is None:
                        return
                    yield batch
                    pending, n_pending, index = [], 0, index + 1
        if pending:
            batch = self._batch(worker, index, pending, n_pending, start + index * self.batch_size)
            if batch is not None:
                yield batch

    def _batch(self, worker: int, index: int, pending: list[tuple[int, Chunk]], n: int, first: int) -> dict | None:
        def write(out: np.ndarray) -> None:
            row = 0
            for _, chunk in pending:
                out[row : row + len(chunk.tokens)] = chunk.tokens
                row += len(chunk.tokens)

        batch = self._output(worker, index, n, write)
        if batch is None:
            return None
        batch["shards"] = self._shard_names(np.array([unit for unit, _ in pending]))
        if self.with_ids:
            batch["image_ids"] = [key for _, chunk in pending for key in chunk.image_ids]
            batch["token_positions"] = torch.from_numpy(np.concatenate([c.token_positions for _, c in pending]))
            batch["token_index"] = torch.arange(first, first + n, dtype=torch.int64)
            batch["labels"] = torch.from_numpy(np.concatenate([c.labels for _, c in pending]))
        return batch
