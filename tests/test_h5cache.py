"""HDF5 token cache (feature_extraction/h5cache.py) and codes file (sae_pipeline/artifacts/codes.py).

Round trips against numpy indexing, appends, atomic writes.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import h5py
import numpy as np
import pytest

from feature_extraction.h5cache import CacheFormatError, TokenCache, read_attrs, write_token_cache
from sae_pipeline.artifacts.codes import CodesWriter, count_codes, read_codes

N, D = 37, 6


@pytest.fixture
def cache_data(tmp_path: Path) -> tuple[Path, np.ndarray, list[str], np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.standard_normal((N, D)).astype(np.float16)
    ids = [f"img{i // 5}" for i in range(N)]
    positions = np.arange(N) % 5
    fpath = tmp_path / "cache.h5"
    write_token_cache(fpath, tokens, ids, positions, attrs={"layer": 11, "spec": {"name": "dinov2", "x": None}})
    return fpath, tokens, ids, positions


INDICES = [
    0,
    -1,
    17,
    np.int64(3),
    slice(None),
    slice(3, 30, 4),
    slice(None, None, -3),
    slice(5, 5),
    [5, 1, 1, 36, 0],
    np.array([], dtype=np.int64),
    np.arange(10, 20),
    np.array([-2, 4]),
    (np.arange(N) % 3 == 0),
]


@pytest.mark.parametrize("index", INDICES, ids=lambda i: repr(i)[:30])
def test_token_cache_matches_numpy_indexing(cache_data, index):
    fpath, tokens, ids, positions = cache_data
    cache = TokenCache(fpath)
    got = cache[index]
    assert got.dtype == np.float16 and got.tobytes() == tokens[index].tobytes()
    assert got.shape == tokens[index].shape
    np.testing.assert_array_equal(cache.image_ids(index), np.asarray(ids)[index])
    np.testing.assert_array_equal(cache.token_positions(index), positions[index])
    cache.close()


def test_token_cache_metadata_and_lazy_open(cache_data):
    fpath, tokens, _, _ = cache_data
    cache = TokenCache(fpath)
    assert len(cache) == N and cache.d == D
    assert cache.attrs == {"layer": 11, "spec": {"name": "dinov2", "x": None}}
    assert cache._h5 is None  # nothing held open until the first read
    cache[0]
    assert cache._h5 is not None
    assert cache.__getstate__()["_h5"] is None  # a copy sent to a worker reopens its own handle
    with pytest.raises(IndexError):
        cache[N]
    with pytest.raises(IndexError):
        cache[[0, -N - 1]]
    cache.close()
    np.testing.assert_array_equal(cache[2], tokens[2])  # reopens after close


def _child_read(cache: TokenCache, out_fpath: str) -> None:
    np.save(out_fpath, cache[[3, 1]], allow_pickle=False)


def test_token_cache_reopens_in_a_forked_child(cache_data, tmp_path):
    fpath, tokens, _, _ = cache_data
    cache = TokenCache(fpath)
    cache[0]  # parent holds a handle; the child must not use it
    child = multiprocessing.get_context("fork").Process(target=_child_read, args=(cache, str(tmp_path / "o.npy")))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy", allow_pickle=False), tokens[[3, 1]])
    np.testing.assert_array_equal(cache[5], tokens[5])
    cache.close()


def test_token_cache_without_optional_fields(tmp_path):
    tokens = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    write_token_cache(tmp_path / "c.h5", tokens)
    cache = TokenCache(tmp_path / "c.h5")
    np.testing.assert_array_equal(cache[:], tokens)
    assert cache.attrs == {} and read_attrs(tmp_path / "c.h5") == {}
    with pytest.raises(CacheFormatError, match="image_ids"):
        cache.image_ids()
    cache.close()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tokens": np.zeros(5)}, "tokens"),
        ({"tokens": np.zeros((5, 2), np.int32)}, "tokens"),
        ({"image_ids": ["a"]}, "image_ids"),
        ({"token_positions": np.zeros(4)}, "token_positions"),
        ({"attrs": {"bad": object()}}, "attrs"),
    ],
)
def test_write_token_cache_rejects_bad_input_and_keeps_old_file(tmp_path, kwargs, match):
    fpath = tmp_path / "c.h5"
    old = np.ones((5, 2), np.float16)
    write_token_cache(fpath, old)
    before = fpath.read_bytes()
    args = {"tokens": np.zeros((5, 2), np.float16), **kwargs}
    with pytest.raises(ValueError, match=match):
        write_token_cache(fpath, **args)
    assert fpath.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["c.h5"]


def _random_chunk(rng: np.random.Generator, start: int, n: int, k: int, d_sae: int):
    ids = [f"img{(start + i) // 7}" for i in range(n)]
    positions = (np.arange(start, start + n) % 7).astype(np.int64)
    indices = rng.integers(0, d_sae, (n, k)).astype(np.int64)
    indices[rng.random((n, k)) < 0.3] = -1
    values = np.where(indices >= 0, rng.random((n, k)), 0.0).astype(np.float32)
    return ids, positions, indices, values


def test_codes_writer_appends_chunks_of_varying_width(tmp_path):
    rng = np.random.default_rng(2)
    d_sae, fpath = 50, tmp_path / "codes.h5"
    chunks, start = [], 0
    with CodesWriter(fpath, {"variant": "mp", "k": 4}, d_sae=d_sae) as writer:
        for n, k in [(5, 3), (0, 3), (9, 5), (4, 2)]:
            chunk = _random_chunk(rng, start, n, k, d_sae)
            writer.write(*chunk)
            chunks.append(chunk)
            start += n
        assert not fpath.exists()  # only the temporary file exists until the block ends
    width = max(c[2].shape[1] for c in chunks)
    pad = [(0, 0), (0, 0)]
    ref_indices = np.concatenate(
        [np.pad(c[2], pad[:1] + [(0, width - c[2].shape[1])], constant_values=-1) for c in chunks]
    )
    ref_values = np.concatenate([np.pad(c[3], pad[:1] + [(0, width - c[3].shape[1])]) for c in chunks])
    codes = read_codes(fpath)
    assert codes["indices"].dtype == np.int32 and codes["values"].dtype == np.float32
    np.testing.assert_array_equal(codes["indices"], ref_indices)
    np.testing.assert_array_equal(codes["values"], ref_values)
    np.testing.assert_array_equal(codes["image_ids"], sum((c[0] for c in chunks), []))
    np.testing.assert_array_equal(codes["token_positions"], np.concatenate([c[1] for c in chunks]))
    assert read_attrs(fpath) == {"variant": "mp", "k": 4, "d_sae": d_sae}


def test_codes_writer_interrupted_leaves_no_file(tmp_path):
    rng = np.random.default_rng(3)
    fpath = tmp_path / "codes.h5"
    with pytest.raises(RuntimeError):
        with CodesWriter(fpath, {"d_sae": 10}) as writer:
            writer.write(*_random_chunk(rng, 0, 4, 2, 10))
            raise RuntimeError("predict crashed")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda c: (c[0], c[1], c[2] + 100, c[3]), "d_sae"),
        (lambda c: (c[0], c[1], c[2], c[3][:, :1]), "values"),
        (lambda c: (c[0], c[1][:2], c[2], c[3]), "token_positions"),
        (lambda c: (c[0], c[1], c[2].astype(np.float32), c[3]), "indices"),
    ],
)
def test_codes_writer_rejects_bad_chunks(tmp_path, change, match):
    rng = np.random.default_rng(4)
    with CodesWriter(tmp_path / "codes.h5", d_sae=10) as writer:
        with pytest.raises(ValueError, match=match):
            writer.write(*change(_random_chunk(rng, 0, 4, 3, 10)))


def test_readers_reject_wrong_or_missing_files(cache_data, tmp_path):
    fpath = cache_data[0]
    with pytest.raises(CacheFormatError, match="cache.h5"):
        read_codes(fpath)  # a token cache is not a codes file
    with pytest.raises(CacheFormatError, match="missing.h5"):
        TokenCache(tmp_path / "missing.h5")
    (tmp_path / "junk.h5").write_bytes(b"not hdf5")
    with pytest.raises(CacheFormatError, match="junk.h5"):
        TokenCache(tmp_path / "junk.h5")
    with pytest.raises(ValueError, match="outside"):
        CodesWriter(tmp_path / "c.h5").write(["a"], np.zeros(1, int), np.zeros((1, 1), int), np.zeros((1, 1)))


def test_a_cache_that_does_not_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """Issue 31, item 19: the writer had no free-space check, and HDF5 cannot recover from a failed write."""
    import feature_extraction.atomic_files as atomic_files
    from feature_extraction.atomic_files import DiskFullError

    monkeypatch.setattr(atomic_files, "free_bytes", lambda dpath: 2 << 20)  # 2 MiB free
    tokens = np.zeros((1024, 256), np.float32)  # 1 MiB of tokens, + HDF5's 5 MiB reserve
    previous = tmp_path / "previous.h5"
    previous.write_bytes(b"previous cache")
    for fpath, kept in (
        (tmp_path / "new" / "cache.h5", "kept: nothing, no file was written"),
        (previous, f"kept: the previous {previous}, unchanged"),
    ):
        with pytest.raises(DiskFullError) as info:
            write_token_cache(fpath, tokens, image_ids=[f"img{i}" for i in range(1024)])
        line = str(info.value)
        assert line.startswith(f"no space left on device writing {fpath} (2.0 MiB free, 6.0 MiB needed); {kept}")
        assert line.endswith("; free space and rerun the same command"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["previous.h5"]  # no folder, no temporary file
    assert previous.read_bytes() == b"previous cache"


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda h5: h5.__delitem__("values"), "no dataset values"),
        (lambda h5: h5.__delitem__("image_ids"), "no dataset image_ids"),
        (lambda h5: (h5.__delitem__("indices"), h5.create_dataset("indices", data=np.zeros(4, np.int32))), "indices"),
        (lambda h5: (h5.__delitem__("values"), h5.create_dataset("values", data=np.zeros((4, 2), np.int32))), "values"),
        (lambda h5: (h5.__delitem__("token_positions"), h5.create_dataset("token_positions", data=np.zeros(3))), "n "),
    ],
)
def test_codes_readers_name_a_damaged_layout_in_one_line(tmp_path, damage, match):
    """A codes file with the right format attribute but missing or mis-shaped datasets (someone else's file,
    or a hand edit) is a one-line CacheFormatError naming the file and what is wrong, not a KeyError."""
    rng = np.random.default_rng(5)
    fpath = tmp_path / "codes.h5"
    with CodesWriter(fpath, {"d_sae": 10}) as writer:
        writer.write(*_random_chunk(rng, 0, 4, 2, 10))
    assert read_codes(fpath)["indices"].shape == (4, 2)
    with h5py.File(fpath, "a") as h5:
        damage(h5)
    for reader in (read_codes, count_codes):
        with pytest.raises(CacheFormatError, match=match) as info:
            reader(fpath)
        assert str(fpath) in str(info.value) and "\n" not in str(info.value)
