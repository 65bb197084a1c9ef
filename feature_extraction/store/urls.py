"""Which strings name an object store, and the form of a URL that may be shown.

A shard directory is named by a path or by a URL (`s3://bucket/prefix`, or any scheme an
installed fsspec filesystem serves). Credentials never travel in the URL: the AWS SDK reads them
from the environment and the standard config files, so a URL carrying `user:secret@` or a query
string (a presigned signature) is refused before anything is logged or written, and what is shown
of a URL (`display`) never holds more than scheme, bucket and key.
"""

from __future__ import annotations

import re

__all__ = ["TESTED_SCHEMES", "StoreError", "StoreUnavailable", "check_url", "display", "is_url", "join", "split"]

TESTED_SCHEMES = ("s3", "file", "memory")  # what the suite runs; any other fsspec scheme is untested
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+)://")


class StoreError(ValueError):
    """An object store said no, or the URL cannot be used: one line, naming the object and the fix, no secret.

    A ValueError, so every command's error wrapper prints it as `error: ...` and exits 2.
    """


class StoreUnavailable(RuntimeError):
    """The store did not answer for the whole retry window: one line naming the object, exit 1.

    A runtime failure, not bad input: the same command succeeds once the store is back.
    """


def is_url(location: object) -> bool:
    """True for `scheme://...` strings (two letters at least: `C:/` is a Windows drive, not a scheme)."""
    return isinstance(location, str) and _SCHEME.match(location) is not None


def split(url: str) -> tuple[str, str]:
    """`(scheme, path)` of a URL, the path without leading or trailing slashes (`bucket/prefix`)."""
    match = _SCHEME.match(url)
    if match is None:
        raise StoreError(f"{url!r} is not a URL (scheme://bucket/prefix)")
    return match.group(1).lower(), url[match.end() :].strip("/")


def display(url: str) -> str:
    """The URL as it may appear in a log, an error or an artifact: userinfo and query removed."""
    match = _SCHEME.match(url)
    if match is None:
        return url
    rest = url[match.end() :].split("?", 1)[0].split("#", 1)[0]
    host, sep, tail = rest.partition("/")
    return f"{match.group(1)}://{host.rsplit('@', 1)[-1]}{sep}{tail}"


def check_url(url: str, flag: str) -> str:
    """`url` normalised (`scheme://bucket/prefix`, no trailing slash) after refusing secrets in it."""
    scheme, path = split(url)
    host = path.split("/", 1)[0]
    if "@" in host or "?" in url:
        raise StoreError(
            f"{flag} {display(url)}: credentials or signatures do not go in the URL; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or a profile in ~/.aws/credentials) and pass the plain URL"
        )
    if not path:
        raise StoreError(f"{flag} {url}: names no bucket; pass {scheme}://BUCKET/PREFIX")
    return f"{scheme}://{path}"


def join(url: str, name: str) -> str:
    """`url/name` with one slash between them."""
    return url.rstrip("/") + "/" + name.lstrip("/")
