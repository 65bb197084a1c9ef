"""Every private Lightning attribute the product touches, in one place.

Lightning has no public API for a few things we need: the trainer's cluster environment
(SLURM requeue), the path of its next hpc checkpoint, whether this step's logged values are
written, the step its loggers stamp on scalars, and dropping the training loader that
``estimated_stepping_batches`` builds too early on a resumed run. Each is reached here and
nowhere else, so a Lightning release that moves one breaks one function, and
``tests/test_lightning_compat.py`` (which runs each against a real ``Trainer``) fails, naming it.

``pyproject.toml`` caps ``lightning`` below the next minor release for the same reason; raise
the cap once the test passes on the new version. Verified on :data:`VERIFIED_LIGHTNING`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import lightning as L
    from lightning.fabric.plugins.environments import ClusterEnvironment

VERIFIED_LIGHTNING = "2.6"  # the major.minor whose internals these functions were written against


def cluster_environment(trainer: L.Trainer) -> ClusterEnvironment:
    """The trainer's cluster environment (``SLURMEnvironment`` under SLURM), for any strategy.

    ``trainer.strategy.cluster_environment`` exists only for parallel strategies; the connector
    has it for single-device runs too.
    """
    return trainer._accelerator_connector.cluster_environment


def hpc_save_path(trainer: L.Trainer, folder: str) -> str:
    """``folder/hpc_ckpt_<n+1>.ckpt``: where Lightning's own SLURM handler would save, so that its
    restore on restart (newest ``hpc_ckpt_*``) finds our checkpoint."""
    return trainer._checkpoint_connector.hpc_save_path(folder)


def should_update_logs(trainer: L.Trainer) -> bool:
    """Whether the values logged in this training step are written (``log_every_n_steps``)."""
    return bool(trainer._logger_connector.should_update_logs)


def batches_that_stepped(trainer: L.Trainer) -> int:
    """The step Lightning's loggers stamp on scalars logged now (as its ``LearningRateMonitor`` uses)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def has_train_loader(trainer: L.Trainer) -> bool:
    """Whether the fit loop holds a built training loader."""
    return trainer.fit_loop._combined_loader is not None


def discard_train_loader(trainer: L.Trainer) -> None:
    """Drop the fit loop's training loader and its fetcher (the loop rebuilds both when it starts)."""
    fit_loop = trainer.fit_loop
    if fit_loop._data_fetcher is not None:
        fit_loop._data_fetcher.teardown()
    fit_loop._combined_loader, fit_loop._data_fetcher = None, None
