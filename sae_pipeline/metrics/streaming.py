"""The metrics a training run streams over its batches: R², activation statistics, L0 and dead atoms.

Design choices:

- The streaming metrics (``ReconstructionR2``, ``ActivationStats``) keep only float64 *sums*
  as torchmetrics states with ``dist_reduce_fx="sum"``. Sums are associative, so the value
  after a DDP all-reduce equals the value of one process that saw all the data (up to
  float64 rounding), whatever the world size or batch split.
- States have fixed shapes given at construction (``d_in``, ``d_sae``) rather than being sized
  on the first update: torchmetrics stacks the gathered states before summing, and a rank
  that saw no batch would otherwise hold a differently shaped state and break the sync.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

from feature_extraction.validate import check_int


def as_rows(tensor: Tensor, width: int, name: str) -> Tensor:
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
        x64 = as_rows(x.detach(), self.d_in, "x").to(torch.float64)
        x_hat64 = as_rows(x_hat.detach(), self.d_in, "x_hat").to(torch.float64)
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
        codes = as_rows(codes.detach(), self.d_sae, "codes")
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
