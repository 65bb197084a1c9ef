"""An object in a store, named like a `pathlib.Path` for the few things the shard code asks of a path.

Why path-like: the shard format's readers (`feature_extraction/shards/`) and the commands above
them name a shard directory and its files by `Path`; a `RemotePath` answers the same questions
(`/`, `name`, `parent`, `with_suffix`, `is_file`, `is_dir`, `stat().st_size`, `read_bytes`,
`read_text`, `open("rb")`, `glob`), so the format stays spelled in one place for both. It has no
`__fspath__`: a local-only call (`os.open`, h5py) fails loudly instead of reading a file named
like the URL.

Costs: one listing per directory per process answers every `is_file`/`stat` of its objects (a
manifest's check of 500 shards is one request, not 1000); writes through a `RemotePath` refresh
it. `open("rb")` and `fetch()` read the whole object into memory with parallel ranged GETs
(`fetch.py`), or take it from the read-ahead when the training stream asked for it in advance.
"""

from __future__ import annotations

import fnmatch
import io
import os
import threading
from collections.abc import Iterator
from types import SimpleNamespace

from feature_extraction.store import client
from feature_extraction.store.urls import check_url, display, join, split

__all__ = ["RemotePath"]

_listings: dict[tuple[int, str], dict[str, int]] = {}  # (pid, directory url) -> {name: size}
_listing_lock = threading.Lock()


class RemotePath:
    """`scheme://bucket/key`, an object or a prefix ("directory") of one."""

    def __init__(self, url: str, flag: str = "--data.source") -> None:
        self.url = check_url(url, flag)
        self.scheme = split(self.url)[0]

    # --- names ---
    def __str__(self) -> str:
        return display(self.url)

    def __repr__(self) -> str:
        return f"RemotePath({display(self.url)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __lt__(self, other: RemotePath) -> bool:
        return self.url < other.url

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(join(self.url, str(name)))

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        dot = self.name.rfind(".")
        return self.name[dot:] if dot > 0 else ""

    @property
    def stem(self) -> str:
        return self.name[: len(self.name) - len(self.suffix)]

    @property
    def parent(self) -> RemotePath:
        head = self.url.rsplit("/", 1)[0]
        return RemotePath(head) if "/" in split(head)[1] or split(head)[1] else self

    def with_suffix(self, suffix: str) -> RemotePath:
        return self.parent / (self.stem + suffix)

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def resolve(self) -> RemotePath:
        return self

    absolute = resolve

    # --- what is there ---
    @property
    def _fs_path(self) -> str:
        return client.filesystem(self.scheme)._strip_protocol(self.url)

    def _listing(self, refresh: bool = False) -> dict[str, int]:
        """`{name: size}` of the objects directly under this prefix (cached per process)."""
        key = (os.getpid(), self.url)
        with _listing_lock:
            if not refresh and key in _listings:
                return _listings[key]
        fs = client.filesystem(self.scheme)

        def listing() -> dict[str, int]:
            try:
                entries = fs.ls(self._fs_path, detail=True, refresh=True)
            except FileNotFoundError:
                bucket = self._fs_path.strip("/").split("/", 1)[0]
                if self.scheme in ("s3", "s3a") and not fs.exists(bucket):
                    raise FileNotFoundError("the bucket does not exist") from None  # an error, not an empty folder
                return {}
            files = (e for e in entries if e["type"] == "file")
            return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in files}

        names = client.call(self.url, "listing the objects", listing)
        with _listing_lock:
            _listings[key] = names
        return names

    def refresh(self) -> None:
        """Forget this prefix's cached listing (after someone else wrote to it)."""
        with _listing_lock:
            _listings.pop((os.getpid(), self.url), None)

    def is_file(self) -> bool:
        return self.name in self.parent._listing()

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def is_dir(self) -> bool:
        return bool(self._listing())

    def stat(self) -> SimpleNamespace:
        sizes = self.parent._listing()
        if self.name not in sizes:
            raise FileNotFoundError(f"{self}: not found in the store")
        return SimpleNamespace(st_size=sizes[self.name])

    def iterdir(self) -> Iterator[RemotePath]:
        for name in sorted(self._listing()):
            yield self / name

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        """Objects directly under this prefix whose name matches `pattern` (no `/` or `**` in it)."""
        for name in sorted(self._listing()):
            if fnmatch.fnmatchcase(name, pattern):
                yield self / name

    # --- reading ---
    def read_bytes(self) -> bytes:
        """The whole object in one GET (manifests, sidecars: small); shards go through `fetch`."""
        fs = client.filesystem(self.scheme)
        return client.call(self.url, "reading the object", lambda: fs.cat_file(self._fs_path))

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def fetch(self) -> bytes:
        """The whole object, by parallel ranged GETs, or from the read-ahead if it was asked for (`fetch.py`)."""
        from feature_extraction.store.fetch import fetch_object

        return fetch_object(self)

    def open(self, mode: str = "rb", encoding: str | None = None, buffering: int = -1) -> io.IOBase:  # noqa: ARG002
        """A seekable in-memory copy of the object (`"rb"`, `"r"`); writing goes through `write_bytes`."""
        if mode not in ("r", "rb"):
            raise ValueError(f"{self}: objects in a store are read whole or written whole (open mode {mode!r})")
        data = io.BytesIO(self.fetch())
        return data if mode == "rb" else io.TextIOWrapper(data, encoding=encoding or "utf-8")

    # --- writing: each object whole, or not at all (a PUT is atomic) ---
    def write_bytes(self, data: bytes, exclusive: bool = False) -> bool:
        """Put `data` as this object; with `exclusive`, only if it does not exist yet (False: it did)."""
        fs = client.filesystem(self.scheme)

        def put() -> bool:
            try:
                fs.pipe_file(self._fs_path, bytes(data), mode="create" if exclusive else "overwrite")
            except (FileExistsError, OSError) as exn:
                if exclusive and (isinstance(exn, FileExistsError) or "pre-condition" in str(exn)):
                    return False
                raise
            return True

        written = client.call(self.url, "writing the object", put)
        self.parent.refresh()
        return written

    def write_text(self, text: str, encoding: str = "utf-8") -> None:
        self.write_bytes(text.encode(encoding))

    def upload(self, local_fpath: str | os.PathLike) -> None:
        """Put a local file as this object (multipart when large; the object appears whole when done)."""
        fs = client.filesystem(self.scheme)
        client.call(self.url, "writing the object", lambda: fs.put_file(os.fspath(local_fpath), self._fs_path))
        self.parent.refresh()

    def download(self, local_fpath: str | os.PathLike) -> None:
        """Get this object into a local file (written whole by the caller's atomic path)."""
        data = self.fetch()
        with open(local_fpath, "wb") as f:
            f.write(data)

    def unlink(self, missing_ok: bool = False) -> None:
        fs = client.filesystem(self.scheme)

        def remove() -> None:
            try:
                fs.rm_file(self._fs_path)
            except FileNotFoundError:
                if not missing_ok:
                    raise

        client.call(self.url, "deleting the object", remove)
        self.parent.refresh()
