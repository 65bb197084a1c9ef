"""Codes at inference as sparse entries (`sae/inference_codes.py`): every variant's `encode_sparse` equals the
non-zeros of its dense codes bit for bit, and `predict`'s ranked lists from them equal a plain loop's."""

from __future__ import annotations

import pytest
import torch
from sae_variants_fixtures import D_IN, batch, make
from torch import Tensor

from sae_pipeline.sae import SAE_REGISTRY, ShallowSAE
from sae_pipeline.sae.inference_codes import from_dense, from_token_lists, ranked_lists, sparse_codes
from sae_pipeline.sae.sparse_decode import SparseCodes
from sae_pipeline.training.module import SAEModule

FIELDS = ("rows", "indices", "crow", "values")


def assert_same_entries(got: SparseCodes, expected: SparseCodes) -> None:
    assert got.d_sae == expected.d_sae
    for name in FIELDS:
        a, b = getattr(got, name), getattr(expected, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def tied_batch(seed: int = 1) -> Tensor:
    """Rounded inputs (codes with exact ties), one token at ``b_pre`` and one far below it (codes all 0 or
    few), in float64 so that ties survive the encoder's sums."""
    x = batch(seed, dtype=torch.float64).round()
    x[3] = 0.0
    x[7] = -50.0
    return x


def prepared(name: str) -> object:
    sae = make(name).double().eval()
    with torch.no_grad():
        sae.W_dec.copy_(sae.W_dec.round(decimals=1))
        sae.b_pre.zero_()
        if isinstance(sae, ShallowSAE):
            sae.W_enc.copy_(torch.cat([sae.W_dec.T[:, ::2], sae.W_dec.T[:, ::2]], 1))  # atoms j, j + d/2 tie
        if hasattr(sae, "threshold"):
            sae.threshold.fill_(0.5)
    return sae


@pytest.mark.parametrize("name", sorted(SAE_REGISTRY))
def test_encode_sparse_equals_the_dense_codes_nonzeros(name: str) -> None:
    sae = prepared(name)
    x = tied_batch()
    with torch.no_grad():
        dense = sae.encode(x)
        expected = from_dense(dense)
        assert_same_entries(sae.encode_sparse(x), expected)
        assert torch.equal(expected.to_dense(), dense)
        assert (expected.values != 0).all() and expected.crow[4] == expected.crow[3]  # no entry of 0; a zero row
        if isinstance(sae, ShallowSAE):  # 0 forces the dense path: the same entries
            sae.sparse_max_density = 0.0
            assert_same_entries(sae.encode_sparse(x), expected)


@pytest.mark.parametrize("name", ["batchtopk", "matryoshka"])
def test_token_scaled_threshold_entries_equal_the_dense_codes(name: str) -> None:
    sae = make(name, token_scaled_threshold=True).eval()
    sae.threshold.fill_(0.4)
    x = batch()
    x[2] = sae.b_pre.detach()  # s(x) = 0: every positive code passes the threshold, zeros do not
    with torch.no_grad():
        expected = from_dense(sae.encode(x))
        assert_same_entries(sae.encode_sparse(x), expected)
    assert 0 < expected.values.numel() < x.shape[0] * sae.d_sae


def test_batchtopk_in_training_mode_reads_the_dense_codes() -> None:
    sae = prepared("batchtopk").train()
    x = tied_batch()
    with torch.no_grad():
        assert sae.inference_entries(sae.pre_activations(x)) is None
        assert_same_entries(sae.encode_sparse(x), from_dense(sae.encode(x)))


def test_token_lists_sum_repeats_in_list_order() -> None:
    """MP picks an atom again: its coefficients add up as `scatter_add_` adds them (values of very different
    magnitudes, so another order would round differently); sums of 0 and index -1 with value 0 are left out."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        indices = torch.randint(0, 6, (9, 7), generator=gen)
        values = torch.randn(9, 7, generator=gen) * 10 ** torch.randint(-6, 7, (9, 7), generator=gen).float()
        values[2] = 0.0
        indices[4, :2], values[4, :2] = 3, torch.tensor([1.5, -1.5])  # a sum of exactly 0
        dense = torch.zeros(9, 6).scatter_add_(1, indices, values)
        assert_same_entries(from_token_lists(indices, values, 6), from_dense(dense))
    indices = torch.tensor([[2, -1, -1], [0, 1, -1]])
    values = torch.tensor([[0.5, 0.0, 0.0], [0.25, -2.0, 0.0]])
    sae = make("ompsae")
    assert_same_entries(sae.sparse_from_pursuit(indices, values), from_dense(sae.codes_from_pursuit(indices, values)))


def plain_ranked(dense: Tensor) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's non-zeros by |value| desc, then index asc, padded with -1 / 0 to the widest row."""
    rows = [sorted((j for j in range(dense.shape[1]) if dense[r, j] != 0), key=lambda j: (-abs(float(dense[r, j])), j))
            for r in range(dense.shape[0])]  # fmt: skip
    width = max(map(len, rows), default=0)
    indices = [row + [-1] * (width - len(row)) for row in rows]
    values = [[float(dense[r, j]) for j in row] + [0.0] * (width - len(row)) for r, row in enumerate(rows)]
    return indices, values


def test_ranked_lists_equal_a_plain_loop_with_ties_and_zero_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(10):
        dense = torch.randint(-3, 4, (11, 30), generator=gen).double() * (torch.rand(11, 30, generator=gen) < 0.3)
        dense[trial % 11] = 0.0
        dense[5, :4] = torch.tensor([2.0, -2.0, 2.0, -2.0])  # ties of |value| within a row
        indices, values = ranked_lists(from_dense(dense))
        expected_indices, expected_values = plain_ranked(dense)
        assert indices.dtype == torch.int64 and values.dtype == torch.float64
        assert indices.tolist() == expected_indices and values.tolist() == expected_values
        assert torch.equal(sparse_codes(dense)[0], indices)
    empty = sparse_codes(torch.zeros(4, 6))
    assert empty[0].shape == empty[1].shape == (4, 0) and empty[0].dtype == torch.int64


def test_ranked_lists_leave_out_values_scaled_to_zero() -> None:
    codes = from_dense(torch.tensor([[1e-45, 0.0, 2.0], [0.0, 0.0, 0.0]]))
    indices, values = ranked_lists(codes.with_values(codes.values / 4.0))  # 1e-45 / 4 underflows to 0
    assert indices.tolist() == [[2], [-1]] and values.tolist() == [[0.5], [0.0]]


def test_ranked_lists_equal_the_former_topk_ranking_without_ties() -> None:
    """Distinct magnitudes: the same lists as the former `codes.abs().topk(width)` ranking."""
    gen = torch.Generator().manual_seed(3)
    dense = torch.randn(40, 64, generator=gen) * (torch.rand(40, 64, generator=gen) < 0.2)
    width = int((dense != 0).sum(1).max())
    magnitudes, former = dense.abs().topk(width, dim=1)
    former = former.masked_fill(magnitudes == 0, -1)
    indices, values = ranked_lists(from_dense(dense))
    assert torch.equal(indices, former)
    assert torch.equal(values, dense.gather(1, former.clamp_min(0)).masked_fill(former < 0, 0.0))


@pytest.mark.parametrize("name", ["topk", "batchtopk", "relu"])
def test_predict_step_equals_the_dense_path(name: str) -> None:
    """`predict`'s rows from the sparse entries equal those from the dense codes (`sparse_max_density` 0)."""
    sae = prepared(name).float()
    module = SAEModule(sae, normalize_input=False).eval()
    module.input_scale.fill_(3.0)
    batch_ = {"x": tied_batch().float(), "image_ids": [f"i{r}" for r in range(20)], "token_positions": torch.arange(20)}
    with torch.inference_mode():
        sparse = module.predict_step(batch_, 0)
        sae.sparse_max_density = 0.0
        dense = module.predict_step(batch_, 0)
        codes = sae.encode(module.preprocess(batch_["x"])).float() / module.input_scale
    for key in ("indices", "values"):
        assert torch.equal(sparse[key], dense[key])
    expected_indices, expected_values = plain_ranked(codes)
    assert sparse["indices"].tolist() == expected_indices and sparse["values"].tolist() == expected_values
    assert sparse["indices"].shape[0] == 20 and D_IN == sae.d_in
