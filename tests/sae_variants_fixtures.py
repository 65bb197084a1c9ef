"""Small SAEs of every registered variant, built the same way by every variant test file."""

from __future__ import annotations

import copy
import inspect

import torch
from torch import Tensor

from sae_pipeline.sae import SAE_REGISTRY, SparseAutoencoder, get_sae_class

D_IN, D_SAE, K, BATCH = 12, 48, 4, 20  # the sizes every variant's test_kwargs are meant for
KWARGS: dict[str, dict] = {key: cls.test_kwargs for key, cls in SAE_REGISTRY.items()}


def make(name: str, seed: int = 0, **overrides: object) -> SparseAutoencoder:
    torch.manual_seed(seed)
    sae = get_sae_class(name)(D_IN, D_SAE, **{**KWARGS[name], **overrides})
    with torch.no_grad():
        sae.b_pre.normal_(std=0.3)
    return sae


def batch(seed: int = 1, n: int = BATCH, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(n, D_IN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def hyper_parameters(sae: SparseAutoencoder) -> dict[str, object]:
    """Every constructor argument, read back from the attribute of the same name, plus k."""
    names = [name for name in inspect.signature(type(sae)).parameters]
    return {name: copy.deepcopy(getattr(sae, name)) for name in [*names, "k"]}
