"""Matryoshka BatchTopK SAE (Bussmann et al. 2025, "Learning Multi-Level Features with Matryoshka SAEs").

A flat SAE trained on one reconstruction loss lets a general feature be "absorbed" into more
specific ones (the specific latent learns to also carry the general direction, and the general
latent stops firing on it). Matryoshka SAEs train nested prefixes of one dictionary to each
reconstruct the input on their own: with prefix widths ``m_1 < … < m_G = d_sae``,

    x_hat_g = codes[:, :m_g] @ W_dec[:m_g] + b_pre,     loss = Σ_g mse(x_hat_g, x) + AuxK

so the first ``m_1`` latents must already give a usable reconstruction without the others: early
latents are pushed towards general features, later ones add detail. The widths grow
geometrically, each ``prefix_ratio`` times the previous, ``n_prefixes`` of them (default 4 and 4:
d_sae/64, d_sae/16, d_sae/4, d_sae), two scalars rather than a list because an SAE's config is
plain JSON scalars (:mod:`sae_pipeline.sae.config`). The codes are BatchTopK's
(:class:`BatchTopKSAE`: batch top ``B·k`` in training, the learned threshold θ at inference), the
same for every prefix (as the paper's implementation; prefixes differ only in which latents they
decode). Each inner prefix's MSE is a named loss term, ``mse_prefix_<m_g>`` (logged as
``train/mse_prefix_<m_g>``); the full dictionary's is the usual ``mse``.

On the sparse path the prefix reconstructions cost one sparse decode of the entries below the
largest inner width in all (each entry is decoded once, into its group's partial sum, and the
prefixes are running sums of the groups), not one decode per prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from feature_extraction.validate import check_float, check_int
from sae_pipeline.sae.base import SAEOutput
from sae_pipeline.sae.batchtopk import BatchTopKSAE
from sae_pipeline.sae.sparse_decode import SparseCodes, row_offsets, sparse_decode


def prefix_widths(d_sae: int, n_prefixes: int, prefix_ratio: float) -> tuple[int, ...]:
    """Strictly increasing widths ``round(d_sae / prefix_ratio^(n_prefixes − g))`` for g = 1..n_prefixes
    (at least 1), ending with ``d_sae``; widths that round alike count once."""
    return tuple(sorted({max(1, round(d_sae / prefix_ratio ** (n_prefixes - g))) for g in range(1, n_prefixes + 1)}))


class MatryoshkaBatchTopKSAE(BatchTopKSAE):
    """BatchTopK SAE whose nested dictionary prefixes each reconstruct the input.

    Args:
        d_in, d_sae, k, k_aux, aux_coefficient, threshold_momentum, dead_after_tokens,
            token_scaled_threshold: as :class:`BatchTopKSAE`.
        n_prefixes: number of nested prefixes, the whole dictionary included (1: BatchTopK's loss).
        prefix_ratio: each prefix's width over the previous one's, > 1. With the defaults (4, 4.0)
            the widths are d_sae/64, d_sae/16, d_sae/4, d_sae: 16, 62, 250, 1000 at d_sae = 1000.
    """

    key = "matryoshka"
    label = "Matryoshka BatchTopK"
    test_kwargs = {"k": 4}

    def __init__(
        self,
        d_in: int,
        d_sae: int,
        k: int,
        n_prefixes: int = 4,
        prefix_ratio: float = 4.0,
        k_aux: int | None = None,
        aux_coefficient: float = 1 / 32,
        threshold_momentum: float = 0.99,
        dead_after_tokens: int = 10_000_000,
        token_scaled_threshold: bool = False,
    ) -> None:
        super().__init__(
            d_in, d_sae, k, k_aux, aux_coefficient, threshold_momentum, dead_after_tokens, token_scaled_threshold
        )
        self.n_prefixes = check_int("n_prefixes", n_prefixes, 1)
        self.prefix_ratio = check_float("prefix_ratio", prefix_ratio, 1.0, strict_minimum=True)
        self.prefix_widths = prefix_widths(self.d_sae, self.n_prefixes, self.prefix_ratio)

    def loss_terms(self, x: Tensor, output: SAEOutput, step: int) -> dict[str, Tensor]:
        """BatchTopK's terms plus ``mse_prefix_<m>`` for every inner prefix width m."""
        terms = super().loss_terms(x, output, step)
        for width, x_hat in zip(self.prefix_widths[:-1], self.prefix_reconstructions(output)):
            terms[f"mse_prefix_{width}"] = F.mse_loss(x_hat, x)
        return terms

    def prefix_reconstructions(self, output: SAEOutput) -> list[Tensor]:
        """``x_hat`` of every inner prefix (all widths but the last), differentiable, from the codes of
        ``output``: the running sums of each group's contribution ``codes[:, lo:hi] @ W_dec[lo:hi]``."""
        x_hat = self.b_pre.expand(output.x_hat.shape)
        out, low = [], 0
        for width in self.prefix_widths[:-1]:
            x_hat = x_hat + self.group_contribution(output, low, width)
            out.append(x_hat)
            low = width
        return out

    def group_contribution(self, output: SAEOutput, low: int, high: int) -> Tensor:
        """``codes[:, low:high] @ W_dec[low:high]`` ``[B, d_in]``, decoded sparsely on the sparse path: the
        group's entries picked out (a data-sized selection, on the CPU), or, where host reads are avoided,
        every entry with the others' values set to 0 (the same sums: adding 0 changes no float)."""
        codes = output.sparse
        if codes is None:
            return output.codes[:, low:high] @ self.W_dec[low:high]
        assert codes.values is not None
        keep = (codes.indices >= low) & (codes.indices < high)
        if self.avoids_host_reads(codes.values):
            return sparse_decode(codes.with_values(torch.where(keep, codes.values, 0.0)), self.W_dec)
        rows = codes.rows[keep]
        crow = row_offsets(rows, codes.batch_size)
        group = SparseCodes(codes.indices[keep], rows, crow, self.d_sae, codes.values[keep])
        return sparse_decode(group, self.W_dec)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, prefix_widths={list(self.prefix_widths)}"
