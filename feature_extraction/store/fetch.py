"""Whole objects at the store's rate: parallel ranged GETs, and a bounded read-ahead of the next shards.

Why whole objects: a shard's reader seeks to each member (`shards/read.py`); over a network a
seek is a request, so a shard is fetched once, in `PART_BYTES` ranges requested together (one
GET stream is limited by one connection's window; S3's own guidance is 8-16 MB ranges in
parallel), then read from memory exactly as a local file is read: the same per-sample checksums,
the same bytes, so a run over a bucket trains the weights a run over a local copy does.

Why read-ahead: a DataLoader worker parses and shuffles one shard while the next ones arrive.
The training stream names, in order, the shards a worker will read this epoch (`plan`); the first
`depth` are fetched in background threads and each `take` starts the next. Memory per worker is
bounded by `(depth + 1) x` the largest shard: `depth` in flight or waiting, one being read.
`depth` is `SAE_PIPELINE_READ_AHEAD` (default 2; 0 turns read-ahead off).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from feature_extraction import stop_flag
from feature_extraction.store import client

RemotePath = Any  # remote.py's RemotePath, which imports this module (named here without an import cycle)

__all__ = ["PART_BYTES", "READ_AHEAD_ENV", "fetch_object", "plan", "read_ahead_depth"]

PART_BYTES = 8 << 20
READ_AHEAD_ENV = "SAE_PIPELINE_READ_AHEAD"


def read_ahead_depth() -> int:
    """How many shards a reader fetches ahead of the one it reads (`SAE_PIPELINE_READ_AHEAD`, default 2)."""
    try:
        return max(0, int(os.environ.get(READ_AHEAD_ENV, "2")))
    except ValueError:
        return 2


def ranged_get(path: RemotePath, size: int | None = None) -> bytes:
    """The object's bytes by `PART_BYTES` ranges requested together (one GET when small), retried as a whole."""
    fs = client.filesystem(path.scheme)
    fs_path = path._fs_path
    if size is None:
        size = path.stat().st_size
    if size <= PART_BYTES:
        data = client.call(path.url, "reading the object", lambda: fs.cat_file(fs_path))
    else:
        starts = list(range(0, size, PART_BYTES))
        ends = [min(start + PART_BYTES, size) for start in starts]
        parts = client.call(
            path.url, "reading the object", lambda: fs.cat_ranges([fs_path] * len(starts), starts, ends)
        )
        data = b"".join(parts)
    if len(data) != size:
        raise client.StoreError(
            f"{path}: the store returned {len(data)} of its {size} bytes; the object changed while read, "
            "or the store is faulty: rerun"
        )
    return data


class _ReadAhead:
    """This process's planned fetches: at most `depth` futures, started in plan order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.pending: OrderedDict[RemotePath, Future] = OrderedDict()
        self.queue: deque[RemotePath] = deque()
        self.depth = 0

    def plan(self, paths: Sequence[RemotePath]) -> None:
        with self.lock:
            for future in self.pending.values():
                future.cancel()
            self.pending.clear()
            self.depth = read_ahead_depth()
            self.queue = deque(dict.fromkeys(paths)) if self.depth else deque()
            self._fill()

    def _fill(self) -> None:
        while self.queue and len(self.pending) < self.depth:
            path = self.queue.popleft()
            self.pending[path] = _start(path)

    def take(self, path: RemotePath) -> bytes | None:
        with self.lock:
            future = self.pending.pop(path, None)
            if future is None:
                if path in self.queue:  # asked for out of plan order: fetch it now, keep the rest planned
                    self.queue.remove(path)
                return None
            self._fill()
        return stop_flag.result(future, client.STOP_GRACE_S, str(path))  # its fetch ends on a stop too


def _start(path: RemotePath) -> Future:
    """`ranged_get(path)` in a daemon thread: a process that is stopped (Ctrl-C, SIGTERM, the loader's end)
    exits without waiting for a fetch nobody will read (an executor's threads would be joined at exit)."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(ranged_get(path))
        except BaseException as exn:  # noqa: BLE001 (handed to the reader, who raises it)
            future.set_exception(exn)

    threading.Thread(target=run, name="read-ahead", daemon=True).start()
    return future


_state = _ReadAhead()


def _here() -> _ReadAhead:
    global _state
    if _state.pid != os.getpid():  # a forked DataLoader worker: the parent's threads did not come along
        _state = _ReadAhead()
    return _state


def plan(paths: Sequence[RemotePath]) -> None:
    """The shards this process will read next, in order: start fetching the first `depth` of them."""
    _here().plan(paths)


def fetch_object(path: RemotePath) -> bytes:
    """The whole object: from the read-ahead when planned, else fetched now."""
    data = _here().take(path)
    return data if data is not None else ranged_get(path)
