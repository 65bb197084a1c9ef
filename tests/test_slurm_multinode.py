"""`sbatch --nodes=2 slurm/train.sh` on a real two-node SLURM: DDP across hosts, then a requeue.

The two nodes are test hosts on this machine (tests/slurm_cluster.py with nodes=2, built on
tests/node_network.py): each slurmd runs in its own network namespace with its own address on a
bridge, its own hostname (n1, n2) and an /etc/hosts naming the nodes. Lightning's SLURMEnvironment
takes the node rank and MASTER_ADDR (n1) from SLURM, and gloo connects the two ranks across the
bridge (each namespace has only its own loopback). What differs from two machines: one kernel,
one file system (as a cluster's shared disk) and the machine's two cores split between the nodes.

One job does it all (about 2 minutes on a quiet 2-core box): it trains, gets SIGUSR1 mid-run
(`scancel --signal=USR1`), requeues itself, resumes on both nodes from the hpc checkpoint and
finishes; its final validation R² must equal a single process's validation of the final weights.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import system_tools
import torch
from slurm_cluster import MULTINODE_EXECUTABLES, MULTINODE_INSTALL_HINT, SlurmCluster
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO_DPATH = Path(__file__).resolve().parents[1]
TRAIN_SH = REPO_DPATH / "slurm" / "train.sh"
DIGITS_CONFIG = REPO_DPATH / "configs" / "mpsae_digits.yaml"
EPOCHS, VAL_EVERY = 60, 30
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def job_fields(cluster: SlurmCluster, job_id: str) -> dict[str, str]:
    shown = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], env=cluster.env, capture_output=True, text=True
    ).stdout
    return dict(field.split("=", 1) for field in shown.split() if "=" in field)


def nodes_idle(cluster: SlurmCluster) -> bool:
    """Every node IDLE, none still COMPLETING the previous run."""
    shown = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=cluster.env, capture_output=True, text=True).stdout
    return shown.split() == ["idle"] * cluster.nodes


def scalars(run_dpath: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of `tag` over every TensorBoard event file under run_dpath, in step order."""
    found = []
    for fpath in run_dpath.rglob("events.out.tfevents.*"):
        events = EventAccumulator(str(fpath), size_guidance={"scalars": 0})
        events.Reload()
        if tag in events.Tags()["scalars"]:
            found += [(event.step, event.value) for event in events.Scalars(tag)]
    return sorted(found)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_node_job_trains_across_the_bridge_requeues_and_resumes_on_both_nodes(tmp_path: Path) -> None:
    system_tools.require(MULTINODE_EXECUTABLES, MULTINODE_INSTALL_HINT)
    system_tools.require_root("the test makes network namespaces and a bridge")
    workdir = tmp_path / "work"
    (workdir / "logs").mkdir(parents=True)
    # The interpreter as train.sh starts it on each node, saying first where it runs.
    python = tmp_path / "python"
    python.write_text(
        '#!/bin/sh\necho "task $SLURM_PROCID/$SLURM_NTASKS node $SLURM_NODEID host $(hostname) '
        'address $(getent hosts "$(hostname)" | cut -d" " -f1) restart ${SLURM_RESTART_COUNT:-0}" >&2\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    env = {"PYTHON": str(python), "OMP_NUM_THREADS": "1", "SBATCH_GRES": "none", "PYTHONWARNINGS": "ignore"}
    args = [
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=1",
        "--mem=1G",
        f"--output={workdir}/logs/%x-%j.out",
        str(TRAIN_SH),
        str(DIGITS_CONFIG),
        "--trainer.max_epochs",
        str(EPOCHS),
        "--trainer.check_val_every_n_epoch",
        str(VAL_EVERY),
        "--checkpoint.every_n_train_steps",
        "5",
        *QUIET,
    ]

    def log() -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted((workdir / "logs").glob("*.out")))

    with SlurmCluster(tmp_path / "cluster", nodes=2) as cluster:
        addresses = cluster.network.addresses
        job_id = cluster.sbatch(args, env=env, cwd=workdir)
        run_dpath = workdir / "runs" / "mpsae_digits"
        deadline = time.time() + 400
        while not list(run_dpath.rglob("last.ckpt")):  # training is under way on both nodes (step >= 5)
            assert time.time() < deadline and job_fields(cluster, job_id)["JobState"] in ("PENDING", "RUNNING"), log()[
                -3000:
            ]
            time.sleep(0.2)
        # To every task on both nodes (no --batch), as SLURM's --signal=SIGUSR1@90 does.
        subprocess.run(["scancel", "--signal=USR1", job_id], env=cluster.env, check=True)
        while (fields := job_fields(cluster, job_id))["Restarts"] == "0" or fields["JobState"] != "PENDING":
            assert time.time() < deadline and fields["JobState"] in ("RUNNING", "COMPLETING", "REQUEUED", "PENDING"), (
                f"{fields}\n{log()[-3000:]}"
            )
            time.sleep(0.2)
        # Release the requeued job (SLURM holds it ~2 minutes) once both nodes cleaned up, a second later
        # (a launch within the second of the credential's revocation is killed; see test_slurm_train.py).
        while not nodes_idle(cluster):
            assert time.time() < deadline, "the nodes did not become idle"
            time.sleep(0.2)
        time.sleep(2.0)
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=cluster.env, check=True)
        states = cluster.wait(job_id, timeout=max(deadline - time.time(), 60))
        final_fields = job_fields(cluster, job_id)
    text = log()
    assert states == {job_id: "COMPLETED 0:0"}, f"{states}\n{text[-4000:]}"
    assert final_fields["NodeList"] == "n[1-2]" and final_fields["NumNodes"] == "2", final_fields

    # Both runs of the job: rank 0 on n1 and rank 1 on n2, each at its own address on the bridge.
    for restart in (0, 1):
        for rank, host in ((0, "n1"), (1, "n2")):
            line = f"task {rank}/2 node {rank} host {host} address {addresses[host]} restart {restart}"
            assert line in text, text[-4000:]
    assert text.count("Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2") == 2, text[-4000:]
    assert text.count("train: config=") == 2 and "nodes=2 tasks/node=1" in text and "restart=1" in text

    # The requeue: hpc checkpoint mid-run, restored by the second run, which finished the schedule.
    hpc_fpaths = list(run_dpath.rglob("hpc_ckpt_*.ckpt"))
    assert len(hpc_fpaths) == 1, hpc_fpaths
    hpc = torch.load(hpc_fpaths[0], weights_only=True)
    saved_step = hpc["global_step"]
    loader_state = hpc["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader_state["world_size"] == 2
    relative = hpc_fpaths[0].relative_to(workdir)
    assert f"Saved {relative} at global step {saved_step}; requeueing SLURM job {job_id}" in text, text[-4000:]
    assert f"Restored all states from the checkpoint at {relative}" in text
    (last_fpath,) = run_dpath.rglob("last.ckpt")
    final = torch.load(last_fpath, weights_only=True)
    steps_per_epoch = final["global_step"] // EPOCHS
    assert final["global_step"] == EPOCHS * steps_per_epoch and 5 <= saved_step < final["global_step"]
    assert loader_state["epoch"] * steps_per_epoch + loader_state["batches_done"] == saved_step
    losses = scalars(run_dpath, "train/loss")
    assert losses[-1][0] == final["global_step"] - 1  # logged on through the end, in the same run

    # The two-node validation (metric states reduced across the bridge) equals one process's.
    val_r2 = scalars(run_dpath, "val/r2")
    assert len(val_r2) == EPOCHS // VAL_EVERY and val_r2[-1][0] >= losses[-1][0]  # the last one: final weights
    from sae_pipeline.data import ActivationDataModule
    from sae_pipeline.training.module import SAEModule

    module = SAEModule.load_from_checkpoint(last_fpath, weights_only=True)
    datamodule = ActivationDataModule("digits", batch_size=256, num_workers=0, shuffle_buffer_tokens=2048)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    single = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    assert single["val/r2"] == pytest.approx(val_r2[-1][1], abs=1e-6)
