"""Which of MP-SAE's two selection paths costs less (`mp_autograd.select_atoms`), and in which dtypes.

Both start with one correlation matmul and take an argmax per step; for the later steps one path updates
the correlations with a row of the Gram matrix (memory-bound, after one ``d_sae²`` GEMM), the other runs a
fresh matmul per step. The choice is a cost model, not a measurement at run time, so that it is the same
on every step and every rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Above this size the Gram matrix is not formed even when it would save FLOPs
# (d_sae = 32768 in float32 is exactly 4 GiB).
GRAM_MAX_BYTES = 4 * 2**30


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision inputs run the pursuit recurrences in float32 (cheap: ``[B, d_in]``)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def element_cost(device: torch.device, dtype: torch.dtype, fused: bool = False) -> float:
    """Time of one memory-bound Gram-update element (gather ``G[j, i]``, update ``C[b, i]``)
    in units of one matmul FLOP, by device and dtype (of the GEMMs).

    CPU, 24: measured on the 2-core dev box (≈0.4 ns per element against ≈55 GFLOP/s per
    core in sgemm). CUDA, 250 in float32 and 4000 in half precision: estimated, not measured,
    from an H100's ratio of FLOPs to memory bandwidth (≈20 FLOP/byte for float32 CUDA cores,
    ≈300 for bf16 tensor cores) times the ≈12 bytes an element moves. ``fused`` (the Triton
    kernel, `triton_pursuit`): the update moves only ≈2 bytes more per element than the matmul
    path's own write of ``C`` and argmax read (G's element), so 50 in float32 and 300 in half
    precision: estimated the same way, not measured.
    """
    if device.type == "cpu":
        return 24.0
    half = dtype in (torch.float16, torch.bfloat16)
    if fused:
        return 300.0 if half else 50.0
    return 4000.0 if half else 250.0


def gemm_dtype(residual: Tensor) -> torch.dtype:
    """The dtype of the selection's GEMMs: a half input's own, the autocast dtype for a float32 input on
    CUDA under autocast (what the plain loop's matmuls run in there), else the compute dtype."""
    if residual.dtype in (torch.float16, torch.bfloat16):
        return residual.dtype
    if residual.dtype == torch.float32 and residual.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return compute_dtype(residual.dtype)


def prefer_gram(
    n_tokens: int,
    k: int,
    d_in: int,
    d_sae: int,
    cost_per_element: float = 24.0,
    element_size: int = 4,
    symmetric: bool = False,
) -> bool:
    """Whether the Gram-update selection is cheaper than a correlation matmul per step.

    Both start with one matmul ``r_0 @ W_decᵀ`` and take an argmax per step. For the k − 1
    updates, the Gram path pays for ``G = W_dec W_decᵀ`` once plus ``B·d_sae`` memory-bound
    elements per step (``cost_per_element`` FLOPs each, see `element_cost`); the matmul
    path pays ``2·B·d_in·d_sae`` FLOPs per step. G costs ``2·d_sae²·d_in`` FLOPs as a matmul,
    or, ``symmetric`` (CPU, `gram`), ``d_sae²·d_in`` by syrk plus ``d_sae²`` elements to
    mirror its triangle. So with the matmul the Gram path wins when
    ``2·d_sae²·d_in < (k−1)·B·d_sae·(2·d_in − cost_per_element)``, and on CPU at d_in = 256
    about when ``B·(k−1) > 0.57·d_sae``. At B=1024, k=16, d_sae=4096: 15 360 > 2 350, Gram
    (4.3 GFLOPs once instead of 32 over the steps). A Gram matrix larger than
    ``GRAM_MAX_BYTES`` is never formed.
    """
    if k <= 1 or d_sae * d_sae * element_size > GRAM_MAX_BYTES:
        return False
    saving_per_element = 2 * d_in - cost_per_element
    gram_cost = d_sae * d_sae * (d_in + cost_per_element if symmetric else 2 * d_in)
    return saving_per_element > 0 and gram_cost < (k - 1) * n_tokens * d_sae * saving_per_element
