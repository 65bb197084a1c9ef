"""SAELens format both ways, against the real ``sae-lens`` package (the ``saelens`` extra).

Our export loads in SAELens 6 and its encode / decode equal ours for every variant (input
normalisation folded in); a SAE that SAELens itself made and saved loads into our evaluation,
computes what SAELens computes, and gets R², L0 and Babel checked against plain formulas.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from system_tools import REQUIRE_ENV
from torch import Tensor

from feature_extraction.h5cache import write_token_cache
from sae_pipeline.__main__ import main as sae_pipeline_main
from sae_pipeline.artifacts import ExportError, load_sae
from sae_pipeline.artifacts.saelens_export import export_checkpoint_saelens, saelens_architecture, write_saelens
from sae_pipeline.data import ActivationDataModule, validation_tokens
from sae_pipeline.evaluate.__main__ import main as evaluate_main
from sae_pipeline.sae import SAE_REGISTRY, BatchTopKSAE, JumpReLUSAE, MatchingPursuitSAE, ReLUSAE, TopKSAE
from sae_pipeline.training.module import SAEModule

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sae_lens
except ImportError:
    _message = 'needs the sae-lens package; install with: pip install -e ".[saelens]"'
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{_message} ({REQUIRE_ENV}=1: CI must not skip this)", pytrace=False)
    pytest.skip(_message, allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

D_IN, D_SAE, K, BATCH, VAL_FRACTION = 12, 48, 4, 32, 0.25
KWARGS: dict[str, dict[str, Any]] = {name: cls.test_kwargs for name, cls in SAE_REGISTRY.items()} | {
    "relu": {"l1_coefficient": 1e-2},
    "jumprelu": {"initial_threshold": 0.3, "bandwidth": 0.1},
}
# The variants SAELens 6 represents, and its class for each; any other variant exports natively only.
EXPECTED_SAELENS = {
    "relu": "StandardSAE",
    "jumprelu": "JumpReLUSAE",
    "topk": "TopKSAE",
    "batchtopk": "JumpReLUSAE",
    "mpsae": "MatchingPursuitSAE",
}


def assert_equal_to_1e5(got: Tensor, expected: Tensor) -> None:
    """Equal to 1e-5 of the largest magnitude (float32 round-off, whatever the units)."""
    assert got.shape == expected.shape
    scale = max(1.0, float(expected.abs().max()))
    assert float((got - expected).abs().max()) <= 1e-5 * scale


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Raw activations far from unit scale (like a ViT's), so the folded input scale matters."""
    generator = torch.Generator().manual_seed(0)
    tokens = (40.0 * torch.randn(640, D_IN, generator=generator) + 25.0).numpy()
    fpath = tmp_path_factory.mktemp("data") / "tokens.h5"
    write_token_cache(fpath, tokens)
    return fpath


def train(name: str, source: Path, out_dpath: Path, d_sae: int = D_SAE, **kwargs: Any) -> tuple[SAEModule, Path]:
    """A few optimiser steps on ``source`` through the real data module; the checkpoint records the data."""
    torch.manual_seed(0)
    sae = SAE_REGISTRY[name](D_IN, d_sae, **{**KWARGS[name], **kwargs})
    module = SAEModule(sae, lr=1e-2, warmup_steps=0)
    data = ActivationDataModule(
        str(source), batch_size=BATCH, num_workers=0, shuffle_buffer_tokens=256, val_fraction=VAL_FRACTION
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=out_dpath,
    )
    trainer.fit(module, data)
    ckpt_fpath = out_dpath / f"{name}.ckpt"
    trainer.save_checkpoint(ckpt_fpath)
    return module.eval(), ckpt_fpath


@pytest.fixture(scope="module")
def trained(token_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[SAEModule, Path]]:
    out_dpath = tmp_path_factory.mktemp("runs")
    return {name: train(name, token_cache, out_dpath) for name in sorted(EXPECTED_SAELENS)}


def test_every_variant_has_a_saelens_architecture_or_says_it_has_none() -> None:
    for name, cls in SAE_REGISTRY.items():
        sae = cls(D_IN, D_SAE, **KWARGS[name])
        if name in EXPECTED_SAELENS:
            assert saelens_architecture(sae)
        else:
            with pytest.raises(ExportError, match="has no SAELens architecture"):
                saelens_architecture(sae)


@pytest.mark.parametrize("name", sorted(EXPECTED_SAELENS))
def test_our_export_loads_in_saelens_with_equal_encode_and_decode(
    name: str, trained: dict[str, tuple[SAEModule, Path]], token_cache: Path, tmp_path: Path
) -> None:
    module, ckpt_fpath = trained[name]
    scale = float(module.input_scale)
    assert abs(math.log(scale)) > 2  # raw units far from the training units: the fold is exercised
    out_dpath = export_checkpoint_saelens(ckpt_fpath, tmp_path / "saelens")
    assert sorted(p.name for p in out_dpath.iterdir()) == ["cfg.json", "sae_weights.safetensors"]
    theirs = sae_lens.SAE.load_from_disk(out_dpath)
    assert type(theirs).__name__ == EXPECTED_SAELENS[name]
    ours = load_sae(out_dpath)  # the other way: our equivalent of the SAELens directory
    assert type(ours) is type(module.sae)
    x = validation_tokens(str(token_cache), VAL_FRACTION)
    with torch.no_grad():
        codes = theirs.encode(x)
        assert (codes != 0).any()
        assert_equal_to_1e5(codes, ours.encode(x))
        assert_equal_to_1e5(theirs.decode(codes), ours.decode(codes))
        # The normalisation survived: SAELens on raw x = the trained model on scaled x, back in raw units.
        trained_output = module.sae(module.preprocess(x))
        torch.testing.assert_close(theirs(x), trained_output.x_hat / scale, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(codes, trained_output.codes / scale, rtol=1e-4, atol=1e-3)


def test_config_fields_are_saelens_6(trained: dict[str, tuple[SAEModule, Path]], tmp_path: Path) -> None:
    module, ckpt_fpath = trained["mpsae"]
    config = json.loads((export_checkpoint_saelens(ckpt_fpath, tmp_path / "mp") / "cfg.json").read_text())
    assert config["architecture"] == "matching_pursuit" and config["normalize_activations"] == "none"
    assert (config["max_iterations"], config["residual_threshold"], config["stop_on_duplicate_support"]) == (
        K,
        0,
        False,
    )
    assert config["metadata"]["sae_lens_version"].startswith("6.")
    assert config["metadata"]["input_scale_folded"] == pytest.approx(float(module.input_scale))
    assert config["metadata"]["saelens_agreement_checked_on"]["n_tokens"] == 160  # 640 rows, val_fraction 0.25
    _, ckpt_fpath = trained["batchtopk"]
    config = json.loads((export_checkpoint_saelens(ckpt_fpath, tmp_path / "btk") / "cfg.json").read_text())
    assert config["architecture"] == "jumprelu" and config["metadata"]["training_architecture"] == "batchtopk"
    threshold = load_sae(tmp_path / "btk").threshold
    assert isinstance(load_sae(tmp_path / "btk"), BatchTopKSAE) and float(threshold) > 0


def test_mp_export_refused_where_saelens_would_clip(
    token_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 4 atoms in 12 dimensions: often every atom anti-correlates with a residual.
    module, ckpt_fpath = train("mpsae", token_cache, tmp_path, d_sae=4, k=3)
    out_dpath = tmp_path / "refused"
    status = sae_pipeline_main(
        ["export", "--ckpt_path", str(ckpt_fpath), "--out", str(out_dpath), "--format", "saelens"]
    )
    error = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in error and "negative correlation" in error and "--format native" in error
    assert not out_dpath.exists()  # nothing written
    # The refusal is right: written anyway, SAELens's clipped pursuit gives other codes.
    folded = module.sae
    folded.fold_input_scale(float(module.input_scale))
    theirs = sae_lens.SAE.load_from_disk(write_saelens(folded, tmp_path / "forced"))
    x = validation_tokens(str(token_cache), VAL_FRACTION)
    with torch.no_grad():
        assert float((theirs.encode(x) - folded.encode(x)).abs().max()) > 1e-2


def test_mp_export_through_the_command_line_checks_the_training_data(
    trained: dict[str, tuple[SAEModule, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, ckpt_fpath = trained["mpsae"]
    status = sae_pipeline_main(
        ["export", "--ckpt_path", str(ckpt_fpath), "--out", str(tmp_path / "mp"), "--format", "saelens"]
    )
    assert status == 0 and "sae_weights.safetensors" in capsys.readouterr().out
    assert isinstance(sae_lens.SAE.load_from_disk(tmp_path / "mp"), sae_lens.MatchingPursuitSAE)


# --- SAELens -> ours ---------------------------------------------------------------------------
def digits_mean() -> Tensor:
    from sklearn.datasets import load_digits

    return torch.from_numpy(load_digits().data.astype(np.float32) / 16.0).mean(0)


def saelens_made(kind: str, dpath: Path) -> Path:
    """A random-weight SAE constructed and saved by SAELens itself (64-d, for the bundled digits)."""
    torch.manual_seed(1)
    common = {"d_in": 64, "d_sae": 128}
    if kind == "batchtopk":
        sae = sae_lens.BatchTopKTrainingSAE(sae_lens.BatchTopKTrainingSAEConfig(k=8, **common))
        with torch.no_grad():
            sae.b_dec.copy_(digits_mean())
            sae.b_enc.normal_(std=0.1)
            sae.topk_threshold.fill_(0.015)  # its save folds the decoder norms (0.1 at init) into the encoder
        sae.save_inference_model(dpath)  # SAELens saves BatchTopK as jumprelu with the global threshold
        return dpath
    if kind == "standard":
        sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(**common))
    elif kind == "standard_no_b_dec":
        sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(apply_b_dec_to_input=False, **common))
    elif kind == "topk":
        sae = sae_lens.TopKSAE(sae_lens.TopKSAEConfig(k=8, **common))
    elif kind == "jumprelu":
        sae = sae_lens.JumpReLUSAE(sae_lens.JumpReLUSAEConfig(**common))
        with torch.no_grad():
            sae.threshold.uniform_(-0.05, 0.3)  # some ≤ 0: SAELens's ReLU makes those plain ReLU latents
    else:
        sae = sae_lens.MatchingPursuitSAE(
            sae_lens.MatchingPursuitSAEConfig(
                residual_threshold=0.0, max_iterations=8, stop_on_duplicate_support=False, **common
            )
        )
    with torch.no_grad():
        sae.b_dec.copy_(digits_mean())
        if hasattr(sae, "b_enc"):
            sae.b_enc.normal_(std=0.1)
    sae.save_model(dpath)
    return dpath


OURS_FOR = {
    "standard": ReLUSAE,
    "standard_no_b_dec": ReLUSAE,
    "topk": TopKSAE,
    "jumprelu": JumpReLUSAE,
    "batchtopk": BatchTopKSAE,
    "matching_pursuit": MatchingPursuitSAE,
}


@pytest.mark.parametrize("kind", sorted(OURS_FOR))
def test_saelens_made_sae_loads_as_our_equivalent(kind: str, tmp_path: Path) -> None:
    sae_dpath = saelens_made(kind, tmp_path / kind)
    theirs = sae_lens.SAE.load_from_disk(sae_dpath)
    ours = load_sae(sae_dpath)
    assert type(ours) is OURS_FOR[kind] and not ours.training
    x = validation_tokens("digits", 0.1)
    with torch.no_grad():
        codes = theirs.encode(x)
        assert 0 < float((codes != 0).sum(1).double().mean()) < 128
        assert_equal_to_1e5(ours.encode(x), codes)
        assert_equal_to_1e5(ours.decode(codes), theirs.decode(codes))
        assert_equal_to_1e5(ours(x).x_hat, theirs(x))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["jumprelu", "matching_pursuit"])
def test_saelens_made_sae_gets_r2_l0_and_babel_in_our_evaluation(kind: str, tmp_path: Path) -> None:
    sae_dpath = saelens_made(kind, tmp_path / kind)
    theirs = sae_lens.SAE.load_from_disk(sae_dpath)
    x = validation_tokens("digits", 0.1)
    with torch.no_grad():
        codes, x_hat = theirs.encode(x), theirs(x)
    assert (
        evaluate_main(
            ["sae", "--sae", str(sae_dpath), "--data", "digits", "--out", str(tmp_path / "eval"), "--r_max", "8"]
        )
        == 0
    )
    result = json.loads((tmp_path / "eval" / "results.json").read_text())["saes"][kind]
    # Plain references from SAELens's own outputs and weights.
    r2 = 1 - (x - x_hat).square().sum() / (x - x.mean(0)).square().sum()
    l0 = (codes != 0).sum(1).double().mean()
    atoms = theirs.W_dec.detach() / theirs.W_dec.detach().norm(dim=1, keepdim=True)
    overlaps = (atoms @ atoms.T).abs().fill_diagonal_(0)
    babel_1 = overlaps.max()
    babel_8 = overlaps.topk(8, dim=1).values.sum(1).max()
    assert result["format"] == "saelens" and result["n_eval_tokens"] == x.shape[0]
    assert result["r2"] == pytest.approx(float(r2), abs=1e-4)
    assert result["l0"] == pytest.approx(float(l0), abs=1e-4) and result["l0"] > 0
    assert result["babel_dict"][0] == pytest.approx(float(babel_1), abs=1e-5)
    assert result["babel_dict"][7] == pytest.approx(float(babel_8), abs=1e-4)
    # r runs to max(--r_max, k), k the measured L0 for SAEs without one (as in the study).
    assert len(result["babel_coactive"]) == len(result["babel_dict"]) >= 8
    assert 0 < result["babel_coactive"][0] <= result["babel_dict"][0] + 1e-6
    assert (tmp_path / "eval" / "figures" / f"sae_{kind}_babel.png").is_file()


@pytest.mark.parametrize(
    ("kind", "change", "message"),
    [
        ("standard", {"normalize_activations": "layer_norm"}, "normalize_activations"),
        ("standard", {"architecture": "gated"}, "architecture 'gated'"),
        ("matching_pursuit", {"stop_on_duplicate_support": True}, "stop_on_duplicate_support"),
        ("matching_pursuit", {"residual_threshold": 0.01}, "residual_threshold"),
        ("matching_pursuit", {"max_iterations": None}, "max_iterations"),
        ("topk", {"rescale_acts_by_decoder_norm": True}, "rescale_acts_by_decoder_norm"),
    ],
)
def test_saelens_settings_we_cannot_compute_are_refused_in_one_line(
    kind: str, change: dict[str, Any], message: str, tmp_path: Path
) -> None:
    sae_dpath = saelens_made(kind, tmp_path / kind)
    cfg_fpath = sae_dpath / "cfg.json"
    cfg_fpath.write_text(json.dumps({**json.loads(cfg_fpath.read_text()), **change}))
    with pytest.raises(ExportError, match=message) as info:
        load_sae(sae_dpath)
    assert "\n" not in str(info.value) and str(sae_dpath) in str(info.value)


def test_saelens_directory_without_weights_names_the_missing_file(tmp_path: Path) -> None:
    sae_dpath = saelens_made("topk", tmp_path / "topk")
    (sae_dpath / "sae_weights.safetensors").unlink()
    with pytest.raises(ExportError, match="sae_weights.safetensors: not found"):
        load_sae(sae_dpath)
