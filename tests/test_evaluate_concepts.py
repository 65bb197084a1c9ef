"""Concept statistics against plain per-input loops on random SAEs (no training)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from sae_pipeline.evaluate.concepts import concept_statistics, selection_order, sequential_reconstruction, spearman
from sae_pipeline.sae import MatchingPursuitSAE, ReLUSAE, TopKSAE


def random_sae(cls, **kwargs):
    torch.manual_seed(0)
    sae = cls(d_in=12, d_sae=40, **kwargs).double()
    with torch.no_grad():
        sae.b_pre.normal_()
        if hasattr(sae, "b_enc"):
            sae.b_enc.normal_(std=0.1)
    return sae.eval()


def plain_steps(sae, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per atom: sum of the (1-based) steps at which it is selected, and how often, one input at a time."""
    step_sum, count = np.zeros(sae.d_sae), np.zeros(sae.d_sae)
    for row in x:
        if isinstance(sae, MatchingPursuitSAE):
            residual, order = row - sae.b_pre, []
            for _ in range(sae.k):
                correlations = sae.W_dec @ residual
                j = int(correlations.argmax())
                order.append(j)
                residual = residual - correlations[j] * sae.W_dec[j]
        else:
            codes = sae.encode(row[None])[0]
            active = [j for j in range(sae.d_sae) if codes[j] != 0]
            order = sorted(active, key=lambda j: -float(codes[j]))
        for step, j in enumerate(order, start=1):
            step_sum[j] += step
            count[j] += 1
    return step_sum, count


@pytest.mark.parametrize("cls, kwargs", [(MatchingPursuitSAE, {"k": 5}), (TopKSAE, {"k": 5}), (ReLUSAE, {})])
@torch.no_grad()
def test_statistics_match_plain_loops(cls, kwargs) -> None:
    sae = random_sae(cls, **kwargs)
    x = torch.randn(300, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    stats = concept_statistics(sae, x)
    codes = sae.encode(x).numpy()
    np.testing.assert_allclose(stats["frequency"], (codes != 0).mean(0))
    np.testing.assert_allclose(stats["mean_value"], codes.mean(0), atol=1e-12)
    step_sum, count = plain_steps(sae, x)
    expected = np.where(count > 0, step_sum / np.maximum(count, 1), np.nan)
    got = np.array([np.nan if v is None else v for v in stats["mean_step"]])
    np.testing.assert_allclose(got, expected, equal_nan=True)
    assert stats["top_by_frequency"][0] == int(np.argmax((codes != 0).mean(0)))
    # the value when active, E[z_j | z_j != 0], from the nonzero codes themselves
    when_active = np.array(
        [codes[codes[:, j] != 0, j].mean() if (codes[:, j] != 0).any() else np.nan for j in range(sae.d_sae)]
    )
    got_active = np.array([np.nan if v is None else v for v in stats["value_when_active"]])
    np.testing.assert_allclose(got_active, when_active, equal_nan=True, rtol=1e-10)
    fired = ~np.isnan(when_active)
    assert stats["value_when_active_cv"] == pytest.approx(abs(when_active[fired].std() / when_active[fired].mean()))
    assert stats["spearman_value_when_active_vs_step"] == pytest.approx(
        spearmanr(when_active[fired], expected[fired]).statistic
    )
    assert stats["spearman_frequency_vs_value_when_active"] == pytest.approx(
        spearmanr((codes != 0).mean(0)[fired], when_active[fired]).statistic
    )
    W, minus_b = sae.W_dec.numpy(), -sae.b_pre.numpy()
    cosines = W @ minus_b / (np.linalg.norm(W, axis=1) * np.linalg.norm(minus_b))
    assert stats["negative_atom"]["index"] == int(np.argmax(cosines))


@pytest.mark.parametrize("cls, kwargs", [(MatchingPursuitSAE, {"k": 6}), (TopKSAE, {"k": 6}), (ReLUSAE, {})])
@torch.no_grad()
def test_sequential_reconstruction_ends_at_the_models_reconstruction(cls, kwargs) -> None:
    sae = random_sae(cls, **kwargs)
    x = torch.randn(12, dtype=torch.float64)
    sequence = sequential_reconstruction(sae, x)
    np.testing.assert_allclose(sequence["partials"][0], sae.b_pre.numpy())
    np.testing.assert_allclose(sequence["partials"][-1], sae.decode(sae.encode(x[None]))[0].numpy(), atol=1e-10)
    norms = sequence["residual_norms"]
    if cls is MatchingPursuitSAE:  # Proposition 2: the residual never grows
        assert all(b <= a + 1e-12 for a, b in zip(norms, norms[1:]))
    indices, _ = selection_order(sae, x[None])
    assert sequence["order"] == indices[0][indices[0] >= 0].tolist()


def test_spearman_matches_scipy() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(50), rng.integers(0, 5, 50).astype(float)  # ties in b
    assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic)
    assert spearman(a[:2], b[:2]) is None and spearman(a, np.ones(50)) is None
