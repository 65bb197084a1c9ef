"""OMP-SAE: Orthogonal Matching Pursuit unrolled into a weight-tied sparse autoencoder.

Matching Pursuit (MP-SAE, :mod:`sae_pipeline.sae.mp`) leaves the coefficients of earlier atoms as
they were picked, so the residual is orthogonal only to the atom just picked. OMP (Pati et al.
1993) re-fits the coefficients of ALL selected atoms by least squares after every pick, so the
residual is orthogonal to every selected atom and ``x_hat`` is the projection of ``x − b_pre``
onto their span: the best reconstruction those atoms allow. Per token, with ``y = x − b_pre``::

    S = []
    for t = 1..k:  j_t = argmax_{j allowed} <r_{t-1}, d_j>;  S += [j_t]
                   c_S = argmin_c ‖y − Σ_{i∈S} c_i d_i‖²   (least squares);  r_t = y − Σ c_i d_i
    codes = Σ_{i∈S} c_i e_i;  x_hat = codes @ W_dec + b_pre

The argmax is signed, as MP-SAE's (the paper's Algorithm 1), so OMP with k = 1 is MP with k = 1.
"Allowed" excludes the atoms already selected and any atom (numerically) in their span, i.e. whose
squared distance to the span is at most ``RANK_TOLERANCE · eps · ‖d_j‖²`` (`omp_autograd.RANK_TOLERANCE`):
such an atom cannot lower the residual and would make the least-squares system singular. When no
atom is allowed the token stops early: its residual is then orthogonal to every atom, so no further
step could lower it. This always happens by step ``d_in`` (``d_in`` independent atoms span the input space and the
residual is 0), or earlier when the dictionary spans fewer directions. So k is the MOST atoms per
token: any k in ``[1, d_sae]`` is accepted (as TopK's), and a k above ``d_in`` gives the codes of
``k = d_in``; the steps not taken appear in :meth:`OMPSAE.pursuit` as index −1 with coefficient 0.
This is preferred to an error for k > d_in because a config written for one backbone (k = 32)
stays valid on narrower inputs, and training cannot crash on a token whose residual vanished.

The computation lives in :mod:`sae_pipeline.sae.omp_autograd` (selection by incremental QR without
autograd, then one least-squares solve with a hand-derived backward).
"""

from __future__ import annotations

import torch
from torch import Tensor

from feature_extraction.validate import check_int
from sae_pipeline.sae.base import SAEOutput, SparseAutoencoder
from sae_pipeline.sae.mp_autograd import Workspace
from sae_pipeline.sae.omp_autograd import orthogonal_matching_pursuit, select_atoms
from sae_pipeline.sae.sparse_decode import SparseCodes


class OMPSAE(SparseAutoencoder):
    """Weight-tied OMP-SAE; the loss is the MSE alone (sparsity is the number of steps k).

    Args:
        d_in: input dimension.
        d_sae: number of atoms.
        k: pursuit steps in training, in ``[1, d_sae]``: the most atoms per token (all distinct; at
            most ``d_in`` are taken, see the module docstring).
        dead_after_tokens: see :class:`SparseAutoencoder`.
    """

    key = "ompsae"
    label = "OMP-SAE"
    is_pursuit = True
    test_kwargs = {"k": 4}
    #: Whether the correlation updates run as the fused Triton kernel (`triton_pursuit`); None: on CUDA with
    #: Triton. Not a constructor argument: it changes the cost, not the result (up to near-ties).
    fused: bool | None = None

    def __init__(self, d_in: int, d_sae: int, k: int, dead_after_tokens: int = 10_000_000) -> None:
        super().__init__(d_in, d_sae, dead_after_tokens)
        self.k = check_int("k", k, 1, self.d_sae)
        self.workspace = Workspace()  # CPU scratch buffers, not state

    def pursuit(self, x: Tensor, k: int | None = None) -> tuple[Tensor, Tensor]:
        """Selection order and final coefficients: ``(indices [B, k], coefficients [B, k])``.

        Row b lists the atoms in the order OMP picked them (all distinct) with their coefficients
        after the last least-squares fit, then −1 / 0 for the steps a token did not take (none
        while k ≤ d_in and the dictionary spans the inputs). Differentiable in the coefficients.
        """
        self.check_input(x)
        steps = self.resolve_k(k)
        assert steps is not None
        indices, coefficients, _ = orthogonal_matching_pursuit(
            x, self.W_dec, self.b_pre, steps, self.workspace, fused=self.fused
        )
        return indices, coefficients

    def codes_from_pursuit(self, indices: Tensor, coefficients: Tensor) -> Tensor:
        """Dense codes ``[B, d_sae]`` (the atoms of a row are distinct; −1 entries carry 0)."""
        codes = coefficients.new_zeros(coefficients.shape[0], self.d_sae)
        return codes.scatter_add_(1, indices.clamp_min(0), coefficients)

    def encode(self, x: Tensor, k: int | None = None) -> Tensor:
        """Codes after ``k`` OMP steps (the trained k when None), any k in ``[1, d_sae]``."""
        indices, coefficients = self.pursuit(x, k)
        return self.codes_from_pursuit(indices, coefficients)

    def forward(self, x: Tensor) -> SAEOutput:
        """k OMP steps; ``x_hat`` is built from the selected atoms only (equal to ``decode(codes)``);
        the codes are sparse (dense ``[B, d_sae]`` only if read)."""
        self.check_input(x)
        assert self.k is not None
        indices, coefficients, x_hat = orthogonal_matching_pursuit(
            x, self.W_dec, self.b_pre, self.k, self.workspace, self.avoids_host_reads(x), self.fused
        )
        codes = SparseCodes.from_topk(indices.clamp_min(0), self.d_sae).with_values(coefficients.reshape(-1))
        return SAEOutput(x_hat=x_hat, pre_acts=None, sparse=codes)

    @torch.no_grad()
    def residual_norms(self, x: Tensor, k: int | None = None) -> Tensor:
        """``‖r_t‖₂`` for t = 0..k, shape ``[B, k + 1]`` (``r_0 = x − b_pre``); non-increasing in t.

        From the QR factors: ``r_{t-1} = r_t + z_t q_t`` with ``q_t ⊥ r_t``, so
        ``‖r_{t-1}‖² = ‖r_t‖² + z_t²``, accumulated from the final residual backwards.
        """
        self.check_input(x)
        steps = self.resolve_k(k)
        assert steps is not None
        _, _, z, r = select_atoms(x - self.b_pre, self.W_dec, steps, self.workspace, fused=self.fused)
        tail = torch.cat([z.square().flip(1).cumsum(1).flip(1), z.new_zeros(z.shape[0], 1)], dim=1)
        return (tail + r.square().sum(1, keepdim=True)).sqrt().to(x.dtype)
