"""``python -m benchmarks.peers`` and ``python -m benchmarks.gpu`` in their tiny dry-run modes: every contender
steps, and every peer that is installed (the ``bench`` extra) computes the same codes, x_hat and
gradients as ours from the same weights (MP-SAE included: SAELens's ``matching_pursuit`` and
overcomplete's ``MpSAE``); the TopK family is timed with no dead latent and with dead ones, every
library's own bookkeeping counting the same latents dead. The dry runs are marked slow: about 35 s of CPU
together, most of it importing SAELens, timm and the peers (3 min wall on the box loaded by
five other sessions), and about a minute for SAELens compiled (its compile); the argument tests take a few
seconds."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO_DPATH = Path(__file__).resolve().parents[1]
PEER_MODULES = {
    "SAELens": "sae_lens",
    "overcomplete": "overcomplete",
    "sparsify": "sparsify",
    "dictionary_learning": "dictionary_learning",
}
AUXK_VARIANTS = ("topk", "batchtopk", "matryoshka")  # timed twice: no dead latent, then 1/16 of them dead
PEER_VARIANTS = {  # the variants each library has
    "ours": ("topk", "batchtopk", "matryoshka", "jumprelu", "relu", "mpsae"),
    "SAELens": ("topk", "batchtopk", "matryoshka", "jumprelu", "relu", "mpsae"),
    "overcomplete": ("topk", "batchtopk", "jumprelu", "relu", "mpsae"),
    "sparsify": ("topk",),
    "dictionary_learning": ("topk", "batchtopk", "matryoshka", "jumprelu", "relu"),
}


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
        if line.startswith("| ") and not line.startswith(("| d_in", "| variant", "| d_sae"))
    ]


def contender_rows(stdout: str) -> list[list[str]]:
    """peers.py's rows, one per contender and block: d_in, d_sae, contender, step, ÷ ours, ÷ GEMM, peak memory,
    resident, equal to ours, dead."""
    return [row for row in table_rows(stdout) if len(row) == 10]


def check_contender_rows(rows: list[list[str]]) -> None:
    """Every row's figures are sane, every peer equal to ours, and the dead column says what each block timed:
    the TopK family first with no dead latent, then with 1/16 of them dead (4 of 64) in every library that has
    AuxK, overcomplete's step having none."""
    seen: dict[str, int] = {}
    for row in rows:
        step, vs_ours, vs_gemm, peak, resident, equal = row[3], float(row[4]), float(row[5]), row[6], row[7], row[8]
        assert step.endswith(" s") and vs_ours > 0 and vs_gemm > 0
        assert 0 < float(resident.split()[0]) <= float(peak.split()[0]), row
        assert equal == "reference" if row[2].startswith("ours") else equal.startswith("equal ("), row
        library, variant = row[2].split()
        block = seen[row[2]] = seen.get(row[2], 0) + 1  # the contender's first or second block
        if variant not in AUXK_VARIANTS:
            assert row[9] == "—" and block == 1, row
        elif library == "overcomplete":
            assert row[9] == "no AuxK", row
        else:
            assert row[9] == ("0.0 %" if block == 1 else "6.2 %"), row


@pytest.mark.slow
def test_peers_dry_run_every_contender_steps_and_agrees_with_ours() -> None:
    result = run("peers", "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = contender_rows(result.stdout)
    names = [row[2] for row in rows]
    for library, variants in PEER_VARIANTS.items():
        if library != "ours" and importlib.util.find_spec(PEER_MODULES[library]) is None:
            assert f"{library}: not installed" in result.stdout
            continue
        expected = [f"{library} {v}" for v in variants for _ in range(2 if v in AUXK_VARIANTS else 1)]
        assert sorted(name for name in names if name.startswith(f"{library} ")) == sorted(expected), result.stdout
    check_contender_rows(rows)
    assert "its step failed" not in result.stdout
    # the last table: per block, the fastest peer against ours
    fastest = [row for row in table_rows(result.stdout) if len(row) == 7]
    blocks = [(row[1], row[2]) for row in fastest]
    assert blocks == [
        (v, dead) for v in PEER_VARIANTS["ours"] for dead in (["none", "6.2 %"] if v in AUXK_VARIANTS else ["none"])
    ]
    for row in fastest:
        library = row[4].split()[0]
        assert library in PEER_MODULES and float(row[5]) > 0 and float(row[6]) > 0, row


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_peers_saelens_compiled_steps_after_compiling_and_agrees() -> None:
    """``--peers SAELens+compile``: SAELens's training forward through ``torch.compile`` (its ``compile_sae``),
    compiled in the warm-up (once per dead-mask branch), then timed; the same function as ours."""
    if importlib.util.find_spec("sae_lens") is None:
        pytest.skip("SAELens is not installed (the bench extra)")
    result = run("peers", "--dry-run", "--variants", "topk", "--peers", "SAELens+compile")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = contender_rows(result.stdout)
    assert [row[2] for row in rows] == ["ours topk", "SAELens+compile topk"] * 2, result.stdout
    check_contender_rows(rows)
    assert "its step failed" not in result.stdout


def test_peers_bad_dead_fraction_is_one_line_exit_2() -> None:
    result = run("peers", "--dead-fraction", "1")
    assert result.returncode == 2 and "--dead-fraction must be in [0, 1), got 1.0" in result.stderr


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
