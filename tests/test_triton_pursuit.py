"""The fused pursuit step (``sae_pipeline/sae/triton_pursuit.py``) on the CPU under Triton's interpreter,
against a float64 reference on fresh random inputs; then MP-SAE and OMP-SAE through the kernel path
against their plain loops (float64) and their PyTorch paths (same indices).

Triton reads ``TRITON_INTERPRET=1`` when it is imported (its own library functions are jitted then), and
a session has usually imported it already; so, unless the session runs under it, one test here runs
this file again in a fresh interpreter with it set (``test_under_the_interpreter``), and the kernel tests
run there. The interpreter is slow: tiny shapes, and tiles shrunk (2 × 16) so that rows span several
tiles and the last program's rows are partly masked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from sae_pipeline.sae import mp_autograd, omp_autograd, triton_pursuit
from sae_pipeline.sae.mp_autograd import select_atoms
from sae_pipeline.sae.triton_pursuit import update_argmax
from tests.test_mp_sae import make_sae as make_mp
from tests.test_mp_sae import plain_loop
from tests.test_omp_sae import compare as compare_omp
from tests.test_omp_sae import make_sae as make_omp

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not triton_pursuit.triton_installed(), reason="needs Triton")
in_interpreter = pytest.mark.skipif(not INTERPRETED, reason="run by test_under_the_interpreter")


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETED, reason="this session is the interpreter's")
def test_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=500)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-2000:]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(triton_pursuit, "BLOCK_ROWS", 2)
    monkeypatch.setattr(triton_pursuit, "BLOCK_COLUMNS", 16)
    triton_pursuit._kernel.cache_clear()
    yield
    triton_pursuit._kernel.cache_clear()


def reference_step(
    C: Tensor,
    rows: Tensor | None,
    row_index: Tensor,
    coef: Tensor,
    gather: bool,
    mask: bool,
    D: Tensor | None,
    tol: Tensor,
) -> tuple[Tensor, Tensor | None]:
    """The step of the kernel's docstring, in float64 PyTorch ops."""
    C, n = C.double().clone(), C.shape[0]
    if rows is not None:
        R = rows.double()[row_index] if gather else rows.double()
        C -= coef.double()[:, None] * R
        if mask:
            C[torch.arange(n), row_index.clamp_min(0)] = float("-inf")
        if D is not None:
            D = D.double() - R * R
            C[D <= tol.double()] = float("-inf")
    return C, D


MODES = ["argmax only", "gram rows", "omp rows", "omp rows and distances"]


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", MODES)
def test_step_matches_the_float64_reference(dtype: torch.dtype, mode: str) -> None:
    n, width, d_sae = 7, 70, 70  # 7 rows: programs of 2, the last half empty; 70 columns: 5 tiles of 16
    C = torch.randn(n, width, dtype=dtype)
    G = torch.randn(d_sae, width, dtype=dtype)
    P = torch.randn(n, width, dtype=dtype)
    row_index = torch.randint(0, d_sae, (n,))
    row_index[0] = -1  # OMP's step not taken: masks atom 0
    coef = torch.randn(n, dtype=dtype)
    D = torch.rand(n, width, dtype=dtype) * 3
    tol = torch.rand(width, dtype=dtype)
    update = mode != "argmax only"
    gather = mode == "gram rows"
    rows = (G if gather else P) if update else None
    if gather:
        row_index = row_index.clamp_min(0)
    distances = D.clone() if mode.endswith("distances") else None
    ref_C, ref_D = reference_step(C, rows, row_index, coef, gather, mode.startswith("omp"), distances, tol)

    c_out = torch.full_like(C, float("nan"))  # poisoned: every entry must be written
    out_index = torch.full((n, 3), -7, dtype=torch.int64)  # a strided column, as the pursuits pass
    out_value = torch.full((n,), float("nan"), dtype=dtype)
    update_argmax(
        C,
        out_index[:, 1],
        out_value,
        c_out=c_out,
        rows=rows,
        row_index=row_index,
        coef=coef,
        gather=gather,
        mask_picked=mode.startswith("omp"),
        distances=distances,
        tolerance=tol,
    )
    assert (out_index[:, [0, 2]] == -7).all()  # the neighbouring columns untouched
    index = out_index[:, 1]
    tight = 1e-12 if dtype == torch.float64 else 1e-5
    top = ref_C.amax(1)
    if dtype == torch.float64:
        torch.testing.assert_close(index, ref_C.argmax(1), rtol=0, atol=0)
    assert (ref_C.gather(1, index[:, None])[:, 0] >= top - tight * top.abs().clamp_min(1)).all()  # a maximum
    torch.testing.assert_close(out_value.double(), top, rtol=tight, atol=tight)
    if update:
        torch.testing.assert_close(c_out.double(), ref_C, rtol=tight, atol=tight)
    else:
        assert c_out.isnan().all()  # nothing to store without an update
    if distances is not None:
        assert ref_D is not None
        torch.testing.assert_close(distances.double(), ref_D, rtol=tight, atol=tight)
        assert torch.isinf(ref_C).any() and torch.isfinite(ref_C).any()  # the rank mask is exercised


@in_interpreter
def test_ties_go_to_the_first_column_across_tiles() -> None:
    C = torch.randint(-2, 3, (9, 50)).double()  # many exact ties, within and across tiles
    C[0] = 0.0
    C[1, 45] = C[1, 17] = 5.0
    C[2] = float("-inf")  # nothing left (OMP): torch.argmax gives 0
    out_index = torch.full((9,), -7, dtype=torch.int64)
    out_value = torch.full((9,), float("nan"), dtype=torch.float64)
    update_argmax(C, out_index, out_value)
    torch.testing.assert_close(out_index, C.argmax(1), rtol=0, atol=0)
    torch.testing.assert_close(out_value, C.amax(1), rtol=0, atol=0)


@in_interpreter
def test_bf16_correlations_are_read_and_float32_kept() -> None:
    """MP's second step: the first correlations of a bf16 GEMM in, float32 out; ``store=False`` (its
    last step) writes no correlation."""
    first = torch.randn(5, 40).bfloat16()
    G = torch.randn(40, 40).bfloat16()
    j = torch.randint(0, 40, (5,))
    coef = torch.randn(5)
    for store in (True, False):
        kept = torch.full((5, 40), float("nan"))
        out_index = torch.full((5,), -7, dtype=torch.int64)
        out_value = coef.clone()  # coef read before the value is written, as MP passes it
        update_argmax(first, out_index, out_value, c_out=kept, rows=G, row_index=j, coef=out_value, store=store)
        ref = first.double() - coef.double()[:, None] * G.double()[j]
        torch.testing.assert_close(out_index, ref.argmax(1), rtol=0, atol=0)
        torch.testing.assert_close(out_value.double(), ref.amax(1), rtol=1e-6, atol=1e-6)
        if store:
            torch.testing.assert_close(kept.double(), ref, rtol=1e-6, atol=1e-6)
        else:
            assert kept.isnan().all()


@in_interpreter
def test_bad_arguments_raise() -> None:
    C = torch.randn(4, 8)
    with pytest.raises(ValueError, match="row_index and coef"):
        update_argmax(C, torch.empty(4, dtype=torch.int64), torch.empty(4), rows=C)
    with pytest.raises(ValueError, match="unit column stride"):
        update_argmax(C.T, torch.empty(8, dtype=torch.int64), torch.empty(8))


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mp_selection_through_the_kernel(dtype: torch.dtype) -> None:
    torch.manual_seed(int(torch.seed() % 2**31))
    r = torch.randn(8, 6, dtype=dtype)
    W = F.normalize(torch.randn(64, 6, dtype=dtype), dim=1)
    fused = select_atoms(r, W, 4, "gram", fused=True)
    assert torch.equal(fused, select_atoms(r, W, 4, "gram", fused=False))
    assert torch.equal(fused, select_atoms(r, W, 4, "matmul", fused=False))
    if dtype == torch.float64:
        assert torch.equal(fused, plain_loop(r, W, torch.zeros(6, dtype=dtype), 4)[0])
    assert torch.equal(select_atoms(r, W, 1, "gram", fused=True), fused[:, :1])


@in_interpreter
def test_mp_sae_through_the_kernel_matches_the_plain_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mp_autograd, "fused_available", lambda device: True)
    sae = make_mp(6, 48, 4, seed=int(torch.seed() % 2**31), selection="gram")
    x = torch.randn(8, 6, dtype=torch.float64) * 2
    W_ref = sae.W_dec.detach().clone().requires_grad_()
    b_ref = sae.b_pre.detach().clone().requires_grad_()
    indices, codes, x_hat = plain_loop(x, W_ref, b_ref, 4)
    out = sae(x)
    assert torch.equal(sae.pursuit(x)[0], indices)
    torch.testing.assert_close(out.codes, codes, rtol=0, atol=1e-10)
    torch.testing.assert_close(out.x_hat, x_hat, rtol=0, atol=1e-10)
    upstream = torch.randn_like(x)
    (x_hat * upstream).sum().backward()
    (out.x_hat * upstream).sum().backward()
    torch.testing.assert_close(sae.W_dec.grad, W_ref.grad, rtol=0, atol=1e-8)
    torch.testing.assert_close(sae.b_pre.grad, b_ref.grad, rtol=0, atol=1e-8)


@in_interpreter
@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("shape", [(8, 6, 40, 4), (6, 3, 12, 5)])  # the second: k > d_in, tokens stop
def test_omp_sae_through_the_kernel_matches_the_plain_loop(
    sync_free: bool, shape: tuple[int, int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = omp_autograd.omp_step
    monkeypatch.setattr(omp_autograd, "fused_available", lambda device: True)
    monkeypatch.setattr(omp_autograd, "omp_step", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    batch, d_in, d_sae, k = shape
    sae = make_omp(d_in, d_sae, k, seed=int(torch.seed() % 2**31))
    sae.sync_free = sync_free
    x = torch.randn(batch, d_in, dtype=torch.float64)
    compare_omp(sae, x, k)
    assert calls, "the kernel path was taken"
    if k > d_in:
        assert (sae.pursuit(x)[0][:, d_in:] == -1).all()
