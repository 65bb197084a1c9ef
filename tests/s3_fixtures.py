"""pytest fixtures for tests against a real S3 server (SeaweedFS, tests/s3_server.py).

A test module loads them as a pytest plugin (importing the fixture functions by name would
trip ruff's F811 at every test that takes one as an argument); plain helpers it imports:

    from s3_fixtures import apply_s3_env     # helpers, when needed
    pytest_plugins = ["s3_fixtures"]

    def test_reads_from_a_bucket(s3_bucket, s3_env):
        url = f"s3://{s3_bucket}/shards"     # the process env now points at the server

- `s3_server`: one `SeaweedS3` for the whole session, started at first use (~2.5 s) and stopped
  when pytest ends (kept in the session's `config.stash`: one server, however the fixture is
  reached). Never stop or restart it in a test: use `s3_private_server` for that.
- `s3_private_server`: a `SeaweedS3` of the test's own (its data in the test's tmp_path),
  started (~2.5 s), and stopped after the test (~1 s): for faults that stop, kill or restart it.
- `s3_bucket`: a fresh bucket name on `s3_server` (created; deleted with its objects afterwards).
- `s3_env`: the AWS variables for `s3_server` set with monkeypatch (subprocesses inherit them),
  the developer's own profile and config files out of the way, s3fs's instance cache cleared;
  returns the dict it set.
- `fault_proxy`: a `FaultProxy` in front of `s3_server` (tests/fault_proxy.py), closed afterwards.
  For a proxy in front of a private server, build one: `FaultProxy(s3_private_server.endpoint)`.
- `apply_s3_env(monkeypatch, server, endpoint=None)`: what `s3_env` does, for a private server
  or a proxy (`endpoint`).
"""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_proxy import FaultProxy
from s3_server import SeaweedS3, require_weed

_SHARED = pytest.StashKey[SeaweedS3]()
_BUCKET_NUMBERS = itertools.count()

# Variables that would make botocore use other credentials, another endpoint or the developer's files.
AWS_VARIABLES_CLEARED = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ROLE_ARN",
    "AWS_ROLE_SESSION_NAME",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_ENDPOINT_URL_S3",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
    "AWS_REGION",
    "AWS_CA_BUNDLE",
)


def clear_s3fs_cache() -> None:
    """fsspec reuses an `S3FileSystem` made with the same arguments, whatever the environment says now; the
    product's store keeps one filesystem and its listings per process too (`feature_extraction.store.reset`)."""
    from feature_extraction.store import reset

    reset()
    try:
        import s3fs
    except ImportError:
        return
    s3fs.S3FileSystem.clear_instance_cache()


def apply_s3_env(monkeypatch: pytest.MonkeyPatch, server: SeaweedS3, endpoint: str | None = None) -> dict[str, str]:
    """Point the AWS environment at `server` (through `endpoint`, e.g. a FaultProxy, when given)."""
    for name in AWS_VARIABLES_CLEARED:
        monkeypatch.delenv(name, raising=False)
    env = {**server.env, "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    if endpoint is not None:
        env["AWS_ENDPOINT_URL"] = endpoint
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    clear_s3fs_cache()
    return env


def new_bucket_name(prefix: str = "test") -> str:
    """A valid bucket name (lowercase, digits, `-`; 3-63 characters) no other test uses."""
    return f"{prefix}-{next(_BUCKET_NUMBERS)}-{secrets.token_hex(4)}"


@pytest.fixture(scope="session")
def s3_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SeaweedS3:
    """The session's shared SeaweedFS (skips, or fails in CI, without `weed`)."""
    require_weed()
    config = request.config
    server = config.stash.get(_SHARED, None)
    if server is None:
        server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
        config.stash[_SHARED] = server
        config.add_cleanup(server.stop)
    if not server.running:
        server.start()
    return server


@pytest.fixture
def s3_private_server(tmp_path: Path) -> Iterator[SeaweedS3]:
    """A SeaweedFS of this test's own, which the test may stop, kill and restart."""
    require_weed()
    server = SeaweedS3(tmp_path / "seaweedfs")
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: SeaweedS3) -> Iterator[str]:
    """A fresh, empty bucket on the shared server; deleted with what it holds after the test."""
    name = s3_server.make_bucket(new_bucket_name())
    yield name
    if s3_server.running:
        s3_server.delete_bucket(name)


@pytest.fixture
def s3_env(s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The shared server's AWS variables in `os.environ` for this test."""
    yield apply_s3_env(monkeypatch, s3_server)
    clear_s3fs_cache()


@pytest.fixture
def fault_proxy(s3_server: SeaweedS3) -> Iterator[FaultProxy]:
    """A FaultProxy in front of the shared server (starts in pass-through mode)."""
    with FaultProxy(s3_server.endpoint) as proxy:
        yield proxy
