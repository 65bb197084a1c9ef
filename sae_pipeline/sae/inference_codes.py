"""Codes at inference as sparse entries: what `predict` and `features` read instead of dense codes.

A k-sparse variant's encoder already holds its few active latents per token (TopK's per-token
top k, BatchTopK's threshold mask, a pursuit's selection order). Scattering them into dense
`[B, d_sae]` codes only to search those again for their non-zeros costs a few passes over
B · d_sae elements per batch, and every consumer downstream (predict's ranked lists, the
features pass's top-N table and label counts, each image's top atoms and heatmaps) reads only
the non-zero entries.

The entries here are *canonical*: a `SparseCodes` holding the non-zero codes only, in the order
of `dense.nonzero()` (by token, then by latent), whether a sparse encoder built them
(`SparseAutoencoder.encode_sparse`, `sae_pipeline/sae/sparse_inference.py`) or `from_dense` read
them off dense codes (the variants without a sparse encoder: ReLU, JumpReLU, BatchTopK in training
mode). So every consumer sees the same entries in the same order either way, and a sum over entries
adds the same floats in the same order as the dense path did: the results are equal bit for bit,
not within rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sae_pipeline.sae.sparse_decode import SparseCodes, row_offsets


def _entries(rows: Tensor, indices: Tensor, values: Tensor, batch: int, d_sae: int) -> SparseCodes:
    return SparseCodes(indices, rows, row_offsets(rows, batch), d_sae, values)


def from_dense(codes: Tensor) -> SparseCodes:
    """The non-zero entries of dense codes `[B, d_sae]` (the fallback of every variant)."""
    if codes.ndim != 2:
        raise ValueError(f"codes must be [batch, d_sae], got shape {list(codes.shape)}")
    rows, indices = codes.nonzero(as_tuple=True)
    return _entries(rows, indices, codes[rows, indices], codes.shape[0], codes.shape[1])


def from_support(mask: Tensor, dense_values: Tensor) -> SparseCodes:
    """The entries of `dense_values [B, d_sae]` where the bool `mask` is set and the value is not 0
    (the non-zeros of `dense_values * mask`, without that product)."""
    rows, indices = (mask & (dense_values != 0)).nonzero(as_tuple=True)
    return _entries(rows, indices, dense_values[rows, indices], mask.shape[0], mask.shape[1])


def from_token_lists(indices: Tensor, values: Tensor, d_sae: int) -> SparseCodes:
    """The codes `zeros([B, d_sae]).scatter_add_(1, indices, values)` as canonical entries.

    `indices [B, w]` lists each token's latents in any order, a latent possibly several times
    (MP picks an atom again): its values are summed in the order listed, from 0, as
    `scatter_add_` on the CPU sums them. Entries whose sum is 0 are dropped.
    """
    batch, width = indices.shape
    indices, order = indices.sort(dim=1, stable=True)  # by latent within the token, repeats in list order
    values = values.gather(1, order).reshape(-1)
    indices = indices.reshape(-1)
    rows = torch.arange(batch, device=indices.device)[:, None].expand(batch, width).reshape(-1)
    if width > 1 and bool((indices.view(batch, width)[:, 1:] == indices.view(batch, width)[:, :-1]).any()):
        keys, inverse = torch.unique_consecutive(rows * d_sae + indices, return_inverse=True)
        values = values.new_zeros(keys.numel()).index_add_(0, inverse, values)  # in entry order on the CPU
        rows, indices = torch.div(keys, d_sae, rounding_mode="floor"), keys % d_sae
    keep = values != 0
    return _entries(rows[keep], indices[keep], values[keep], batch, d_sae)


def ranked_lists(codes: SparseCodes) -> tuple[Tensor, Tensor]:
    """Canonical entries -> `(indices [B, w] int64, values [B, w])`, the rows `predict` writes.

    `w` is the largest number of non-zero codes of any token in the batch; each row lists its
    non-zero codes by decreasing |value|, ties by increasing latent index, then index -1 with
    value 0. Entries whose value is 0 (e.g. after a division by the input scale) are left out.
    """
    values = codes._values()
    keep = values != 0
    rows, indices, values = codes.rows[keep], codes.indices[keep], values[keep]
    batch = codes.batch_size
    crow = row_offsets(rows, batch)
    width = int((crow[1:] - crow[:-1]).max()) if batch else 0
    if width == 0:
        empty = values.new_zeros(batch, 0)
        return empty.to(torch.int64), empty
    # (row asc, |value| desc, index asc): entries come by (row, index); two stable sorts keep that.
    order = torch.sort(values.abs(), descending=True, stable=True).indices
    order = order[torch.sort(rows[order], stable=True).indices]
    rows, indices, values = rows[order], indices[order], values[order]
    slot = torch.arange(rows.numel(), device=rows.device) - crow[rows]
    out_indices = torch.full((batch, width), -1, dtype=torch.int64, device=rows.device)
    out_values = values.new_zeros(batch, width)
    out_indices[rows, slot] = indices
    out_values[rows, slot] = values
    return out_indices, out_values


@torch.no_grad()
def sparse_codes(codes: Tensor) -> tuple[Tensor, Tensor]:
    """Dense codes `[B, d_sae]` -> `ranked_lists` (`predict`'s rows from dense codes)."""
    return ranked_lists(from_dense(codes))
