"""``python -m benchmarks.peers`` and ``python -m benchmarks.gpu`` in their tiny dry-run modes: every contender
steps, and every peer that is installed (the ``bench`` extra) computes the same codes, x_hat and
gradients as ours from the same weights (MP-SAE included: SAELens's ``matching_pursuit`` and
overcomplete's ``MpSAE``). The two dry runs are marked slow: about 35 s of CPU
together, most of it importing SAELens, timm and the peers (3 min wall on the box loaded by
five other sessions); the two argument tests take a few seconds."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO_DPATH = Path(__file__).resolve().parents[1]
PEER_MODULES = {"SAELens": "sae_lens", "overcomplete": "overcomplete", "sparsify": "sparsify"}
PEER_VARIANTS = {"SAELens": 5, "overcomplete": 5, "sparsify": 1}


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m benchmarks.MODULE ARGS`` from the repository root, as BENCHMARKS.md runs them."""
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_DPATH,
    )


def table_rows(stdout: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| d_in") and not line.startswith("| variant")
    ]


@pytest.mark.slow
def test_peers_dry_run_every_contender_steps_and_agrees_with_ours() -> None:
    result = run("peers", "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = table_rows(result.stdout)
    libraries = [row[2].split()[0] for row in rows]
    assert libraries.count("ours") == 5 and "ours mpsae" in [row[2] for row in rows]
    for library, module in PEER_MODULES.items():
        if importlib.util.find_spec(module) is None:
            assert f"{library}: not installed" in result.stdout
            continue
        assert libraries.count(library) == PEER_VARIANTS[library], result.stdout
    for row in rows:
        step, vs_ours, vs_gemm, peak, resident, equal = row[3], float(row[4]), float(row[5]), row[6], row[7], row[8]
        assert step.endswith(" s") and vs_ours > 0 and vs_gemm > 0
        assert 0 < float(resident.split()[0]) <= float(peak.split()[0]), row
        assert equal == "reference" if row[2].startswith("ours") else equal.startswith("equal ("), row


def test_peers_bad_argument_is_one_line_exit_2() -> None:
    result = run("peers", "--k", "0")
    assert result.returncode == 2 and "--k must be >= 1, got 0" in result.stderr


@pytest.mark.slow
def test_gpu_dry_run_reports_every_variant_and_extraction() -> None:
    result = run("gpu", "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row[0]: row for row in table_rows(result.stdout)}
    from sae_pipeline.sae import SAE_REGISTRY

    assert set(rows) == set(SAE_REGISTRY)
    for variant, row in rows.items():
        assert float(row[2].replace(",", "")) > 0
        assert (row[3] == "—") == SAE_REGISTRY[variant].is_pursuit  # no roofline for a pursuit
    assert "images/s" in result.stdout.splitlines()[-1]


@pytest.mark.slow
def test_sparse_kernels_dry_run_times_every_product() -> None:
    """``python -m benchmarks.sparse_kernels --dry-run``: every row timed on the CPU (Triton's column needs CUDA)."""
    result = run("sparse_kernels", "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row[0]: row for row in table_rows(result.stdout) if row[0] != "product"}
    assert set(rows) == {"decode", "dW_dec", "dvalues", "decode fwd+bwd", "batchtopk select"}
    for row in rows.values():
        assert row[1] == "needs CUDA" and row[2].endswith(" ms"), row


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch")
def test_gpu_without_cuda_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    result = run("gpu")
    assert result.returncode == 2 and "no CUDA device is visible" in result.stderr
