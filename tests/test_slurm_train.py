"""slurm/train.sh and slurm/sweep.sh on a real single-node SLURM: 2-task gloo DDP on the CPU,
pre-emption of a group of SAEs (SIGUSR1 -> hpc checkpoint -> requeue -> resume), bad input, an array sweep.
(One SAE's requeue on two nodes: tests/test_slurm_multinode.py; the scripts' command lines without a
cluster: tests/test_slurm_scripts.py; mid-epoch resume without SLURM: tests/test_resume_mid_epoch.py.)

One cluster and one set of shards (made by the extraction command) serve the whole module.
The training runs are the demo's (configs/demo_shards.yaml): 6 training shards of 34 tokens,
batch 32 per rank, 2 ranks -> 3 steps per epoch.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import system_tools
import torch
import yaml
from slurm_cluster import EXECUTABLES, INSTALL_HINT, SlurmCluster
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO_DPATH = Path(__file__).resolve().parents[1]
TRAIN_SH, SWEEP_SH = REPO_DPATH / "slurm" / "train.sh", REPO_DPATH / "slurm" / "sweep.sh"
DEMO_CONFIG = REPO_DPATH / "configs" / "demo_shards.yaml"
EPOCHS, STEPS_PER_EPOCH = 100, 3
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    system_tools.require(EXECUTABLES, INSTALL_HINT)
    with SlurmCluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """7 shards of 2 photos (vit_tiny, 17 tokens x 192-d per photo) from `python -m feature_extraction`."""
    out = tmp_path_factory.mktemp("shards") / "vit_tiny"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "feature_extraction",
            "--config",
            str(REPO_DPATH / "configs" / "extract_demo.yaml"),
            "--out",
            str(out),
            "--shard_size",
            "2",
            "--progress",
            "false",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def submit(cluster: SlurmCluster, workdir: Path, args: list[str], tasks: int = 2) -> str:
    """sbatch in `workdir` (CPU-only node: no GPU, 1 CPU per task); the log is workdir/logs/<name>-<id>.out."""
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    env = {
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "SBATCH_GRES": "none",
        "PYTHONWARNINGS": "ignore",
        "MASTER_PORT": str(_free_port()),
    }  # Lightning's default port (from the job id) may be taken here
    return cluster.sbatch(
        [f"--ntasks-per-node={tasks}", "--cpus-per-task=1", "--mem=1G", f"--output={workdir}/logs/%x-%j.out", *args],
        env=env,
        cwd=workdir,
    )


def job_fields(cluster: SlurmCluster, job_id: str) -> dict[str, str]:
    shown = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], env=cluster.env, capture_output=True, text=True
    ).stdout
    return dict(field.split("=", 1) for field in shown.split() if "=" in field)


def node_state(cluster: SlurmCluster) -> str:
    shown = subprocess.run(["scontrol", "-o", "show", "node"], env=cluster.env, capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in shown.split() if "=" in field).get("State", "?")


def node_is_idle(cluster: SlurmCluster) -> bool:
    """No job (or job clean-up) on the test node: State=IDLE, without COMPLETING."""
    state = node_state(cluster)
    return state.startswith("IDLE") and "COMPLETING" not in state


def log_text(workdir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((workdir / "logs").glob("*.out")))


def train_args(shards: Path, *extra: str, config: Path = DEMO_CONFIG) -> list[str]:
    return [
        str(TRAIN_SH),
        str(config),
        "--data.source",
        str(shards),
        "--trainer.max_epochs",
        str(EPOCHS),
        "--trainer.check_val_every_n_epoch",
        "50",
        "--checkpoint.every_n_train_steps",
        "10",
        *QUIET,
        *extra,
    ]


def logged_steps(run_dpath: Path, tag: str = "train/loss") -> list[list[int]]:
    """The steps of `tag` in each TensorBoard event file of the run, files in the order written."""
    steps = []
    for fpath in sorted(run_dpath.glob("events.out.tfevents.*"), key=lambda p: int(p.name.split(".")[3])):
        events = EventAccumulator(str(fpath), size_guidance={"scalars": 0})
        events.Reload()
        steps.append([event.step for event in events.Scalars(tag)] if tag in events.Tags()["scalars"] else [])
    return steps


@pytest.fixture(scope="module")
def uninterrupted(cluster: SlurmCluster, shards: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    workdir = tmp_path_factory.mktemp("uninterrupted")
    job_id = submit(cluster, workdir, train_args(shards))
    states = cluster.wait(job_id, timeout=300)
    assert states == {job_id: "COMPLETED 0:0"}, f"{states}\n{log_text(workdir)[-4000:]}"
    return workdir, job_id


@pytest.mark.slow
def test_two_task_job_trains_with_lightning_ddp(uninterrupted: tuple[Path, str]) -> None:
    workdir, job_id = uninterrupted
    log = log_text(workdir)
    # Lightning's SLURMEnvironment set up the ranks (gloo on the CPU) and armed its requeue machinery.
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in log, log[-3000:]
    assert "distributed_backend=gloo" in log and "Starting with 2 processes" in log
    assert "SLURM auto-requeueing enabled" in log
    run_dpath = workdir / "runs" / "demo_shards"
    assert sorted(p.name for p in run_dpath.iterdir()) == [f"slurm-{job_id}"]  # logs and checkpoints: one folder
    checkpoint = torch.load(run_dpath / f"slurm-{job_id}" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert logged_steps(run_dpath / f"slurm-{job_id}")[-1][-1] == EPOCHS * STEPS_PER_EPOCH - 1


def group_config(workdir: Path) -> Path:
    """The demo config's SAE as member ``demo`` of a group, beside a smaller TopK member."""
    config = yaml.safe_load(DEMO_CONFIG.read_text())
    alone = config.pop("model")
    small = {**alone, "sae": {"class_path": "sae_pipeline.sae.TopKSAE", "init_args": {"d_sae": 64, "k": 4}}}
    config["model"] = {"members": {"demo": alone, "small": small}}
    fpath = workdir / "demo_group.yaml"
    fpath.write_text(yaml.safe_dump(config))
    return fpath


@pytest.mark.slow
def test_usr1_requeues_a_group_and_the_job_resumes_where_it_stopped(
    cluster: SlurmCluster, shards: Path, tmp_path: Path, uninterrupted: tuple[Path, str]
) -> None:
    job_id = submit(cluster, tmp_path, train_args(shards, config=group_config(tmp_path)))
    run_dpath = tmp_path / "runs" / "demo_group"
    deadline = time.time() + 240
    last_fpath = run_dpath / f"slurm-{job_id}" / "checkpoints" / "last.ckpt"
    while not last_fpath.exists():  # training is under way (step >= 10)
        assert time.time() < deadline and job_fields(cluster, job_id)["JobState"] in ("PENDING", "RUNNING"), log_text(
            tmp_path
        )[-3000:]
        time.sleep(0.2)
    # No --batch: the signal goes to the srun tasks (the Python ranks), as --signal=SIGUSR1@90 does.
    subprocess.run(["scancel", "--signal=USR1", job_id], env=cluster.env, check=True)
    while (fields := job_fields(cluster, job_id))["Restarts"] == "0" or fields["JobState"] != "PENDING":
        assert time.time() < deadline and fields["JobState"] in ("RUNNING", "COMPLETING", "REQUEUED", "PENDING"), (
            f"{fields}\n{log_text(tmp_path)[-3000:]}"
        )
        time.sleep(0.2)
    # SLURM holds a requeued job back for about two minutes (Reason=BeginTime); release it sooner, but
    # only once the node has cleaned up the first run and a second has passed: slurmd revokes the
    # job's credential at one-second resolution, and a launch of the same job in that second is
    # killed ("Killing non-startable batch JobId=N: Job credential revoked").
    while not node_is_idle(cluster):
        assert time.time() < deadline, f"the node did not become idle: {node_state(cluster)}"
        time.sleep(0.2)
    time.sleep(2.0)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=cluster.env, check=True)
    states = cluster.wait(job_id, timeout=300)
    log = log_text(tmp_path)
    assert states == {job_id: "COMPLETED 0:0"}, f"{states}\n{log[-4000:]}"

    version_dpath = run_dpath / f"slurm-{job_id}"
    hpc_fpath = version_dpath / "hpc_ckpt_1.ckpt"
    hpc = torch.load(hpc_fpath, weights_only=True)
    saved_step = hpc["global_step"]
    assert 10 <= saved_step < EPOCHS * STEPS_PER_EPOCH
    relative = hpc_fpath.relative_to(tmp_path)
    assert f"Saved {relative} at global step {saved_step}; requeueing SLURM job {job_id}" in log, log[-4000:]
    assert f"Restored all states from the checkpoint at {relative}" in log
    assert log.count("train: config=") == 2 and "restart=1" in log  # the script ran again, same job
    # The data stream's position went into the checkpoint with the global step.
    loader_state = hpc["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader_state["epoch"] * STEPS_PER_EPOCH + loader_state["batches_done"] == saved_step

    # Each member's TensorBoard run, continued: the steps of its second event file follow those of the first.
    assert sorted(p.name for p in run_dpath.iterdir()) == [f"slurm-{job_id}"]
    for member in ("demo", "small"):
        before, after = logged_steps(version_dpath / member)
        assert before and after and before[-1] < saved_step <= after[0], member
        assert after[-1] == EPOCHS * STEPS_PER_EPOCH - 1

    # Member `demo` ends as the single SAE never interrupted: step count and the trained weights
    # (optimiser, schedule, dead-latent clock and data order all resumed; a member equals its SAE alone).
    final = torch.load(version_dpath / "checkpoints" / "last.ckpt", weights_only=True)
    reference_dpath, reference_job = uninterrupted
    reference_fpath = reference_dpath / "runs" / "demo_shards" / f"slurm-{reference_job}" / "checkpoints" / "last.ckpt"
    reference = torch.load(reference_fpath, weights_only=True)
    assert final["global_step"] == reference["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert any(name.startswith("members.small.") for name in final["state_dict"])
    for name, value in reference["state_dict"].items():
        torch.testing.assert_close(final["state_dict"][f"members.demo.{name}"], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["no config", "missing config", "too few shards"])
def test_bad_input_fails_at_once_with_one_line(cluster: SlurmCluster, shards: Path, tmp_path: Path, case: str) -> None:
    args = {
        "no config": [str(TRAIN_SH)],
        "missing config": [str(TRAIN_SH), "configs/nope.yaml"],
        # 6 training shards < 2 ranks x 4 workers
        "too few shards": train_args(shards, "--data.num_workers", "4"),
    }[case]
    job_id = submit(cluster, tmp_path, args)
    states = cluster.wait(job_id, timeout=120)  # a DDP hang would end here
    log = log_text(tmp_path)
    assert states[job_id].startswith("FAILED"), f"{states}\n{log[-3000:]}"
    errors = [line for line in log.splitlines() if line.startswith("error")]
    # One error, once per job; under load both ranks may print it before srun stops the second
    # (rank > 0 waits a few seconds first, see sae_pipeline/__main__.py): the same line then.
    assert len(set(errors)) == 1 and len(errors) <= 2, log[-3000:]
    assert "Traceback" not in log
    expected = {
        "no config": "error: missing config file; usage: sbatch slurm/train.sh CONFIG.yaml",
        "missing config": "error: config file 'configs/nope.yaml' not found",
        "too few shards": "6 training shards < ranks x workers = 2 x 4 = 8; lower --data.num_workers",
    }[case]
    assert expected in errors[0], errors[0]


@pytest.mark.slow
def test_sweep_trains_each_entry_into_its_own_run(cluster: SlurmCluster, shards: Path, tmp_path: Path) -> None:
    mp_config = tmp_path / "mp_shards.yaml"
    mp_text = DEMO_CONFIG.read_text().replace("sae_pipeline.sae.TopKSAE", "sae_pipeline.sae.MatchingPursuitSAE")
    mp_config.write_text(mp_text.replace("      dead_after_tokens: 2048\n", ""))
    sweep_list = tmp_path / "sweep.txt"
    sweep_list.write_text(f"# two configs\n{DEMO_CONFIG}\n\n{mp_config} --model.sae.init_args.k 4\n")
    (tmp_path / "logs").mkdir()
    env = {
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "SBATCH_GRES": "none",
        "PYTHONWARNINGS": "ignore",
        "TRAIN_SCRIPT": str(TRAIN_SH),
    }
    # One task per array element (1 CPU each): both run at once on the 2-CPU node.
    job_id = cluster.sbatch(
        [
            "--array=0-1",
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            "--mem=1G",
            f"--output={tmp_path}/logs/%x-%A_%a.out",
            str(SWEEP_SH),
            str(sweep_list),
            "--",
            "--data.source",
            str(shards),
            "--trainer.max_epochs",
            "4",
            *QUIET,
        ],
        env=env,
        cwd=tmp_path,
    )
    states = cluster.wait(job_id, timeout=300)
    log = log_text(tmp_path)
    assert sorted(states.values()) == ["COMPLETED 0:0"] * 2, f"{states}\n{log[-4000:]}"
    expected = {"demo_shards": f"slurm-{job_id}_0", "mp_shards-k4": f"slurm-{job_id}_1"}
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(expected)
    for name, version in expected.items():
        assert logged_steps(tmp_path / "runs" / name / version)[-1], name  # its own TensorBoard events
        checkpoint = torch.load(tmp_path / "runs" / name / version / "checkpoints" / "last.ckpt", weights_only=True)
        assert checkpoint["global_step"] == 4 * 6  # 1 rank: 6 steps per epoch
    mp = torch.load(
        tmp_path / "runs" / "mp_shards-k4" / expected["mp_shards-k4"] / "checkpoints" / "last.ckpt", weights_only=True
    )
    assert mp["sae_config"]["class_path"].endswith("MatchingPursuitSAE") and mp["sae_config"]["init_args"]["k"] == 4
