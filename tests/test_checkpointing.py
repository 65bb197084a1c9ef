"""Checkpoints a user is pointed at hold the run they trained (issue 10, items 1, 2, 4, 6-8, training side).

Runs go through ``python -m sae_pipeline``'s ``main`` in-process (the same code path as the command,
one interpreter start for the module) on the bundled digits with a small TopK SAE: a few seconds each.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import system_tools
import torch
from in_process import QUIET, error_lines, fit_in, run

from feature_extraction.atomic_files import DiskFullError
from feature_extraction.h5cache import write_token_cache
from sae_pipeline.artifacts.checkpoint import read_checkpoint, sae_from_checkpoint
from sae_pipeline.artifacts.codes import read_codes
from sae_pipeline.data import ActivationDataModule
from sae_pipeline.training.checkpointing import AtomicCheckpointIO, newest_checkpoint

REPO_DPATH = Path(__file__).resolve().parents[1]
TOPK_DIGITS = str(REPO_DPATH / "configs" / "topk_digits.yaml")
SMALL = ["--model.sae.init_args.d_sae", "128", *QUIET]


def fit(capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    status, out, err = run(["fit", "--config", TOPK_DIGITS, *SMALL, *extra], capsys)
    assert status == 0, err[-3000:]
    return out


def step_of(fpath: Path | str) -> int:
    return int(torch.load(fpath, map_location="cpu", weights_only=True)["global_step"])


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two fits of one config in one folder: 12 steps, then 14 with a checkpoint every 5 steps."""
    cwd = tmp_path_factory.mktemp("two_runs")
    for steps, extra in ((12, []), (14, ["--checkpoint.every_n_train_steps", "5"])):
        fit_in(cwd, "--config", TOPK_DIGITS, *SMALL, "--trainer.max_steps", str(steps), *extra)
    return cwd


def test_each_fit_has_its_own_checkpoints_and_the_final_step_is_saved(two_runs: Path) -> None:
    run_dpath = two_runs / "runs" / "topk_digits"
    assert sorted(p.name for p in run_dpath.iterdir()) == ["version_0", "version_1"]
    first, second = (run_dpath / f"version_{v}" / "checkpoints" for v in (0, 1))
    assert step_of(first / "last.ckpt") == 12  # the first run's model stays in the first run's folder
    # 14 is not a checkpoint step (every 5): the final state is saved anyway, and only as last.ckpt.
    assert step_of(second / "last.ckpt") == 14
    assert sorted(p.name for p in second.iterdir()) == ["epoch=1-step=10.ckpt", "last.ckpt"]
    assert list(run_dpath.glob("version_1/events.out.tfevents.*"))  # TensorBoard beside its checkpoints
    assert newest_checkpoint([run_dpath]) == second / "last.ckpt"


def test_fit_prints_its_final_checkpoint_and_tensorboard_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    out = fit(capsys, "--trainer.max_steps", "3")
    lines = out.splitlines()
    assert "Final checkpoint (global step 3): runs/topk_digits/version_0/checkpoints/last.ckpt" in lines
    assert "TensorBoard run: runs/topk_digits/version_0   (tensorboard --logdir runs)" in lines
    assert step_of(tmp_path / "runs/topk_digits/version_0/checkpoints/last.ckpt") == 3


def test_ckpt_path_last_is_the_newest_run_by_time(
    two_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(two_runs / "runs", tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    old = tmp_path / "runs/topk_digits/version_0/checkpoints/last.ckpt"
    os.utime(old, ns=(old.stat().st_atime_ns, old.stat().st_mtime_ns + 10**12))  # version_0 written last
    status, out, err = run(
        ["predict", "--config", TOPK_DIGITS, *SMALL, "--ckpt_path", "last", "--codes.fpath", "codes/digits.h5"], capsys
    )
    assert status == 0, err[-3000:]
    # predict says where the codes went, and they are the codes of version_0's model (12 steps).
    assert "Wrote the codes of 1797 tokens to codes/digits.h5" in out.splitlines()
    codes = read_codes(tmp_path / "codes/digits.h5")
    assert newest_checkpoint([tmp_path / "runs" / "topk_digits"]) == old
    x = torch.cat([batch["x"] for batch in ActivationDataModule("digits", num_workers=0).predict_dataloader()])
    active = [set(row[row >= 0].tolist()) for row in codes["indices"]]
    for version, expected in ((0, True), (1, False)):
        checkpoint = read_checkpoint(tmp_path / f"runs/topk_digits/version_{version}/checkpoints/last.ckpt")
        with torch.no_grad():
            dense = sae_from_checkpoint(checkpoint).eval().encode(x * checkpoint["input_scale"])
        same = all(set(torch.nonzero(row).flatten().tolist()) == atoms for row, atoms in zip(dense, active))
        assert same is expected, version


def test_default_root_dir_takes_logs_and_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    out = fit(capsys, "--trainer.max_steps", "2", "--trainer.default_root_dir", "elsewhere")
    assert not (tmp_path / "runs").exists()
    version = tmp_path / "elsewhere" / "topk_digits" / "version_0"
    assert step_of(version / "checkpoints" / "last.ckpt") == 2 and list(version.glob("events.out.tfevents.*"))
    assert "Final checkpoint (global step 2): elsewhere/topk_digits/version_0/checkpoints/last.ckpt" in out


@pytest.mark.parametrize("command", ["validate", "test", "predict"])
def test_evaluating_commands_need_a_checkpoint(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    status, _, err = run([command, "--config", TOPK_DIGITS, *SMALL], capsys)
    assert status == 2 and len(error_lines(err)) == 1, err[-2000:]
    assert "--ckpt_path" in error_lines(err)[0] and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing written, no codes.h5 of a random SAE


def _bad_checkpoint(kind: str, two_runs: Path, tmp_path: Path) -> str:
    good = two_runs / "runs" / "topk_digits" / "version_1" / "checkpoints" / "last.ckpt"
    target = tmp_path / f"{kind}.ckpt"
    if kind == "missing":
        return str(target)
    if kind == "text":
        target.write_text("not a checkpoint\n")
    elif kind == "truncated":
        target.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif kind == "directory":
        target.mkdir()
    elif kind == "weights-only":
        checkpoint = torch.load(good, weights_only=True)
        del checkpoint["optimizer_states"], checkpoint["loops"]
        torch.save(checkpoint, target)
    elif kind == "no-sae":
        torch.save({"state_dict": {"w": torch.zeros(2)}}, target)
    return str(target)


@pytest.mark.parametrize(
    ("kind", "command", "expected"),
    [
        ("missing", "validate", "file not found"),
        ("text", "fit", "not a readable checkpoint"),
        ("truncated", "predict", "not a readable checkpoint (truncated"),
        ("truncated", "fit", "not a readable checkpoint (truncated"),
        ("directory", "test", "not a file"),
        ("weights-only", "fit", "no training state to resume"),
        ("no-sae", "validate", "not an SAE checkpoint"),
    ],
)
def test_bad_ckpt_path_is_one_line(
    kind: str,
    command: str,
    expected: str,
    two_runs: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ckpt = _bad_checkpoint(kind, two_runs, tmp_path)
    monkeypatch.chdir(tmp_path)
    status, _, err = run([command, "--config", TOPK_DIGITS, *SMALL, "--ckpt_path", ckpt], capsys)
    assert status == 2, err[-2000:]
    assert len(error_lines(err)) == 1 and expected in error_lines(err)[0] and ckpt in error_lines(err)[0], err
    assert "weights_only" not in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_checkpoint_for_other_data_width_is_one_line(
    command: str, two_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    write_token_cache(tmp_path / "d8.h5", np.random.default_rng(0).standard_normal((300, 8)).astype(np.float32))
    ckpt = str(two_runs / "runs" / "topk_digits" / "version_1" / "checkpoints" / "last.ckpt")
    monkeypatch.chdir(tmp_path)
    status, _, err = run(
        [command, "--config", TOPK_DIGITS, *SMALL, "--data.source", "d8.h5", "--ckpt_path", ckpt], capsys
    )
    assert status == 2, err[-2000:]
    (line,) = error_lines(err)
    assert "d_in=64" in line and "d_in=8" in line and "digits" in line and "Traceback" not in err


def test_ckpt_path_last_without_a_run_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    status, _, err = run(["fit", "--config", TOPK_DIGITS, *SMALL, "--ckpt_path", "last"], capsys)
    assert status == 2
    assert error_lines(err) == [
        "error: CheckpointError: --ckpt_path last: no checkpoint under runs/topk_digits to "
        "resume; run fit without --ckpt_path to start a new run"
    ]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("args", "setup", "expected"),
    [
        (["fit", "--trainer.max_steps", "2"], "runs-is-a-file", "runs/topk_digits cannot be created: runs is a file"),
        (["fit", "--trainer.default_root_dir", "out/x"], "out-is-a-file", "--trainer.default_root_dir"),
        (
            ["predict", "--ckpt_path", "{ckpt}", "--codes.fpath", "out/codes.h5"],
            "out-is-a-file",
            "--codes.fpath out/codes.h5: its folder out is a file",
        ),
        (["predict", "--ckpt_path", "{ckpt}", "--codes.fpath", "codes"], "codes-is-a-dir", "codes is a directory"),
        (["fit", "--model.lr", "-1e-3"], None, "model.lr must be a finite number > 0, got -0.001"),
        (["fit", "--trainer.accelerator", "gpu"], None, "--trainer.accelerator gpu: not usable here"),
        (["fit", "--config", "{broken_yaml}"], None, "broken.yaml: YAML syntax error at line 3, column 1"),
    ],
)
def test_bad_input_is_one_line(
    args: list[str],
    setup: str | None,
    expected: str,
    two_runs: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if "gpu" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.chdir(tmp_path)
    {
        "runs-is-a-file": lambda: Path("runs").write_text(""),
        "out-is-a-file": lambda: Path("out").write_text(""),
        "codes-is-a-dir": lambda: Path("codes").mkdir(),
        None: lambda: None,
    }[setup]()
    (tmp_path / "broken.yaml").write_text("trainer:\n  max_steps: [3\n")
    ckpt = str(two_runs / "runs" / "topk_digits" / "version_1" / "checkpoints" / "last.ckpt")
    args = [arg.format(ckpt=ckpt, broken_yaml="broken.yaml") for arg in args]
    before = sorted(p.name for p in tmp_path.iterdir())
    status, _, err = run([args[0], "--config", TOPK_DIGITS, *SMALL, *args[1:]], capsys)
    assert status == 2, err[-2000:]
    assert len(error_lines(err)) == 1 and expected in error_lines(err)[0], err[-2000:]
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_diverging_run_is_a_short_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    status, _, err = run(
        ["fit", "--config", TOPK_DIGITS, *SMALL, "--model.lr", "1e30", "--trainer.max_steps", "30"], capsys
    )
    assert status == 2
    (line,) = error_lines(err)
    assert "training diverged, lower model.lr" in line and len(line) < 300, line


def test_read_only_working_directory_is_one_line(tmp_path: Path) -> None:
    """The issue's case: fit in a folder the user cannot write (as an unprivileged user when run as root)."""
    import tempfile

    readonly = Path(tempfile.mkdtemp(prefix="sae-readonly-"))  # not under tmp_path: its parents are 0700
    readonly.chmod(0o555)
    try:
        _fit_in_read_only_folder(readonly)
    finally:
        readonly.chmod(0o755)
        shutil.rmtree(readonly)


def _fit_in_read_only_folder(readonly: Path) -> None:
    command = [sys.executable, "-m", "sae_pipeline", "fit", "--config", TOPK_DIGITS, *SMALL]
    if os.geteuid() == 0:
        command = [*_without_root_privileges(), *command]
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "PYTHONDONTWRITEBYTECODE": "1",
        "HOME": str(readonly),
        "MPLCONFIGDIR": str(readonly),
    }
    result = subprocess.run(command, cwd=readonly, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = error_lines(result.stderr)
    assert "runs/topk_digits cannot be written" in line and "--trainer.default_root_dir" in line, line
    assert list(readonly.iterdir()) == []


def _without_root_privileges() -> list[str]:
    """A ``setpriv`` prefix that takes root's power to write anywhere, wherever this clone lives.

    Root writes into a 0555 folder through its capabilities (CAP_DAC_OVERRIDE), so the child
    runs with every capability dropped, as the user that owns the clone: root for a clone
    under root's home (a 0700 folder that `nobody` could not enter, so could not import the
    package from), its owner for a clone in someone's home. Either can read the clone and
    neither can write into the root-owned 0555 folder.
    """
    import sae_pipeline

    system_tools.require(["setpriv"], "apt-get install -y util-linux")
    owner = Path(sae_pipeline.__file__).resolve().parent.stat()
    return [
        "setpriv",
        f"--reuid={owner.st_uid}",
        f"--regid={owner.st_gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
    ]


def test_atomic_checkpoint_io_replaces_the_file_whole(tmp_path: Path) -> None:
    target = tmp_path / "ckpts" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1, "w": torch.arange(4)}, target)
    inode = target.stat().st_ino
    io.save_checkpoint({"global_step": 2, "w": torch.arange(1000)}, target)
    # A new file renamed over the old one (never rewritten in place), and no partial file left.
    assert target.stat().st_ino != inode
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]
    assert torch.load(target, weights_only=True)["global_step"] == 2


class FullDiskIO(AtomicCheckpointIO):
    """A disk that is full when the checkpoint's bytes are written."""

    def write(self, checkpoint: dict, f, target: Path) -> None:  # noqa: ANN001
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_names_the_newest_checkpoint_when_last_would_not_find_it(tmp_path: Path) -> None:
    """Issue 31, item 13: the line advised `--ckpt_path last`, which finds only last*.ckpt: here the older step."""
    dpath = tmp_path / "checkpoints"
    AtomicCheckpointIO().save_checkpoint({"global_step": 2}, dpath / "last.ckpt")
    periodic = dpath / "epoch=0-step=4.ckpt"  # the step's periodic file, saved just before its last.ckpt
    AtomicCheckpointIO().save_checkpoint({"global_step": 4}, periodic)
    stamp = (dpath / "last.ckpt").stat().st_mtime_ns + 10**9
    os.utime(periodic, ns=(stamp, stamp))
    with pytest.raises(DiskFullError) as info:
        FullDiskIO().save_checkpoint({"global_step": 4}, dpath / "last.ckpt")
    assert (
        f"kept: the checkpoints already in {dpath} (epoch=0-step=4.ckpt, last.ckpt), unchanged "
        f"(fit --ckpt_path {periodic} resumes from the newest)"
    ) in str(info.value)
    assert step_of(dpath / "last.ckpt") == 2 and sorted(p.name for p in dpath.iterdir()) == [periodic.name, "last.ckpt"]
