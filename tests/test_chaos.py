"""kill -9 ``fit`` at random moments, resume each time with ``--ckpt_path last``: the run ends at the
uninterrupted run's step, with its weights and its data order (issue 10, item 5).

One kill lands inside a save of ``last.ckpt``: the checkpoint plugin of ``tests/pause_io.py`` makes
the save write half of its bytes and sleep, and the process is killed there; the previous checkpoint
must still load and be the one ``last`` picks. The data order is checked step by step through the
TensorBoard ``train/loss`` of every process (read back from the event files): each logged step's
loss equals the uninterrupted run's at that step, and together they cover every step but, at most,
the last step before each checkpoint a kill resumed from: Lightning saves a step's checkpoint before it
logs that step (and flushes the logger after each log), so a kill in between loses that one point.
The moments are drawn from a seed printed in any failure message.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import fork_server
import pytest
import torch
from pause_io import env_with_repo_root, pause_in_save_args
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sae_pipeline.training.checkpointing import newest_checkpoint

REPO_DPATH = Path(__file__).resolve().parents[1]
MAX_STEPS = 30  # 6 batches per epoch on digits: the kills fall in different epochs
ARGS = [
    "fit",
    "--config",
    str(REPO_DPATH / "configs" / "mpsae_digits.yaml"),
    "--trainer.max_steps",
    str(MAX_STEPS),
    "--trainer.max_epochs",
    "-1",
    "--trainer.check_val_every_n_epoch",
    "1000",
    "--trainer.log_every_n_steps",
    "1",
    "--checkpoint.every_n_train_steps",
    "1",
    "--model.sae.init_args.d_sae",
    "1000",
    "--trainer.logger.init_args.max_queue",
    "1",
    "--trainer.logger.init_args.flush_secs",
    "1",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
TIMEOUT_S = 300


def launch(cwd: Path, resume: bool, extra: list[str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "sae_pipeline", *ARGS, *(["--ckpt_path", "last"] if resume else []), *(extra or [])],
        cwd=cwd,
        env=env_with_repo_root(ENV),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def newest_step(cwd: Path) -> int:
    """The global step of what ``--ckpt_path last`` would resume from now (-1: nothing yet)."""
    fpath = newest_checkpoint([cwd / "runs" / "mpsae_digits"])
    return -1 if fpath is None else int(torch.load(fpath, weights_only=True)["global_step"])


def wait_until(condition, process: subprocess.Popen, context: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert process.poll() is None, f"{context}: exited {process.returncode}\n{process.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"{context}: timed out"
        time.sleep(0.05)


def kill9(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL


def logged_losses(cwd: Path) -> dict[int, list[float]]:
    """``train/loss`` by step over every process's event files (all versions)."""
    losses: dict[int, list[float]] = {}
    for fpath in sorted(cwd.glob("runs/mpsae_digits/version_*/events.out.tfevents.*")):
        events = EventAccumulator(str(fpath), size_guidance={"scalars": 0})
        events.Reload()
        if "train/loss" in events.Tags()["scalars"]:
            for event in events.Scalars("train/loss"):
                losses.setdefault(event.step, []).append(event.value)
    return losses


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_gives_the_uninterrupted_run(tmp_path: Path) -> None:
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    context = f"seed {seed}"
    reference_dpath, chaos_dpath = tmp_path / "reference", tmp_path / "chaos"
    reference_dpath.mkdir()
    chaos_dpath.mkdir()
    reference = launch(reference_dpath, resume=False)  # runs while the chaos starts: two cores, two processes

    # 1. a fresh run, killed a random moment after a random step
    process = launch(chaos_dpath, resume=False)
    target = rng.randint(2, 8)
    wait_until(lambda: newest_step(chaos_dpath) >= target, process, f"{context}, first run")
    time.sleep(rng.uniform(0, 0.2))
    kill9(process)
    resumed_from = [newest_step(chaos_dpath)]

    # 2. resumed, killed while it writes a checkpoint (half the bytes on disk)
    before = newest_step(chaos_dpath)
    marker = tmp_path / "in-save"
    pause_step = before + rng.randint(1, 4)
    process = launch(chaos_dpath, resume=True, extra=pause_in_save_args(pause_step, marker))
    wait_until(marker.exists, process, f"{context}, paused save")
    kill9(process)
    partial = list(chaos_dpath.glob("runs/mpsae_digits/version_*/checkpoints/.last.ckpt.partial"))
    assert partial, context  # the killed save of last.ckpt left only its hidden partial file...
    assert pause_step - 1 <= newest_step(chaos_dpath) < pause_step, context  # ...and last is the previous save
    resumed_from.append(newest_step(chaos_dpath))

    # 3. resumed, killed a random moment after a random number of further steps
    process = launch(chaos_dpath, resume=True)
    target = newest_step(chaos_dpath) + rng.randint(1, 8)
    wait_until(lambda: newest_step(chaos_dpath) >= target, process, f"{context}, third run")
    time.sleep(rng.uniform(0, 0.2))
    kill9(process)
    resumed_from.append(newest_step(chaos_dpath))

    # 4. resumed to the end
    final = fork_server.run(
        [sys.executable, "-m", "sae_pipeline", *ARGS, "--ckpt_path", "last"],
        cwd=chaos_dpath,
        env=ENV,
        timeout=TIMEOUT_S,
    )
    assert final.returncode == 0, f"{context}\n{final.stderr[-3000:]}"
    _, reference_err = reference.communicate(timeout=TIMEOUT_S)
    assert reference.returncode == 0, reference_err[-3000:]

    ended = torch.load(newest_checkpoint([chaos_dpath / "runs" / "mpsae_digits"]), weights_only=True)
    expected = torch.load(reference_dpath / "runs/mpsae_digits/version_0/checkpoints/last.ckpt", weights_only=True)
    assert ended["global_step"] == expected["global_step"] == MAX_STEPS, context
    for name, value in expected["state_dict"].items():
        torch.testing.assert_close(ended["state_dict"][name], value, rtol=0, atol=0, msg=f"{context}: {name}")

    # Data order: every step's batch gave the reference's loss, in whichever process trained it.
    reference_losses = {step: values[0] for step, values in logged_losses(reference_dpath).items()}
    chaos_losses = logged_losses(chaos_dpath)
    assert sorted(reference_losses) == list(range(MAX_STEPS))
    missing = set(range(MAX_STEPS)) - set(chaos_losses)
    assert missing <= {step - 1 for step in resumed_from}, f"{context}: {sorted(missing)} not logged ({resumed_from})"
    assert set(chaos_losses) <= set(range(MAX_STEPS)), context
    for step, values in chaos_losses.items():
        assert values == [reference_losses[step]] * len(values), f"{context}: step {step}"
