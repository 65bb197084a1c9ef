"""TopK SAE (Gao et al. 2024, "Scaling and evaluating sparse autoencoders").

``codes`` keeps the ``k`` largest entries of ``relu(pre)`` per token, so sparsity is fixed by
construction and the loss needs no penalty. Dead latents (no firing for
``dead_after_tokens`` tokens) are revived with the AuxK loss: the top ``k_aux``
pre-activations among dead latents reconstruct the main model's detached residual
``x − x_hat``, decoded without ``b_pre`` because the residual has no offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from feature_extraction.validate import check_float, check_int
from sae_pipeline.sae.base import SAEOutput, ShallowSAE, keep_top_k
from sae_pipeline.sae.inference_codes import from_token_lists
from sae_pipeline.sae.sparse_decode import SparseCodes, sparse_decode, sparse_encode


class TopKSAE(ShallowSAE):
    """TopK SAE with AuxK.

    Args:
        d_in: input dimension.
        d_sae: number of atoms.
        k: active latents per token, in [1, d_sae].
        k_aux: dead latents used by AuxK; None means ``d_in // 2`` (Gao et al. use a power of
            two near d_in/2), clipped to [1, d_sae].
        aux_coefficient: α of AuxK; 1/32 as in Gao et al. 2024.
        dead_after_tokens: see :class:`SparseAutoencoder`.
    """

    key = "topk"
    label = "TopK"
    test_kwargs = {"k": 4}

    def __init__(
        self,
        d_in: int,
        d_sae: int,
        k: int,
        k_aux: int | None = None,
        aux_coefficient: float = 1 / 32,
        dead_after_tokens: int = 10_000_000,
    ) -> None:
        super().__init__(d_in, d_sae, dead_after_tokens)
        self.k = check_int("k", k, 1, self.d_sae)
        if k_aux is None:
            self.k_aux = min(max(self.d_in // 2, 1), self.d_sae)
        else:
            self.k_aux = check_int("k_aux", k_aux, 1, self.d_sae)
        self.aux_coefficient = check_float("aux_coefficient", aux_coefficient, 0.0)

    def activate(self, pre: Tensor, k: int | None) -> Tensor:
        """The ``k`` (trained k when None) largest of ``relu(pre)`` per token."""
        return keep_top_k(F.relu(pre), self.k if k is None else k)

    def select_support(self, pre: Tensor) -> SparseCodes | None:
        """The per-token top ``k`` of ``pre`` (those of ``relu(pre)``, up to ties at 0, whose codes are 0)."""
        if not self.fits_sparse(pre.shape[0] * self.k, pre.shape[0]):
            return None
        return SparseCodes.from_topk(pre.topk(self.k, dim=-1, sorted=False).indices, self.d_sae)

    def sparse_activate(self, pre_values: Tensor, support: SparseCodes) -> Tensor:
        return F.relu(pre_values)

    def inference_entries(self, pre: Tensor) -> SparseCodes | None:
        """`activate`'s own top-k call on ``relu(pre)`` (computed in place), so the same latents win ties;
        its k values and indices become the entries, without the scatter into ``[B, d_sae]``."""
        top = F.relu(pre, inplace=True).topk(self.k, dim=-1, sorted=False)
        return from_token_lists(top.indices, top.values, self.d_sae)

    def auxiliary_loss(self, x: Tensor, output: SAEOutput) -> Tensor:
        """``α · mse(e_hat, (x − x_hat).detach())`` with ``e_hat`` from the top ``k_aux`` dead latents.

        ``e_hat = Σ relu(pre_j) · W_dec[j]`` over those latents, without ``b_pre``. Zero while no
        latent is dead: on the CPU at no cost (a host read of the dead mask skips it); where host reads
        are avoided (`avoids_host_reads`) it is computed and then replaced by 0 on the device. On
        the sparse path it gathers the dead columns of the detached ``pre`` and decodes sparsely; on the
        dense path, when fewer than ``k_aux`` latents are dead, the extra picks are live latents
        masked to -inf, whose values are replaced by 0.
        """
        if output.pre_acts is None:
            raise ValueError("output.pre_acts is None; pass the SAEOutput of this SAE's forward")
        dead = self.dead_mask().to(output.pre_acts.device)
        if self.avoids_host_reads(x):
            return torch.where(dead.any(), self.masked_auxiliary_loss(x, output, dead), 0.0)
        if not bool(dead.any()):
            return output.x_hat.new_zeros(())
        residual = (x - output.x_hat).detach()
        if output.sparse is not None:
            dead_latents = dead.nonzero().squeeze(1)
            n_aux = min(self.k_aux, dead_latents.numel())
            local = output.pre_acts.index_select(1, dead_latents).topk(n_aux, dim=-1, sorted=False).indices
            support = SparseCodes.from_topk(dead_latents[local], self.d_sae)
            values = F.relu(sparse_encode(x, self.b_pre, self.W_enc, self.b_enc, output.pre_acts, support))
            e_hat = sparse_decode(support.with_values(values), self.W_dec)
            return self.aux_coefficient * F.mse_loss(e_hat, residual)
        return self.dense_auxiliary_loss(output, dead, residual)

    def dense_auxiliary_loss(self, output: SAEOutput, dead: Tensor, residual: Tensor) -> Tensor:
        """AuxK from the dense ``pre`` (``k_aux`` picks per token, those among live latents worth 0)."""
        assert output.pre_acts is not None
        masked = torch.where(dead, F.relu(output.pre_acts), float("-inf"))
        values, indices = masked.topk(self.k_aux, dim=-1, sorted=False)
        values = torch.where(torch.isfinite(values), values, 0.0)
        aux_codes = torch.zeros_like(output.pre_acts).scatter(-1, indices, values)
        return self.aux_coefficient * F.mse_loss(aux_codes @ self.W_dec, residual)

    def masked_auxiliary_loss(self, x: Tensor, output: SAEOutput, dead: Tensor) -> Tensor:
        """AuxK without a host read: ``k_aux`` picks per token among all latents, the live ones masked to
        -inf before the ``topk`` and worth 0 after it (on the sparse path, the dead latents' entries of
        the detached ``pre``, as `auxiliary_loss` gathers them)."""
        assert output.pre_acts is not None
        residual = (x - output.x_hat).detach()
        if output.sparse is None:
            return self.dense_auxiliary_loss(output, dead, residual)
        top = torch.where(dead, output.pre_acts, float("-inf")).topk(self.k_aux, dim=-1, sorted=False)
        real = torch.isfinite(top.values)
        support = SparseCodes.from_topk(
            torch.where(real, top.indices, spread_indices(top.indices, self.d_sae)), self.d_sae
        )
        values = F.relu(sparse_encode(x, self.b_pre, self.W_enc, self.b_enc, output.pre_acts, support))
        values = torch.where(real.reshape(-1), values, 0.0)
        e_hat = sparse_decode(support.with_values(values), self.W_dec)
        return self.aux_coefficient * F.mse_loss(e_hat, residual)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, k_aux={self.k_aux}, aux_coefficient={self.aux_coefficient}"


def spread_indices(indices: Tensor, d_sae: int) -> Tensor:
    """Latents for AuxK's masked picks, each token's ``k_aux`` slots on consecutive latents, shifted per token.

    Why: among the all ``-inf`` scores of the live latents, ``topk`` returns the same few tied latents
    for every token, so the latent-major products of the backward (`triton_sparse.segment_sums`, one
    program per latent) get a few segments of B entries each, run serially. On an H200 those products
    took two thirds of a TopK step's GPU time (BENCHMARKS.md, "The GPU suite on an H200"); with no dead
    latent every one of the ``k_aux`` picks is such a pick. They are worth 0 (their values and gradients
    are masked), so any latent will do; spread, each latent gets about ``B · k_aux / d_sae`` of them.
    """
    batch, k = indices.shape
    tokens = torch.arange(batch, device=indices.device)[:, None]
    return (tokens * k + torch.arange(k, device=indices.device)[None, :]) % d_sae
