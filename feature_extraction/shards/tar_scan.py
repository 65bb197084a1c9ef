"""Where each member of a shard's tar lies, without reading the members.

The training stream's reader (``read.py``) reads samples at random and ``finalize`` hashes the
members of shards written before per-sample checksums (``integrity.py``); both need only each
member's name, data offset and size, so the scan is its own module below both. Our writer's plain ustar headers are
parsed here directly (tarfile's parser was a third of the reader's time); anything else is left to tarfile. A cut or
corrupt archive raises ``ShardFormatError`` naming the shard.

A shard is someone else's data, so every member is checked before anyone reads it: a regular
file (no link, device, directory or sparse file), a name of the key scheme
(``layout.member_name_problem``), and a declared size that fits in the file. tarfile reads
extended (pax, GNU long-name) headers whole, at the size they declare, so it reads through
``_HeaderReads``, which refuses any read larger than ``MAX_EXTENDED_HEADER``: memory stays
bounded by what the shard holds, never by what a header declares (docs/formats.md, "What a
reader refuses").
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

from feature_extraction.shards.layout import ShardFormatError, member_name_problem

__all__ = ["MAX_EXTENDED_HEADER", "ZERO_BLOCK", "check_members", "check_tar_end", "iter_members", "ustar_member"]

ZERO_BLOCK = bytes(tarfile.BLOCKSIZE)
MAX_EXTENDED_HEADER = 1 << 20  # a pax or GNU long-name header holds a name: ours take a few hundred bytes
_KINDS = {
    tarfile.SYMTYPE: "a symbolic link",
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.DIRTYPE: "a directory",
    tarfile.FIFOTYPE: "a FIFO",
    tarfile.GNUTYPE_SPARSE: "a sparse file",
}


def ustar_member(block: bytes, offset: int, fpath: Path) -> tuple[str, int, int] | None:
    """``(name, data offset, size)`` of a plain ustar regular-file header; None for anything else.

    tarfile's parser (``TarInfo.frombuf``) was a third of the reader's time. This one
    reads only what locating a member needs, verifies the header checksum, and leaves
    every other case (pax or GNU extensions, links, base-256 sizes) to tarfile.
    """
    if block[257:262] != b"ustar" or block[156:157] not in (b"0", b"\0"):
        return None
    try:
        size, checksum = int(block[124:136].rstrip(b" \0"), 8), int(block[148:156].rstrip(b" \0"), 8)
    except ValueError:
        return None
    if checksum != sum(block) - sum(block[148:156]) + 8 * 32:
        raise ShardFormatError(f"{fpath}: corrupt tar (bad header checksum at byte {offset}); re-extract the shard")
    name = block[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
    if prefix := block[345:500].split(b"\0", 1)[0]:
        name = prefix.decode("utf-8", "surrogateescape") + "/" + name
    return name, offset + tarfile.BLOCKSIZE, size


def _checked(member: tuple[str, int, int], end: int, fpath: Path) -> tuple[str, int, int]:
    """``member`` when its name follows the key scheme and its declared size fits before the archive's end."""
    name, offset, size = member
    if problem := member_name_problem(name):
        raise ShardFormatError(
            f"{fpath}: member {name!r} {problem}; a shard holds only KEY.SUFFIX members of its samples, "
            "re-extract the shard"
        )
    if offset + size > end:
        raise ShardFormatError(
            f"{fpath}: member {name!r} declares {size} bytes, more than the {max(end - offset, 0)} left in "
            "the shard file; the shard is corrupt or forged, re-extract it"
        )
    return member


class _HeaderReads:
    """The shard's stream as tarfile sees it: no single read above ``MAX_EXTENDED_HEADER`` bytes.

    tarfile only reads headers here (members are read by offset, elsewhere), so a larger read
    is an extended header declaring more than any name needs: refused before Python allocates it.
    """

    def __init__(self, stream, fpath: Path) -> None:  # noqa: ANN001 (binary file)
        self._stream, self._fpath = stream, fpath

    def read(self, size: int = -1) -> bytes:
        if size < 0 or size > MAX_EXTENDED_HEADER:
            raise ShardFormatError(
                f"{self._fpath}: a tar header at byte {self._stream.tell()} declares "
                f"{'all the rest' if size < 0 else size} bytes of extended header (at most "
                f"{MAX_EXTENDED_HEADER}); the shard is corrupt or forged, re-extract it"
            )
        return self._stream.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._stream.seek(offset, whence)

    def tell(self) -> int:
        return self._stream.tell()


def iter_members(stream, fpath: Path) -> Iterator[tuple[str, int, int]]:  # noqa: ANN001 (binary file)
    """``(name, data offset, size)`` of each member, in order; all regular files, checked (module docstring).

    Headers our writer produces go through ``ustar_member``; from the first header it
    does not handle, tarfile parses the rest of the archive (it can start at any header).
    """
    end = stream.seek(0, os.SEEK_END) - 2 * tarfile.BLOCKSIZE  # the end-of-archive marker (check_tar_end)
    offset = 0
    while True:
        stream.seek(offset)
        block = stream.read(tarfile.BLOCKSIZE)
        if len(block) < tarfile.BLOCKSIZE:
            raise ShardFormatError(f"{fpath}: cut short at byte {offset}; re-extract the shard")
        if block == ZERO_BLOCK:
            return
        if (member := ustar_member(block, offset, fpath)) is None:
            break
        yield _checked(member, end, fpath)
        offset = member[1] + -(-member[2] // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    stream.seek(offset)
    with tarfile.open(fileobj=_HeaderReads(stream, fpath), mode="r:") as tar:
        for info in tar:
            tar.members = []  # random access keeps every header otherwise; a shard holds thousands
            if not info.isreg() or info.issparse():
                link = f" to {info.linkname!r}" if info.issym() or info.islnk() else ""
                raise ShardFormatError(
                    f"{fpath}: member {info.name!r} is {_KINDS.get(info.type, f'of tar type {info.type!r}')}{link}, "
                    "not a regular file; a shard holds only its samples' files, re-extract the shard"
                )
            yield _checked((info.name, info.offset_data, info.size), end, fpath)
        # Past its first header tarfile ends quietly at an invalid one; a real end is zeros.
        stream.seek(tar.offset)
        if stream.read(tarfile.BLOCKSIZE) != ZERO_BLOCK:
            raise ShardFormatError(f"{fpath}: corrupt tar (invalid header at byte {tar.offset}); re-extract the shard")


def check_members(fpath: Path, stream=None) -> None:  # noqa: ANN001 (binary file)
    """Scan every member header of a shard (``iter_members``'s checks) without reading a member.

    For readers that hand the tar to another library (webdataset) after checking it here; ``stream``:
    the shard already open (an object fetched from a store is read once).
    """
    if stream is not None:
        for _ in iter_members(stream, fpath):
            pass
        return
    with fpath.open("rb") as stream:
        for _ in iter_members(stream, fpath):
            pass


def check_tar_end(fpath: Path, stream=None) -> None:  # noqa: ANN001 (binary file)
    """A tarfile-written archive ends with zero blocks on a 512-byte boundary; a cut file does not.

    webdataset's streaming reader stops silently when a cut falls between members, so
    this cheap tail check is what turns such a truncation into an error. ``stream``: the shard
    already open (a local file is opened here otherwise).
    """
    if stream is None:
        with fpath.open("rb") as stream:
            check_tar_end(fpath, stream)
        return
    size = stream.seek(0, os.SEEK_END)
    if size < 1024 or size % 512:
        raise ShardFormatError(f"{fpath}: truncated tar ({size} bytes); re-extract the shard")
    stream.seek(size - 1024)
    if stream.read(1024).strip(b"\0"):
        raise ShardFormatError(f"{fpath}: truncated tar (no end-of-archive marker); re-extract the shard")
