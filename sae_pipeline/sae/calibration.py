"""Values set from the first training batch (a threshold, a bias), identical on every DDP rank.

Why: a shallow SAE's sparsity is decided by where its pre-activations cross a threshold (JumpReLU's
θ) or zero (ReLU, through ``b_enc``). Their optimisers move those parameters by about the learning
rate per step (Adam), so a start far from the sparsity the run aims at costs thousands of steps
before the L0 is anywhere near it (JumpReLU's θ₀ = 1e-3 of the JumpReLU paper; ReLU's ``b_enc = 0``,
which starts every latent on half of the tokens). Reading the cut off the first batch puts the run
at its target sparsity from step one. Ranks see different batches, so every such value is averaged
over them: the replicas of a DDP model must stay identical.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

QUANTILE_MAX_ELEMENTS = 1 << 24  # torch.quantile accepts at most 2^24 elements: larger inputs are strided


def mean_over_ranks(value: Tensor) -> Tensor:
    """``value`` averaged over the DDP ranks, in place (unchanged without a process group). Every rank
    must call it at the same point (it is a collective)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value


def pooled_cut(pre: Tensor, l0: float) -> Tensor:
    """The value that ``l0`` entries per row of ``pre [B, d_sae]`` exceed on average, all latents pooled
    (a scalar, float32): the ``1 − l0/d_sae`` quantile."""
    flat = pre.detach().float().flatten()
    flat = flat[:: max(1, math.ceil(flat.numel() / QUANTILE_MAX_ELEMENTS))]  # torch.quantile's size limit
    return torch.quantile(flat, 1.0 - l0 / pre.shape[1])


def per_latent_cut(pre: Tensor, l0: float) -> Tensor:
    """Per latent (column of ``pre [B, d_sae]``), the value that a share ``l0/d_sae`` of the batch's tokens
    exceed, ``[d_sae]`` float32: every latent starts firing equally often, so none starts dead, and the
    mean L0 is ``l0``. ``kthvalue`` (no size limit, unlike ``torch.quantile``)."""
    rows = pre.shape[0]
    kth = min(rows, max(1, round(rows * (1.0 - l0 / pre.shape[1]))))
    return pre.detach().float().kthvalue(kth, dim=0).values
