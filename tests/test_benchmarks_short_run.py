"""``python -m benchmarks.short_run_sparsity`` in a tiny run (12 steps): a table row per run, the figure drawn, and
ReLU's calibrated start visible already. Its ``main`` runs in this process on one torch thread (what ``python -m``
runs; a fresh interpreter paid its imports of torch, Lightning and TensorBoard again, and the script's default of
2 threads oversubscribes a suite worker's core); the four CLI runs still take a while (their validation's figures
and Babel scalars): slow."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.image import imread


@pytest.mark.slow
def test_short_run_sparsity_prints_every_run_and_draws_the_curves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from benchmarks import short_run_sparsity

    figure = tmp_path / "short_run.png"
    monkeypatch.chdir(tmp_path)
    argv = ["--steps", "12", "--threads", "1", "--figure", str(figure)]
    monkeypatch.setattr(sys, "argv", ["short_run_sparsity", *argv])
    threads, lightning_level = torch.get_num_threads(), logging.getLogger("lightning.pytorch").level
    try:
        short_run_sparsity.main()
    finally:
        torch.set_num_threads(threads)
        logging.getLogger("lightning.pytorch").setLevel(lightning_level)
    stdout = capsys.readouterr().out
    rows = {
        (cells[0], cells[1]): cells
        for cells in (
            [c.strip() for c in line.strip("|").split("|")]
            for line in stdout.splitlines()
            if line.startswith("| ") and "_dinov2" in line
        )
    }
    assert len(rows) == 4, stdout
    ratio = {key: float(cells[4]) for key, cells in rows.items()}
    assert (
        ratio[("relu_dinov2", "initial_l0 32 (config)")] < 2 < 4 < ratio[("relu_dinov2", "b_enc = 0 (no initial_l0)")]
    )
    pixels = imread(figure)
    assert pixels.shape[1] > pixels.shape[0] > 300 and np.ptp(pixels[..., :3]) > 0.5  # two panels, not blank
