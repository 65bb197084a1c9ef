"""TopK SAE (Gao et al. 2024, "Scaling and evaluating sparse autoencoders").

``codes`` keeps the ``k`` largest entries of ``relu(pre)`` per token, so sparsity is fixed by
construction and the loss needs no penalty. Dead latents (no firing for
``dead_after_tokens`` tokens) are revived with the AuxK loss: the top ``k_aux``
pre-activations among dead latents reconstruct the main model's detached residual
``x − x_hat``, decoded without ``b_pre`` because the residual has no offset. Where the step reads no
device value (a GPU), AuxK follows a dead count that the host reads ``aux_lag`` steps late, and costs
nothing while that count is 0 (:meth:`TopKSAE.auxiliary_loss`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from feature_extraction.validate import check_float, check_int
from sae_pipeline.sae.base import SAEOutput, ShallowSAE, keep_top_k
from sae_pipeline.sae.inference_codes import from_token_lists
from sae_pipeline.sae.late_count import LateCount
from sae_pipeline.sae.sparse_decode import SparseCodes, sparse_decode, sparse_encode
from sae_pipeline.sae.topk_select import top_k_indices


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
    #: Where host reads are avoided: the steps between the dead count that AuxK's plan follows and the step
    #: that uses it (`LateCount`). Not a constructor argument: it changes when AuxK starts and stops, by a
    #: few steps of the millions of tokens a latent takes to die.
    aux_lag: int = 8

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
        self._late_dead: LateCount | None = None  # the host's late dead count, during a sync-free fit
        self.planned_aux_slots: int | None = None  # this step's AuxK slots (`plan_step`); None: all latents

    def activate(self, pre: Tensor, k: int | None) -> Tensor:
        """The ``k`` (trained k when None) largest of ``relu(pre)`` per token."""
        return keep_top_k(F.relu(pre), self.k if k is None else k)

    def select_support(self, pre: Tensor) -> SparseCodes | None:
        """The per-token top ``k`` of ``pre`` (those of ``relu(pre)``, up to ties at 0, whose codes are 0), by
        `topk_select.top_k_indices`: on a GPU the selection kernel (each token's latents ascending, ties at the
        threshold to the lowest latent), else ``torch.topk``."""
        if not self.fits_sparse(pre.shape[0] * self.k, pre.shape[0]):
            return None
        return SparseCodes.from_topk(top_k_indices(pre, self.k), self.d_sae)

    def sparse_activate(self, pre_values: Tensor, support: SparseCodes) -> Tensor:
        return F.relu(pre_values)

    def inference_entries(self, pre: Tensor) -> SparseCodes | None:
        """`activate`'s own top-k call on ``relu(pre)`` (computed in place), so the same latents win ties;
        its k values and indices become the entries, without the scatter into ``[B, d_sae]``."""
        acts = F.relu(pre, inplace=True)
        indices = top_k_indices(acts, self.k)
        return from_token_lists(indices, acts.gather(-1, indices), self.d_sae)

    # --- AuxK's plan on a sync-free device: the dead count, known late on the host -------------------
    def begin_fit(self) -> None:
        """Where host reads are avoided: start the late dead count (`LateCount`) from the count read now,
        once per fit (before its first step, so no step reads it)."""
        if not self.avoids_host_reads(self.W_dec):
            self._late_dead = None
            return
        self._late_dead = LateCount(self.aux_lag)
        self._late_dead.reset(int(self.dead_mask().sum()), self.tokens_since_fired.device)

    def plan_step(self) -> int | None:
        """The slots of this step's AuxK (`aux_slots` of the late dead count; 0: no AuxK at all), which is
        also the step's key: a captured step keeps one graph per number of slots. None where the step reads
        the dead count itself (the CPU) or no fit has begun (then AuxK masks all ``d_sae`` latents)."""
        self.planned_aux_slots = None if self._late_dead is None else aux_slots(self._late_dead.read(), self.d_sae)
        return self.planned_aux_slots

    def after_step(self) -> None:
        """Push the dead count after this step's firing, non-blocking, for the step ``aux_lag`` steps on."""
        if self._late_dead is not None:
            self._late_dead.push(self.dead_mask().sum())

    def auxiliary_loss(self, x: Tensor, output: SAEOutput) -> Tensor:
        """``α · mse(e_hat, (x − x_hat).detach())`` with ``e_hat`` from the top ``k_aux`` dead latents.

        ``e_hat = Σ relu(pre_j) · W_dec[j]`` over those latents, without ``b_pre``; 0 while no latent is dead.
        On the CPU the dead count is read (free there): no dead latent, no work; else the top ``k_aux`` runs
        over the dead latents only (`dead_latent_loss`).

        Where host reads are avoided (`avoids_host_reads`, and so in the CUDA graph step) the step cannot
        ask the device whether a latent is dead, so it follows the dead count the host knew ``aux_lag`` steps
        earlier (`plan_step`, `LateCount`): dead latents change over millions of tokens, not steps, so AuxK
        starts ``aux_lag`` steps after the first latent dies and stops ``aux_lag`` steps after the last one
        revives. Why: computed on every step and masked to 0 (as it was), AuxK cost a top-``k_aux`` over all
        ``[B, d_sae]`` pre-activations and a sparse encode and decode of ``B · k_aux`` entries per step, a
        large share of a step on a GPU, while most of a run has no dead latent. Now, with no dead latent in
        the late count, no AuxK work is queued at all; otherwise the top-``k_aux`` runs over
        ``planned_aux_slots`` latents (the late count rounded up to a power of two), the dead ones first. That
        is the exact AuxK whenever the device's dead latents fit in the slots; a stale count smaller than the
        device's covers its first dead latents only (each exactly), a larger one pads with picks worth 0, and
        a device with no dead latent gives 0.
        """
        if output.pre_acts is None:
            raise ValueError("output.pre_acts is None; pass the SAEOutput of this SAE's forward")
        dead = self.dead_mask().to(output.pre_acts.device)
        if self.avoids_host_reads(x):
            slots = self.d_sae if self.planned_aux_slots is None else self.planned_aux_slots
            if slots == 0:
                return output.x_hat.new_zeros(())
            return torch.where(dead.any(), self.dead_latent_loss(x, output, dead, slots), 0.0)
        n_dead = int(dead.sum())
        if n_dead == 0:
            return output.x_hat.new_zeros(())
        return self.dead_latent_loss(x, output, dead, n_dead)

    def dead_latent_loss(self, x: Tensor, output: SAEOutput, dead: Tensor, slots: int) -> Tensor:
        """AuxK over ``slots`` latents: the dead ones, lowest first (`torch.nonzero_static`: a fixed size, no
        host read), padded with slots worth 0 when fewer are dead, all ``d_sae`` (the live ones masked) when
        ``slots >= d_sae``.

        Each token picks the top ``min(k_aux, slots)`` of the detached ``pre`` over the slots (a padding slot
        is -inf, so it is picked only when the dead latents are fewer than ``k_aux``); their values
        ``relu(pre)`` (differentiable: the sparse encode's gather, or the dense ``pre``'s) are decoded
        sparsely. Padding picks are worth 0 (value and gradient) and sit on spread latents (`spread_indices`).
        """
        assert output.pre_acts is not None
        pre = output.pre_acts.detach()
        if slots >= self.d_sae:
            columns, real_column, scores = None, dead, torch.where(dead, pre, float("-inf"))
        else:
            found = torch.nonzero_static(dead, size=slots, fill_value=-1).squeeze(1)
            real_column, columns = found >= 0, found.clamp_min(0)
            scores = torch.where(real_column, pre.index_select(1, columns), float("-inf"))
        top = top_k_indices(scores, min(self.k_aux, slots))  # any order: each pick stands alone
        real = real_column[top]
        latents = top if columns is None else columns[top]
        support = SparseCodes.from_topk(torch.where(real, latents, spread_indices(latents, self.d_sae)), self.d_sae)
        if output.sparse is not None:  # pre is detached there: the gradients go through the gathered entries
            values = sparse_encode(x, self.b_pre, self.W_enc, self.b_enc, pre, support)
        else:
            values = support.gather(output.pre_acts)
        values = torch.where(real.reshape(-1), F.relu(values), 0.0)
        e_hat = sparse_decode(support.with_values(values), self.W_dec)
        return self.aux_coefficient * F.mse_loss(e_hat, (x - output.x_hat).detach())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, k_aux={self.k_aux}, aux_coefficient={self.aux_coefficient}"


def aux_slots(n_dead: int | None, d_sae: int) -> int | None:
    """AuxK's slots for a late dead count: 0 for none, else the count rounded up to a power of two (at most
    ``d_sae``); None (count unknown) stays None.

    Why round: the slots fix the step's shapes, so each value is one CUDA graph (`graph_step`); powers of two
    give at most ``log2(d_sae) + 2`` of them over a run, whatever the count does, and leave room for
    latents that die within the lag (a stale count below the device's covers only the first dead latents).
    """
    if n_dead is None:
        return None
    return 0 if n_dead <= 0 else min(1 << (n_dead - 1).bit_length(), d_sae)


def spread_indices(indices: Tensor, d_sae: int) -> Tensor:
    """Latents for AuxK's padding picks, each token's ``k`` slots on consecutive latents, shifted per token.

    Why: among the all ``-inf`` scores of the padding slots (or of the masked live latents), ``topk`` returns
    the same few tied latents for every token, so the latent-major products of the backward
    (`triton_sparse.segment_sums`, one program per latent) get a few segments of B entries each, run
    serially. On an H200 those products took two thirds of a TopK step's GPU time (BENCHMARKS.md, "The GPU
    suite on an H200"), when AuxK ran with no dead latent and every one of the ``k_aux`` picks was such a
    pick. They are worth 0 (their values and gradients are masked), so any latent will do; spread, each
    latent gets about ``B · k / d_sae`` of them.
    """
    batch, k = indices.shape
    tokens = torch.arange(batch, device=indices.device)[:, None]
    return (tokens * k + torch.arange(k, device=indices.device)[None, :]) % d_sae
