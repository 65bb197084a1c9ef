"""The webdataset shard format: round trips, determinism, task split, stats, manifest checks, crash safety."""

from __future__ import annotations

import errno
import gc
import hashlib
import io
import json
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

import feature_extraction
from feature_extraction import shards as S
from feature_extraction.running_stats import RunningStats
from feature_extraction.shards import read as R
from feature_extraction.shards import write as W

D = 8
N_TOKENS = 5  # 1 prefix token + a 2x2 grid
GRID = (2, 2)
SPEC = {"name": "fake", "library": "timm", "model_name": "vit_tiny"}


def make_samples(n_images: int, seed: int = 0) -> list[tuple[str, np.ndarray, dict]]:
    rng = np.random.default_rng(seed)
    ids = [f"n{rng.integers(1e6):06d}_{i}" for i in range(n_images)]
    return [
        (
            key,
            (3 * rng.standard_normal((N_TOKENS, D))).astype(np.float16),
            {"label": int(rng.integers(10)), "source": f"/images/{key}.jpg"},
        )
        for key in ids
    ]


def write_dataset(dpath: Path, samples: list, shard_size: int) -> list[list[str]]:
    by_key = {key: (key, tokens, meta) for key, tokens, meta in samples}
    assignment = S.assign_shards(list(by_key), shard_size)
    for index, keys in enumerate(assignment):
        S.write_shard(dpath, index, (by_key[k] for k in keys))
    return assignment


def write_test_manifest(dpath: Path, n_shards: int) -> dict:
    return S.write_manifest(
        dpath,
        n_shards=n_shards,
        spec=SPEC,
        layer=11,
        tokens_per_image=N_TOKENS,
        n_prefix_tokens=1,
        grid=GRID,
        skipped=[{"image_id": "bad", "reason": "decode"}],
    )


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, list, dict]:
    samples = make_samples(11)
    assignment = write_dataset(tmp_path, samples, shard_size=4)
    return tmp_path, samples, write_test_manifest(tmp_path, len(assignment))


def test_round_trip_keys_bytes_and_meta_in_order(dataset):
    dpath, samples, manifest = dataset
    expected = sorted(samples, key=lambda s: s[0])
    got = list(R.iter_shard_samples(S.shard_fpaths(dpath, manifest)))
    assert [k for k, _, _ in got] == [k for k, _, _ in expected]
    for (_, tokens, meta), (_, ref_tokens, ref_meta) in zip(got, expected):
        assert tokens.dtype == np.float16 and tokens.tobytes() == ref_tokens.tobytes()
        assert meta == ref_meta


def test_tokens_are_plain_npy_without_pickle(dataset):
    dpath, samples, _ = dataset
    ref = {k: t for k, t, _ in samples}
    with tarfile.open(dpath / S.shard_fname(0)) as tar:
        names = tar.getnames()
        assert all(n.endswith((".tokens.npy", ".meta.json")) for n in names)
        member = next(n for n in names if n.endswith(".tokens.npy"))
        arr = np.load(io.BytesIO(tar.extractfile(member).read()), allow_pickle=False)
    assert arr.tobytes() == ref[member.split(".")[0]].tobytes()


def test_two_writes_are_byte_identical(tmp_path):
    samples = make_samples(6, seed=3)
    write_dataset(tmp_path / "a", samples, shard_size=4)
    write_dataset(tmp_path / "b", samples[::-1], shard_size=4)  # listing order must not matter
    for index in range(2):
        a = (tmp_path / "a" / S.shard_fname(index)).read_bytes()
        b = (tmp_path / "b" / S.shard_fname(index)).read_bytes()
        assert a == b
        sidecar = S.read_sidecar(tmp_path / "a", index)
        assert sidecar["sha256"] == hashlib.sha256(a).hexdigest() == S.read_sidecar(tmp_path / "b", index)["sha256"]
        assert sidecar["bytes"] == len(a)


def test_webdataset_pipeline_with_decode_sample(dataset):
    dpath, samples, manifest = dataset
    urls = [str(p) for p in S.shard_fpaths(dpath, manifest)]
    with warnings.catch_warnings():  # webdataset's url_opener leaves its file handles to the GC
        warnings.simplefilter("ignore", ResourceWarning)
        ds = wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(), wds.map(R.decode_sample))
        keys = [k for k, _, _ in ds]
        del ds
        gc.collect()
    assert keys == sorted(k for k, _, _ in samples)


@pytest.mark.parametrize("shard_size", [1, 3, 4, 100])
def test_assign_shards_sorted_chunks_independent_of_order(shard_size):
    rng = np.random.default_rng(shard_size)
    ids = [f"img{v}" for v in rng.permutation(23)]
    shards = S.assign_shards(ids, shard_size)
    assert [k for shard in shards for k in shard] == sorted(ids)
    assert all(len(s) == shard_size for s in shards[:-1]) and 1 <= len(shards[-1]) <= shard_size
    assert S.assign_shards(list(reversed(ids)), shard_size) == shards


@pytest.mark.parametrize("bad_ids, shard_size", [(["a", "a"], 2), (["a.jpg"], 2), (["__x__"], 2), (["a"], 0)])
def test_assign_shards_rejects_bad_input(bad_ids, shard_size):
    with pytest.raises(ValueError):
        S.assign_shards(bad_ids, shard_size)


@pytest.mark.parametrize("n_shards", [0, 1, 7, 10, 33])
@pytest.mark.parametrize("num_tasks", [1, 2, 3, 8, 50])
def test_shards_for_task_covers_every_shard_once(n_shards, num_tasks):
    owned = [i for t in range(num_tasks) for i in S.shards_for_task(n_shards, t, num_tasks)]
    assert sorted(owned) == list(range(n_shards))


@pytest.mark.parametrize("task_index, num_tasks", [(2, 2), (-1, 2), (0, 0)])
def test_shards_for_task_rejects_bad_task(task_index, num_tasks):
    with pytest.raises(ValueError, match="task"):
        S.shards_for_task(10, task_index, num_tasks)


def test_running_stats_merge_equals_one_pass_numpy():
    rng = np.random.default_rng(1)
    chunks = [(rng.standard_normal((n, D)) * 5 + 2).astype(np.float16) for n in (1, 7, 30, 4)]
    x = np.concatenate(chunks).astype(np.float64)
    parts = []
    for chunk in chunks:
        stats = RunningStats(D)
        stats.update(chunk[: len(chunk) // 2])
        stats.update(chunk[len(chunk) // 2 :])
        parts.append(RunningStats.from_json(json.loads(json.dumps(stats.to_json()))))
    merged = parts[0].merge(parts[1]).merge(parts[2].merge(parts[3])).merge(RunningStats(0))
    assert merged.n_tokens == len(x)
    np.testing.assert_allclose(merged.mean(), x.mean(axis=0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(merged.mean_sq_norm(), (x**2).sum(axis=1).mean(), rtol=1e-12)
    with pytest.raises(ValueError, match="d="):
        merged.merge(RunningStats(D + 1, 1, np.zeros(D + 1), 0.0))


def test_write_manifest_fields_and_stats(dataset):
    dpath, samples, manifest = dataset
    x = np.concatenate([t for _, t, _ in samples]).astype(np.float64)
    assert manifest == S.load_manifest(dpath, verify=True)
    assert set(S.REQUIRED_FIELDS) <= set(manifest)
    assert manifest["schema_version"] == S.SCHEMA_VERSION and manifest["dtype"] == "float16"
    assert manifest["backbone"] == SPEC and manifest["layer"] == 11 and manifest["d"] == D
    assert manifest["grid"] == list(GRID) and manifest["n_prefix_tokens"] == 1
    assert manifest["n_images"] == len(samples) and manifest["n_tokens"] == len(x)
    assert manifest["package_version"] == feature_extraction.__version__
    assert [s["count"] for s in manifest["shards"]] == [4, 4, 3]
    for index, entry in enumerate(manifest["shards"]):
        data = (dpath / entry["fname"]).read_bytes()
        assert entry["fname"] == S.shard_fname(index) and entry["bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    np.testing.assert_allclose(manifest["stats"]["mean"], x.mean(axis=0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(manifest["stats"]["mean_sq_norm"], (x**2).sum(axis=1).mean(), rtol=1e-12)
    assert manifest["skipped"] == [{"image_id": "bad", "reason": "decode"}]


def test_finalize_lists_missing_shards(tmp_path):
    write_dataset(tmp_path, make_samples(9), shard_size=3)
    (tmp_path / "shard-000001.json").unlink()
    with pytest.raises(S.ShardFormatError, match=r"shards 1, 3 of 4"):
        write_test_manifest(tmp_path, 4)
    assert not (tmp_path / S.MANIFEST_FNAME).exists()


def _rewrite_manifest(dpath: Path, **changes) -> None:
    fpath = dpath / S.MANIFEST_FNAME
    manifest = json.loads(fpath.read_text())
    for key, value in changes.items():
        if value is None:
            del manifest[key]
        else:
            manifest[key] = value
    fpath.write_text(json.dumps(manifest))


def _append_zeros(fpath: Path) -> None:
    with open(fpath, "ab") as f:
        f.write(b"\0" * 512)


def _flip_last_data_byte(fpath: Path) -> None:
    data = bytearray(fpath.read_bytes())
    pos = max(i for i, b in enumerate(data[:-1024]) if b)  # inside the last member, size unchanged
    data[pos] ^= 0xFF
    fpath.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, verify, named",
    [
        (lambda d: (d / S.MANIFEST_FNAME).unlink(), False, "finalize"),
        (lambda d: (d / S.shard_fname(1)).unlink(), False, S.shard_fname(1)),
        (lambda d: _append_zeros(d / S.shard_fname(2)), False, S.shard_fname(2)),
        (lambda d: _flip_last_data_byte(d / S.shard_fname(0)), True, S.shard_fname(0)),
        (lambda d: _rewrite_manifest(d, dtype="float32"), False, "'dtype'"),
        (lambda d: _rewrite_manifest(d, stats=None), False, "'stats'"),
        (lambda d: _rewrite_manifest(d, schema_version=99), False, "'schema_version'"),
    ],
)
def test_load_manifest_errors_name_the_file(dataset, damage, verify, named):
    dpath = dataset[0]
    damage(dpath)
    with pytest.raises(S.ShardFormatError, match=named) as info:
        S.load_manifest(dpath, verify=verify)
    assert str(dpath) in str(info.value) and "\n" not in str(info.value)


def test_sha_mismatch_is_caught_only_with_verify(dataset):
    dpath = dataset[0]
    _flip_last_data_byte(dpath / S.shard_fname(0))
    S.load_manifest(dpath)  # the cheap check passes: same size
    with pytest.raises(S.ShardFormatError, match="sha256"):
        S.load_manifest(dpath, verify=True)


def test_load_manifest_missing_dir(tmp_path):
    with pytest.raises(S.ShardFormatError, match="not found"):
        S.load_manifest(tmp_path / "nope")


def _member_cuts(fpath: Path) -> dict[str, int]:
    """Byte offsets where a copy could stop: inside a header, inside data, between members."""
    with tarfile.open(fpath) as tar:
        members = tar.getmembers()
    last_end = members[-1].offset_data + (members[-1].size + 511) // 512 * 512
    return {
        "mid_header": members[1].offset + 100,
        "mid_data": members[1].offset_data + 7,
        "between_members": members[2].offset,
        "no_end_marker": last_end,
        "empty": 0,
    }


@pytest.mark.parametrize("where", ["mid_header", "mid_data", "between_members", "no_end_marker", "empty"])
def test_truncated_tar_raises_naming_the_shard(dataset, where):
    dpath, _, manifest = dataset
    fpath = dpath / S.shard_fname(1)
    data = fpath.read_bytes()
    fpath.write_bytes(data[: _member_cuts(fpath)[where]])
    with pytest.raises(S.ShardFormatError, match=S.shard_fname(1)) as info:
        list(R.iter_shard_samples(S.shard_fpaths(dpath, manifest)))
    assert "\n" not in str(info.value)


def test_corrupt_samples_raise_naming_the_key():
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    good = io.BytesIO()
    np.save(good, np.zeros((2, 3), np.float16))
    for sample in [
        {"tokens.npy": b"garbage", "meta.json": b"{}"},
        {"tokens.npy": buf.getvalue(), "meta.json": b"{}"},  # pickled payload: refused, not loaded
        {"tokens.npy": good.getvalue(), "meta.json": b"{not json"},
        {"meta.json": b"{}"},
    ]:
        with pytest.raises(S.ShardFormatError, match="^/x/shard-000003.tar: sample .img7."):  # the shard file first
            R.decode_sample({"__key__": "img7", "__url__": "/x/shard-000003.tar", **sample})


def _failing(samples, exc):
    yield from samples
    raise exc


@pytest.mark.parametrize("exc", [RuntimeError("backbone crashed"), OSError(errno.ENOSPC, "No space left")])
def test_failure_midway_leaves_no_tmp_and_keeps_complete_shards(tmp_path, exc):
    samples = make_samples(6)
    S.write_shard(tmp_path, 0, samples[:3])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(type(exc)):
        S.write_shard(tmp_path, 1, _failing(samples[3:], exc))
    with pytest.raises(type(exc)):  # a failed rewrite of a complete shard keeps the old one
        S.write_shard(tmp_path, 0, _failing(samples[3:], exc))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert S.shard_is_complete(tmp_path, 0) and not S.shard_is_complete(tmp_path, 1)


def test_shard_is_complete_needs_tar_sidecar_and_matching_size(tmp_path):
    samples = make_samples(4)
    S.write_shard(tmp_path, 0, samples[:2])
    S.write_shard(tmp_path, 1, samples[2:])
    assert S.shard_is_complete(tmp_path, 0) and S.shard_is_complete(tmp_path, 1)
    sidecar = S.read_sidecar(tmp_path, 0)
    (tmp_path / "shard-000000.tar").rename(tmp_path / "shard-000000.tar.tmp")  # .tmp only
    (tmp_path / "shard-000001.json").unlink()  # sidecar-less
    (tmp_path / "shard-000002.tar").write_bytes(b"\0" * (sidecar["bytes"] + 512))  # size disagrees
    (tmp_path / "shard-000002.json").write_text(json.dumps({**sidecar, "index": 2}))
    assert not any(S.shard_is_complete(tmp_path, i) for i in range(3))
    (tmp_path / "shard-000002.tar").write_bytes(b"\0" * sidecar["bytes"])
    assert S.shard_is_complete(tmp_path, 2)  # the cheap check is size only, by design


@pytest.mark.parametrize(
    "tokens, match",
    [
        (np.zeros((N_TOKENS, D), np.float32), "float16"),
        (np.zeros(D, np.float16), "shape"),
        (np.zeros((N_TOKENS, D + 1), np.float16), "d="),
        (np.full((N_TOKENS, D), np.inf, np.float16), "inf"),
        (np.full((N_TOKENS, D), np.nan, np.float16), "nan"),
    ],
)
def test_write_shard_rejects_bad_tokens_naming_the_key(tmp_path, tokens, match):
    first = make_samples(1)[0]
    with pytest.raises(ValueError, match=f"bad_key.*{match}"):
        S.write_shard(tmp_path, 0, [first, ("bad_key", tokens, {})])
    assert not any(tmp_path.iterdir())


def test_sidecar_stats_match_numpy(tmp_path):
    samples = make_samples(5)
    sidecar = S.write_shard(tmp_path, 0, samples)
    x = np.concatenate([t for _, t, _ in samples]).astype(np.float64)
    stats = RunningStats.from_json(sidecar["stats"])
    assert sidecar == S.read_sidecar(tmp_path, 0) and sidecar["count"] == 5 and sidecar["n_tokens"] == len(x)
    np.testing.assert_allclose(stats.sum, x.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(stats.sum_sq_norm, (x**2).sum(), rtol=1e-12)


def test_rewrite_crashing_before_its_sidecar_leaves_the_shard_incomplete(tmp_path, monkeypatch):
    samples = make_samples(4)
    S.write_shard(tmp_path, 0, samples[:2])

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left")

    monkeypatch.setattr(W, "write_json_atomic", no_space)
    with pytest.raises(OSError):
        S.write_shard(tmp_path, 0, samples[2:])  # same size as the old tar, different bytes
    assert not S.shard_is_complete(tmp_path, 0)  # the old sidecar must not vouch for the new tar
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    "content, what",
    [
        (b'[{"image_id": "a"', "skipped list is not valid JSON"),
        (b'{"image_id": "a"}', "skipped list must be a JSON list"),
        (b"\xff\xfe", "skipped list is not valid JSON"),
        (b'[{"image_id": 3, "reason": "decode"}]', "skipped list entry 0 field 'image_id' must be a string"),
    ],
)
def test_finalize_reads_a_broken_skipped_list_as_data(tmp_path, content, what):
    """A shard's skipped-N.json is read as data: a truncated or foreign one is a one-line error naming it,
    and the fix (without the sidecar, the rerun redoes the shard and writes the list again)."""
    from feature_extraction.shards.finalize import read_skipped

    fpath = tmp_path / S.skipped_fname(3)
    fpath.write_bytes(b'[{"image_id": "a", "reason": "decode"}]')
    assert read_skipped(fpath, tmp_path, 3) == [{"image_id": "a", "reason": "decode"}]
    fpath.write_bytes(content)
    with pytest.raises(S.ShardFormatError) as info:
        read_skipped(fpath, tmp_path, 3)
    line = str(info.value)
    assert line.startswith(f"{fpath}: {what}") and f"delete it and {tmp_path / S.sidecar_fname(3)}" in line, line
    assert "\n" not in line
