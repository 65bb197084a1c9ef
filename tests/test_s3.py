"""Shards in a real S3 server (SeaweedFS on loopback): the training stream, faults, commands and DDP over a bucket.

Every test here reads objects that a real S3 server holds, over HTTP, with the product's own
client (s3fs under `feature_extraction/store/`). Faults are real: a proxy that answers 503 or
cuts responses, a server stopped mid-read and started again, keys the server refuses.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import fork_server
import pytest
import torch
from fault_proxy import FaultProxy
from s3_fixtures import apply_s3_env, new_bucket_name

from feature_extraction.store import location, reset
from sae_pipeline.data import ActivationDataModule, open_source
from sae_pipeline.data.loaders import TrainTokenLoader

REPO_DPATH = Path(__file__).resolve().parents[1]
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
COUNTS = [6, 5, 7, 4, 6, 5, 8, 6]
D = 16


def upload(local: Path, url: str) -> None:
    remote = location(url)
    for fpath in sorted(local.iterdir()):
        (remote / fpath.name).upload(fpath)


def batches(source: str, workers: int = 0, epoch: int = 0, on_batch=None) -> list[torch.Tensor]:  # noqa: ANN001
    dm = ActivationDataModule(
        source, batch_size=8, num_workers=workers, shuffle_buffer_tokens=32, val_fraction=0.2, seed=1
    )
    dm.setup("fit")
    out = []
    for batch in TrainTokenLoader(dm.train_dataset(0, 1), num_workers=workers, epoch_fn=lambda: epoch):
        out.append(batch["x"])
        if on_batch is not None:
            on_batch(len(out))
    return out


def assert_equal_streams(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) > 0
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def shards(tmp_path: Path, token_shards) -> Path:
    dpath = tmp_path / "shards"
    token_shards(dpath, COUNTS, D, offset=1)
    return dpath


@pytest.fixture(autouse=True)
def fresh_clients(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Each test reads the environment it set; a failure waits seconds, not the default two minutes."""
    monkeypatch.setenv("SAE_PIPELINE_STORE_RETRY_SECONDS", "30")
    reset()
    yield
    reset()


def test_the_stream_from_a_bucket_equals_the_local_one(shards: Path, s3_bucket: str, s3_env) -> None:
    url = f"s3://{s3_bucket}/tiny/shards"
    upload(shards, url)
    for workers in (0, 2):
        assert_equal_streams(batches(str(shards), workers, 1), batches(url, workers, 1))


def test_503_and_cut_connections_are_retried_and_logged_once(
    shards: Path, s3_bucket: str, s3_server, fault_proxy: FaultProxy, monkeypatch, caplog
) -> None:
    apply_s3_env(monkeypatch, s3_server)
    url = f"s3://{s3_bucket}/shards"
    upload(shards, url)
    local = batches(str(shards))
    apply_s3_env(monkeypatch, s3_server, endpoint=fault_proxy.endpoint)
    reset()
    with caplog.at_level(logging.WARNING, "feature_extraction.store"):
        fault_proxy.status(503, times=3)
        assert_equal_streams(local, batches(url))
        fault_proxy.drop_after(700, times=2)  # cut inside a shard's bytes
        assert_equal_streams(local, batches(url))
    assert fault_proxy.injected >= 5
    warnings = [r.getMessage() for r in caplog.records]
    assert 1 <= len(warnings) <= 2 and all("retrying with backoff" in w for w in warnings)  # one per kind of fault
    assert s3_server.secret_key not in caplog.text


def test_a_server_stopped_mid_read_and_restarted_does_not_end_the_epoch(
    shards: Path, s3_private_server, monkeypatch
) -> None:
    apply_s3_env(monkeypatch, s3_private_server)
    monkeypatch.setenv("SAE_PIPELINE_READ_AHEAD", "0")  # each shard is fetched when its turn comes
    bucket = s3_private_server.make_bucket(new_bucket_name())
    url = f"s3://{bucket}/shards"
    upload(shards, url)
    local = batches(str(shards))
    first_batch, resume, result = threading.Event(), threading.Event(), {}

    def outage(n: int) -> None:
        if n == 1:  # after the first batch, while shards are still to be fetched: the reader waits for the server
            first_batch.set()
            resume.wait(60)

    def read() -> None:
        try:
            result["batches"] = batches(url, on_batch=outage)
        except Exception as exn:  # noqa: BLE001 (reported below)
            result["error"] = exn

    reader = threading.Thread(target=read)
    reader.start()
    assert first_batch.wait(60)
    s3_private_server.kill()  # from this thread: the server dies with the thread that started it
    resume.set()  # the reader's next fetches fail ...
    time.sleep(2.0)
    s3_private_server.start()  # ... until the server is back
    reader.join(120)
    assert "error" not in result, result.get("error")
    assert_equal_streams(local, result["batches"])


def run_cli(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {}), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return fork_server.run([sys.executable, "-m", "sae_pipeline", *args], cwd=cwd, env=env, timeout=600)


def fit_args(source: str, *extra: str) -> list[str]:
    return [
        "fit",
        "--config",
        str(REPO_DPATH / "configs" / "batchtopk_digits.yaml"),
        "--data.source",
        source,
        "--data.batch_size",
        "8",
        "--data.shuffle_buffer_tokens",
        "32",
        "--data.val_fraction",
        "0.25",
        "--model.sae.init_args.d_sae",
        "32",
        "--model.sae.init_args.k",
        "4",
        "--trainer.accelerator",
        "cpu",
        "--figures.every_n_val_epochs",
        "100",
        *extra,
        *QUIET,
    ]


def refusal(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def test_bad_keys_unknown_bucket_and_missing_object_are_one_line_each(
    shards: Path, s3_bucket: str, s3_server, s3_env, tmp_path: Path
) -> None:
    url = f"s3://{s3_bucket}/shards"
    upload(shards, url)
    line = refusal(run_cli(fit_args(url, "--trainer.max_steps", "1"), tmp_path, {"AWS_SECRET_ACCESS_KEY": "wrong"}))
    assert "refused the credentials" in line and "wrong" not in line and s3_server.secret_key not in line
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.ckpt"))
    # the same error path (a ValueError's one line, exit 2) in process, for the other refusals: seconds, not a fit each
    with pytest.raises(ValueError, match="bucket does not exist") as caught:
        open_source(f"s3://no-such-{s3_bucket}/shards")
    assert str(caught.value).count("\n") == 0
    location(url + "/shard-000002.tar").unlink()
    reset()
    with pytest.raises(ValueError, match=f"{url}/shard-000002.tar: listed in manifest.json .* but missing"):
        open_source(url)


@pytest.mark.slow
def test_ddp_over_a_bucket_trains_the_weights_of_ddp_over_the_local_copy(
    shards: Path, s3_bucket: str, s3_env, tmp_path: Path
) -> None:
    """2 gloo ranks x 1 worker split the bucket's shards; the checkpoint equals the local run's, tensor for tensor."""
    url = f"s3://{s3_bucket}/shards"
    upload(shards, url)
    weights = []
    for name, source in (("local", str(shards)), ("bucket", url)):
        cwd = tmp_path / name
        cwd.mkdir()
        ddp = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.max_epochs", "2"]
        result = run_cli(fit_args(source, *ddp, "--data.num_workers", "1"), cwd)
        assert result.returncode == 0, result.stderr[-3000:]
        ckpt = torch.load(
            cwd / "runs" / "batchtopk_digits" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True
        )
        weights.append(ckpt["state_dict"])
        if name == "bucket":
            config = (cwd / "runs" / "batchtopk_digits" / "version_0" / "config.yaml").read_text()
            assert url in config and os.environ["AWS_SECRET_ACCESS_KEY"] not in config
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_no_credentials_at_all_names_them(s3_bucket: str, s3_env, monkeypatch, tmp_path: Path) -> None:
    """No key variables, no profile, no config or credentials file (HOME empty): reading and writing a bucket
    end with one line naming what to set (today's line said "failed (NoCredentialsError)")."""
    url = f"s3://{s3_bucket}/shards"
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask for on this machine
    reset()
    with pytest.raises(ValueError) as caught:
        open_source(url)
    line = str(caught.value)
    assert line.startswith(f"{url}: no AWS credentials found (") and "\n" not in line, line
    assert "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE" in line
    with pytest.raises(ValueError, match=f"^{url}/x: no AWS credentials found .*; set AWS_ACCESS_KEY_ID"):
        location(url + "/x").write_bytes(b"x")
