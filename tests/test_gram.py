"""MP-SAE's Gram matrix on CPU (BLAS syrk and a mirrored triangle) against a float64 matmul."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from threadpoolctl import threadpool_info

from sae_pipeline.sae.gram import gram_into, mirror_lower, uses_syrk


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d_sae", [1, 7, 300])
def test_gram_equals_the_matmul_whatever_the_buffer_held(dtype: torch.dtype, d_sae: int) -> None:
    W = torch.randn(d_sae, 23, generator=torch.Generator().manual_seed(d_sae), dtype=dtype)
    out = torch.full((d_sae, d_sae), float("nan"), dtype=dtype)  # syrk's beta = 0 must not read it
    gram_into(W, out)
    expected = (W.double() @ W.double().T).to(dtype)
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    assert torch.equal(out, out.T)  # exactly symmetric: one triangle copied from the other


def test_gram_of_a_strided_half_precision_dictionary_in_a_float32_buffer() -> None:
    W = torch.randn(50, 40).to(torch.float16)[:, ::2]  # not contiguous, not the buffer's dtype
    out = torch.empty(50, 50)
    gram_into(W, out)
    torch.testing.assert_close(out, W.float() @ W.float().T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", [1, 3, 64, 1000])
def test_mirror_fills_the_upper_triangle_from_the_lower(block: int) -> None:
    lower = torch.randn(130, 130).tril()
    matrix = lower + torch.full((130, 130), float("nan")).triu(1)
    mirror_lower(matrix, block)
    assert torch.equal(matrix, lower + lower.tril(-1).T)


def test_the_blas_thread_count_is_restored_after_the_call() -> None:
    gram_into(torch.randn(64, 8), torch.empty(64, 64))  # loads SciPy's BLAS
    before = [pool["num_threads"] for pool in threadpool_info()]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gram_into(torch.randn(64, 8), torch.empty(64, 64))
    finally:
        torch.set_num_threads(threads)
    assert [pool["num_threads"] for pool in threadpool_info()] == before


def test_only_cpu_float_buffers_take_the_syrk_path() -> None:
    cpu = torch.device("cpu")
    assert uses_syrk(cpu, torch.float32) and uses_syrk(cpu, torch.float64)
    assert not uses_syrk(cpu, torch.bfloat16) and not uses_syrk(torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("preset", [None, "28"])
def test_importing_the_package_shortens_the_openblas_spin_unless_the_user_set_it(preset: str | None) -> None:
    env = {key: value for key, value in os.environ.items() if key != "OPENBLAS_THREAD_TIMEOUT"}
    if preset is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = preset
    code = "import os, sae_pipeline; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == (preset or "4")
