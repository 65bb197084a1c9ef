"""``--data.cache ram|gpu``: the training split read once into memory, every epoch gathered from there.

Design choices:
- The same batches as the uncached stream, by construction rather than by a second
  implementation: ``CachedTokenStream`` is a ``ShuffledTokenStream`` (same unit order, spans,
  quotas, seeds, skip and resume bookkeeping) whose shuffle buffer holds *token indices* instead
  of tokens. Each unit's tokens sit at a fixed offset of the cache (the units laid end to end in
  their source order), so the reader's span becomes ranges of indices, the buffer shuffles them
  exactly as it shuffles tokens (its draws depend only on token counts), and a batch is one
  ``index_select`` of the drawn indices. The cache holds the bytes the reader returned (the
  source's dtype, float16 for shards, checksums verified while filling), so the batches are equal
  bit for bit (``tests/test_data_cache.py``).
- Filling: before the first epoch the whole training split is read once, unit after unit in source
  order, in the main process (a progress bar on stderr on rank 0 when it takes more than a second).
  Every rank caches the *whole* split, not its share: a rank's span moves every epoch with the
  seeded unit order, so any token may be its next epoch's. SIGTERM or Ctrl-C ends the fill at the
  next chunk (``stop_flag``): ``fit`` stops with its usual line instead of reading the split first.
- ``ram``: one host tensor. With DataLoader workers it lives in shared memory (``/dev/shm``), which
  the workers map rather than copy; without workers in private memory on 2 MB pages where the
  kernel allows (``host_tensor``). The workers gather their batches straight into their
  ``BatchRing`` slots, as the uncached workers do.
- ``gpu``: one tensor on the trainer's CUDA device; batches are gathered there (no host copy, no
  PCIe traffic per step but the batch's indices, copied from pinned memory without a host wait, so
  the training loop stays free of synchronisations), so the DataLoader runs in the main process
  without workers and without pinning. The main process plays the roles of the
  ``--data.num_workers`` readers in turn, one batch each, as a DataLoader polls its workers: the
  batches are still those of the uncached stream with that many workers, and a checkpoint resumes
  under either setting.
- The fit check (``check_fits``), before anything is read: ``ram`` needs the split's bytes times the
  ranks on this node (``LOCAL_WORLD_SIZE``, else the trainer's devices per node, else 1) to be at
  most half of ``MemAvailable`` (``/proc/meminfo``; ``os.sysconf`` elsewhere), the split's bytes at
  most half of the address space ``ulimit -v`` (RLIMIT_AS) leaves this process (a limit per process:
  ``feature_extraction.allocation.address_space_left``), and, with workers, to fit in ``/dev/shm``'s
  free space (Docker's default is 64 MB: ``--shm-size``); ``gpu`` needs CUDA and the split's bytes at
  most half of the device's free memory. Otherwise one line names the bytes needed and available and
  the fix. The halves leave room for the model, the optimiser and the rest of the run. An allocation
  that fails all the same (another process took the memory meanwhile) is one line too
  (``feature_extraction.allocation``).
- Validation, test and predict read the shards as before: they run once per validation, not every
  step, and their split is held out of the cache.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

from feature_extraction import stop_flag
from feature_extraction.allocation import address_space_left, allocating, size_text
from sae_pipeline.data.host_memory import host_tensor
from sae_pipeline.data.shuffle_buffer import ShuffleBuffer
from sae_pipeline.data.sources import Unit
from sae_pipeline.data.streams import ShuffledTokenStream

CACHE_KINDS = ("none", "ram", "gpu")
SHM_DPATH = "/dev/shm"
STAGE_BYTES = 64 * 2**20  # the gpu fill copies to the device in blocks of about this size


def cache_kind(cache: str | None) -> str | None:
    """``--data.cache`` as ``None``, ``"ram"`` or ``"gpu"``; anything else is a one-line ValueError."""
    if cache is None or cache == "none":
        return None
    if cache in CACHE_KINDS:
        return cache
    raise ValueError(f"--data.cache={cache!r}: accepted values are {', '.join(CACHE_KINDS)}")


def mem_available() -> int:
    """Bytes the kernel can give new allocations without swapping (``MemAvailable``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def shm_free() -> int | None:
    """Free bytes of ``/dev/shm`` (where shared tensors live), None where it does not exist."""
    try:
        stat = os.statvfs(SHM_DPATH)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def check_fits(kind: str, n_bytes: int, device: torch.device, local_ranks: int = 1, shared: bool = False) -> None:
    """Raise a one-line ValueError unless a ``kind`` cache of ``n_bytes`` fits (module docstring: the rule)."""
    fix = "use --data.cache none (read the shards every epoch)"
    if device.type == "cpu":
        needed = n_bytes * local_ranks
        ranks = f" x {local_ranks} ranks on this node = {size_text(needed)}" if local_ranks > 1 else ""
        available = mem_available()
        if needed > available // 2:
            raise ValueError(
                f"--data.cache {kind}: the training split needs {size_text(n_bytes)}{ranks}, more than half of the "
                f"{size_text(available)} of available memory; {fix} or a machine with more memory"
            )
        left = address_space_left()
        if left is not None and n_bytes > left // 2:
            raise ValueError(
                f"--data.cache {kind}: the training split needs {size_text(n_bytes)}, more than half of the "
                f"{size_text(left)} of address space that ulimit -v (RLIMIT_AS) leaves this process; {fix}, "
                "or raise ulimit -v"
            )
        free = shm_free() if shared else None
        if free is not None and needed > free:
            raise ValueError(
                f"--data.cache {kind}: the training split needs {size_text(n_bytes)}{ranks} of shared memory for "
                f"the loader's workers, more than {SHM_DPATH} has free ({size_text(free)}); {fix}, "
                "--data.num_workers 0, or a larger /dev/shm (docker run --shm-size)"
            )
        return
    free = torch.cuda.mem_get_info(device)[0]
    if n_bytes > free // 2:
        raise ValueError(
            f"--data.cache gpu: the training split needs {size_text(n_bytes)}, more than half of the "
            f"{size_text(free)} free on {device}; use --data.cache ram, --data.cache none, or a GPU with more memory"
        )


def fill(
    units: Sequence[Unit], d: int, dtype: np.dtype, device: torch.device, shared: bool = False, progress: bool = False
) -> torch.Tensor:
    """Every token of ``units``, in order, as one ``[n_tokens, d]`` tensor of ``dtype`` on ``device``.

    ``shared``: in shared memory (host only), for DataLoader workers. For a device, tokens gather
    in a host block of about ``STAGE_BYTES`` first: fewer, larger copies than one per image.
    """
    n_tokens = sum(unit.n_tokens for unit in units)
    row_bytes = d * np.dtype(dtype).itemsize
    torch_dtype = torch.from_numpy(np.empty(0, dtype)).dtype
    on_host = device.type == "cpu"
    where = f"{'shared' if shared else 'host'} memory" if on_host else str(device)
    fix = (
        "use --data.cache none (read the shards every epoch), or free memory"
        + (" (raise ulimit -v)" if address_space_left() is not None else "")
        if on_host
        else "use --data.cache ram, --data.cache none, or free memory on the GPU (another process may hold it)"
    )
    with allocating(
        f"--data.cache {'ram' if on_host else 'gpu'}: the training split in {where}", n_tokens * row_bytes, fix
    ):
        if on_host:
            cache = host_tensor(n_tokens, d, torch_dtype, shared)
        else:
            cache = torch.empty((n_tokens, d), dtype=torch_dtype, device=device)
        stage = None if on_host else np.empty((min(n_tokens, max(1, STAGE_BYTES // row_bytes)), d), dtype)
    host = cache.numpy() if on_host else None
    done = staged = 0  # rows in the cache; rows waiting in the stage (device only)
    bar = tqdm(
        total=n_tokens * row_bytes,
        desc=f"--data.cache: reading the training split into {'RAM' if on_host else device}",
        unit="B",
        unit_scale=True,
        delay=1,
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
        leave=False,
    )
    with bar:
        for unit in units:
            n_read = 0
            for chunk in unit.read(0, unit.n_tokens):
                stop_flag.check("the --data.cache fill")  # a stop ends the fill now, not after an epoch's read
                tokens = chunk.tokens[: unit.n_tokens - n_read]  # a unit never yields more; the cache is guarded
                n_read += len(tokens)
                bar.update(len(tokens) * row_bytes)
                if on_host:
                    host[done : done + len(tokens)] = tokens
                    done += len(tokens)
                    continue
                while len(tokens):
                    take = min(len(tokens), len(stage) - staged)
                    stage[staged : staged + take] = tokens[:take]
                    staged, tokens = staged + take, tokens[take:]
                    if staged == len(stage):
                        cache[done : done + staged].copy_(torch.from_numpy(stage))
                        done, staged = done + staged, 0
            if n_read != unit.n_tokens:
                raise ValueError(
                    f"--data.cache: {unit.name} gave {n_read} of its {unit.n_tokens} tokens; the source changed "
                    "while read"
                )
        if staged:
            cache[done : done + staged].copy_(torch.from_numpy(stage[:staged]))
    return cache


class CachedTokenStream(ShuffledTokenStream):
    """The training stream over a cache of the training split (``fill``): the same batches, gathered from memory.

    ``cache`` (``[n_tokens, d]``, the units in order) is set by the datamodule once the
    stream's own checks have passed. ``in_main``: the loader runs in the main process (a
    device cache): ``__iter__`` plays every reader's role in turn and batches stay on the device.
    """

    def __init__(self, *args: object, in_main: bool = False, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.in_main = in_main
        self.cache: torch.Tensor | None = None
        self.offsets = np.concatenate([[0], np.cumsum([unit.n_tokens for unit in self.units], dtype=np.int64)])

    def __iter__(self) -> Iterator[dict]:
        if not self.in_main:
            yield from super().__iter__()
            return
        # A DataLoader with W workers yields one batch of each live worker in turn, worker 0 first, and
        # after a resume its worker i plays reader (i + skip) % W (ShuffledTokenStream.__iter__).
        readers = [self._reader_batches((i + self.skip_batches) % self.n_readers) for i in range(self.n_readers)]
        while readers:
            live = []
            for reader in readers:
                batch = next(reader, None)
                if batch is not None:
                    yield batch
                    live.append(reader)
            readers = live

    def _token_parts(
        self, order: Sequence[int], pieces: list[tuple[int, int, int]]
    ) -> Iterator[tuple[int, np.ndarray]]:
        for position, lo, hi in pieces:
            unit = int(order[position])
            start = int(self.offsets[unit])
            yield unit, np.arange(start + lo, start + hi, dtype=np.int64)

    def _gathered(self, worker: int, index: int, buffer: ShuffleBuffer, slots: np.ndarray) -> dict | None:
        rows = torch.from_numpy(buffer.tokens[slots])  # a copy: the slots take new indices next
        if self.in_main:
            if self.cache.is_cuda:  # pinned, not waiting: a pageable copy would wait for the steps queued before it
                rows = rows.pin_memory().to(self.cache.device, non_blocking=True)
            return {"x": self.cache.index_select(0, rows)}
        return self._output(
            worker, index, len(slots), lambda out: torch.index_select(self.cache, 0, rows, out=torch.from_numpy(out))
        )
