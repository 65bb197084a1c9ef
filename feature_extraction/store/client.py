"""The object store's client: one fsspec filesystem per process and scheme, every call retried with backoff.

Why our own retries, with the client's turned off: s3fs retries a few exceptions for about two
seconds and botocore a few more, each on its own schedule, so a store that restarts (tens of
seconds) or throttles a burst ends the run. Here every call goes through `call`: a dropped
connection, a timeout, a 5xx or a throttling reply is retried with exponential backoff (0.5 s
doubling to 10 s) for `SAE_PIPELINE_STORE_RETRY_SECONDS` (default 120 s) in all, and the first
retry of each kind is logged once per process, without the exception's text (it may carry a
signed URL). What cannot get better by waiting is one `StoreError` line at once: a missing object
or bucket, refused credentials, no credentials at all (naming the variables to set). Retries spent
are one `StoreUnavailable` line: a runtime failure (exit 1), not bad input, since the same command
succeeds once the store is back. The waits are `stop_flag` waits, in whichever thread or DataLoader
worker they run: SIGTERM or Ctrl-C ends the backoff at once (`Stopped`) and a stop does not retry;
a request under way gets `STOP_GRACE_S` to answer, then is abandoned (a daemon thread makes it, so
a store that never answers holds nothing up); the store is then noted as not answering, for the
stop line.

Credentials, region and endpoint come from where the AWS SDK looks (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, `~/.aws/config` and `~/.aws/credentials`,
`AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL` or `AWS_ENDPOINT_URL_S3` for an S3-compatible server);
nothing here reads, stores or prints them.

A filesystem is made per process (DataLoader workers fork, and an event loop or connection pool
does not survive a fork), lazily, so a process that never reads a bucket never imports s3fs.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from feature_extraction import stop_flag
from feature_extraction.store.urls import StoreError, StoreUnavailable, display

__all__ = ["RETRY_ENV", "call", "filesystem", "retry_seconds"]

RETRY_ENV = "SAE_PIPELINE_STORE_RETRY_SECONDS"
DEFAULT_RETRY_SECONDS = 120.0
STOP_GRACE_S = 1.5  # after a stop, how long a request under way may still answer (a stop ends within 5 s)
_log = logging.getLogger("feature_extraction.store")
_lock = threading.Lock()
_filesystems: dict[tuple[int, str], Any] = {}
_logged: set[str] = set()
T = TypeVar("T")

_TRANSIENT_ERRNOS = {errno.EREMOTEIO, errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.EPIPE}
_TRANSIENT_PHRASES = (
    "SlowDown",
    "reduce your request rate",
    "Throttl",
    "Service Unavailable",
    "Internal Server Error",
    "internal error",
    "InternalError",
    "Bad Gateway",
    "Gateway Timeout",
)
_NO_CREDENTIALS = {  # botocore's exceptions, by name (botocore is imported only with s3fs)
    "NoCredentialsError": "no AWS credentials found",
    "PartialCredentialsError": "incomplete AWS credentials (a key id without its secret, or the reverse)",
    "ProfileNotFound": "AWS_PROFILE names a profile that is in neither ~/.aws/config nor ~/.aws/credentials",
}
_SET_CREDENTIALS = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE naming a profile in ~/.aws/credentials "
    "(AWS_SHARED_CREDENTIALS_FILE and AWS_CONFIG_FILE move those files), then rerun"
)
_INSTALL = {"s3": "pip install 'sae-pipeline[s3]' (s3fs)", "gs": "pip install gcsfs", "gcs": "pip install gcsfs"}


def retry_seconds() -> float:
    """How long one call keeps retrying a transient failure (`SAE_PIPELINE_STORE_RETRY_SECONDS`)."""
    try:
        return max(0.0, float(os.environ.get(RETRY_ENV, DEFAULT_RETRY_SECONDS)))
    except ValueError:
        raise StoreError(f"{RETRY_ENV}={os.environ[RETRY_ENV]!r} must be a number of seconds") from None


def filesystem(scheme: str) -> Any:  # noqa: ANN401 (an fsspec filesystem)
    """This process's filesystem for `scheme`, its own retries off (module docstring)."""
    key = (os.getpid(), scheme)
    with _lock:
        if key in _filesystems:
            return _filesystems[key]
        import fsspec

        try:
            cls = fsspec.get_filesystem_class(scheme)
        except (ImportError, ValueError):
            hint = _INSTALL.get(scheme, f"install the fsspec filesystem that serves {scheme}://")
            raise StoreError(f"{scheme}:// URLs need a filesystem that is not installed: {hint}") from None
        if scheme in ("s3", "s3a"):
            # botocore's own retries off: `call` retries everything with one schedule
            fs = cls(skip_instance_cache=True, config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 10})
            fs.retries = 1
            fs.loop.set_exception_handler(_quiet_transient)
        else:
            fs = cls(skip_instance_cache=True)
        _filesystems[key] = fs
        return fs


def _quiet_transient(loop: Any, context: dict) -> None:  # noqa: ANN401 (an asyncio loop)
    """The client's event loop, for a task nobody awaited: aiohttp's request body writer fails too when the store
    drops the connection, and asyncio would print that failure's traceback ("Task exception was never retrieved")
    for every retry of an upload. `call` retries it and logs it once; anything else is printed as before."""
    exn = context.get("exception")
    if exn is None or not _is_transient(exn):
        loop.default_exception_handler(context)


def _is_transient(exn: BaseException) -> bool:
    """Worth waiting for: connection and timeout errors, 5xx and throttling replies; not a refusal."""
    if isinstance(exn, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, StoreError)):
        return False
    if isinstance(exn, (ConnectionError, TimeoutError)):
        return True
    name = type(exn).__name__
    text = str(exn)
    if any(word in name for word in ("Connection", "Timeout", "Endpoint", "Payload", "IncompleteRead", "Parser")):
        return True
    if isinstance(exn, OSError) and exn.errno in _TRANSIENT_ERRNOS:  # s3fs's translation of a 5xx reply
        return True
    return any(phrase in text for phrase in _TRANSIENT_PHRASES)


def _refusal(exn: BaseException, url: str, action: str) -> StoreError:
    """One line for an error that waiting will not fix; never the exception's text (it may carry secrets)."""
    shown = display(url)
    if isinstance(exn, FileNotFoundError):
        if any(
            phrase in str(exn)
            for phrase in ("NoSuchBucket", "specified bucket does not exist", "bucket does not exist")
        ):
            return StoreError(f"{shown}: the bucket does not exist; check the URL's bucket name (and AWS_ENDPOINT_URL)")
        return StoreError(f"{shown}: not found in the store ({action}); check the URL, or re-run what writes it")
    if type(exn).__name__ in _NO_CREDENTIALS:  # botocore found none where it looks: waiting will not make some
        return StoreError(f"{shown}: {_NO_CREDENTIALS[type(exn).__name__]} ({action}); {_SET_CREDENTIALS}")
    if isinstance(exn, PermissionError):
        return StoreError(
            f"{shown}: the store refused the credentials ({action}); check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE) and the bucket's permissions"
        )
    return StoreError(f"{shown}: {action} failed ({type(exn).__name__}); check the URL and the store")


def _attempt(fn: Callable[[], T], url: str) -> T:
    """`fn()` in a daemon thread, waited for as a `stop_flag.result` (module docstring)."""
    future: Future[T] = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exn:  # noqa: BLE001 (raised in the caller's thread)
                future.set_exception(exn)

    threading.Thread(target=run, name="store-call", daemon=True).start()
    try:
        return stop_flag.result(future, STOP_GRACE_S, display(url))
    except stop_flag.Stopped:  # abandoned: the store did not answer within the grace
        stop_flag.note_unanswered(display(url))
        raise


def call(url: str, action: str, fn: Callable[[], T]) -> T:
    """`fn()`, retried on transient failures (module docstring); other failures become one `StoreError`."""
    deadline = time.monotonic() + retry_seconds()
    wait = 0.5
    while True:
        try:
            return _attempt(fn, url)
        except Exception as exn:  # noqa: BLE001 (classified below: every failure ends as a retry or one line)
            if isinstance(exn, (StoreError, StoreUnavailable, stop_flag.Stopped)):
                raise
            if not _is_transient(exn):
                raise _refusal(exn, url, action) from None
            if time.monotonic() + wait > deadline:
                raise StoreUnavailable(
                    f"{display(url)}: the store did not answer for {retry_seconds():.0f} s ({type(exn).__name__}) "
                    f"{action}; check the endpoint and the network, then rerun (raise {RETRY_ENV} to wait longer)"
                ) from None
            kind = type(exn).__name__
            if kind not in _logged:
                _logged.add(kind)
                _log.warning(
                    "%s: %s from the store (%s); retrying with backoff for up to %.0f s (logged once)",
                    display(url),
                    kind,
                    action,
                    retry_seconds(),
                )
            try:
                stop_flag.sleep(wait, display(url))  # a stop (here, or the signal's own exception) ends the retries
            except BaseException:
                stop_flag.note_unanswered(display(url))
                raise
            wait = min(wait * 2, 10.0)
