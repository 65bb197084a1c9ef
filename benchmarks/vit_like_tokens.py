"""Synthetic ViT-like token activations (tests, benchmarks): sparse structure, heavy tails, a few massive dimensions.

Why: the backbone configs (``configs/*_dinov2.yaml``) must train on tokens that look like DINOv2's
final layer, which a CPU test cannot extract. What matters for the SAEs is reproduced:

- a sparse generative structure (each token a few atoms of a hidden dictionary, log-normal
  coefficients), so an SAE can reach a high R²;
- a non-zero mean and heavy-tailed (Student-t) noise;
- "register / CLS" tokens (``massive_share`` of them) whose few ``massive_dims`` hold values ~50x
  the typical coordinate, as DINOv2's registers and CLS token do: they dominate E‖x‖², so after
  the input normalisation (E‖x‖² = d_in) ordinary tokens are much smaller than unit scale.
"""

from __future__ import annotations

import numpy as np


def vit_like_tokens(
    n: int,
    d: int,
    seed: int = 0,
    n_atoms: int | None = None,
    active: int = 8,
    massive_dims: int = 3,
    massive_share: float = 0.04,
    massive_value: float = 50.0,
) -> np.ndarray:
    """``[n, d]`` float32 tokens (see the module docstring)."""
    rng = np.random.default_rng(seed)
    n_atoms = n_atoms or 4 * d
    atoms = rng.standard_normal((n_atoms, d))
    atoms /= np.linalg.norm(atoms, axis=1, keepdims=True)
    # Zipf-like atom popularity, as real features are
    popularity = 1.0 / np.arange(1, n_atoms + 1) ** 0.7
    popularity /= popularity.sum()
    chosen = np.stack([rng.choice(n_atoms, size=active, replace=False, p=popularity) for _ in range(n)])
    coefficients = rng.lognormal(mean=0.0, sigma=0.75, size=(n, active)) * np.sqrt(d / active)
    tokens = np.einsum("na,nad->nd", coefficients, atoms[chosen])
    tokens += 0.5 * rng.standard_normal(d)  # a common offset (ViT features are not centred)
    tokens += 0.1 * rng.standard_t(df=3, size=(n, d))
    massive = rng.random(n) < massive_share
    pattern = massive_value * np.sqrt(d / 64) * rng.choice([-1.0, 1.0], size=massive_dims)
    tokens[np.ix_(massive, np.arange(massive_dims))] = pattern * (
        1 + 0.05 * rng.standard_normal((int(massive.sum()), massive_dims))
    )
    return tokens.astype(np.float32)
