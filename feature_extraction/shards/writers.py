"""Writer processes that stream an extraction's batches into shard tars.

Writing a ViT-B sample costs about 1-3 ms (float64 statistics, sha256, tar headers,
0.4 MB of I/O), as much as a fast GPU's forward of it, and threads do not scale on it
(the GIL), so the extraction command hands finished batches to these processes and goes
on with the next forward. Each shard's list of undecodable images is written here too,
before the shard's tar is renamed into place, so a complete shard always has its list. A writer
says when a shard is complete (its sidecar written), so the extraction can upload it at once
(`remote_out.py`, `--out s3://...`).
"""

from __future__ import annotations

import os
import queue
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from feature_extraction.atomic_files import OUT_OF_SPACE_ERRNOS, DiskFullError, write_json_atomic
from feature_extraction.shards.layout import shard_fname, skipped_fname
from feature_extraction.shards.write import write_shard

__all__ = ["ShardWriters"]

DONE = "done"  # a writer's report of a complete shard (tar and sidecar in place)


def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel SIGKILL this writer when the extraction process `parent` dies (e.g. SIGKILL).

    Otherwise an orphan could go on writing a `.tmp` that a rerun is rewriting. A parent that died before the
    request (between the fork and here) sends no signal: the writer then sees it re-parented and exits.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def _writer_process(out_dpath: str, tasks: Any, results: Any, parent: int) -> None:
    """Body of a writer process: write the shards the main process streams to `tasks`.

    Messages: ("begin", index), ("samples", tokens [b, n, d] shared-memory tensor, keys,
    metas, positions [b, n] or None), ("end", skipped), ("abort",), None (stop). Each complete
    shard is reported on `results` as `(index, "done", None, None)`; a failure as
    `(index, kind, errno, reason)`, and the rest of the queue drained, so the producer never
    blocks on a dead consumer.
    """
    _die_with_parent(parent)
    # Ctrl-C, or a SIGTERM sent to the whole group (scancel): the main process aborts the open shards in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    failed = False
    while (item := tasks.get()) is not None:
        if item[0] != "begin" or failed:
            continue  # leftovers of a failed or aborted shard
        index = item[1]
        try:
            write_shard(Path(out_dpath), index, _streamed_samples(Path(out_dpath), tasks, index))
            results.put((index, DONE, None, None))
        except BaseException as exn:  # noqa: BLE001 (reported to the main process)
            kind = "OSError" if isinstance(exn, OSError) else "ValueError" if isinstance(exn, ValueError) else "other"
            results.put((index, kind, getattr(exn, "errno", None), getattr(exn, "strerror", None) or str(exn)))
            failed = True


def _streamed_samples(out_dpath: Path, tasks: Any, index: int) -> Iterator[tuple]:
    while True:
        item = tasks.get()
        if item is None or item[0] == "abort":
            raise RuntimeError(f"shard {index} aborted")
        if item[0] == "samples":
            _, tokens, keys, metas, positions = item
            array = tokens.numpy()
            for j, key in enumerate(keys):
                yield (key, array[j], metas[j]) if positions is None else (key, array[j], metas[j], positions[j])
        elif item[0] == "end":
            # Before write_shard renames the tar: a complete shard always has its list.
            fpath = out_dpath / skipped_fname(index)
            if item[1]:
                write_json_atomic(fpath, item[1])
            else:
                fpath.unlink(missing_ok=True)
            return


class ShardWriters:
    """Writer processes fed through bounded queues; shard number p goes to process p % n.

    Writing a ViT-B sample costs about 1-3 ms (float64 statistics, sha256, tar headers,
    0.4 MB of I/O), as much as a fast GPU's forward of it, and threads do not scale on it
    (the GIL: 1 thread ~800 samples/s, 2 threads ~900, 2 processes ~1400 on the 2-core dev
    box), so shards are written by processes. Tokens travel as shared-memory tensors
    (torch.multiprocessing, as DataLoader batches do); at most `max_batches` batches wait
    per process, so host and /dev/shm memory stay under about n x one shard of tokens.
    """

    def __init__(
        self, out_dpath: Path, n_processes: int, max_batches: int, on_written: Callable[[int], None] | None = None
    ) -> None:
        """`on_written(index)` is called in this process once shard `index` is complete (from `send`/`close`)."""
        import torch.multiprocessing as mp

        # fork: children share the parent's modules and never touch CUDA; spawn where fork is missing.
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self.out_dpath = out_dpath
        self.on_written = on_written
        self.queues = [ctx.Queue(maxsize=max_batches) for _ in range(n_processes)]
        self.results = ctx.Queue()
        self.errors: list[tuple] = []
        self.processes = [
            ctx.Process(
                target=_writer_process,
                args=(str(out_dpath), q, self.results, os.getpid()),
                daemon=True,
                name=f"shard-writer-{n}",
            )
            for n, q in enumerate(self.queues)
        ]
        for process in self.processes:
            process.start()

    def send(self, position: int, *item: Any) -> None:
        self._put(position % len(self.queues), item)

    def _put(self, number: int, item: tuple | None) -> None:
        while True:
            self._check()
            try:
                self.queues[number].put(item, timeout=1.0)
                return
            except queue.Full:
                if not self.processes[number].is_alive():
                    raise RuntimeError(
                        f"shard writer process {number} died with exit code "
                        f"{self.processes[number].exitcode}; rerun to redo its shards"
                    ) from None

    def send_samples(
        self, position: int, tokens: Tensor, keys: list[str], metas: list[dict], positions: np.ndarray | None = None
    ) -> None:
        """Queue a batch; `positions [b, n]` (full-sequence positions) when the tokens are a subset."""
        shared = torch.empty(tokens.shape, dtype=tokens.dtype).share_memory_()
        shared.copy_(tokens)
        self.send(position, "samples", shared, keys, metas, positions)

    def _check(self) -> None:
        while True:
            try:
                result = self.results.get_nowait()
            except queue.Empty:
                break
            if result[1] != DONE:
                self.errors.append(result)
            elif self.on_written is not None:
                self.on_written(result[0])
        if not self.errors:
            return
        index, kind, errno_, reason = min(self.errors, key=lambda e: e[0])
        if kind == "OSError" and errno_ in OUT_OF_SPACE_ERRNOS:
            raise DiskFullError(
                self.out_dpath / shard_fname(index),
                f"the complete shards in {self.out_dpath} (a rerun resumes after them; the partial shard was removed)",
            )
        if kind == "OSError":
            raise OSError(
                errno_,
                f"could not write shard {index} in {self.out_dpath}: {reason}; free space or fix "
                "the output directory and rerun (complete shards are kept)",
            )
        raise (ValueError if kind == "ValueError" else RuntimeError)(f"shard {index}: {reason}")

    def close(self) -> None:
        """Wait for the last shards; re-raise a writer error."""
        for number, process in enumerate(self.processes):
            if process.is_alive():
                self._put(number, None)
        for process in self.processes:
            process.join()
        self._check()
        if dead := [p.name for p in self.processes if p.exitcode != 0]:
            raise RuntimeError(f"shard writer processes {dead} failed; rerun to redo their shards")

    def abort(self) -> None:
        """Have every writer drop its open shard (its ``.tmp``) and stop; kill one that does not.

        Under a SIGTERM to the whole group (scancel) the DataLoader worker dies too, and torch's
        SIGCHLD handler then raises in whatever this is blocked on, which cut the abort short and
        left writers (they ignore SIGTERM) alive with their ``.tmp`` files, hanging interpreter
        exit. A worker's death no longer matters once aborting, so SIGCHLD is left at its default
        meanwhile, and whatever still interrupts, the kill is in a ``finally``.
        """
        try:
            previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        except ValueError:  # not the main thread
            previous = None
        try:
            for q in self.queues:
                for item in (("abort",), None):
                    try:
                        q.put(item, timeout=5.0)
                    except queue.Full:
                        break
            for process in self.processes:
                process.join(timeout=30)
        finally:
            for process in self.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
            if previous is not None:
                signal.signal(signal.SIGCHLD, previous)
