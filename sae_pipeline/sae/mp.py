"""MP-SAE: Matching Pursuit unrolled into a weight-tied sparse autoencoder (Costa et al. 2025).

Instead of one encoder pass, k greedy residual-guided steps over the dictionary (the paper's
Algorithm 1): each step picks the atom most correlated with the residual, adds its
coefficient to the code and removes its contribution from the residual. The residual is then
orthogonal to the atom just picked (Proposition 1) and its norm never increases
(Proposition 2), which is why the number of steps can be raised at inference without
retraining. There is no encoder: the decoder ``W_dec`` is the whole model (plus ``b_pre``).

The computation lives in :mod:`sae_pipeline.sae.mp_autograd` (selection without autograd,
then a hand-written backward over the selected atoms only).
"""

from __future__ import annotations

import torch
from torch import Tensor

from feature_extraction.validate import check_int
from sae_pipeline.sae.base import SAEOutput, SparseAutoencoder
from sae_pipeline.sae.mp_autograd import Selection, Workspace, matching_pursuit, select_atoms


class MatchingPursuitSAE(SparseAutoencoder):
    """Weight-tied MP-SAE; the loss is the MSE alone (sparsity is the number of steps k).

    Args:
        d_in: input dimension.
        d_sae: number of atoms.
        k: pursuit steps in training (= atoms selected per token, repeats counted).
        selection: how the greedy indices are found: ``"auto"`` picks, per batch shape, Gram
            updates or a matmul per step (see ``pursuit_cost.prefer_gram``); ``"gram"`` and
            ``"matmul"`` force one. Results are the same either way (up to float32 near-ties).
        dead_after_tokens: see :class:`SparseAutoencoder`.
    """

    key = "mpsae"
    aliases = ("mp",)  # its registry key and exported "variant" before the configs' name was adopted
    label = "MP-SAE"
    is_pursuit = True
    k_above_d_sae = True
    test_kwargs = {"k": 4}
    #: Whether the pursuit's Gram-update steps run as the fused Triton kernel (`triton_pursuit`); None: on
    #: CUDA with Triton. Not a constructor argument: it changes the cost, not the result (up to near-ties).
    fused: bool | None = None

    def __init__(
        self, d_in: int, d_sae: int, k: int, selection: Selection = "auto", dead_after_tokens: int = 10_000_000
    ) -> None:
        super().__init__(d_in, d_sae, dead_after_tokens)
        self.k = check_int("k", k, 1, self.d_sae)
        if selection not in ("auto", "gram", "matmul"):
            raise ValueError(f"selection must be 'auto', 'gram' or 'matmul', got {selection!r}")
        self.selection: Selection = selection
        self.workspace = Workspace()  # CPU scratch buffers (a chunk's correlations, a small Gram matrix), not state

    def resolve_k(self, k: int | None) -> int | None:
        """``k`` ≥ 1 with no upper bound (the trained ``self.k`` when None): a pursuit may run more steps
        than there are atoms, picking atoms again; the residual still shrinks (Proposition 2)."""
        if k is None:
            return self.k
        return check_int("k", k, 1)

    def pursuit(self, x: Tensor, k: int | None = None) -> tuple[Tensor, Tensor]:
        """Selection order and coefficients: ``(indices [B, k], coefficients [B, k])``.

        Row b lists the atoms in the order MP picked them, with the coefficient added at each
        step (an atom picked twice appears twice). Differentiable in the coefficients.
        """
        self.check_input(x)
        steps = self.resolve_k(k)
        assert steps is not None
        indices, coefficients, _ = matching_pursuit(
            x, self.W_dec, self.b_pre, steps, self.selection, self.workspace, self.fused
        )
        return indices, coefficients

    def encode(self, x: Tensor, k: int | None = None) -> Tensor:
        """Codes after ``k`` pursuit steps (the trained k when None); any k ≥ 1, also above d_sae."""
        indices, coefficients = self.pursuit(x, k)
        return self.codes_from_pursuit(indices, coefficients)

    def forward(self, x: Tensor) -> SAEOutput:
        """k pursuit steps; ``x_hat`` is built from the selected atoms only (equal to
        ``decode(codes)``), so no dense ``[B, d_sae]`` matmul enters the graph."""
        self.check_input(x)
        assert self.k is not None
        indices, coefficients, x_hat = matching_pursuit(
            x, self.W_dec, self.b_pre, self.k, self.selection, self.workspace, self.fused
        )
        return SAEOutput(x_hat=x_hat, codes=self.codes_from_pursuit(indices, coefficients), pre_acts=None)

    @torch.no_grad()
    def residual_norms(self, x: Tensor, k: int | None = None) -> Tensor:
        """``‖r_t‖₂`` for t = 0..k, shape ``[B, k + 1]`` (``r_0 = x − b_pre``).

        Non-increasing in t for unit-norm atoms (Proposition 2); used by the evaluation suite.
        """
        self.check_input(x)
        steps = self.resolve_k(k)
        assert steps is not None
        r = x - self.b_pre
        indices = select_atoms(r, self.W_dec, steps, self.selection, self.workspace, self.fused)
        norms = r.new_empty(x.shape[0], steps + 1)
        norms[:, 0] = r.norm(dim=1)
        for t in range(steps):
            d = self.W_dec.index_select(0, indices[:, t])
            c = torch.linalg.vecdot(r, d)
            r = r - c[:, None] * d
            norms[:, t + 1] = r.norm(dim=1)
        return norms

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, selection={self.selection!r}"
