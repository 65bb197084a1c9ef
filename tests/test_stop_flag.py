"""The one waiting primitive (`feature_extraction.stop_flag`, issue 43 item 1): every wait ends on a stop.

Fast, in-process: each wait is long (a minute) and must end within a second of the stop, from another
thread, in a forked process (a DataLoader worker's view), in the store's backoff and in the
`--data.cache` fill. The commands that use them are signalled for real in tests/test_store_stops.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from feature_extraction import stop_flag
from feature_extraction.store import client

LONG_S = 60.0


@pytest.fixture(autouse=True)
def fresh_flag():  # noqa: ANN201
    stop_flag.reset()
    yield
    stop_flag.reset()


def stop_after(seconds: float, signum: int = signal.SIGTERM) -> threading.Timer:
    timer = threading.Timer(seconds, stop_flag.request, args=(signum,))
    timer.start()
    return timer


def timed(fn) -> tuple[object, float]:  # noqa: ANN001
    start = time.monotonic()
    try:
        outcome = fn()
    except stop_flag.Stopped as stopped:
        outcome = stopped
    return outcome, time.monotonic() - start


def test_a_minute_long_wait_ends_within_a_second_of_the_stop() -> None:
    stop_after(0.2)
    woke, seconds = timed(lambda: stop_flag.wait(LONG_S))
    assert woke is True and seconds < 1.0
    assert stop_flag.requested() == signal.SIGTERM
    assert stop_flag.wait(LONG_S) is True  # the flag stays set: every later wait ends at once
    stop_flag.reset()
    assert stop_flag.wait(0.01) is False and stop_flag.requested() == 0  # a new command: a fresh flag


@pytest.mark.parametrize("kind", ["sleep", "join", "wait_for", "result"])
def test_each_wait_raises_stopped_with_the_signal(kind: str) -> None:
    never = threading.Event()
    busy = threading.Thread(target=never.wait, daemon=True)
    busy.start()
    condition = threading.Condition()

    def queue_wait() -> None:
        with condition:
            stop_flag.wait_for(condition, lambda: False)  # a queue that never gets room

    waits = {
        "sleep": lambda: stop_flag.sleep(LONG_S, "s3://bucket/x"),
        "join": lambda: stop_flag.join(busy),
        "wait_for": queue_wait,
        "result": lambda: stop_flag.result(Future()),
    }
    stop_after(0.2, signal.SIGINT)
    try:
        stopped, seconds = timed(waits[kind])
    finally:
        never.set()
    assert isinstance(stopped, stop_flag.Stopped) and stopped.signum == signal.SIGINT and seconds < 1.0
    if kind == "sleep":
        assert str(stopped) == "stopped by SIGINT while waiting for s3://bucket/x"


def test_work_under_way_gets_its_grace_then_is_abandoned() -> None:
    done = Future()
    threading.Timer(0.4, done.set_result, args=("answered",)).start()
    stop_flag.request(signal.SIGTERM)
    assert stop_flag.result(done, grace=3.0) == "answered"  # a healthy request answers within the grace
    stopped, seconds = timed(lambda: stop_flag.result(Future(), grace=0.5))
    assert isinstance(stopped, stop_flag.Stopped) and 0.4 < seconds < 1.5  # a dead one is abandoned after it


def test_a_forked_process_wakes_when_its_parent_is_stopped() -> None:
    """A DataLoader worker retrying the store learns of the main process's stop through the shared page."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a minute-long wait, woken by the parent's stop
        try:
            start = time.monotonic()
            woke = stop_flag.wait(LONG_S)
            os.write(write, f"{woke} {time.monotonic() - start:.3f} {stop_flag.requested()}".encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        time.sleep(0.2)
        stop_flag.request(signal.SIGTERM)
        with os.fdopen(read) as f:
            woke, seconds, signum = f.read().split()
    finally:
        os.waitpid(pid, 0)
    assert woke == "True" and float(seconds) < 1.0 and int(signum) == signal.SIGTERM


def test_the_store_backoff_ends_on_a_stop_and_names_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that has died: the retries (two minutes here) end at the stop, and the stop line can say so."""
    monkeypatch.setenv(client.RETRY_ENV, "120")
    monkeypatch.setattr(client, "_logged", {"ConnectionResetError"})  # no log line
    calls = []

    def refused() -> None:
        calls.append(time.monotonic())
        raise ConnectionResetError("peer reset")

    stop_after(1.0)
    stopped, seconds = timed(lambda: client.call("s3://bucket/shards/x.tar", "reading the object", refused))
    assert isinstance(stopped, stop_flag.Stopped) and seconds < 2.0 and 2 <= len(calls) <= 3  # 0.5 s, 1 s backoff
    assert stop_flag.unanswered() == "s3://bucket/shards/x.tar: the store was not answering when the stop came"
    again = []
    with pytest.raises(stop_flag.Stopped):  # after a stop a failure is not retried
        client.call("s3://bucket/y", "reading the object", lambda: again.append(1) or refused())
    assert again == [1]
    assert client.call("s3://bucket/z", "reading the object", lambda: "answered") == "answered"  # a healthy store


def test_the_cache_fill_ends_at_the_next_chunk() -> None:
    """Ctrl-C during `--data.cache ram`: the fill stops reading, rather than reading the whole split first."""
    from sae_pipeline.data.cache import fill

    read = []

    class Unit:
        n_tokens = 40

        def read(self, start: int, stop: int):  # noqa: ANN202
            for i in range(4):  # four chunks of ten tokens; the stop comes with the first
                read.append(i)
                if i == 0:
                    stop_flag.request(signal.SIGINT)
                yield type("Chunk", (), {"tokens": np.zeros((10, 4), np.float16)})

    with pytest.raises(stop_flag.Stopped):
        fill([Unit(), Unit()], 4, np.dtype(np.float16), torch.device("cpu"))
    assert read == [0]
