"""The Triton kernels of `sae/` on the CPU, under Triton's interpreter: the sparse products against
float64 references (`tests/sparse_kernel_checks.py`: fixed-k and ragged CSR, empty tokens, repeated and
unused latents, float32 and bfloat16 operands, NaN-poisoned outputs) and BatchTopK's threshold search
against today's `topk` selection (`tests/batch_select_checks.py`: float32, float64, bfloat16, deliberate
ties, no host read); and the CPU's own paths left as they were.

Triton chooses the interpreter from `TRITON_INTERPRET` when it is imported (its library's own jit
functions are decorated then), so the checks run in a fresh interpreter with the variable set; this
process, and a GPU run of the suite, keep compiled kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sae_pipeline.sae import sparse_decode, triton_sparse

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a fresh interpreter (torch import) and the Triton interpreter: ~20 s
def test_kernels_match_float64_reference_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "tests.sparse_kernel_checks"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-4000:]
    checked = result.stdout.split("checked:")[-1].split()
    assert len([c for c in checked if not c.startswith("select-")]) == 5 and "empty" in checked, result.stdout
    assert len([c for c in checked if c.startswith("select-")]) == 31, result.stdout


def test_cpu_tensors_stay_on_embedding_bag() -> None:
    """The kernels are for CUDA tensors only: the CPU path (and its speed) is what it was."""
    x = torch.randn(3, 4)
    assert sparse_decode._gpu_kernels(x, x) is None
    assert not triton_sparse.applies(x)
