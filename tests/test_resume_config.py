"""``--ckpt_path`` never silently changes what the user asked for (reliability issue, item 6).

A run from a checkpoint takes the checkpoint's model; a config whose SAE or explicit model
settings differ is refused in one line before anything is written, and a config that names no
SAE says in one line which one it resumes (sae_pipeline/training/ckpt_config.py). Runs go through
``python -m sae_pipeline``'s ``main`` in-process (as tests/test_checkpointing.py does), one in a
real subprocess, on the bundled digits with a small MP-SAE.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fork_server
import pytest
import torch
import yaml
from in_process import QUIET, error_lines, fit_in, run

REPO_DPATH = Path(__file__).resolve().parents[1]
MPSAE = str(REPO_DPATH / "configs" / "mpsae_digits.yaml")
TOPK = str(REPO_DPATH / "configs" / "topk_digits.yaml")
D_SAE = "64"  # the checkpoint's; mpsae_digits.yaml says 1000


@pytest.fixture(scope="module")
def mp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with runs/mpsae_digits/version_0: an MP-SAE (d_sae 64, k 10, lr 1e-3) trained 2 steps."""
    cwd = tmp_path_factory.mktemp("mp_run")
    fit_in(cwd, "--config", MPSAE, "--model.sae.init_args.d_sae", D_SAE, "--trainer.max_steps", "2")
    return cwd


CKPT = "runs/mpsae_digits/version_0/checkpoints/last.ckpt"
REFUSED = {
    "another SAE class": (
        ["fit", "--config", TOPK],
        ("holds MatchingPursuitSAE(d_sae=64, k=10) but the config asks for TopKSAE(d_sae=1000, k=10)"),
    ),
    "the config's d_sae": (
        ["fit", "--config", MPSAE],
        ("holds MatchingPursuitSAE(d_sae=64, k=10) but the config asks for MatchingPursuitSAE(d_sae=1000, k=10)"),
    ),
    "an explicit d_sae flag": (
        ["fit", "--config", MPSAE, "--model.sae.init_args.d_sae", "500"],
        "but the config asks for MatchingPursuitSAE(d_sae=500, k=10)",
    ),
    "d_sae without a class": (
        ["fit", "--data.source", "digits", "--model.sae.init_args.d_sae", "500"],
        ("holds MatchingPursuitSAE(d_sae=64, k=10) but the config asks for MatchingPursuitSAE(d_sae=500)"),
    ),
    "k of the same class": (
        ["fit", "--config", MPSAE, "--model.sae.init_args.d_sae", D_SAE, "--model.sae.init_args.k", "5"],
        "asks for MatchingPursuitSAE(d_sae=64, k=5)",
    ),
    "an explicit lr": (
        ["fit", "--config", MPSAE, "--model.sae.init_args.d_sae", D_SAE, "--model.lr", "0.01"],
        "was trained with model.lr=0.001 but the config asks for model.lr=0.01",
    ),
    "predict with another SAE": (
        ["predict", "--config", TOPK, "--codes.fpath", "codes.h5"],
        "holds MatchingPursuitSAE(d_sae=64, k=10) but the config asks for TopKSAE",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_checkpoint_unlike_the_config_is_refused_in_one_line(
    case: str, mp_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(mp_run)
    before = sorted(str(p.relative_to(mp_run)) for p in mp_run.rglob("*"))
    trained_config = (mp_run / "runs/mpsae_digits/version_0/config.yaml").read_bytes()
    args, expected = REFUSED[case]
    status, _out, err = run([*args, *QUIET, "--ckpt_path", CKPT], capsys)
    assert status == 2, err[-3000:]
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert f"--ckpt_path {CKPT} " in lines[0] and expected in lines[0], lines[0]
    assert (
        "pass the config the run was trained with (its version_N/config.yaml) or start a new run without "
        "--ckpt_path" in lines[0]
    )
    # Nothing written: no new run folder, the trained run's config.yaml as it was, no codes.
    assert sorted(str(p.relative_to(mp_run)) for p in mp_run.rglob("*")) == before
    assert (mp_run / "runs/mpsae_digits/version_0/config.yaml").read_bytes() == trained_config


def test_the_config_the_run_was_trained_with_resumes_it(
    mp_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ckpt = mp_run / CKPT
    status, _out, err = run(
        [
            "fit",
            "--config",
            MPSAE,
            "--model.sae.init_args.d_sae",
            D_SAE,
            *QUIET,
            "--trainer.max_steps",
            "3",
            "--ckpt_path",
            str(ckpt),
        ],
        capsys,
    )
    assert status == 0, err[-3000:]
    resumed = torch.load(tmp_path / "runs/mpsae_digits/version_0/checkpoints/last.ckpt", weights_only=True)
    assert resumed["global_step"] == 3
    assert resumed["sae_config"] == torch.load(ckpt, weights_only=True)["sae_config"]
    assert "resuming its" not in err  # the config named the SAE: nothing to announce


def fit_without_sae(ckpt: str, cwd: Path, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m sae_pipeline fit --ckpt_path CKPT`` on digits with no config, so no ``model.sae``: 3 steps."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_DPATH), os.environ.get("PYTHONPATH", "")])}
    data = ["--data.source", "digits", "--data.batch_size", "256", "--data.num_workers", "0"]
    return fork_server.run(
        [
            sys.executable,
            "-m",
            "sae_pipeline",
            "fit",
            *data,
            *QUIET,
            "--trainer.max_steps",
            "3",
            "--trainer.accelerator",
            "cpu",
            "--ckpt_path",
            ckpt,
        ],
        cwd=cwd,
        env={**env, **(extra_env or {})},
        timeout=300,
    )


@pytest.mark.slow
def test_a_config_without_sae_resumes_the_checkpoints_and_says_which(mp_run: Path, tmp_path: Path) -> None:
    ckpt = mp_run / CKPT
    result = fit_without_sae(str(ckpt), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "resuming its" in line]
    assert said == [
        (f"--ckpt_path {ckpt}: resuming its MatchingPursuitSAE(d_sae=64, k=10) (the config names no model.sae)")
    ], result.stderr[-3000:]
    written = yaml.safe_load((tmp_path / "runs/sae/version_0/config.yaml").read_text())
    assert written["model"]["sae"]["class_path"] == "sae_pipeline.sae.MatchingPursuitSAE"
    assert written["model"]["sae"]["init_args"]["d_sae"] == 64
    resumed = torch.load(tmp_path / "runs/sae/version_0/checkpoints/last.ckpt", weights_only=True)
    assert resumed["global_step"] == 3


@pytest.mark.slow
def test_a_requeued_slurm_job_without_sae_takes_its_hpc_checkpoints_model(mp_run: Path, tmp_path: Path) -> None:
    """The job's hpc checkpoint replaces --ckpt_path (sae_pipeline/training/requeue.py) and Lightning merges no
    hyper-parameters from it: the SAE, lr and warm-up still come from the checkpoint, not the defaults."""
    job = tmp_path / "runs/sae/slurm-77"
    job.mkdir(parents=True)
    (job / "hpc_ckpt_1.ckpt").write_bytes((mp_run / CKPT).read_bytes())
    slurm = {
        "SLURM_JOB_ID": "77",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NAME": "train",
        "SLURM_NODELIST": "localhost",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }
    result = fit_without_sae(str(mp_run / CKPT), tmp_path, slurm)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "--ckpt_path runs/sae/slurm-77/hpc_ckpt_1.ckpt: resuming its MatchingPursuitSAE(d_sae=64, k=10)"
        in result.stderr
    )
    written = yaml.safe_load((job / "config.yaml").read_text())
    assert written["model"]["sae"]["init_args"]["d_sae"] == 64
    assert (written["model"]["lr"], written["model"]["warmup_steps"]) == (1e-3, 20)  # mpsae_digits.yaml's
    assert torch.load(job / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 3


def test_a_config_without_sae_or_data_names_what_is_missing(
    mp_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    status, _out, err = run(["fit", *QUIET, "--ckpt_path", str(mp_run / CKPT)], capsys)
    assert status == 2
    assert error_lines(err) == ["error: the following arguments are required: fit.data.source"], err
    assert not (tmp_path / "runs").exists()


def test_a_group_config_with_a_single_sae_checkpoint_is_one_error_line(
    mp_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line names what the checkpoint holds, what the config names and the fix (the group's side:
    tests/test_group_cli.py)."""
    monkeypatch.chdir(tmp_path)
    members = {
        "a": {"sae": {"class_path": "TopKSAE", "init_args": {"d_sae": 32, "k": 2}}},
        "b": {"sae": {"class_path": "ReLUSAE", "init_args": {"d_sae": 32}}},
    }
    config = tmp_path / "pair.yaml"
    config.write_text(yaml.safe_dump({"model": {"members": members}, "data": {"source": "digits"}}))
    ckpt = str(mp_run / CKPT)
    status, _out, err = run(["fit", "--config", str(config), *QUIET, "--ckpt_path", ckpt], capsys)
    assert status == 2, err[-3000:]
    assert error_lines(err) == [
        f"error: CheckpointError: --ckpt_path {ckpt} holds one SAE, MatchingPursuitSAE(d_sae=64, k=10), but the "
        "config names a group of 2 SAEs (a, b); pass that SAE's config (its version_N/config.yaml) or start a new "
        "run without --ckpt_path"
    ], err
    assert not (tmp_path / "runs").exists()


def test_resuming_a_run_already_at_max_steps_trains_nothing_and_leaves_no_run_folder(
    mp_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit 0 with one line (the run is done, as a rerun of a finished job finds it), and no empty version_1."""
    monkeypatch.chdir(mp_run)
    before = sorted(str(p.relative_to(mp_run)) for p in mp_run.rglob("*"))
    args = ["fit", "--config", MPSAE, "--model.sae.init_args.d_sae", D_SAE, "--trainer.max_steps", "2", *QUIET]
    status, out, err = run([*args, "--ckpt_path", CKPT], capsys)
    assert status == 0, err[-3000:]
    assert [line for line in out.splitlines() if line] == [
        f"Nothing to train: {CKPT} is already at global step 2 (--trainer.max_steps 2); raise it to train further"
    ], out
    assert sorted(str(p.relative_to(mp_run)) for p in mp_run.rglob("*")) == before
