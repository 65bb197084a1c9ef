"""ReLU SAE: ``codes = relu((x - b_pre) @ W_enc + b_enc)`` with an L1 penalty.

The classic shallow SAE (Bricken et al. 2023; Cunningham et al. 2024), the soft-thresholding
baseline of the paper (Costa et al. 2025, §2): loss ``MSE + λ·Σ_i |codes_i|`` (summed over
latents, averaged over tokens). Since the atoms are unit-norm, ``|codes_i|`` equals
``|codes_i|·‖d_i‖``, the norm-aware form of Anthropic's later recipe.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from feature_extraction.validate import check_float, check_int
from sae_pipeline.sae.base import SAEOutput, ShallowSAE, keep_top_k
from sae_pipeline.sae.calibration import mean_over_ranks, per_latent_cut
from sae_pipeline.sae.sparse_decode import SparseCodes

# λ at k = 10, scaled as (10 / k)^L1_EXPONENT for other k, so that the measured L0 of a study run
# lands near k (ReLU has no k; it is the measured L0 that the study's figures plot and the claims
# compare at). Digits (configs/relu_digits.yaml, 2000 steps: λ = 0.01, 0.03, 0.1 gave L0 = 46, 13,
# 3.4, i.e. L0 ∝ λ^-1.14). Other data (shards) use the digits value; calibrate your own if the
# measured L0 is far from k.
L1_AT_K10 = {"digits": 0.038}
L1_EXPONENT = 0.88
# MNIST (784-d, same input normalisation E‖x‖² = d_in): L0 is far steeper in λ and not a power law
# (L0 ∝ λ^-1.4 near L0 40, λ^-3 near L0 5), so λ is read off measured points, interpolated in log λ
# against log k (extrapolated along the end segments). Measured on mnist_sample, p = 1000, 1000 steps
# of configs/relu_mnist.yaml's recipe, val L0: λ = 0.0044 → 35.0, 0.005 → 29.2, 0.0059 → 22.3,
# 0.0079 → 12.6, 0.0107 → 5.1, 0.012 → 3.8; the table is the λ for L0 = k.
L1_BY_K = {"mnist": ((5, 0.0107), (10, 0.0085), (20, 0.0062), (40, 0.0040))}
L1_TABLE_OF = {"mnist": "mnist", "mnist_sample": "mnist"}


def l1_from_table(table: tuple[tuple[int, float], ...], k: int) -> float:
    """λ at ``k`` by piecewise-linear interpolation of log λ in log k over ``table`` ((k, λ) by rising k)."""
    (k0, l0), (k1, l1) = next(((a, b) for a, b in zip(table, table[1:]) if k <= b[0]), table[-2:])
    slope = math.log(l1 / l0) / math.log(k1 / k0)
    return l0 * (k / k0) ** slope


class ReLUSAE(ShallowSAE):
    """ReLU SAE with an optionally warmed-up L1 coefficient.

    Args:
        d_in: input (token activation) dimension.
        d_sae: number of atoms.
        l1_coefficient: λ. The MSE here is a mean over elements (≈1 for unit-variance
            inputs at init) while the L1 term is summed over latents, so λ = 1e-3 prices
            100 unit-size active latents at 0.1, the same order as the MSE: a sensible start
            for a sweep, not a tuned value.
        l1_warmup_steps: λ grows linearly from 0 to its value over this many steps
            (``λ·min(1, step / l1_warmup_steps)``), which avoids killing latents before the
            decoder has found useful directions; 0 disables the warm-up.
        initial_l0: None (default): ``b_enc`` starts at 0, so every latent fires on about half of the
            tokens and the L1 penalty must push the biases down by Adam steps of about the learning
            rate, thousands of steps. A number: on the first training batch ``b_enc`` is set so that
            each latent fires on the share ``initial_l0 / d_sae`` of its tokens (mean L0 =
            ``initial_l0``, no latent starts dead; averaged over ranks), the data-dependent start that
            JumpReLU's θ has too; λ then decides where the L0 settles. On synthetic ViT-like tokens
            (d 64, p 512, bf16, ``configs/relu_dinov2.yaml``'s recipe, λ = 1e-2) 300 steps end at L0 197
            without it and 23.4 with ``initial_l0 = 32`` (R² −0.02 and 0.65), 3000 steps at 61.2 (still
            coming down from ~256) and 26.7 (``benchmarks/short_run_sparsity.py``). A loaded or resumed model
            (``b_enc`` not all 0) is kept as it is.
        dead_after_tokens: see :class:`SparseAutoencoder`.
    """

    key = "relu"
    label = "ReLU"
    sparsity_knob = "l1_coefficient"
    test_kwargs: dict[str, Any] = {}

    @classmethod
    def sparsity_init_args(cls, k: int, data: str = "digits") -> dict[str, Any]:
        """The L1 coefficient that makes the L0 roughly ``k`` on ``data`` (see ``L1_AT_K10`` and ``L1_BY_K``)."""
        return {"l1_coefficient": cls.l1_for_k(k, data)}

    @staticmethod
    def l1_for_k(k: int, data: str = "digits") -> float:
        """λ for a mean L0 of about ``k`` on ``data`` (a data source name; unknown ones get the digits value)."""
        if data in L1_TABLE_OF:
            return round(l1_from_table(L1_BY_K[L1_TABLE_OF[data]], k), 6)
        return round(L1_AT_K10.get(data, L1_AT_K10["digits"]) * (10 / k) ** L1_EXPONENT, 6)

    def __init__(
        self,
        d_in: int,
        d_sae: int,
        l1_coefficient: float = 1e-3,
        l1_warmup_steps: int = 0,
        dead_after_tokens: int = 10_000_000,
        initial_l0: float | None = None,
    ) -> None:
        super().__init__(d_in, d_sae, dead_after_tokens)
        self.l1_coefficient = check_float("l1_coefficient", l1_coefficient, 0.0)
        self.l1_warmup_steps = check_int("l1_warmup_steps", l1_warmup_steps, 0)
        self.initial_l0 = (
            None
            if initial_l0 is None
            else check_float("initial_l0", initial_l0, 0.0, float(d_sae), strict_minimum=True)
        )
        self._calibration_pending = self.initial_l0 is not None  # once per process, on the first training batch

    def pre_activations(self, x: Tensor) -> Tensor:
        """The encoder's ``pre``; on the first training batch with ``initial_l0``, after setting ``b_enc``."""
        pre = super().pre_activations(x)
        if self._calibration_pending and self.training:
            self._calibration_pending = False
            # shifted, not recomputed: under autocast a second addmm would read the cached bf16 copy of
            # b_enc from before the change
            pre = pre + self.calibrate_bias(pre).to(pre.dtype)
        return pre

    @torch.no_grad()
    def calibrate_bias(self, pre: Tensor) -> Tensor:
        """``b_enc −=`` each latent's cut for ``initial_l0`` on this batch, averaged over ranks, unless ``b_enc``
        was set already (a loaded or resumed model: the change is 0); returns the change ``[d_sae]``.
        Decided on the device (``torch.where``), so the first step does not wait for the GPU either."""
        assert self.initial_l0 is not None
        cut = mean_over_ranks(per_latent_cut(pre, self.initial_l0)).to(self.b_enc.dtype)
        shift = torch.where(self.b_enc.any(), torch.zeros_like(cut), -cut)
        self.b_enc.add_(shift)
        return shift

    def activate(self, pre: Tensor, k: int | None) -> Tensor:
        """``relu(pre)``; with ``k`` given, the ``k`` largest of those codes per token.

        A ReLU SAE has no sparsity knob of its own, so the inference-time sweep over ``k``
        can only shrink its support, never grow it (the paper's "plateau", §4).
        """
        codes = F.relu(pre)
        return codes if k is None else keep_top_k(codes, k)

    def select_support(self, pre: Tensor) -> SparseCodes | None:
        """``pre > 0``, when few enough are; the dense path where host reads are avoided."""
        if self.avoids_host_reads(pre):  # the support's size is the data's: dense, not a read of its size
            return None
        mask = pre > 0
        return SparseCodes.from_mask(mask) if self.fits_sparse(int(mask.sum()), pre.shape[0]) else None

    def sparse_activate(self, pre_values: Tensor, support: SparseCodes) -> Tensor:
        return F.relu(pre_values)

    def l1_scale(self, step: int) -> float:
        """``λ`` at ``step`` after the linear warm-up."""
        if self.l1_warmup_steps == 0:
            return self.l1_coefficient
        return self.l1_coefficient * min(1.0, max(step, 0) / self.l1_warmup_steps)

    def step_dependent(self, step: int) -> bool:
        """During the L1 warm-up λ changes every step; after it, never."""
        return step < self.l1_warmup_steps

    def sparsity_penalty(self, x: Tensor, output: SAEOutput, step: int) -> Tensor:
        """``λ(step) · mean_tokens Σ_latents |codes|``."""
        if output.sparse is not None:
            return self.l1_scale(step) * output.sparse.values.abs().sum() / output.x_hat.shape[0]
        return self.l1_scale(step) * output.codes.abs().sum(dim=-1).mean()

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, l1_coefficient={self.l1_coefficient}, l1_warmup_steps={self.l1_warmup_steps}, "
            f"initial_l0={self.initial_l0}"
        )
