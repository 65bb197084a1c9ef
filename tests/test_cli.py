"""``python -m sae_pipeline`` end to end (subprocesses): fit, --print_config, bad input, predict."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fork_server
import lightning as L
import numpy as np
import pytest
import torch
import yaml

from feature_extraction.h5cache import read_attrs, write_token_cache
from sae_pipeline.artifacts.checkpoint import read_checkpoint, sae_from_checkpoint
from sae_pipeline.artifacts.codes import merge_codes, read_codes
from sae_pipeline.cli import SAECLI
from sae_pipeline.data import ActivationDataModule
from sae_pipeline.sae.inference_codes import sparse_codes

REPO_DPATH = Path(__file__).resolve().parents[1]
MPSAE_DIGITS = str(REPO_DPATH / "configs" / "mpsae_digits.yaml")
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def run_cli(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "2"}
    env.pop("SAE_PIPELINE_TRACEBACK", None)
    return fork_server.run([sys.executable, "-m", "sae_pipeline", *args], cwd=cwd, env=env, timeout=timeout)


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 5-step MP-SAE run on digits through the real command; returns its working directory."""
    cwd = tmp_path_factory.mktemp("cli")
    result = run_cli(["fit", "--config", MPSAE_DIGITS, "--trainer.max_steps", "5", *QUIET], cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd


@pytest.mark.slow
def test_fit_writes_checkpoint_logs_and_config(fitted: Path) -> None:
    run_dpath = fitted / "runs" / "mpsae_digits"
    ckpt_fpath = run_dpath / "version_0" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(ckpt_fpath, weights_only=True)  # no pickle of Python objects needed
    assert checkpoint["global_step"] == 5
    assert checkpoint["sae_config"]["class_path"] == "sae_pipeline.sae.MatchingPursuitSAE"
    assert checkpoint["sae_config"]["init_args"]["d_in"] == 64  # linked from the data
    assert checkpoint["input_scale"] > 0
    assert list(run_dpath.glob("version_0/events.out.tfevents.*"))
    saved = yaml.safe_load((run_dpath / "version_0" / "config.yaml").read_text())
    assert saved["model"]["sae"]["init_args"]["k"] == 10 and saved["data"]["source"] == "digits"


def test_print_config_shows_the_resolved_config(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["sae_pipeline"])
    with pytest.raises(SystemExit) as info:
        SAECLI(args=["fit", "--config", MPSAE_DIGITS, "--model.sae.init_args.k", "7", "--print_config"])
    assert info.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["sae"]["class_path"] == "sae_pipeline.sae.MatchingPursuitSAE"
    assert config["model"]["sae"]["init_args"]["k"] == 7 and config["model"]["lr"] == 1e-3
    assert config["checkpoint"]["save_last"] is True and config["codes"]["fpath"] == "codes.h5"
    assert config["trainer"]["logger"]["class_path"].endswith("TensorBoardLogger")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (["--model.sae.init_args.kk", "3"], "kk"),
        (["--model.sae.class_path", "NoSuchSAE"], "NoSuchSAE"),
        (["--model.sae.class_path", "torch.nn.Linear"], "torch.nn.Linear"),
    ],
)
def test_bad_config_values_fail_with_a_short_message(
    override: list[str],
    expected: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["sae_pipeline"])
    with pytest.raises(SystemExit) as info:
        SAECLI(args=["fit", "--config", MPSAE_DIGITS, *override])
    assert info.value.code == 2
    stderr = capsys.readouterr().err
    assert len(stderr.strip().splitlines()) <= 6, stderr  # no 90-line usage dump
    assert stderr.count("error:") == 1 and expected in stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_misspelled_key_exits_non_zero_through_the_command(tmp_path: Path) -> None:
    result = run_cli(["fit", "--config", MPSAE_DIGITS, "--model.lrr", "0.1"], tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) <= 4, result.stderr
    assert error_lines(result) == ["error: unrecognized arguments: --model.lrr 0.1"]
    assert not (tmp_path / "runs").exists()


def test_an_unknown_command_lists_every_command(tmp_path: Path) -> None:
    result = run_cli(["trian"], tmp_path, timeout=60)
    assert result.returncode == 2
    from sae_pipeline.__main__ import COMMANDS, LIGHTNING_COMMANDS

    (line,) = result.stderr.splitlines()
    assert line.startswith("error: ") and "'trian'" in line
    assert all(name in line for name in [*LIGHTNING_COMMANDS, *COMMANDS]), line


@pytest.mark.slow
def test_non_finite_data_stops_with_one_line_error(tmp_path: Path) -> None:
    tokens = np.random.default_rng(0).standard_normal((300, 8)).astype(np.float32)
    tokens[::7, 3] = np.nan
    write_token_cache(tmp_path / "bad.h5", tokens)
    result = run_cli(
        [
            "fit",
            "--config",
            MPSAE_DIGITS,
            "--data.source",
            str(tmp_path / "bad.h5"),
            "--model.sae.init_args.d_sae",
            "32",
            "--model.sae.init_args.k",
            "4",
            *QUIET,
        ],
        tmp_path,
    )
    assert result.returncode == 2
    assert len(error_lines(result)) == 1 and "bad.h5" in error_lines(result)[0] and "NaN" in error_lines(result)[0]
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_predict_writes_the_codes_of_every_token(fitted: Path) -> None:
    ckpt_fpath = fitted / "runs" / "mpsae_digits" / "version_0" / "checkpoints" / "last.ckpt"
    result = run_cli(
        ["predict", "--config", MPSAE_DIGITS, "--ckpt_path", str(ckpt_fpath), "--codes.fpath", "out/codes.h5", *QUIET],
        fitted,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    codes = read_codes(fitted / "out" / "codes.h5")
    assert read_attrs(fitted / "out" / "codes.h5")["d_sae"] == 1000
    # Reference: the checkpoint's SAE on every digits row, in the data module's predict order.
    checkpoint = read_checkpoint(ckpt_fpath)
    sae, scale = sae_from_checkpoint(checkpoint).eval(), checkpoint["input_scale"]
    batches = list(ActivationDataModule("digits", num_workers=0).predict_dataloader())
    x = torch.cat([batch["x"] for batch in batches])
    ids = [image_id for batch in batches for image_id in batch["image_ids"]]
    positions = torch.cat([batch["token_positions"] for batch in batches])
    assert len(x) == 1797 and codes["indices"].shape[0] == 1797
    assert list(codes["image_ids"]) == ids
    np.testing.assert_array_equal(codes["token_positions"], positions.numpy())
    with torch.no_grad():
        dense = sae.encode(x * scale) / scale
    reference = torch.zeros_like(dense)
    indices, values = torch.from_numpy(codes["indices"]).long(), torch.from_numpy(codes["values"])
    rows = torch.arange(len(x))[:, None].expand_as(indices)
    active = indices >= 0
    reference[rows[active], indices[active]] = values[active]
    torch.testing.assert_close(reference, dense, atol=1e-5, rtol=1e-4)
    assert (values[~active] == 0).all() and active.sum(1).max() <= 10
    assert (values.abs()[:, :-1] >= values.abs()[:, 1:]).all()  # largest |value| first


@pytest.mark.slow
def test_export_command_on_a_cli_checkpoint(fitted: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sae_pipeline.__main__ import main
    from sae_pipeline.artifacts import load_sae

    ckpt_fpath = fitted / "runs" / "mpsae_digits" / "version_0" / "checkpoints" / "last.ckpt"
    assert main(["export", "--ckpt_path", str(ckpt_fpath), "--out", str(fitted / "export")]) == 0
    assert "sae.safetensors" in capsys.readouterr().out
    checkpoint = read_checkpoint(ckpt_fpath)
    trained, scale = sae_from_checkpoint(checkpoint).eval(), checkpoint["input_scale"]
    x = torch.cat([batch["x"] for batch in ActivationDataModule("digits", num_workers=0).predict_dataloader()])
    with torch.no_grad():
        torch.testing.assert_close(
            load_sae(fitted / "export")(x).x_hat, trained(x * scale).x_hat / scale, rtol=1e-4, atol=1e-4
        )


def test_sparse_codes_matches_a_plain_loop() -> None:
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(9, 20, generator=generator) * (torch.rand(9, 20, generator=generator) < 0.2)
    dense[3] = 0
    indices, values = sparse_codes(dense)
    width = int((dense != 0).sum(1).max())
    assert indices.shape == values.shape == (9, width)
    for row in range(9):
        nonzero = [(abs(float(v)), j, float(v)) for j, v in enumerate(dense[row]) if v != 0]
        nonzero.sort(key=lambda item: -item[0])
        expected_indices = [j for _, j, _ in nonzero] + [-1] * (width - len(nonzero))
        expected_values = [v for _, _, v in nonzero] + [0.0] * (width - len(nonzero))
        assert indices[row].tolist() == expected_indices
        assert values[row].tolist() == pytest.approx(expected_values)


def test_merge_codes_concatenates_parts_of_different_widths(tmp_path: Path) -> None:
    from sae_pipeline.artifacts.codes import CodesWriter

    parts = []
    for rank, width in enumerate([2, 4]):
        fpath = tmp_path / f"codes.h5.rank{rank}"
        with CodesWriter(fpath, {"d_sae": 50}) as writer:
            indices = np.arange(3 * width).reshape(3, width) + 10 * rank
            writer.write([f"r{rank}_{i}" for i in range(3)], np.arange(3), indices, indices.astype(np.float32))
        parts.append(fpath)
    assert merge_codes(parts, tmp_path / "codes.h5") == 6
    merged = read_codes(tmp_path / "codes.h5")
    assert list(merged["image_ids"]) == [f"r{r}_{i}" for r in range(2) for i in range(3)]
    np.testing.assert_array_equal(merged["indices"][:3, :2], np.arange(6).reshape(3, 2))
    np.testing.assert_array_equal(merged["indices"][:3, 2:], -1)
    np.testing.assert_array_equal(merged["indices"][3:], np.arange(12).reshape(3, 4) + 10)


def test_main_reports_value_errors_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from sae_pipeline.__main__ import main

    assert main(["export", "--ckpt_path", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "missing.ckpt" in err[0] and "--ckpt_path" in err[0]


def scalar(run_dpath: Path, tag: str) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(run_dpath.glob("version_0"))), size_guidance={"scalars": 0})
    events.Reload()
    return events.Scalars(tag)[-1].value


@pytest.mark.slow
def test_ddp_fit_on_uneven_shards_gives_the_single_process_val_r2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, token_shards
) -> None:
    from sae_pipeline.training.module import SAEModule

    shards_dpath = tmp_path / "shards"
    token_shards(shards_dpath, [3, 11, 5, 9, 4, 7, 6], 16, offset=2)  # uneven shards: ranks get different token counts
    data_args = [
        "--data.source",
        str(shards_dpath),
        "--data.batch_size",
        "16",
        "--data.shuffle_buffer_tokens",
        "64",
        "--data.val_fraction",
        "0.3",
    ]
    result = run_cli(
        [
            "fit",
            "--config",
            str(REPO_DPATH / "configs" / "batchtopk_digits.yaml"),
            *data_args,
            "--model.sae.init_args.d_sae",
            "64",
            "--model.sae.init_args.k",
            "4",
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "2",
            "--trainer.strategy",
            "ddp",
            "--trainer.max_epochs",
            "2",
            "--trainer.check_val_every_n_epoch",
            "1",
            "--figures.every_n_val_epochs",
            "100",
            *QUIET,
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dpath = tmp_path / "runs" / "batchtopk_digits"
    ddp_r2 = scalar(run_dpath, "val/r2")
    # The same checkpoint and data in one process (LightningCLI's hparams rebuild the module).
    monkeypatch.chdir(tmp_path)
    module = SAEModule.load_from_checkpoint(run_dpath / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    datamodule = ActivationDataModule(
        str(shards_dpath), batch_size=16, num_workers=0, shuffle_buffer_tokens=64, val_fraction=0.3
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    single = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    assert single["val/r2"] == pytest.approx(ddp_r2, abs=1e-6)
    assert single["val/l0"] == pytest.approx(scalar(run_dpath, "val/l0"), abs=1e-6)
