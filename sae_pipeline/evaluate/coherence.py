"""Co-active coherence controlled for support size: what "selects more incoherent atoms" can be compared on.

The co-active Babel of :func:`sae_pipeline.metrics.babel_coactive` sums, for each token, over
``min(r, |S| − 1)`` co-active atoms and scores tokens with ``|S| ≤ 1`` as 0. A variant whose
supports are smaller (ReLU at a low L0, or MP-SAE picking the same atom twice, which shrinks
``|S|`` below k) then scores lower whatever its atoms are. Two forms remove that:

- **restricted Babel** ``μ₁^S(r)``: the mean over tokens with ``|S| ≥ r + 1`` only of
  ``max_{j ∈ S} Σ_{r largest i ∈ S∖{j}} |⟨d_i, d_j⟩|``; every counted token sums exactly r
  terms, so variants are compared on the same number of terms. The claims use it at
  :func:`common_r`, the largest r ≤ k − 1 at which every variant keeps at least
  ``MIN_TOKEN_SHARE`` of its tokens;
- **mean pairwise coherence**: per token the mean of ``|⟨d_i, d_j⟩|`` over the pairs of its
  support (size-normalised; tokens with ``|S| ≥ 2``), averaged over tokens.

Both are reported with the mean ``|S|`` (distinct active atoms per token).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

MIN_TOKEN_SHARE = 0.25  # a restricted Babel value needs at least this share of a variant's tokens
_CHUNK = 1024


@torch.no_grad()
def support_coherence(W_dec: Tensor, codes: Tensor, r_max: int) -> dict[str, Any]:
    """Restricted Babel ``μ₁^S(r)`` for r = 1..r_max, its token counts, mean pairwise coherence and mean |S|.

    ``W_dec [p, d]`` (unit-norm atoms), ``codes [N, p]``. ``restricted[r-1]`` is None when no token
    has ``|S| ≥ r + 1``.
    """
    W = W_dec.detach().double()
    W = W / W.norm(dim=1, keepdim=True).clamp_min(1e-12)
    sums = torch.zeros(r_max, dtype=torch.float64)
    counts = torch.zeros(r_max, dtype=torch.int64)
    pair_sum, pair_tokens, size_sum, n = 0.0, 0, 0.0, 0
    for chunk in codes.split(_CHUNK):
        active = chunk != 0
        sizes = active.sum(dim=1)
        n += chunk.shape[0]
        size_sum += float(sizes.sum())
        m = int(sizes.max()) if chunk.shape[0] else 0
        if m < 2:
            continue
        # indices of the active atoms per token, padded (padding masked out below)
        order = active.to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :m]
        valid = torch.arange(m)[None, :] < sizes[:, None]
        atoms = W[order]  # [B, m, d]
        gram = (atoms @ atoms.transpose(1, 2)).abs()
        pair_mask = valid[:, :, None] & valid[:, None, :] & ~torch.eye(m, dtype=torch.bool)[None]
        gram = torch.where(pair_mask, gram, torch.zeros((), dtype=gram.dtype))
        many = sizes >= 2
        pairs = (sizes * (sizes - 1)).clamp_min(1).double()
        pair_sum += float((gram.sum(dim=(1, 2)) / pairs)[many].sum())
        pair_tokens += int(many.sum())
        cumulative = gram.sort(dim=2, descending=True).values.cumsum(dim=2)  # [B, m, m]: row j, r largest
        for r in range(1, min(r_max, m - 1) + 1):
            keep = sizes >= r + 1
            if keep.any():
                per_token = cumulative[keep][:, :, r - 1].max(dim=1).values
                sums[r - 1] += per_token.sum()
                counts[r - 1] += int(keep.sum())
    restricted = [float(s / c) if c > 0 else None for s, c in zip(sums.tolist(), counts.tolist())]
    return {
        "restricted_babel": restricted,
        "restricted_tokens": counts.tolist(),
        "n_tokens": n,
        "mean_support": size_sum / max(n, 1),
        "mean_pairwise": pair_sum / pair_tokens if pair_tokens else None,
    }


def common_r(stats: dict[str, dict[str, Any]], k: int) -> int | None:
    """The largest r ≤ k − 1 at which every variant has ``|S| ≥ r + 1`` on ≥ MIN_TOKEN_SHARE of its tokens."""
    best = None
    for r in range(1, k):
        if all(
            r <= len(s["restricted_tokens"])
            and s["n_tokens"] > 0
            and s["restricted_tokens"][r - 1] >= MIN_TOKEN_SHARE * s["n_tokens"]
            for s in stats.values()
        ):
            best = r
    return best
