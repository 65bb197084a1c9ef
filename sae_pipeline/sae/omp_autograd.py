"""OMP-SAE's pursuit, fast and exact: batched selection by incremental QR without autograd, then one
least-squares solve with a hand-derived backward (the algorithm itself: :mod:`sae_pipeline.sae.omp`).

1. `select_atoms` (no autograd) runs the pursuit batched over tokens with an incremental
   QR factorisation of the selected atoms: ``D_S = L Q`` (rows), ``Q`` orthonormal, built by
   Gram–Schmidt (re-orthogonalised when an atom lies mostly in the span), so ``L`` is the
   Cholesky factor of the Gram matrix ``D_S D_Sᵀ`` without ever forming it. A new atom costs
   ``O(t·d_in)`` per token, and its Gram–Schmidt remainder is its distance to the span, so the rank
   rule is checked on the winner only (:func:`next_atom`). The correlations ``<r, d_j>`` are updated with
   ``P_t = q_t @ W_decᵀ``: one matmul per step, as MP-SAE's matmul selection. (MP-SAE can instead
   update them with one row of the Gram matrix ``W_dec W_decᵀ``, because its residual moves along
   one atom per step; OMP's moves along ``q_t``, a combination of all t selected atoms, which would
   cost t Gram rows per step, no cheaper than the matmul for k ≳ 16.)
2. :class:`LeastSquaresFunction` computes the coefficients from ``(L, z = Q y)`` by one
   triangular solve (``Lᵀ c = z``) and ``x_hat = D_Sᵀ c + b_pre``, and saves only the inputs,
   the indices ``[B, k]``, ``L [B, k, k]`` and ``c [B, k]``: no ``[B, d_sae]`` tensor.

Backward: autograd through the plain loop differentiates only the LAST least-squares solve (the
earlier solves feed only the argmax, which has no gradient), so the Function differentiates
``c = G⁻¹ D_S y``, ``G = D_S D_Sᵀ``, directly. With upstream ``ḡ`` on ``c`` and ``g`` on ``x_hat``,
``γ = ḡ + D_S g`` and ``λ = G⁻¹ γ`` (two triangular solves with ``L``), ``r = y − D_Sᵀ c`` and
``u = g − D_Sᵀ λ``::

    ∂y = D_Sᵀ λ,   ∂b_pre = Σ_batch u,   ∂d_{j_i} = λ_i r + c_i u

(from ``dc = G⁻¹(dD_S y − dD_S D_Sᵀ c − D_S dD_Sᵀ c)``). This is chosen over a hand-written
reverse scan over the k steps (as MP-SAE's) because it is exact, shorter and touches only
``[B, k, d_in]`` tensors; the tests check it against autograd through the plain per-token loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from sae_pipeline.sae.mp_autograd import Workspace, argmax_block_size, compute_dtype, first_argmax
from sae_pipeline.sae.sparse_decode import with_kernels
from sae_pipeline.sae.triton_pursuit import fused_available, omp_step

#: Rows of the batch processed together on CPU (GPUs take the whole batch). Larger than MP-SAE's
#: 256: OMP runs ~30 small ops per step, and each parallel region is a thread barrier, which on a
#: busy 2-core box can cost milliseconds; 4x fewer chunks measured 1.5-2x faster with 2 threads
#: there (B=1024, d_sae=4096, k=16), and the same with 1 thread.
CPU_CHUNK_ROWS = 1024

#: Gram–Schmidt runs a second pass when a new atom keeps less than this fraction of its squared
#: norm after the first (see :func:`orthonormal_step`).
REORTHOGONALIZE = 0.25

#: An atom whose squared distance to the span of the selected atoms is at most
#: ``RANK_TOLERANCE · eps · ‖d_j‖²`` is not selectable (well above the rounding of a Gram–Schmidt
#: remainder, well below any atom that could usefully lower the residual).
RANK_TOLERANCE = 100.0


@torch.no_grad()
def select_atoms(
    y: Tensor,
    W_dec: Tensor,
    k: int,
    workspace: Workspace | None = None,
    sync_free: bool = False,
    fused: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """OMP on ``y [B, d_in]``: ``(indices [B, k], L [B, k, k], z [B, k], r [B, d_in])``, no autograd.

    ``D_S = L Q`` with ``Q`` orthonormal rows, ``z = Q y`` and ``r`` the final residual, all in the
    compute dtype (float32 for half inputs). In float64 the indices are those of the plain loop. A
    step a token does not take (no atom left to lower its residual) has index −1, ``z = 0`` and an
    identity row in ``L``, so the least-squares solve and its backward ignore it.

    ``sync_free`` (a GPU's training step): no host read. The rank rule is then applied to every atom
    before the argmax, from each atom's squared distance to the span kept per token
    (``‖d_j‖² − Σ_t <q_t, d_j>²``, one ``[B, d_sae]`` update per step from the correlations' own
    ``<q_t, d_j>``), instead of to the winner after it, retried until none is dependent (a loop whose
    length is the data's). The same atoms are picked unless an atom's distance lies within rounding of
    the tolerance.

    ``fused`` (None: on CUDA with Triton): each step's update of the correlations (and of the distances),
    the masking of the picked atom and the next argmax are one kernel (`triton_pursuit.update_argmax`)
    instead of five passes over ``[B, d_sae]``; the same arithmetic, so the same indices.
    """
    n_tokens, d_in = y.shape
    fused = fused_available(y.device) if fused is None else fused
    d_sae = W_dec.shape[0]
    dtype = compute_dtype(y.dtype)
    device = y.device
    W = W_dec.detach().to(dtype)
    workspace = Workspace() if workspace is None else workspace
    atom_sq = torch.linalg.vecdot(W, W)
    tolerance = RANK_TOLERANCE * torch.finfo(dtype).eps * atom_sq  # [d_sae]
    indices = torch.empty(n_tokens, k, dtype=torch.int64, device=device)
    L = torch.zeros(n_tokens, k, k, dtype=dtype, device=device)
    z = torch.empty(n_tokens, k, dtype=dtype, device=device)
    residual = y.detach().to(dtype).clone()
    on_cpu = device.type == "cpu"
    chunk = CPU_CHUNK_ROWS if on_cpu else max(n_tokens, 1)
    block = argmax_block_size(d_sae) if on_cpu else None
    rows_max = max(min(chunk, n_tokens), 1)
    corr_buffer = workspace.get("omp_correlations", (rows_max, d_sae), dtype, device)
    proj_buffer = workspace.get("omp_projections", (rows_max, d_sae), dtype, device)
    Q = workspace.get("omp_q", (rows_max, k, d_in), dtype, device)
    distance_buffer = workspace.get("omp_distances", (rows_max, d_sae), dtype, device) if sync_free else None
    best_buffer = torch.empty(rows_max, dtype=dtype, device=device) if fused else None
    for start in range(0, n_tokens, chunk):
        stop = min(start + chunk, n_tokens)
        n = stop - start
        r = residual[start:stop]
        corr, proj = corr_buffer[:n], proj_buffer[:n]
        torch.matmul(r, W.T, out=corr)  # <r_0, d_j>
        corr.masked_fill_(atom_sq <= 0, float("-inf"))  # zero atoms never help
        distances = None if distance_buffer is None else distance_buffer[:n].copy_(atom_sq.expand(n, d_sae))
        for t in range(k):
            first = None  # with the kernel: step t − 1's updates of corr (and distances) fused with this argmax
            if best_buffer is not None:
                first = omp_step(
                    corr, indices[start:stop], t, best_buffer[:n], proj, z[start:stop], distances, tolerance
                )
            j, q, row, stopped = next_atom(corr, block, W, Q[:n, :t], tolerance, sync_free, first)
            indices[start:stop, t] = j
            Q[:n, t] = q
            L[start:stop, t, : t + 1] = row
            z_t = torch.linalg.vecdot(q, r)
            z[start:stop, t] = z_t
            r.addcmul_(q, z_t[:, None], value=-1.0)
            if t == k - 1:
                break
            torch.matmul(q, W.T, out=proj)  # <q_t, d_j>
            if best_buffer is not None:
                continue  # the next step's kernel applies proj
            corr.addcmul_(proj, z_t[:, None], value=-1.0)  # <r_t, d_j>; masked entries stay -inf
            corr.scatter_(1, j.clamp_min(0)[:, None], float("-inf"))  # selected: never again
            if distances is not None:  # in the span now: never again
                corr.masked_fill_(distances.addcmul_(proj, proj, value=-1.0) <= tolerance, float("-inf"))
    return indices, L, z, residual


def next_atom(
    corr: Tensor,
    block: int | None,
    W: Tensor,
    Q: Tensor,
    tolerance: Tensor,
    sync_free: bool = False,
    first: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The step's atom per token, ``(j [n], q [n, d_in], row [n, t + 1], stopped [n])``: the largest
    correlation among atoms not in the span of the selected ones.

    The rank rule is checked lazily, on the winner only: Gram–Schmidt gives its distance to the span
    (``row_t``); a winner within the tolerance is masked in ``corr`` (for good: distances only shrink)
    and the argmax retried. That is the argmax over the allowed atoms, at the cost of one Gram–Schmidt
    per token instead of a distance update of every atom per step; retries are rare (an atom near the
    span has a correlation near 0). A token with no atom left (all masked) gets ``j = −1``, ``q = 0``
    and an identity row (``stopped``). ``sync_free``: ``corr`` has every dependent atom masked already
    (`select_atoms`), so one argmax, and the stopped tokens are set on the device. ``first``: the
    argmax ``(j, best)`` of ``corr`` already taken (by the fused kernel).
    """
    if sync_free:
        j, best = first_argmax(corr, block) if first is None else first
        q, row = orthonormal_step(W.index_select(0, j), Q, sync_free=True)
        stopped = torch.isinf(best[:, 0])
        identity = torch.zeros_like(row[:1])
        identity[:, -1:].fill_(1.0)  # a fill kernel: `identity[0, -1] = 1.0` copies a host scalar, a sync
        return (
            torch.where(stopped, -1, j),
            torch.where(stopped[:, None], 0.0, q),
            torch.where(stopped[:, None], identity, row),
            stopped,
        )
    rows = torch.arange(corr.shape[0], device=corr.device)
    while True:
        j, best = first_argmax(corr, block) if first is None else first
        first = None
        q, row = orthonormal_step(W.index_select(0, j), Q)
        stopped = torch.isinf(best[:, 0])
        dependent = (row[:, -1].square() <= tolerance[j]) & ~stopped
        if not bool(dependent.any()):
            break
        corr[rows[dependent], j[dependent]] = float("-inf")
    if bool(stopped.any()):  # rare: k > d_in, or a dictionary of lower rank
        q[stopped] = 0.0
        row[stopped] = 0.0
        row[stopped, -1] = 1.0
        j = torch.where(stopped, -1, j)
    return j, q, row, stopped


def orthonormal_step(d: Tensor, Q: Tensor, sync_free: bool = False) -> tuple[Tensor, Tensor]:
    """Gram–Schmidt of the new atoms ``d [n, d_in]`` against ``Q [n, t, d_in]`` (orthonormal rows),
    re-orthogonalised once ("twice is enough", Giraud et al. 2005) when some token's atom lost more
    than 3/4 of its squared norm to the projection (below that, one pass keeps ``q`` orthogonal to
    ``Q`` to within a few roundings; the DGKS criterion): ``(q [n, d_in],
    row [n, t + 1])`` where ``d = Σ_i row_i q_i`` and ``row_t = ‖d − Σ_{i<t} row_i q_i‖``, the
    distance of ``d`` to the span of ``Q``. Broadcast products, not ``bmm``: on CPU a batch of
    [t, d_in] × [d_in, 1] products costs ~10x more through ``bmm``. ``sync_free``: the second pass is
    always computed and kept only where the batch needs it (``torch.where``): the same result without
    reading the test on the host.
    """
    t = Q.shape[1]
    row = d.new_empty(d.shape[0], t + 1)
    v = d
    if t:
        w = torch.linalg.vecdot(Q, v[:, None, :])  # [n, t]
        v = v - (w[:, :, None] * Q).sum(1)
        needed = (v.square().sum(1) < REORTHOGONALIZE * d.square().sum(1)).any()
        if sync_free:
            again = torch.linalg.vecdot(Q, v[:, None, :])
            v = torch.where(needed, v - (again[:, :, None] * Q).sum(1), v)
            w = torch.where(needed, w + again, w)
        elif bool(needed):
            again = torch.linalg.vecdot(Q, v[:, None, :])
            v = v - (again[:, :, None] * Q).sum(1)
            w = w + again
        row[:, :t] = w
    norm = v.norm(dim=1)
    row[:, t] = norm
    return v / norm.clamp_min(torch.finfo(v.dtype).tiny)[:, None], row


def gather_atoms(W_dec: Tensor, indices: Tensor, dtype: torch.dtype) -> Tensor:
    """``W_dec[indices]`` as ``[B, k, d_in]`` in ``dtype`` (atom 0 for the −1 of a step not taken,
    whose coefficient is 0)."""
    n_tokens, k = indices.shape
    return W_dec.index_select(0, indices.clamp_min(0).reshape(-1)).view(n_tokens, k, -1).to(dtype)


class LeastSquaresFunction(torch.autograd.Function):
    """``(x, W_dec, b_pre, indices, L, z) -> (coefficients [B, k], x_hat [B, d_in])``: the least-squares
    fit of ``x − b_pre`` on the atoms ``indices``, given their factor ``L`` and ``z = Q (x − b_pre)``
    from `select_atoms`. Differentiable in ``x``, ``W_dec``, ``b_pre`` (module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, W_dec: Tensor, b_pre: Tensor, indices: Tensor, L: Tensor, z: Tensor
    ) -> tuple[Tensor, Tensor]:
        dtype = L.dtype
        c = torch.linalg.solve_triangular(L.mT, z[:, :, None], upper=True)[:, :, 0]  # Lᵀ c = z
        atoms = gather_atoms(W_dec, indices, dtype)
        x_hat = torch.bmm(c[:, None, :], atoms)[:, 0] + b_pre.to(dtype)
        ctx.save_for_backward(x, W_dec, b_pre, indices, L, c)
        return c.to(x.dtype), x_hat.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_c: Tensor | None, grad_x_hat: Tensor | None) -> tuple[Tensor | None, ...]:
        x, W_dec, b_pre, indices, L, c = ctx.saved_tensors
        dtype = L.dtype
        atoms = gather_atoms(W_dec, indices, dtype)  # D_S [B, k, d_in]
        g = torch.zeros(x.shape, dtype=dtype, device=x.device) if grad_x_hat is None else grad_x_hat.to(dtype)
        gamma = torch.bmm(atoms, g[:, :, None])  # D_S g [B, k, 1]
        if grad_c is not None:
            gamma += grad_c.to(dtype)[:, :, None]
        gamma.masked_fill_(indices[:, :, None] < 0, 0.0)  # steps not taken: no atom, no gradient
        # G⁻¹ γ by two triangular solves (G = L Lᵀ): cuBLAS's batched trsm can be captured in a CUDA graph,
        # `torch.cholesky_solve` (MAGMA's batched potrs on CUDA) cannot
        lam = torch.linalg.solve_triangular(L, gamma, upper=False)
        lam = torch.linalg.solve_triangular(L.mT, lam, upper=True)
        lifted = torch.bmm(lam.transpose(1, 2), atoms)[:, 0]  # D_Sᵀ λ [B, d_in]
        u = g - lifted
        grad_x = lifted.to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_b_pre = u.sum(0).to(b_pre.dtype) if ctx.needs_input_grad[2] else None
        grad_W = None
        if ctx.needs_input_grad[1]:
            r = x.to(dtype) - b_pre.to(dtype) - torch.bmm(c[:, None, :], atoms)[:, 0]
            grad_atoms = lam * r[:, None, :]  # λ_i r + c_i u
            grad_atoms.addcmul_(c[:, :, None], u[:, None, :])
            grad_W = torch.zeros(W_dec.shape, dtype=dtype, device=x.device)
            grad_W.index_add_(0, indices.clamp_min(0).reshape(-1), grad_atoms.view(-1, W_dec.shape[1]))
            grad_W = grad_W.to(W_dec.dtype)
        return grad_x, grad_W, grad_b_pre, None, None, None


def orthogonal_matching_pursuit(
    x: Tensor,
    W_dec: Tensor,
    b_pre: Tensor,
    k: int,
    workspace: Workspace | None = None,
    sync_free: bool = False,
    fused: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(indices [B, k], coefficients [B, k], x_hat [B, d_in])`` of k OMP steps, differentiable in
    ``x``, ``W_dec`` and ``b_pre`` as autograd through the plain loop (``sync_free``: see select_atoms)."""
    y = x.detach() - b_pre.detach()
    if fused is None and fused_available(y.device):  # a kernel that fails on this GPU: torch's operators
        indices, L, z, _ = with_kernels(
            lambda: select_atoms(y, W_dec, k, workspace, sync_free, True),
            lambda: select_atoms(y, W_dec, k, workspace, sync_free, False),
        )
    else:
        indices, L, z, _ = select_atoms(y, W_dec, k, workspace, sync_free, fused)
    coefficients, x_hat = LeastSquaresFunction.apply(x, W_dec, b_pre, indices, L, z)
    return indices, coefficients, x_hat
