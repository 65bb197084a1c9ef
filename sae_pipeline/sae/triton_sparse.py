"""Triton kernels for the three sparse products of `sparse_decode.py`, used on a GPU.

`F.embedding_bag` gives all three on the CPU, where it is a tight loop. On a GPU its backward-side
helpers and the `per_sample_weights` cast cost extra launches and passes, and the W_dec gradient it
would give through autograd is a scatter with atomics. Here each product is one kernel:

- `segment_sums`: ``out[s] = Σ_{e in segment s} w[e] · table[index[e]]`` for CSR segments. With the
  token-major CSR of `SparseCodes` it is the decode (and the W_enc.T gather of the input gradient);
  with the latent-major order (`SparseCodes.by_latent`) it is ``∂W_dec`` / ``∂W_enc``: each program
  owns one output row (a latent) and sums that latent's entries, so no atomics and no zero-fill
  (a latent with no entry writes a row of zeros), and the sums are deterministic. The per-entry
  weights are read through the permutation in the kernel (no permuted copy).
- `entry_dots`: ``out[e] = ⟨tokens[rows[e]], weight[indices[e]]⟩``, a block of entries per program.

Operands may be float32, bfloat16 or float16; every sum accumulates in float32 and is stored in
the output's dtype. The kernels take any strides (no `.contiguous()` copy of `W_enc.T`).

Fewer flops than the dense GEMMs is not always less time (cuBLAS's GEMM beat the latent-major sums at the
paper's shape on an H200), so `sparse_decode.py` runs each product here only where this process measured it
faster than its cuBLAS form (`product_choice.py`).

Tests run these kernels on the CPU under `TRITON_INTERPRET=1` (`tests/test_triton_sparse.py`; the
interpreter is chosen when `triton.jit` decorates, so the test loads its own copy of this module
with the variable set); `tests/test_gpu_sparse_kernels.py` runs them on CUDA.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs none of this
    triton = None

#: Operand dtypes the kernels take; anything else (float64) stays on `F.embedding_bag`.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: ``(entries per step of a segment, columns per program, warps)`` of `segment_sums`: a
#: ``[BLOCK_E, BLOCK_D]`` tile of gathered rows per step. Chosen by `benchmarks/sparse_kernels.py --sweep`
#: on an H200 (bf16, d_in 768, d_sae 19 200, k 32, B 4 096; BENCHMARKS.md): token-major segments (k entries
#: each: the decode, the input gradient) 0.246 → 0.053 ms at (32, 128, 2) against the first (16, 128, 4);
#: latent-major ones (a few entries each: ``∂W_dec``, ``∂W_enc``) 0.599 → 0.176 ms at (16, 256, 2).
TOKEN_MAJOR_TILE = (32, 128, 2)
LATENT_MAJOR_TILE = (16, 256, 2)


def applies(*tensors: Tensor) -> bool:
    """Whether the kernels run for these operands: Triton imported, CUDA tensors of a kernel dtype."""
    return triton is not None and all(t.is_cuda and t.dtype in KERNEL_DTYPES for t in tensors)


if triton is not None:

    @triton.jit
    def _segment_sums_kernel(
        out_ptr,
        table_ptr,
        index_ptr,
        weight_ptr,
        order_ptr,
        offsets_ptr,
        d,
        stride_out,
        stride_row,
        stride_col,
        HAS_ORDER: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        segment = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < d
        start = tl.load(offsets_ptr + segment)
        end = tl.load(offsets_ptr + segment + 1)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for first in range(start, end, BLOCK_E):
            entries = first + tl.arange(0, BLOCK_E)
            ok = entries < end
            rows = tl.load(index_ptr + entries, mask=ok, other=0).to(tl.int64)
            if HAS_ORDER:
                at = tl.load(order_ptr + entries, mask=ok, other=0)
            else:
                at = entries
            w = tl.load(weight_ptr + at, mask=ok, other=0.0).to(tl.float32)
            tile = tl.load(
                table_ptr + rows[:, None] * stride_row + cols[None, :] * stride_col,
                mask=ok[:, None] & col_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(tile * w[:, None], axis=0)
        out = out_ptr + segment.to(tl.int64) * stride_out + cols
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=col_ok)

    @triton.jit
    def _entry_dots_kernel(
        out_ptr,
        tokens_ptr,
        weight_ptr,
        rows_ptr,
        index_ptr,
        nnz,
        d,
        stride_t_row,
        stride_t_col,
        stride_w_row,
        stride_w_col,
        BLOCK_E: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        entries = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        ok = entries < nnz
        rows = tl.load(rows_ptr + entries, mask=ok, other=0).to(tl.int64)
        latents = tl.load(index_ptr + entries, mask=ok, other=0).to(tl.int64)
        acc = tl.zeros([BLOCK_E], dtype=tl.float32)
        for first in range(0, d, BLOCK_D):
            cols = first + tl.arange(0, BLOCK_D)
            both = ok[:, None] & (cols < d)[None, :]
            a = tl.load(tokens_ptr + rows[:, None] * stride_t_row + cols[None, :] * stride_t_col, mask=both, other=0.0)
            b = tl.load(
                weight_ptr + latents[:, None] * stride_w_row + cols[None, :] * stride_w_col, mask=both, other=0.0
            )
            acc += tl.sum(a.to(tl.float32) * b.to(tl.float32), axis=1)
        tl.store(out_ptr + entries, acc.to(out_ptr.dtype.element_ty), mask=ok)


def segment_sums(
    offsets: Tensor,
    index: Tensor,
    table: Tensor,
    weights: Tensor,
    order: Tensor | None = None,
    out: Tensor | None = None,
    *,
    tile: tuple[int, int, int] | None = None,
) -> Tensor:
    """``out[s] = Σ_{offsets[s] ≤ e < offsets[s+1]} weights[order[e] or e] · table[index[e]]``
    ``[len(offsets) − 1, table.shape[1]]`` in ``table``'s dtype (``out``: a contiguous buffer to write,
    e.g. a poisoned one in the tests; every element is written). ``tile``: ``(BLOCK_E, BLOCK_D, warps)``,
    by default the one measured best for the order (with ``order``: latent-major); an argument for
    `benchmarks/sparse_kernels.py --sweep`, which times the alternatives on a GPU."""
    n_segments, d = offsets.numel() - 1, table.shape[1]
    if out is None:
        out = torch.empty(n_segments, d, dtype=table.dtype, device=table.device)
    if n_segments == 0 or d == 0:
        return out.zero_()
    index, weights, offsets = index.contiguous(), weights.contiguous(), offsets.contiguous()
    block_e, block_d, num_warps = tile or (TOKEN_MAJOR_TILE if order is None else LATENT_MAJOR_TILE)
    grid = (n_segments, triton.cdiv(d, block_d))
    _segment_sums_kernel[grid](
        out,
        table,
        index,
        weights,
        index if order is None else order.contiguous(),
        offsets,
        d,
        out.stride(0),
        table.stride(0),
        table.stride(1),
        HAS_ORDER=order is not None,
        BLOCK_E=block_e,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return out


def entry_dots(rows: Tensor, indices: Tensor, tokens: Tensor, weight: Tensor, out: Tensor | None = None) -> Tensor:
    """``out[e] = ⟨tokens[rows[e]], weight[indices[e]]⟩`` ``[nnz]`` in ``tokens``' dtype."""
    nnz, d = indices.numel(), tokens.shape[1]
    if out is None:
        out = torch.empty(nnz, dtype=tokens.dtype, device=tokens.device)
    if nnz == 0:
        return out
    rows, indices = rows.contiguous(), indices.contiguous()
    _entry_dots_kernel[(triton.cdiv(nnz, 32),)](
        out,
        tokens,
        weight,
        rows,
        indices,
        nnz,
        d,
        tokens.stride(0),
        tokens.stride(1),
        weight.stride(0),
        weight.stride(1),
        BLOCK_E=32,
        BLOCK_D=64,
    )
    return out
