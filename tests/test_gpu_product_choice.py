"""The sparse products' choice of Triton kernel or cuBLAS (`sae_pipeline/sae/product_choice.py`) on CUDA (a lent
GPU): both paths against float64 in bfloat16 and float32, one measurement per key with CUDA events (under CUDA's
sync check, which a fit's first step runs under in `tests/test_gpu_sync.py`), and none during a graph capture,
whose replay gives the same sums. The CPU counterpart is `tests/test_product_choice.py`."""

from __future__ import annotations

import pytest
import torch

from sae_pipeline.sae import product_choice, sparse_decode
from sae_pipeline.sae.product_choice import DENSE, SPARSE, ProductChooser
from tests.sparse_kernel_checks import TOLERANCE, ragged_codes, relative_error, topk_codes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
triton_sparse = pytest.importorskip("sae_pipeline.sae.triton_sparse")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", ["topk", "ragged"])
def test_both_paths_match_float64_on_cuda(layout: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    chooser = ProductChooser()
    monkeypatch.setattr(product_choice, "CHOOSER", chooser)
    monkeypatch.setattr(sparse_decode, "use_triton", True)
    make = topk_codes if layout == "topk" else ragged_codes
    codes = make(1024, 4096, 32, torch.Generator().manual_seed(0), "cuda")
    g = torch.Generator().manual_seed(1)
    W_dec = torch.randn(4096, 256, generator=g).to("cuda", dtype)
    tokens = torch.randn(1024, 256, generator=g).to("cuda", dtype)
    values = torch.randn(codes.indices.numel(), generator=g).to("cuda", dtype)
    dense = torch.zeros(1024, 4096, dtype=torch.float64, device="cuda").index_put(
        (codes.rows, codes.indices), values.double(), accumulate=True
    )
    reference = {
        "decode": dense @ W_dec.double(),
        "dW_dec": dense.T @ tokens.double(),
        "dvalues": (tokens.double() @ W_dec.double().T)[codes.rows, codes.indices],
    }
    for path in (SPARSE, DENSE):
        with chooser.forcing(path):
            got = {
                "decode": sparse_decode.token_sums(codes, W_dec, values),
                "dW_dec": sparse_decode.latent_sums(codes, tokens, values),
                "dvalues": sparse_decode.entry_dots(codes, tokens, W_dec),
            }
        for name, ref in reference.items():
            error = relative_error(got[name], ref)
            assert got[name].dtype == dtype and error <= TOLERANCE[dtype], (path, name, error)
    assert chooser.measurements == 0 and sparse_decode.use_triton


def test_measured_once_with_events_and_never_while_capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    chooser = ProductChooser()
    monkeypatch.setattr(product_choice, "CHOOSER", chooser)
    monkeypatch.setattr(sparse_decode, "use_triton", True)
    codes = topk_codes(2048, 8192, 32, torch.Generator().manual_seed(2), "cuda")
    g = torch.Generator().manual_seed(3)
    W_dec = torch.randn(8192, 256, generator=g).to("cuda", torch.bfloat16)
    values = torch.randn(codes.indices.numel(), generator=g).to("cuda", torch.bfloat16)
    reference = codes.with_values(values.double()).to_dense() @ W_dec.double()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled before any capture (PyTorch's rule), not through the chooser
        triton_sparse.segment_sums(codes.crow, codes.indices, W_dec, values)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    # a key first seen during a capture: the kernel, nothing measured or kept
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sparse_decode.token_sums(codes, W_dec, values)
    assert chooser.measurements == 0 and chooser.choices == {}
    graph.replay()
    assert relative_error(captured, reference) <= TOLERANCE[torch.bfloat16]

    # eager: measured once (no host read CUDA's check would catch: events only), then kept
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            out = sparse_decode.token_sums(codes, W_dec, values)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert chooser.measurements == 1
    ((key, choice),) = chooser.choices.items()
    assert key.device == torch.cuda.get_device_name() and key.dtype == torch.bfloat16 and key.per_token == 32
    assert choice.measured and choice.sparse_seconds > 0 and choice.dense_seconds > 0
    assert relative_error(out, reference) <= TOLERANCE[torch.bfloat16]

    # captured again: the kept path, no measurement; the replay gives the same sums
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sparse_decode.token_sums(codes, W_dec, values)
    graph.replay()
    assert chooser.measurements == 1
    assert relative_error(captured, reference) <= TOLERANCE[torch.bfloat16]
    (line,) = chooser.report()  # the measured choice (it replaced the capture's unmeasured one before any report)
    assert f"[{key.describe()}]" in line and "measured" in line and "not measured" not in line
