"""Where each member of a shard's tar lies, without reading the members.

The training stream's reader (``read.py``) reads samples at random and ``finalize`` hashes the
members of shards written before per-sample checksums (``integrity.py``); both need only each
member's name, data offset and size, so the scan is its own module below both. Our writer's plain ustar headers are
parsed here directly (tarfile's parser was a third of the reader's time); anything else is left to tarfile. A cut or
corrupt archive raises ``ShardFormatError`` naming the shard.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path

from feature_extraction.shards.layout import ShardFormatError

__all__ = ["ZERO_BLOCK", "check_tar_end", "iter_members", "ustar_member"]

ZERO_BLOCK = bytes(tarfile.BLOCKSIZE)


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


def iter_members(stream, fpath: Path) -> Iterator[tuple[str, int, int]]:  # noqa: ANN001 (binary file)
    """``(name, data offset, size)`` of each regular member, in order.

    Headers our writer produces go through ``ustar_member``; from the first header it
    does not handle, tarfile parses the rest of the archive (it can start at any header).
    """
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
        yield member
        offset = member[1] + -(-member[2] // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    stream.seek(offset)
    with tarfile.open(fileobj=stream, mode="r:") as tar:
        for info in tar:
            tar.members = []  # random access keeps every header otherwise; a shard holds thousands
            if info.isreg():
                yield info.name, info.offset_data, info.size
        # Past its first header tarfile ends quietly at an invalid one; a real end is zeros.
        stream.seek(tar.offset)
        if stream.read(tarfile.BLOCKSIZE) != ZERO_BLOCK:
            raise ShardFormatError(f"{fpath}: corrupt tar (invalid header at byte {tar.offset}); re-extract the shard")


def check_tar_end(fpath: Path) -> None:
    """A tarfile-written archive ends with zero blocks on a 512-byte boundary; a cut file does not.

    webdataset's streaming reader stops silently when a cut falls between members, so
    this cheap tail check is what turns such a truncation into an error.
    """
    size = fpath.stat().st_size
    if size < 1024 or size % 512:
        raise ShardFormatError(f"{fpath}: truncated tar ({size} bytes); re-extract the shard")
    with open(fpath, "rb") as f:
        f.seek(size - 1024)
        if f.read(1024).strip(b"\0"):
            raise ShardFormatError(f"{fpath}: truncated tar (no end-of-archive marker); re-extract the shard")
