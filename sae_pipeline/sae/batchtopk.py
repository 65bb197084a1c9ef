"""BatchTopK SAE (Bussmann et al. 2024): top ``B·k`` activations over the whole batch.

Training keeps the ``B·k`` largest entries of ``relu(pre)`` across all tokens of the batch,
so the mean L0 is k while each token may use more or fewer latents. Inference cannot depend
on the batch, so a scalar threshold θ is learned alongside: an exponential moving average of
the smallest activation kept per training batch (averaged over DDP ranks), and at inference
``codes = relu(pre) · (relu(pre) > θ)``. AuxK is inherited from :class:`TopKSAE`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from sae_pipeline.sae.base import SAEOutput, check_float, keep_top_k
from sae_pipeline.sae.sparse_decode import SparseCodes
from sae_pipeline.sae.topk import TopKSAE


class BatchTopKSAE(TopKSAE):
    """BatchTopK SAE with a running inference threshold.

    Args:
        d_in, d_sae, k, k_aux, aux_coefficient, dead_after_tokens: as :class:`TopKSAE`.
        threshold_momentum: EMA momentum of θ in [0, 1); 0.99 averages over ~100 batches,
            long enough to smooth batch noise, short enough to follow the trained encoder.
            The first update sets θ to that batch's value (no bias towards the 0 init).
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
    ) -> None:
        super().__init__(d_in, d_sae, k, k_aux, aux_coefficient, dead_after_tokens)
        self.threshold_momentum = check_float("threshold_momentum", threshold_momentum, 0.0, 1.0, strict_maximum=True)
        self.register_buffer("threshold", torch.zeros(()))
        self.register_buffer("n_threshold_updates", torch.zeros((), dtype=torch.int64))

    def activate(self, pre: Tensor, k: int | None) -> Tensor:
        """Per-token top ``k`` when ``k`` is given; else batch top ``B·k`` (train) or θ (eval)."""
        acts = F.relu(pre)
        if k is not None:
            return keep_top_k(acts, k)
        if self.training:
            return self.batch_top_k(acts)
        return acts * (acts > self.threshold).to(acts.dtype)

    def batch_top_k(self, acts: Tensor) -> Tensor:
        """Keep the ``B·k`` largest entries of ``acts [B, d_sae]`` over the whole batch."""
        flat = acts.flatten()
        n_keep = min(acts.shape[0] * self.k, flat.numel())
        values, indices = flat.topk(n_keep, sorted=False)
        return torch.zeros_like(flat).scatter(0, indices, values).view_as(acts)

    def select_support(self, pre: Tensor) -> SparseCodes | None:
        """Training: the batch top ``B·k`` of ``pre``; inference: ``pre > max(θ, 0)``."""
        batch = pre.shape[0]
        if self.training:
            n_keep = min(batch * self.k, pre.numel())
            if not self.fits_sparse(n_keep, batch):
                return None
            return SparseCodes.from_flat(pre.flatten().topk(n_keep, sorted=False).indices, batch, self.d_sae)
        mask = (pre > self.threshold) & (pre > 0)
        if not self.fits_sparse(int(mask.sum()), batch):
            return None
        return SparseCodes.from_mask(mask)

    def forward(self, x: Tensor) -> SAEOutput:
        """As the shallow forward; in training mode also updates θ from this batch."""
        output = super().forward(x)
        if self.training:
            self.update_threshold(output.sparse.values if output.sparse is not None else output.codes)
        return output

    @torch.no_grad()
    def fold_input_scale(self, scale: float) -> None:
        """Biases and the inference threshold θ divided by ``scale``."""
        super().fold_input_scale(scale)
        self.threshold.div_(scale)

    @torch.no_grad()
    def update_threshold(self, codes: Tensor) -> None:
        """EMA of the smallest positive kept activation, averaged over DDP ranks (``codes``: dense, or
        the values of the sparse codes).

        No host sync: a batch with no positive activation (min = +inf) leaves θ unchanged.
        """
        positive = torch.where(codes.detach() > 0, codes.detach(), float("inf"))
        batch_min = (positive.amin() if positive.numel() else positive.new_full((), float("inf"))).to(self.threshold.dtype)
        valid = torch.isfinite(batch_min)
        batch_min = torch.where(valid, batch_min, self.threshold)
        if dist.is_available() and dist.is_initialized():
            # Every rank runs forward each step under DDP, so this collective cannot hang.
            dist.all_reduce(batch_min, op=dist.ReduceOp.SUM)
            batch_min /= dist.get_world_size()
        m = self.threshold_momentum
        ema = m * self.threshold + (1.0 - m) * batch_min
        first = self.n_threshold_updates == 0
        self.threshold.copy_(torch.where(first, batch_min, ema))
        self.n_threshold_updates.add_(valid.to(torch.int64))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, threshold_momentum={self.threshold_momentum}"
