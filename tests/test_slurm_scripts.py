"""slurm/train.sh and slurm/sweep.sh without a cluster: the commands they build, with fake ``sbatch``,
``srun`` and ``train.sh`` that print their arguments, and the shipped sweep list. (The scripts on a real
SLURM: tests/test_slurm_train.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_DPATH = Path(__file__).resolve().parents[1]
TRAIN_SH, SWEEP_SH = REPO_DPATH / "slurm" / "train.sh", REPO_DPATH / "slurm" / "sweep.sh"
DEMO_CONFIG = REPO_DPATH / "configs" / "demo_shards.yaml"


def test_sweep_submits_itself_with_one_task_per_entry(tmp_path: Path) -> None:
    fake_sbatch = tmp_path / "sbatch"
    fake_sbatch.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake_sbatch.chmod(0o755)
    sweep_list = tmp_path / "k.txt"
    sweep_list.write_text("a.yaml --model.sae.init_args.k 16\n# comment\n\nb.yaml\nc.yaml --model.lr=1e-3\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
    result = subprocess.run(
        ["bash", str(SWEEP_SH), str(sweep_list), "--", "--trainer.max_epochs", "2"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "--array=0-2",
        str(SWEEP_SH),
        str(sweep_list),
        "--",
        "--trainer.max_epochs",
        "2",
    ]
    empty = subprocess.run(["bash", str(SWEEP_SH)], env=env, capture_output=True, text=True)
    assert empty.returncode == 2 and empty.stderr.startswith("error: no configs given")


def test_sweep_task_runs_train_sh_with_its_entry(tmp_path: Path) -> None:
    fake_train = tmp_path / "train.sh"
    fake_train.write_text('printf "%s\\n" "$@"\n')  # run with bash by sweep.sh
    sweep_list = tmp_path / "k.txt"
    sweep_list.write_text("a.yaml --model.sae.init_args.k 16\nconfigs/c.yaml --model.lr=1e-3 --seed_everything 1\n")
    env = {**os.environ, "SLURM_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "1", "TRAIN_SCRIPT": str(fake_train)}
    result = subprocess.run(
        ["bash", str(SWEEP_SH), str(sweep_list), "--", "--trainer.max_epochs", "2"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "configs/c.yaml",
        "--trainer.logger.init_args.name",
        "c-lr1e-3_seed_everything1",
        "--model.lr=1e-3",
        "--seed_everything",
        "1",
        "--trainer.max_epochs",
        "2",
    ]
    beyond = subprocess.run(
        ["bash", str(SWEEP_SH), str(sweep_list)],
        capture_output=True,
        text=True,
        env={**env, "SLURM_ARRAY_TASK_ID": "2"},
    )
    assert beyond.returncode == 2 and "only 2 entries; use --array=0-1" in beyond.stderr


def test_train_sh_passes_the_allocation_and_extra_flags(tmp_path: Path) -> None:
    fake_srun = tmp_path / "srun"
    fake_srun.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake_srun.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS": "8",
        "SRUN_ARGS": "--cpu-bind=none",
    }
    env.pop("SLURM_NTASKS_PER_NODE", None)
    result = subprocess.run(
        ["bash", str(TRAIN_SH), str(DEMO_CONFIG), "--model.lr", "1e-3"], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "--kill-on-bad-exit=1",
        "--cpu-bind=none",
        "python",
        "-m",
        "sae_pipeline",
        "fit",
        "--config",
        str(DEMO_CONFIG),
        "--trainer.num_nodes",
        "2",
        "--trainer.devices",
        "4",
        "--model.lr",
        "1e-3",
    ]
    header = [line.split()[1] for line in TRAIN_SH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "--signal=SIGUSR1@90" in header and "--requeue" in header and "--open-mode=append" in header


def test_shipped_sweep_list_names_existing_configs() -> None:
    text = (REPO_DPATH / "configs" / "sweep_k_dinov2.txt").read_text()
    entries = [words for line in text.splitlines() if (words := line.split("#")[0].split())]
    assert len(entries) == 8
    for config, *flags in entries:
        assert (REPO_DPATH / config).is_file(), config
        assert flags[0] == "--model.sae.init_args.k" and int(flags[1]) > 0
