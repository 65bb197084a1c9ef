"""The optional TopPatches callback writes a real image into TensorBoard's event files at validation."""

from __future__ import annotations

import io
from pathlib import Path

import lightning as L
import numpy as np
import pytest
from features_fixtures import write_shards
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sae_pipeline.data import ActivationDataModule
from sae_pipeline.features.tensorboard import TAG, TopPatches
from sae_pipeline.sae import MatchingPursuitSAE, ReLUSAE
from sae_pipeline.training.module import SAEModule


def fit_with(callback: TopPatches, datamodule: ActivationDataModule, sae, root: Path) -> np.ndarray:
    logger = TensorBoardLogger(str(root), name="run", default_hp_metric=False)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        limit_val_batches=1,
        val_check_interval=2,
        logger=logger,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(SAEModule(sae, warmup_steps=1), datamodule=datamodule)
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    assert TAG in events.Tags()["images"]
    event = events.Images(TAG)[-1]
    assert event.step == trainer.global_step
    return np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))


def test_top_patches_of_digits(tmp_path: Path) -> None:
    datamodule = ActivationDataModule("digits", batch_size=64, num_workers=0, shuffle_buffer_tokens=64)
    image = fit_with(
        TopPatches(atoms=[0, 5, 7], top=4, tile=16), datamodule, MatchingPursuitSAE(d_in=64, d_sae=32, k=3), tmp_path
    )
    assert image.shape == (3 * 20, 8 + 4 * 20, 3)  # 3 atoms x 4 images of 16 px (+4 px gaps, label margin)
    assert image[:, 8:].std() > 10  # digits were drawn


def test_top_patches_of_photo_shards(tmp_path: Path) -> None:
    write_shards(tmp_path / "shards", tmp_path / "images", n_images=12, shard_size=3)
    datamodule = ActivationDataModule(
        str(tmp_path / "shards"), batch_size=16, num_workers=0, shuffle_buffer_tokens=32, val_fraction=0.25
    )
    image = fit_with(TopPatches(n_atoms=2, top=3, tile=32), datamodule, ReLUSAE(d_in=12, d_sae=12), tmp_path)
    assert image.shape == (2 * 36, 16 + 3 * 36, 3)
    assert (np.abs(image.astype(int) - [255, 60, 0]).sum(-1) < 60).any()  # a top patch outlined


def test_atom_out_of_range_is_refused(tmp_path: Path) -> None:
    datamodule = ActivationDataModule("digits", batch_size=64, num_workers=0, shuffle_buffer_tokens=64)
    with pytest.raises(ValueError, match="atoms 40: out of range"):
        fit_with(TopPatches(atoms=[40]), datamodule, MatchingPursuitSAE(d_in=64, d_sae=32, k=3), tmp_path)
