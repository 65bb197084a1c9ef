"""Every private Lightning attribute the product touches, in one place.

Lightning has no public API for a few things we need: the trainer's cluster environment
(SLURM requeue), the path of its next hpc checkpoint, whether this step's logged values are
written, the step its loggers stamp on scalars, dropping the training loader that
``estimated_stepping_batches`` builds too early on a resumed run, the CLI's reading of
``--ckpt_path`` (to resolve and check it first), Lightning's SIGTERM notifier (replaced by
:mod:`sae_pipeline.training.interrupts`) and ``ModelCheckpoint``'s ``last.ckpt`` save (to save the final
step, which it skips when ``max_steps`` is not a checkpoint step) and the CLI's hand-over of
hyper-parameters to ``save_hyperparameters`` (which a group's members must not take for theirs).
Each is reached here and nowhere else, so a Lightning release that moves one breaks one function, and
``tests/test_lightning_compat.py`` (which runs each against a real ``Trainer``) fails, naming it.

``pyproject.toml`` caps ``lightning`` below the next minor release for the same reason; raise
the cap once the test passes on the new version. Verified on :data:`VERIFIED_LIGHTNING`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters

if TYPE_CHECKING:
    import lightning as L
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch.callbacks import ModelCheckpoint

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


@contextmanager
def own_hyperparameters() -> Iterator[None]:
    """Modules built inside save their own arguments as hyper-parameters. LightningCLI hands the config of the
    module it instantiates to ``save_hyperparameters`` through a context variable, which a LightningModule
    built inside that one (a group's member) would take for its own."""
    token = _given_hyperparameters.set(None)
    try:
        yield
    finally:
        _given_hyperparameters.reset(token)


class CkptPathHook:
    """Mixin for ``LightningCLI``: run :meth:`prepare_ckpt_path` just before the CLI reads ``--ckpt_path``,
    and merge the hyper-parameters it read.

    ``LightningCLI._parse_ckpt_path`` (private, called between parsing and instantiation) loads the
    checkpoint's hyper-parameters into the model's config, but only when ``--ckpt_path`` is an existing
    file: ``last`` passes through unread, and a truncated or foreign file raises torch's traceback
    (which advises ``weights_only=False``). The subclass's ``prepare_ckpt_path`` resolves ``last`` to a
    file, validates it and returns the hyper-parameters it read (the product's one checkpoint reader,
    :mod:`sae_pipeline.artifacts.checkpoint`), which :func:`merge_ckpt_hyper_parameters` merges as
    Lightning would: Lightning never reads the file a second time for them, so what it merges is what
    was checked. A ``prepare_ckpt_path`` that returns None leaves the reading to Lightning.
    """

    def prepare_ckpt_path(self) -> dict[str, Any] | None:  # pragma: no cover - overridden
        """Resolve and check ``self.config[subcommand].ckpt_path`` (the subclass implements it); return the
        checkpoint's hyper-parameters, or None for Lightning to read them."""
        return None

    def _parse_ckpt_path(self) -> None:
        hyper_parameters = self.prepare_ckpt_path()
        if hyper_parameters is None:
            super()._parse_ckpt_path()  # type: ignore[misc]
        else:
            merge_ckpt_hyper_parameters(self, hyper_parameters)


def merge_ckpt_hyper_parameters(cli: Any, hyper_parameters: dict[str, Any]) -> None:
    """Merge a checkpoint's saved model hyper-parameters into ``cli.config``, as ``LightningCLI._parse_ckpt_path``
    does with those it reads itself; a ``_class_path`` naming the CLI's own model class (its module's path
    after a move, :data:`sae_pipeline.artifacts.checkpoint.MOVED_MODULES`) is dropped where the CLI takes no
    model class (Lightning would pass it on, and the parse would refuse it)."""
    hparams = dict(hyper_parameters)
    hparams.pop("_instantiator", None)
    if not hparams:
        return
    if "_class_path" in hparams:
        own = cli._model_class
        if not cli.subclass_mode_model and hparams["_class_path"] == f"{own.__module__}.{own.__qualname__}":
            del hparams["_class_path"]
        else:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
    try:
        cli.config = cli.parser.parse_object({cli.config.subcommand: {"model": hparams}}, cli.config)
    except SystemExit:
        sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
        raise


def mute_sigterm_notifier(trainer: L.Trainer) -> None:
    """Keep Lightning's own SIGTERM handling out of the way of :mod:`sae_pipeline.training.interrupts`.

    Lightning's notifier (registered when a stage starts, composed with the handler already
    installed) forwards the signal to the launcher's children, runs a ``dist.broadcast`` *inside
    the signal handler* (a collective that pairs with whatever the other ranks are doing) and
    makes the loops raise ``SIGTERMException``: exit status 0, no checkpoint. Replacing the
    connector's bound notifier before it registers leaves only our handler doing anything.
    """
    trainer._signal_connector._sigterm_notifier_fn = _ignore_signal


def _ignore_signal(signum: int, frame: object) -> None:
    return None


def last_saved_step(callback: ModelCheckpoint) -> int:
    """The global step of the newest checkpoint this ``ModelCheckpoint`` wrote (0 before any)."""
    return int(callback._last_global_step_saved)


def save_last_checkpoint(callback: ModelCheckpoint, trainer: L.Trainer) -> None:
    """Save ``last.ckpt`` now, the way ``ModelCheckpoint(save_last=True)`` does after a periodic save
    (same name, same bookkeeping of ``last_model_path``); every rank must call it."""
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The keyword arguments a ``DDPStrategy`` passes to ``DistributedDataParallel`` when it wraps the module
    (the dict itself: a change made before ``strategy.setup`` reaches the wrapper). Lightning keeps them
    private; its constructor takes them as ``**kwargs`` only."""
    return strategy._ddp_kwargs


def ddp_comm_hook(strategy: Any) -> Any:
    """The communication hook a ``DDPStrategy`` was given (``ddp_comm_hook=``), or None. Lightning registers it
    itself, on CUDA only."""
    return strategy._ddp_comm_hook
