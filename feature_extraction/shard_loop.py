"""The extraction command's hot loop: batches of images through the backbone into the shard writers.

Apart from `extract.py` (the command: arguments, output checks, `extraction.json`, the task split) because this
is the part whose speed is the command's speed: `benchmarks/extract.py` times `write_shards` against a bare
forward loop, and `features explain` reuses `forward_tokens` for its own forwards without loading the command.
Nothing here decides which images or shards to write; the caller passes them.

- Batches never span two shards (why: `extract.py`'s docstring); each shard's batches go to `ShardWriters`
  (`shards/writers.py`), writer processes that hash and write the tars while the next batches run.
- On CUDA the copy of a batch's tokens to the host is asynchronous: `write_shards` queues the next forward
  before it waits on the previous batch's event, so the GPU never idles on the host.
- A Ctrl-C or SIGTERM sent to the whole group is acted on by the main process only (`loader_worker_init` in
  the loader workers): it aborts the open shards and stops the workers, so the command prints one stop line.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from feature_extraction.allocation import allocating
from feature_extraction.backbones import Backbone
from feature_extraction.images import CONTENT_HASH_KEY, ImageRecord, collate_images
from feature_extraction.shards import image_key
from feature_extraction.shards.writers import ShardWriters

__all__ = ["forward_tokens", "write_shards"]


def forward_tokens(
    backbone: Backbone, pixels: Tensor, device: torch.device, positions: Tensor | None = None
) -> tuple[Tensor, Any]:
    """Start the forward of one batch; returns float16 tokens `[B, n_tokens, d]` on the host and a CUDA event.

    `positions [B, n]` (int, per image) keeps only those tokens, gathered on the device.

    On CUDA the copy to pinned host memory is asynchronous: the caller waits on the event
    (`event.synchronize()`) only after queueing the next batch, so the GPU never idles on
    the host. The event is None on the CPU.
    """
    on_cuda = device.type == "cuda"
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_cuda):
        tokens = backbone(pixels.to(device, non_blocking=True)).to(torch.float16)
        if positions is not None:
            index = positions.to(device, torch.int64, non_blocking=True)
            tokens = tokens.gather(1, index[:, :, None].expand(-1, -1, tokens.shape[2]))
    if not on_cuda:
        return tokens, None
    fix = "lower --batch_size, or free host memory (pinned pages stay in RAM)"
    with allocating("the extraction: a batch's tokens in pinned host memory", tokens.numel() * 2, fix):
        host = torch.empty(tokens.shape, dtype=torch.float16, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def _record_meta(record: ImageRecord, digest: str | None = None) -> dict:
    """`meta.json` of a sample: the original id, its label, where the image came from and its content hash."""
    meta: dict[str, Any] = {"image_id": record.image_id, "label": record.label}
    if record.class_name is not None:
        meta["class_name"] = record.class_name
    if record.kind == "samples":
        meta["source"] = f"skimage.data.{record.member}"
    else:
        meta["source"] = os.path.abspath(record.source)
        if record.kind == "tar":
            meta["member"] = record.member
    if digest is not None:
        meta[CONTENT_HASH_KEY] = digest
    return meta


def loader_worker_init(_worker_id: int) -> None:
    """A Ctrl-C or a SIGTERM sent to the whole group (scancel) reaches the loader workers too; only the main
    process acts on it (it stops the workers and aborts the open shards), so a worker never adds a second line to
    the one stop line: neither by dying of the signal nor by `quiet_dropped_handoff`'s traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.excepthook = quiet_dropped_handoff


def quiet_dropped_handoff(kind: type[BaseException], error: BaseException, trace: Any) -> None:
    """A worker hands each batch's shared memory to the main process through multiprocessing's resource sharer, a
    thread that prints any error it meets. A stop that lands while the main process is taking a batch drops that
    connection half-way, and the worker's sharer printed the reset as a traceback under the stop line (CI, Ctrl-C
    during extraction). The main process says why it stopped; every other error prints as usual."""
    sharer = os.path.join("multiprocessing", "resource_sharer.py")
    if issubclass(kind, (ConnectionError, EOFError)) and any(
        frame.filename.endswith(sharer) for frame in traceback.extract_tb(trace)
    ):
        return
    sys.__excepthook__(kind, error, trace)


def write_shards(
    backbone: Backbone,
    dataset: torch.utils.data.Dataset,
    records: Sequence[ImageRecord],
    shards: Sequence[tuple[int, Sequence[int]]],
    out_dpath: Path,
    *,
    batch_size: int,
    num_workers: int,
    device: torch.device,
    num_writers: int = 4,
    progress: bool = True,
    positions_of: Callable[[list[str]], np.ndarray] | None = None,
    on_shard_written: Callable[[int], None] | None = None,
) -> dict:
    """Run the backbone over each shard's records and write the shards; the command's hot loop.

    `shards` lists `(shard index, record indices in key order)`; `dataset[i]` returns
    `(i, pixels, content hash)` for record `i`, or `(i, None, why)` when it cannot be read. `positions_of(image_ids)`,
    when given, says which tokens of each image to store (`[B, n]`). `on_shard_written(index)` is called here
    as each shard is complete (`ShardWriters`); it may block (a bounded upload queue) and may raise, which aborts
    the open shards as any error does. Returns counts and the elapsed time.
    """
    if not shards:
        return {"images": 0, "skipped": 0, "seconds": 0.0}
    batches, batch_shard = [], []
    for position, (_, items) in enumerate(shards):
        for start in range(0, len(items), batch_size):
            batches.append(list(items[start : start + batch_size]))
            batch_shard.append(position)
    last_batch_of = {position: b for b, position in enumerate(batch_shard)}
    n_images = sum(len(items) for _, items in shards)
    max_shard = max((len(items) for _, items in shards), default=1)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batches,
        collate_fn=collate_images,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        worker_init_fn=loader_worker_init,
    )
    start_time = time.perf_counter()
    # Fork the writers first, while this process runs no other thread (tqdm's monitor, pin_memory).
    writer = ShardWriters(
        out_dpath, num_writers, max_batches=max(2, math.ceil(max_shard / batch_size)), on_written=on_shard_written
    )
    batch_iter = iter(loader)
    interactive = sys.stderr.isatty()
    bar = tqdm(
        total=n_images,
        unit="img",
        disable=not progress or n_images == 0,
        dynamic_ncols=interactive,
        mininterval=0.5 if interactive else 30.0,
        desc="extract",
    )
    counts = {"images": 0, "skipped": 0}
    skipped: list[dict] = []

    def flush(
        batch_no: int,
        ok: list[int],
        tokens: Tensor | None,
        event: Any,
        failed: list[int],
        positions: np.ndarray | None,
        hashes: list[str],
        reasons: list[str],
    ) -> None:
        nonlocal skipped
        position = batch_shard[batch_no]
        index = shards[position][0]
        if batch_no == 0 or batch_shard[batch_no - 1] != position:
            writer.send(position, "begin", index)
        if tokens is not None:
            if event is not None:
                event.synchronize()
            writer.send_samples(
                position,
                tokens,
                [image_key(records[i].image_id) for i in ok],
                [_record_meta(records[i], digest) for i, digest in zip(ok, hashes)],
                positions,
            )
        skipped += [
            {
                "image_id": records[i].image_id,
                "source": _record_meta(records[i])["source"],
                "shard": index,
                "reason": why,
            }
            for i, why in zip(failed, reasons)
        ]
        if last_batch_of[position] == batch_no:
            writer.send(position, "end", skipped)
            skipped = []
        counts["images"] += len(ok)
        counts["skipped"] += len(failed)
        bar.update(len(ok) + len(failed))

    try:
        pending = None
        for batch_no, (ok, pixels, failed, hashes, reasons) in enumerate(batch_iter):
            positions = None
            if positions_of is not None and pixels is not None:
                positions = positions_of([records[i].image_id for i in ok])
            tokens, event = (
                forward_tokens(backbone, pixels, device, None if positions is None else torch.from_numpy(positions))
                if pixels is not None
                else (None, None)
            )
            if pending is not None:
                flush(*pending)
            pending = (batch_no, ok, tokens, event, failed, positions, hashes, reasons)
        if pending is not None:
            flush(*pending)
        writer.close()
    except BaseException:
        writer.abort()
        shutdown = getattr(batch_iter, "_shutdown_workers", None)  # workers only with num_workers > 0
        if shutdown is not None:
            shutdown()  # now, not whenever the traceback lets go of the iterator
        raise
    finally:
        bar.close()
    return {**counts, "seconds": time.perf_counter() - start_time}
