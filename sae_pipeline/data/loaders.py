"""Training and evaluation DataLoaders over the token streams (``streams.py``).

Why a DataLoader subclass: the streams yield whole batches (no collation); batches from
worker processes come through a ``BatchRing`` of reused shared-memory slots; a worker's
one-line error (``ShardFormatError``, ``CacheFormatError``, ``StoreUnavailable``, ``Stopped``) reaches
the user as that one line, not wrapped in the DataLoader's traceback; and the training loader is stateful
(Lightning stores its ``state_dict`` in the checkpoint), which is how a run resumes
mid-epoch without losing or repeating tokens (see ``datamodule.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from feature_extraction.allocation import allocating
from feature_extraction.stop_flag import Stopped
from feature_extraction.store import StoreUnavailable
from sae_pipeline.data.batch_ring import BatchRing
from sae_pipeline.data.streams import ShuffledTokenStream, TokenStream


def _one_line(exn: Exception) -> Exception:
    """Recover the original one-line message of an error raised in a DataLoader worker.

    The DataLoader re-raises a worker's exception as ``type(exn)("Caught ... Original
    Traceback ...")``; the original ``Type: message`` is the traceback's last line.
    """
    text = str(exn)
    if not text.startswith("Caught "):
        return exn
    for line in reversed(text.splitlines()):
        head, sep, message = line.partition(": ")
        if sep and head.rsplit(".", 1)[-1] == type(exn).__name__:
            return type(exn)(message)
    return exn


class TokenLoader(DataLoader):
    """A DataLoader over a ``TokenStream`` (which yields whole batches): no collation, batches from workers
    through a ``BatchRing``, clean worker errors."""

    def __init__(self, dataset: TokenStream, num_workers: int = 0, pin_memory: bool = False, **kwargs: Any) -> None:
        # Lightning may re-instantiate the loader with batch_size / sampler kwargs; the stream owns batching,
        # and fresh (non-persistent) workers are what carry each epoch's order into the worker processes.
        kwargs.update(batch_size=None, persistent_workers=False)
        # With workers, x is built here from the ring (pinned if asked); the DataLoader pins nothing itself.
        self.pin_x = pin_memory and num_workers > 0
        super().__init__(dataset, num_workers=num_workers, pin_memory=pin_memory and num_workers == 0, **kwargs)

    def __iter__(self) -> Iterator[dict]:
        ring = self.dataset.open_ring(self.prefetch_factor + 2) if self.num_workers > 0 else None
        return self._clean_errors(super().__iter__(), ring)

    def _clean_errors(self, batches: Iterator[dict], ring: BatchRing | None) -> Iterator[dict]:
        try:
            with self._allocating():
                for batch in batches:
                    if "ring" in batch:
                        batch["x"] = ring.take(*batch.pop("ring"), pin_memory=self.pin_x)
                    self._on_batch()
                    yield batch
        except (ValueError, StoreUnavailable, Stopped) as exn:  # one-line errors from a worker: ShardFormatError,
            clean = _one_line(exn)  # CacheFormatError, a store that did not answer, a backoff cut short by a stop
            if clean is exn:
                raise
            raise clean from None
        finally:
            # Stop the workers now, not whenever the garbage collector reaches the iterator (after a worker
            # error that took seconds per worker).
            if ring is not None:
                ring.close()
            shutdown = getattr(batches, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

    def _allocating(self) -> Any:
        """A batch that cannot be allocated (pinned for a GPU, or not) is one line (`feature_extraction.allocation`)."""
        data = self.dataset
        n_bytes = data.batch_size * data.d * data.dtype.itemsize
        cache = getattr(data, "cache", None)
        if cache is not None and cache.is_cuda:  # gathered from --data.cache gpu on the device
            where, fix = f"{cache.device}'s memory", "lower --data.batch_size, or use --data.cache ram"
        elif self.pin_x or self.pin_memory:
            where = "pinned host memory, for the copy to the GPU"
            fix = "lower --data.batch_size or --data.num_workers, or free host memory (pinned pages stay in RAM)"
        else:
            where, fix = "host memory", "lower --data.batch_size or --data.num_workers, or free host memory"
        return allocating(f"the data loader: a batch in {where}", n_bytes, fix)

    def _on_batch(self) -> None:
        pass


class TrainTokenLoader(TokenLoader):
    """The training loader: sets each epoch's order and resumes mid-epoch from its ``state_dict``.

    ``epoch_fn`` gives the epoch (the trainer's); without it the loader counts its own
    iterations. ``progress_fn`` gives the batches trained so far this epoch (the
    trainer's progress; without it, the batches this loader has yielded).
    """

    def __init__(
        self,
        dataset: ShuffledTokenStream,
        num_workers: int = 0,
        pin_memory: bool = False,
        epoch_fn: Callable[[], int] | None = None,
        progress_fn: Callable[[], int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, num_workers=num_workers, pin_memory=pin_memory, **kwargs)
        self.epoch_fn, self.progress_fn = epoch_fn, progress_fn
        self._n_iterations, self._epoch, self._n_yielded = 0, 0, 0
        self._resume_state: dict | None = None

    def __iter__(self) -> Iterator[dict]:
        # Lazy: the epoch and the batches to skip are read when the first batch is asked for. Lightning
        # may call iter() before it has restored or advanced the epoch (a run resumed from a checkpoint
        # taken at an epoch's last batch creates the iterator while current_epoch is still the old one).
        return self._epoch_batches()

    def _epoch_batches(self) -> Iterator[dict]:
        epoch = self.epoch_fn() if self.epoch_fn is not None else self._n_iterations
        self._n_iterations += 1
        skip = 0
        if self._resume_state is not None and self._resume_state["epoch"] == epoch:
            skip = min(self._resume_state["batches_done"], len(self.dataset))
        self._resume_state = None
        self.dataset.set_epoch(epoch, skip)
        self._epoch, self._n_yielded = epoch, skip
        yield from super().__iter__()

    def _on_batch(self) -> None:
        self._n_yielded += 1

    def state_dict(self) -> dict:
        """Epoch and batches done in it: what a resumed run needs to continue the same stream."""
        done = self.progress_fn() if self.progress_fn is not None else self._n_yielded
        return {
            "epoch": int(self._epoch),
            "batches_done": int(done),
            "world_size": self.dataset.world_size,
            "num_workers": self.dataset.num_workers,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at the next ``iter()`` if it is the same epoch (a later epoch starts from its beginning)."""
        if not isinstance(state, dict) or not {"epoch", "batches_done"} <= state.keys():
            raise ValueError(f"training loader state must have 'epoch' and 'batches_done', got {state!r}")
        self._resume_state = {"epoch": int(state["epoch"]), "batches_done": int(state["batches_done"])}
