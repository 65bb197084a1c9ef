"""The Gram matrix ``G = W_dec W_decᵀ`` of MP-SAE's Gram-update selection (:mod:`.mp_autograd`).

On CPU it is the training step's largest cost: as a matmul, ``2·d_sae²·d_in`` FLOPs, about 0.6 s of
a 0.8 s step at d_in 768, d_sae 8 192 on 2 threads. G is symmetric, so BLAS ``?syrk`` computes one
triangle with half the FLOPs. torch has no syrk, so it is called through SciPy's BLAS (already a
dependency), its threads held to torch's count for the call (threadpoolctl), so the two thread pools
never ask for more cores than torch was given. The other triangle is then mirrored tile by tile,
``d_sae²/2`` memory-bound copies. GPUs keep the matmul: cuBLAS makes the Gram cheap there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from threadpoolctl import ThreadpoolController

# Side of the square tiles the triangle is mirrored in: a tile and its transpose stay in cache
# (two 256 KiB float32 tiles). Measured at d_sae 8 192 on 2 threads: 0.07 s in 256-tiles, 0.17 s
# in [256, d_sae] strips, 0.65 s as one whole-matrix ``tril + trilᵀ``.
MIRROR_BLOCK = 256
_SYRK = {torch.float32: "ssyrk", torch.float64: "dsyrk"}


def uses_syrk(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`gram_into` takes the half-FLOP path (CPU, float32 or float64)."""
    return device.type == "cpu" and dtype in _SYRK


def gram_into(W_dec: Tensor, out: Tensor) -> None:
    """``out = W_dec W_decᵀ`` in place (``out`` ``[d_sae, d_sae]``, in its own dtype); no autograd."""
    W_dec = W_dec.detach()
    if not (uses_syrk(out.device, out.dtype) and out.is_contiguous()):
        if out.dtype == W_dec.dtype:
            torch.matmul(W_dec, W_dec.T, out=out)
        else:
            out.copy_(W_dec @ W_dec.T)
        return
    a = W_dec.to(out.dtype).contiguous().numpy().T  # [d_in, d_sae], Fortran order: Aᵀ A = W_dec W_decᵀ
    c = out.numpy().T  # out seen in Fortran order: syrk's upper triangle is out's lower one
    with _blas_controller().limit(limits=torch.get_num_threads(), user_api="blas"):
        result = _syrk(out.dtype)(1.0, a, trans=1, lower=0, beta=0.0, c=c, overwrite_c=1)
    if not np.shares_memory(result, c):  # SciPy copied c (it should not: c is Fortran-contiguous)
        out.copy_(torch.from_numpy(np.ascontiguousarray(result.T)))
    mirror_lower(out)


def mirror_lower(matrix: Tensor, block: int = MIRROR_BLOCK) -> None:
    """Fill the strict upper triangle of a square ``matrix`` from its lower one, in place."""
    size = matrix.shape[0]
    for row in range(0, size, block):
        row_end = min(row + block, size)
        diagonal = matrix[row:row_end, row:row_end]
        diagonal.copy_(diagonal.tril() + diagonal.tril(-1).T)
        for column in range(row_end, size, block):
            column_end = min(column + block, size)
            matrix[row:row_end, column:column_end].copy_(matrix[column:column_end, row:row_end].T)


def _syrk(dtype: torch.dtype) -> Callable[..., np.ndarray]:
    from scipy.linalg import blas  # loaded on the first Gram matrix only

    return getattr(blas, _SYRK[dtype])


@functools.cache
def _blas_controller() -> ThreadpoolController:
    """The thread pools of the loaded BLAS libraries, found once (after SciPy's BLAS is loaded)."""
    from scipy.linalg import blas  # noqa: F401 (loads SciPy's BLAS, so that the controller sees it)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()
