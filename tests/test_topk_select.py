"""The top-k selection kernels (`sae_pipeline/sae/triton_topk.py`) on the CPU under Triton's interpreter, and the
dispatch around them (`sae_pipeline/sae/topk_select.py`).

Under the interpreter (a fresh process with ``TRITON_INTERPRET=1``, as `tests/test_triton_sparse.py` explains):
the per-token kernel and the batch selection against the stated rule and `torch.topk` (`tests/topk_select_checks.py`:
float32, bfloat16 and float16; rows not a multiple of the chunk, k = 1 and d_sae − 1, ties at the threshold,
-inf, NaN with either sign, signed zeros, constant rows, a lane holding three of the top k, massive rows, rows
over 65 536 columns; outputs poisoned, no host read), and TopK, BatchTopK and Matryoshka's steps through the
kernels against their steps through `torch.topk`. The interpreter runs every program instance in Python, so the
checks take each case at the fewest rows and columns that reach its path. Here: the CPU keeps `torch.topk`, a
kernel failure falls back with one warning, and the benchmark's dry run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from sae_pipeline.sae import topk_select

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a fresh interpreter and Triton's interpreter over every case: ~15 s
def test_kernels_match_the_rule_and_topk_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "tests.topk_select_checks"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-4000:]
    checked = result.stdout.split("checked:")[-1].split()
    # per row: 11 cases and a crowded lane in float32 and bfloat16, float16's two, forced exact twice, three sizes;
    # the batch: 10 cases and a crowded lane in bfloat16, float32's three
    assert len([c for c in checked if c.startswith("rows-")]) == 2 * 12 + 2 + 2 + 3, checked
    assert len([c for c in checked if c.startswith("flat-")]) == 11 + 3, checked
    assert len([c for c in checked if c.startswith("sae-")]) == 6, checked


def test_cpu_keeps_torch_topk() -> None:
    """The kernels are for CUDA tensors: on the CPU the selection is `torch.topk`'s, call for call."""
    x = torch.randn(5, 40)
    assert not topk_select.applies(x, 4)
    assert torch.equal(topk_select.top_k_indices(x, 4), x.topk(4, dim=-1, sorted=False).indices)
    assert torch.equal(topk_select.top_k_indices(x, 40), x.topk(40, dim=-1, sorted=False).indices)
    assert torch.equal(topk_select.batch_top_indices(x, 20), x.flatten().topk(20).indices.sort().values)
    assert topk_select.keep_per_row(4096, 4096 * 32) == 64


def test_a_failing_kernel_falls_back_once_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topk_select, "use_triton", True)

    def broken() -> torch.Tensor:
        raise RuntimeError("PTX too new for this driver\nmore")

    with pytest.warns(RuntimeWarning, match="top-k kernels failed on this device .*PTX too new for this driver"):
        assert topk_select.with_select_kernels(broken, lambda: torch.ones(1)).item() == 1
    assert topk_select.use_triton is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the switch is off now, nothing is tried again
        assert topk_select.with_select_kernels(broken, lambda: torch.zeros(1)).item() == 0


@pytest.mark.slow  # a fresh interpreter: the torch import
def test_benchmark_dry_run_times_torch_and_says_the_kernel_needs_cuda() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.topk_select", "--dry-run"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {
        cells[0]: cells
        for line in result.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| selection")
        for cells in [[cell.strip() for cell in line.strip("|").split("|")]]
    }
    assert set(rows) == {"per-token top-k", "batch top-k"}, result.stdout
    for cells in rows.values():
        assert cells[1] == "needs CUDA" and cells[2].endswith(" ms") and cells[4].endswith(" ms"), cells
