"""TensorBoard figures and coherence scalars of the SAE under training (the paper's evaluation plots).

``SAEFigures`` runs at the end of a validation epoch, on a fixed evaluation sample of the
validation split (``trainer.datamodule.eval_sample()``, preprocessed like training batches),
and logs:

- scalars ``val/babel_dict_r1``, ``val/babel_dict_rk``, ``val/babel_coactive_r1``,
  ``val/babel_coactive_rk``: the Babel function μ₁(r) (Tropp 2004) of the whole dictionary
  and of the atoms co-active on a token, at r = 1 and r = k (paper Sec. "Coherence");
- figures ``val/babel`` (both curves for r = 1..r_max), ``val/r2_vs_k`` (R² against the
  inference-time k, paper Fig. "inference at k"), ``val/atoms`` (the most frequently active
  atoms as images, when the data are image-shaped);
- histograms ``val/activation_frequency`` and ``val/mean_activation``, and the figure
  ``val/frequency_vs_mean`` (one point per atom), the paper's Fig. "Activation distributions".

A group of SAEs (:mod:`sae_pipeline.training.group`) gets the same for each member, in the member's own
TensorBoard run (scalars ``<name>/val/...`` in ``callback_metrics``).

The computation itself is :func:`sae_pipeline.metrics.measure.evaluate_sae` (no Lightning
needed), which the evaluation suite runs on exported SAEs too; this callback only schedules it and
logs what it returns.

Design choices:

- DDP: the evaluation sample is identical on every rank, so every rank computes the same
  scalars and logs them with ``rank_zero_only=False, sync_dist=False``: no collective is
  introduced (none could hang), and ``callback_metrics`` holds them on every rank (a
  ``ModelCheckpoint`` may monitor them). Only global rank 0 renders figures and histograms.
- Figures and histograms go through the TensorBoard logger's ``SummaryWriter`` at the step
  Lightning gives the scalars logged at the same time (``global_step − 1`` during fit: its
  loggers count the batches stepped *before* the current one), so the ``val/babel`` figure
  and the ``val/babel_dict_r1`` scalar of one validation share a step. With other loggers
  (or none) only the scalars are logged.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

from feature_extraction.validate import check_int
from sae_pipeline.figures import atom_grid_figure, babel_curve_figure, frequency_vs_mean_figure, r2_vs_k_figure
from sae_pipeline.metrics import evaluate_sae
from sae_pipeline.sae import SparseAutoencoder
from sae_pipeline.training import lightning_compat

_DEFAULT_R_MAX = 64


class SAEFigures(L.Callback):
    """Babel scalars and curves, R² against inference k, activation histograms and atom grid.

    Args:
        every_n_val_epochs: run on every n-th validation epoch (the first one included);
            sanity-check validation never counts.
        ks: inference-time k values for the R² sweep; None takes
            ``pl_module.hparams.inference_ks``, and when that is None too derives them from
            the trained k (``default_inference_ks`` of :mod:`sae_pipeline.metrics.measure`; for
            ReLU/JumpReLU, which have no k, from the mean L0 rounded).
        r_max: largest r of the Babel curves; None takes ``pl_module.hparams.babel_r_max``
            (else 64). Capped at ``d_sae - 1`` (the Babel function needs r other atoms) and
            raised to k when k is larger, so that μ₁(k) exists.
        n_atoms: atoms shown in the atom grid (the most frequently active ones).
    """

    def __init__(
        self, every_n_val_epochs: int = 1, ks: list[int] | None = None, r_max: int | None = None, n_atoms: int = 25
    ) -> None:
        super().__init__()
        self.every_n_val_epochs = check_int("every_n_val_epochs", every_n_val_epochs, 1)
        self.ks = None if ks is None else sorted({check_int("ks[i]", value, 1) for value in ks})
        if self.ks is not None and not self.ks:
            raise ValueError("ks must hold at least one integer >= 1, or be None to derive it from the trained k")
        self.r_max = None if r_max is None else check_int("r_max", r_max, 1)
        self.n_atoms = check_int("n_atoms", n_atoms, 1)
        self.n_val_epochs = 0

    # --- Lightning hooks ---------------------------------------------------------------
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.n_val_epochs += 1
        if (self.n_val_epochs - 1) % self.every_n_val_epochs != 0:
            return
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "eval_sample"):
            rank_zero_warn("SAEFigures needs trainer.datamodule.eval_sample(); no datamodule, so nothing logged")
            return
        eval_sample = datamodule.eval_sample().to(pl_module.device)
        members = getattr(pl_module, "named_members", None)
        if members is None:
            self._log_one(trainer, pl_module, pl_module, eval_sample, datamodule, None)
            return
        for name, member in members():  # a group (sae_pipeline.training.group): each SAE in its own run
            self._log_one(trainer, pl_module, member, eval_sample, datamodule, name)

    def _log_one(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        module: L.LightningModule,
        eval_sample: torch.Tensor,
        datamodule: Any,
        name: str | None,
    ) -> None:
        """The scalars and figures of one SAE (``module``; ``name`` a group's member, None alone)."""
        sae: SparseAutoencoder = module.sae  # type: ignore[assignment]
        x = module.preprocess(eval_sample)  # type: ignore[operator]
        was_training = sae.training
        sae.eval()
        try:
            report = evaluate_sae(sae, x, self._r_max(module), self._ks(module))
        finally:
            sae.train(was_training)

        scalars = {
            f"val/{key}": report[key]
            for key in ("babel_dict_r1", "babel_dict_rk", "babel_coactive_r1", "babel_coactive_rk")
        }
        if name is None:
            for key, value in scalars.items():
                pl_module.log(key, value, rank_zero_only=False, sync_dist=False)
            writer = _tensorboard_writer(trainer)
        else:
            for key, value in scalars.items():
                pl_module.log(f"{name}/{key}", value, rank_zero_only=False, sync_dist=False, logger=False)
            pl_module.log_member(name, scalars)  # type: ignore[operator]
            writer = pl_module.member_writer(name)  # type: ignore[operator]
        if writer is None or not trainer.is_global_zero:
            return
        step = _logged_step(trainer)
        curves = {"dictionary": report["babel_dict"], f"co-active (k = {report['k']})": report["babel_coactive"]}
        writer.add_figure("val/babel", babel_curve_figure(curves), global_step=step)
        label = type(sae).__name__
        writer.add_figure(
            "val/r2_vs_k", r2_vs_k_figure(report["ks"], {label: report["r2_by_k"]}, trained_k=sae.k), global_step=step
        )
        writer.add_histogram("val/activation_frequency", report["frequency"].numpy(), global_step=step)
        writer.add_histogram("val/mean_activation", report["mean_value"].numpy(), global_step=step)
        writer.add_figure(
            "val/frequency_vs_mean",
            frequency_vs_mean_figure(report["frequency"], report["mean_value"]),
            global_step=step,
        )
        image_shape = getattr(datamodule, "image_shape", None)
        if image_shape is not None:
            order = torch.argsort(report["frequency"], descending=True, stable=True)[: self.n_atoms]
            atoms = sae.W_dec.detach()[order.to(sae.W_dec.device)].cpu()
            title = f"most frequent atoms (step {step})"
            labels = [f"#{index}" for index in order.tolist()]
            writer.add_figure(
                "val/atoms",
                atom_grid_figure(atoms, tuple(image_shape), n_atoms=self.n_atoms, title=title, labels=labels),
                global_step=step,
            )

    def state_dict(self) -> dict[str, Any]:
        """The validation-epoch counter, so ``every_n_val_epochs`` keeps its phase on resume."""
        return {"n_val_epochs": self.n_val_epochs}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.n_val_epochs = int(state_dict.get("n_val_epochs", 0))

    def _r_max(self, pl_module: L.LightningModule) -> int:
        """``r_max`` given here, else the module's ``babel_r_max`` hyper-parameter, else 64."""
        if self.r_max is not None:
            return self.r_max
        return check_int("babel_r_max", _hparam(pl_module, "babel_r_max") or _DEFAULT_R_MAX, 1)

    def _ks(self, pl_module: L.LightningModule) -> list[int] | None:
        """``ks`` given here, else the module's ``inference_ks`` hyper-parameter, else None (derived)."""
        if self.ks is not None:
            return self.ks
        ks = _hparam(pl_module, "inference_ks")
        return None if ks is None else sorted({check_int("inference_ks[i]", value, 1) for value in ks})


def _hparam(pl_module: L.LightningModule, name: str) -> Any:
    hparams = getattr(pl_module, "hparams", None)
    return hparams.get(name) if hasattr(hparams, "get") else None


def _logged_step(trainer: L.Trainer) -> int:
    """The step Lightning gives the scalars logged now (its count of batches that stepped, as its own
    ``LearningRateMonitor`` uses), so a figure sits at the same step as its scalars: during fit
    that is ``global_step − 1`` for a validation after step ``global_step``."""
    return lightning_compat.batches_that_stepped(trainer)


def _tensorboard_writer(trainer: L.Trainer) -> Any | None:
    """The ``SummaryWriter`` of the first TensorBoard logger, or None (other loggers: no-op)."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


__all__ = ["SAEFigures"]
