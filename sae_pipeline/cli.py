"""The ``python -m sae_pipeline {fit,validate,test,predict}`` command (LightningCLI).

The constructors are the config (jsonargparse): ``model`` is :class:`SAEModule` with its
``sae`` given as ``class_path`` / ``init_args`` (``MatchingPursuitSAE``,
``sae_pipeline.sae.TopKSAE``, ...), ``data`` is :class:`ActivationDataModule`.
What this subclass adds to LightningCLI:

- ``data.d_in`` is linked into ``model.sae.init_args.d_in`` when the classes are
  instantiated, so the width comes from the data (manifest) and is never typed twice.
- Always-on callbacks, configurable from the YAML or flags: ``--checkpoint.*``
  (:class:`~sae_pipeline.training.checkpointing.SAECheckpoint`, a ModelCheckpoint that also saves the
  final step; ``save_last: true``), ``--figures.*`` (SAEFigures, the TensorBoard figures) and
  ``--codes.fpath`` (where ``predict`` writes the codes; inert otherwise), ``--ddp.*`` (DDP's gradient
  all-reduce: bucket views, optional bf16/fp16 compression; `sae_pipeline.training.ddp`); SIGTERM / Ctrl-C save
  and exit 143 / 130 (:mod:`sae_pipeline.training.interrupts`); checkpoints are written atomically.
- TensorBoardLogger by default, under ``runs/<config file stem>/version_N`` (the last ``--config``
  file's; ``runs/<config stem>_<data file stem>`` when ``--data FILE`` is given too, so that
  ``--config configs/vision/mpsae.yaml --data configs/data/dinov2.yaml`` trains ``runs/mpsae_dinov2``
  like ``--config configs/mpsae_dinov2.yaml``; ``runs/sae`` without a config;
  ``--trainer.default_root_dir DIR`` replaces ``runs``), with that run's checkpoints
  in ``version_N/checkpoints/`` (:mod:`sae_pipeline.training.checkpointing`). ``--ckpt_path last`` is the
  newest checkpoint over the config's runs; ``fit`` ends by printing its final checkpoint and
  TensorBoard directory.
- ``validate``, ``test`` and ``predict`` write no TensorBoard run (no ``version_N`` folder beside the
  training runs, no ``config.yaml``): their metrics are printed, their codes go to ``--codes.fpath``.
- ``validate``, ``test`` and ``predict`` need ``--ckpt_path``; every ``--ckpt_path`` is checked
  (exists, is a checkpoint of this package, fits the data's ``d_in``) before anything runs
  (:mod:`sae_pipeline.resume_checks`), and output folders are checked writable: one-line errors, exit 2.
- ``fit`` holds the lock of its own run folder (a new ``version_N``, claimed before anything is written to
  it) and, with ``--ckpt_path last``, of the run it resumes (:mod:`sae_pipeline.run_lock`): a second
  ``fit --ckpt_path last`` that resolves ``last`` to either is refused in one line, exit 2.
- Under SLURM (``srun``, see ``slurm/train.sh``) the TensorBoard version is ``slurm-<job id>``
  (``slurm-<array job>_<task>`` in an array) and ``trainer.default_root_dir`` is that version
  directory, where Lightning saves and looks for its hpc checkpoint: a requeued job (same id)
  resumes from it and logs into the same run (:mod:`sae_pipeline.training.requeue`), even when the
  submission said ``--ckpt_path``.
- The optimiser and schedule belong to the module (paper recipe), not to CLI flags.
"""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from feature_extraction.output_dirs import check_writable_dir, check_writable_file, dir_problem
from sae_pipeline.cli_args import (
    check_config_files,
    config_files,
    member_flags,
    merge_member_flags,
    names_group,
    normalize_args,
)
from sae_pipeline.data import ActivationDataModule
from sae_pipeline.resume_checks import EVALUATING, ResumeChecks, already_done
from sae_pipeline.run_lock import RunLocks
from sae_pipeline.sae import VARIANTS  # noqa: F401 -- imports every registered variant, so bare class names resolve in configs
from sae_pipeline.training import lightning_compat
from sae_pipeline.training.callbacks import SAEFigures
from sae_pipeline.training.checkpointing import AtomicCheckpointIO, SAECheckpoint
from sae_pipeline.training.ckpt_config import explicit_config
from sae_pipeline.training.ddp import DDPSettings
from sae_pipeline.training.group import SAEGroupModule
from sae_pipeline.training.interrupts import Interrupts
from sae_pipeline.training.module import SAEModule
from sae_pipeline.training.predict import CodesPredictionWriter
from sae_pipeline.training.requeue import SLURMRequeue, hpc_checkpoints, slurm_job_tag

DEFAULT_RUNS_DPATH = "runs"
DEFAULT_RUN_NAME = "sae"
PROG = "python -m sae_pipeline"
DESCRIPTION = (
    "Train (fit), evaluate (validate, test) and apply (predict: codes to HDF5) sparse autoencoders "
    "on token activations. Each fit run writes runs/<config stem>/version_N/ (TensorBoard) and "
    "version_N/checkpoints/last.ckpt; --ckpt_path last means the newest run's. Export a checkpoint with: "
    "python -m sae_pipeline export --ckpt_path FILE --out DIR (see its --help); extract features with: "
    "python -m sae_pipeline extract ... (the flags of python -m feature_extraction)."
)


class SAEArgumentParser(LightningArgumentParser):
    """Parse errors print one usage line, the ``--help`` tip and the error (not ~90 lines of usage)."""

    def print_usage(self, file: Any = None) -> None:
        print(f"usage: {self.prog.replace(' [options]', '')} [options]", file=file)


class FitConfigSaver(SaveConfigCallback):
    """LightningCLI's ``config.yaml`` beside a training run; ``validate``/``test``/``predict`` have no run folder."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            super().setup(trainer, pl_module, stage)


class SAECLI(lightning_compat.CkptPathHook, LightningCLI):
    """LightningCLI for :class:`SAEModule` + :class:`ActivationDataModule` (see the module docstring)."""

    def __init__(self, args: Any = None, run: bool = True, group: bool = False, **kwargs: Any) -> None:
        self.group = group  # model is SAEGroupModule (cli_args.names_group), else SAEModule
        self.run_dpath: Path | None = None
        self._prepared = False
        self._resume: ResumeChecks | None = None  # the checks of --ckpt_path, and what they kept of its checkpoint
        kwargs.setdefault("save_config_callback", FitConfigSaver)
        self._explicit: Namespace | None = None  # what config files and flags set (ckpt_config)
        given = sys.argv[1:] if args is None else args if isinstance(args, (list, tuple)) else []
        self._given_args = [str(arg) for arg in given]  # for the run name of --data FILE
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_kwargs", {"prog": PROG, "description": DESCRIPTION})
        kwargs.setdefault("trainer_defaults", {"callbacks": [SLURMRequeue(), Interrupts()]})
        self._locks = ExitStack()  # the run folders a fit writes and resumes, locked while the command runs
        self._run_locks = RunLocks(self._locks)
        self._claimed_version = False  # the logger's version is the version_N claimed for this fit
        with self._locks:
            super().__init__(
                SAEGroupModule if group else SAEModule,
                ActivationDataModule,
                args=args,
                run=run,
                auto_configure_optimizers=False,
                parser_class=SAEArgumentParser,
                **kwargs,
            )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        target = "model.d_in" if self.group else "model.sae.init_args.d_in"
        parser.link_arguments("data.d_in", target, apply_on="instantiate")
        parser.add_lightning_class_args(SAECheckpoint, "checkpoint")
        # enable_version_counter false: last.ckpt is overwritten, never joined by a stale last-v1.ckpt.
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.enable_version_counter": False})
        parser.add_lightning_class_args(SAEFigures, "figures")
        parser.add_lightning_class_args(CodesPredictionWriter, "codes")
        parser.add_lightning_class_args(DDPSettings, "ddp")
        parser.set_defaults(
            {
                "trainer.logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": DEFAULT_RUNS_DPATH, "name": None, "default_hp_metric": False},
                }
            }
        )

    # --- before instantiation: names, outputs, --ckpt_path ---------------------------------------
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse, and keep what the user set explicitly (:mod:`sae_pipeline.training.ckpt_config`). With ``--ckpt_path``
        and no ``model.sae`` the SAE is the checkpoint's: the check of required arguments waits until
        `sae_pipeline.resume_checks` has filled it in. ``--model.members.NAME.KEY`` flags are merged into their
        member (`sae_pipeline.cli_args.member_flags`): the parse without them gives the config's members,
        and the merged members are passed as one ``--model.members`` after every other argument."""
        if self.group and (args is None or isinstance(args, (list, tuple))):
            rest, flags = member_flags(sys.argv[1:] if args is None else list(args))
            first = explicit_config(parser, rest) if flags else None
            if first is not None:
                section = first.get(first.get("subcommand")) if first.get("subcommand") else first
                members = merge_member_flags(section.get("model.members"), flags)
                merged = [*rest, f"--model.members={json.dumps(members, default=str)}"]
                if args is None:  # as cli_main's normalize_args: LightningCLI reads sys.argv itself
                    sys.argv[1:] = merged
                else:
                    args = merged
        self._explicit = explicit_config(parser, args)
        subcommand = self._explicit.get("subcommand") if self._explicit is not None else None
        explicit = self._explicit.get(subcommand) if subcommand else None
        if (
            explicit is not None
            and explicit.get("ckpt_path")
            and explicit.get(self._model_key) is None
            and not isinstance(args, (dict, Namespace))
        ):
            self.config = parser.parse_args(args, _skip_validation=True)
            return
        super().parse_arguments(parser, args)

    def prepare_ckpt_path(self) -> dict[str, Any] | None:
        """Called by LightningCLI before it reads ``--ckpt_path`` (:class:`lightning_compat.CkptPathHook`); returns
        the checked checkpoint's hyper-parameters for the CLI to merge (None without ``--ckpt_path``)."""
        if self._prepared:
            return self._resume.hyper_parameters if self._resume is not None else None
        self._prepared = True
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        self._name_run(config, subcommand)
        self._check_outputs(config, subcommand)
        self._resume = ResumeChecks(self.parser, self.config, self._explicit, self.group, self._run_locks)
        self._resume.check_ckpt_path(config, subcommand, self.run_dpath)
        self._resume.check_requeued(config, subcommand, self._model_key)  # a requeued job's own model
        if subcommand == "fit" and self._resume.nothing_to_train is None:  # locked before its first write
            self._claimed_version = self._run_locks.fit_outputs(config, self._trained)
        return self._resume.hyper_parameters

    def _trained(self) -> bool:
        """Whether this fit trained a step (a failed fit's new version_N is removed otherwise: run_lock)."""
        trainer = getattr(self, "trainer", None)
        start = self._resume.start_step if self._resume is not None else 0
        return trainer is not None and trainer.global_step > start

    @property
    def _model_key(self) -> str:
        """The config key naming what is trained: the SAE, or a group's members."""
        return "model.members" if self.group else "model.sae"

    def before_instantiate_classes(self) -> None:
        self.prepare_ckpt_path()  # already done unless this Lightning has no _parse_ckpt_path

    def _name_run(self, config: Namespace, subcommand: str | None) -> None:
        """Name the TensorBoard run after the config file; ``--trainer.default_root_dir`` replaces ``runs``."""
        run_name = DEFAULT_RUN_NAME
        config_fpaths = config.get("config") or []
        if config_fpaths:
            run_name = Path(str(config_fpaths[-1])).stem
        data_fpaths = [name for name in config_files(self._given_args, "--data") if Path(name).is_file()]
        if data_fpaths:  # --config configs/vision/<variant>.yaml --data configs/data/<backbone>.yaml
            data_name = Path(data_fpaths[-1]).stem
            run_name = f"{run_name}_{data_name}" if config_fpaths else data_name
        logger = config.trainer.get("logger")
        root = config.trainer.get("default_root_dir")
        tensorboard = isinstance(logger, Namespace) and str(logger.get("class_path", "")).endswith("TensorBoardLogger")
        if tensorboard:
            if logger.init_args.get("name") is None:
                logger.init_args.name = run_name
            if root is not None and logger.init_args.get("save_dir") == DEFAULT_RUNS_DPATH:
                logger.init_args.save_dir = str(root)
            self.run_dpath = Path(logger.init_args.save_dir) / str(logger.init_args.name)
        else:
            self.run_dpath = Path(root if root is not None else DEFAULT_RUNS_DPATH) / run_name
            if root is None:
                config.trainer.default_root_dir = str(self.run_dpath)
        job = slurm_job_tag()
        if tensorboard and job is not None:
            self._follow_slurm_job(config, logger, job, subcommand)
        if tensorboard and subcommand in EVALUATING:
            config.trainer.logger = False  # nothing to plot: no version_N folder beside the training runs

    def _follow_slurm_job(self, config: Namespace, logger: Namespace, job: str, subcommand: str | None) -> None:
        """One SLURM job, one TensorBoard run: ``runs/<name>/slurm-<job>``, also Lightning's hpc
        checkpoint directory. A requeued job resumes from its hpc checkpoint whatever ``--ckpt_path``."""
        if logger.init_args.get("version") is None:
            logger.init_args.version = f"slurm-{job}"
        version_dpath = Path(logger.init_args.save_dir) / logger.init_args.name / str(logger.init_args.version)
        config.trainer.default_root_dir = str(version_dpath)
        if subcommand == "fit" and hpc_checkpoints(config.trainer.default_root_dir):
            config.ckpt_path = None  # Lightning then restores the newest hpc checkpoint (SLURM only)

    def _check_outputs(self, config: Namespace, subcommand: str | None) -> None:
        if subcommand == "fit" and self.run_dpath is not None:
            problem = dir_problem(self.run_dpath)
            if problem:
                raise ValueError(
                    f"the run folder {self.run_dpath} {problem}; pass --trainer.default_root_dir DIR "
                    "to write logs and checkpoints elsewhere"
                )
            if config.checkpoint.get("dirpath"):
                check_writable_dir(config.checkpoint.dirpath, "--checkpoint.dirpath")
        if subcommand == "predict":
            check_writable_file(config.codes.fpath, "--codes.fpath")

    # --- instantiation --------------------------------------------------------------------------
    def after_instantiate_classes(self) -> None:
        """The checkpoint's SAE must take the data's width (the model's d_in is linked from the data); the
        version claimed for this fit leaves the config once the logger has it."""
        trainer_config = (self.config[self.subcommand] if self.subcommand else self.config).get("trainer") or {}
        if self._claimed_version:  # the logger has it; the run's config.yaml must not pin a later fit to it
            trainer_config.logger.init_args.version = None
        if self.group and trainer_config.get("gradient_clip_val") is not None:
            raise ValueError(
                "--trainer.gradient_clip_val clips the norm of every SAE of a group together; clip each by its own "
                "norm with model.gradient_clip_val (every member) or model.members.NAME.gradient_clip_val"
            )
        if self._resume is not None:
            subcommand = self.subcommand or ""
            ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
            self._resume.check_data_width(self.datamodule, ckpt_path)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """The trainer, with checkpoints written atomically, and its set-up errors in one line."""
        config_init = self.config_init[self.subcommand] if self.subcommand else self.config_init
        plugins = (config_init.get("trainer") or {}).get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            plugins.append(AtomicCheckpointIO())
        kwargs.setdefault("plugins", plugins)
        try:
            return super().instantiate_trainer(**kwargs)
        except MisconfigurationException as exn:
            raise ValueError(trainer_setup_error(exn, config_init.get("trainer") or {})) from None

    # --- fit ------------------------------------------------------------------------------------
    @property
    def _nothing_to_train(self) -> str | None:
        """The line of a ``fit --ckpt_path`` already at ``--trainer.max_steps`` (it trains nothing), or None."""
        return self._resume.nothing_to_train if self._resume is not None else None

    def fit(self, model: Any, **kwargs: Any) -> None:
        """``trainer.fit``, unless ``--ckpt_path`` is already at ``--trainer.max_steps``: then one line says so and
        nothing runs, so no empty ``version_N`` is left (exit 0: the run is done, as a rerun of a finished job
        finds it; LightningCLI calls this method in place of ``trainer.fit``)."""
        if self._nothing_to_train is None:
            self.trainer.fit(model, **kwargs)
        elif rank_zero_only.rank == 0:
            print(self._nothing_to_train, flush=True)

    def after_fit(self) -> None:
        """Tell the user which files hold what this run trained (rank 0 only)."""
        trainer = self.trainer
        if not trainer.is_global_zero or self._nothing_to_train is not None:
            return
        callback = trainer.checkpoint_callback
        ckpt = getattr(callback, "last_model_path", None) or getattr(callback, "best_model_path", None)
        resumed = self.config[self.subcommand].get("ckpt_path") if self.subcommand else None
        done = already_done(trainer)
        if ckpt and self.group:
            for name in self.model.members:
                print(
                    f"Final checkpoint of {name} (global step {trainer.global_step}): {ckpt} "
                    f"(export --ckpt_path {ckpt} --name {name})",
                    flush=True,
                )
        elif ckpt:
            print(f"Final checkpoint (global step {trainer.global_step}): {ckpt}", flush=True)
        elif resumed and done:
            print(f"Nothing to train: {resumed} is already at {done}; raise it to train further", flush=True)
        else:
            print(
                f"No checkpoint saved (global step {trainer.global_step}; fast_dev_run or checkpointing off)",
                flush=True,
            )
        # the logger's own log_dir: Trainer.log_dir broadcasts, which hangs or fails on rank 0 alone
        log_dir = getattr(trainer.logger, "log_dir", None)
        if log_dir and self.group:
            print(f"TensorBoard runs: {log_dir}/<member>/   (tensorboard --logdir {log_dir})", flush=True)
        elif log_dir:
            print(f"TensorBoard run: {log_dir}   (tensorboard --logdir {trainer.logger.save_dir})", flush=True)


def trainer_setup_error(exn: Exception, trainer_config: Any) -> str:
    """One line for a Trainer that cannot be built here (e.g. ``--trainer.accelerator gpu`` without a GPU)."""
    first = str(exn).strip().splitlines()[0] if str(exn).strip() else type(exn).__name__
    accelerator = trainer_config.get("accelerator") if hasattr(trainer_config, "get") else None
    if str(accelerator or "auto") not in ("auto", "cpu"):
        return (
            f"--trainer.accelerator {accelerator}: not usable here ({first.split('. ')[0].rstrip('.!')}); "
            "use --trainer.accelerator cpu, or auto to take what is there"
        )
    return f"trainer settings: {first}"


def cli_main(args: Any = None, run: bool = True) -> SAECLI:
    """Entry point of ``python -m sae_pipeline`` (also used by tests with ``args=[...]``)."""
    group = False
    if args is None:
        sys.argv[1:] = normalize_args(sys.argv[1:])
        check_config_files(sys.argv[1:])
        group = names_group(sys.argv[1:])
    elif isinstance(args, (list, tuple)):
        args = normalize_args(list(args))
        check_config_files(args)
        group = names_group(args)
    return SAECLI(args=args, run=run, group=group)
