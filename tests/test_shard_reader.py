"""The training stream's random-access shard reader against webdataset's own reader."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from webdataset.tariterators import base_plus_ext

from feature_extraction import shards as S
from feature_extraction.shards import read as R


def write(dpath: Path, keys: list[str], seed: int = 0, n_tokens: int = 5, d: int = 8) -> Path:
    rng = np.random.default_rng(seed)
    samples = [(key, rng.standard_normal((n_tokens, d)).astype(np.float16), {"i": i}) for i, key in enumerate(keys)]
    S.write_shard(dpath, 0, samples)
    return next(dpath.glob("shard-*.tar"))


def webdataset_tokens(fpath: Path) -> list[tuple[str, np.ndarray]]:
    return [(key, tokens) for key, tokens, _ in R.iter_shard_samples([fpath])]


@pytest.mark.parametrize(
    "keys",
    [
        [f"img{i:03d}" for i in range(7)],
        ["n01440764_10026", "x" * 180, "sub%2Edir%2Fname", "é-ünï-çødé", "z" * 99],  # long (pax) and non-ASCII keys
    ],
)
def test_same_samples_as_webdataset(tmp_path: Path, keys: list[str]) -> None:
    fpath = write(tmp_path, keys)
    expected = webdataset_tokens(fpath)
    got = list(R.iter_shard_tokens(fpath))
    assert [k for k, _ in got] == [k for k, _ in expected] == keys
    for (_, a), (_, b) in zip(got, expected):
        assert a.dtype == np.float16 and np.array_equal(a, b)


def test_first_and_last_select_a_range(tmp_path: Path) -> None:
    keys = [f"img{i}" for i in range(9)]
    fpath = write(tmp_path, keys, n_tokens=3)
    expected = webdataset_tokens(fpath)
    for first, last in [(0, 0), (2, 5), (8, 8), (4, None)]:
        got = list(R.iter_shard_tokens(fpath, first, last))
        stop = len(keys) if last is None else last + 1
        assert [k for k, _ in got] == keys[first:stop]
        assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, expected[first:stop]))


def test_member_key_follows_webdataset() -> None:
    for name in ["a.tokens.npy", "dir/b.meta.json", "dir.x/c.tokens.npy", "d", "e.", "p/q/r.s.t"]:
        key, suffix = R.member_key(name)
        wds_key, wds_suffix = base_plus_ext(name)
        assert (key, suffix) == (wds_key, wds_suffix) or wds_key is None, name


def test_corrupt_header_checksum_is_an_error(tmp_path: Path) -> None:
    fpath = write(tmp_path, ["a", "b", "c"])
    with tarfile.open(fpath) as tar:
        second = tar.getmembers()[1].offset
    data = bytearray(fpath.read_bytes())
    data[second + 5] ^= 0x20  # a name byte: the checksum no longer matches
    fpath.write_bytes(bytes(data))
    with pytest.raises(S.ShardFormatError, match=r"shard-000000.tar: corrupt tar"):
        list(R.iter_shard_tokens(fpath))


def test_truncated_shard_names_the_file(tmp_path: Path) -> None:
    fpath = write(tmp_path, ["a", "b", "c"], n_tokens=64)
    data = fpath.read_bytes()
    fpath.write_bytes(data[: len(data) // 2])
    with pytest.raises(S.ShardFormatError, match=r"shard-000000.tar"):
        list(R.iter_shard_tokens(fpath))
    fpath.write_bytes(data[: len(data) // 2 // 512 * 512] + bytes(1024))  # cut, then zero blocks: looks closed
    with pytest.raises(S.ShardFormatError, match=r"shard-000000.tar"):
        list(R.iter_shard_tokens(fpath))


def test_wrong_dtype_and_missing_file(tmp_path: Path) -> None:
    fpath = tmp_path / "shard-000000.tar"
    with tarfile.open(fpath, "w", format=tarfile.USTAR_FORMAT) as tar:
        buffer = io.BytesIO()
        np.save(buffer, np.zeros((2, 3), np.float32))
        info = tarfile.TarInfo("a.tokens.npy")
        info.size = len(buffer.getvalue())
        tar.addfile(info, io.BytesIO(buffer.getvalue()))
    with pytest.raises(S.ShardFormatError, match=r"'a.tokens.npy' is float32 \[2, 3\].*expected C-ordered float16"):
        list(R.iter_shard_tokens(fpath))
    with pytest.raises(S.ShardFormatError, match=r"nope.tar: shard file not found"):
        list(R.iter_shard_tokens(tmp_path / "nope.tar"))


def test_corrupt_header_after_a_pax_member_is_an_error(tmp_path: Path) -> None:
    """Past a header the fast path leaves to tarfile, a broken header must not end the shard quietly."""
    fpath = write(tmp_path, ["x" * 150, "b", "c"])
    with tarfile.open(fpath) as tar:
        last = tar.getmembers()[-1].offset
    data = bytearray(fpath.read_bytes())
    data[last + 1] ^= 0x20
    fpath.write_bytes(bytes(data))
    with pytest.raises(S.ShardFormatError, match=r"shard-000000.tar: corrupt tar \(invalid header"):
        list(R.iter_shard_tokens(fpath))


def test_with_meta_yields_each_samples_meta_json(tmp_path: Path) -> None:
    """The feature browser's labels: meta.json read only for the samples yielded, a broken one named."""
    fpath = write(tmp_path, [f"img{i}" for i in range(6)])
    got = list(R.iter_shard_tokens(fpath, 2, 4, with_positions=True, with_meta=True))
    assert [(key, positions, meta) for key, _, positions, meta in got] == [
        (f"img{i}", None, {"i": i}) for i in (2, 3, 4)
    ]
    assert [meta for _, _, meta in R.iter_shard_tokens(fpath, with_meta=True)] == [{"i": i} for i in range(6)]
    broken = tmp_path / "broken" / "shard-000000.tar"
    broken.parent.mkdir()
    with tarfile.open(broken, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in (("a.meta.json", b"{not json"), ("a.tokens.npy", None)):
            if data is None:
                buffer = io.BytesIO()
                np.save(buffer, np.zeros((2, 3), np.float16))
                data = buffer.getvalue()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert [key for key, _ in R.iter_shard_tokens(broken)] == ["a"]  # not read unless asked for
    with pytest.raises(S.ShardFormatError, match=r"'a.meta.json' is not valid JSON"):
        list(R.iter_shard_tokens(broken, with_meta=True))
