"""SAEModule: the training logic around an injected SAE variant (Lightning).

The SAE is a plain ``nn.Module`` (``class_path`` / ``init_args`` in the YAML); this module
owns everything a training run adds to it:

- Optimiser: the paper's vision recipe (Costa et al. 2025, §4 "Setup"): Adam, lr 5e-4,
  linear warm-up then cosine decay to 1e-6, stepped per optimiser step over
  ``trainer.estimated_stepping_batches``; a parameter the SAE names in ``lr_scales`` (JumpReLU's
  threshold) trains at that multiple of the schedule.
- Dictionary constraint: unit-norm atoms after every optimiser step, with the gradient
  component parallel to each atom removed before it (docs/design.md, "Definitions").
- Input normalisation (optional): ``x · input_scale`` with ``input_scale = sqrt(d_in / E‖x‖²)``
  from the data statistics, so one set of hyper-parameters (λ, JumpReLU bandwidth) fits
  every backbone; export folds the scale back in (:mod:`sae_pipeline.artifacts.export`).
- ``b_pre`` from the data mean, once: a persistent flag buffer keeps a resumed run (or a
  second ``fit`` call) from resetting it.
- Dead-latent clock merged across ranks every step, so AuxK and ``val/dead_fraction``
  agree on every rank whatever the world size.
- Exact validation metrics: float64 sums all-reduced once per epoch, valid even when a
  rank received no validation batch.
- NaN/Inf in a batch stops training with the global step and the shards named.
- No host read in the training step on a GPU: the loss is logged as a tensor (Lightning reads it
  only on the steps it writes), the other train metrics are computed on those steps only, and
  NaN/Inf is noted on the device and read then, or before a checkpoint is written
  (`sae_pipeline.training.non_finite`); what the host must know before a step (TopK's AuxK: whether
  latents are dead, and how many) it knows a few steps late (`SparseAutoencoder.plan_step`, planned at
  each batch's start; `after_step` at its end, `begin_fit` at the fit's start).
- On one CUDA device (`cuda_graph`, on by default there since the GPU tests passed on an H200), the whole
  step (forward, backward, Adam, the projection, the clock) is one CUDA graph replayed per batch
  (`sae_pipeline.training.graph_step`).
- The sparse products' choice of Triton kernel or cuBLAS, measured at their first call
  (`sae_pipeline.sae.product_choice`), logged once per fit, one INFO line per product.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

import sae_pipeline
from feature_extraction.shards import extraction_record, manifest_sha256
from feature_extraction.validate import check_float, check_int
from sae_pipeline.metrics import ActivationStats, ReconstructionR2, dead_fraction
from sae_pipeline.sae import SparseAutoencoder, product_choice
from sae_pipeline.sae.config import sae_config
from sae_pipeline.sae.inference_codes import ranked_lists
from sae_pipeline.training import lightning_compat
from sae_pipeline.training.graph_step import CudaGraphStep, checkpoint_groups
from sae_pipeline.training.non_finite import NonFiniteBatchError as NonFiniteBatchError  # callers import it here
from sae_pipeline.training.non_finite import NonFiniteWatch, batch_sources, non_finite_batch, non_finite_loss
from sae_pipeline.training.optim import adam_implementation, param_groups, warmup_cosine_factor


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class SAEModule(L.LightningModule):
    """Train one SAE variant.

    Args:
        sae: the SAE variant (``class_path`` + ``init_args``; ``d_in`` is linked from the data
            by the CLI).
        lr: peak Adam learning rate; 5e-4 as in the paper's vision experiments.
        warmup_steps: optimiser steps of linear warm-up (capped at the run's total).
        min_lr: learning rate at the end of the cosine decay (1e-6 in the paper).
        normalize_input: scale inputs so that E‖x‖² = d_in (from the data statistics).
        inference_ks: the k values of the R²-vs-k sweep in the figures callback (None: it
            derives them from the SAE's k).
        babel_r_max: largest r of the Babel curves in the figures callback.
        cuda_graph: run each training step as one replayed CUDA graph (None, the default: wherever it
            can be captured, i.e. on one CUDA device; True: also warn when it cannot; False: never).
    """

    def __init__(
        self,
        sae: SparseAutoencoder,
        lr: float = 5e-4,
        warmup_steps: int = 1000,
        min_lr: float = 1e-6,
        normalize_input: bool = True,
        inference_ks: list[int] | None = None,
        babel_r_max: int = 64,
        cuda_graph: bool | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(sae, SparseAutoencoder):
            raise ValueError(f"model.sae must be a SparseAutoencoder variant, got {type(sae).__name__}")
        check_float("model.lr", lr, 0.0, strict_minimum=True)
        check_float("model.min_lr", min_lr, 0.0, lr, note=" (model.lr)")
        check_int("model.warmup_steps", warmup_steps, 0)
        if inference_ks is not None and not all(isinstance(k, int) and 1 <= k <= sae.d_sae for k in inference_ks):
            raise ValueError(f"model.inference_ks must be integers in [1, d_sae={sae.d_sae}], got {inference_ks!r}")
        check_int("model.babel_r_max", babel_r_max, 1)
        if cuda_graph not in (None, True, False):
            raise ValueError(f"model.cuda_graph must be true, false or null, got {cuda_graph!r}")
        # The SAE object itself is not a hyper-parameter (it would be pickled into the
        # checkpoint); its plain {"class_path", "init_args"} is, so checkpoints load with
        # torch.load(weights_only=True) and LightningCLI can rebuild the module from them.
        # `cuda_graph` neither: it chooses how this process runs the step, not the model, so a checkpoint
        # resumes on any device with any choice (and reads as one written before the option).
        self.save_hyperparameters(ignore=["sae", "cuda_graph"])
        self.hparams["sae"] = sae_config(sae)
        self.sae = sae
        self.register_buffer("input_scale", torch.ones(()))
        self.register_buffer("initialized_from_data", torch.zeros((), dtype=torch.bool))
        self.train_r2 = ReconstructionR2(sae.d_in)
        # Evaluation metrics are synced by hand at epoch end (see `_log_eval_epoch`).
        self.val_r2 = ReconstructionR2(sae.d_in, sync_on_compute=False)
        self.val_stats = ActivationStats(sae.d_sae, sync_on_compute=False)
        self.test_r2 = ReconstructionR2(sae.d_in, sync_on_compute=False)
        self.test_stats = ActivationStats(sae.d_sae, sync_on_compute=False)
        self.data_info: dict[str, Any] | None = None
        self._initialized_cache: bool | None = None
        # Where messages say the settings are, and which SAE they are about (a group's member changes both).
        self.config_prefix = "model"
        self.label = ""
        self.non_finite = NonFiniteWatch()  # where the GPU's step notes NaN/Inf (see step_loss)
        self.graph_step = CudaGraphStep(cuda_graph)
        self._replay = False  # whether this batch's step goes through the graph (decided at the batch's start)
        self._step_key: Any = None  # the SAE's plan of this batch's step (`SparseAutoencoder.plan_step`)

    # --- input ----------------------------------------------------------------------------
    def preprocess(self, x: Tensor) -> Tensor:
        """``x · input_scale`` (the scale is 1 unless ``normalize_input``)."""
        return x * self.input_scale.to(x.dtype)

    def _checked_input(self, batch: dict[str, Any], stage: str) -> Tensor:
        x = batch["x"]
        if not torch.isfinite(x).all():
            n_bad = int((~torch.isfinite(x)).sum())
            raise non_finite_batch(f"{stage}{self.label}", self.global_step, batch_sources(batch), n_bad)
        return self.preprocess(x)

    # --- data-dependent initialisation -----------------------------------------------------
    def setup(self, stage: str) -> None:
        """Take ``input_scale`` and ``b_pre`` from the datamodule's statistics (once).

        Runs before Lightning restores a checkpoint, so a resumed run ends with the
        checkpoint's values either way; the flag buffer covers a module reused in-process.
        """
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is None:
            return
        d_in = getattr(datamodule, "d_in", None)
        if d_in is not None and d_in != self.sae.d_in:
            raise ValueError(
                f"data d_in={d_in} differs from model.sae.init_args.d_in={self.sae.d_in}; "
                "drop d_in from the config so the CLI links it from the data"
            )
        manifest = getattr(datamodule, "manifest", None)
        self.data_info = {
            "source": str(getattr(datamodule, "source", None)),
            "d_in": d_in,
            "manifest_sha256": manifest_sha256(manifest) if manifest else None,
            # the backbone behind the tokens, so that an export can run it on new images (features explain)
            "extraction": extraction_record(manifest) if manifest else None,
        }
        if bool(self.initialized_from_data):
            return
        stats = getattr(datamodule, "stats", None)
        if stats:
            try:
                self.init_from_data(torch.as_tensor(stats["mean"], dtype=torch.float32), float(stats["mean_sq_norm"]))
            except ValueError as exn:
                raise ValueError(f"data.source {self.data_info['source']}: {exn}") from None

    @torch.no_grad()
    def init_from_data(self, mean: Tensor, mean_sq_norm: float) -> None:
        """Set ``input_scale = sqrt(d_in / E‖x‖²)`` (when normalising) and ``b_pre = mean · input_scale``."""
        if not (math.isfinite(mean_sq_norm) and mean_sq_norm > 0 and bool(torch.isfinite(mean).all())):
            raise ValueError(
                f"the data statistics are not finite and positive (mean squared norm {mean_sq_norm}); "
                "the data holds NaN/Inf or only zeros: repair or drop it"
            )
        scale = math.sqrt(self.sae.d_in / mean_sq_norm) if self.hparams.normalize_input else 1.0
        self.input_scale.fill_(scale)
        self.sae.init_b_pre(mean.to(self.sae.b_pre.device, self.sae.b_pre.dtype) * scale)
        self.initialized_from_data.fill_(True)
        self._initialized_cache = True

    def on_train_batch_start(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Without datamodule statistics (plain dataloaders), initialise from the first batch,
        averaged over ranks."""
        if self._initialized_cache is None:  # read the buffer once, not every step (a device sync)
            self._initialized_cache = bool(self.initialized_from_data)
        if not self._initialized_cache:
            self._init_from_batch(batch)
        self._replay = self.graph_step.use_for(self, batch)
        # what the step's work depends on that the host knows (TopK: AuxK's slots from the late dead count)
        self._step_key = self.sae.plan_step()

    def on_train_start(self) -> None:
        """The SAE's host-side state for this fit (TopK: its late dead count, from the clock as restored), and
        a new report of the sparse products' choices (each logged once per fit)."""
        self.sae.begin_fit()
        product_choice.CHOOSER.new_fit()

    def on_train_batch_end(self, outputs: Any, batch: dict[str, Any], batch_idx: int) -> None:
        """After the step is queued (replayed or eager): the SAE's host-side bookkeeping (TopK: the dead count's
        non-blocking copy that a step `aux_lag` steps on plans with), and one INFO line per sparse product whose
        choice of Triton kernel or cuBLAS this fit has not said yet (`sae_pipeline.sae.product_choice`: measured
        at the product's first call, i.e. in the first step; nothing to say on the CPU)."""
        self.sae.after_step()
        for line in product_choice.CHOOSER.report():
            rank_zero_info(line)

    def _init_from_batch(self, batch: dict[str, Any]) -> None:
        x = batch["x"].detach().float()
        moments = torch.cat([x.mean(0), x.square().sum(1).mean()[None]])
        if _world_size() > 1:
            dist.all_reduce(moments)
            moments /= _world_size()
        self.init_from_data(moments[:-1], float(moments[-1]))

    # --- training ---------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        replayed = self.graph_step.run(self, batch, self._step_key) if self._replay else None
        if replayed is None:
            x, output, losses = self.step_loss(batch)
            self.log("train/loss", losses.loss, prog_bar=True)  # a tensor: read only when Lightning writes it
        else:
            # the step has run (backward and Adam included); its outputs are the graph's, rewritten next step
            x, output, losses = replayed
            if self.sae.avoids_host_reads(x):
                self.non_finite.remember(self.global_step, batch)
            loss = losses.loss.detach().clone()
            self.log("train/loss", loss, prog_bar=True)
        if self._is_logging_step():
            self.raise_if_non_finite()
            # The other train metrics cost a few ms each (L0 and R² read the whole batch) and
            # Lightning only writes them every `log_every_n_steps`: compute them only then.
            for name, value in self.train_metrics(x, output, losses).items():
                self.log(name, value)
            self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss if replayed is not None else losses.loss

    def step_loss(self, batch: dict[str, Any], static_step: Tensor | None = None) -> tuple[Tensor, Any, Any]:
        """Input, SAE output and losses of one training batch, the dead-latent clock advanced
        (shared with `sae_pipeline.training.group.SAEGroupModule`, which runs it per member).

        NaN/Inf in the batch or the loss raises at once on the CPU; on a GPU it is noted on the device
        and raised by `raise_if_non_finite` (logging steps, checkpoints), naming the same step. ``static_step``:
        the global step as a device scalar (a captured step, `sae_pipeline.training.graph_step`)."""
        deferred = self.sae.avoids_host_reads(batch["x"])
        x = self.preprocess(batch["x"]) if deferred else self._checked_input(batch, "training")
        with self.sae.finite_checked_by_caller():
            output = self.sae(x)
        losses = self.sae.loss(x, output, step=self.global_step)
        if deferred:
            step = self.global_step if static_step is None else static_step
            self.non_finite.note(step, batch, batch["x"], losses.loss)
        elif not torch.isfinite(losses.loss):
            raise non_finite_loss(
                f"training{self.label}", self.global_step, batch_sources(batch), float(losses.loss), self._lr_setting()
            )
        self.record_firing(output.fired(), x.shape[0])
        return x, output, losses

    def _lr_setting(self) -> str:
        return f"{self.config_prefix}.lr (now {self.hparams.lr})"

    def raise_if_non_finite(self) -> None:
        """Raise for a NaN/Inf batch or loss that the step noted on the device (one host read)."""
        self.non_finite.raise_if_seen(f"training{self.label}", self._lr_setting())

    def train_metrics(self, x: Tensor, output: Any, losses: Any) -> dict[str, Tensor]:
        """The training scalars of a logging step beside the loss (also each member's in a group)."""
        values = {f"train/{name}": term for name, term in losses.terms.items()}  # mse, sparsity_loss, aux_loss...
        values["train/l0"] = output.l0().float()
        values["train/r2"] = self.train_r2(x, output.x_hat).float()
        values["train/dead_fraction"] = dead_fraction(self.sae.tokens_since_fired, self.sae.dead_after_tokens).float()
        return values

    def _is_logging_step(self) -> bool:
        """Whether Lightning writes this step's logged values (its own rule, so none is lost)."""
        return lightning_compat.should_update_logs(self.trainer)

    @torch.no_grad()
    def record_firing(self, fired: Tensor, n_tokens: int) -> None:
        """Advance the dead-latent clock with this step's firing (bool ``[d_sae]``, from the sparse
        codes when there are) from every rank: a latent fired if it fired on any rank, and the
        token count is the sum (one all-reduce)."""
        counts = torch.cat([fired.to(torch.int64), fired.new_full((1,), n_tokens, dtype=torch.int64)])
        if _world_size() > 1:
            dist.all_reduce(counts)
        self.sae.record_firing(counts[:-1] > 0, counts[-1])

    def on_train_epoch_end(self) -> None:
        self.raise_if_non_finite()
        self.train_r2.reset()

    def on_validation_start(self) -> None:
        self.raise_if_non_finite()

    def on_train_end(self) -> None:
        self.raise_if_non_finite()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.sae.remove_parallel_grad()

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if self._replay:  # the closure runs training_step, whose replay is the whole step (Adam included)
            optimizer_closure()
            return
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self.sae.normalize_atoms()

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        if not self._replay:  # a replayed step has run its backward in the graph
            super().backward(loss, *args, **kwargs)

    def _estimated_total_steps(self) -> float:
        """``trainer.estimated_stepping_batches``, without its side effect on a resumed run.

        Called here (before Lightning restores a checkpoint's loop state), the estimate builds
        the training loader and starts its iterator, and the fit loop then keeps both: the
        loader's saved position is never loaded and the resumed epoch would start over with
        epoch 0's order. So the early set-up is dropped; the fit loop builds the loader again
        after the restore.
        """
        built_here = not lightning_compat.has_train_loader(self.trainer)
        total_steps = self.trainer.estimated_stepping_batches
        if built_here and lightning_compat.has_train_loader(self.trainer):
            lightning_compat.discard_train_loader(self.trainer)
        return total_steps

    def configure_optimizers(self) -> dict[str, Any]:
        total_steps = self._estimated_total_steps()
        if not math.isfinite(total_steps) or total_steps < 1:
            raise ValueError(
                f"the run's number of optimiser steps is {total_steps}; set --trainer.max_steps or "
                "--trainer.max_epochs so the cosine schedule has an end"
            )
        total_steps = int(total_steps)
        optimizer = torch.optim.Adam(param_groups(self.sae, self.hparams.lr), **adam_implementation(self.sae))
        factor = partial(
            warmup_cosine_factor,
            warmup_steps=min(self.hparams.warmup_steps, total_steps),
            total_steps=total_steps,
            min_ratio=self.hparams.min_lr / self.hparams.lr,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    # --- evaluation --------------------------------------------------------------------------
    def _eval_step(self, batch: dict[str, Any], stage: str) -> None:
        x = self._checked_input(batch, stage)
        output = self.sae(x)
        getattr(self, f"{stage}_r2").update(x, output.x_hat)
        getattr(self, f"{stage}_stats").update(output.codes)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def _log_eval_epoch(self, stage: str) -> None:
        for name, value in self.eval_epoch_values(stage).items():
            # Identical on every rank already; the max over ranks keeps it exact (a mean could round).
            self.log(f"{stage}/{name}", float(value), sync_dist=True, reduce_fx="max")

    def eval_epoch_values(self, stage: str) -> dict[str, Tensor]:
        """All-reduce the float64 sums (every rank calls this, even with no batch) and return R², MSE,
        L0 and the dead fraction as the values of the whole evaluated set, then reset."""
        r2_metric: ReconstructionR2 = getattr(self, f"{stage}_r2")
        stats_metric: ActivationStats = getattr(self, f"{stage}_stats")
        with r2_metric.sync_context(), stats_metric.sync_context():
            if r2_metric.n.item() > 0:
                values = {
                    "r2": r2_metric.compute(),
                    "mse": r2_metric.sum_sq_err / (r2_metric.n * self.sae.d_in),
                    "l0": stats_metric.compute()["l0"],
                }
            else:
                values = {}
        r2_metric.reset()
        stats_metric.reset()
        values["dead_fraction"] = dead_fraction(self.sae.tokens_since_fired, self.sae.dead_after_tokens)
        return values

    def on_validation_epoch_end(self) -> None:
        self._log_eval_epoch("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval_epoch("test")

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        """Sparse codes in raw units (trained codes / input_scale, as the exported SAE gives them), ranked
        from the SAE's sparse entries (`encode_sparse`: no ``[B, d_sae]`` codes for the k-sparse variants)."""
        x = self._checked_input(batch, "predict")
        codes = self.sae.encode_sparse(x)
        assert codes.values is not None
        indices, values = ranked_lists(codes.with_values(codes.values.float() / self.input_scale))
        return {
            "image_ids": list(batch["image_ids"]),
            "token_positions": batch["token_positions"],
            "indices": indices,
            "values": values,
        }

    # --- checkpoints ------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Plain data export needs without unpickling Python objects; none of weights that saw NaN/Inf."""
        self.raise_if_non_finite()
        checkpoint["sae_config"] = sae_config(self.sae)
        checkpoint["input_scale"] = float(self.input_scale)
        checkpoint["data"] = self.data_info
        checkpoint["sae_pipeline_version"] = sae_pipeline.__version__
        for optimizer_state in checkpoint.get("optimizer_states", []):
            checkpoint_groups(optimizer_state)  # as an eager run writes it (learning rates as numbers)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._initialized_cache = None  # the restored buffer decides
        if self.data_info is None:
            self.data_info = checkpoint.get("data")
