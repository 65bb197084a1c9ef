"""Extraction into an object store (`--out s3://bucket/prefix`) against a real S3 server (SeaweedFS on loopback).

The bucket's shards and manifest equal a local extraction's; a rerun resumes from the whole objects (a tar
without its sidecar, or of the wrong size, is redone; a staged shard not yet uploaded is uploaded, not
recomputed); a process killed with SIGKILL mid-upload resumes to the same set; the lock object refuses a
second writer and is taken over from a dead one; the tasks of an array job each upload their own shards and
the last writes the manifest; nothing secret reaches an object, a log or an error line.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import fork_server
import numpy as np
import pytest
from PIL import Image

from feature_extraction import shards as S
from feature_extraction.__main__ import main
from feature_extraction.extract import extract
from feature_extraction.remote_out import default_stage
from feature_extraction.stage_lease import LEASE_FNAME, StageLease
from feature_extraction.store import client, location, remote

REPO_DPATH = Path(__file__).resolve().parents[1]
BACKBONE = "vit_tiny"
OPTIONS = dict(backbone=BACKBONE, shard_size=3, batch_size=2, num_workers=0, device="cpu", progress=False)

pytest_plugins = ["s3_fixtures"]  # s3_server (SeaweedFS, shared by the session), s3_bucket, s3_env


@pytest.fixture(autouse=True)
def fresh_store_client():
    """The store client caches one filesystem and its listings per process: another test's server must not leak in."""
    client._filesystems.clear()
    remote._listings.clear()
    yield
    client._filesystems.clear()
    remote._listings.clear()


def make_images(root: Path, n: int, size: int = 48) -> Path:
    """`n` random RGB PNGs in two class folders."""
    rng = np.random.default_rng(0)
    for i in range(n):
        fpath = root / f"class{i % 2}" / f"img{i:03d}.png"
        fpath.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(fpath)
    return root


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("images"), 10)


@pytest.fixture(scope="module")
def reference(images, tmp_path_factory) -> Path:
    """A local extraction of the same images, settings and weights: what the bucket must hold."""
    out = tmp_path_factory.mktemp("reference") / "shards"
    extract(images=str(images), out=str(out), **OPTIONS)
    return out


def without_time(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k != "created_at"}


def objects(url: str) -> dict[str, bytes]:
    """Every object under the prefix, by name."""
    prefix = location(url)
    prefix.refresh()
    return {p.name: p.read_bytes() for p in prefix.iterdir()}


def assert_same_shards(url: str, reference: Path) -> None:
    """The bucket holds the reference's shards byte for byte and a manifest equal to its own (but the time)."""
    manifest = S.load_manifest(url, verify=True)
    assert without_time(manifest) == without_time(S.load_manifest(reference))
    stored = objects(url)
    for fpath in sorted(reference.glob("shard-*")):
        assert stored[fpath.name] == fpath.read_bytes(), fpath.name


def run(images: Path, url: str, stage: Path, **kwargs) -> dict:
    return extract(images=str(images), out=url, stage=str(stage), **(OPTIONS | kwargs))


def test_extract_to_bucket_equals_local(images, reference, s3_bucket, s3_env, tmp_path, caplog) -> None:
    url = f"s3://{s3_bucket}/vit"
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="feature_extraction")
    summary = run(images, url, tmp_path / "stage")
    assert summary["finalized"] and summary["out"] == url
    assert_same_shards(url, reference)
    names = set(objects(url))
    assert not any(name.startswith(".lock") or name.startswith(".finalize") for name in names), names
    assert not (tmp_path / "stage").exists()  # every staged shard is in the bucket: the stage is removed
    secret = s3_env["AWS_SECRET_ACCESS_KEY"]
    assert not any(secret.encode() in data for data in objects(url).values())
    assert secret not in caplog.text and s3_env["AWS_ACCESS_KEY_ID"] not in caplog.text
    assert json.loads(objects(url)[S.EXTRACTION_FNAME])["images"] == str(images)

    stage = tmp_path / "stage"
    with StageLease(stage):  # another task of this host stages there meanwhile: the folder stays for it
        again = run(images, url, stage)  # a rerun of a finished bucket writes nothing
        assert sorted(p.name for p in stage.iterdir()) == [LEASE_FNAME, S.EXTRACTION_FNAME]
    assert again["shards_written"] == [] and again["shards_already_complete"] == 4 and again["finalized"]
    (stage / "notes.txt").write_text("someone's")  # a --stage holding other files is never removed whole
    run(images, url, stage)
    assert (stage / "notes.txt").read_text() == "someone's"


def test_uploads_through_503s_and_cut_connections_are_retried(
    images, reference, s3_bucket, s3_server, fault_proxy, monkeypatch, tmp_path
) -> None:
    """The store answers 503 to the first uploads and cuts a later one: the extraction retries and ends whole."""
    from s3_fixtures import apply_s3_env

    apply_s3_env(monkeypatch, s3_server, endpoint=fault_proxy.endpoint)
    client._filesystems.clear()
    url = f"s3://{s3_bucket}/vit"
    fault_proxy.status(503, times=4)
    summary = run(images, url, tmp_path / "stage")
    assert summary["finalized"] and fault_proxy.injected == 4
    apply_s3_env(monkeypatch, s3_server)
    client._filesystems.clear()
    remote._listings.clear()
    assert_same_shards(url, reference)


def test_resume_redoes_what_is_not_whole(images, reference, s3_bucket, s3_env, tmp_path) -> None:
    """A tar without its sidecar, a tar of the wrong size and a missing shard are redone; a staged shard is uploaded."""
    url, stage = f"s3://{s3_bucket}/vit", tmp_path / "stage"
    run(images, url, stage)
    prefix = location(url)
    (prefix / S.MANIFEST_FNAME).unlink()
    (prefix / S.sidecar_fname(0)).unlink()  # killed between the tar's upload and its sidecar's
    (prefix / S.shard_fname(1)).write_bytes(b"half a tar")  # a stale sidecar beside another tar
    stage.mkdir()  # removed after the first run's uploads; staged again as a run killed before its upload leaves it
    for name in (S.shard_fname(2), S.sidecar_fname(2)):  # written and staged, killed before its upload
        (prefix / name).unlink()
    for name in (S.shard_fname(2), S.sidecar_fname(2), S.EXTRACTION_FNAME):
        (stage / name).write_bytes((reference / name).read_bytes())
    summary = run(images, url, stage)
    assert summary["shards_written"] == [0, 1] and summary["shards_already_complete"] == 2 and summary["finalized"]
    assert_same_shards(url, reference)
    assert not list(stage.glob("*.tar"))


def test_tasks_upload_their_own_shards_and_the_last_finalizes(images, reference, s3_bucket, s3_env, tmp_path) -> None:
    url = f"s3://{s3_bucket}/vit"
    first = run(images, url, tmp_path / "a", task_index=1, num_tasks=2)
    assert first["shards_written"] == [1, 3] and not first["finalized"]
    assert not location(url + "/" + S.MANIFEST_FNAME).is_file()
    second = run(images, url, tmp_path / "b", task_index=0, num_tasks=2)
    assert second["shards_written"] == [0, 2] and second["finalized"]
    assert_same_shards(url, reference)


def argv(images: Path, url: str, stage: Path) -> list[str]:
    return [
        "--backbone",
        BACKBONE,
        "--images",
        str(images),
        "--out",
        url,
        "--stage",
        str(stage),
        "--shard_size",
        "3",
        "--batch_size",
        "2",
        "--num_workers",
        "0",
        "--device",
        "cpu",
        "--progress",
        "false",
    ]


def lock_record(pid: int) -> bytes:
    return json.dumps(
        {
            "pid": pid,
            "host": socket.gethostname(),
            "started": "2026-01-01 00:00:00 UTC",
            "command": "extract",
            "slurm_job_id": None,
            "slurm_restart_count": 0,
            "token": "x",
        }
    ).encode()


def test_lock_object_refuses_a_live_writer_and_takes_over_a_dead_one(
    images, reference, s3_bucket, s3_env, tmp_path, capsys
) -> None:
    url = f"s3://{s3_bucket}/vit"
    lock = location(f"{url}/.lock.0-of-1")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        lock.write_bytes(lock_record(sleeper.pid))
        assert main(argv(images, url, tmp_path / "stage")) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith(f"error: --out {url} is being written by pid {sleeper.pid} on host")
        assert err.endswith(f"wait for it to finish, or delete {url}/.lock.0-of-1 if that process is gone")
        assert sorted(objects(url)) == [".lock.0-of-1"]  # refused before anything was written
    finally:
        sleeper.kill()
        sleeper.wait()
    assert main(argv(images, url, tmp_path / "stage")) == 0  # its holder is gone: taken over
    assert ".lock.0-of-1" not in objects(url)  # and released at the end
    assert_same_shards(url, reference)


def test_finalize_a_bucket(images, reference, s3_bucket, s3_env, tmp_path, capsys) -> None:
    url = f"s3://{s3_bucket}/vit"
    run(images, url, tmp_path / "stage")
    prefix = location(url)
    (prefix / S.MANIFEST_FNAME).unlink()
    tar = bytearray((reference / S.shard_fname(1)).read_bytes())
    tar[-2048] ^= 1  # same size: only reading it finds the flipped bit
    (prefix / S.shard_fname(1)).write_bytes(bytes(tar))
    assert main(["finalize", "--out", url]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{url}: shard 1 no longer matches its sidecar" in err
    assert f"--out {url}" in err  # the repair command names the bucket
    (prefix / ".finalize.lock").write_bytes(json.dumps({"time": time.time()}).encode())
    assert main(["finalize", "--out", url, "--verify", "false"]) == 1 and "--force true" in capsys.readouterr().err
    assert main(["finalize", "--out", url, "--verify", "false", "--force", "true"]) == 0  # sizes agree
    assert S.load_manifest(url)["shards"] == S.load_manifest(reference)["shards"]
    assert ".finalize.lock" not in objects(url)
    # the advice, followed: a rerun trusts a bucket's shards, so it starts with deleting the sidecar
    first, rerun = err.split("; ", 1)[1].split("rerun `", 1)
    assert first == f"delete the damaged shard's sidecar (shard-NNNNNN.json) from {url}, then "
    (prefix / S.sidecar_fname(1)).unlink()
    command = [*shlex.split(rerun.split("`", 1)[0])[3:], "--stage", str(tmp_path / "stage")]
    assert main([*command, "--batch_size", "2", "--num_workers", "0", "--device", "cpu", "--progress", "false"]) == 0
    assert main(["finalize", "--out", url]) == 0
    assert objects(url)[S.shard_fname(1)] == (reference / S.shard_fname(1)).read_bytes()


def test_bad_urls_are_one_line(images, s3_env, tmp_path, capsys) -> None:
    secret = "wJalrXUtnFEMIK7MDENGbPxRfiCYzEXAMPLEKEY"
    assert main(argv(images, f"s3://AKIDEXAMPLE:{secret}@shards/vit", tmp_path / "stage")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "credentials or signatures do not go in the URL" in err and secret not in err
    assert not (tmp_path / "stage").exists()


N_KILLED = 30  # images, one per shard: the uploads lag the writers by several shards when the kill lands


@pytest.mark.slow
def test_resume_after_sigkill_mid_upload(s3_bucket, s3_env, tmp_path) -> None:
    """SIGKILL once the first shard is in the bucket; the rerun completes it to what a clean extraction writes."""
    images = make_images(tmp_path / "images", N_KILLED, size=64)
    url, stage = f"s3://{s3_bucket}/vit", tmp_path / "stage"
    command = [sys.executable, "-m", "feature_extraction", *argv(images, url, stage)]
    command[command.index("--shard_size") + 1] = "1"
    status, stderr = start_and_stop_after_first_upload(command, url, signal.SIGKILL)
    assert status == -signal.SIGKILL, stderr[-2000:]
    bucket = location(url)
    bucket.refresh()
    in_bucket = [i for i in range(N_KILLED) if S.shard_is_complete(bucket, i)]
    assert 1 <= len(in_bucket) < N_KILLED and not (bucket / S.MANIFEST_FNAME).is_file()  # really interrupted

    summary = run(images, url, stage, shard_size=1)
    assert summary["finalized"] and summary["shards_already_complete"] >= len(in_bucket)
    assert not set(summary["shards_written"]) & set(in_bucket)
    reference = tmp_path / "reference"
    extract(images=str(images), out=str(reference), **(OPTIONS | {"shard_size": 1}))
    manifest = S.load_manifest(url, verify=True)
    assert [e["sha256"] for e in manifest["shards"]] == [e["sha256"] for e in S.load_manifest(reference)["shards"]]
    assert without_time(manifest) == without_time(S.load_manifest(reference))
    assert not list(stage.glob("*.tar")) and not list(stage.glob("*.tmp"))


def start_and_stop_after_first_upload(command: list[str], url: str, sig: int) -> tuple[int, str]:
    """Run `command`, send `sig` once a shard's sidecar is in the bucket; returns the exit status and stderr.

    The command is a process of its own that gets the real signal, forked from the test's fork server
    (tests/fork_server.py, as tests/test_interrupts.py signals `fit`): what is tested is how the running extraction
    stops, not an interpreter's start."""
    process = fork_server.popen(command, cwd=REPO_DPATH)
    bucket = location(url)
    deadline = time.time() + 120
    while process.poll() is None and time.time() < deadline:
        bucket.refresh()
        if any(p.name.endswith(".json") and p.name.startswith("shard-") for p in bucket.iterdir()):
            break
        time.sleep(0.01)
    process.send_signal(sig)
    _, stderr = process.communicate()
    return process.returncode, stderr


@pytest.mark.slow
def test_sigterm_releases_the_lock_object(s3_bucket, s3_env, tmp_path) -> None:
    images = make_images(tmp_path / "images", N_KILLED, size=64)
    url = f"s3://{s3_bucket}/vit"
    command = [sys.executable, "-m", "feature_extraction", *argv(images, url, tmp_path / "stage")]
    command[command.index("--shard_size") + 1] = "1"
    status, stderr = start_and_stop_after_first_upload(command, url, signal.SIGTERM)
    assert status == 143, stderr[-2000:]
    stop = "terminated (SIGTERM): finished shards are kept; rerun the same command to resume"
    assert stderr.strip().splitlines()[-1] == stop, stderr[-2000:]
    names = set(objects(url))
    assert ".lock.0-of-1" not in names and S.MANIFEST_FNAME not in names  # released; really interrupted
    assert S.EXTRACTION_FNAME in names and any(name.startswith("shard-") for name in names)  # finished shards kept


def test_default_stage_is_per_url() -> None:
    a, b = location("s3://shards/a", "--out"), location("s3://shards/b", "--out")
    assert default_stage(a) == default_stage(location("s3://shards/a/", "--out")) != default_stage(b)
    assert default_stage(a).name.startswith("sae-pipeline-stage-") and len(default_stage(a).name) == 19 + 12
    assert os.path.dirname(default_stage(a)) == __import__("tempfile").gettempdir()


def test_a_full_stage_is_one_line_and_the_rerun_resumes_from_the_bucket(
    images, reference, s3_bucket, s3_env, tmp_path, capsys
) -> None:
    """Issue 43, item 4: a --stage whose disk fills up is one line naming the stage, what the bucket keeps and the
    room a stage needs, exit 2 (it said the shards were kept in the stage, which holds none of them); a rerun with
    room finishes from the bucket."""
    from test_disk_full import tmpfs

    url = f"s3://{s3_bucket}/vit"
    with tmpfs(tmp_path / "stage", "64k") as stage:  # room for a sidecar or two, not for a shard's tar
        assert main(argv(images, url, stage)) == 2
        err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(f"error: --stage {stage} is full (") and " MiB free): " in lines[0], lines[0]
    assert f"no space left on device writing {stage / 'shard-'}" in lines[0], lines[0]
    kept = f"; kept: the shards uploaded to {url} and the complete ones staged (a rerun skips or uploads them; "
    assert kept + "the partial shard was removed); " in lines[0], lines[0]
    fix = r"pass --stage DIR on a disk with room for about \d+ shards \(--num_writers \+ \d+\), or free space there"
    assert re.search(fix + ", and rerun the same command$", lines[0]), lines[0]
    assert S.MANIFEST_FNAME not in objects(url)
    assert main(argv(images, url, tmp_path / "roomy")) == 0
    assert_same_shards(url, reference)
