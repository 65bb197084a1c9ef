"""The Babel function of an SAE's dictionary, and of the atoms active together on a token.

The Babel function (Tropp 2004, "Greed is good"; the paper's Sec. "Coherence") measures how well one
atom can be approximated by r others. Both forms are computed a block of atoms (or a chunk of
tokens) at a time, so a ``d_sae x d_sae`` Gram matrix is never held in memory.
"""

from __future__ import annotations

import torch
from torch import Tensor

from feature_extraction.validate import check_int
from sae_pipeline.metrics.streaming import as_rows

# Elements (not bytes) one chunk of `babel_coactive` may allocate for its gathered atoms and
# Gram matrices: 2**23 float32 values = 32 MiB, small next to a batch of activations.
_COACTIVE_CHUNK_ELEMENTS = 2**23


def _unit_atoms(W_dec: Tensor) -> Tensor:
    """Rows of ``W_dec`` scaled to unit L2 norm, in float32 or float64 (half is upcast)."""
    if W_dec.ndim != 2:
        raise ValueError(f"W_dec must be 2-D [d_sae, d_in], got shape {tuple(W_dec.shape)}")
    dtype = torch.float64 if W_dec.dtype == torch.float64 else torch.float32
    W = W_dec.detach().to(dtype)
    if not torch.isfinite(W).all():
        raise ValueError("W_dec contains non-finite values (NaN or inf)")
    norms = W.norm(dim=1, keepdim=True)
    if (norms == 0).any():
        raise ValueError("W_dec has an all-zero row: the Babel function needs unit-norm atoms")
    return W / norms


def _check_r_max(r_max: int, d_sae: int) -> None:
    check_int("r_max", r_max, 1, d_sae - 1, note=" (d_sae - 1)")


@torch.no_grad()
def babel(W_dec: Tensor, r_max: int, block_size: int = 1024) -> Tensor:
    """Babel function μ₁(r) of the dictionary for r = 1..r_max (Tropp 2004; paper Sec. "Coherence").

    μ₁(r) = max over sets S of r atoms, max over atoms j ∉ S, of Σ_{i∈S} |⟨d_i, d_j⟩|, which
    equals: max over atoms j of the sum of the r largest |⟨d_i, d_j⟩| over i ≠ j. It measures
    how well one atom can be approximated by r others (lower = less redundant); unlike the
    mutual coherence μ₁(1) it sees cumulative interference.

    The function is defined for unit-norm atoms, so the rows of ``W_dec`` ([d_sae, d_in]) are
    normalised here first. Atoms j are processed ``block_size`` at a time: |W_blk Wᵀ| with the
    diagonal excluded, top-r_max per row, cumulative sum, running max over blocks. Peak
    memory is ``O(block_size · d_sae)``, never ``d_sae²``.

    Returns a tensor ``[r_max]`` (float32, or float64 for a float64 ``W_dec``) on W_dec's device.
    """
    W = _unit_atoms(W_dec)
    d_sae = W.shape[0]
    _check_r_max(r_max, d_sae)
    check_int("block_size", block_size, 1)
    result = torch.zeros(r_max, dtype=W.dtype, device=W.device)
    # One reused buffer: a fresh block-sized allocation per block costs page faults on CPU.
    buffer = torch.empty(min(block_size, d_sae), d_sae, dtype=W.dtype, device=W.device)
    for start in range(0, d_sae, block_size):
        stop = min(start + block_size, d_sae)
        gram = torch.mm(W[start:stop], W.T, out=buffer[: stop - start]).abs_()  # row j: |<d_j, d_i>| for all i
        rows = torch.arange(stop - start, device=W.device)
        gram[rows, rows + start] = -torch.inf  # exclude i == j; never picked since r_max <= d_sae - 1
        top = gram.topk(r_max, dim=1, sorted=True).values
        result = torch.maximum(result, top.cumsum(dim=1).amax(dim=0))
    return result


@torch.no_grad()
def babel_coactive(W_dec: Tensor, codes: Tensor, r_max: int) -> Tensor:
    """Babel function of the co-activated atoms, averaged over tokens (paper Sec. "Coherence", Fig. 5b).

    For each token, S is the set of atoms active for it (``codes != 0``) and the Babel
    function is taken within S: μ₁^S(r) = max over j ∈ S of the sum of the r largest
    |⟨d_i, d_j⟩| over i ∈ S, i ≠ j. When r ≥ |S| there are fewer than r other active atoms
    and the sum runs over all of them (the curve is flat from r = |S| − 1 on). Tokens with
    |S| ≤ 1 have no pair of atoms and contribute 0. The result is the mean over all tokens,
    for each r. Atoms are normalised to unit norm first, as in ``babel``.

    Vectorised per chunk of tokens: pad each token's active indices to the chunk's largest
    |S| = m, gather atoms [B, m, d_in], batch Gram [B, m, m] with padding and the diagonal
    set to 0 (harmless in a sum of non-negative terms), sort, cumsum, max over j.

    Args:
        W_dec: dictionary [d_sae, d_in] (rows are atoms).
        codes: codes [..., d_sae].
        r_max: largest r, in [1, d_sae − 1].

    Returns a tensor ``[r_max]`` (float32, or float64 for a float64 ``W_dec``).
    """
    W = _unit_atoms(W_dec)
    d_sae, d_in = W.shape
    _check_r_max(r_max, d_sae)
    codes = as_rows(codes.detach(), d_sae, "codes")
    n_tokens = codes.shape[0]
    if n_tokens == 0:
        raise ValueError("codes must hold at least one token, got shape [0, d_sae]")
    active = (codes != 0).to(W.device)
    n_active = active.sum(dim=1)
    # Visit tokens in order of increasing |S| so that each chunk pads to a similar m and one
    # token with many active atoms does not shrink every chunk (the result is a sum).
    order = torch.argsort(n_active)
    sorted_counts = n_active[order].tolist()
    total = torch.zeros(r_max, dtype=torch.float64, device=W.device)
    start = 0
    while start < n_tokens:
        stop = min(start + _chunk_tokens(sorted_counts[start], d_in), n_tokens)
        stop = min(start + _chunk_tokens(sorted_counts[stop - 1], d_in), n_tokens)  # m grew: shrink
        rows = order[start:stop]
        total += _coactive_chunk_sum(W, active[rows], n_active[rows], r_max)
        start = stop
    return (total / n_tokens).to(W.dtype)


def _chunk_tokens(m: int, d_in: int) -> int:
    """Tokens per chunk when each pads to m atoms: gathered atoms plus two m x m buffers."""
    m = max(m, 1)
    return max(1, _COACTIVE_CHUNK_ELEMENTS // (m * d_in + 2 * m * m))


def _coactive_chunk_sum(W: Tensor, active: Tensor, n_active: Tensor, r_max: int) -> Tensor:
    """Sum over the chunk's tokens of their co-active Babel curves, float64 ``[r_max]``."""
    m = int(n_active.max().item())
    if m <= 1:
        return torch.zeros(r_max, dtype=torch.float64, device=W.device)
    n_tokens = active.shape[0]
    token, atom = active.nonzero(as_tuple=True)  # row-major: grouped by token, in atom order
    offsets = torch.cumsum(n_active, dim=0) - n_active
    slot = torch.arange(token.numel(), device=W.device) - offsets[token]
    index = torch.zeros(n_tokens, m, dtype=torch.long, device=W.device)
    valid = torch.zeros(n_tokens, m, dtype=torch.bool, device=W.device)
    index[token, slot] = atom
    valid[token, slot] = True
    atoms = W[index]  # [B, m, d_in]
    gram = torch.bmm(atoms, atoms.transpose(1, 2)).abs_()  # [B, m, m]
    keep = valid.unsqueeze(1) & valid.unsqueeze(2)
    keep &= ~torch.eye(m, dtype=torch.bool, device=W.device)
    gram = gram.masked_fill_(~keep, 0.0)
    r_eff = min(r_max, m - 1)  # at most m - 1 other atoms per row
    top = gram.topk(r_eff, dim=2, sorted=True).values
    curves = top.cumsum(dim=2).amax(dim=1)  # [B, r_eff]; padded rows are all 0
    if r_eff < r_max:  # fewer than r others: the sum runs over all of them
        curves = torch.cat([curves, curves[:, -1:].expand(-1, r_max - r_eff)], dim=1)
    return curves.to(torch.float64).sum(dim=0)
