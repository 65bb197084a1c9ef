"""One writer per output (feature_extraction/output_lock.py): a second writer is refused in one line naming the
holder, a dead holder's lock is taken over, and the lock goes away however the holder ends."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
from in_process import QUIET, error_lines, fit_in, run
from PIL import Image
from terminal import Command

from feature_extraction.__main__ import main as extract_main
from feature_extraction.atomic_files import DiskFullError
from feature_extraction.output_lock import OutputLocked, lock_fpath, output_lock
from sae_pipeline.run_lock import RunLocks

REPO_DPATH = Path(__file__).resolve().parents[1]
TOPK_DIGITS = str(REPO_DPATH / "configs" / "topk_digits.yaml")
HOST = socket.gethostname()
# A process that holds the lock of argv[1] under the commands' own stop handling until it is stopped.
HOLDER = """
import sys, time
from feature_extraction.exit_status import run_command
from feature_extraction.output_lock import output_lock

def hold():
    with output_lock(sys.argv[1], "extract", part=(0, 1)):
        print("held", flush=True)
        time.sleep(120)

sys.exit(run_command(hold, interrupted="stopped")[0])
"""


def dead_pid() -> int:
    process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(process.stdout)


def write_lock(fpath: Path, **holder: object) -> dict:
    record = {"pid": 1, "host": HOST, "started": "2026-01-01 00:00:00 UTC", "command": "extract", **holder}
    fpath.parent.mkdir(parents=True, exist_ok=True)
    fpath.write_text(json.dumps(record))
    return record


def start_holder(out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_DPATH), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "held", process.stderr.read()
    return process


def test_a_second_writer_is_refused_naming_the_holder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with output_lock(out, "extract") as fpath:
        assert fpath == out / ".lock"
        with pytest.raises(OutputLocked) as info, output_lock(out, "export"):
            pass
    line = str(info.value)
    assert f"--out {out} is being written by pid {os.getpid()} on host {HOST} since " in line
    assert f"(extract); wait for it to finish, or delete {out / '.lock'} if that process is gone" in line
    assert "\n" not in line
    assert not out.exists()  # the folder the lock created is removed with it


def test_the_lock_of_a_dead_process_is_taken_over(tmp_path: Path) -> None:
    stale = write_lock(tmp_path / "out" / ".lock", pid=dead_pid())
    with output_lock(tmp_path / "out", "extract") as fpath:
        holder = json.loads(fpath.read_text())
        assert holder["pid"] == os.getpid() and holder != stale
    assert list((tmp_path / "out").iterdir()) == []


def test_a_holder_on_another_host_is_refused_with_the_manual_fix(tmp_path: Path) -> None:
    write_lock(tmp_path / "out" / ".lock", pid=dead_pid(), host="node-other")
    with pytest.raises(OutputLocked, match="another host: whether it still runs cannot be checked") as info:
        with output_lock(tmp_path / "out", "extract"):
            pass
    assert f"delete {tmp_path / 'out' / '.lock'} if that process is gone" in str(info.value)
    assert (tmp_path / "out" / ".lock").is_file()  # someone else's lock is left alone


def test_a_requeued_slurm_job_takes_its_earlier_runs_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fpath = tmp_path / "run" / ".lock"
    write_lock(fpath, pid=os.getpid(), host="node-7", slurm_job_id="4242", slurm_restart_count=0)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with pytest.raises(OutputLocked), output_lock(tmp_path / "run", "fit"):  # the same run of the job: refused
        pass
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued: the run on node-7 was ended by SLURM
    with output_lock(tmp_path / "run", "fit"):
        assert json.loads(fpath.read_text())["slurm_restart_count"] == 1
    assert not fpath.exists()


def test_the_lock_goes_away_after_an_error(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(ZeroDivisionError), output_lock(tmp_path / "out", "evaluate"):
        assert (tmp_path / "out" / ".lock").is_file()
        _ = 1 / 0
    assert list((tmp_path / "out").iterdir()) == []


def test_a_full_disk_leaves_no_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    (tmp_path / "out").mkdir()
    monkeypatch.setattr(os, "write", no_space)
    with pytest.raises(DiskFullError, match=r"writing .*\.lock"), output_lock(tmp_path / "out", "export"):
        pass
    monkeypatch.undo()
    assert list((tmp_path / "out").iterdir()) == []


def test_ranks_of_one_run_do_not_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with output_lock(tmp_path / "out", "fit"):
        for name in ("LOCAL_RANK", "RANK", "SLURM_PROCID", "NODE_RANK"):
            with monkeypatch.context() as env:
                env.setenv(name, "1")
                with output_lock(tmp_path / "out", "fit") as fpath:  # rank 1 of the holder's run
                    assert fpath is None


def test_fits_starting_together_claim_their_own_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fit's new version_N is created (one process wins it) and locked before anything is written to it; one
    left empty is removed at the end, and so is one a fit failed in before training, but not one it trained in."""
    root = tmp_path / "runs" / "topk_digits"
    (root / "version_3").mkdir(parents=True)  # numbered after the highest, as Lightning numbers them
    with ExitStack() as stack:
        locks = RunLocks(stack)
        first, second = locks.new_version(root, lambda: False), locks.new_version(root, lambda: False)
        assert (first, second) == (4, 5)
        assert json.loads((root / "version_4" / ".lock").read_text())["command"] == "fit"
        with pytest.raises(OutputLocked, match=r"the run .*version_5 is being written by"):
            output_lock(root / "version_5", "fit --ckpt_path last", what="the run").__enter__()
        with monkeypatch.context() as env:
            env.setenv("LOCAL_RANK", "1")
            assert locks.new_version(root, lambda: False) is None  # ranks > 0 take rank 0's folder
    assert sorted(p.name for p in root.iterdir()) == ["version_3"]  # both left empty: removed
    for trained in (False, True):
        with pytest.raises(RuntimeError, match="failed"), ExitStack() as stack:
            number = RunLocks(stack).new_version(root, lambda trained=trained: trained)
            (root / f"version_{number}" / "events.out.tfevents.0").write_bytes(b"begun")
            raise RuntimeError("the fit failed")
        assert (root / f"version_{number}").exists() == trained, trained


def test_extraction_tasks_lock_their_own_part_and_other_splits_clash(tmp_path: Path) -> None:
    out = tmp_path / "shards"
    with output_lock(out, "extract", part=(0, 2)) as first, output_lock(out, "extract", part=(1, 2)) as second:
        assert (first.name, second.name) == (".lock.0-of-2", ".lock.1-of-2")
        with pytest.raises(OutputLocked, match=r"\.lock\.0-of-2"), output_lock(out, "extract", part=(0, 1)):
            pass
        with pytest.raises(OutputLocked, match=r"\.lock\.[01]-of-2"), output_lock(out, "extract", part=(0, 3)):
            pass
    assert lock_fpath(out, beside=True) == tmp_path / ".shards.lock"


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i in range(4):
        (root / "a").mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / "a" / f"{i}.png")
    return root


def test_extraction_into_an_out_being_written_is_refused_then_runs(
    images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two real processes: the holder is stopped by SIGTERM (exit 143, its lock gone), then the extraction runs."""
    out = tmp_path / "shards"
    args = ["--backbone", "vit_tiny", "--images", str(images), "--out", str(out), "--shard_size", "2"]
    args += ["--num_workers", "0", "--device", "cpu", "--progress", "false"]
    holder = start_holder(out)
    try:
        assert extract_main(args) == 2
        err = capsys.readouterr().err
        assert error_lines(err) == [line for line in err.splitlines() if line.strip()]
        assert f"is being written by pid {holder.pid} on host {HOST}" in err
        assert not list(out.glob("shard-*"))  # the refused run wrote nothing
    finally:
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=60) == 143
    assert not (out / ".lock.0-of-1").exists()
    assert extract_main(args) == 0
    assert sorted(p.name for p in out.glob("shard-*.tar")) == ["shard-000000.tar", "shard-000001.tar"]
    assert (out / "manifest.json").is_file() and not list(out.glob(".lock*"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory holding runs/topk_digits/version_0 (2 steps)."""
    cwd = tmp_path_factory.mktemp("trained")
    fit_in(cwd, "--config", TOPK_DIGITS, "--model.sae.init_args.d_sae", "64", "--trainer.max_steps", "2")
    return cwd


def test_every_command_refuses_an_output_being_written(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(trained)
    version = trained / "runs" / "topk_digits" / "version_0"
    ckpt = str(version / "checkpoints" / "last.ckpt")
    fit = ["fit", "--config", TOPK_DIGITS, "--model.sae.init_args.d_sae", "64", "--trainer.max_steps", "3"]
    features = ["features", "--config", TOPK_DIGITS, "--ckpt_path", "last"]
    cases = {
        "export": (["export", "--ckpt_path", ckpt, "--out", str(tmp_path / "exp")], tmp_path / "exp", {}),
        "evaluate": (["evaluate", "report", "--out", str(tmp_path / "study")], tmp_path / "study", {}),
        "features": ([*features, "--out", str(tmp_path / "site")], tmp_path / "site", {"beside": True}),
        "fit": ([*fit, "--ckpt_path", "last"], version, {"what": "the run"}),
    }
    for name, (args, out, where) in cases.items():
        with output_lock(out, "someone else's", **where) as fpath:
            status, _, err = run(args, capsys)
        assert status == 2, (name, err[-2000:])
        assert len(error_lines(err)) == 1, (name, err)
        assert f"is being written by pid {os.getpid()} on host {HOST}" in error_lines(err)[0], name
        shown = fpath.relative_to(trained) if name == "fit" else fpath  # fit names the run as it found it
        assert f"(someone else's); wait for it to finish, or delete {shown} if" in error_lines(err)[0], name
    assert not (tmp_path / "exp").exists() and not (tmp_path / "study").exists()  # nothing written
    assert sorted(p.name for p in version.parent.iterdir()) == ["version_0"]  # no resumed run began


def test_the_lock_is_released_after_each_command(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(trained)
    version = trained / "runs" / "topk_digits" / "version_0"
    status, _, err = run(["evaluate", "report", "--out", str(tmp_path / "study")], capsys)  # an error exit
    assert status == 2 and "no results.json" in err and not (tmp_path / "study").exists()
    status, _, err = run(["export", "--ckpt_path", str(version / "checkpoints" / "last.ckpt"), "--out", "exp"], capsys)
    assert status == 0, err
    assert not (trained / "exp" / ".lock").exists()
    fit = ["fit", "--config", TOPK_DIGITS, "--model.sae.init_args.d_sae", "64", "--trainer.max_steps", "3", *QUIET]
    for _ in range(2):  # a resume does not leave the run locked for the next one
        status, _, err = run([*fit, "--ckpt_path", "last"], capsys)
        assert status == 0, err[-2000:]
    assert not list(version.parent.glob("*/.lock"))


@pytest.mark.slow
def test_a_resume_holds_its_run_and_its_own_version_until_sigterm(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two real fits of one run: a second resume is refused naming the first, whichever version `last` resolves to.
    Issue 43, item 3: once the first resume has saved a periodic checkpoint, `last` is the first fit's own new
    version_1, which was not locked: the second resume forked it into version_2 and trained the same steps again.
    SIGTERM (143) releases both."""
    runs = tmp_path / "runs" / "topk_digits"
    shutil.copytree(trained / "runs" / "topk_digits" / "version_0", runs / "version_0")
    fit = ["fit", "--config", TOPK_DIGITS, "--model.sae.init_args.d_sae", "64", *QUIET, "--ckpt_path", "last"]
    periodic = ["--checkpoint.every_n_train_steps", "1", "--trainer.max_steps", "1000000", "--trainer.max_epochs", "-1"]
    first = Command(tmp_path, *fit, *periodic)
    try:
        first.wait_for((runs / "version_1" / "checkpoints" / "last.ckpt").is_file, "the first periodic checkpoint")
        monkeypatch.chdir(tmp_path)
        resumed = runs / "version_0" / "checkpoints" / "last.ckpt"
        for version in ("version_1", "version_0"):  # last: the first fit's own version, then the run it resumes
            if version == "version_0":  # the newest by time, whatever the first fit saves meanwhile
                os.utime(resumed, (resumed.stat().st_atime, resumed.stat().st_mtime + 3600))
            status, _, err = run([*fit, "--trainer.max_steps", "3"], capsys)
            assert status == 2 and len(error_lines(err)) == 1, err[-2000:]
            holder = f"is being written by pid {first.process.pid} on host {HOST}"
            assert f"the run runs/topk_digits/{version} {holder}" in err, err
    finally:
        first.signal(signal.SIGTERM)
        assert first.finish() == 143, first.text()[-3000:]
    assert sorted(p.name for p in runs.iterdir()) == ["version_0", "version_1"]  # the refused resumes left nothing
    assert not list(runs.glob("*/.lock"))
