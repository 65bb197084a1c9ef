"""Every long command stops on Ctrl-C / SIGTERM with 130 / 143, one line saying how to rerun, and only
whole outputs left behind (issue: reliability, items 2 and 9).

Each case starts the real ``python -m sae_pipeline ...`` as a subprocess in its own process group
(as a terminal does), waits until it is working (a line in its output or a file it writes), sends
the signal once (Ctrl-C to the whole group, SIGTERM to the process) and checks the exit status, the
one ``interrupted (Ctrl-C): ...`` / ``terminated (SIGTERM): ...`` line, and the files left.
``fit`` itself is covered by tests/test_interrupts.py. Two checks of what ``fit`` and ``features``
print (Lightning's noise silenced, a resume already at max_steps) read the run the cases start
from, rather than train another one elsewhere.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import fork_server
import pytest
import torch
from terminal import ENV, TIMEOUT_S, Command, child_pids, command_line

REPO_DPATH = Path(__file__).resolve().parents[1]
MPSAE_DIGITS = str(REPO_DPATH / "configs" / "mpsae_digits.yaml")
HEADS = {signal.SIGINT: "interrupted (Ctrl-C): ", signal.SIGTERM: "terminated (SIGTERM): "}


def run_sae_pipeline(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m sae_pipeline ARGS`` to the end (no signal), its output captured."""
    return fork_server.run([sys.executable, "-m", "sae_pipeline", *args], cwd=cwd, env=ENV, timeout=TIMEOUT_S)


def the_line(command: Command, signum: int) -> str:
    """The one interruption line; nothing else reads as an error or a traceback."""
    err = "".join(command.err)
    lines = [line for line in err.splitlines() if line.startswith(HEADS[signum])]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert not [line for line in err.splitlines() if line.startswith("error:")], err[-3000:]
    assert "rerun the same command" in lines[0] or "continue with the same command" in lines[0], lines[0]
    return lines[0]


def files(dpath: Path) -> dict[str, bytes]:
    return {str(p.relative_to(dpath)): p.read_bytes() for p in sorted(dpath.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory with one fit run (``--ckpt_path last``) and a previous feature site."""
    cwd = tmp_path_factory.mktemp("signals")
    fit = run_sae_pipeline(
        "fit",
        "--config",
        MPSAE_DIGITS,
        "--trainer.max_steps",
        "4",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        cwd=cwd,
    )
    assert fit.returncode == 0, fit.stderr[-3000:]
    site = run_sae_pipeline(
        "features",
        "--config",
        MPSAE_DIGITS,
        "--ckpt_path",
        "last",
        "--out",
        "site",
        "--atoms",
        "0",
        "1",
        "--top",
        "2",
        cwd=cwd,
    )
    assert site.returncode == 0, site.stderr[-3000:]
    (cwd / "fit.log").write_text(fit.stdout + fit.stderr)
    (cwd / "features.log").write_text(site.stdout + site.stderr)
    return cwd


def run_dirs(cwd: Path) -> list[str]:
    return sorted(p.name for p in (cwd / "runs" / "mpsae_digits").iterdir())


SLOW = ["--config", MPSAE_DIGITS, "--ckpt_path", "last", "--data.batch_size", "1"]  # one token per batch: long


def codes_being_written(cwd: Path) -> Callable[[], bool]:
    return lambda: (cwd / "codes.h5.tmp").exists()


def site_being_written(cwd: Path) -> Callable[[], bool]:
    return lambda: any(cwd.glob(".site.partial-*/atoms/*.html"))


CASES = {
    # name: (arguments, when it is working, what the line says)
    "predict": (
        ["predict", *SLOW, "--codes.fpath", "codes.h5", "--trainer.enable_progress_bar", "false"],
        codes_being_written,
        "no codes written, codes.h5 not created",
    ),
    "validate": (
        ["validate", *SLOW, "--data.val_fraction", "0.9", "--trainer.enable_progress_bar", "false"],
        lambda cwd: None,
        "nothing was written",
    ),
    "test": (
        ["test", *SLOW, "--data.val_fraction", "0.9", "--trainer.enable_progress_bar", "false"],
        lambda cwd: None,
        "nothing was written",
    ),
    "features-pass": (
        ["features", *SLOW, "--out", "site"],
        lambda cwd: None,
        "no site written to site (the previous site there is unchanged)",
    ),
    "features-site": (
        ["features", "--config", MPSAE_DIGITS, "--ckpt_path", "last", "--out", "site"],
        site_being_written,
        "no site written to site (the previous site there is unchanged)",
    ),
}
# validate / test / the features pass write nothing while they work: they are working once the
# checkpoint is loaded (validate, test) or the pass's Trainer is built (its device line).
LOG_MARKERS = {"validate": "Loaded model weights", "test": "Loaded model weights", "features-pass": "GPU available"}


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("case", list(CASES))
def test_long_commands_stop_with_one_line_and_whole_outputs(trained: Path, case: str, signum: int) -> None:
    args, working, says = CASES[case]
    site_before = files(trained / "site")
    command = Command(trained, *args)
    if case in LOG_MARKERS:
        command.wait_for(lambda: LOG_MARKERS[case] in command.text(), LOG_MARKERS[case])
    else:
        command.wait_for(working(trained), "the output being written")
    command.signal(signum)
    assert command.finish() == 128 + signum, command.text()[-3000:]
    assert says in the_line(command, signum)
    assert not (trained / "codes.h5").exists() and not list(trained.glob("codes.h5*"))  # no half codes file
    assert files(trained / "site") == site_before  # the previous site, intact
    assert not list(trained.glob(".site.*"))  # no staging or swapped-out folder left
    assert run_dirs(trained) == ["version_0"]  # validate / test / predict leave no version_N folder


@pytest.mark.slow
def test_predict_interrupted_leaves_a_previous_codes_file_as_it_was(trained: Path, tmp_path: Path) -> None:
    codes = tmp_path / "codes.h5"
    codes.write_bytes(b"previous codes")
    command = Command(trained, "predict", *SLOW, "--codes.fpath", str(codes), "--trainer.enable_progress_bar", "false")
    command.wait_for(lambda: (tmp_path / "codes.h5.tmp").exists(), "codes.h5.tmp")
    command.signal(signal.SIGTERM)
    assert command.finish() == 143, command.text()[-3000:]
    assert f"no codes written, {codes} left as it was" in the_line(command, signal.SIGTERM)
    assert codes.read_bytes() == b"previous codes" and sorted(tmp_path.iterdir()) == [codes]


@pytest.mark.slow
def test_second_ctrl_c_during_a_checkpoint_save_exits_130_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    from pause_io import env_with_repo_root, pause_in_save_args

    marker = tmp_path / "in-save"
    command = Command(
        tmp_path,
        "fit",
        "--config",
        MPSAE_DIGITS,
        "--trainer.max_steps",
        "40",
        "--trainer.max_epochs",
        "-1",
        "--checkpoint.every_n_train_steps",
        "2",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        *pause_in_save_args(4, marker),
        env=env_with_repo_root(ENV),
    )  # the save at step 4 stops half-way
    command.wait_for(marker.exists, "the paused save")
    checkpoints = tmp_path / "runs" / "mpsae_digits" / "version_0" / "checkpoints"
    command.signal(signal.SIGINT)
    command.wait_for(lambda: "SIGINT received" in "".join(command.err), "the first Ctrl-C's note")
    command.signal(signal.SIGINT)
    assert command.finish() == 130, command.text()[-3000:]
    line = the_line(command, signal.SIGINT)
    # The line reads the disk (issue 31, item 12): step 4's periodic file was saved whole before its last.ckpt,
    # so step 4 is saved, and `--ckpt_path last` would resume step 2: the file is named.
    periodic = "runs/mpsae_digits/version_0/checkpoints/epoch=0-step=4.ckpt"
    assert line == (
        f"interrupted (Ctrl-C): saved {periodic} at global step 4; continue with the same command and "
        f"--ckpt_path {periodic}"
    )
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".")]  # the half save's partial removed
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 2  # the save before
    for fpath in checkpoints.iterdir():  # (and the step-4 top-k file, saved whole before last.ckpt)
        assert torch.load(fpath, weights_only=True)["global_step"] in (2, 4)


@pytest.mark.slow
def test_lightning_noise_is_silenced_and_the_features_pass_has_its_name(trained: Path) -> None:
    for log in ("fit.log", "features.log"):
        text = (trained / log).read_text()
        for noise in ("Tip:", "litlogger", "TPU available", "LeafSpec", "Loading `train_dataloader`", "srun"):
            assert noise not in text, f"{log}: {noise}"
    fit = (trained / "fit.log").read_text()
    assert "Final checkpoint (global step 4): runs/mpsae_digits/version_0/checkpoints/last.ckpt" in fit
    features = (trained / "features.log").read_text()
    assert "Features pass" in features and "Predicting" not in features


@pytest.mark.slow
def test_resuming_a_run_already_at_max_steps_says_so(trained: Path, tmp_path: Path) -> None:
    ckpt = trained / "runs" / "mpsae_digits" / "version_0" / "checkpoints" / "last.ckpt"
    result = run_sae_pipeline(
        "fit",
        "--config",
        MPSAE_DIGITS,
        "--ckpt_path",
        str(ckpt),
        "--trainer.max_steps",
        "4",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        cwd=trained,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"Nothing to train: {ckpt} is already at global step 4 (--trainer.max_steps 4); raise it to train further"
    ) in result.stdout, result.stdout
    assert "fast_dev_run" not in result.stdout


@pytest.mark.slow
def test_evaluate_interrupted_then_rerun_continues_the_interrupted_run(tmp_path: Path) -> None:
    out, name, steps = tmp_path / "study", "mpsae_p2000_k4", 200
    args = [
        "expressivity",
        "--data",
        "digits",
        "--out",
        str(out),
        "--variants",
        "mpsae",
        "--k",
        "4",
        "--k_main",
        "4",
        "--p",
        "2000",
        "--p_main",
        "2000",
        "--max_steps",
        str(steps),
        "--k_infer",
        "4",
        "--r_max",
        "4",
        "--sae_seeds",
        "1",  # one run, trained alone: its run folder is the one to interrupt
        "--config_dir",
        str(REPO_DPATH / "configs"),
    ]
    run_dpath = out / "runs" / name
    command = Command(tmp_path, *args, module="sae_pipeline.evaluate")
    # hparams.yaml: written once the Trainer's callbacks are set up, so the signal reaches a fit in progress
    command.wait_for(lambda: (run_dpath / "version_0" / "hparams.yaml").is_file(), "training under way")
    command.signal(signal.SIGINT)
    assert command.finish() == 130, command.text()[-3000:]
    line = the_line(command, signal.SIGINT)
    assert (
        f"finished runs in {out} are kept" in line and "continues the interrupted run from its last checkpoint" in line
    ), line
    saved = torch.load(run_dpath / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 1 <= saved < steps

    rerun = fork_server.run(
        [sys.executable, "-m", "sae_pipeline.evaluate", *args], cwd=tmp_path, env=ENV, timeout=TIMEOUT_S
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    record = (out / "models" / name / "study_run.json").read_text()
    assert f"--ckpt_path {run_dpath / 'checkpoints' / 'last.ckpt'}" in record  # resumed, not retrained
    assert torch.load(run_dpath / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == steps
    assert sorted(p.name for p in run_dpath.iterdir() if p.name.startswith("version")) == ["version_0"]


@pytest.mark.slow
def test_sigterm_to_rank_0_of_a_ddp_predict_stops_every_rank(trained: Path, tmp_path: Path) -> None:
    """``docker stop`` / ``timeout`` signal only the launcher (rank 0): it forwards to the rank it started."""
    codes = tmp_path / "codes.h5"
    command = Command(
        trained,
        "predict",
        *SLOW,
        "--codes.fpath",
        str(codes),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "ddp",
    )
    command.wait_for(lambda: len(list(tmp_path.glob("codes.h5.rank*.tmp"))) == 2, "both ranks writing their part")
    children = child_pids(command.process.pid)
    ranks = [pid for pid in children if "sae_pipeline" in command_line(pid)]
    assert len(ranks) == 1, f"rank 0's children {children}: {len(ranks)} run sae_pipeline"
    (rank1,) = ranks
    command.signal(signal.SIGTERM)
    assert command.finish() == 143, command.text()[-3000:]
    assert "no codes written" in the_line(command, signal.SIGTERM)  # printed once, by rank 0
    assert list(tmp_path.iterdir()) == []  # no part, no temporary file, no codes file
    deadline = time.monotonic() + 30
    while Path(f"/proc/{rank1}").exists() and "zombie" not in Path(f"/proc/{rank1}/status").read_text():
        assert time.monotonic() < deadline, "rank 1 still running"
        time.sleep(0.1)
