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

The computation itself is :func:`evaluate_sae` (no Lightning needed), for reuse by an
offline evaluation script.

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
- The sample is processed in chunks of at most ``_CHUNK_ELEMENTS`` dense code entries, so a
  16 K-token sample with d_sae = 19 200 never holds a 1.2 GB code matrix.
"""
from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from sae_pipeline import lightning_compat
from sae_pipeline.figures import atom_grid_figure, babel_curve_figure, frequency_vs_mean_figure, r2_vs_k_figure
from sae_pipeline.metrics import ActivationStats, ReconstructionR2, babel, babel_coactive
from sae_pipeline.sae import SparseAutoencoder

# Dense code entries per chunk of the evaluation sample: 2**24 float32 = 64 MiB of codes.
_CHUNK_ELEMENTS = 2**24
_DEFAULT_R_MAX = 64


def default_inference_ks(k: int, d_sae: int) -> list[int]:
    """Powers of two up to ``4k``, plus ``k`` and ``4k``, capped at ``d_sae``: the sweep of the
    paper's Fig. "inference at k" (below, at and well above the trained sparsity)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    ks = {k, 4 * k}
    power = 1
    while power <= 4 * k:
        ks.add(power)
        power *= 2
    return sorted(value for value in ks if value <= d_sae) or [d_sae]


class SAEFigures(L.Callback):
    """Babel scalars and curves, R² against inference k, activation histograms and atom grid.

    Args:
        every_n_val_epochs: run on every n-th validation epoch (the first one included);
            sanity-check validation never counts.
        ks: inference-time k values for the R² sweep; None takes
            ``pl_module.hparams.inference_ks``, and when that is None too derives them from
            the trained k with :func:`default_inference_ks` (for ReLU/JumpReLU, which have no
            k, from the mean L0 rounded).
        r_max: largest r of the Babel curves; None takes ``pl_module.hparams.babel_r_max``
            (else 64). Capped at ``d_sae - 1`` (the Babel function needs r other atoms) and
            raised to k when k is larger, so that μ₁(k) exists.
        n_atoms: atoms shown in the atom grid (the most frequently active ones).
    """

    def __init__(
        self,
        every_n_val_epochs: int = 1,
        ks: list[int] | None = None,
        r_max: int | None = None,
        n_atoms: int = 25,
    ) -> None:
        super().__init__()
        self.every_n_val_epochs = _check_int("every_n_val_epochs", every_n_val_epochs)
        self.ks = None if ks is None else sorted({_check_int("ks[i]", value) for value in ks})
        if self.ks is not None and not self.ks:
            raise ValueError("ks must hold at least one integer >= 1, or be None to derive it from the trained k")
        self.r_max = None if r_max is None else _check_int("r_max", r_max)
        self.n_atoms = _check_int("n_atoms", n_atoms)
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
        sae: SparseAutoencoder = pl_module.sae  # type: ignore[assignment]
        x = pl_module.preprocess(datamodule.eval_sample().to(pl_module.device))  # type: ignore[operator]
        was_training = sae.training
        sae.eval()
        try:
            report = evaluate_sae(sae, x, self._r_max(pl_module), self._ks(pl_module))
        finally:
            sae.train(was_training)

        for name in ("babel_dict_r1", "babel_dict_rk", "babel_coactive_r1", "babel_coactive_rk"):
            pl_module.log(f"val/{name}", report[name], rank_zero_only=False, sync_dist=False)

        writer = _tensorboard_writer(trainer)
        if writer is None or not trainer.is_global_zero:
            return
        step = _logged_step(trainer)
        curves = {"dictionary": report["babel_dict"], f"co-active (k = {report['k']})": report["babel_coactive"]}
        writer.add_figure("val/babel", babel_curve_figure(curves), global_step=step)
        label = type(sae).__name__
        writer.add_figure(
            "val/r2_vs_k",
            r2_vs_k_figure(report["ks"], {label: report["r2_by_k"]}, trained_k=sae.k),
            global_step=step,
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
        return _check_int("babel_r_max", _hparam(pl_module, "babel_r_max") or _DEFAULT_R_MAX)

    def _ks(self, pl_module: L.LightningModule) -> list[int] | None:
        """``ks`` given here, else the module's ``inference_ks`` hyper-parameter, else None (derived)."""
        if self.ks is not None:
            return self.ks
        ks = _hparam(pl_module, "inference_ks")
        return None if ks is None else sorted({_check_int("inference_ks[i]", value) for value in ks})


@torch.no_grad()
def evaluate_sae(sae: SparseAutoencoder, x: Tensor, r_max: int, ks: list[int] | None = None) -> dict[str, Any]:
    """Every quantity :class:`SAEFigures` logs, for the (preprocessed) sample ``x [n, d_in]``.

    Needs no Lightning, so an offline evaluation script can reuse it. Runs the SAE as it is
    (call ``sae.eval()`` first for BatchTopK's inference threshold).

    ``ks`` (None: :func:`default_inference_ks` of k) are the inference k values of the R²
    sweep; values above ``d_sae`` are dropped, except for MP-SAE (its pursuit may pick atoms again).

    Returns a dict: ``k`` (trained k, or the mean L0 rounded for variants without one),
    ``ks``, ``r2_by_k`` (list of floats), ``babel_dict`` and ``babel_coactive`` (float32
    CPU tensors ``[max(r_max, k) capped at d_sae − 1]``), the four ``babel_*_r1/rk``
    floats, ``frequency`` and ``mean_value`` (float64 CPU ``[d_sae]``), ``l0`` (float).
    """
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] != sae.d_in:
        raise ValueError(f"eval sample must have shape [n_tokens >= 1, d_in={sae.d_in}], got {tuple(x.shape)}")
    if sae.d_sae < 2:
        raise ValueError(f"the Babel function needs d_sae >= 2 atoms, got d_sae={sae.d_sae}")
    _check_int("r_max", r_max)
    chunks = x.split(max(1, _CHUNK_ELEMENTS // sae.d_sae))
    stats = ActivationStats(sae.d_sae, sync_on_compute=False).to(x.device)
    # One chunk (the usual case): keep its codes for the co-active pass instead of re-encoding.
    kept_codes: list[Tensor] = []
    for chunk in chunks:
        codes = sae.encode(chunk)
        stats.update(codes)
        if len(chunks) == 1:
            kept_codes.append(codes)
    activation = {name: value.cpu() for name, value in stats.compute().items()}
    l0 = float(activation["l0"])
    k = sae.k if sae.k is not None else max(1, round(l0))
    r_max = min(max(r_max, k), sae.d_sae - 1)
    r_k = min(k, r_max)

    babel_dict = babel(sae.W_dec, r_max).float().cpu()
    coactive_sum = torch.zeros(r_max, dtype=torch.float64)
    for index, chunk in enumerate(chunks):
        codes = kept_codes[index] if kept_codes else sae.encode(chunk)
        coactive_sum += babel_coactive(sae.W_dec, codes, r_max).double().cpu() * chunk.shape[0]
    babel_co = (coactive_sum / x.shape[0]).float()

    requested = ks
    k_cap = None if sae.k_above_d_sae else sae.d_sae  # MP may repeat atoms: any k
    ks = [value for value in (ks or default_inference_ks(k, sae.d_sae)) if k_cap is None or value <= k_cap]
    if not ks:
        raise ValueError(f"every k in ks={requested} exceeds d_sae={sae.d_sae}; choose ks in [1, {sae.d_sae}]")
    r2_by_k = []
    for value in ks:
        r2 = ReconstructionR2(sae.d_in, sync_on_compute=False).to(x.device)
        for chunk in chunks:
            r2.update(chunk, sae.decode(sae.encode(chunk, value)))
        r2_by_k.append(float(r2.compute()))

    return {
        "k": k,
        "ks": ks,
        "r2_by_k": r2_by_k,
        "babel_dict": babel_dict,
        "babel_coactive": babel_co,
        "babel_dict_r1": float(babel_dict[0]),
        "babel_dict_rk": float(babel_dict[r_k - 1]),
        "babel_coactive_r1": float(babel_co[0]),
        "babel_coactive_rk": float(babel_co[r_k - 1]),
        "frequency": activation["frequency"],
        "mean_value": activation["mean_value"],
        "l0": l0,
    }


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


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


__all__ = ["SAEFigures", "default_inference_ks", "evaluate_sae"]
