"""Every number and curve of one SAE on one evaluation sample: Babel, R² against inference k, activations.

The training callback (:class:`sae_pipeline.training.callbacks.SAEFigures`) logs these at validation and
the evaluation suite (:mod:`sae_pipeline.evaluate.studies`, :mod:`~sae_pipeline.evaluate.sae_dir`,
:mod:`~sae_pipeline.evaluate.external`) computes them for exported SAEs; both call :func:`evaluate_sae`,
which needs no Lightning. It lives with the metrics, below both, so that training imports nothing
from the evaluation.

The sample is processed in chunks of at most ``_CHUNK_ELEMENTS`` dense code entries, so a 16 K-token
sample with d_sae = 19 200 never holds a 1.2 GB code matrix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from feature_extraction.validate import check_int
from sae_pipeline.metrics.babel_function import babel, babel_coactive
from sae_pipeline.metrics.streaming import ActivationStats, ReconstructionR2
from sae_pipeline.sae import SparseAutoencoder

# Dense code entries per chunk of the evaluation sample: 2**24 float32 = 64 MiB of codes.
_CHUNK_ELEMENTS = 2**24


def default_inference_ks(k: int, d_sae: int) -> list[int]:
    """Powers of two up to ``4k``, plus ``k`` and ``4k``, capped at ``d_sae``: the sweep of the
    paper's Fig. "inference at k" (below, at and well above the trained sparsity)."""
    check_int("k", k, 1)
    ks = {k, 4 * k}
    power = 1
    while power <= 4 * k:
        ks.add(power)
        power *= 2
    return sorted(value for value in ks if value <= d_sae) or [d_sae]


@torch.no_grad()
def evaluate_sae(sae: SparseAutoencoder, x: Tensor, r_max: int, ks: list[int] | None = None) -> dict[str, Any]:
    """Every quantity ``SAEFigures`` logs, for the (preprocessed) sample ``x [n, d_in]``.

    Runs the SAE as it is
    (call ``sae.eval()`` first for BatchTopK's inference threshold).

    ``ks`` (None: :func:`default_inference_ks` of k) are the inference k values of the R²
    sweep; values above ``d_sae`` are dropped, except for MP-SAE (its pursuit may pick atoms again).

    Returns a dict: ``k`` (trained k, or the mean L0 rounded for variants without one),
    ``ks``, ``r2_by_k`` (list of floats), ``babel_dict`` and ``babel_coactive`` (float32
    CPU tensors ``[max(r_max, k) capped at d_sae − 1]``), the four ``babel_*_r1/rk``
    floats, ``frequency`` and ``mean_value`` (float64 CPU ``[d_sae]``), ``l0`` (float).
    """
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] != sae.d_in:
        raise ValueError(f"eval sample must have shape [n_tokens >= 1, d_in={sae.d_in}], got {tuple(x.shape)}")
    if sae.d_sae < 2:
        raise ValueError(f"the Babel function needs d_sae >= 2 atoms, got d_sae={sae.d_sae}")
    check_int("r_max", r_max, 1)
    chunks = x.split(max(1, _CHUNK_ELEMENTS // sae.d_sae))
    stats = ActivationStats(sae.d_sae, sync_on_compute=False).to(x.device)
    # One chunk (the usual case): keep its codes for the co-active pass instead of re-encoding.
    kept_codes: list[Tensor] = []
    for chunk in chunks:
        codes = sae.encode(chunk)
        stats.update(codes)
        if len(chunks) == 1:
            kept_codes.append(codes)
    activation = {name: value.cpu() for name, value in stats.compute().items()}
    l0 = float(activation["l0"])
    k = sae.k if sae.k is not None else max(1, round(l0))
    r_max = min(max(r_max, k), sae.d_sae - 1)
    r_k = min(k, r_max)

    babel_dict = babel(sae.W_dec, r_max).float().cpu()
    coactive_sum = torch.zeros(r_max, dtype=torch.float64)
    for index, chunk in enumerate(chunks):
        codes = kept_codes[index] if kept_codes else sae.encode(chunk)
        coactive_sum += babel_coactive(sae.W_dec, codes, r_max).double().cpu() * chunk.shape[0]
    babel_co = (coactive_sum / x.shape[0]).float()

    requested = ks
    k_cap = None if sae.k_above_d_sae else sae.d_sae  # MP may repeat atoms: any k
    ks = [value for value in (ks or default_inference_ks(k, sae.d_sae)) if k_cap is None or value <= k_cap]
    if not ks:
        raise ValueError(f"every k in ks={requested} exceeds d_sae={sae.d_sae}; choose ks in [1, {sae.d_sae}]")
    r2_by_k = []
    for value in ks:
        r2 = ReconstructionR2(sae.d_in, sync_on_compute=False).to(x.device)
        for chunk in chunks:
            r2.update(chunk, sae.decode(sae.encode(chunk, value)))
        r2_by_k.append(float(r2.compute()))

    return {
        "k": k,
        "ks": ks,
        "r2_by_k": r2_by_k,
        "babel_dict": babel_dict,
        "babel_coactive": babel_co,
        "babel_dict_r1": float(babel_dict[0]),
        "babel_dict_rk": float(babel_dict[r_k - 1]),
        "babel_coactive_r1": float(babel_co[0]),
        "babel_coactive_rk": float(babel_co[r_k - 1]),
        "frequency": activation["frequency"],
        "mean_value": activation["mean_value"],
        "l0": l0,
    }
