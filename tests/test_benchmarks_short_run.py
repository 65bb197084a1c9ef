"""benchmarks/short_run_sparsity.py in a tiny run (12 steps): a table row per run, the figure drawn, and
ReLU's calibrated start visible already (14 s on a quiet 2-core box, four CLI runs: slow)."""
from __future__ import annotations

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
    done = subprocess.run([sys.executable, str(REPO_DPATH / "benchmarks" / "short_run_sparsity.py"), "--steps", "12",
                           "--figure", str(figure)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(cells[0], cells[1]): cells for cells in ([c.strip() for c in line.strip("|").split("|")]
            for line in done.stdout.splitlines() if line.startswith("| ") and "_dinov2" in line)}
    assert len(rows) == 4, done.stdout
    ratio = {key: float(cells[4]) for key, cells in rows.items()}
    assert ratio[("relu_dinov2", "initial_l0 32 (config)")] < 2 < 4 < ratio[("relu_dinov2", "b_enc = 0 (no initial_l0)")]
    pixels = imread(figure)
    assert pixels.shape[1] > pixels.shape[0] > 300 and np.ptp(pixels[..., :3]) > 0.5  # two panels, not blank
