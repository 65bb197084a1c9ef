"""The Triton kernels of `sae/` on CUDA (a lent GPU): the sparse products in bfloat16 and float32 at a
bigger shape against float64 (`tests/sparse_kernel_checks.py`), BatchTopK's threshold search against
CUDA's `topk` (`tests/batch_select_checks.py`) without a host sync, and the sparse training path through
the kernels against the `F.embedding_bag` path."""

from __future__ import annotations

import copy

import pytest
import torch

from sae_pipeline.sae import BatchTopKSAE, MatryoshkaBatchTopKSAE, TopKSAE, sparse_decode
from tests.batch_select_checks import cases, check_selection, rule
from tests.sparse_kernel_checks import check_products, ragged_codes, topk_codes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
triton_sparse = pytest.importorskip("sae_pipeline.sae.triton_sparse")
batch_select = pytest.importorskip("sae_pipeline.sae.batch_select")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", ["topk", "ragged"])
def test_products_match_float64_on_cuda(layout: str, dtype: torch.dtype) -> None:
    make = topk_codes if layout == "topk" else ragged_codes
    codes = make(1024, 4096, 32, torch.Generator().manual_seed(0), "cuda")
    check_products(triton_sparse, codes, 256, dtype, seed=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
def test_threshold_search_matches_cuda_topk_without_a_sync(dtype: torch.dtype) -> None:
    for name, values, n in cases(256, 2048, 8, dtype, seed=4):
        values = values.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = batch_select.radix_top_indices(values, n, out=torch.full((n,), -1, device="cuda"))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        check_selection(lambda v, m, got=got: got, values, n, f"{name} {dtype}")


def test_cuda_topk_keeps_the_lowest_index_ties() -> None:
    """What makes the support equal today's on a GPU even with ties at the threshold."""
    for name, values, n in cases(256, 2048, 8, torch.float32, seed=6):
        values = values.cuda()
        assert torch.equal(values.topk(n, sorted=False).indices.sort().values, rule(values, n)), name


@pytest.mark.parametrize("cls", [TopKSAE, BatchTopKSAE, MatryoshkaBatchTopKSAE], ids=lambda c: c.key)
def test_sparse_step_through_the_kernels_equals_embedding_bag(cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    template = cls(128, 4096, k=16).cuda()
    template.sparse_max_density = 1.0
    x = torch.randn(512, 128, device="cuda")
    grads = []
    for kernels in (True, False):
        monkeypatch.setattr(sparse_decode, "use_triton", kernels)
        sae = copy.deepcopy(template)
        out = sae(x)
        assert out.sparse is not None
        sae.loss(x, out).loss.backward()
        grads.append({name: p.grad for name, p in sae.named_parameters()})
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, rtol=1e-4, atol=1e-5, msg=name)
