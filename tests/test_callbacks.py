"""SAEFigures: a real Trainer run on digits writes every contracted TensorBoard tag, and the values
match plain reference computations (full Gram matrix Babel, R² by hand, firing counts)."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import sae_pipeline.metrics.measure as measure_module
from sae_pipeline.data import ActivationDataModule
from sae_pipeline.demo_report import format_table, read_final_metrics
from sae_pipeline.metrics.measure import default_inference_ks, evaluate_sae
from sae_pipeline.sae import MatchingPursuitSAE, ReLUSAE, SparseAutoencoder, TopKSAE
from sae_pipeline.training.callbacks import SAEFigures
from sae_pipeline.training.module import SAEModule

SCALAR_TAGS = [
    "train/loss",
    "train/mse",
    "train/l0",
    "train/r2",
    "lr",
    "val/r2",
    "val/l0",
    "val/dead_fraction",
    "val/babel_dict_r1",
    "val/babel_dict_rk",
    "val/babel_coactive_r1",
    "val/babel_coactive_rk",
]
IMAGE_TAGS = ["val/babel", "val/r2_vs_k", "val/atoms"]
HISTOGRAM_TAGS = ["val/activation_frequency", "val/mean_activation"]


# --- plain references ------------------------------------------------------------------------
def reference_babel(W: torch.Tensor, r_max: int) -> torch.Tensor:
    """μ₁(r) from the whole Gram matrix: max over j of the sum of the r largest |<d_i, d_j>|, i != j."""
    W = W.double() / W.double().norm(dim=1, keepdim=True)
    gram = (W @ W.T).abs()
    gram.fill_diagonal_(-math.inf)
    return gram.topk(r_max, dim=1).values.cumsum(dim=1).amax(dim=0)


def reference_babel_coactive(W: torch.Tensor, codes: torch.Tensor, r: int) -> float:
    """Token by token: μ₁(r) within the active atoms (sum over all others when fewer than r), mean."""
    W = W.double() / W.double().norm(dim=1, keepdim=True)
    total = 0.0
    for row in codes:
        active = row.nonzero().flatten()
        if active.numel() <= 1:
            continue
        gram = (W[active] @ W[active].T).abs()
        gram.fill_diagonal_(0.0)
        top = gram.sort(dim=1, descending=True).values[:, : min(r, active.numel() - 1)]
        total += float(top.sum(dim=1).max())
    return total / codes.shape[0]


def reference_r2(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    x, x_hat = x.double(), x_hat.double()
    return float(1 - (x - x_hat).square().sum() / (x - x.mean(0)).square().sum())


# --- a real run ---------------------------------------------------------------------------------
def fit_on_digits(
    sae: SparseAutoencoder, tmp_path: Path, every_n_val_epochs: int = 1
) -> tuple[SAEModule, ActivationDataModule, Path]:
    """4 optimiser steps on digits, validation after steps 2 and 4 (plus the sanity check)."""
    torch.manual_seed(0)
    datamodule = ActivationDataModule("digits", batch_size=128, num_workers=0, shuffle_buffer_tokens=512)
    module = SAEModule(sae, lr=1e-3, warmup_steps=1, babel_r_max=8)
    logger = TensorBoardLogger(save_dir=str(tmp_path), name="run", version=0)
    trainer = L.Trainer(
        max_steps=4,
        val_check_interval=2,
        log_every_n_steps=1,
        logger=logger,
        accelerator="cpu",
        callbacks=[SAEFigures(every_n_val_epochs=every_n_val_epochs)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
    )
    trainer.fit(module, datamodule=datamodule)
    return module, datamodule, Path(logger.log_dir)


def read_events(log_dpath: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(log_dpath), size_guidance={"images": 0, "histograms": 0, "scalars": 0})
    accumulator.Reload()
    return accumulator


@pytest.mark.parametrize(("variant", "every_n_val_epochs", "figure_steps"), [("mp", 1, [1, 3]), ("topk", 2, [1])])
def test_trainer_run_writes_every_tag_with_reference_values(
    variant: str, every_n_val_epochs: int, figure_steps: list[int], tmp_path: Path
) -> None:
    sae: SparseAutoencoder
    if variant == "mp":
        sae = MatchingPursuitSAE(d_in=64, d_sae=96, k=4)
    else:
        sae = TopKSAE(d_in=64, d_sae=96, k=4)
    module, datamodule, log_dpath = fit_on_digits(sae, tmp_path, every_n_val_epochs)
    events = read_events(log_dpath)
    tags = events.Tags()

    for tag in SCALAR_TAGS:
        assert tag in tags["scalars"], f"missing scalar {tag}; have {sorted(tags['scalars'])}"
        values = [event.value for event in events.Scalars(tag)]
        assert values and all(math.isfinite(value) for value in values), (tag, values)
    for tag in IMAGE_TAGS:
        assert tag in tags["images"], f"missing image {tag}; have {tags['images']}"
        images = events.Images(tag)
        assert [image.step for image in images] == figure_steps  # sanity check skipped, every n-th epoch
        assert images[-1].encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n" and images[-1].width > 100
    for tag in HISTOGRAM_TAGS:
        assert tag in tags["histograms"], f"missing histogram {tag}; have {tags['histograms']}"
    assert [event.step for event in events.Scalars("val/babel_dict_r1")] == figure_steps

    # The demo's reader returns the last event of each tag.
    final = read_final_metrics(log_dpath)
    for tag, (step, value) in final.items():
        assert (step, value) == (events.Scalars(tag)[-1].step, events.Scalars(tag)[-1].value)
    assert f"{final['val/r2'][1]:.3f}" in format_table([("x", final)])
    with pytest.raises(ValueError, match="no scalar val/missing"):
        read_final_metrics(log_dpath, ("val/missing",))

    # Lightning logs a validation after optimiser step n at step n - 1; the figures share that step.
    # The last figure step (3) is the end of training: recompute everything from the final model.
    sae = module.sae.eval()
    x = module.preprocess(datamodule.eval_sample())
    with torch.no_grad():
        codes = sae.encode(x)
    k = sae.k
    dictionary = reference_babel(sae.W_dec.detach(), 8)
    expected = {
        "val/babel_dict_r1": float(dictionary[0]),
        "val/babel_dict_rk": float(dictionary[k - 1]),
        "val/babel_coactive_r1": reference_babel_coactive(sae.W_dec.detach(), codes, 1),
        "val/babel_coactive_rk": reference_babel_coactive(sae.W_dec.detach(), codes, k),
    }
    if figure_steps[-1] == 3:
        for tag, value in expected.items():
            assert events.Scalars(tag)[-1].value == pytest.approx(value, rel=1e-4, abs=1e-5), tag
    frequency = (codes != 0).double().mean(0)
    histogram = events.Histograms("val/activation_frequency")[-1].histogram_value
    assert histogram.num == sae.d_sae
    if figure_steps[-1] == 3:
        assert histogram.sum == pytest.approx(float(frequency.sum()), rel=1e-6)
        assert histogram.max == pytest.approx(float(frequency.max()), rel=1e-6)
    mean_histogram = events.Histograms("val/mean_activation")[-1].histogram_value
    assert mean_histogram.num == sae.d_sae


@pytest.mark.parametrize("variant", ["mp", "topk", "relu"])
def test_evaluate_sae_matches_references_and_chunking(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    sae: SparseAutoencoder
    if variant == "mp":
        sae = MatchingPursuitSAE(d_in=16, d_sae=40, k=3)
    elif variant == "topk":
        sae = TopKSAE(d_in=16, d_sae=40, k=3)
    else:
        sae = ReLUSAE(d_in=16, d_sae=40)
        with torch.no_grad():
            sae.b_enc.fill_(-0.8)  # a sparse-ish ReLU so that L0 is a handful of atoms
    sae.eval()
    x = torch.randn(160, 16) @ torch.randn(16, 16) * 0.5 + 1.0
    with torch.no_grad():
        codes = sae.encode(x)
    l0 = float((codes != 0).double().sum(1).mean())
    k = sae.k if sae.k is not None else max(1, round(l0))
    ks = [1, 2, 5, 41]  # 41 > d_sae: dropped, except for MP-SAE (its pursuit picks atoms again)
    kept = [1, 2, 5, 41] if variant == "mp" else [1, 2, 5]

    whole = evaluate_sae(sae, x, r_max=6, ks=ks)
    monkeypatch.setattr(measure_module, "_CHUNK_ELEMENTS", 40 * 70)  # 70-token chunks, the last one short
    chunked = evaluate_sae(sae, x, r_max=6, ks=ks)

    r_max = max(6, k)
    expected_dictionary = reference_babel(sae.W_dec.detach(), r_max)
    expected_coactive = {r: reference_babel_coactive(sae.W_dec.detach(), codes, r) for r in (1, k)}
    with torch.no_grad():
        expected_r2 = [reference_r2(x, sae.decode(sae.encode(x, value))) for value in kept]
    for report in (whole, chunked):
        assert report["k"] == k and report["ks"] == kept
        assert report["l0"] == pytest.approx(l0)
        torch.testing.assert_close(report["babel_dict"].double(), expected_dictionary, rtol=1e-5, atol=1e-5)
        assert report["babel_dict_rk"] == pytest.approx(float(expected_dictionary[k - 1]), rel=1e-5)
        for r, name in ((1, "babel_coactive_r1"), (k, "babel_coactive_rk")):
            assert report[name] == pytest.approx(expected_coactive[r], rel=1e-5)
        assert report["r2_by_k"] == pytest.approx(expected_r2, rel=1e-6, abs=1e-9)
        torch.testing.assert_close(report["frequency"], (codes != 0).double().mean(0))
        torch.testing.assert_close(report["mean_value"], codes.double().mean(0))


def test_default_inference_ks_and_bad_arguments() -> None:
    for k, d_sae in ((10, 1000), (1, 5), (16, 40), (7, 7)):
        expected = sorted(v for v in {2**i for i in range(12) if 2**i <= 4 * k} | {k, 4 * k} if v <= d_sae)
        assert default_inference_ks(k, d_sae) == expected
    assert default_inference_ks(10, 1000) == [1, 2, 4, 8, 10, 16, 32, 40]
    for kwargs in ({"every_n_val_epochs": 0}, {"ks": [0, 2]}, {"ks": []}, {"r_max": -1}, {"n_atoms": 1.5}):
        with pytest.raises(ValueError, match=next(iter(kwargs))[:2]):
            SAEFigures(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="d_in=16"):
        evaluate_sae(TopKSAE(d_in=16, d_sae=40, k=3), torch.zeros(5, 8), r_max=4)
    state = SAEFigures()
    state.load_state_dict({"n_val_epochs": 3})
    assert state.state_dict() == {"n_val_epochs": 3}
    assert np.isfinite(default_inference_ks(3, 100)).all()
