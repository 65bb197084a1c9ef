"""Evaluation metrics for sparse autoencoders: R², sparsity, dead atoms and the Babel function.

Design choices:

- The streaming metrics (``ReconstructionR2``, ``ActivationStats``) keep only float64 *sums*
  as torchmetrics states with ``dist_reduce_fx="sum"``. Sums are associative, so the value
  after a DDP all-reduce equals the value of one process that saw all the data (up to
  float64 rounding), whatever the world size or batch split.
- States have fixed shapes given at construction (``d_in``, ``d_sae``) rather than being sized
  on the first update: torchmetrics stacks the gathered states before summing, and a rank
  that saw no batch would otherwise hold a differently shaped state and break the sync.
- The Babel function (Tropp 2004, "Greed is good"; the paper's Sec. "Coherence") is computed
  a block of atoms at a time, so a ``d_sae x d_sae`` Gram matrix is never held in memory.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

from feature_extraction.validate import check_int

# Elements (not bytes) one chunk of `babel_coactive` may allocate for its gathered atoms and
# Gram matrices: 2**23 float32 values = 32 MiB, small next to a batch of activations.
_COACTIVE_CHUNK_ELEMENTS = 2**23


def _as_rows(tensor: Tensor, width: int, name: str) -> Tensor:
    """Flatten leading dimensions to ``[n, width]``, raising a one-line error on a bad shape."""
    if tensor.ndim < 1 or tensor.shape[-1] != width:
        raise ValueError(f"{name} must have shape [..., {width}], got {tuple(tensor.shape)}")
    return tensor.reshape(-1, width)



class ReconstructionR2(Metric):
    """Fraction of variance explained, R² = 1 − Σ‖x − x̂‖² / Σ‖x − μ‖² (the paper's expressivity metric).

    ``μ`` is the per-dimension mean over everything seen since the last ``reset``, so this
    is the variance-weighted R² of the whole evaluated set (sklearn's
    ``r2_score(..., multioutput="variance_weighted")``), not a mean of per-batch R².

    The total variance is accumulated as ``Σx`` and ``Σx²`` per dimension in float64 and
    formed at the end as ``Σx² − n·μ²`` per dimension: float64 keeps the cancellation
    harmless even for dimensions whose mean is far larger than their spread (the "massive
    activations" of ViTs), and sums are what DDP can all-reduce exactly.

    Args:
        d_in: width of ``x``; the state size (fixed here so that DDP sync always sees
            identically shaped states, even on a rank that received no batch).
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    sum_x: Tensor
    sum_x2: Tensor
    sum_sq_err: Tensor
    n: Tensor

    def __init__(self, d_in: int, **kwargs: object) -> None:
        super().__init__(**kwargs)
        check_int("d_in", d_in, 1)
        self.d_in = d_in
        self.add_state("sum_x", default=torch.zeros(d_in, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sum_x2", default=torch.zeros(d_in, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sum_sq_err", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("n", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, x: Tensor, x_hat: Tensor) -> None:
        """Add a batch of inputs ``x`` and reconstructions ``x_hat``, both ``[..., d_in]``."""
        if x.shape != x_hat.shape:
            raise ValueError(f"x_hat must have the shape of x {tuple(x.shape)}, got {tuple(x_hat.shape)}")
        x64 = _as_rows(x.detach(), self.d_in, "x").to(torch.float64)
        x_hat64 = _as_rows(x_hat.detach(), self.d_in, "x_hat").to(torch.float64)
        self.sum_x += x64.sum(dim=0)
        self.sum_x2 += x64.square().sum(dim=0)
        self.sum_sq_err += (x64 - x_hat64).square().sum()
        self.n += x64.shape[0]

    def compute(self) -> Tensor:
        """R² as a float64 scalar; NaN when the inputs seen have zero variance."""
        if self.n.item() == 0:
            raise ValueError("ReconstructionR2.compute() called before any update(x, x_hat): no tokens seen")
        total_variance = (self.sum_x2 - self.sum_x.square() / self.n).sum()
        if total_variance.item() <= 0:
            return torch.full((), float("nan"), dtype=torch.float64, device=self.n.device)
        return 1.0 - self.sum_sq_err / total_variance


class ActivationStats(Metric):
    """Per-atom activation frequency and mean value, and L0, over all tokens seen.

    These are the quantities of the paper's Fig. "Activation distributions": frequency
    ``Σ_i [z_j^i ≠ 0] / n`` and mean value ``E[z_j]`` taken over *all* tokens (zeros
    included), so ``mean_value = frequency · E[z_j | z_j ≠ 0]``. Counts and sums are float64
    states summed across DDP ranks.

    Args:
        d_sae: number of atoms (width of the codes).
    """

    is_differentiable = False
    full_state_update = False

    fire_count: Tensor
    value_sum: Tensor
    n_tokens: Tensor

    def __init__(self, d_sae: int, **kwargs: object) -> None:
        super().__init__(**kwargs)
        check_int("d_sae", d_sae, 1)
        self.d_sae = d_sae
        self.add_state("fire_count", default=torch.zeros(d_sae, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("value_sum", default=torch.zeros(d_sae, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("n_tokens", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, codes: Tensor) -> None:
        """Add a batch of codes ``[..., d_sae]`` (dense; zeros are inactive atoms)."""
        codes = _as_rows(codes.detach(), self.d_sae, "codes")
        self.fire_count += (codes != 0).sum(dim=0).to(torch.float64)
        self.value_sum += codes.to(torch.float64).sum(dim=0)
        self.n_tokens += codes.shape[0]

    def compute(self) -> dict[str, Tensor]:
        """``{"frequency": [d_sae], "mean_value": [d_sae], "l0": scalar}``, all float64."""
        if self.n_tokens.item() == 0:
            raise ValueError("ActivationStats.compute() called before any update(codes): no tokens seen")
        return {
            "frequency": self.fire_count / self.n_tokens,
            "mean_value": self.value_sum / self.n_tokens,
            "l0": self.fire_count.sum() / self.n_tokens,
        }


def l0(codes: Tensor) -> Tensor:
    """Mean number of nonzero codes per token (the sparsity k the paper compares SAEs at).

    ``codes`` is ``[..., d_sae]``; returns a float64 scalar (counts are exact integers first).
    """
    if codes.ndim < 1 or codes.numel() == 0:
        raise ValueError(f"codes must be a non-empty tensor [..., d_sae], got shape {tuple(codes.shape)}")
    # count_nonzero skips the [B, d_sae] bool tensor and its per-row sums (~9x faster on CPU).
    n_tokens = codes.numel() // codes.shape[-1]
    return torch.count_nonzero(codes).to(torch.float64) / n_tokens


def dead_fraction(tokens_since_fired: Tensor, dead_after_tokens: int) -> Tensor:
    """Fraction of atoms that have not fired in the last ``dead_after_tokens`` tokens.

    Uses the same rule as ``SparseAutoencoder.dead_mask``: dead iff
    ``tokens_since_fired >= dead_after_tokens``. Returns a float64 scalar.
    """
    check_int("dead_after_tokens", dead_after_tokens, 1)
    if tokens_since_fired.ndim != 1 or tokens_since_fired.numel() == 0:
        raise ValueError(
            f"tokens_since_fired must be a non-empty 1-D tensor [d_sae], got shape {tuple(tokens_since_fired.shape)}"
        )
    return (tokens_since_fired >= dead_after_tokens).to(torch.float64).mean()


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
    codes = _as_rows(codes.detach(), d_sae, "codes")
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
