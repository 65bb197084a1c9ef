"""Top-k selection of the training step: the per-token top ``k`` (TopK's support, its dense ``activate``, AuxK's
picks) and BatchTopK's batch top ``B·k``, by Triton kernels on a GPU (`triton_topk.py`, `triton_batch_topk.py`),
`torch.topk` elsewhere.

Why: `torch.topk` per token took about 1.3 ms of a TopK step at the paper's shape on an H200, and BatchTopK's
threshold search (`batch_select.py`) 0.6x a plain top-k, where reading the pre-activations once takes about
40 µs; the kernels read each value once (`triton_topk.py` says how).

**The set and its order.** The kernels keep the same set as `torch.topk` up to ties at equal values, and settle
those by a stated rule: of the entries equal to the ``k``-th largest, **the lowest index first** (the lowest
column per token; the lowest flat index, row-major, for BatchTopK, as `batch_select.py` keeps it: the order in
which CUDA's radix-select `topk` gathers ties, `tests/test_gpu_topk_select.py` checks it per row); -0 equals
+0; **NaN counts as the largest value** (as `torch.topk` has it), NaNs tying with each other. Indices come back
ascending per row (`top_k_indices`) or over the batch (`batch_top_indices`), not in `torch.topk`'s order: a
``sorted=False`` top-k's set, which every caller takes (`SparseCodes.from_topk` and `from_flat`, the gathers
of the sparse path, AuxK's picks over its planned slots).

**Where they run.** CUDA tensors of bfloat16, float16 or float32 whose rows are contiguous, with ``1 ≤ k ≤
MAX_K`` and ``k < d_sae`` (``k = d_sae``: every index, no selection), Triton importable, and both `use_triton`
here and `sparse_decode.use_triton` on. Elsewhere `torch.topk` (the CPU, as before, and float64); BatchTopK
shapes the kernel does not take keep `batch_select.py`'s threshold search. A kernel that fails to compile or
launch turns `use_triton` off for the rest of the process, with one warning (`with_select_kernels`). No host
synchronisation: the outputs have fixed sizes (``[B, k]``, ``[n]``) and every decision is made on the device.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from sae_pipeline.sae import sparse_decode

#: False: `torch.topk` everywhere (set for the rest of the process when a kernel fails to compile or launch,
#: `with_select_kernels`); `sparse_decode.use_triton` False turns these kernels off too.
use_triton = True
#: The largest ``k`` the per-token kernel takes (its lanes grow with ``k``); above it, `torch.topk`.
MAX_K = 512
KEYED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
T = TypeVar("T")


def applies(values: Tensor, k: int) -> bool:
    """Whether the kernel selects the top ``k`` along the last dimension of ``values`` (see the module docstring).
    Imports Triton only for a CUDA tensor: the CPU path never loads it."""
    if not (
        use_triton
        and sparse_decode.use_triton
        and values.is_cuda
        and values.dtype in KEYED_DTYPES
        and values.dim() >= 1
        and values.numel() > 0
        and values.stride(-1) == 1
        and 1 <= k <= MAX_K
        and k < values.shape[-1]
    ):
        return False
    from sae_pipeline.sae import triton_topk

    return triton_topk.triton is not None


def with_select_kernels(kernel_call: Callable[[], T], fallback: Callable[[], T]) -> T:
    """``kernel_call()``, or ``fallback()`` (the same set up to ties) from the first time a kernel fails here: a
    Triton or driver that cannot compile it costs speed, not the run. Said once, with the reason."""
    global use_triton
    if use_triton:
        try:
            return kernel_call()
        except Exception as exn:  # noqa: BLE001 (any compile or launch failure: the fallback selects the same)
            use_triton = False
            reason = f"{type(exn).__name__}: {str(exn).splitlines()[0] if str(exn) else ''}"
            warnings.warn(
                f"the Triton top-k kernels failed on this device ({reason}); using torch.topk for the rest of the "
                "run (the same sets, slower)",
                RuntimeWarning,
                stacklevel=3,
            )
    return fallback()


def top_k_indices(values: Tensor, k: int) -> Tensor:
    """Indices ``[..., k]`` of the ``k`` largest entries along the last dimension: the kernel's (each row
    ascending, ties at the threshold to the lowest index) where it applies, else `torch.topk`'s (any order)."""
    if k == values.shape[-1] and values.is_cuda:  # every index: no selection at all
        return torch.arange(k, device=values.device).expand(values.shape).contiguous()
    if not applies(values, k):
        return values.topk(k, dim=-1, sorted=False).indices
    from sae_pipeline.sae import triton_topk

    return with_select_kernels(
        lambda: triton_topk.row_top_k(values.reshape(-1, values.shape[-1]), k).view(*values.shape[:-1], k),
        lambda: values.topk(k, dim=-1, sorted=False).indices,
    )


def keep_per_row(batch: int, n: int) -> int:
    """``R``, the entries `triton_batch_topk.batch_top_k` keeps per row: twice the mean of ``n`` over the rows."""
    return 2 * -(-n // batch)


def batch_applies(values: Tensor, n: int) -> bool:
    """Whether `triton_batch_topk.batch_top_k` takes ``values [B, d_sae]`` and ``n``: the per-token kernel `applies` to
    its ``R`` per row."""
    return values.dim() == 2 and 1 <= n <= values.numel() and applies(values, keep_per_row(values.shape[0], n))


def batch_top_indices(values: Tensor, n: int) -> Tensor:
    """Ascending flat indices of the ``n`` largest entries of ``values [B, d_sae]`` (``1 ≤ n ≤ numel``): of the
    entries equal to the ``n``-th largest, those of lowest flat index where a kernel runs (`batch_top_k`, or
    `batch_select.py`'s threshold search where that does not apply), `torch.topk`'s on the CPU."""
    if batch_applies(values, n):
        from sae_pipeline.sae import triton_batch_topk

        return with_select_kernels(lambda: triton_batch_topk.batch_top_k(values, n), lambda: _batch_fallback(values, n))
    return _batch_fallback(values, n)


def _batch_fallback(values: Tensor, n: int) -> Tensor:
    flat = values.reshape(-1)
    if flat.is_cuda and use_triton and sparse_decode.use_triton:
        from sae_pipeline.sae import batch_select  # imported here: the CPU path never loads Triton

        if batch_select.radix_applies(flat):
            return sparse_decode.with_kernels(
                lambda: batch_select.radix_top_indices(flat, n), lambda: flat.topk(n, sorted=False).indices.sort()[0]
            )
    return flat.topk(n, sorted=False).indices.sort().values
