"""Matching Pursuit, fast and exact: greedy selection without autograd, then a hand-written
backward over the selected atoms only.

The function computed is the paper's Algorithm 1 (Costa et al. 2025, MP-SAE)::

    r_0 = x − b_pre
    for t = 1..k:  j_t = argmax_j <r_{t-1}, d_j>;  c_t = <r_{t-1}, d_{j_t}>;  r_t = r_{t-1} − c_t d_{j_t}
    codes = Σ_t c_t e_{j_t};  x_hat = codes @ W_dec + b_pre

with gradients flowing through the ``c_t`` and the residual updates but not through the
argmax — what autograd through that loop gives. Autograd through the loop itself costs two
dense ``[B, d_sae]`` matmuls per step and keeps ``k`` such tensors for backward. Here:

1. :func:`select_atoms` (no grad) finds the indices ``[B, k]``. Correlations start as one
   matmul ``C = r_0 @ W_decᵀ``; each later step either updates them with a row of the Gram
   matrix, ``C −= c_j · G[j]`` (``G = W_dec W_decᵀ``, ``B·d_sae`` memory-bound work per step,
   ``2·d_sae²·d_in`` FLOPs once, half that by syrk on CPU: :mod:`.gram`), or recomputes them
   with a matmul (``2·B·d_in·d_sae`` FLOPs per step). See `pursuit_cost.prefer_gram` for the choice.
   A large Gram matrix is formed per call and freed before the backward (it is the step's
   memory peak: d_sae² elements); one up to ``CPU_KEPT_GRAM_BYTES`` is kept between steps on CPU.
2. :class:`MatchingPursuitFunction` recomputes the ``c_t`` and ``x_hat`` from the indices on
   ``[B, d_in]`` tensors (so the outputs never depend on Gram-path rounding) and saves only
   the inputs, the indices and the coefficients ``[B, k]``. Its backward is a reverse scan
   over t with ``[B, d_in]`` adjoints; gradients reach ``W_dec`` by ``index_add_`` (on CPU
   per block of tokens, so that its scratch stays within ``CPU_BACKWARD_SCRATCH_BYTES``).

Backward, derived by hand. With ``D_t = W_dec[j_t]`` (per token), upstream gradients
``ḡ_t`` on ``c_t`` and ``g`` on ``x_hat``, and ``a_t`` the adjoint of ``r_t`` (``a_k = 0``,
since ``x_hat = b_pre + Σ c_t D_t`` does not read ``r_k``), for t = k..1::

    γ_t   = ḡ_t + <g, D_t> − <a_t, D_t>          total adjoint of c_t
    ∂D_t  = γ_t r_{t-1} + c_t (g − a_t)          (c_t = <r_{t-1}, D_t>, r_t = r_{t-1} − c_t D_t, x_hat)
    a_{t-1} = a_t + γ_t D_t
    ∂x = a_0,   ∂b_pre = Σ_batch (g − a_0),   ∂W_dec[j] = Σ_{(b,t): j_t = j} ∂D_t

The code carries ``u_t = g − a_t`` instead of ``a_t`` (one pass fewer per step), and
recovers ``r_{t-1}`` in the reverse scan as ``r_t + c_t D_t``, starting from ``r_k`` recomputed
by the forward's own updates; no residual is stored.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from sae_pipeline.sae.gram import gram_into, uses_syrk
from sae_pipeline.sae.pursuit_cost import compute_dtype, element_cost, gemm_dtype, prefer_gram
from sae_pipeline.sae.sparse_decode import with_kernels
from sae_pipeline.sae.triton_pursuit import fused_available, mp_select

Selection = Literal["auto", "gram", "matmul"]

# Rows of the batch processed together on CPU: the correlations of a chunk (chunk × d_sae)
# then stay in cache across the k steps; on GPUs the whole batch runs at once.
CPU_CHUNK_ROWS = 256
# The backward's gathered atoms and their gradients (2 · k · d_in per token) on CPU are made
# for as many tokens at a time as fit here, not for the whole batch (k · B · d_in each,
# 96 MiB apiece at B = 1024, k = 32, d_in = 768); these two bounded buffers are kept in the workspace.
CPU_BACKWARD_SCRATCH_BYTES = 32 * 2**20
# A Gram matrix up to this size (d_sae = 4096 in float32) is kept in the workspace between
# steps; a larger one lives for its selection only: kept, it would be held through the backward
# pass and the optimiser step too (256 MiB at d_sae = 8192, the step's peak either way).
CPU_KEPT_GRAM_BYTES = 64 * 2**20


def argmax_block_size(d_sae: int) -> int | None:
    """Block size for :func:`first_argmax`: the divisor of ``d_sae`` in [32, 512] closest to
    ``√d_sae`` (the two argmax passes then scan ``d_sae/b + b`` elements, least near ``√d_sae``;
    64 at d_sae = 4096), or None when there is none (then plain argmax)."""
    divisors = [b for b in range(32, 513) if d_sae % b == 0 and b < d_sae]
    return min(divisors, key=lambda b: abs(math.log(b * b / d_sae))) if divisors else None


def first_argmax(corr: Tensor, block: int | None) -> tuple[Tensor, Tensor]:
    """``(index, value)`` of each row's maximum, the first one on ties, as ``torch.argmax``.

    CPU ``argmax`` is not vectorised (about 15x slower than ``amax``), so the row is cut into
    contiguous blocks: ``amax`` per block, argmax over the block maxima (first block holding
    the maximum), then argmax inside that block (first position): the same index.
    """
    if block is None:
        index = corr.argmax(dim=1)
        return index, corr.gather(1, index[:, None])
    n_rows, width = corr.shape
    blocks = corr.view(n_rows, width // block, block)
    block_max = blocks.amax(dim=2)
    best_block = block_max.argmax(dim=1)
    rows = torch.arange(n_rows, device=corr.device)
    inside = blocks[rows, best_block].argmax(dim=1)
    return best_block * block + inside, block_max.gather(1, best_block[:, None])


class Workspace:
    """Scratch tensors kept between calls, on CPU only.

    On CPU a fresh multi-MB tensor is mapped anew by the allocator and page-faults on first
    touch, every training step; reusing one buffer avoids that. Only buffers that stay small
    belong here (MP's correlations of one row chunk, ``CPU_CHUNK_ROWS × d_sae``, a Gram matrix
    up to ``CPU_KEPT_GRAM_BYTES`` and the backward's atoms of ``CPU_BACKWARD_SCRATCH_BYTES``
    worth of tokens): what is kept is held through the backward pass and the optimiser step
    too, so a larger Gram matrix is allocated per call instead. On GPUs the caching allocator
    already reuses memory, so nothing is kept. Not part of any state_dict.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}

    def __deepcopy__(self, memo: dict) -> Workspace:
        return Workspace()  # scratch content is never worth copying

    def clear(self) -> None:
        """Free the kept buffers (e.g. after a large evaluation on CPU)."""
        self.tensors.clear()

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialised tensor of ``shape`` (a view of a kept buffer on CPU)."""
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        numel = math.prod(shape)
        kept = self.tensors.get(name)
        if kept is None or kept.dtype != dtype or kept.numel() < numel:
            kept = torch.empty(numel, dtype=dtype, device=device)
            self.tensors[name] = kept
        return kept[:numel].view(shape)


def correlate(r: Tensor, W_dec: Tensor, out: Tensor) -> None:
    """``out = r @ W_decᵀ`` in place (through a cast when ``out`` is the float32 work dtype)."""
    if out.dtype == r.dtype:
        torch.matmul(r, W_dec.T, out=out)
    else:
        out.copy_(r @ W_dec.T)


@torch.no_grad()
def select_atoms(
    residual: Tensor,
    W_dec: Tensor,
    k: int,
    selection: Selection = "auto",
    workspace: Workspace | None = None,
    fused: bool | None = None,
) -> Tensor:
    """Greedy MP indices ``[B, k]`` (int64) for ``r_0 = residual [B, d_in]``; no autograd.

    Atoms may repeat. In float32 a near-tie may resolve differently from the plain loop
    (rounding of the updated correlations); in float64 the choice is the same. ``fused`` (None: on
    CUDA with Triton) runs the Gram path as one kernel per step (`triton_pursuit.mp_select`).
    """
    n_tokens = residual.shape[0]
    d_sae, d_in = W_dec.shape
    work_dtype = compute_dtype(residual.dtype)
    fused = fused_available(residual.device) if fused is None else fused
    gemm = gemm_dtype(residual) if fused else residual.dtype
    if selection == "auto":
        cost = element_cost(residual.device, gemm, fused)
        size = torch.finfo(gemm if fused else work_dtype).bits // 8
        use_gram = prefer_gram(n_tokens, k, d_in, d_sae, cost, size, uses_syrk(residual.device, work_dtype))
    elif selection in ("gram", "matmul"):
        use_gram = selection == "gram" and k > 1
    else:
        raise ValueError(f"selection must be 'auto', 'gram' or 'matmul', got {selection!r}")
    if fused and use_gram:  # a kernel that fails on this GPU: the same selection by torch's operators
        return with_kernels(
            lambda: mp_select(residual, W_dec, k, work_dtype, gemm),
            lambda: select_atoms(residual, W_dec, k, selection, workspace, fused=False),
        )
    residual = residual.detach()
    W_dec = W_dec.detach()
    workspace = Workspace() if workspace is None else workspace
    device = residual.device
    on_cpu = device.type == "cpu"
    gram = None
    if use_gram:  # kept between steps only while small (page faults of a fresh one cost ~1/3 of its matmul)
        gram_bytes = d_sae * d_sae * torch.finfo(work_dtype).bits // 8
        keep = gram_bytes <= CPU_KEPT_GRAM_BYTES
        gram = (
            workspace.get("gram", (d_sae, d_sae), work_dtype, device)
            if keep
            else torch.empty(d_sae, d_sae, dtype=work_dtype, device=device)
        )
    if gram is not None:
        gram_into(W_dec, gram)
    indices = torch.empty(n_tokens, k, dtype=torch.int64, device=device)
    chunk = CPU_CHUNK_ROWS if on_cpu else max(n_tokens, 1)
    block = argmax_block_size(d_sae) if on_cpu else None
    rows_max = min(chunk, n_tokens)
    corr_buffer = workspace.get("correlations", (rows_max, d_sae), work_dtype, device)
    rows_buffer = workspace.get("gram_rows", (rows_max, d_sae), work_dtype, device) if gram is not None else None
    for start in range(0, n_tokens, chunk):
        r = residual[start : start + chunk]
        out = indices[start : start + chunk]
        n_rows = r.shape[0]
        corr = corr_buffer[:n_rows]
        correlate(r, W_dec, corr)
        for t in range(k):
            j, c = first_argmax(corr, block)
            out[:, t] = j
            if t == k - 1:
                break
            if gram is None or rows_buffer is None:
                r = r - c.to(r.dtype) * W_dec.index_select(0, j)
                correlate(r, W_dec, corr)
            else:
                corr.addcmul_(torch.index_select(gram, 0, j, out=rows_buffer[:n_rows]), c, value=-1.0)
    return indices


class MatchingPursuitFunction(torch.autograd.Function):
    """``(x, W_dec, b_pre, indices) -> (coefficients [B, k], x_hat [B, d_in])`` for fixed indices.

    Saves only its inputs and the coefficients; see the module docstring for the backward.
    """

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, W_dec: Tensor, b_pre: Tensor, indices: Tensor, workspace: Workspace | None = None
    ) -> tuple[Tensor, Tensor]:
        dtype = compute_dtype(x.dtype)
        n_tokens, k = indices.shape
        r = x.to(dtype) - b_pre.to(dtype)
        recon = torch.zeros_like(r)
        coefficients = r.new_empty(n_tokens, k)
        for t in range(k):
            d = W_dec.index_select(0, indices[:, t]).to(dtype)
            c = torch.linalg.vecdot(r, d)
            coefficients[:, t] = c
            c = c[:, None]
            r.addcmul_(d, c, value=-1.0)
            recon.addcmul_(d, c)
        x_hat = recon + b_pre.to(dtype)
        coefficients = coefficients.to(x.dtype)
        ctx.save_for_backward(x, W_dec, b_pre, indices, coefficients)
        ctx.workspace = Workspace() if workspace is None else workspace
        return coefficients, x_hat.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_coefficients: Tensor | None, grad_x_hat: Tensor | None) -> tuple[Tensor | None, ...]:
        x, W_dec, b_pre, indices, coefficients = ctx.saved_tensors
        dtype = compute_dtype(x.dtype)
        n_tokens, k = indices.shape
        d_in = W_dec.shape[1]
        c = coefficients.to(dtype)
        g = None if grad_x_hat is None else grad_x_hat.to(dtype)
        g_c = None if grad_coefficients is None else grad_coefficients.to(dtype)
        r = x.to(dtype) - b_pre.to(dtype)
        u = torch.zeros_like(r) if g is None else g.clone()
        grad_W_dec = torch.zeros(W_dec.shape, dtype=dtype, device=x.device) if ctx.needs_input_grad[1] else None
        rows = n_tokens
        if (
            x.device.type == "cpu" and n_tokens > 0
        ):  # bounded scratch: atoms and their gradients of `rows` tokens, blocks of equal size
            fit = max(1, CPU_BACKWARD_SCRATCH_BYTES // (2 * k * d_in * torch.finfo(dtype).bits // 8))
            rows = -(-n_tokens // -(-n_tokens // fit))
        atoms = ctx.workspace.get("atoms", (k * min(rows, n_tokens), d_in), dtype, x.device)
        grad_atoms = ctx.workspace.get("grad_atoms", (k * min(rows, n_tokens), d_in), dtype, x.device)
        for start in range(0, n_tokens, rows):
            part = slice(start, start + rows)
            g_c_part = None if g_c is None else g_c[part]
            reverse_scan(W_dec, indices[part], c[part], g_c_part, r[part], u[part], grad_W_dec, atoms, grad_atoms)
        grad_x = None
        if ctx.needs_input_grad[0]:  # ∂x = a_0 = g − u_0
            grad_x = (-u if g is None else g - u).to(x.dtype)
        grad_b_pre = u.sum(0).to(b_pre.dtype) if ctx.needs_input_grad[2] else None  # Σ (g − a_0)
        if grad_W_dec is not None:
            grad_W_dec = grad_W_dec.to(W_dec.dtype)
        return grad_x, grad_W_dec, grad_b_pre, None, None


def reverse_scan(
    W_dec: Tensor,
    indices: Tensor,
    c: Tensor,
    g_c: Tensor | None,
    r: Tensor,
    u: Tensor,
    grad_W_dec: Tensor | None,
    atoms_buffer: Tensor,
    grad_atoms_buffer: Tensor,
) -> None:
    """The backward's reverse scan for a block of tokens, in place: ``r`` enters as ``r_0`` and
    ``u`` as ``g``, ``u`` leaves as ``u_0``; the atoms' gradients are added to ``grad_W_dec``.
    The buffers (``[≥ k·n, d_in]``) hold the block's atoms and their gradients."""
    n_tokens, k = indices.shape
    d_in = W_dec.shape[1]
    dtype = r.dtype
    # D_t for all t, step-major so that each step's [n, d_in] slice is contiguous.
    flat_indices = indices.T.reshape(-1)
    atoms = atoms_buffer[: k * n_tokens].view(k, n_tokens, d_in)
    if W_dec.dtype == dtype:
        torch.index_select(W_dec, 0, flat_indices, out=atoms.view(-1, d_in))
    else:
        atoms.view(-1, d_in).copy_(W_dec.index_select(0, flat_indices))
    for t in range(k):  # r_k, by the same operations as the forward pass
        r.addcmul_(atoms[t], c[:, t, None], value=-1.0)
    # u_t = g − a_t (a_t: adjoint of r_t, a_k = 0); then γ_t = ḡ_t + <u_t, D_t>,
    # ∂D_t = γ_t r_{t-1} + c_t u_t and u_{t-1} = u_t − γ_t D_t.
    grad_atoms = None if grad_W_dec is None else grad_atoms_buffer[: k * n_tokens].view(k, n_tokens, d_in)
    for t in range(k - 1, -1, -1):
        d = atoms[t]
        c_t = c[:, t, None]
        gamma = torch.linalg.vecdot(u, d)
        if g_c is not None:
            gamma += g_c[:, t]
        gamma = gamma[:, None]
        r.addcmul_(d, c_t)  # r_{t-1}
        if grad_atoms is not None:
            torch.mul(r, gamma, out=grad_atoms[t])
            grad_atoms[t].addcmul_(u, c_t)
        u.addcmul_(d, gamma, value=-1.0)
    if grad_W_dec is not None and grad_atoms is not None:
        grad_W_dec.index_add_(0, flat_indices, grad_atoms.view(-1, d_in))


def matching_pursuit(
    x: Tensor,
    W_dec: Tensor,
    b_pre: Tensor,
    k: int,
    selection: Selection = "auto",
    workspace: Workspace | None = None,
    fused: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(indices [B, k], coefficients [B, k], x_hat [B, d_in])`` of k MP steps, differentiable
    in ``x``, ``W_dec`` and ``b_pre`` exactly as autograd through the plain loop."""
    indices = select_atoms(x.detach() - b_pre.detach(), W_dec, k, selection, workspace, fused)
    coefficients, x_hat = MatchingPursuitFunction.apply(x, W_dec, b_pre, indices, workspace)
    return indices, coefficients, x_hat
