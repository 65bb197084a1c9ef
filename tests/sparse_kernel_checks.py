"""Shared checks of the sparse-product kernels (`sae_pipeline/sae/triton_sparse.py`) against float64
dense references: used on the CPU under the Triton interpreter (`tests/test_triton_sparse.py`) and on
CUDA (`tests/test_gpu_sparse_kernels.py`)."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from sae_pipeline.sae.sparse_decode import SparseCodes, row_offsets

#: METHOD-style relative error ‖out − ref‖ / ‖ref‖ allowed per operand dtype (the reference is float64 of
#: the same rounded operands, so this bounds the kernel's own rounding and accumulation).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def topk_codes(batch: int, d_sae: int, k: int, generator: torch.Generator, device: str) -> SparseCodes:
    """Fixed k per token, with a latent repeated inside some tokens (as OMP's clamped padding gives)."""
    indices = torch.rand(batch, d_sae, generator=generator).topk(k, dim=1).indices
    indices[::3, 1] = indices[::3, 0]  # a repeated latent in every third token
    return SparseCodes.from_topk(indices.to(device), d_sae)


def ragged_codes(batch: int, d_sae: int, k: int, generator: torch.Generator, device: str) -> SparseCodes:
    """BatchTopK-like CSR: 0 to 3k entries per token (some tokens empty), latents drawn with repeats, and a
    few latents never used (their gradient rows must be written as zeros)."""
    counts = torch.randint(0, 3 * k + 1, (batch,), generator=generator)
    counts[::4] = 0
    rows = torch.repeat_interleave(torch.arange(batch), counts)
    indices = torch.randint(0, d_sae // 2, (rows.numel(),), generator=generator) * 2  # odd latents unused
    return SparseCodes(indices.to(device), rows.to(device), row_offsets(rows, batch).to(device), d_sae)


def relative_error(out: Tensor, ref: Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def check_products(kernels: ModuleType, codes: SparseCodes, d_in: int, dtype: torch.dtype, seed: int) -> None:
    """The three products on fresh random operands of ``dtype``, into NaN-poisoned buffers, against float64."""
    device = codes.indices.device
    g = torch.Generator().manual_seed(seed)
    batch, d_sae, nnz = codes.batch_size, codes.d_sae, codes.indices.numel()
    W_dec = torch.randn(d_sae, d_in, generator=g).to(device=device, dtype=dtype)
    tokens = torch.randn(batch, d_in, generator=g).to(device=device, dtype=dtype)
    values = torch.randn(nnz, generator=g).to(device=device, dtype=dtype)
    W64, t64, v64 = W_dec.double(), tokens.double(), values.double()
    rows, indices = codes.rows, codes.indices
    tol = TOLERANCE[dtype]

    # decode: out[b] = Σ_e values[e] · W_dec[indices[e]]
    out = torch.full((batch, d_in), float("nan"), dtype=dtype, device=device)
    kernels.segment_sums(codes.crow, indices, W_dec, values, out=out)
    ref = torch.zeros(batch, d_in, dtype=torch.float64, device=device).index_add_(0, rows, v64[:, None] * W64[indices])
    assert torch.isfinite(out).all() and relative_error(out, ref) <= tol, ("decode", relative_error(out, ref))
    empty = codes.crow[1:] == codes.crow[:-1]
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))

    # ∂W_dec over the latent-major order: out[j] = Σ_{e of j} values[e] · tokens[rows[e]]
    order, sorted_rows, latent_crow = codes.by_latent()
    out = torch.full((d_sae, d_in), float("nan"), dtype=dtype, device=device)
    kernels.segment_sums(latent_crow, sorted_rows, tokens, values, order, out=out)
    ref = torch.zeros(d_sae, d_in, dtype=torch.float64, device=device).index_add_(0, indices, v64[:, None] * t64[rows])
    assert torch.isfinite(out).all() and relative_error(out, ref) <= tol, ("latent sums", relative_error(out, ref))
    unused = latent_crow[1:] == latent_crow[:-1]
    assert bool(unused.any()) == (codes.indices.unique().numel() < d_sae)
    assert torch.equal(out[unused], torch.zeros_like(out[unused]))

    # the same through a transposed (non-contiguous) table, as the W_enc.T gather of the input gradient
    table = W_dec.T.contiguous().T
    out = torch.full((batch, d_in), float("nan"), dtype=dtype, device=device)
    kernels.segment_sums(codes.crow, indices, table, values, out=out)
    ref = torch.zeros(batch, d_in, dtype=torch.float64, device=device).index_add_(0, rows, v64[:, None] * W64[indices])
    assert torch.isfinite(out).all() and relative_error(out, ref) <= tol, ("strided", relative_error(out, ref))

    # ∂values: out[e] = ⟨tokens[rows[e]], W_dec[indices[e]]⟩
    out = torch.full((nnz,), float("nan"), dtype=dtype, device=device)
    kernels.entry_dots(rows, indices, tokens, W_dec, out=out)
    ref = (t64[rows] * W64[indices]).sum(1)
    assert torch.isfinite(out).all() and relative_error(out, ref) <= tol, ("entry dots", relative_error(out, ref))


def interpreted_checks(batch: int = 16, d_sae: int = 64, d_in: int = 32, k: int = 4) -> list[str]:
    """Every case on CPU tensors, for a process started with ``TRITON_INTERPRET=1`` (Triton reads it when it is
    first imported, so the test runs this in a fresh interpreter); returns the names of the cases run."""
    from sae_pipeline.sae import triton_sparse

    done = []
    for layout, make in (("topk", topk_codes), ("ragged", ragged_codes)):
        for dtype in (torch.float32, torch.bfloat16):
            for seed in (0,):
                codes = make(batch, d_sae, k, torch.Generator().manual_seed(seed), "cpu")
                check_products(triton_sparse, codes, d_in, dtype, seed=10 + seed)
                done.append(f"{layout}-{dtype}-{seed}")
    codes = ragged_codes(4, d_sae, 0, torch.Generator().manual_seed(0), "cpu")  # no entry at all
    out = torch.full((4, d_in), float("nan"))
    triton_sparse.segment_sums(codes.crow, codes.indices, torch.randn(d_sae, d_in), torch.randn(0), out=out)
    assert torch.equal(out, torch.zeros(4, d_in))
    assert (
        triton_sparse.entry_dots(codes.rows, codes.indices, torch.randn(4, d_in), torch.randn(d_sae, d_in)).numel() == 0
    )
    done.append("empty")
    return done


if __name__ == "__main__":
    from tests.batch_select_checks import interpreted_selection_checks

    print("checked:", " ".join([*interpreted_checks(), *interpreted_selection_checks()]))
