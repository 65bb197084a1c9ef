"""SAEModule: schedule, dictionary constraint, data initialisation, resume, NaN errors, dead latents,
exact validation metrics -- each against a plain re-derivation in the test."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from sae_pipeline.data import ActivationDataModule
from sae_pipeline.sae import MatchingPursuitSAE, TopKSAE
from sae_pipeline.training.module import NonFiniteBatchError, SAEModule
from sae_pipeline.training.optim import warmup_cosine_factor

D_IN, D_SAE, BATCH = 16, 64, 32


def memory_loader(x: Tensor, batch_size: int = BATCH, nan_at_batch: int | None = None) -> DataLoader:
    """Batches ``{"x", "shards"}`` of ``x`` in order; optionally a NaN in one batch."""

    def collate(rows: list[int]) -> dict[str, Any]:
        batch = x[rows].clone()
        index = rows[0] // batch_size
        if index == nan_at_batch:
            batch[1, 2] = float("nan")
        return {"x": batch, "shards": [f"shard-{index:06d}.tar"]}

    return DataLoader(list(range(len(x))), batch_size=batch_size, collate_fn=collate, drop_last=True)


def make_data(n: int = 8 * BATCH, seed: int = 0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return 3.0 * torch.randn(n, D_IN, generator=generator) + torch.linspace(-2, 2, D_IN)


def trainer(tmp_path: Path, **kwargs: Any) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    return L.Trainer(**{**defaults, **kwargs})


def make_module(seed: int = 0, **kwargs: Any) -> SAEModule:
    torch.manual_seed(seed)
    return SAEModule(TopKSAE(D_IN, D_SAE, k=4), **kwargs)


class Recorder(L.Callback):
    """Learning rate and b_pre seen at the start of each training batch."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.b_pre_at_start: Tensor | None = None
        self.tokens_since_fired_at_start: Tensor | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.b_pre_at_start = pl_module.sae.b_pre.detach().clone()
        self.tokens_since_fired_at_start = pl_module.sae.tokens_since_fired.clone()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        if trainer.global_step == 0:  # the b_pre of the first forward pass
            self.b_pre_at_first_step = pl_module.sae.b_pre.detach().clone()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def reference_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step + 1 - warmup) / max(total - warmup, 1)) if total > warmup else 0.0
    return min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * t)) / 2


@pytest.mark.parametrize(("warmup", "total"), [(3, 20), (0, 7), (10, 10), (5, 1)])
def test_warmup_cosine_factor_matches_formula(warmup: int, total: int) -> None:
    for step in range(total + 3):
        expected = reference_factor(step, warmup, total, 0.01)
        assert warmup_cosine_factor(step, warmup, total, 0.01) == pytest.approx(expected, abs=1e-12)


def test_lr_schedule_in_a_run_warms_up_then_ends_at_min_lr(tmp_path: Path) -> None:
    lr, min_lr, warmup, total = 1e-2, 1e-4, 4, 12
    module, recorder = make_module(lr=lr, warmup_steps=warmup, min_lr=min_lr), Recorder()
    trainer(tmp_path, max_steps=total, callbacks=[recorder]).fit(module, memory_loader(make_data(16 * BATCH)))
    expected = [lr * reference_factor(step, warmup, total, min_lr / lr) for step in range(total)]
    assert recorder.lrs == pytest.approx(expected, rel=1e-9)
    assert recorder.lrs[warmup - 1] == pytest.approx(lr) and recorder.lrs[-1] == pytest.approx(min_lr)
    assert recorder.lrs[0] == pytest.approx(lr / warmup)


def test_warmup_is_capped_by_the_total(tmp_path: Path) -> None:
    recorder = Recorder()
    trainer(tmp_path, max_steps=3, callbacks=[recorder]).fit(
        make_module(lr=1e-3, warmup_steps=1000), memory_loader(make_data())
    )
    assert recorder.lrs == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])


class GradientProbe(SAEModule):
    """Records, per step, the grad's component along each atom before and after the projection."""

    parallel_before: list[Tensor]
    parallel_after: list[Tensor]

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        W, grad = self.sae.W_dec.detach(), self.sae.W_dec.grad
        self.parallel_before.append((grad * W).sum(1).abs().max())
        super().on_before_optimizer_step(optimizer)
        self.parallel_after.append(((grad * W).sum(1) / (grad.norm(dim=1) + 1e-12)).abs().max())


def test_unit_norm_atoms_and_parallel_grad_removed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = GradientProbe(MatchingPursuitSAE(D_IN, D_SAE, k=3), lr=5e-2, warmup_steps=0)
    module.parallel_before, module.parallel_after = [], []
    W_start = module.sae.W_dec.detach().clone()
    trainer(tmp_path, max_steps=6).fit(module, memory_loader(make_data()))
    assert len(module.parallel_after) == 6
    assert max(float(v) for v in module.parallel_before) > 1e-3  # there was something to remove
    assert max(float(v) for v in module.parallel_after) < 1e-5
    norms = module.sae.W_dec.detach().norm(dim=1)
    torch.testing.assert_close(norms, torch.ones(D_SAE), atol=1e-6, rtol=0)
    assert (module.sae.W_dec.detach() - W_start).abs().max() > 1e-2  # the atoms did move


def test_input_scale_and_b_pre_from_datamodule_stats(tmp_path: Path) -> None:
    dm = ActivationDataModule("digits", batch_size=128, num_workers=0, shuffle_buffer_tokens=1024)
    torch.manual_seed(0)
    module, recorder = SAEModule(TopKSAE(64, 128, k=4), warmup_steps=0), Recorder()
    trainer(tmp_path, max_steps=2, callbacks=[recorder]).fit(module, dm)
    # Reference statistics straight from the training rows the loader yields.
    rows = torch.cat([batch["x"] for batch in dm.train_dataloader()])
    scale = math.sqrt(64 / rows.square().sum(1).mean().item())
    assert float(module.input_scale) == pytest.approx(scale, rel=2e-2)
    assert float(module.input_scale) == pytest.approx(math.sqrt(64 / dm.stats["mean_sq_norm"]), rel=1e-6)
    torch.testing.assert_close(recorder.b_pre_at_start, dm.stats["mean"] * float(module.input_scale))
    assert module.preprocess(rows).square().sum(1).mean().item() == pytest.approx(64, rel=2e-2)


def test_normalize_input_off_keeps_raw_scale_and_first_batch_fallback(tmp_path: Path) -> None:
    x = make_data()
    module, recorder = make_module(normalize_input=False, warmup_steps=0), Recorder()
    trainer(tmp_path, max_steps=1, callbacks=[recorder]).fit(module, memory_loader(x))
    assert float(module.input_scale) == 1.0
    # Without a datamodule, the first batch gives the statistics.
    torch.testing.assert_close(recorder.b_pre_at_first_step, x[:BATCH].mean(0))
    module2 = make_module(warmup_steps=0)
    trainer(tmp_path, max_steps=1).fit(module2, memory_loader(x))
    assert float(module2.input_scale) == pytest.approx(
        math.sqrt(D_IN / x[:BATCH].square().sum(1).mean().item()), rel=1e-6
    )


def test_b_pre_initialised_once_never_on_resume(tmp_path: Path) -> None:
    x = make_data()
    module, first = make_module(lr=5e-2, warmup_steps=0), Recorder()
    trainer(tmp_path, max_steps=4, callbacks=[first]).fit(module, memory_loader(x))
    scale = float(module.input_scale)
    torch.testing.assert_close(first.b_pre_at_first_step, x[:BATCH].mean(0) * scale)
    trained_b_pre = module.sae.b_pre.detach().clone()
    assert (trained_b_pre - first.b_pre_at_first_step).abs().max() > 1e-3  # b_pre trained away from the mean
    # A second fit on the same module does not reset it.
    again = Recorder()
    trainer(tmp_path, max_steps=1, callbacks=[again]).fit(module, memory_loader(x.flip(0)))
    torch.testing.assert_close(again.b_pre_at_start, trained_b_pre)
    # Resume into a fresh module: the checkpoint's b_pre and scale, not the new data's mean.
    ckpt_fpath = tmp_path / "resume.ckpt"
    fit_trainer = trainer(tmp_path, max_steps=4)
    fresh = make_module(lr=5e-2, warmup_steps=0)
    fit_trainer.fit(fresh, memory_loader(x))
    fit_trainer.save_checkpoint(ckpt_fpath)
    saved_b_pre, saved_tokens = fresh.sae.b_pre.detach().clone(), fresh.sae.tokens_since_fired.clone()
    resumed, recorder = make_module(seed=5, lr=5e-2, warmup_steps=0), Recorder()
    resume_trainer = trainer(tmp_path, max_steps=6, callbacks=[recorder])
    resume_trainer.fit(resumed, memory_loader(3 * x + 7), ckpt_path=ckpt_fpath)
    torch.testing.assert_close(recorder.b_pre_at_start, saved_b_pre)
    assert float(resumed.input_scale) == pytest.approx(float(fresh.input_scale))
    torch.testing.assert_close(recorder.tokens_since_fired_at_start, saved_tokens)
    assert saved_tokens.max() > 0  # a non-trivial dead-latent clock was carried over
    assert resume_trainer.global_step == 6 and len(recorder.lrs) == 2


def test_dead_latent_clock_matches_reference(tmp_path: Path) -> None:
    x = make_data(12 * BATCH)
    module = make_module(lr=1e-2, warmup_steps=0)
    codes_per_step: list[Tensor] = []
    forward = module.sae.forward

    def recording_forward(inputs: Tensor) -> Any:
        output = forward(inputs)
        if module.sae.training:
            codes_per_step.append(output.codes.detach().clone())
        return output

    module.sae.forward = recording_forward  # type: ignore[method-assign]
    trainer(tmp_path, max_steps=10).fit(module, memory_loader(x))
    expected = torch.zeros(D_SAE, dtype=torch.int64)
    for codes in codes_per_step:
        expected += codes.shape[0]
        expected[(codes != 0).any(0)] = 0
    assert len(codes_per_step) == 10
    torch.testing.assert_close(module.sae.tokens_since_fired, expected)
    assert expected.max() > 0  # some latent stayed silent for a while: the test can fail


def test_nan_batch_names_step_and_shard_and_keeps_checkpoints(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=-1)
    run = trainer(tmp_path, max_steps=8, enable_checkpointing=True, callbacks=[checkpoint])
    with pytest.raises(NonFiniteBatchError) as info:
        run.fit(make_module(warmup_steps=0), memory_loader(make_data(), nan_at_batch=3))
    message = str(info.value)
    assert "global step 3" in message and "shard-000003.tar" in message and "\n" not in message
    assert isinstance(info.value, ValueError)
    saved = sorted((tmp_path / "ckpts").glob("*.ckpt"))
    assert len(saved) == 3
    for fpath in saved:
        state = torch.load(fpath, weights_only=True)
        assert torch.isfinite(state["state_dict"]["sae.W_dec"]).all()


def test_validation_metrics_are_exact_over_the_set(tmp_path: Path) -> None:
    x_train, x_val = make_data(), make_data(5 * 24 + 7, seed=1)
    module = make_module(lr=1e-2, warmup_steps=0)
    run = trainer(tmp_path, max_steps=3)
    run.fit(module, memory_loader(x_train))
    val_loader = DataLoader(
        list(range(len(x_val))), batch_size=24, collate_fn=lambda rows: {"x": x_val[rows], "shards": ["val"]}
    )
    metrics = run.validate(module, val_loader, verbose=False)[0]
    module.eval()
    with torch.no_grad():
        x = module.preprocess(x_val).double()
        output = module.sae(x.float())
        x_hat, codes = output.x_hat.double(), output.codes
    r2 = 1 - (x - x_hat).square().sum() / (x - x.mean(0)).square().sum()
    assert metrics["val/r2"] == pytest.approx(r2.item(), abs=1e-6)
    assert metrics["val/mse"] == pytest.approx((x - x_hat).square().mean().item(), rel=1e-5)
    assert metrics["val/l0"] == pytest.approx((codes != 0).sum(1).double().mean().item(), rel=1e-9)
    dead = (module.sae.tokens_since_fired >= module.sae.dead_after_tokens).double().mean().item()
    assert metrics["val/dead_fraction"] == pytest.approx(dead)


def test_bad_arguments_raise_one_line_errors() -> None:
    sae = TopKSAE(D_IN, D_SAE, k=4)
    for kwargs, flag in [
        ({"lr": 0.0}, "model.lr"),
        ({"min_lr": 1.0}, "model.min_lr"),
        ({"warmup_steps": -1}, "model.warmup_steps"),
        ({"inference_ks": [0]}, "model.inference_ks"),
    ]:
        with pytest.raises(ValueError, match=flag):
            SAEModule(sae, **kwargs)


def test_train_metrics_logged_on_every_logging_step_only(tmp_path: Path) -> None:
    """The train metrics are computed only when Lightning writes logs: none of its logging
    steps may lose them, and the values are this run's (TopK with k=4: L0 = 4)."""
    from lightning.pytorch.loggers import CSVLogger

    x = make_data(n=7 * BATCH)
    module = make_module(warmup_steps=1)
    logger = CSVLogger(str(tmp_path), name="run", version=0)
    fit = trainer(tmp_path, max_steps=7, log_every_n_steps=3, logger=logger)
    fit.fit(module, train_dataloaders=memory_loader(x))
    rows = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    steps_with = {
        name: sorted(
            int(r.split(",")[header.index("step")]) for r in rows[1:] if r.split(",")[header.index(name)] != ""
        )
        for name in ("train/loss", "train/r2", "train/l0", "lr")
    }
    assert steps_with["train/loss"] == [2, 5], steps_with  # Lightning's rule: every 3rd optimiser step
    assert all(steps == steps_with["train/loss"] for steps in steps_with.values()), steps_with
    l0_values = [
        float(r.split(",")[header.index("train/l0")]) for r in rows[1:] if r.split(",")[header.index("train/l0")]
    ]
    assert l0_values == [4.0, 4.0]


class TopKWithExtraTerm(TopKSAE):
    """A variant that adds a loss term without touching SAELoss or SAEModule."""

    def loss_terms(self, x: Tensor, output: Any, step: int) -> dict[str, Tensor]:
        return {**super().loss_terms(x, output, step), "code_energy": 1e-3 * output.codes.square().mean()}


def test_every_loss_term_is_logged_under_its_name(tmp_path: Path) -> None:
    """train/mse, train/sparsity_loss, train/aux_loss (the tags since the first release) and a variant's own
    term are logged at each logging step, and train/loss is their sum."""
    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    module = SAEModule(TopKWithExtraTerm(D_IN, D_SAE, k=4), warmup_steps=1)
    logger = CSVLogger(str(tmp_path), name="run", version=0)
    trainer(tmp_path, max_steps=4, log_every_n_steps=2, logger=logger).fit(module, memory_loader(make_data()))
    rows = [row.split(",") for row in (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()]
    header, rows = rows[0], rows[1:]
    terms = ["train/mse", "train/sparsity_loss", "train/aux_loss", "train/code_energy"]
    logged = [row for row in rows if row[header.index("train/code_energy")] != ""]
    assert len(logged) == 2
    for row in logged:
        values = [float(row[header.index(tag)]) for tag in terms]
        assert values[0] > 0 and values[1] == 0 and values[3] > 0  # TopK: no sparsity penalty
        assert float(row[header.index("train/loss")]) == pytest.approx(sum(values), rel=1e-6)
