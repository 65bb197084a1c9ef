"""``python -m benchmarks.short_run_sparsity`` in a tiny run (12 steps): a table row per run, the figure drawn, and
ReLU's calibrated start visible already (14 s on a quiet 2-core box, four CLI runs: slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

REPO_DPATH = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_short_run_sparsity_prints_every_run_and_draws_the_curves(tmp_path: Path) -> None:
    figure = tmp_path / "short_run.png"
    paths = [str(REPO_DPATH), *filter(None, [os.environ.get("PYTHONPATH")])]  # benchmarks/ importable from tmp_path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.short_run_sparsity", "--steps", "12", "--figure", str(figure)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {
        (cells[0], cells[1]): cells
        for cells in (
            [c.strip() for c in line.strip("|").split("|")]
            for line in done.stdout.splitlines()
            if line.startswith("| ") and "_dinov2" in line
        )
    }
    assert len(rows) == 4, done.stdout
    ratio = {key: float(cells[4]) for key, cells in rows.items()}
    assert (
        ratio[("relu_dinov2", "initial_l0 32 (config)")] < 2 < 4 < ratio[("relu_dinov2", "b_enc = 0 (no initial_l0)")]
    )
    pixels = imread(figure)
    assert pixels.shape[1] > pixels.shape[0] > 300 and np.ptp(pixels[..., :3]) > 0.5  # two panels, not blank
