"""Export: safetensors + config.json, input scale folded, identical outputs on raw activations, no pickle."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from safetensors import safe_open
from torch import Tensor
from torch.utils.data import DataLoader

import sae_pipeline
from feature_extraction.shards import load_manifest, manifest_sha256
from sae_pipeline.artifacts import ExportError, export_checkpoint, load_sae
from sae_pipeline.data import ActivationDataModule
from sae_pipeline.sae import SAE_REGISTRY, SparseAutoencoder, get_sae_class
from sae_pipeline.training.module import SAEModule

D_IN, D_SAE, K, BATCH = 12, 48, 4, 32
# Each variant's test_kwargs, with the penalties of the L1/L0 variants set for 6 steps on large raw inputs.
KWARGS: dict[str, dict[str, Any]] = {name: cls.test_kwargs for name, cls in SAE_REGISTRY.items()} | {
    "relu": {"l1_coefficient": 1e-2},
    "jumprelu": {"initial_threshold": 0.3, "bandwidth": 0.1},
}


def raw_data(n: int, seed: int = 0) -> Tensor:
    """Activations far from unit scale (like a ViT's), so the folded scale matters."""
    generator = torch.Generator().manual_seed(seed)
    return 40.0 * torch.randn(n, D_IN, generator=generator) + 25.0


def memory_loader(x: Tensor) -> DataLoader:
    return DataLoader(
        list(range(len(x))),
        batch_size=BATCH,
        drop_last=True,
        collate_fn=lambda rows: {"x": x[rows], "shards": ["memory"]},
    )


def make_sae(name: str, seed: int = 0) -> SparseAutoencoder:
    torch.manual_seed(seed)
    return SAE_REGISTRY[name](D_IN, D_SAE, **KWARGS[name])


def quiet_trainer(tmp_path: Path, max_steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )


def trained_checkpoint(name: str, tmp_path: Path) -> tuple[SAEModule, Path]:
    module = SAEModule(make_sae(name), lr=1e-2, warmup_steps=0)
    trainer = quiet_trainer(tmp_path, max_steps=6)
    trainer.fit(module, memory_loader(raw_data(8 * BATCH)))
    ckpt_fpath = tmp_path / f"{name}.ckpt"
    trainer.save_checkpoint(ckpt_fpath)
    return module.eval(), ckpt_fpath


@pytest.mark.parametrize("name", sorted(SAE_REGISTRY))
def test_fold_input_scale_equals_running_on_scaled_inputs(name: str) -> None:
    sae = make_sae(name).eval()
    with torch.no_grad():
        sae.b_pre.normal_(std=0.5)
        if hasattr(sae, "b_enc"):
            sae.b_enc.normal_(std=0.2)
        if "threshold" in dict(sae.named_buffers()):  # BatchTopK's inference θ (0 until trained)
            sae.threshold.fill_(0.4)
    scale = 0.37
    folded = copy.deepcopy(sae)
    folded.fold_input_scale(scale)
    x = raw_data(20, seed=3)
    with torch.no_grad():
        expected, got = sae(scale * x), folded(x)
        torch.testing.assert_close(got.x_hat, expected.x_hat / scale, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.codes, expected.codes / scale, rtol=1e-4, atol=1e-4)
        assert (expected.codes != 0).any()
        if sae.k is not None:
            torch.testing.assert_close(folded.encode(x, k=2), sae.encode(scale * x, k=2) / scale, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="scale"):
        folded.fold_input_scale(0.0)


@pytest.mark.parametrize("name", sorted(SAE_REGISTRY))
def test_export_and_load_give_identical_outputs_on_raw_activations(name: str, tmp_path: Path) -> None:
    module, ckpt_fpath = trained_checkpoint(name, tmp_path)
    scale = float(module.input_scale)
    assert abs(math.log(scale)) > 2  # the data is far from unit scale: folding is exercised
    out_dpath = export_checkpoint(ckpt_fpath, tmp_path / "export")
    assert sorted(p.name for p in out_dpath.iterdir()) == ["config.json", "sae.safetensors"]
    sae = load_sae(out_dpath)
    assert type(sae) is type(module.sae) and not sae.training
    x = raw_data(50, seed=9)
    with torch.no_grad():
        expected = module.sae(module.preprocess(x))
        got = sae(x)
        torch.testing.assert_close(got.x_hat, expected.x_hat / scale, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.codes, expected.codes / scale, rtol=1e-4, atol=1e-3)
        assert (got.codes != 0).any()
    # The exported model reconstructs raw activations as well as the trained one did scaled ones.
    relative_error = ((got.x_hat - x).square().sum() / (expected.x_hat / scale - x).square().sum()).item()
    assert relative_error == pytest.approx(1.0, rel=1e-3)


def test_config_json_content(tmp_path: Path) -> None:
    module, ckpt_fpath = trained_checkpoint("mpsae", tmp_path)
    config = json.loads((export_checkpoint(ckpt_fpath, tmp_path / "out") / "config.json").read_text())
    assert config["variant"] == "mpsae" and config["class_path"] == "sae_pipeline.sae.MatchingPursuitSAE"
    assert config["init_args"] == {
        "d_in": D_IN,
        "d_sae": D_SAE,
        "k": K,
        "selection": "auto",
        "dead_after_tokens": 10_000_000,
    }
    assert (config["d_in"], config["d_sae"], config["k"]) == (D_IN, D_SAE, K)
    assert config["input_scale"] == pytest.approx(float(module.input_scale)) and config["input_scale_folded"]
    assert config["hyper_parameters"] == {
        "lr": 1e-2,
        "warmup_steps": 0,
        "min_lr": 1e-6,
        "normalize_input": True,
        "inference_ks": None,
        "babel_r_max": 64,
    }
    assert config["global_step"] == 6 and config["package_version"] == sae_pipeline.__version__
    assert config["manifest_sha256"] is None  # in-memory data: no manifest


def test_export_written_with_the_old_mp_key_still_loads(tmp_path: Path) -> None:
    """Exports written before the ``mp`` -> ``mpsae`` rename say ``"variant": "mp"``; they load as MP-SAE."""
    _, ckpt_fpath = trained_checkpoint("mpsae", tmp_path)
    out_dpath = export_checkpoint(ckpt_fpath, tmp_path / "out")
    expected = load_sae(out_dpath)
    config_fpath = out_dpath / "config.json"
    config_fpath.write_text(json.dumps({**json.loads(config_fpath.read_text()), "variant": "mp"}))
    sae = load_sae(out_dpath)
    assert type(sae) is get_sae_class("mp") is get_sae_class("mpsae")
    x = raw_data(10, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(sae(x).x_hat, expected(x).x_hat, rtol=0, atol=0)


def test_checkpoint_loads_weights_only_and_export_has_no_pickle(tmp_path: Path) -> None:
    _, ckpt_fpath = trained_checkpoint("topk", tmp_path)
    checkpoint = torch.load(ckpt_fpath, weights_only=True, map_location="cpu")
    assert checkpoint["sae_config"]["class_path"] == "sae_pipeline.sae.TopKSAE"
    assert json.dumps(checkpoint["hyper_parameters"]) and json.dumps(checkpoint["sae_config"])
    out_dpath = export_checkpoint(ckpt_fpath, tmp_path / "out")
    with safe_open(str(out_dpath / "sae.safetensors"), framework="pt") as f:
        assert set(f.keys()) == {"W_dec", "b_pre", "W_enc", "b_enc", "tokens_since_fired"}


@pytest.fixture()
def tiny_shards(tmp_path: Path, token_shards) -> Path:
    dpath = tmp_path / "shards"
    token_shards(dpath, [20, 20, 20], D_IN, scale=30)
    return dpath


def test_manifest_hash_recorded_for_shard_data(tiny_shards: Path, tmp_path: Path) -> None:
    dm = ActivationDataModule(
        str(tiny_shards), batch_size=BATCH, num_workers=0, shuffle_buffer_tokens=256, val_fraction=0.34
    )
    trainer = quiet_trainer(tmp_path, max_steps=2)
    trainer.fit(SAEModule(make_sae("topk"), warmup_steps=0), dm)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    config = json.loads((export_checkpoint(tmp_path / "run.ckpt", tmp_path / "out") / "config.json").read_text())
    manifest = load_manifest(tiny_shards)
    assert config["manifest_sha256"] == manifest_sha256(manifest)
    assert config["data"]["source"] == str(tiny_shards)
    # The hash names the data, not the moment it was indexed.
    assert manifest_sha256({**manifest, "created_at": "1999-01-01T00:00:00Z"}) == config["manifest_sha256"]
    assert manifest_sha256({**manifest, "n_images": manifest["n_images"] + 1}) != config["manifest_sha256"]


def test_bad_checkpoints_give_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="not found"):
        export_checkpoint(tmp_path / "missing.ckpt", tmp_path / "out")
    (tmp_path / "garbage.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(ExportError, match="garbage.ckpt") as info:
        export_checkpoint(tmp_path / "garbage.ckpt", tmp_path / "out")
    assert "\n" not in str(info.value)
    torch.save({"state_dict": {}}, tmp_path / "other.ckpt")
    with pytest.raises(ExportError, match="sae_config"):
        export_checkpoint(tmp_path / "other.ckpt", tmp_path / "out")
    with pytest.raises(ExportError, match="config.json"):
        load_sae(tmp_path / "nowhere")
    assert not (tmp_path / "out").exists()
