"""A shard's ``.npy`` members, parsed with their declared size checked before anything is allocated.

Why not ``np.load``: a shard is someone else's data, and ``np.load`` allocates what the header
declares (10¹² float16 elements is a 2 TB request) before it reads a byte of data. Here the
header is parsed alone (numpy's parser, behind a cap on its length), and the size it declares,
``product(shape) x itemsize``, must equal the bytes the member holds after it; only then is
memory taken, so it is bounded by the member, and the member by its shard file
(``tar_scan.py``). Never unpickles: an object dtype is refused.
"""

from __future__ import annotations

import io
import math

import numpy as np

from feature_extraction.shards.layout import ShardFormatError

__all__ = ["MAX_HEADER_BYTES", "NPY_PREFIX", "check_data_bytes", "decode_npy", "read_npy_header"]

NPY_PREFIX = 128  # numpy pads .npy headers to 64 bytes; ours take 128
MAX_HEADER_BYTES = 10_000  # numpy's own limit on a header it parses (``max_header_size``)
_HEADERS: dict[bytes, tuple] = {}  # .npy header bytes -> (shape, dtype, fortran_order), for headers already checked


def read_npy_header(stream, size: int, where: str) -> tuple[tuple[int, ...], np.dtype, bool, bytes]:  # noqa: ANN001
    """``(shape, dtype, fortran_order, header bytes)`` of the ``size``-byte ``.npy`` at the stream's position.

    The stream is left after the header. Every sample of a shard has the same header bytes, so
    the parse (numpy's, a ``literal_eval``) is cached by those bytes: it was a tenth of the
    training stream's reader time.
    """
    head = stream.read(min(NPY_PREFIX, size))
    if len(head) < 10 or head[:6] != b"\x93NUMPY":
        raise ShardFormatError(f"{where} is not a valid .npy (no NUMPY magic); re-extract the shard")
    if head[6] == 1:
        length = 10 + int.from_bytes(head[8:10], "little")
    elif len(head) >= 12:
        length = 12 + int.from_bytes(head[8:12], "little")
    else:
        length = size + 1
    if length > min(size, MAX_HEADER_BYTES):
        raise ShardFormatError(
            f"{where}: its .npy header declares {length} bytes, the member holds {size} (a header takes at most "
            f"{MAX_HEADER_BYTES}); the shard is corrupt or forged, re-extract it"
        )
    if length > len(head):
        head += stream.read(length - len(head))
    else:
        stream.seek(length - len(head), 1)
    header = head[:length]
    if (parsed := _HEADERS.get(header)) is None:
        try:
            buffer = io.BytesIO(header)
            version = np.lib.format.read_magic(buffer)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            parsed = read_header(buffer)
        except (ValueError, SyntaxError, EOFError) as exn:
            raise ShardFormatError(f"{where} is not a valid .npy ({exn}); re-extract the shard") from None
        if parsed[2].hasobject:
            raise ShardFormatError(f"{where} holds Python objects (a pickle), never read; re-extract the shard")
        if len(_HEADERS) >= 64:
            _HEADERS.clear()
        _HEADERS[header] = parsed
    shape, fortran_order, dtype = parsed
    return shape, dtype, fortran_order, header


def check_data_bytes(shape: tuple[int, ...], dtype: np.dtype, size: int, header: bytes, where: str) -> None:
    """The size the header declares, ``product(shape) x itemsize``, must be the bytes after it in the member."""
    declared = math.prod(shape) * dtype.itemsize  # Python ints: 10¹² elements do not overflow
    if declared != size - len(header):
        raise ShardFormatError(
            f"{where}: its .npy header declares {dtype} {list(shape)} = {declared} bytes, the member holds "
            f"{size - len(header)} after the header; the shard is corrupt or forged, re-extract it"
        )


def decode_npy(data: bytes, where: str) -> np.ndarray:
    """The array of a whole ``.npy`` member held in ``data`` (C or Fortran order), checked as above."""
    shape, dtype, fortran_order, header = read_npy_header(io.BytesIO(data), len(data), where)
    check_data_bytes(shape, dtype, len(data), header, where)
    flat = np.frombuffer(data, dtype, math.prod(shape), len(header)).copy()  # writable, like np.load's
    return flat.reshape(shape, order="F" if fortran_order else "C")
