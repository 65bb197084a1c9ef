"""BatchTopK SAE (Bussmann et al. 2024): top ``B·k`` activations over the whole batch.

Training keeps the ``B·k`` largest entries of ``relu(pre)`` across all tokens of the batch,
so the mean L0 is k while each token may use more or fewer latents. Inference cannot depend
on the batch, so a scalar threshold θ is learned alongside: an exponential moving average of
the smallest activation kept per training batch (averaged over DDP ranks), and at inference
``codes = relu(pre) · (relu(pre) > θ)``. AuxK is inherited from :class:`TopKSAE`.

With ``token_scaled_threshold=True`` the batch ranking and θ use ``relu(pre) / s(x)``,
``s(x) = ‖x − b_pre‖ / √d_in``, so that the few tokens of a massive norm (ViT register/CLS
tokens) do not take most of the batch's ``B·k`` slots (:mod:`sae_pipeline.sae.token_scale`);
the codes kept are still ``relu(pre)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from feature_extraction.validate import check_float
from sae_pipeline.sae.base import SAEOutput, keep_top_k
from sae_pipeline.sae.calibration import mean_over_ranks
from sae_pipeline.sae.inference_codes import from_support
from sae_pipeline.sae.sparse_decode import SparseCodes
from sae_pipeline.sae.token_scale import token_scale
from sae_pipeline.sae.topk import TopKSAE
from sae_pipeline.sae.topk_select import batch_top_indices


class BatchTopKSAE(TopKSAE):
    """BatchTopK SAE with a running inference threshold.

    Args:
        d_in, d_sae, k, k_aux, aux_coefficient, dead_after_tokens: as :class:`TopKSAE`.
        threshold_momentum: EMA momentum of θ in [0, 1); 0.99 averages over ~100 batches,
            long enough to smooth batch noise, short enough to follow the trained encoder.
            The first update sets θ to that batch's value (no bias towards the 0 init).
        token_scaled_threshold: rank entries and compare with θ as ``relu(pre) / s(x)`` (see the
            module docstring); θ is then unitless. False (default): Bussmann et al.'s ranking.
    """

    key = "batchtopk"
    label = "BatchTopK"
    test_kwargs = {"k": 4}

    def __init__(
        self,
        d_in: int,
        d_sae: int,
        k: int,
        k_aux: int | None = None,
        aux_coefficient: float = 1 / 32,
        threshold_momentum: float = 0.99,
        dead_after_tokens: int = 10_000_000,
        token_scaled_threshold: bool = False,
    ) -> None:
        super().__init__(d_in, d_sae, k, k_aux, aux_coefficient, dead_after_tokens)
        self.threshold_momentum = check_float("threshold_momentum", threshold_momentum, 0.0, 1.0, strict_maximum=True)
        if not isinstance(token_scaled_threshold, bool):
            raise ValueError(f"token_scaled_threshold must be true or false, got {token_scaled_threshold!r}")
        self.token_scaled_threshold = token_scaled_threshold
        self._token_scale: Tensor | None = None  # s(x) of the batch pre_activations saw last, [B, 1]
        self.register_buffer("threshold", torch.zeros(()))
        self.register_buffer("n_threshold_updates", torch.zeros((), dtype=torch.int64))

    def pre_activations(self, x: Tensor) -> Tensor:
        """As :class:`ShallowSAE`; with a token-scaled threshold also keeps ``s(x)`` for this forward."""
        pre = super().pre_activations(x)
        self._token_scale = token_scale(x, self.b_pre) if self.token_scaled_threshold else None
        return pre

    def ranked(self, pre: Tensor) -> Tensor:
        """What the batch ranking and θ see: ``pre``, or ``pre / s(x)`` with a token-scaled threshold."""
        return pre if self._token_scale is None else pre / self._token_scale.to(pre.dtype)

    def activate(self, pre: Tensor, k: int | None) -> Tensor:
        """Per-token top ``k`` when ``k`` is given; else batch top ``B·k`` (train) or θ (eval)."""
        acts = F.relu(pre)
        if k is not None:
            return keep_top_k(acts, k)
        if self.training:
            return self.batch_top_k(acts)
        return acts * (self.ranked(acts) > self.threshold).to(acts.dtype)

    def batch_top_k(self, acts: Tensor) -> Tensor:
        """Keep the ``B·k`` largest entries of ``acts [B, d_sae]`` (of ``acts / s(x)`` with a token-scaled
        threshold) over the whole batch (`topk_select.batch_top_indices`, as `select_support`)."""
        flat = acts.flatten()
        n_keep = min(acts.shape[0] * self.k, flat.numel())
        indices = batch_top_indices(self.ranked(acts.detach()), n_keep)
        return torch.zeros_like(flat).scatter(0, indices, flat[indices]).view_as(acts)

    def select_support(self, pre: Tensor) -> SparseCodes | None:
        """Training: the batch top ``B·k`` of ``pre`` (or ``pre / s(x)``), by `topk_select.batch_top_indices` (on a
        GPU the selection kernel, ties at the threshold to the lowest flat index, as CUDA's `topk`; the indices
        come ascending, so `from_flat` does not sort them); inference: ``pre > max(θ, 0)`` (``pre / s(x) > θ``)."""
        batch = pre.shape[0]
        if self.training:
            n_keep = min(batch * self.k, pre.numel())
            if not self.fits_sparse(n_keep, batch):
                return None
            indices = batch_top_indices(self.ranked(pre), n_keep)
            return SparseCodes.from_flat(indices, batch, self.d_sae, is_sorted=True)
        mask = (self.ranked(pre) > self.threshold) & (pre > 0)
        if not self.fits_sparse(int(mask.sum()), batch):
            return None
        return SparseCodes.from_mask(mask)

    def inference_entries(self, pre: Tensor) -> SparseCodes | None:
        """Eval mode: the entries of ``relu(pre)`` above θ, `activate`'s mask without its product; training
        mode (a batch top-k): None, the dense codes."""
        if self.training:
            return None
        acts = F.relu(pre, inplace=True)
        return from_support(self.ranked(acts) > self.threshold, acts)

    def forward(self, x: Tensor) -> SAEOutput:
        """As the shallow forward; in training mode also updates θ from this batch."""
        output = super().forward(x)
        if self.training:
            if output.sparse is None:
                codes = self.ranked(output.codes)
            else:
                values = output.sparse.values
                codes = (
                    values
                    if self._token_scale is None
                    else values / self._token_scale[output.sparse.rows, 0].to(values.dtype)
                )
            self.update_threshold(codes)
        return output

    @torch.no_grad()
    def fold_input_scale(self, scale: float) -> None:
        """Biases and the inference threshold θ divided by ``scale`` (a token-scaled θ is unitless and stays)."""
        super().fold_input_scale(scale)
        if not self.token_scaled_threshold:
            self.threshold.div_(scale)

    @torch.no_grad()
    def update_threshold(self, codes: Tensor) -> None:
        """EMA of the smallest positive kept activation, averaged over DDP ranks (``codes``: dense, or
        the values of the sparse codes; divided by ``s(x)`` with a token-scaled threshold).

        No host sync: a batch with no positive activation (min = +inf) leaves θ unchanged.
        """
        positive = torch.where(codes.detach() > 0, codes.detach(), float("inf"))
        batch_min = (positive.amin() if positive.numel() else positive.new_full((), float("inf"))).to(
            self.threshold.dtype
        )
        valid = torch.isfinite(batch_min)
        batch_min = torch.where(valid, batch_min, self.threshold)
        mean_over_ranks(batch_min)  # every rank runs forward each step under DDP, so this collective cannot hang
        m = self.threshold_momentum
        ema = m * self.threshold + (1.0 - m) * batch_min
        first = self.n_threshold_updates == 0
        self.threshold.copy_(torch.where(first, batch_min, ema))
        self.n_threshold_updates.add_(valid.to(torch.int64))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, threshold_momentum={self.threshold_momentum}, "
            f"token_scaled_threshold={self.token_scaled_threshold}"
        )
