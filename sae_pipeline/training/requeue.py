"""Pre-emption on SLURM: Lightning's hpc checkpoint and requeue, taken at a step boundary.

SLURM warns a job before stopping it (``#SBATCH --signal=SIGUSR1@90`` in ``slurm/train.sh``,
or ``scancel --signal=USR1 JOB``). Lightning's own handler saves the hpc checkpoint *inside
the signal handler*, i.e. wherever the interpreter happens to be: in the middle of a
training step, or, under DDP, while the other rank already waits in the step's gradient
all-reduce, where the checkpoint's barrier pairs with the wrong collective (see
Lightning-AI/pytorch-lightning#21406). So :class:`SLURMRequeue` installs its handler first
(Lightning then keeps it and adds none of its own); the handler only sets a flag. After
each training batch (and each validation run) every rank contributes its flag to one
all-reduce; once any rank got the signal, all of them save Lightning's hpc checkpoint
together, global rank 0 requeues the job with ``scontrol requeue``, and every rank exits.

Resume is Lightning's: under SLURM, ``fit`` without ``--ckpt_path`` restores the newest
``hpc_ckpt_<n>.ckpt`` in ``trainer.default_root_dir``, which :mod:`sae_pipeline.cli` makes
the run's TensorBoard directory ``runs/<name>/slurm-<job id>``. A requeued job keeps its id,
so it finds the checkpoint and logs on into the same run; a new job starts a new one.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from sae_pipeline.training import lightning_compat
from sae_pipeline.training.step_boundary import StepBoundaryCallback, max_over_ranks


def slurm_job_tag() -> str | None:
    """``<array job>_<task>`` for an array task, else ``<job id>``; None where Lightning would not
    use SLURMEnvironment (no ``srun``, or an interactive job named ``bash`` / ``interactive``)."""
    if "SLURM_NTASKS" not in os.environ or os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return os.environ.get("SLURM_JOB_ID")


def hpc_checkpoints(dpath: str | Path) -> list[Path]:
    """Lightning's ``hpc_ckpt_<n>.ckpt`` files in ``dpath``, oldest (lowest n) first."""
    found = []
    for fpath in Path(dpath).glob("hpc_ckpt_*.ckpt"):
        number = fpath.stem.removeprefix("hpc_ckpt_")
        if number.isdigit():
            found.append((int(number), fpath))
    return [fpath for _, fpath in sorted(found)]


class SLURMRequeue(StepBoundaryCallback):
    """On SLURM's requeue signal: hpc checkpoint at a step boundary, ``scontrol requeue``, exit.

    Inert outside SLURM, outside ``fit``, and with ``SLURMEnvironment(auto_requeue=False)``.
    Costs one one-element all-reduce per training step under DDP (Lightning's own loop
    already broadcasts its SIGTERM flag every step).
    """

    def __init__(self) -> None:
        self.signal_received = False
        self._signum: int | None = None
        self._previous_handler: Any = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signal_received = True  # nothing else: the work happens at the next step boundary

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        environment = lightning_compat.cluster_environment(trainer)
        if stage != "fit" or not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
            return
        self.signal_received = False
        self._signum = environment.requeue_signal or signal.SIGUSR1
        # Installed before the trainer registers its handlers, so Lightning keeps this one for the signal.
        self._previous_handler = signal.signal(self._signum, self._on_signal)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_handler()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore_handler()

    def _restore_handler(self) -> None:
        if self._signum is not None:
            signal.signal(self._signum, self._previous_handler)
            self._signum = None

    def _check(self, trainer: L.Trainer) -> None:
        if self._signum is None or not max_over_ranks(trainer, int(self.signal_received)):
            return
        for logger in trainer.loggers:
            logger.finalize("finished")  # as Lightning's handler does: flush the metrics logged so far
        root = Path(trainer.default_root_dir)
        fpath = lightning_compat.hpc_save_path(trainer, str(root))
        trainer.save_checkpoint(fpath)  # full state (optimiser, loops); every rank takes part, rank 0 writes
        requeued = max_over_ranks(trainer, int(trainer.is_global_zero and self._requeue(fpath, trainer.global_step)))
        if not requeued:
            rank_zero_warn(
                f"could not requeue the SLURM job; training goes on until SLURM stops it. Resume by hand "
                f"with --ckpt_path {fpath}"
            )
            self.signal_received = False
            return
        if trainer.is_global_zero:
            for old in hpc_checkpoints(root):
                if old != Path(fpath):
                    old.unlink(missing_ok=True)  # the newest one holds everything the older ones do
        raise SystemExit(0)

    @staticmethod
    def _requeue(fpath: str, global_step: int) -> bool:
        job = slurm_job_tag()
        if job is None:
            return False
        rank_zero_info(f"Saved {fpath} at global step {global_step}; requeueing SLURM job {job}")
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if result.returncode != 0:
            rank_zero_warn(f"`scontrol requeue {job}` failed: {result.stderr.strip()}")
            return False
        rank_zero_info(f"Requeued SLURM job {job}; it resumes from {fpath}")
        return True
