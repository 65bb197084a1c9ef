"""SAEGroupModule: many SAEs trained in one ``fit``, on one data stream, one Trainer, one validation pass.

A sweep of SAEs on the same activations reads the same shards once per SAE when each is its own run;
the data path (shard reads, decoding, shuffling, the host-to-device copy) is then paid N times. A
group pays it once: every member takes its step on the same batch.

The config names the members, each holding what a single run's ``model`` section holds::

    model:
      members:
        topk_k10: {sae: {class_path: sae_pipeline.sae.TopKSAE, init_args: {d_sae: 1000, k: 10}}, lr: 1.0e-3}
        relu:     {sae: {class_path: sae_pipeline.sae.ReLUSAE, init_args: {d_sae: 1000}}, gradient_clip_val: 1.0}

Each member is an :class:`~sae_pipeline.training.module.SAEModule` and keeps everything it has alone:
its learning rate and warm-up/cosine schedule, first-batch calibration and ``b_pre``/input scale,
dead-latent clock, metrics, figures (its own TensorBoard run ``version_N/<name>/``, so the curves of
the members overlay) and its own gradient clipping (``gradient_clip_val``, by its own norm).

Design choices:

- Manual optimisation with one Adam holding every member's parameter groups and one ``LambdaLR``
  with one factor per group. Adam's state and update are per parameter, so this is the same
  arithmetic as one optimiser per member, and Lightning counts one optimiser step per batch
  (several optimisers would each advance ``global_step``, cutting ``max_steps`` short).
- One backward over the sum of the members' losses: the members share no parameter, so each gets
  exactly the gradient of its own loss, and DDP reduces the gradients once per step as for one SAE.
- Clipping is per member (``trainer.gradient_clip_val`` clips the global norm of everything the
  optimiser holds, coupling the members; the CLI refuses it for a group).
- Exactness: a member trained in a group equals the same SAE trained alone with the same seed and
  batches (``tests/test_group.py``, float64, every variant). Each member's weights are drawn after
  re-seeding torch with the run's seed (``seed_everything``) or the member's own ``seed``, so every
  member starts as it would alone, whatever its place in the group.
- One checkpoint for the group: the members' weights under ``members.<name>.`` and, for readers
  that take one SAE (``export --name``, ``features --name``), ``sae_group`` = ``{name: {sae_config,
  input_scale, hyper_parameters}}`` (:func:`sae_pipeline.artifacts.checkpoint.select_member`).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

import sae_pipeline
from feature_extraction.validate import check_float, check_int
from sae_pipeline.artifacts.checkpoint import MEMBER_NAME, MEMBER_NAME_RULE
from sae_pipeline.sae.base import SparseAutoencoder
from sae_pipeline.sae.config import ExportError, build_sae, check_sae_config, sae_config
from sae_pipeline.training import lightning_compat
from sae_pipeline.training.module import SAEModule
from sae_pipeline.training.optim import adam_implementation, param_groups, warmup_cosine_factor

MEMBER_KEYS = ("lr", "warmup_steps", "min_lr", "normalize_input", "inference_ks", "babel_r_max")
CLIP_ALGORITHMS = ("norm", "value")
CLIP_KEYS = ("gradient_clip_val", "gradient_clip_algorithm")  # a member's, else the group's


def member_entry(name: str, entry: Any, d_in: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Check one member's config; return (its SAE's ``{class_path, init_args}`` with ``d_in`` filled in,
    its other settings). Every problem is a ValueError naming ``model.members.<name>``."""
    where = f"model.members.{name}"
    if not isinstance(name, str) or not MEMBER_NAME.fullmatch(name):
        raise ValueError(f"model.members: name {name!r} {MEMBER_NAME_RULE} (it names the member's folders)")
    if not isinstance(entry, dict) or not isinstance(entry.get("sae"), dict):
        raise ValueError(f"{where}: must hold sae: {{class_path: ..., init_args: ...}} as a single run's model does")
    known = {"sae", "seed", "gradient_clip_val", "gradient_clip_algorithm", *MEMBER_KEYS}
    unknown = sorted(map(str, set(entry) - known))
    if unknown:
        raise ValueError(
            f"{where}: unknown setting(s) {', '.join(unknown)}; a member takes sae, seed, gradient_clip_val, "
            f"gradient_clip_algorithm and {', '.join(MEMBER_KEYS)}"
        )
    try:
        sae = dict(check_sae_config(entry["sae"], f"{where}.sae"))
    except ExportError as exn:
        raise ValueError(str(exn)) from None
    class_path = sae["class_path"]
    if class_path and "." not in class_path:
        class_path = f"sae_pipeline.sae.{class_path}"  # bare class names, as jsonargparse takes them
    init_args = dict(sae.get("init_args") or {})
    if d_in is not None:
        if init_args.get("d_in") not in (None, d_in):
            raise ValueError(
                f"{where}.sae.init_args.d_in={init_args['d_in']} differs from the data's d_in={d_in}; "
                "drop d_in from the member (it is taken from the data)"
            )
        init_args["d_in"] = d_in
    elif "d_in" not in init_args:
        raise ValueError(f"{where}.sae.init_args.d_in: not set and no data to take it from; set it")
    settings = {key: entry[key] for key in MEMBER_KEYS if key in entry}
    return {"class_path": class_path, "init_args": init_args}, settings


def build_member(sae_dict: dict[str, Any], settings: dict[str, Any]) -> SAEModule:
    """One member, whose hyper-parameters are its own arguments (built outside any ``__init__``: Lightning's
    ``save_hyperparameters`` would also collect the arguments of an enclosing module's ``__init__``)."""
    with lightning_compat.own_hyperparameters():
        return SAEModule(build_sae(sae_dict), **settings, cuda_graph=False)  # the group's step runs eagerly


def plain_config(value: Any) -> Any:
    """Dicts and lists all the way down (jsonargparse hands nested sections over as Namespaces, and a member's
    ``sae`` whose ``init_args`` it can complete, ``d_in`` included, as an instance: its config stands for it,
    so the member is built after its seed and its ``d_in`` checked against the data's)."""
    if isinstance(value, SparseAutoencoder):
        return sae_config(value)
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, dict):
        return {key: plain_config(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_config(item) for item in value]
    return value


class SAEGroupModule(L.LightningModule):
    """Train a named group of SAEs on one data stream (see the module docstring).

    Args:
        members: ``{name: {sae: {class_path, init_args}, lr, warmup_steps, min_lr, normalize_input,
            inference_ks, babel_r_max, gradient_clip_val, gradient_clip_algorithm, seed}}``; a member's
            settings default as a single run's model section does.
        d_in: the data's width (linked from the data by the CLI); a member's ``d_in`` must agree.
        gradient_clip_val: default clipping threshold of every member (each by its own gradient); None: none.
        gradient_clip_algorithm: ``norm`` (each member's own 2-norm) or ``value``.
        predict_member: the member whose codes ``predict`` writes (``--model.predict_member NAME``).
    """

    def __init__(
        self,
        members: dict[str, dict[str, Any]],
        d_in: int | None = None,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        predict_member: str | None = None,
    ) -> None:
        super().__init__()
        members = plain_config(members)
        if not isinstance(members, dict) or not members:
            raise ValueError("model.members is empty; name at least one SAE: members: {NAME: {sae: ...}}")
        self.save_hyperparameters(ignore=["predict_member"])  # a checkpoint's value would override the flag
        self.predict_member = predict_member
        self.automatic_optimization = False
        modules: dict[str, SAEModule] = {}
        base_seed = torch.initial_seed()  # seed_everything's seed
        self.clipping: dict[str, tuple[float | None, str]] = {}
        for name, entry in members.items():
            sae_dict, settings = member_entry(name, entry, d_in)
            where = f"model.members.{name}"
            clip = entry.get("gradient_clip_val", gradient_clip_val)
            algorithm = entry.get("gradient_clip_algorithm", gradient_clip_algorithm)
            if clip is not None:
                check_float(f"{where}.gradient_clip_val", clip, 0.0, strict_minimum=True)
            if algorithm not in CLIP_ALGORITHMS:
                raise ValueError(f"{where}.gradient_clip_algorithm is {algorithm!r}; use norm or value")
            self.clipping[name] = (clip, algorithm)
            # Each member's weights start from the run's seed (or its own), as when it is trained alone.
            seed = entry.get("seed")
            torch.manual_seed(base_seed if seed is None else check_int(f"{where}.seed", seed, 0, 2**63 - 1))
            try:
                module = build_member(sae_dict, settings)
            except (TypeError, ValueError) as exn:
                message = str(exn).splitlines()[0] if str(exn) else type(exn).__name__
                raise ValueError(f"{where}: {message.replace('model.', f'{where}.')}") from None
            module.config_prefix, module.label = where, f" of SAE {name!r}"
            modules[name] = module
        self.members = torch.nn.ModuleDict(modules)
        self.member_loggers: dict[str, TensorBoardLogger] = {}

    # Child LightningModules need the trainer (global_step, datamodule); Lightning hands it only to direct children.
    @property
    def trainer(self) -> L.Trainer:
        return L.LightningModule.trainer.fget(self)  # type: ignore[attr-defined]

    @trainer.setter
    def trainer(self, trainer: L.Trainer | None) -> None:
        L.LightningModule.trainer.fset(self, trainer)  # type: ignore[attr-defined]
        for member in self._modules.get("members", {}).values():
            member.trainer = trainer

    def named_members(self) -> list[tuple[str, SAEModule]]:
        return list(self.members.items())  # type: ignore[arg-type]

    # --- set-up ------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        for name, member in self.named_members():
            member.trainer = self.trainer
            d_in = getattr(getattr(self.trainer, "datamodule", None), "d_in", None)
            if d_in is not None and d_in != member.sae.d_in:
                raise ValueError(
                    f"data d_in={d_in} differs from model.members.{name}.sae.init_args.d_in={member.sae.d_in}; "
                    "drop d_in from the member so it is taken from the data"
                )
            member.setup(stage)

    def on_fit_start(self) -> None:
        """One TensorBoard run per member, ``<this run's folder>/<name>/``, with its own hyper-parameters."""
        logger = self.trainer.logger
        self.member_loggers = {}
        if not isinstance(logger, TensorBoardLogger) or not self.trainer.is_global_zero:
            return
        for name, member in self.named_members():
            member_logger = TensorBoardLogger(save_dir=logger.log_dir, name=name, version="", default_hp_metric=False)
            member_logger.log_hyperparams({**dict(member.hparams), "sae": member.hparams["sae"]})
            self.member_loggers[name] = member_logger

    def on_fit_end(self) -> None:
        for member_logger in self.member_loggers.values():
            member_logger.finalize("success")

    def member_writer(self, name: str) -> Any | None:
        """The SummaryWriter of a member's TensorBoard run (None off rank 0 or without TensorBoard)."""
        member_logger = self.member_loggers.get(name)
        return member_logger.experiment if member_logger is not None else None

    def log_member(self, name: str, values: dict[str, Any]) -> None:
        member_logger = self.member_loggers.get(name)
        if member_logger is not None and values:
            step = lightning_compat.batches_that_stepped(self.trainer)
            scalars = {
                key: float(value.detach() if isinstance(value, Tensor) else value) for key, value in values.items()
            }
            member_logger.log_metrics(scalars, step=step)

    # --- training ----------------------------------------------------------------------------
    def on_train_start(self) -> None:
        for _, member in self.named_members():
            member.on_train_start()

    def on_train_batch_start(self, batch: dict[str, Any], batch_idx: int) -> None:
        for _, member in self.named_members():
            member.on_train_batch_start(batch, batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: dict[str, Any], batch_idx: int) -> None:
        for _, member in self.named_members():
            member.on_train_batch_end(outputs, batch, batch_idx)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        logging = lightning_compat.should_update_logs(self.trainer)
        total: Tensor | None = None
        lrs = self._member_lrs() if logging else {}
        for name, member in self.named_members():
            x, output, losses = member.step_loss(batch)
            if logging:  # the steps Lightning writes: the only ones whose values are read on the host
                member.raise_if_non_finite()
                self.log_member(
                    name, {"train/loss": losses.loss, **member.train_metrics(x, output, losses), "lr": lrs[name]}
                )
            total = losses.loss if total is None else total + losses.loss
        assert total is not None
        optimizer.zero_grad()
        self.manual_backward(total)
        optimizer.step()  # Lightning calls on_before_optimizer_step (below) in it, after unscaling
        for _, member in self.named_members():
            member.sae.normalize_atoms()
        scheduler.step()
        self.log("train/loss", total.detach(), prog_bar=True, logger=False)
        return total.detach()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Each member as alone: the gradient parallel to its atoms removed, then clipped by its own norm."""
        for name, member in self.named_members():
            member.sae.remove_parallel_grad()
            clip, algorithm = self.clipping[name]
            if clip is None:
                continue
            if algorithm == "norm":
                torch.nn.utils.clip_grad_norm_(list(member.sae.parameters()), clip)
            else:
                torch.nn.utils.clip_grad_value_(list(member.sae.parameters()), clip)

    def _member_lrs(self) -> dict[str, float]:
        optimizer = self.trainer.optimizers[0]
        return {name: optimizer.param_groups[first]["lr"] for name, first in self._first_groups.items()}

    def configure_optimizers(self) -> dict[str, Any]:
        total_steps = self.named_members()[0][1]._estimated_total_steps()
        if not math.isfinite(total_steps) or total_steps < 1:
            raise ValueError(
                f"the run's number of optimiser steps is {total_steps}; set --trainer.max_steps or "
                "--trainer.max_epochs so the cosine schedule has an end"
            )
        total_steps = int(total_steps)
        groups: list[dict[str, Any]] = []
        factors = []
        self._first_groups: dict[str, int] = {}
        for name, member in self.named_members():
            hparams = member.hparams
            factor = partial(
                warmup_cosine_factor,
                warmup_steps=min(hparams.warmup_steps, total_steps),
                total_steps=total_steps,
                min_ratio=hparams.min_lr / hparams.lr,
            )
            member_groups = param_groups(member.sae, hparams.lr)
            self._first_groups[name] = len(groups)
            groups += member_groups
            factors += [factor] * len(member_groups)
        optimizer = torch.optim.Adam(groups, **adam_implementation(self))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factors)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    def on_train_epoch_end(self) -> None:
        for _, member in self.named_members():
            member.on_train_epoch_end()

    # --- evaluation ----------------------------------------------------------------------------
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        for _, member in self.named_members():
            member._eval_step(batch, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        for _, member in self.named_members():
            member._eval_step(batch, "test")

    def _log_eval_epoch(self, stage: str) -> None:
        """Each member's metrics: ``<name>/val/r2`` ... in ``callback_metrics`` and the table ``validate`` /
        ``test`` print, and ``val/r2`` ... in the member's own TensorBoard run."""
        fitting = self.trainer.state.fn == "fit"  # the main run would repeat what each member's run shows
        for name, member in self.named_members():
            values = {key: float(value) for key, value in member.eval_epoch_values(stage).items()}
            for key, value in values.items():
                self.log(
                    f"{name}/{stage}/{key}", value, sync_dist=True, reduce_fx="max", logger=False if fitting else None
                )
            if not self.trainer.sanity_checking:
                self.log_member(name, {f"{stage}/{key}": value for key, value in values.items()})

    def on_validation_epoch_end(self) -> None:
        self._log_eval_epoch("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval_epoch("test")

    def predict_target(self) -> SAEModule:
        """The member ``predict`` applies; a one-line error naming the members when none or another is set."""
        names = list(self.members)
        if self.predict_member not in names:
            said = "names no member" if self.predict_member is None else f"names {self.predict_member!r}, not a member"
            raise ValueError(
                f"predict of a group writes one member's codes; --model.predict_member {said}: pass one of "
                f"{', '.join(names)}"
            )
        return self.members[self.predict_member]  # type: ignore[return-value]

    def on_predict_start(self) -> None:
        self.predict_target()

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        return self.predict_target().predict_step(batch, batch_idx)

    # --- checkpoints ---------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Per member, what a single run's checkpoint holds at its top level (plain data, no pickle)."""
        for _, member in self.named_members():
            member.raise_if_non_finite()
        checkpoint["sae_group"] = {
            name: {
                "sae_config": sae_config(member.sae),
                "input_scale": float(member.input_scale),
                "hyper_parameters": {key: value for key, value in dict(member.hparams).items()},
            }
            for name, member in self.named_members()
        }
        first = self.named_members()[0][1]
        checkpoint["data"] = first.data_info
        checkpoint["sae_pipeline_version"] = sae_pipeline.__version__

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        for _, member in self.named_members():
            member.on_load_checkpoint(checkpoint)


__all__ = ["SAEGroupModule", "member_entry", "plain_config"]
