"""Where shards live: a local directory or an object store (`s3://bucket/prefix`, any fsspec URL).

- `urls.py`: which strings are URLs, the form of one that may be shown (no credentials), `StoreError`
  (refused: exit 2) and `StoreUnavailable` (no answer for the retry window: exit 1).
- `client.py`: one fsspec filesystem per process, every call retried with backoff, refusals as one line.
- `remote.py`: `RemotePath`, an object named like a `pathlib.Path`, so the shard format's code reads
  a bucket as it reads a folder.
- `fetch.py`: whole objects by parallel ranged GETs, and the training stream's bounded read-ahead.

`location(text)` is the one place a command's path-or-URL argument becomes one or the other.
"""

from __future__ import annotations

from pathlib import Path

from feature_extraction.store import client, remote
from feature_extraction.store.remote import RemotePath
from feature_extraction.store.urls import TESTED_SCHEMES, StoreError, StoreUnavailable, display, is_url

__all__ = [
    "TESTED_SCHEMES",
    "Location",
    "RemotePath",
    "StoreError",
    "StoreUnavailable",
    "display",
    "is_url",
    "location",
    "reset",
]

Location = Path | RemotePath


def location(where: str | Path | RemotePath, flag: str = "--data.source") -> Path | RemotePath:
    """`where` as a `RemotePath` when it is a URL (checked: no credentials in it), else as a `Path`."""
    if isinstance(where, (Path, RemotePath)):
        return where
    if is_url(where):
        return RemotePath(where, flag)
    return Path(where)


def reset() -> None:
    """Forget this process's filesystems, listings and logged retries: the next call reads the environment
    again (a test that points AWS_ENDPOINT_URL elsewhere)."""
    with client._lock:
        client._filesystems.clear()
        client._logged.clear()
    with remote._listing_lock:
        remote._listings.clear()
