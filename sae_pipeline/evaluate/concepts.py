"""What the atoms mean: activation statistics, selection order and atom-by-atom reconstruction.

The quantities of the paper's "Learned Concepts" and "Hints of Hierarchy" (Costa et al. 2025,
Figs. 3, 4 and the appendix "Sequential Reconstruction"):

- per atom j: activation frequency ``P(z_j ≠ 0)``, mean value ``E[z_j]`` over all tokens
  (zeros included, as in :class:`sae_pipeline.metrics.ActivationStats`) and the value when
  active ``E[z_j | z_j ≠ 0]`` (= mean value / frequency; both forms are reported, the claims
  use the value when active, see :mod:`.claims`);
- the *selection step* of atom j: for MP-SAE the pursuit step (1-based) at which it was picked,
  averaged over every selection; shallow SAEs pick all atoms at once, so, as the paper does,
  their active atoms are ordered by activation value (largest first) to simulate a sequence;
- one input reconstructed atom by atom in that order, from ``b_pre``.

Summary numbers test the paper's reading: MP-SAE uses atoms with roughly equal frequency but
widely varying values (coefficient of variation of each), atoms with larger values are
selected earlier (Spearman ρ between value and mean step, in both forms), and shallow SAEs hold a
"negative" atom close to ``−b_pre`` (its cosine and frequency rank).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from scipy.stats import rankdata  # scipy comes with scikit-learn
from torch import Tensor

from sae_pipeline.sae import SparseAutoencoder

_CHUNK = 2048
MAX_SHOWN_STEPS = 16


def selection_order(sae: SparseAutoencoder, x: Tensor) -> tuple[Tensor, Tensor]:
    """``(indices [B, m], values [B, m])``: atoms in selection order, padded with index −1 / value 0.

    A pursuit (``is_pursuit``, e.g. MP-SAE): its own order (an atom picked twice appears twice).
    Shallow SAEs: the active atoms sorted by activation value, largest first (``m`` = the chunk's
    largest L0).
    """
    if sae.is_pursuit:
        return sae.pursuit(x)  # type: ignore[attr-defined]
    codes = sae.encode(x)
    m = max(1, int((codes != 0).sum(dim=1).max()))
    values, indices = codes.topk(m, dim=1, sorted=True)
    active = values != 0
    return torch.where(active, indices, -1), torch.where(active, values, 0.0)


@torch.no_grad()
def concept_statistics(sae: SparseAutoencoder, x: Tensor, n_top: int = 25) -> dict[str, Any]:
    """Per-atom frequency, mean value and mean selection step over ``x``, with summary numbers."""
    d_sae = sae.d_sae
    fire = torch.zeros(d_sae, dtype=torch.float64)
    value_sum = torch.zeros(d_sae, dtype=torch.float64)
    step_sum = torch.zeros(d_sae, dtype=torch.float64)
    step_count = torch.zeros(d_sae, dtype=torch.float64)
    for chunk in x.split(_CHUNK):
        codes = sae.encode(chunk)
        fire += (codes != 0).sum(dim=0).double()
        value_sum += codes.double().sum(dim=0)
        indices, _ = selection_order(sae, chunk)
        steps = torch.arange(1, indices.shape[1] + 1, dtype=torch.float64).expand(indices.shape[0], -1)
        valid = indices >= 0
        step_sum.index_add_(0, indices[valid], steps[valid])
        step_count.index_add_(0, indices[valid], torch.ones_like(steps[valid]))
    n = x.shape[0]
    frequency, mean_value = (fire / n).numpy(), (value_sum / n).numpy()
    mean_step = np.where(step_count.numpy() > 0, step_sum.numpy() / np.maximum(step_count.numpy(), 1), np.nan)
    fired = frequency > 0
    # E[z_j] counts the zeros, so it is frequency x value-when-active and grows with the frequency by
    # construction; the value when active, E[z_j | z_j != 0] = E[z_j] / frequency, separates the two.
    when_active = np.where(fired, mean_value / np.maximum(frequency, 1e-300), np.nan)
    W = sae.W_dec.detach().double()
    negative_bias = -sae.b_pre.detach().double()
    cosines = (W @ negative_bias) / (W.norm(dim=1) * negative_bias.norm()).clamp_min(1e-12)
    negative_atom = int(cosines.argmax())
    frequency_rank = int((frequency > frequency[negative_atom]).sum()) + 1
    return {
        "n_tokens": int(n),
        "frequency": _json_list(frequency),
        "mean_value": _json_list(mean_value),
        "mean_step": _json_list(mean_step),
        "top_by_frequency": np.argsort(-frequency, kind="stable")[:n_top].tolist(),
        "top_by_mean": np.argsort(-mean_value, kind="stable")[:n_top].tolist(),
        "n_fired": int(fired.sum()),
        "value_when_active": _json_list(when_active),
        "frequency_cv": _cv(frequency[fired]),
        "mean_value_cv": _cv(mean_value[fired]),
        "value_when_active_cv": _cv(when_active[fired]),
        "spearman_mean_vs_step": spearman(mean_value[fired], mean_step[fired]),
        "spearman_value_when_active_vs_step": spearman(when_active[fired], mean_step[fired]),
        "spearman_frequency_vs_mean": spearman(frequency[fired], mean_value[fired]),
        "spearman_frequency_vs_value_when_active": spearman(frequency[fired], when_active[fired]),
        "negative_atom": {
            "index": negative_atom,
            "cosine_with_minus_b_pre": float(cosines[negative_atom]),
            "frequency_rank": frequency_rank,
        },
    }


@torch.no_grad()
def sequential_reconstruction(sae: SparseAutoencoder, x: Tensor) -> dict[str, Any]:
    """One input ``x [d_in]`` rebuilt atom by atom in selection order, starting from ``b_pre``.

    ``partials[t]`` is the reconstruction after t atoms (t = 0: ``b_pre``) for the first
    :data:`MAX_SHOWN_STEPS` steps, and the last entry the full reconstruction; ``residual_norms``
    covers every step. For MP-SAE the last partial equals ``decode(encode(x))``.
    """
    indices, values = selection_order(sae, x[None])
    keep = indices[0] >= 0
    order, coefficients = indices[0][keep], values[0][keep]
    contributions = coefficients[:, None] * sae.W_dec.detach()[order]
    partials = torch.cat([sae.b_pre.detach()[None], sae.b_pre.detach() + contributions.cumsum(dim=0)])
    residual_norms = (x[None] - partials).norm(dim=1)
    shown = list(range(min(len(partials), MAX_SHOWN_STEPS + 1)))
    if shown[-1] != len(partials) - 1:
        shown.append(len(partials) - 1)
    return {
        "input": x.tolist(),
        "order": order.tolist(),
        "coefficients": coefficients.tolist(),
        "shown_steps": shown,
        "partials": partials[shown].tolist(),
        "residual_norms": residual_norms.tolist(),
    }


def spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman rank correlation (average ranks for ties); None with fewer than 3 points or no spread."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    if a.size < 3:
        return None
    ra, rb = rankdata(a), rankdata(b)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def _cv(values: np.ndarray) -> float | None:
    """Coefficient of variation |std / mean|; None when undefined."""
    if values.size == 0 or values.mean() == 0:
        return None
    return float(abs(values.std() / values.mean()))


def _json_list(values: np.ndarray) -> list[float | None]:
    """Floats for JSON, NaN as None (JSON has no NaN)."""
    return [None if not math.isfinite(v) else float(v) for v in values.tolist()]
