"""The resume checks: what `--ckpt_path` names, and whether its checkpoint fits the command.

`fit`, `validate`, `test` and `predict` take `--ckpt_path`; before anything is built (`sae_pipeline.cli` calls
these checks from `prepare_ckpt_path`) it is resolved and checked, so that a wrong one ends in one line, exit 2,
not in a traceback halfway through a run:

- `validate`, `test` and `predict` need one; `last` is the newest checkpoint of the config's runs (a resumed
  `fit` then holds the run's lock, `sae_pipeline.run_lock`);
- the checkpoint is read once, by the product's one reader (`sae_pipeline.artifacts.checkpoint`), and the model
  settings the user wrote must agree with it; an SAE left unset is the checkpoint's
  (`sae_pipeline.training.ckpt_config`);
- a requeued SLURM job without `model.sae` takes its model from its own hpc checkpoint;
- a `fit` already at `--trainer.max_steps` trains nothing and says so;
- once the data is built, it must give the `d_in` the checkpoint's SAE takes.

Kept apart from the LightningCLI subclass, which only wires these checks in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from sae_pipeline.artifacts.checkpoint import CheckpointError, checkpoint_d_in, read_checkpoint
from sae_pipeline.run_lock import RunLocks
from sae_pipeline.training.checkpointing import newest_checkpoint
from sae_pipeline.training.ckpt_config import (
    check_against_checkpoint,
    check_group_against_checkpoint,
    sae_label,
    sae_namespace,
    sets_sae_class,
)
from sae_pipeline.training.requeue import hpc_checkpoints

EVALUATING = ("validate", "test", "predict")  # the subcommands that apply a trained SAE: they need --ckpt_path
CKPT_NEEDS = ("global_step",)  # beyond the weights and the SAE: a Lightning training checkpoint


class ResumeChecks:
    """The checks of one command line's `--ckpt_path`, and what they keep of its checkpoint once it is dropped.

    `parser` and `config` are the CLI's (the whole parse, validated again once an SAE is taken from the
    checkpoint), `explicit` what config files and flags set, `group` whether the model is a group of SAEs;
    the run a `fit --ckpt_path last` resumes is held in `locks` (`sae_pipeline.run_lock`) while the command runs."""

    def __init__(
        self,
        parser: LightningArgumentParser,
        config: Namespace,
        explicit: Namespace | None,
        group: bool,
        locks: RunLocks,
    ) -> None:
        self.parser, self.config, self.explicit, self.group, self.locks = parser, config, explicit, group, locks
        self.d_in: int | None = None  # the checkpoint's SAE's input width
        self.source: Any = None  # the data it was trained on, as its checkpoint says
        self.hyper_parameters: dict[str, Any] | None = None  # merged by lightning_compat
        self.nothing_to_train: str | None = None  # fit --ckpt_path already at max_steps: the line saying so
        self.start_step = 0  # the global step a fit starts from (its checkpoint's)

    def check_ckpt_path(self, config: Namespace, subcommand: str | None, run_dpath: Path | None) -> None:
        """`last` -> the newest checkpoint of this config's runs (`run_dpath`); any path -> checked readable."""
        ckpt_path = config.get("ckpt_path") if subcommand else None
        if subcommand in EVALUATING and not ckpt_path:
            raise CheckpointError(
                f"{subcommand} needs a trained SAE: pass --ckpt_path FILE (written by fit, e.g. "
                f"{run_dpath}/version_0/checkpoints/last.ckpt) or --ckpt_path last (the "
                "newest run of this config)"
            )
        if not ckpt_path:
            return
        if str(ckpt_path) == "last":
            search = [run_dpath] + ([Path(config.checkpoint.dirpath)] if config.checkpoint.get("dirpath") else [])
            found = newest_checkpoint(search)
            if found is None:
                what = (
                    "resume; run fit without --ckpt_path to start a new run"
                    if subcommand == "fit"
                    else "use; train one first with fit"
                )
                raise CheckpointError(
                    f"--ckpt_path last: no checkpoint under {' or '.join(map(str, search))} to {what}"
                )
            rank_zero_info(f"--ckpt_path last: {found}")
            config.ckpt_path = ckpt_path = str(found)
            if subcommand == "fit":  # one resume of a run at a time; released when the command ends
                self.locks.resume(found)
        checkpoint = read_checkpoint(ckpt_path, need=CKPT_NEEDS, for_fit=subcommand == "fit", last=True, mmap=True)
        self.check_model_config(config, subcommand, str(ckpt_path), checkpoint)
        if subcommand == "fit":
            self.start_step = int(checkpoint.get("global_step") or 0)
            self.nothing_to_train = nothing_to_train(str(ckpt_path), checkpoint, config.trainer.get("max_steps"))
        self.d_in = checkpoint_d_in(checkpoint)
        self.source = (checkpoint.get("data") or {}).get("source")
        self.hyper_parameters = dict(checkpoint.get("hyper_parameters") or {})
        del checkpoint

    def check_requeued(self, config: Namespace, subcommand: str | None, model_key: str) -> None:
        """A requeued SLURM job that was started with `--ckpt_path` and no model (`model_key` unset): the CLI
        dropped `--ckpt_path` for the job's own hpc checkpoint, which holds the same model; Lightning merges the
        hyper-parameters of `--ckpt_path` only, so they are taken here."""
        requeued = hpc_checkpoints(config.trainer.default_root_dir) if config.trainer.get("default_root_dir") else []
        if not (subcommand and config.get(model_key) is None and not config.get("ckpt_path") and requeued):
            return
        checkpoint = read_checkpoint(requeued[-1], need=CKPT_NEEDS, for_fit=True, last=True, mmap=True)
        self.check_model_config(config, subcommand, str(requeued[-1]), checkpoint)
        for key, value in (checkpoint.get("hyper_parameters") or {}).items():
            if key not in ("sae", "members") and not key.startswith("_") and key in config.model:
                config.model[key] = value

    def check_model_config(
        self, config: Namespace, subcommand: str | None, ckpt_path: str, checkpoint: dict[str, Any]
    ) -> None:
        """The user's explicit model settings agree with the checkpoint's; an SAE left unset is the
        checkpoint's, said in one line (`sae_pipeline.training.ckpt_config`)."""
        explicit = self.explicit.get(subcommand) if self.explicit is not None and subcommand else None
        explicit_model = explicit.get("model") if explicit is not None else None
        if self.group or "sae_group" in checkpoint:
            written = explicit_model if explicit is not None else config.get("model")
            check_group_against_checkpoint(ckpt_path, checkpoint, written, self.group)
            return
        check_against_checkpoint(ckpt_path, checkpoint, config.get("model"), explicit_model)
        if explicit is None or sets_sae_class(explicit_model):
            return
        sae = checkpoint["sae_config"]
        if config.get("model.sae") is None:
            config.model.sae = sae_namespace(sae)
            try:
                self.parser.validate(self.config)  # the check the CLI's parse_arguments held back
            except (TypeError, KeyError, ValueError) as exn:
                self.parser.error(str(exn), exn)  # what the parse would have said: usage, tip, error line
        doing = "resuming" if subcommand == "fit" else "using"
        label = sae_label(sae["class_path"], sae.get("init_args") or {})
        rank_zero_info(f"--ckpt_path {ckpt_path}: {doing} its {label} (the config names no model.sae)")

    def check_data_width(self, datamodule: Any, ckpt_path: Any) -> None:
        """The checkpoint's SAE must take the data's width (the model's `d_in` is linked from the data)."""
        d_in = getattr(datamodule, "d_in", None)
        if self.d_in is not None and d_in is not None and d_in != self.d_in:
            trained_on = f" (it was trained on {self.source})" if self.source else ""
            raise CheckpointError(
                f"--ckpt_path {ckpt_path}: its SAE takes d_in={self.d_in} inputs but "
                f"data.source {getattr(datamodule, 'source', '?')} gives d_in={d_in}; pass "
                f"the data it was trained on{trained_on}"
            )


def nothing_to_train(ckpt_path: str, checkpoint: dict[str, Any], max_steps: Any) -> str | None:
    """The line for a `fit --ckpt_path` whose checkpoint already reached `--trainer.max_steps`, or None."""
    step = checkpoint.get("global_step")
    if not isinstance(max_steps, int) or max_steps < 0 or not isinstance(step, int) or step < max_steps:
        return None
    return (
        f"Nothing to train: {ckpt_path} is already at global step {step} (--trainer.max_steps {max_steps}); "
        "raise it to train further"
    )


def already_done(trainer: Any) -> str | None:
    """Where a resumed run already was that its stopping setting had reached (`global step N
    (--trainer.max_steps N)`), or None."""
    if trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps:
        return f"global step {trainer.global_step} (--trainer.max_steps {trainer.max_steps})"
    if trainer.max_epochs is not None and trainer.max_epochs >= 0 and trainer.current_epoch >= trainer.max_epochs:
        return f"epoch {trainer.current_epoch} (--trainer.max_epochs {trainer.max_epochs})"
    return None
