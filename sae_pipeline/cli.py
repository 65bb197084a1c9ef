"""The ``python -m sae_pipeline {fit,validate,test,predict}`` command (LightningCLI).

The constructors are the config (jsonargparse): ``model`` is :class:`SAEModule` with its
``sae`` given as ``class_path`` / ``init_args`` (``MatchingPursuitSAE``,
``sae_pipeline.sae.TopKSAE``, ...), ``data`` is :class:`ActivationDataModule`.
What this subclass adds to LightningCLI:

- ``data.d_in`` is linked into ``model.sae.init_args.d_in`` when the classes are
  instantiated, so the width comes from the data (manifest) and is never typed twice.
- Always-on callbacks, configurable from the YAML or flags: ``--checkpoint.*``
  (ModelCheckpoint, ``save_last: true``), ``--figures.*`` (SAEFigures, the TensorBoard
  figures) and ``--codes.fpath`` (where ``predict`` writes the codes; inert otherwise).
- TensorBoardLogger by default, under ``runs/<config file stem>/`` (``runs/sae`` without a
  config); checkpoints go to ``runs/<name>/checkpoints`` (not per logger version), so
  ``fit --ckpt_path last`` finds the previous run's ``last.ckpt``.
- Under SLURM (``srun``, see ``slurm/train.sh``) the TensorBoard version is ``slurm-<job id>``
  (``slurm-<array job>_<task>`` in an array) and ``trainer.default_root_dir`` is that version
  directory, where Lightning saves and looks for its hpc checkpoint: a requeued job (same id)
  resumes from it and logs into the same run (:mod:`sae_pipeline.requeue`), even when the
  submission said ``--ckpt_path``.
- The optimiser and schedule belong to the module (paper recipe), not to CLI flags.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from sae_pipeline.callbacks import SAEFigures
from sae_pipeline.data import ActivationDataModule
from sae_pipeline.module import SAEModule
from sae_pipeline.predict import CodesPredictionWriter
from sae_pipeline.requeue import SLURMRequeue, hpc_checkpoints, slurm_job_tag
from sae_pipeline.sae import (  # noqa: F401 -- imported so that bare class names resolve in configs
    BatchTopKSAE,
    JumpReLUSAE,
    MatchingPursuitSAE,
    ReLUSAE,
    TopKSAE,
)

DEFAULT_RUNS_DPATH = "runs"
DEFAULT_RUN_NAME = "sae"
PROG = "python -m sae_pipeline"
DESCRIPTION = ("Train (fit), evaluate (validate, test) and apply (predict: codes to HDF5) sparse autoencoders "
               "on token activations. Export a checkpoint with: python -m sae_pipeline export --ckpt_path FILE "
               "--out DIR (see its --help); extract features with: python -m sae_pipeline extract ... (the flags of "
               "python -m feature_extraction).")


class SAEArgumentParser(LightningArgumentParser):
    """Parse errors print one usage line, the ``--help`` tip and the error (not ~90 lines of usage)."""

    def print_usage(self, file: Any = None) -> None:
        print(f"usage: {self.prog.replace(' [options]', '')} [options]", file=file)


class SAECLI(LightningCLI):
    """LightningCLI for :class:`SAEModule` + :class:`ActivationDataModule` (see the module docstring)."""

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_kwargs", {"prog": PROG, "description": DESCRIPTION})
        kwargs.setdefault("trainer_defaults", {"callbacks": [SLURMRequeue()]})
        super().__init__(SAEModule, ActivationDataModule, args=args, run=run, auto_configure_optimizers=False,
                         parser_class=SAEArgumentParser, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.d_in", "model.sae.init_args.d_in", apply_on="instantiate")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True})
        parser.add_lightning_class_args(SAEFigures, "figures")
        parser.add_lightning_class_args(CodesPredictionWriter, "codes")
        parser.set_defaults({
            "trainer.logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": DEFAULT_RUNS_DPATH, "name": None, "default_hp_metric": False},
            },
        })

    def before_instantiate_classes(self) -> None:
        """Name the TensorBoard run after the config file and put checkpoints beside it."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        run_name = DEFAULT_RUN_NAME
        config_fpaths = config.get("config") or []
        if config_fpaths:
            run_name = Path(str(config_fpaths[-1])).stem
        logger = config.trainer.get("logger")
        save_dir = DEFAULT_RUNS_DPATH
        tensorboard = isinstance(logger, Namespace) and str(logger.get("class_path", "")).endswith("TensorBoardLogger")
        if tensorboard:
            if logger.init_args.get("name") is None:
                logger.init_args.name = run_name
            save_dir, run_name = logger.init_args.save_dir, logger.init_args.name
        if config.checkpoint.get("dirpath") is None:
            config.checkpoint.dirpath = str(Path(save_dir) / run_name / "checkpoints")
        job = slurm_job_tag()
        if tensorboard and job is not None:
            self._follow_slurm_job(config, logger, job)

    def _follow_slurm_job(self, config: Namespace, logger: Namespace, job: str) -> None:
        """One SLURM job, one TensorBoard run: ``runs/<name>/slurm-<job>``, also Lightning's hpc
        checkpoint directory. A requeued job resumes from its hpc checkpoint whatever ``--ckpt_path``."""
        if logger.init_args.get("version") is None:
            logger.init_args.version = f"slurm-{job}"
        version_dpath = Path(logger.init_args.save_dir) / logger.init_args.name / str(logger.init_args.version)
        if config.trainer.get("default_root_dir") is None:
            config.trainer.default_root_dir = str(version_dpath)
        if self.subcommand == "fit" and hpc_checkpoints(config.trainer.default_root_dir):
            config.ckpt_path = None  # Lightning then restores the newest hpc checkpoint (SLURM only)


def cli_main(args: Any = None, run: bool = True) -> SAECLI:
    """Entry point of ``python -m sae_pipeline`` (also used by tests with ``args=[...]``)."""
    return SAECLI(args=args, run=run)
