"""One pursuit step on a GPU as one Triton kernel: the correlation update fused with the next argmax.

MP-SAE and OMP-SAE keep the correlations ``C [B, d_sae]`` of every token with every atom and, per step,
update them and take each row's argmax. In PyTorch ops that is several passes over ``C`` per step
(MP: gather the Gram rows ``G[j]`` into a ``[B, d_sae]`` copy, ``addcmul``, ``argmax``, ``gather``;
OMP adds a ``scatter`` of the picked atom, the squared-distance update and a ``masked_fill``), each
reading and writing ``B·d_sae`` elements from memory: at B 4096, d_sae 19 200 one pass is 315 MB in
float32, and the steps are memory-bound. This kernel streams each row once per step:

    C'[b, i] = C[b, i] − coef[b] · R[row(b), i]        R = G (MP: row(b) = j_b) or P (OMP: row(b) = b)
    OMP only: C'[b, j_b] = −inf (picked: never again);  D'[b, i] = D[b, i] − P[b, i]²,
              C'[b, i] = −inf where D'[b, i] ≤ tol[i]   (atom in the span of the picked ones)
    out_index[b] = argmax_i C'[b, i] (first on ties, as ``torch.argmax``),  out_value[b] = C'[b, out_index[b]]

The argmax is signed (the largest correlation, not the largest magnitude), as both pursuits define it.
It writes ``C'`` back only when a later step reads it (``store``), and the running maximum is kept per
lane of the tile (a compare per element, no reduction per tile), reduced across lanes once per row.
``C`` may start in another dtype than the one it is kept in (``c_in`` read, ``c_out`` written: the
first update reads the bf16 correlations of a bf16 GEMM and keeps float32), so no cast pass is needed.

Used by `mp_autograd.select_atoms` and `omp_autograd.select_atoms` on CUDA when Triton is installed
(`fused_available`); the CPU keeps its PyTorch path. The tests run this kernel on the CPU under
``TRITON_INTERPRET=1`` (``tests/test_triton_pursuit.py``), which must be set before the kernel is
built: it is built on first use (`_kernel`), not at import.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

#: Rows per program and columns per tile: a program streams ``BLOCK_ROWS`` rows in tiles of
#: ``BLOCK_COLUMNS`` (4 × 512 elements, 8 KiB of float32 per operand per tile).
BLOCK_ROWS = 4
BLOCK_COLUMNS = 512


@functools.cache
def triton_installed() -> bool:
    """Whether Triton can be imported (it ships with PyTorch's CUDA wheels on Linux)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fused_available(device: torch.device) -> bool:
    """Whether the pursuits take this kernel by default on ``device``: CUDA with Triton installed, and no
    Triton kernel has failed in this process (`sparse_decode.with_kernels`)."""
    from sae_pipeline.sae import sparse_decode

    return device.type == "cuda" and sparse_decode.use_triton and triton_installed()


@functools.cache
def _kernel() -> Any:
    """The jitted kernel, built on first use (Triton reads ``TRITON_INTERPRET`` when it is built)."""
    import triton
    import triton.language as tl

    @triton.jit
    def update_argmax_kernel(
        c_in,
        c_out,
        stride_c_in,
        stride_c_out,
        rows,
        stride_rows,
        row_index,
        stride_row_index,
        coef,
        dist,
        stride_dist,
        tol,
        out_index,
        stride_out_index,
        out_value,
        n_rows,
        width,
        UPDATE: tl.constexpr,
        GATHER: tl.constexpr,
        MASK_PICKED: tl.constexpr,
        DISTANCES: tl.constexpr,
        STORE: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b = pid * BLOCK_B + tl.arange(0, BLOCK_B)
        b_ok = b < n_rows
        b64 = b.to(tl.int64)
        lanes = tl.arange(0, BLOCK_N)
        if UPDATE:
            picked = tl.load(row_index + b64 * stride_row_index, mask=b_ok, other=0)
            picked = tl.maximum(picked, 0)  # OMP's −1 (a step not taken) masks atom 0, as its PyTorch path
            c = tl.load(coef + b, mask=b_ok, other=0.0).to(c_out.dtype.element_ty)
            if GATHER:
                r_row = picked.to(tl.int64) * stride_rows
            else:
                r_row = b64 * stride_rows
        best = tl.full((BLOCK_B, BLOCK_N), float("-inf"), c_out.dtype.element_ty)
        best_at = tl.zeros((BLOCK_B, BLOCK_N), tl.int64) + lanes[None, :].to(tl.int64)
        for start in range(0, width, BLOCK_N):
            col = start + lanes
            ok = b_ok[:, None] & (col < width)[None, :]
            corr = tl.load(c_in + b64[:, None] * stride_c_in + col[None, :], mask=ok, other=0.0).to(
                c_out.dtype.element_ty
            )
            if UPDATE:
                r = tl.load(rows + r_row[:, None] + col[None, :], mask=ok, other=0.0).to(c_out.dtype.element_ty)
                corr = corr - c[:, None] * r
                if MASK_PICKED:
                    corr = tl.where(col[None, :] == picked[:, None], float("-inf"), corr)
                if DISTANCES:
                    d_ptr = dist + b64[:, None] * stride_dist + col[None, :]
                    d = tl.load(d_ptr, mask=ok, other=0.0) - r * r
                    tl.store(d_ptr, d, mask=ok)
                    t = tl.load(tol + col, mask=col < width, other=0.0)
                    corr = tl.where(d <= t[None, :], float("-inf"), corr)
                if STORE:
                    tl.store(c_out + b64[:, None] * stride_c_out + col[None, :], corr, mask=ok)
            corr = tl.where(ok, corr, float("-inf"))
            better = corr > best  # strict: an earlier column keeps a tie
            best = tl.where(better, corr, best)
            best_at = tl.where(better, col[None, :].to(tl.int64), best_at)
        top = tl.max(best, axis=1)
        first = tl.min(tl.where(best == top[:, None], best_at, width + BLOCK_N), axis=1)
        tl.store(out_index + b64 * stride_out_index, first, mask=b_ok)
        tl.store(out_value + b, top, mask=b_ok)

    return update_argmax_kernel


def update_argmax(
    c_in: Tensor,
    out_index: Tensor,
    out_value: Tensor,
    c_out: Tensor | None = None,
    rows: Tensor | None = None,
    row_index: Tensor | None = None,
    coef: Tensor | None = None,
    gather: bool = True,
    mask_picked: bool = False,
    distances: Tensor | None = None,
    tolerance: Tensor | None = None,
    store: bool = True,
) -> None:
    """One step, in place (module docstring): ``out_index [B]`` (int64, may be a strided column of the
    indices) and ``out_value [B]`` (``c_out``'s dtype) get each row's argmax and maximum; with ``rows``
    the correlations are first updated (``c_out`` written when ``store``).

    ``c_in``/``c_out`` ``[B, width]`` with unit column stride (``c_out`` defaults to ``c_in``); ``rows``:
    ``G [d_sae, width]`` indexed by ``row_index`` (``gather``) or ``P [B, width]`` row by row; ``coef [B]``
    contiguous, may be ``out_value`` itself (read before written, row by row); ``row_index [B]`` int64,
    also the column masked by ``mask_picked``; ``distances [B, width]`` (updated in place) and
    ``tolerance [width]``: OMP's rank rule.
    """
    n_rows, width = c_in.shape
    c_out = c_in if c_out is None else c_out
    update = rows is not None
    if update and (row_index is None or coef is None):
        raise ValueError("update_argmax: rows need row_index and coef")
    for name, t in (("c_in", c_in), ("c_out", c_out), ("rows", rows), ("distances", distances)):
        if t is not None and t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"update_argmax: {name} needs unit column stride; pass {name}.contiguous()")
    if coef is not None and coef.stride(0) != 1:
        raise ValueError("update_argmax: coef must be contiguous; pass coef.contiguous()")
    if n_rows == 0:
        return
    # Unused pointers get a harmless tensor of the right kind (constexpr flags keep them unread).
    rows_t = rows if rows is not None else c_in
    index_t = row_index if row_index is not None else out_index
    coef_t = coef if coef is not None else out_value
    dist_t = distances if distances is not None else c_out
    tol_t = tolerance if tolerance is not None else out_value
    grid = (-(-n_rows // BLOCK_ROWS),)
    _kernel()[grid](
        c_in,
        c_out,
        c_in.stride(0),
        c_out.stride(0),
        rows_t,
        rows_t.stride(0),
        index_t,
        index_t.stride(0),
        coef_t,
        dist_t,
        dist_t.stride(0),
        tol_t,
        out_index,
        out_index.stride(0),
        out_value,
        n_rows,
        width,
        UPDATE=update,
        GATHER=gather,
        MASK_PICKED=mask_picked and update,
        DISTANCES=distances is not None and update,
        STORE=store and update,
        BLOCK_B=BLOCK_ROWS,
        BLOCK_N=BLOCK_COLUMNS,
    )


def mp_select(residual: Tensor, W_dec: Tensor, k: int, work_dtype: torch.dtype, gemm_dtype: torch.dtype) -> Tensor:
    """MP's greedy indices ``[B, k]`` by Gram updates, one kernel launch per step (no autograd).

    The first correlations ``r_0 W_decᵀ`` and the Gram matrix ``G = W_dec W_decᵀ`` are GEMMs in
    ``gemm_dtype`` (bf16 under autocast: what the plain loop's matmuls run in there); the correlations
    are then kept and updated in ``work_dtype`` (float32 for half inputs). Same algorithm as the PyTorch
    Gram path of `mp_autograd.select_atoms`, so the same indices up to rounding at near-ties.
    """
    n_tokens = residual.shape[0]
    W = W_dec.detach().to(gemm_dtype)
    first = residual.detach().to(gemm_dtype) @ W.T  # [B, d_sae]
    corr = first if first.dtype == work_dtype else torch.empty(first.shape, dtype=work_dtype, device=first.device)
    indices = torch.empty(n_tokens, k, dtype=torch.int64, device=residual.device)
    value = torch.empty(n_tokens, dtype=work_dtype, device=residual.device)
    update_argmax(first, indices[:, 0], value, c_out=corr)
    if k == 1:
        return indices
    gram = W @ W.T
    for t in range(1, k):
        update_argmax(
            first if t == 1 else corr,
            indices[:, t],
            value,
            c_out=corr,
            rows=gram,
            row_index=indices[:, t - 1],
            coef=value,
            store=t < k - 1,
        )
    return indices


def omp_step(
    corr: Tensor,
    indices: Tensor,
    t: int,
    best: Tensor,
    proj: Tensor,
    z: Tensor,
    distances: Tensor | None,
    tolerance: Tensor,
) -> tuple[Tensor, Tensor]:
    """OMP's step ``t`` of `omp_autograd.select_atoms` in place, ``(indices[:, t], best [B, 1])``: from ``t = 1`` the
    previous step's update ``corr −= z[:, t−1] · proj`` (``proj = q_{t−1} W_decᵀ``), the picked atom
    ``indices[:, t−1]`` masked and, given ``distances``, the rank rule; then the argmax."""
    if t == 0:
        update_argmax(corr, indices[:, 0], best)
    else:
        update_argmax(
            corr,
            indices[:, t],
            best,
            rows=proj,
            row_index=indices[:, t - 1],
            coef=z[:, t - 1].contiguous(),
            gather=False,
            mask_picked=True,
            distances=distances,
            tolerance=tolerance,
        )
    return indices[:, t], best[:, None]
