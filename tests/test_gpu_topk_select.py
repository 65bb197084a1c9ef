"""The top-k selection kernels (`sae_pipeline/sae/triton_topk.py`) on CUDA (a lent GPU): the per-token kernel at
d_sae 19 200 and the batch selection against the stated rule and CUDA's `topk` (`tests/topk_select_checks.py`)
without a host sync, CUDA's own tie order, a captured graph, and how many rows take the exact path at the paper's
shape. Few dtypes and shapes: each new one compiles the kernels again, inside the suite's GPU part."""

from __future__ import annotations

import pytest
import torch

from sae_pipeline.sae import topk_select
from tests.topk_select_checks import check_flat, check_rows, flat_cases, row_cases, rule_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
triton_topk = pytest.importorskip("sae_pipeline.sae.triton_topk")
triton_batch_topk = pytest.importorskip("sae_pipeline.sae.triton_batch_topk")
if triton_topk.triton is None:
    pytest.skip("needs Triton", allow_module_level=True)

ROW_CASES = ("random", "coarse", "ties inside", "ties across the threshold", "-inf", "nan", "signed zeros", "constant")


def no_sync(fn):  # noqa: ANN001, ANN201
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_per_token_kernel_matches_the_rule_without_a_sync(dtype: torch.dtype) -> None:
    for name, values, k in row_cases(256, 19_200, 32, dtype, seed=0):
        if name not in ROW_CASES:
            continue  # other k: other compiles (the interpreter's checks run them)
        values = values.cuda()
        got = no_sync(lambda v=values, k=k: triton_topk.row_top_k(v, k, out=torch.full((256, k), -1, device="cuda")))
        check_rows(got, values, k, f"{name} {dtype}")


def test_cuda_topk_keeps_the_lowest_index_ties_per_row() -> None:
    """The rule the docs state as CUDA's own: its per-row `topk` gathers ties at the threshold by index too."""
    values = torch.randint(-3, 4, (64, 19_200), generator=torch.Generator().manual_seed(1)).float().cuda()
    assert torch.equal(values.topk(32, dim=1, sorted=False).indices.sort(dim=1).values.cpu(), rule_rows(values, 32))


def test_batch_selection_matches_the_rule_without_a_sync() -> None:
    for name, values, n in flat_cases(128, 19_200, 32, torch.bfloat16, seed=2):
        if n != 128 * 32:
            continue  # another R per row: another compile
        values = values.cuda()
        poisoned = torch.full((n,), -1, device="cuda")
        got = no_sync(lambda v=values, n=n, out=poisoned: triton_batch_topk.batch_top_k(v, n, out=out))
        check_flat(got, values, n, name)


def test_selections_replay_from_a_cuda_graph() -> None:
    values = torch.randn(512, 19_200, device="cuda").to(torch.bfloat16)
    expected = (topk_select.top_k_indices(values, 32), topk_select.batch_top_indices(values, 512 * 32))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = (topk_select.top_k_indices(values, 32), topk_select.batch_top_indices(values, 512 * 32))
    values.copy_(torch.randn_like(values))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], topk_select.top_k_indices(values, 32))
    assert torch.equal(captured[1], topk_select.batch_top_indices(values, 512 * 32))
    assert not torch.equal(captured[0], expected[0])


def test_few_rows_take_the_exact_path_at_the_papers_shape() -> None:
    values = torch.randn(4096, 19_200, device="cuda").to(torch.bfloat16)
    fallbacks = torch.zeros(1, dtype=torch.int32, device="cuda")
    got = triton_topk.row_top_k(values, 32, fallbacks=fallbacks)
    print(f"exact-path rows: {int(fallbacks)} of 4096 (tile {triton_topk.tile_for(32)})")
    assert int(fallbacks) < 0.05 * 4096
    assert torch.equal(got[:64].cpu(), rule_rows(values[:64], 32))
