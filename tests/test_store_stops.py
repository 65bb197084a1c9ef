"""A store that has died, then one SIGTERM or Ctrl-C: every command ends within 5 s (issue 43, item 1).

Each command reads or writes a bucket of the real S3 server through the fault proxy
(tests/s3_fixtures.py); the proxy starts refusing every connection while the command is under way,
and the signal is sent once the command is retrying (its "retrying with backoff" line): then it
waits on the dead store, in a DataLoader worker, an upload thread or the `--data.cache` fill. The
retry window is two minutes (`SAE_PIPELINE_STORE_RETRY_SECONDS=120`), so a stop within
`STOP_WITHIN_S` is a wait cut short, not one that ran out. Each ends with 143 / 130 and its one
line, `fit` keeping its last checkpoint. The commands are real processes forked from the fork
server (tests/terminal.py), each in its own process group, as under a terminal.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from s3_fixtures import apply_s3_env
from terminal import Command
from test_s3 import fit_args

from feature_extraction.__main__ import main as extract_main
from feature_extraction.store import location, reset

REPO_DPATH = Path(__file__).resolve().parents[1]
STOP_WITHIN_S = 5.0  # issue 43: a stop during any wait ends the command within 5 s
RETRYING = "retrying with backoff"
HEADS = {signal.SIGTERM: "terminated (SIGTERM): ", signal.SIGINT: "interrupted (Ctrl-C): "}


@pytest.fixture
def store(s3_server, s3_bucket: str, fault_proxy, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN001, ANN201
    """`(url, proxy, env)`: a prefix of a fresh bucket, reached by the commands through the proxy."""
    apply_s3_env(monkeypatch, s3_server, endpoint=fault_proxy.endpoint)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.update(SAE_PIPELINE_STORE_RETRY_SECONDS="120", SAE_PIPELINE_READ_AHEAD="0")  # each shard read in its turn
    yield f"s3://{s3_bucket}/data", fault_proxy, env
    fault_proxy.pass_through()
    reset()


def upload(local: Path, url: str, proxy) -> None:  # noqa: ANN001
    for fpath in sorted(local.iterdir()):
        (location(url) / fpath.name).upload(fpath)
    proxy.reset_counts()  # the request log holds the command's requests only


def requested(proxy, method: str, what: str) -> bool:  # noqa: ANN001
    return any(m == method and what in path for m, path, _ in list(proxy.request_log))


def stop_a_retrying_command(command: Command, proxy, signum: int) -> tuple[int, float, str]:  # noqa: ANN001
    """The store dies now; once the command retries it, `signum`: returns the exit status, the seconds from the
    signal to the exit, and stderr."""
    proxy.refuse()
    command.wait_for(lambda: RETRYING in "".join(command.err), "a retry of the dead store")
    time.sleep(0.5)  # what was read before is used up: the command waits on the store
    start = time.monotonic()
    command.signal(signum)
    status = command.finish()
    return status, time.monotonic() - start, "".join(command.err)


def stop_line(err: str, signum: int) -> str:
    lines = [line for line in err.splitlines() if line.startswith(HEADS[signum])]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0][len(HEADS[signum]) :]


@pytest.fixture
def token_data(store, tmp_path: Path, token_shards) -> str:  # noqa: ANN001
    url, proxy, _ = store
    token_shards(tmp_path / "shards", [6, 5, 7, 4, 6, 5, 8, 6], 16, offset=1)
    upload(tmp_path / "shards", url, proxy)
    return url


@pytest.mark.slow
def test_fit_over_a_dead_store_stops_on_sigterm_keeping_its_checkpoint(store, token_data: str, tmp_path: Path) -> None:
    """A DataLoader worker retries the store; the main process waits for its batch and never reaches a step
    boundary: the stop's line names the checkpoint kept (it was acknowledged, then ignored for the whole window)."""
    _, proxy, env = store
    every = ["--trainer.max_epochs", "-1", "--trainer.max_steps", "100000", "--checkpoint.every_n_train_steps", "2"]
    command = Command(tmp_path, *fit_args(token_data, *every, "--data.num_workers", "1"), env=env)
    ckpt_dpath = tmp_path / "runs" / "batchtopk_digits" / "version_0" / "checkpoints"
    command.wait_for(lambda: (ckpt_dpath / "last.ckpt").exists(), "the first checkpoint")
    status, seconds, err = stop_a_retrying_command(command, proxy, signal.SIGTERM)
    assert status == 143 and seconds < STOP_WITHIN_S, (seconds, err[-3000:])
    line = stop_line(err, signal.SIGTERM)
    last = "runs/batchtopk_digits/version_0/checkpoints/last.ckpt"
    kept = f"stopped without saving; the previous checkpoint is kept: {last} (global step "
    assert line.startswith((kept, f"saved {last} at global step ")), line  # saved: the batch was in hand
    assert line.endswith("; continue with the same command and --ckpt_path last"), line
    step = int(line.split("global step ")[1].split(")")[0].split(";")[0])
    assert torch.load(tmp_path / last, weights_only=True)["global_step"] == step >= 2


def test_a_cache_fill_from_a_dead_store_stops_on_ctrl_c(store, token_data: str, tmp_path: Path) -> None:
    """`--data.cache ram` reads the split in the main process before the first step; fit only records a signal
    until a step boundary, so the fill's wait on the store must end on its own."""
    _, proxy, env = store
    fill = ["--data.cache", "ram", "--data.num_workers", "0", "--trainer.num_sanity_val_steps", "0"]
    command = Command(tmp_path, *fit_args(token_data, *fill, "--trainer.max_steps", "4"), env=env)
    command.wait_for(lambda: requested(proxy, "GET", ".tar"), "the fill's first shard")  # setup reads sidecars only
    status, seconds, err = stop_a_retrying_command(command, proxy, signal.SIGINT)
    assert status == 130 and seconds < STOP_WITHIN_S, (seconds, err[-3000:])
    line = stop_line(err, signal.SIGINT)
    assert line.startswith("stopped without saving, no checkpoint in "), line
    assert not list(tmp_path.rglob("*.ckpt"))


def test_features_over_a_dead_store_stops_on_ctrl_c(store, tmp_path: Path) -> None:
    """The pass's DataLoader workers retry the store; the main process stops at once, then waited for them."""
    from features_fixtures import identity_sae, write_export, write_shards

    url, proxy, env = store
    write_shards(tmp_path / "shards", tmp_path / "images")
    upload(tmp_path / "shards", url, proxy)
    export = write_export(identity_sae(), tmp_path / "export")
    site = tmp_path / "site"
    args = ["features", "--sae", str(export), "--data.source", url, "--out", str(site), "--trainer.accelerator", "cpu"]
    command = Command(tmp_path, *args, "--data.num_workers", "2", env=env)
    command.wait_for(lambda: requested(proxy, "GET", ".tar"), "the check of the first shard")  # before the pass
    status, seconds, err = stop_a_retrying_command(command, proxy, signal.SIGINT)
    assert status == 130 and seconds < STOP_WITHIN_S, (seconds, err[-3000:])
    line = stop_line(err, signal.SIGINT)
    assert line == f"no site written to {site} (nothing was written there); rerun the same command", line
    assert not site.exists()


@pytest.mark.slow
def test_extraction_into_a_dead_store_stops_on_sigterm_and_the_rerun_finishes(store, tmp_path: Path) -> None:
    """Uploads retry the store while the extraction waits for them; the stop does not wait out their retries, nor
    the release of the lock object: the rerun takes that over and uploads what is left."""
    url, proxy, env = store
    rng = np.random.default_rng(0)
    for i in range(12):
        fpath = tmp_path / "images" / f"class{i % 2}" / f"img{i:02d}.png"
        fpath.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)).save(fpath)
    flags = ["--backbone", "vit_tiny", "--pretrained", "false", "--images", str(tmp_path / "images"), "--out", url]
    flags += ["--shard_size", "1", "--batch_size", "1", "--num_workers", "0", "--device", "cpu", "--progress", "false"]
    flags += ["--stage", str(tmp_path / "stage")]
    command = Command(tmp_path, *flags, module="feature_extraction", env=env)
    command.wait_for(lambda: requested(proxy, "PUT", "shard-000000.json"), "the first shard's upload")
    status, seconds, err = stop_a_retrying_command(command, proxy, signal.SIGTERM)
    assert status == 143 and seconds < STOP_WITHIN_S, (seconds, err[-3000:])
    line = stop_line(err, signal.SIGTERM)
    assert line.startswith("finished shards are kept; rerun the same command to resume; s3://"), line
    assert line.endswith(": the store was not answering when the stop came"), line

    proxy.pass_through()
    reset()
    assert (location(url) / ".lock.0-of-1").is_file()  # left: the store did not answer its release
    assert extract_main(flags) == 0  # the lock is taken over (its process is gone), the rest uploaded
    assert (location(url) / "manifest.json").is_file() and not (location(url) / ".lock.0-of-1").is_file()
