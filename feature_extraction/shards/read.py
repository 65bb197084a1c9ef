"""The training stream's shard reader: each sample's tokens read straight into a numpy array.

Why not webdataset's reader: it opens the tar in streaming mode, which hands every
400 KB ``tokens.npy`` over in 10 KB pieces that are then joined, and ``np.load`` copies
the joined bytes once more. That made the tar reader most of the training stream's CPU
time (BENCHMARKS.md, loader). A shard on disk can be read at random instead: each
header is parsed where it lies (``tar_scan.py``: plain ustar headers directly, anything else by tarfile),
and each token array is read with one ``readinto`` into its final memory. Members other
than ``tokens.npy`` (``meta.json``, ...) are skipped without being read, unless asked for
(``positions.npy``, and ``meta.json`` for the feature browser's labels).

The format is still webdataset's (written by ``wds.TarWriter``, readable by any
webdataset pipeline, tested in ``tests/test_shards.py``); the key of a member follows
webdataset's rule (the name up to the first dot of its last path component), and a
sample whose tokens are missing, malformed or cut short raises ``ShardFormatError``
naming the shard. What a member declares (its size, its ``.npy`` shape) is checked before
memory is taken by it (``tar_scan.py``, ``npy.py``): a shard is someone else's data.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import xxhash

from feature_extraction.shards import integrity
from feature_extraction.shards.layout import META_SUFFIX, POSITIONS_SUFFIX, TOKENS_SUFFIX, ShardFormatError, member_key
from feature_extraction.shards.meta import MAX_META_BYTES, parse_meta
from feature_extraction.shards.npy import MAX_HEADER_BYTES, check_data_bytes, decode_npy, read_npy_header
from feature_extraction.shards.tar_scan import check_members, check_tar_end, iter_members
from feature_extraction.store import Location, location

__all__ = ["decode_positions", "decode_sample", "iter_shard_samples", "iter_shard_tokens", "read_shard_samples"]


def _read_tokens(
    stream,  # noqa: ANN001 (binary file)
    where: str,
    offset: int,
    size: int,
    checksum: int | None = None,
    shape: tuple[int, int] | None = None,
) -> np.ndarray:
    """The float16 ``[n, d]`` array of one ``tokens.npy`` member, read once into place.

    The header is checked before the array is allocated: C-ordered float16 ``[n, d]``, of
    ``shape`` when the caller knows it (the manifest's tokens per image x d), declaring exactly
    the bytes the member holds. With ``checksum`` (the sidecar's xxh3-64 of the member), the
    bytes read are checked against it: a flipped byte anywhere in the member is an error, never
    training data.
    """
    stream.seek(offset)
    found, dtype, fortran_order, header = read_npy_header(stream, size, where)
    if dtype != np.float16 or len(found) != 2 or fortran_order:
        raise ShardFormatError(
            f"{where} is {dtype} {list(found)}{' (Fortran order)' if fortran_order else ''}, "
            "expected C-ordered float16 [n_tokens, d]; re-extract the shard"
        )
    if shape is not None and tuple(found) != tuple(shape):
        raise ShardFormatError(
            f"{where}: its .npy header declares tokens {list(found)}, the manifest says {list(shape)} "
            "(tokens per image, d); re-extract the shard"
        )
    check_data_bytes(found, dtype, size, header, where)
    tokens = np.empty(found, np.float16)
    data = memoryview(tokens).cast("B")
    if stream.readinto(data) != tokens.nbytes:
        shards_dpath = location(where.split(": member ", 1)[0]).parent
        raise ShardFormatError(f"{where} is cut short; re-extract the shard: {integrity.repair_command(shards_dpath)}")
    if checksum is not None:
        hasher = xxhash.xxh3_64(header)
        hasher.update(data)
        if hasher.intdigest() != checksum:
            raise _mismatch(where)
    return tokens


def _mismatch(where: str) -> ShardFormatError:
    fpath = location(where.split(": member ", 1)[0])
    return ShardFormatError(
        f"{where} does not match its checksum in {fpath.with_suffix('.json').name}: the shard "
        f"is corrupt; {integrity.repair_command(fpath.parent)}"
    )


def decode_positions(data: bytes, n_tokens: int, where: str) -> np.ndarray:
    """A sample's ``positions.npy``: int ``[n_tokens]`` full-sequence positions, checked, never unpickled."""
    positions = decode_npy(data, where)
    if positions.dtype not in (np.int16, np.int32) or positions.shape != (n_tokens,):
        raise ShardFormatError(
            f"{where} is {positions.dtype} {list(positions.shape)}, expected int16/int32 [{n_tokens}] "
            "(one per stored token); re-extract the shard"
        )
    return positions


def _read_member(stream, where: str, offset: int, size: int, limit: int) -> bytes:  # noqa: ANN001 (binary file)
    """A small member's bytes (``positions.npy``, ``meta.json``), refused unread above ``limit``."""
    if size > limit:
        raise ShardFormatError(
            f"{where} declares {size} bytes, at most {limit} fit what it holds; the shard is corrupt or "
            "forged, re-extract it"
        )
    stream.seek(offset)
    return stream.read(size)


def _positions_limit(n_tokens: int) -> int:
    return MAX_HEADER_BYTES + 4 * n_tokens  # int32, one per token


def iter_shard_tokens(
    fpath: Path | str,
    first: int = 0,
    last: int | None = None,
    with_positions: bool = False,
    checksums: integrity.SampleChecksums | None = None,
    with_meta: bool = False,
    shape: tuple[int, int] | None = None,
) -> Iterator[tuple]:
    """Yield ``(key, tokens float16 [n, d])`` of samples ``first..last`` (inclusive) of one shard, in order.

    With ``with_positions``, yield ``(key, tokens, positions)``: the sample's
    ``positions.npy`` (written before its tokens, members being sorted by name), or None
    for a sample of an all-token extraction. With ``with_meta``, the sample's ``meta.json``
    (a dict; ``{}`` when absent) is appended: it is a few hundred bytes next to the tokens, read
    only for the samples yielded (the feature browser's labels). Samples before ``first`` are counted but
    not read; reading stops after ``last``. A missing, truncated or corrupt shard raises
    ``ShardFormatError`` naming it; with ``checksums`` (``integrity.load_sample_checksums``)
    every member read is checked against its sidecar, naming the command that repairs it. With
    ``shape`` (the manifest's ``[tokens_per_image, d]``) a sample of any other shape is refused
    before its tokens are allocated.
    """
    fpath = location(fpath)
    index = -1
    positions: tuple[str, int, int] | None = None  # (key, offset, size) of the last positions.npy seen
    meta: tuple[str, int, int] | None = None  # the same for meta.json (members sorted: meta, positions, tokens)
    try:
        with open_shard(fpath) as stream:
            for name, offset, size in iter_members(stream, fpath):
                key, suffix = member_key(name)
                if with_positions and suffix == POSITIONS_SUFFIX:
                    positions = (key, offset, size)
                if with_meta and suffix == META_SUFFIX:
                    meta = (key, offset, size)
                if suffix != TOKENS_SUFFIX:
                    continue
                index += 1
                if index < first:
                    continue
                if checksums is not None and index >= len(checksums.tokens):
                    raise _mismatch(f"{fpath}: member {name!r} (sample {index + 1} of {len(checksums.tokens)})")
                tokens = _read_tokens(
                    stream,
                    f"{fpath}: member {name!r}",
                    offset,
                    size,
                    None if checksums is None else checksums.tokens[index],
                    shape,
                )
                extra: tuple = ()
                if not with_positions:
                    pass
                elif positions is None or positions[0] != key:
                    if checksums is not None and checksums.positions is not None:
                        raise _mismatch(f"{fpath}: member {key + '.' + POSITIONS_SUFFIX!r} (missing)")
                    extra = (None,)
                else:
                    where = f"{fpath}: member {key + '.' + POSITIONS_SUFFIX!r}"
                    data = _read_member(stream, where, *positions[1:], _positions_limit(len(tokens)))
                    if (
                        checksums is not None
                        and checksums.positions is not None
                        and xxhash.xxh3_64_intdigest(data) != checksums.positions[index]
                    ):
                        raise _mismatch(where)
                    extra = (decode_positions(data, len(tokens), where),)
                if with_meta:
                    extra += (_read_meta(stream, fpath, meta) if meta is not None and meta[0] == key else {},)
                yield (key, tokens, *extra)
                if last is not None and index >= last:
                    return
    except tarfile.TarError as exn:
        raise ShardFormatError(f"{fpath}: corrupt tar ({exn}); re-extract the shard") from None


@contextmanager
def open_shard(fpath: Location, buffering: int = -1) -> Iterator:
    """A shard open for reading, its tail checked (``check_tar_end``); a shard in a store is fetched whole, once.

    A cut tar is named with the command that redoes it: its sidecar may match it (hashed over what was
    written), and the extraction's rerun redoes it because it reads the tail too (``integrity.shard_problem``).
    """
    if not fpath.is_file():
        raise ShardFormatError(f"{fpath}: shard file not found; check the path or re-extract it")
    with fpath.open("rb", buffering=buffering) as stream:
        try:
            check_tar_end(fpath, stream)
        except ShardFormatError as exn:
            raise ShardFormatError(f"{exn}: {integrity.repair_command(location(fpath).parent)}") from None
        stream.seek(0)
        yield stream


def _read_meta(stream, fpath: Path, member: tuple[str, int, int]) -> dict:  # noqa: ANN001 (binary file)
    """A sample's ``meta.json`` as a dict, checked (``meta.parse_meta``: it is not covered by the sidecar's
    checksums)."""
    name = f"member {member[0] + '.' + META_SUFFIX!r}"
    return parse_meta(_read_member(stream, f"{fpath}: {name}", *member[1:], MAX_META_BYTES), fpath, name)


# --- webdataset's reader, for everything but the training stream (it needs meta.json too) ---
def decode_sample(sample: dict) -> tuple[str, np.ndarray, dict]:
    """Decode a raw webdataset sample into ``(key, tokens float16 [n_tokens, d], meta)``.

    Usable as a ``.map`` stage in the training pipeline; never unpickles.
    """
    key = sample.get("__key__", "?")
    where = (f"{sample['__url__']}: " if "__url__" in sample else "") + f"sample {key!r}"
    for field in (TOKENS_SUFFIX, META_SUFFIX):
        if field not in sample:
            raise ShardFormatError(f"{where}: missing {field!r}; the shard is corrupt, re-extract it")
    tokens = decode_npy(sample[TOKENS_SUFFIX], f"{where}: 'tokens.npy'")  # refuses a forged size unallocated
    if tokens.dtype != np.float16 or tokens.ndim != 2:
        raise ShardFormatError(
            f"{where}: 'tokens.npy' is {tokens.dtype} {list(tokens.shape)}, expected float16 [n_tokens, d]; "
            "re-extract the shard"
        )
    return key, tokens, parse_meta(sample[META_SUFFIX], where, "'meta.json'")


def iter_shard_samples(shard_fpaths: Sequence[Path | str], with_positions: bool = False) -> Iterator[tuple]:
    """Yield decoded samples of the given shards in order, through webdataset's tar reader.

    ``(key, tokens, meta)``, or with ``with_positions`` ``(key, tokens, meta, positions)``
    (None for a sample of an all-token extraction). No shuffling and no node/worker
    splitting: the caller has already chosen its shards. A missing, truncated or corrupt
    shard raises ShardFormatError naming it.
    """
    for fpath in shard_fpaths:
        fpath = location(fpath).resolve()  # absolute, so gopen never mistakes "x:" for a URL scheme
        try:
            # webdataset's reader on a stream we own, so the file is closed even when the
            # consumer stops early (its url_opener leaves handles to the garbage collector).
            # A 1 MiB buffer: webdataset reads members in ~10 KB pieces, and unbuffered that
            # made the tar reader most of the training stream's CPU time (BENCHMARKS.md).
            from webdataset import tariterators  # imported here: it loads torch, which the format does not need

            with open_shard(fpath, buffering=1 << 20) as stream:
                check_members(fpath, stream)  # webdataset reads what the headers declare: names, kinds, sizes first
                stream.seek(0)
                files = tariterators.tar_file_expander([{"url": str(fpath), "stream": stream}])
                for sample in tariterators.group_by_keys(files):
                    key, tokens, meta = decode_sample(sample)
                    if not with_positions:
                        yield key, tokens, meta
                    elif POSITIONS_SUFFIX not in sample:
                        yield key, tokens, meta, None
                    else:
                        yield (
                            key,
                            tokens,
                            meta,
                            decode_positions(
                                sample[POSITIONS_SUFFIX], len(tokens), f"{fpath}: sample {key!r}: 'positions.npy'"
                            ),
                        )
        except ShardFormatError:
            raise
        except (tarfile.TarError, OSError, EOFError, ValueError) as exn:
            # webdataset appends the stream and url to exn.args; keep only the message.
            reason = str(exn.args[0]).split(" @ ")[0] if exn.args else type(exn).__name__
            raise ShardFormatError(f"{fpath}: corrupt tar ({reason}); re-extract the shard") from None


def read_shard_samples(
    fpath: Path | str, indices: Sequence[int], shape: tuple[int, int] | None = None
) -> Iterator[tuple[int, str, np.ndarray, np.ndarray | None, dict]]:
    """Yield ``(index, key, tokens, positions or None, meta)`` of the samples ``indices`` of one shard, in order.

    For readers that need a few samples of many shards (the feature browser re-reads the
    top images' tokens): one scan of the member headers, and only the wanted samples'
    members are read. Checked like ``iter_shard_tokens`` (``shape`` too); a wanted index beyond the shard's
    last sample raises ``ShardFormatError``.
    """
    fpath = location(fpath)
    wanted = sorted(set(int(i) for i in indices))
    if not wanted:
        return
    index, members = -1, {}  # suffix -> (offset, size) of the current sample's members seen so far
    current_key = None
    try:
        with open_shard(fpath) as stream:
            for name, offset, size in iter_members(stream, fpath):
                key, suffix = member_key(name)
                if key != current_key:
                    current_key, members = key, {}
                members[suffix] = (offset, size)
                if suffix != TOKENS_SUFFIX:  # members are sorted by name: meta, positions, then tokens
                    continue
                index += 1
                if index != wanted[0]:
                    continue
                where = f"{fpath}: member {name!r}"
                tokens = _read_tokens(stream, where, offset, size, shape=shape)
                positions = None
                if POSITIONS_SUFFIX in members:
                    where = f"{fpath}: member {key + '.' + POSITIONS_SUFFIX!r}"
                    data = _read_member(stream, where, *members[POSITIONS_SUFFIX], _positions_limit(len(tokens)))
                    positions = decode_positions(data, len(tokens), where)
                meta = _read_meta(stream, fpath, (key, *members[META_SUFFIX])) if META_SUFFIX in members else {}
                yield index, key, tokens, positions, meta
                wanted.pop(0)
                if not wanted:
                    return
    except tarfile.TarError as exn:
        raise ShardFormatError(f"{fpath}: corrupt tar ({exn}); re-extract the shard") from None
    raise ShardFormatError(f"{fpath}: has {index + 1} samples, sample {wanted[0]} was asked for; re-extract the shard")
