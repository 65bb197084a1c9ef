"""SAE variants and their registry: one file per variant over :mod:`sae_pipeline.sae.base`.

Shallow SAEs (ReLU, JumpReLU, TopK, BatchTopK) infer codes in one encoder pass; MP-SAE
unrolls Matching Pursuit over a weight-tied dictionary (Costa et al. 2025).
"""
from __future__ import annotations

from sae_pipeline.sae.base import SAELoss, SAEOutput, ShallowSAE, SparseAutoencoder
from sae_pipeline.sae.batchtopk import BatchTopKSAE
from sae_pipeline.sae.jumprelu import JumpReLUSAE
from sae_pipeline.sae.mp import MatchingPursuitSAE
from sae_pipeline.sae.relu import ReLUSAE
from sae_pipeline.sae.topk import TopKSAE

SAE_REGISTRY: dict[str, type[SparseAutoencoder]] = {
    "relu": ReLUSAE,
    "jumprelu": JumpReLUSAE,
    "topk": TopKSAE,
    "batchtopk": BatchTopKSAE,
    "mp": MatchingPursuitSAE,
}


def get_sae_class(name: str) -> type[SparseAutoencoder]:
    """The variant class registered under ``name``; ValueError listing the valid names."""
    try:
        return SAE_REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown SAE variant {name!r}; choose one of {', '.join(sorted(SAE_REGISTRY))}") from None


__all__ = [
    "SAE_REGISTRY",
    "BatchTopKSAE",
    "JumpReLUSAE",
    "MatchingPursuitSAE",
    "ReLUSAE",
    "SAELoss",
    "SAEOutput",
    "ShallowSAE",
    "SparseAutoencoder",
    "TopKSAE",
    "get_sae_class",
]
