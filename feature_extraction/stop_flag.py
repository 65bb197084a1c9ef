"""The stop flag: SIGTERM or Ctrl-C asked this command to stop, and the one way to wait that sees it.

Why: a signal handler runs in the main thread only, between two of its bytecodes. A wait anywhere
else did not see the stop: an upload thread or a DataLoader worker retrying a store that has died,
the main thread of `fit` (whose handler only records the signal and carries on to the next step
boundary) waiting for that worker's batch. Each waited out its retry window (two minutes by
default) before the command could end, and SLURM's pre-emption killed the job meanwhile.

- `request(signum)`: called by the signal handlers (`exit_status`, and
  `sae_pipeline.training.interrupts` for the Lightning commands), never by anything else.
- The waits: `wait(seconds)` returns True early once a stop is requested; `sleep`, `check`, `join`,
  `wait_for` and `result` raise `Stopped` instead. A store's retry backoff and each of its requests,
  a queue or lock wait, an upload drain and the `--data.cache` fill go through them. `result` gives
  work under way a `grace` to finish first: a request to a healthy store answers within it (the
  batch `fit` needs to reach its step boundary and save), one to a store that has died is abandoned.
- Shared with the processes the command forks after `reset()` (DataLoader workers): the flag is a
  shared anonymous page, so a worker in its backoff wakes when the main process is told to stop.
- `Stopped` is a RuntimeError, so it travels as an ordinary error through a thread's future or a
  DataLoader worker's hand-over, and no `except (OSError, ValueError)` on the way takes it for a bad
  file. Each command turns it into its stop line and exit 130 / 143.
- `unanswered()`: the store that was not answering when the stop cut its retries (a URL without
  secrets), for the stop line: what was to be saved there was not.
"""

from __future__ import annotations

import mmap
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import TypeVar

__all__ = [
    "POLL_S",
    "Stopped",
    "check",
    "join",
    "note_unanswered",
    "request",
    "requested",
    "reset",
    "result",
    "sleep",
    "unanswered",
    "wait",
    "wait_for",
]

POLL_S = 0.05  # how often a wait looks at the flag: a stop ends it within this
T = TypeVar("T")
_page = mmap.mmap(-1, 1)  # byte 0: the signal of the first stop, 0 for none (MAP_SHARED: forked children see it)
_unanswered: list[str] = []


class Stopped(RuntimeError):
    """A wait cut short by a stop (SIGTERM or Ctrl-C); ``signum`` is the stop's signal.

    Built from a message too (a DataLoader worker's error is rebuilt in the main process from its text).
    """

    def __init__(self, signum: int | str = 0, where: str = "") -> None:
        if isinstance(signum, str):
            message, signum = signum, requested()
        else:
            signum = int(signum) or requested() or signal.SIGINT
            message = f"stopped by {signal.Signals(signum).name}" + (f" while waiting for {where}" if where else "")
        super().__init__(message)
        self.signum = int(signum) or int(signal.SIGINT)


def reset() -> None:
    """A new command: a fresh flag, shared with the processes forked from now on (not with earlier ones)."""
    global _page
    _page = mmap.mmap(-1, 1)
    _unanswered.clear()


def request(signum: int) -> None:
    """Ask every wait of this process, and of the processes forked since `reset`, to stop."""
    if not _page[0]:
        _page[0] = int(signum) & 0xFF


def requested() -> int:
    """The signal of the stop requested, 0 for none."""
    return _page[0]


def note_unanswered(where: str) -> None:
    """Record that the store at ``where`` (shown form, no secrets) was not answering when the stop came."""
    if where not in _unanswered:
        _unanswered.append(where)


def unanswered() -> str | None:
    """What a stop line adds when a store was not answering (``URL: the store was not answering ...``), else None."""
    if not _unanswered:
        return None
    return f"{_unanswered[0]}: the store was not answering when the stop came"


def wait(seconds: float | None) -> bool:
    """Sleep up to ``seconds`` (None: until a stop); True, as soon as a stop is requested, else False."""
    deadline = None if seconds is None else time.monotonic() + seconds
    while not _page[0]:
        left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
        if left <= 0:
            return False
        time.sleep(left)
    return True


def check(where: str = "") -> None:
    """Raise `Stopped` if a stop is requested."""
    if _page[0]:
        raise Stopped(_page[0], where)


def sleep(seconds: float, where: str = "") -> None:
    """`time.sleep`, cut short by a stop (`Stopped`)."""
    if wait(seconds):
        raise Stopped(_page[0], where)


def join(thread: threading.Thread, timeout: float | None = None, where: str = "") -> bool:
    """`thread.join(timeout)`, cut short by a stop (`Stopped`); True once the thread has ended."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while thread.is_alive():
        check(where)
        left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
        if left <= 0:
            return False
        thread.join(left)
    return True


def wait_for(condition: threading.Condition, predicate: Callable[[], bool], where: str = "") -> None:
    """``condition.wait_for(predicate)`` (called holding it), cut short by a stop (`Stopped`)."""
    while not predicate():
        check(where)
        condition.wait(POLL_S)


def result(future: futures.Future[T], grace: float = 0.0, where: str = "") -> T:
    """``future.result()``; once a stop is requested, `Stopped` if it is not done within ``grace`` seconds."""
    cut = None
    while not futures.wait([future], timeout=POLL_S).done:
        if _page[0]:
            cut = cut if cut is not None else time.monotonic() + grace
            if time.monotonic() >= cut:
                raise Stopped(_page[0], where)
    return future.result()
