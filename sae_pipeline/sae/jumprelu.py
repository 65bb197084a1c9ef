"""JumpReLU SAE (Rajamanoharan et al. 2024, "Jumping Ahead"): ``codes = pre · H(pre − θ)``.

The hard-thresholding baseline of the paper (Costa et al. 2025, §2). θ > 0 is learned per
latent as ``exp(log_threshold)``. ``H`` has zero derivative almost everywhere, so θ is trained
with the paper's straight-through estimator: the pseudo-derivative of ``H(z − θ)`` with
respect to θ is ``−(1/ε)·K((z − θ)/ε)``, ``K`` the rectangle kernel ``1{|u| < ½}`` of
bandwidth ε (their Eq. 11–12); no pseudo-gradient flows to ``z`` through ``H``.

Three options, off by default so the definitions stay the paper's: ``l0_gradient_to_encoder`` (the L0
penalty's pseudo-gradient also reaches ``z``, so the encoder learns the sparsity: the MNIST configs
need it to reach their target L0 within ~1000 steps), ``token_scaled_threshold`` (θ compared with
``z / s(x)``, the token's own scale, for ViT register/CLS tokens) and ``threshold_lr_scale`` (θ learns
at a multiple of the learning rate, so it keeps pace with the encoder); the backbone configs set the
last two.

Precision: the decisions ``pre > θ`` and ``|pre − θ| < ε/2`` are the float32 encoder's under bf16 autocast
too. On a GPU the encoder GEMM runs in bf16 and only the pre-activations that its rounding could carry
across θ or θ ± ε/2 are recomputed in float32 (`jumprelu_bf16.py`); elsewhere the encoder runs in float32.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from feature_extraction.validate import check_float
from sae_pipeline.sae.base import SAEOutput, ShallowSAE, keep_top_k
from sae_pipeline.sae.calibration import mean_over_ranks, pooled_cut
from sae_pipeline.sae.jumprelu_bf16 import bf16_pre_activations, kernel_available
from sae_pipeline.sae.sparse_decode import SparseCodes, sparse_encode
from sae_pipeline.sae.token_scale import token_scale

DEFAULT_BANDWIDTH = 0.05  # ε for O(1) pre-activations (inputs normalised to E‖x‖² = d_in), see JumpReLUSAE
UNCALIBRATED_THRESHOLD = 0.1  # θ₀ before calibration, and θ₀ without a target L0
MIN_CALIBRATED_THRESHOLD = 1e-3  # θ stays positive when a quantile is <= 0 (a target L0 above half of d_sae)


def at_least_float32(t: Tensor) -> Tensor:
    """``t`` in float32 when it is a lower precision (bf16/fp16), else unchanged (float64 stays)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def rectangle(u: Tensor) -> Tensor:
    """Rectangle kernel ``K(u) = 1{-½ < u < ½}`` in ``u``'s dtype."""
    return ((u > -0.5) & (u < 0.5)).to(u.dtype)


class JumpReLUFunction(torch.autograd.Function):
    """``pre · H(pre − θ)``; d/dpre = ``H(pre − θ)``, d/dθ = ``−(θ/ε)·K((pre − θ)/ε)``."""

    @staticmethod
    def forward(ctx: Any, pre: Tensor, threshold: Tensor, bandwidth: float | Tensor) -> Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return pre * (at_least_float32(pre) > at_least_float32(threshold)).to(pre.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor, None]:
        pre, threshold = ctx.saved_tensors
        bandwidth = ctx.bandwidth
        pre32, threshold32 = at_least_float32(pre), at_least_float32(threshold)  # ε is finer than bf16's spacing
        grad_pre = grad_out * (pre32 > threshold32).to(grad_out.dtype)
        kernel = rectangle((pre32 - threshold32) / bandwidth)
        grad_threshold = (-(threshold32 / bandwidth) * kernel * at_least_float32(grad_out)).sum_to_size(threshold.shape)
        return grad_pre, grad_threshold.to(threshold.dtype), None


class StepFunction(torch.autograd.Function):
    """``H(pre − θ)``; d/dθ = ``−(1/ε)·K((pre − θ)/ε)`` (used for the L0 penalty); d/dpre = 0 (the
    JumpReLU paper), or with ``to_pre`` its mirror image ``+(1/ε)·K((pre − θ)/ε)`` (Anthropic's 2025 recipe)."""

    @staticmethod
    def forward(ctx: Any, pre: Tensor, threshold: Tensor, bandwidth: float | Tensor, to_pre: bool = False) -> Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth, ctx.to_pre = bandwidth, to_pre
        return (at_least_float32(pre) > at_least_float32(threshold)).to(pre.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor, None, None]:
        pre, threshold = ctx.saved_tensors
        bandwidth = ctx.bandwidth
        kernel = rectangle((at_least_float32(pre) - at_least_float32(threshold)) / bandwidth)
        grad_step = (1.0 / bandwidth) * kernel * at_least_float32(grad_out)
        grad_pre = grad_step.to(pre.dtype) if ctx.to_pre else torch.zeros_like(pre)
        return grad_pre, (-grad_step).sum_to_size(threshold.shape).to(threshold.dtype), None, None


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
        bandwidth: ε of the rectangle kernel. The JumpReLU paper's 1e-3 assumes pre-activations
            far smaller than ours: with inputs normalised to E‖x‖² = d_in (SAEModule's default)
            and unit-norm encoder columns at init they are O(1), so the default 0.05 is a few
            percent of their scale and still 12x bf16's spacing near 1 (0.004).
        initial_threshold: θ at init. None (default): with ``target_l0``, θ is set on the first
            training batch to the pre-activation quantile that makes the mean L0 equal
            ``target_l0`` (one value for all latents, averaged over ranks), because log θ moves
            by about the learning rate per step, so a far-off θ₀ (the JumpReLU paper's 1e-3)
            needs ~10⁴ steps to reach O(1); without a target, θ₀ = 0.1. A number: that θ₀.
        l0_gradient_to_encoder: the L0 penalty's straight-through gradient also reaches the
            pre-activations (``∂H(pre − θ)/∂pre := (1/ε)·K``, mirror of θ's), so the encoder, which every
            token trains, learns the sparsity too (Anthropic, "Circuits Updates", January 2025; SAELens
            6.11). False (default): θ alone, as in the JumpReLU paper, which moves log θ by at most ~lr per
            step and only on steps where a latent has an entry within ε/2 of θ; on 5000 MNIST digits
            (p = 1000, target 10, 1000 steps) the encoder outgrew it and L0 settled at 15.
        threshold_lr_scale: log θ trains at this multiple of the learning rate. Adam moves log θ by about
            the learning rate per step, while the encoder's weights (O(1/√d_in) each) move by about
            ``lr·√d_in`` relative: with 1 (default, the JumpReLU paper's recipe) the encoder outruns θ
            and the L0 drifts away from ``target_l0`` (0.41 of it still after 3000 steps). On synthetic
            ViT-like tokens (d 64, p 512, target 32, bf16, 300 steps of ``configs/jumprelu_dinov2.yaml``'s
            recipe) 1, 10, 30, 100 gave val L0 10.4, 17.0, 27.0, 32.5 (R² 0.63, 0.67, 0.75, 0.84); after
            3000 steps 30, 100, 300 all hold L0 33 (R² 0.92-0.93). The backbone configs set 100.
        token_scaled_threshold: compare ``pre / s(x)`` with θ, ``s(x) = ‖x − b_pre‖ / √d_in``, i.e.
            ``codes = pre · H(pre − θ·s(x))`` (kernel width ε·s(x) likewise), so that tokens of very
            different norms (ViT register/CLS tokens) get comparable supports; see
            :mod:`sae_pipeline.sae.token_scale`. False (default): the paper's per-latent θ.
        dead_after_tokens: see :class:`SparseAutoencoder`.
    """

    key = "jumprelu"
    label = "JumpReLU"
    sparsity_knob = "target_l0"  # with sparsity_loss: target_l0 in its configs
    test_kwargs = {"initial_threshold": 0.05}
    #: Whether the encoder GEMM runs in bf16 under bf16 autocast, the band of pre-activations that its rounding
    #: could carry across θ or θ ± ε/2 recomputed in float32 (:mod:`sae_pipeline.sae.jumprelu_bf16`). None: on
    #: CUDA with Triton (elsewhere the float32 encoder, as before); True: on every device (the tests run it on the
    #: CPU); False: never. Not a constructor argument: it changes the cost, not the firing set.
    bf16_encoder: bool | None = None

    def __init__(
        self,
        d_in: int,
        d_sae: int,
        sparsity_coefficient: float = 1e-3,
        sparsity_loss: Literal["l0", "target_l0"] = "l0",
        target_l0: float | None = None,
        bandwidth: float = DEFAULT_BANDWIDTH,
        initial_threshold: float | None = None,
        dead_after_tokens: int = 10_000_000,
        l0_gradient_to_encoder: bool = False,
        token_scaled_threshold: bool = False,
        threshold_lr_scale: float = 1.0,
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
        self.initial_threshold = (
            None
            if initial_threshold is None
            else check_float("initial_threshold", initial_threshold, 0.0, strict_minimum=True)
        )
        for name, flag in (
            ("l0_gradient_to_encoder", l0_gradient_to_encoder),
            ("token_scaled_threshold", token_scaled_threshold),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be true or false, got {flag!r}")
        self.threshold_lr_scale = check_float("threshold_lr_scale", threshold_lr_scale, 0.0, strict_minimum=True)
        self.l0_gradient_to_encoder = l0_gradient_to_encoder
        self.token_scaled_threshold = token_scaled_threshold
        self._token_scale: Tensor | None = None  # s(x) of the batch pre_activations saw last, [B, 1]
        start = UNCALIBRATED_THRESHOLD if self.initial_threshold is None else self.initial_threshold
        self.log_threshold = nn.Parameter(torch.full((d_sae,), math.log(start)))
        # Calibrate on the first training batch only if θ is still at its placeholder then (a resumed
        # or loaded model is not); decided on the device, once per process.
        self._calibration_pending = self.initial_threshold is None and self.target_l0 is not None

    @property
    def threshold(self) -> Tensor:
        """θ ``[d_sae]``, positive by construction."""
        return self.log_threshold.exp()

    def lr_scales(self) -> dict[str, float]:
        return {"log_threshold": self.threshold_lr_scale}

    @torch.no_grad()
    def fold_input_scale(self, scale: float) -> None:
        """Biases and θ divided by ``scale`` (``log θ`` shifted by ``−log scale``); a token-scaled θ is
        unitless (``pre`` and ``s(x)`` scale alike) and stays."""
        super().fold_input_scale(scale)
        if not self.token_scaled_threshold:
            self.log_threshold.sub_(math.log(scale))

    def pre_activations(self, x: Tensor) -> Tensor:
        """``(x - b_pre) @ W_enc + b_enc`` as float32, with the float32 encoder's threshold decisions under bf16
        autocast too. The decisions ``pre > θ`` (the firing set) and ``|pre − θ| < ε/2`` (θ's straight-through
        gradient) are sensitive to rounding: a bf16 GEMM moves ``pre`` by up to ~2⁻⁸·‖x − b_pre‖·‖W_enc[:, j]‖
        (~0.1 at d_in 768 for normalised inputs), more than ε/2 and than the margin of the entries next to θ,
        so bf16 pre-activations would flip the firing set and make θ's gradient rounding noise.

        Under bf16 autocast with :attr:`bf16_encoder` (CUDA with Triton by default) the GEMM runs in bf16 and
        only the entries within ε/2 + a rounding bound of θ are recomputed in float32
        (:mod:`sae_pipeline.sae.jumprelu_bf16`); otherwise, and on the first training batch when θ is
        calibrated from it, the whole encoder runs in float32 (autocast off here)."""
        # activate / select_support / sparse_activate of this forward (or encode) read it
        self._token_scale = token_scale(x, self.b_pre) if self.token_scaled_threshold else None
        bf16 = self.uses_bf16_encoder(x)  # reads the autocast state, so before it is switched off
        with torch.autocast(device_type=x.device.type, enabled=False):
            if bf16:
                half = self.bandwidth / 2
                a = at_least_float32(x) - self.b_pre
                pre = bf16_pre_activations(a, self.W_enc, self.b_enc, self.threshold, self._token_scale, half)
            else:
                pre = super().pre_activations(at_least_float32(x))
        if self._token_scale is not None:
            self._token_scale = self._token_scale.to(pre.dtype)
        if self._calibration_pending and self.training:
            self._calibration_pending = False
            self.calibrate_threshold(pre if self._token_scale is None else pre / self._token_scale)
        return pre

    def uses_bf16_encoder(self, x: Tensor) -> bool:
        """Whether :meth:`pre_activations` runs the bf16 encoder on ``x`` (see :attr:`bf16_encoder`): under bf16
        autocast, for float32/16 input, not on the batch that calibrates θ (its quantile is read in float32)."""
        device = x.device.type
        if self.bf16_encoder is False or x.dtype == torch.float64 or not torch.is_autocast_enabled(device):
            return False
        if torch.get_autocast_dtype(device) != torch.bfloat16 or (self._calibration_pending and self.training):
            return False
        return self.bf16_encoder is True or (x.is_cuda and kernel_available())

    def gate(self, rows: Tensor | None = None, latents: Tensor | None = None) -> tuple[Tensor, float | Tensor]:
        """θ and ε as compared with ``pre``: ``θ [d_sae]`` and ε, or with a token-scaled threshold
        ``θ·s [B, d_sae]`` and ``ε·s [B, 1]``; for the sparse entries at (``rows``, ``latents``), ``[nnz]``."""
        threshold = self.threshold if latents is None else self.threshold[latents]
        scale = self._token_scale
        if scale is None:
            return threshold, self.bandwidth
        if rows is not None:
            scale = scale[rows, 0]
        return threshold * scale, self.bandwidth * scale

    @torch.no_grad()
    def calibrate_threshold(self, pre: Tensor) -> None:
        """θ = the ``1 − target_l0/d_sae`` quantile of ``pre`` (all latents pooled; ``pre / s(x)`` with a
        token-scaled threshold), averaged over ranks, if θ is still at its placeholder (else unchanged);
        decided on the device (``torch.where``), so the first step does not wait for the GPU either."""
        assert self.target_l0 is not None
        value = mean_over_ranks(pooled_cut(pre, self.target_l0))
        calibrated = value.double().clamp_min(MIN_CALIBRATED_THRESHOLD).log().to(self.log_threshold.dtype)
        placeholder = (self.log_threshold == math.log(UNCALIBRATED_THRESHOLD)).all()
        self.log_threshold.copy_(torch.where(placeholder, calibrated, self.log_threshold))

    def activate(self, pre: Tensor, k: int | None) -> Tensor:
        """``pre · H(pre − θ)``; with ``k`` given, the ``k`` largest of those codes per token
        (JumpReLU can only shrink its support at inference, like ReLU)."""
        codes = JumpReLUFunction.apply(pre, *self.gate())
        return codes if k is None else keep_top_k(codes, k)

    def select_support(self, pre: Tensor) -> SparseCodes | None:
        """The active latents and those within ε/2 below θ (``(pre − θ)/ε > −½``): the rectangle
        kernel gives the latter a straight-through θ gradient although their code is 0."""
        if self.avoids_host_reads(pre):  # the support's size is the data's: dense, not a read of its size
            return None
        threshold, bandwidth = self.gate()
        mask = (pre - threshold.detach()).div_(bandwidth) > -0.5
        return SparseCodes.from_mask(mask) if self.fits_sparse(int(mask.sum()), pre.shape[0]) else None

    def sparse_activate(self, pre_values: Tensor, support: SparseCodes) -> Tensor:
        return JumpReLUFunction.apply(pre_values, *self.gate(support.rows, support.indices))

    def l0(self, pre: Tensor) -> Tensor:
        """Mean number of active latents per token, differentiable in θ through the STE."""
        return StepFunction.apply(pre, *self.gate(), self.l0_gradient_to_encoder).sum(dim=-1).mean()

    def sparsity_penalty(self, x: Tensor, output: SAEOutput, step: int) -> Tensor:
        """``λ·L0`` or ``λ·(L0/target_l0 − 1)²`` (L0 averaged over the batch first)."""
        if output.pre_acts is None:
            raise ValueError("output.pre_acts is None; pass the SAEOutput of this JumpReLUSAE's forward")
        if self.token_scaled_threshold:  # s(x) of this x, whatever ran since its forward
            self._token_scale = token_scale(x, self.b_pre).to(output.pre_acts.dtype)
        if output.sparse is not None:  # every entry with a nonzero step or kernel is in the support
            support = output.sparse
            pre_values = (
                sparse_encode(x, self.b_pre, self.W_enc, self.b_enc, output.pre_acts, support)
                if self.l0_gradient_to_encoder
                else support.gather(output.pre_acts)
            )  # pre_acts is detached
            steps = StepFunction.apply(
                pre_values, *self.gate(support.rows, support.indices), self.l0_gradient_to_encoder
            )
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
            f"sparsity_loss={self.sparsity_loss!r}, target_l0={self.target_l0}, bandwidth={self.bandwidth}, "
            f"l0_gradient_to_encoder={self.l0_gradient_to_encoder}, "
            f"token_scaled_threshold={self.token_scaled_threshold}, "
            f"threshold_lr_scale={self.threshold_lr_scale}"
        )
