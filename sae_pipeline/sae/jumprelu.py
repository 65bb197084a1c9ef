"""JumpReLU SAE (Rajamanoharan et al. 2024, "Jumping Ahead"): ``codes = pre · H(pre − θ)``.

The hard-thresholding baseline of the paper (Costa et al. 2025, §2). θ > 0 is learned per
latent as ``exp(log_threshold)``. ``H`` has zero derivative almost everywhere, so θ is trained
with the paper's straight-through estimator: the pseudo-derivative of ``H(z − θ)`` with
respect to θ is ``−(1/ε)·K((z − θ)/ε)``, ``K`` the rectangle kernel ``1{|u| < ½}`` of
bandwidth ε (their Eq. 11–12); no pseudo-gradient flows to ``z`` through ``H``.
"""
from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from sae_pipeline.sae.base import SAEOutput, ShallowSAE, check_float, keep_top_k
from sae_pipeline.sae.sparse_decode import SparseCodes


def rectangle(u: Tensor) -> Tensor:
    """Rectangle kernel ``K(u) = 1{-½ < u < ½}`` in ``u``'s dtype."""
    return ((u > -0.5) & (u < 0.5)).to(u.dtype)


class JumpReLUFunction(torch.autograd.Function):
    """``pre · H(pre − θ)``; d/dpre = ``H(pre − θ)``, d/dθ = ``−(θ/ε)·K((pre − θ)/ε)``."""

    @staticmethod
    def forward(ctx: Any, pre: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return pre * (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor, None]:
        pre, threshold = ctx.saved_tensors
        bandwidth = ctx.bandwidth
        grad_pre = grad_out * (pre > threshold).to(pre.dtype)
        kernel = rectangle((pre - threshold) / bandwidth)
        grad_threshold = (-(threshold / bandwidth) * kernel * grad_out).sum_to_size(threshold.shape)
        return grad_pre, grad_threshold, None


class StepFunction(torch.autograd.Function):
    """``H(pre − θ)``; d/dpre = 0, d/dθ = ``−(1/ε)·K((pre − θ)/ε)`` (used for the L0 penalty)."""

    @staticmethod
    def forward(ctx: Any, pre: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor, None]:
        pre, threshold = ctx.saved_tensors
        bandwidth = ctx.bandwidth
        kernel = rectangle((pre - threshold) / bandwidth)
        grad_threshold = (-(1.0 / bandwidth) * kernel * grad_out).sum_to_size(threshold.shape)
        return torch.zeros_like(pre), grad_threshold, None


class JumpReLUSAE(ShallowSAE):
    """JumpReLU SAE with an L0 or target-L0 sparsity penalty.

    Args:
        d_in: input dimension.
        d_sae: number of atoms.
        sparsity_coefficient: λ. With ``"l0"`` the penalty is ``λ·L0`` (L0 = mean active
            latents per token); against a per-element-mean MSE, λ = 1e-3 prices 100 active
            latents at 0.1. With ``"target_l0"`` the penalty ``λ·(L0/target_l0 − 1)²`` is
            dimensionless, so pick λ near 1 there.
        sparsity_loss: ``"l0"`` (Rajamanoharan et al. 2024) or ``"target_l0"`` (pins L0 near
            ``target_l0``, which makes runs comparable at equal sparsity k, as the paper does).
        target_l0: the target mean L0; required for ``"target_l0"``, in (0, d_sae].
        bandwidth: ε of the rectangle kernel; 1e-3 as in the JumpReLU paper (for inputs of
            unit scale per dimension).
        initial_threshold: θ at init; 1e-3 as in the JumpReLU paper, so training starts
            close to a ReLU SAE.
        dead_after_tokens: see :class:`SparseAutoencoder`.
    """

    def __init__(
        self,
        d_in: int,
        d_sae: int,
        sparsity_coefficient: float = 1e-3,
        sparsity_loss: Literal["l0", "target_l0"] = "l0",
        target_l0: float | None = None,
        bandwidth: float = 1e-3,
        initial_threshold: float = 1e-3,
        dead_after_tokens: int = 10_000_000,
    ) -> None:
        super().__init__(d_in, d_sae, dead_after_tokens)
        self.sparsity_coefficient = check_float("sparsity_coefficient", sparsity_coefficient, 0.0)
        if sparsity_loss not in ("l0", "target_l0"):
            raise ValueError(f"sparsity_loss must be 'l0' or 'target_l0', got {sparsity_loss!r}")
        self.sparsity_loss = sparsity_loss
        if sparsity_loss == "target_l0" and target_l0 is None:
            raise ValueError("target_l0 is required with sparsity_loss='target_l0' (mean active latents per token)")
        self.target_l0 = (
            None if target_l0 is None else check_float("target_l0", target_l0, 0.0, float(d_sae), strict_minimum=True)
        )
        self.bandwidth = check_float("bandwidth", bandwidth, 0.0, strict_minimum=True)
        self.initial_threshold = check_float("initial_threshold", initial_threshold, 0.0, strict_minimum=True)
        self.log_threshold = nn.Parameter(torch.full((d_sae,), math.log(self.initial_threshold)))

    @property
    def threshold(self) -> Tensor:
        """θ ``[d_sae]``, positive by construction."""
        return self.log_threshold.exp()

    @torch.no_grad()
    def fold_input_scale(self, scale: float) -> None:
        """Biases and θ divided by ``scale`` (``log θ`` shifted by ``−log scale``)."""
        super().fold_input_scale(scale)
        self.log_threshold.sub_(math.log(scale))

    def activate(self, pre: Tensor, k: int | None) -> Tensor:
        """``pre · H(pre − θ)``; with ``k`` given, the ``k`` largest of those codes per token
        (JumpReLU can only shrink its support at inference, like ReLU)."""
        codes = JumpReLUFunction.apply(pre, self.threshold, self.bandwidth)
        return codes if k is None else keep_top_k(codes, k)

    def select_support(self, pre: Tensor) -> SparseCodes | None:
        """The active latents and those within ε/2 below θ (``(pre − θ)/ε > −½``): the rectangle
        kernel gives the latter a straight-through θ gradient although their code is 0."""
        mask = (pre - self.threshold.detach()).div_(self.bandwidth) > -0.5
        return SparseCodes.from_mask(mask) if self.fits_sparse(int(mask.sum()), pre.shape[0]) else None

    def sparse_activate(self, pre_values: Tensor, support: SparseCodes) -> Tensor:
        return JumpReLUFunction.apply(pre_values, self.threshold[support.indices], self.bandwidth)

    def l0(self, pre: Tensor) -> Tensor:
        """Mean number of active latents per token, differentiable in θ through the STE."""
        return StepFunction.apply(pre, self.threshold, self.bandwidth).sum(dim=-1).mean()

    def sparsity_penalty(self, x: Tensor, output: SAEOutput, step: int) -> Tensor:
        """``λ·L0`` or ``λ·(L0/target_l0 − 1)²`` (L0 averaged over the batch first)."""
        if output.pre_acts is None:
            raise ValueError("output.pre_acts is None; pass the SAEOutput of this JumpReLUSAE's forward")
        if output.sparse is not None:  # every entry with a nonzero step or kernel is in the support
            support = output.sparse
            steps = StepFunction.apply(support.gather(output.pre_acts),
                                       self.threshold[support.indices], self.bandwidth)
            l0 = steps.sum() / output.x_hat.shape[0]
        else:
            l0 = self.l0(output.pre_acts)
        if self.sparsity_loss == "l0":
            return self.sparsity_coefficient * l0
        assert self.target_l0 is not None
        return self.sparsity_coefficient * (l0 / self.target_l0 - 1.0) ** 2

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, sparsity_coefficient={self.sparsity_coefficient}, "
            f"sparsity_loss={self.sparsity_loss!r}, target_l0={self.target_l0}, bandwidth={self.bandwidth}"
        )
