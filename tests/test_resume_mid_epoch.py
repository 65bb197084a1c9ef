"""What a requeued SLURM job relies on, without SLURM: a run resumed from a checkpoint taken mid-epoch or
at an epoch's last batch ends with the uninterrupted run's weights. (The requeue itself on a real SLURM:
tests/test_slurm_train.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO_DPATH = Path(__file__).resolve().parents[1]
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


@pytest.mark.parametrize("resume_step", [8, 12])  # epoch 1 after 2 of 6 batches; the end of epoch 1
def test_resumed_fit_ends_like_the_uninterrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resume_step: int
) -> None:
    """What a requeued job relies on, without SLURM: resuming from a checkpoint taken mid-epoch or at an
    epoch's last batch gives the uninterrupted run's weights (data order, optimiser, schedule, clock)."""
    from sae_pipeline.cli import cli_main

    monkeypatch.chdir(tmp_path)
    args = [
        "fit",
        "--config",
        str(REPO_DPATH / "configs" / "mpsae_digits.yaml"),
        "--trainer.max_epochs",
        "3",
        "--checkpoint.every_n_train_steps",
        "2",
        "--checkpoint.save_top_k",
        "-1",
        *QUIET,
    ]
    cli_main([*args, "--checkpoint.dirpath", "full"])
    saved = torch.load(next((tmp_path / "full").glob(f"*-step={resume_step}.ckpt")), weights_only=True)
    assert saved["global_step"] == resume_step
    cli_main(
        [
            *args,
            "--checkpoint.dirpath",
            "resumed",
            "--ckpt_path",
            str(next((tmp_path / "full").glob(f"*-step={resume_step}.ckpt"))),
        ]
    )
    full = torch.load(tmp_path / "full" / "last.ckpt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed" / "last.ckpt", weights_only=True)
    assert full["global_step"] == resumed["global_step"] == 18  # 6 batches x 3 epochs
    for name, value in full["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value, rtol=0, atol=0, msg=name)
