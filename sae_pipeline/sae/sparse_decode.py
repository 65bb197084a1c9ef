"""Sparse codes and the two autograd Functions that make a shallow SAE step cost ~1.5 GEMMs.

A shallow SAE with k active latents per token needs one dense GEMM, the encoder's
``pre = (x − b_pre) @ W_enc + b_enc``, to choose its latents. Everything after that touches
only the selected (token, latent) pairs:

- decode: ``x_hat[b] = Σ_{j active in b} z_bj · W_dec[j] + b_pre``
  (``F.embedding_bag``: a gather-and-sum, no ``[B, d_sae]`` codes, no ``[B, k, d_in]`` temporary);
- its backward: ``∂z_bj = ⟨∂x_hat[b], W_dec[j]⟩`` (per-entry dot products) and
  ``∂W_dec[j] = Σ_b z_bj · ∂x_hat[b]`` (the same gather-and-sum over the entries sorted by latent);
- the encoder's backward only over the selected columns: ``∂W_enc[:, j] = Σ_b ∂pre_bj · (x_b − b_pre)``,
  ``∂b_enc[j] = Σ_b ∂pre_bj``, ``∂b_pre = −W_enc · ∂b_enc``.

On a GPU (CUDA tensors of float32/bfloat16/float16, Triton importable) each product runs as a
Triton kernel (`triton_sparse.py`) or as its dense cuBLAS form (the entries scattered into ``[B, d_sae]``,
then one GEMM; for the per-entry dots one GEMM, then the gather), whichever this process measured faster
for the device, dtype and shape (`product_choice.py`: fewer flops is not always less time); everywhere
else, `F.embedding_bag` and ATen's own gradient.

Dense autograd would instead run three more GEMMs of the encoder's size (``codes @ W_dec``, its
two gradients) and a fourth for ``∂W_enc``, and allocate several ``[B, d_sae]`` tensors.

:class:`SparseCodes` is a CSR layout: entries grouped by token, each with a latent index, a value
and its token. It may hold entries whose value is 0 (JumpReLU keeps the latents just below θ,
whose straight-through gradient is not 0); those are not active (``fired``, ``l0`` and
``to_dense`` agree with the dense codes).

At inference the same layout carries the codes ``predict`` and ``features`` read
(``sae_pipeline/sae/inference_codes.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from sae_pipeline.sae import product_choice


class SparseCodes:
    """CSR codes of a batch: ``indices``, ``values``, ``rows`` ``[nnz]``, ``crow`` ``[B + 1]``.

    ``values`` may be None while only the support is known (selection before the encoder
    gather); :meth:`with_values` attaches them. The latent-major order that backward needs is
    computed once per batch and shared by the decoder's and encoder's gradients.
    """

    __slots__ = ("indices", "values", "rows", "crow", "d_sae", "_by_latent")
    _by_latent: tuple[Tensor, Tensor, Tensor] | None

    def __init__(self, indices: Tensor, rows: Tensor, crow: Tensor, d_sae: int, values: Tensor | None = None) -> None:
        self.indices, self.rows, self.crow, self.d_sae, self.values = indices, rows, crow, d_sae, values
        self._by_latent = None

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def from_topk(cls, indices: Tensor, d_sae: int) -> SparseCodes:
        """From per-token ``indices [B, k]`` (every token has k entries)."""
        batch, k = indices.shape
        device = indices.device
        rows = torch.arange(batch, device=device)[:, None].expand(batch, k).reshape(-1)
        crow = torch.arange(0, batch * k + 1, k, device=device)
        return cls(indices.reshape(-1), rows, crow, d_sae)

    @classmethod
    def from_flat(cls, flat_indices: Tensor, batch: int, d_sae: int, is_sorted: bool = False) -> SparseCodes:
        """From indices into the flattened ``[B, d_sae]`` (e.g. a batch-wide top-k), any order (``is_sorted``:
        already ascending, as `topk_select.batch_top_indices` gives them; no sort)."""
        if not is_sorted:
            flat_indices = flat_indices.sort().values
        rows = torch.div(flat_indices, d_sae, rounding_mode="floor")
        return cls(flat_indices - rows * d_sae, rows, row_offsets(rows, batch), d_sae)

    @classmethod
    def from_mask(cls, mask: Tensor) -> SparseCodes:
        """From a bool ``[B, d_sae]`` support."""
        rows, indices = mask.nonzero(as_tuple=True)
        return cls(indices, rows, row_offsets(rows, mask.shape[0]), mask.shape[1])

    def with_values(self, values: Tensor) -> SparseCodes:
        out = SparseCodes(self.indices, self.rows, self.crow, self.d_sae, values)
        out._by_latent = self._by_latent
        return out

    # --- queries ------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.crow.numel() - 1

    def to_dense(self) -> Tensor:
        """Dense codes ``[B, d_sae]`` (differentiable in ``values``)."""
        values = self._values()
        dense = values.new_zeros(self.batch_size, self.d_sae)
        return dense.index_put((self.rows, self.indices), values, accumulate=True)

    @torch.no_grad()
    def fired(self) -> Tensor:
        """Bool ``[d_sae]``: latents with a nonzero code on some token of the batch."""
        hits = torch.zeros(self.d_sae, dtype=torch.int64, device=self.indices.device)
        hits.index_add_(0, self.indices, (self._values() != 0).to(torch.int64))  # no mask: no data-sized tensor
        return hits > 0

    @torch.no_grad()
    def l0(self) -> Tensor:
        """Mean number of nonzero codes per token, float64."""
        return torch.count_nonzero(self._values()).to(torch.float64) / max(self.batch_size, 1)

    def by_latent(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(order, rows[order], latent_crow)``: the entry permutation that groups entries by
        latent, the tokens in that order, and the latents' offsets."""
        if self._by_latent is None:
            order = _stable_argsort(self.indices)
            latent_crow = row_offsets(self.indices.index_select(0, order), self.d_sae)
            self._by_latent = (order, self.rows.index_select(0, order), latent_crow)
        return self._by_latent

    def gather(self, dense: Tensor) -> Tensor:
        """``dense[rows, indices]`` ``[nnz]`` of a ``[B, d_sae]`` tensor."""
        return dense.reshape(-1).index_select(0, self.rows * self.d_sae + self.indices)

    def _values(self) -> Tensor:
        if self.values is None:
            raise ValueError("these SparseCodes hold a support only; attach values with with_values()")
        return self.values


def _stable_argsort(indices: Tensor) -> Tensor:
    """Stable argsort; on the CPU through numpy (one thread: torch's parallel sort of a few
    thousand keys costs more in thread hand-offs than the sort, badly so on a busy machine)."""
    if indices.device.type == "cpu":
        return torch.from_numpy(np.argsort(indices.numpy(), kind="stable"))
    return torch.argsort(indices, stable=True)


def row_offsets(rows: Tensor, batch: int) -> Tensor:
    """Offsets ``[batch + 1]`` of the groups of sorted ``rows``: a search, not ``bincount`` (which reads
    the largest row back to the host on a GPU)."""
    return torch.searchsorted(rows, torch.arange(batch + 1, device=rows.device, dtype=rows.dtype))


# --- the three sparse products -----------------------------------------------------------------
#: False: the products use `F.embedding_bag` on a GPU too, with no choice of cuBLAS (benchmarks/sparse_kernels.py
#: compares the two); set to False for the rest of the process when a kernel fails to compile or launch
#: (`with_kernels`).
use_triton = True
T = TypeVar("T")


def _gpu_kernels(*operands: Tensor) -> Any:
    """`triton_sparse` where its kernels take these operands (CUDA, Triton importable, float32/16), else
    None. Imported here, not at the top: the CPU path never loads Triton."""
    if not use_triton or not all(t.is_cuda for t in operands):
        return None
    from sae_pipeline.sae import triton_sparse

    return triton_sparse if triton_sparse.applies(*operands) else None


def with_kernels(kernel_call: Callable[[], T], fallback: Callable[[], T]) -> T:
    """``kernel_call()``, or ``fallback()`` (torch's own operators, same result) from the first time a Triton
    kernel fails on this machine: a Triton or driver version that cannot compile it must cost speed, not
    the run. Said once, with the reason."""
    global use_triton
    if use_triton:
        try:
            return kernel_call()
        except Exception as exn:  # noqa: BLE001 (any compile or launch failure: the fallback computes the same)
            use_triton = False
            reason = f"{type(exn).__name__}: {str(exn).splitlines()[0] if str(exn) else ''}"
            warnings.warn(
                f"the Triton kernels failed on this device ({reason}); using torch's own operators for the rest "
                "of the run (same results, slower)",
                RuntimeWarning,
                stacklevel=3,
            )
    return fallback()


def _chosen(
    product: str,
    codes: SparseCodes,
    operand: Tensor,
    sparse: Callable[[], Tensor],
    dense: Callable[[], Tensor],
    timed_sparse: Callable[[], object] | None = None,
) -> Tensor:
    """``sparse()`` (the kernel) or ``dense()`` (cuBLAS), as `product_choice.CHOOSER` measured for this product
    and shape; ``operand``: the table or tokens whose dtype, device and width the key names."""
    key = product_choice.key_for(
        product, operand, codes.batch_size, codes.d_sae, operand.shape[1], codes.indices.numel()
    )
    return product_choice.CHOOSER.run(key, operand.device, sparse, dense, timed_sparse)


def token_sums(codes: SparseCodes, weight: Tensor, per_entry: Tensor, product: str = "decode") -> Tensor:
    """``out[b] = Σ_{e in token b} per_entry[e] · weight[indices[e]]`` ``[B, d]``; ``product``: the name its
    choice of kernel or cuBLAS is kept and logged under (`product_choice.PRODUCTS`)."""
    kernels = _gpu_kernels(weight, per_entry)
    if kernels is None:
        return _token_sums(codes, weight, per_entry)
    return _chosen(
        product,
        codes,
        weight,
        lambda: with_kernels(
            lambda: kernels.segment_sums(codes.crow, codes.indices, weight, per_entry),
            lambda: _token_sums(codes, weight, per_entry),
        ),
        lambda: _dense_token_sums(codes, weight, per_entry),
    )


def _token_sums(codes: SparseCodes, weight: Tensor, per_entry: Tensor) -> Tensor:
    return F.embedding_bag(
        codes.indices,
        weight.contiguous(),
        codes.crow,
        mode="sum",
        per_sample_weights=per_entry.to(weight.dtype),
        include_last_offset=True,
    )


def latent_sums(codes: SparseCodes, source: Tensor, per_entry: Tensor, product: str = "dW_dec") -> Tensor:
    """``out[j] = Σ_{e of latent j} per_entry[e] · source[rows[e]]`` ``[d_sae, d]`` (``product``: as in
    `token_sums`). The kernel needs the latent-major order, the dense form does not: a call that would
    compute the order (the first of the batch) is timed with it."""
    kernels = _gpu_kernels(source, per_entry)
    if kernels is None:
        return _latent_sums(codes, source, per_entry)

    def sparse(entries: SparseCodes = codes) -> Tensor:
        order, rows, latent_crow = entries.by_latent()
        return with_kernels(
            lambda: kernels.segment_sums(latent_crow, rows, source, per_entry, order),
            lambda: _latent_sums(entries, source, per_entry),
        )

    unsorted = codes._by_latent is None
    return _chosen(
        product,
        codes,
        source,
        sparse,
        lambda: _dense_latent_sums(codes, source, per_entry),
        (lambda: sparse(SparseCodes(codes.indices, codes.rows, codes.crow, codes.d_sae))) if unsorted else None,
    )


def _latent_sums(codes: SparseCodes, source: Tensor, per_entry: Tensor) -> Tensor:
    order, rows, latent_crow = codes.by_latent()
    return F.embedding_bag(
        rows,
        source.contiguous(),
        latent_crow,
        mode="sum",
        per_sample_weights=per_entry.index_select(0, order).to(source.dtype),
        include_last_offset=True,
    )


def entry_dots(codes: SparseCodes, tokens: Tensor, weight: Tensor, product: str = "dvalues") -> Tensor:
    """``out[e] = ⟨tokens[rows[e]], weight[indices[e]]⟩`` ``[nnz]`` (``product``: as in `token_sums`)."""
    kernels = _gpu_kernels(tokens, weight)
    if kernels is None:
        return _entry_dots(codes, tokens, weight)
    return _chosen(
        product,
        codes,
        tokens,
        lambda: with_kernels(
            lambda: kernels.entry_dots(codes.rows, codes.indices, tokens, weight),
            lambda: _entry_dots(codes, tokens, weight),
        ),
        lambda: _dense_entry_dots(codes, tokens, weight),
    )


def _entry_dots(codes: SparseCodes, tokens: Tensor, weight: Tensor) -> Tensor:
    tokens, weight = tokens.contiguous(), weight.contiguous()
    try:  # ATen's own per-sample-weight gradient of embedding_bag: exactly these dot products
        return torch.ops.aten._embedding_bag_per_sample_weights_backward(
            tokens, weight, codes.indices, codes.crow[:-1], codes.rows, 0
        )
    except (RuntimeError, AttributeError):  # a backend without it: the same in chunks of entries
        out = tokens.new_empty(codes.indices.numel())
        step = max(1, (1 << 22) // max(weight.shape[1], 1))
        for start in range(0, out.numel(), step):
            sl = slice(start, start + step)
            out[sl] = (tokens[codes.rows[sl]] * weight[codes.indices[sl]]).sum(1)
        return out


# --- the dense forms (cuBLAS), for shapes where they are faster than the kernels ---------------------
# Each computes its product's sums in the operands' dtype with autocast off, as the kernels read them: a
# bf16-autocast run whose weights are float32 gets a float32 GEMM (at the run's float32 matmul precision), and
# its choice is measured as such. Not autocast's bf16 GEMM: that would round W_dec, which the kernels do not.
def dense_codes(codes: SparseCodes, per_entry: Tensor, dtype: torch.dtype) -> Tensor:
    """``per_entry`` scattered into ``[B, d_sae]`` of ``dtype`` (entries on the same (token, latent) summed)."""
    dense = torch.zeros(codes.batch_size * codes.d_sae, dtype=dtype, device=per_entry.device)
    dense.index_add_(0, codes.rows * codes.d_sae + codes.indices, per_entry.to(dtype))
    return dense.view(codes.batch_size, codes.d_sae)


def _dense_token_sums(codes: SparseCodes, weight: Tensor, per_entry: Tensor) -> Tensor:
    with torch.autocast(weight.device.type, enabled=False):
        return dense_codes(codes, per_entry, weight.dtype) @ weight


def _dense_latent_sums(codes: SparseCodes, source: Tensor, per_entry: Tensor) -> Tensor:
    with torch.autocast(source.device.type, enabled=False):
        return dense_codes(codes, per_entry, source.dtype).T @ source


def _dense_entry_dots(codes: SparseCodes, tokens: Tensor, weight: Tensor) -> Tensor:
    dtype = torch.promote_types(tokens.dtype, weight.dtype)
    with torch.autocast(tokens.device.type, enabled=False):
        return codes.gather(tokens.to(dtype) @ weight.to(dtype).T).to(tokens.dtype)


# --- autograd Functions -----------------------------------------------------------------------
class SparseEncodeGather(torch.autograd.Function):
    """``pre[rows, indices]`` of ``pre = (x − b_pre) @ W_enc + b_enc``, differentiable in
    ``x, b_pre, W_enc, b_enc`` with a backward over the selected columns only.

    ``pre`` is the dense pre-activation already computed without a graph (it chose the
    support); the forward only gathers from it.
    """

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, b_pre: Tensor, W_enc: Tensor, b_enc: Tensor, pre: Tensor, codes: SparseCodes
    ) -> Tensor:
        ctx.save_for_backward(x, b_pre, W_enc)
        ctx.codes = codes
        return codes.gather(pre)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, b_pre, W_enc = ctx.saved_tensors
        codes: SparseCodes = ctx.codes
        grad = grad.to(W_enc.dtype)
        need_x, need_b_pre, need_W, need_b_enc = ctx.needs_input_grad[:4]
        grad_x = grad_b_pre = grad_W = grad_b_enc = None
        if need_W:  # [d_sae, d_in] transposed: the strides of W_enc = W_dec.T.clone()
            grad_W = latent_sums(codes, (x - b_pre).to(W_enc.dtype), grad, "dW_enc").T
        if need_b_enc or need_b_pre:
            column_sums = torch.zeros(codes.d_sae, dtype=grad.dtype, device=grad.device).index_add_(
                0, codes.indices, grad
            )
            grad_b_enc = column_sums if need_b_enc else None
            grad_b_pre = -(W_enc @ column_sums).to(b_pre.dtype) if need_b_pre else None
        if need_x:
            grad_x = token_sums(codes, W_enc.T, grad, "dx").to(x.dtype)
        return grad_x, grad_b_pre, grad_W, grad_b_enc, None, None


class SparseDecode(torch.autograd.Function):
    """``x_hat[b] = Σ_e values[e] · W_dec[indices[e]] (+ bias)``, with the sparse backward."""

    @staticmethod
    def forward(ctx: Any, values: Tensor, W_dec: Tensor, bias: Tensor | None, codes: SparseCodes) -> Tensor:
        ctx.save_for_backward(values, W_dec)
        ctx.codes = codes
        out = token_sums(codes, W_dec, values)
        if bias is not None:
            out += bias
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        values, W_dec = ctx.saved_tensors
        codes: SparseCodes = ctx.codes
        grad = grad.to(W_dec.dtype)
        grad_values = grad_W = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_values = entry_dots(codes, grad, W_dec).to(values.dtype)
        if ctx.needs_input_grad[1]:
            grad_W = latent_sums(codes, grad, values)
        if ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_values, grad_W, grad_bias, None


def sparse_encode(x: Tensor, b_pre: Tensor, W_enc: Tensor, b_enc: Tensor, pre: Tensor, codes: SparseCodes) -> Tensor:
    """Differentiable ``pre`` at the entries of ``codes`` ``[nnz]`` (see :class:`SparseEncodeGather`)."""
    return SparseEncodeGather.apply(x, b_pre, W_enc, b_enc, pre, codes)


def sparse_decode(codes: SparseCodes, W_dec: Tensor, bias: Tensor | None = None) -> Tensor:
    """``Σ_e values[e] · W_dec[indices[e]] (+ bias)`` per token ``[B, d_in]`` (see :class:`SparseDecode`)."""
    return SparseDecode.apply(codes._values(), W_dec, bias, codes)
