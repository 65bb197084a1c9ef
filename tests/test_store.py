"""Shard directories named by URL (`feature_extraction/store/`), without a server: fsspec's memory:// store.

The real S3 server's tests are in `tests/test_s3.py`; these check the parts that do not need one:
URLs never carry or show secrets, the path-like object answers what the shard code asks, the
retry policy (transient failures wait, refusals do not), and the training stream over a store
yields the local stream's batches bit for bit.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
import torch

from feature_extraction.shards.tar_scan import iter_members
from feature_extraction.store import (
    RemotePath,
    StoreError,
    StoreUnavailable,
    client,
    display,
    fetch,
    is_url,
    location,
)
from feature_extraction.store.urls import check_url
from sae_pipeline.data import ActivationDataModule
from sae_pipeline.data.loaders import TrainTokenLoader


def test_urls_are_told_from_paths_and_shown_without_secrets() -> None:
    assert is_url("s3://bucket/prefix") and is_url("memory://x") and not is_url("C:/data") and not is_url("shards")
    assert display("s3://AKIA:secret@bucket/p/shard.tar?X-Amz-Signature=abc") == "s3://bucket/p/shard.tar"
    assert check_url("s3://bucket/prefix/", "--out") == "s3://bucket/prefix"
    for bad in ("s3://AKIA:secret@bucket/p", "s3://bucket/p?X-Amz-Signature=abc"):
        with pytest.raises(StoreError) as caught:
            location(bad)
        assert "secret" not in str(caught.value) and "Signature=abc" not in str(caught.value)
        assert "AWS_ACCESS_KEY_ID" in str(caught.value)
    with pytest.raises(StoreError, match="names no bucket"):
        location("s3://")
    assert isinstance(location("shards"), Path) and isinstance(location("s3://b/p"), RemotePath)


@pytest.fixture
def memory_dir() -> RemotePath:
    return location(f"memory://test-{uuid.uuid4().hex[:8]}/shards")


def test_a_remote_path_answers_like_a_path(memory_dir: RemotePath) -> None:
    obj = memory_dir / "shard-000000.tar"
    assert not memory_dir.is_dir() and not obj.is_file()
    assert obj.write_bytes(b"x" * 1000) and obj.is_file() and obj.stat().st_size == 1000
    assert obj.name == "shard-000000.tar" and obj.suffix == ".tar" and obj.stem == "shard-000000"
    assert obj.parent == memory_dir and obj.with_suffix(".json").name == "shard-000000.json"
    assert str(obj) == memory_dir.url + "/shard-000000.tar"
    assert not obj.write_bytes(b"y", exclusive=True)  # exists: an exclusive create does not replace it
    assert obj.read_bytes() == b"x" * 1000 and obj.fetch() == b"x" * 1000
    (memory_dir / "shard-000000.json").write_text('{"a": 1}')
    assert [p.name for p in memory_dir.glob("*.json")] == ["shard-000000.json"]
    with obj.open("rb") as stream:
        assert stream.seek(0, 2) == 1000
    with pytest.raises(StoreError, match="not found in the store"):
        (memory_dir / "missing.tar").read_bytes()


def test_a_large_object_arrives_whole_in_ranged_parts(memory_dir: RemotePath, monkeypatch) -> None:
    monkeypatch.setattr(fetch, "PART_BYTES", 1000)
    data = bytes(range(256)) * 37  # 9472 bytes: 10 parts, the last one short
    (memory_dir / "big.tar").write_bytes(data)
    assert fetch.ranged_get(memory_dir / "big.tar") == data
    fetch.plan([memory_dir / "big.tar"])
    assert (memory_dir / "big.tar").fetch() == data  # from the read-ahead


class _Flaky:
    """Fails ``n`` times with ``error``, then returns "done"."""

    def __init__(self, n: int, error: BaseException) -> None:
        self.n, self.error, self.calls = n, error, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.n:
            raise self.error
        return "done"


def test_transient_failures_are_retried_and_logged_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(client.stop_flag, "sleep", lambda seconds, where="": None)  # no backoff
    monkeypatch.setattr(client, "_logged", set())
    flaky = _Flaky(3, ConnectionResetError("peer reset"))
    with caplog.at_level(logging.WARNING, "feature_extraction.store"):
        assert client.call("s3://b/p/x", "reading the object", flaky) == "done"
        assert client.call("s3://b/p/x", "reading the object", _Flaky(2, ConnectionResetError())) == "done"
    assert flaky.calls == 4
    assert len(caplog.records) == 1 and "retrying with backoff" in caplog.records[0].getMessage()
    slow_down = OSError("An error occurred (SlowDown) when calling GetObject: reduce your request rate")
    assert client.call("s3://b/p/x", "reading the object", _Flaky(2, slow_down)) == "done"


def test_refusals_are_one_line_at_once_and_spent_retries_too(monkeypatch) -> None:
    monkeypatch.setattr(client.stop_flag, "sleep", lambda seconds, where="": None)  # no backoff
    denied = _Flaky(1, PermissionError("SignatureDoesNotMatch: StringToSign AKIASECRET"))
    with pytest.raises(StoreError) as caught:
        client.call("s3://b/p/x", "reading the object", denied)
    assert denied.calls == 1 and "AKIASECRET" not in str(caught.value) and "AWS_SECRET_ACCESS_KEY" in str(caught.value)
    with pytest.raises(StoreError, match="bucket does not exist"):
        client.call(
            "s3://b/p/x", "reading the object", _Flaky(1, FileNotFoundError("The specified bucket does not exist"))
        )
    monkeypatch.setenv(client.RETRY_ENV, "0")
    with pytest.raises(StoreUnavailable, match="did not answer for 0 s"):  # a runtime failure (exit 1), not bad input
        client.call("s3://b/p/x", "reading the object", _Flaky(5, TimeoutError()))


def _batches(source: str, workers: int, epoch: int) -> list[dict]:
    dm = ActivationDataModule(
        source, batch_size=8, num_workers=workers, shuffle_buffer_tokens=32, val_fraction=0.2, seed=3
    )
    dm.setup("fit")
    return list(TrainTokenLoader(dm.train_dataset(0, 1), num_workers=workers, epoch_fn=lambda: epoch))


@pytest.mark.parametrize("workers", [0, 2])
def test_the_stream_over_a_store_equals_the_local_stream(tmp_path, token_shards, memory_dir, workers) -> None:
    token_shards(tmp_path, [6, 5, 7, 4, 6, 5], 16, seed=workers)
    for fpath in sorted(tmp_path.iterdir()):
        (memory_dir / fpath.name).upload(fpath)
    for epoch in (0, 1):
        local, remote = _batches(str(tmp_path), workers, epoch), _batches(memory_dir.url, workers, epoch)
        assert len(local) == len(remote) > 0
        assert all(torch.equal(a["x"], b["x"]) for a, b in zip(local, remote))
    assert remote[0]["shards"][0].startswith(memory_dir.url + "/shard-")


def test_a_corrupt_object_is_refused_by_its_sample_checksum(tmp_path, token_shards, memory_dir) -> None:
    token_shards(tmp_path, [4, 4, 4], 16)
    for fpath in sorted(tmp_path.iterdir()):
        data = bytearray(fpath.read_bytes())
        if fpath.name == "shard-000000.tar":  # a training shard (shard 1 is held out for validation)
            with open(fpath, "rb") as stream:
                offset, size = next((o, n) for name, o, n in iter_members(stream, fpath) if name.endswith("tokens.npy"))
            data[offset + size - 1] ^= 0xFF  # the last byte of the first sample's tokens
        (memory_dir / fpath.name).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="shard-000000.tar.*does not match its checksum"):
        _batches(memory_dir.url, 0, 0)
