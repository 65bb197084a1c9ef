"""SAE variants and their registry: one file per variant over :mod:`sae_pipeline.sae.base`.

Shallow SAEs (ReLU, JumpReLU, TopK, BatchTopK) infer codes in one encoder pass; MP-SAE
unrolls Matching Pursuit over a weight-tied dictionary (Costa et al. 2025).

``VARIANTS`` is the registry: to add a variant, import its class here and list it there (its
key, label, sparsity knob, ... are class attributes, see :class:`SparseAutoencoder`), then add
its ``configs/<key>_<data>.yaml``. Tables, legends and reports name a variant by
:func:`display_label`, read from here. Configs name a variant by ``sae_pipeline.sae.<ClassName>``,
which the import here provides.
"""

from __future__ import annotations

import inspect

from sae_pipeline.sae.base import SAELoss, SAEOutput, ShallowSAE, SparseAutoencoder
from sae_pipeline.sae.batchtopk import BatchTopKSAE
from sae_pipeline.sae.jumprelu import JumpReLUSAE
from sae_pipeline.sae.matryoshka import MatryoshkaBatchTopKSAE
from sae_pipeline.sae.mp import MatchingPursuitSAE
from sae_pipeline.sae.omp import OMPSAE
from sae_pipeline.sae.relu import ReLUSAE
from sae_pipeline.sae.topk import TopKSAE

#: Every variant, in the order studies, tables and figures list them.
VARIANTS: tuple[type[SparseAutoencoder], ...] = (
    ReLUSAE,
    JumpReLUSAE,
    TopKSAE,
    BatchTopKSAE,
    MatryoshkaBatchTopKSAE,
    MatchingPursuitSAE,
    OMPSAE,
)


def _registry(classes: tuple[type[SparseAutoencoder], ...]) -> dict[str, type[SparseAutoencoder]]:
    """``{key: class}``; raises at import when a class lacks its own key or label, repeats a key, or names
    a sparsity knob that is not a constructor argument (so a half-registered variant fails every test)."""
    registry: dict[str, type[SparseAutoencoder]] = {}
    for cls in classes:
        if "key" not in vars(cls) or not cls.key or not cls.label:
            raise TypeError(f"{cls.__name__} must set its own class attributes key and label to be registered")
        if cls.key in registry or any(cls.key in other.aliases for other in classes):
            raise TypeError(f"SAE key {cls.key!r} of {cls.__name__} is already taken")
        if cls.sparsity_knob not in inspect.signature(cls).parameters:
            raise TypeError(f"{cls.__name__}.sparsity_knob {cls.sparsity_knob!r} is not a constructor argument")
        registry[cls.key] = cls
    return registry


#: ``{key: class}`` of every variant (canonical keys only; see ``SAE_ALIASES``).
SAE_REGISTRY: dict[str, type[SparseAutoencoder]] = _registry(VARIANTS)
#: ``{earlier key: key}``: names older exports and scripts may carry (``mp`` for ``mpsae``).
SAE_ALIASES: dict[str, str] = {alias: cls.key for cls in VARIANTS for alias in cls.aliases}


def get_sae_class(name: str) -> type[SparseAutoencoder]:
    """The variant class registered under ``name`` (or an earlier alias); ValueError listing the valid names."""
    try:
        return SAE_REGISTRY[SAE_ALIASES.get(name, name)]
    except (KeyError, TypeError):
        raise ValueError(f"unknown SAE variant {name!r}; choose one of {', '.join(SAE_REGISTRY)}") from None


def display_label(name: str) -> str:
    """What tables, figure legends and reports call the variant keyed ``name`` (its class's ``label``);
    any other name (a curve that is no variant of ours, such as another dictionary) is shown as it is."""
    cls = SAE_REGISTRY.get(name)
    return name if cls is None else cls.label


def variant_key(cls: type) -> str | None:
    """The registry key of a variant class (``"mpsae"``, ``"topk"``, ...), None for an unregistered class
    (a user's subclass inherits its parent's ``key`` attribute but is not that variant)."""
    return cls.key if SAE_REGISTRY.get(getattr(cls, "key", None)) is cls else None  # type: ignore[arg-type]


__all__ = [
    "SAE_ALIASES",
    "SAE_REGISTRY",
    "VARIANTS",
    "SAELoss",
    "SAEOutput",
    "ShallowSAE",
    "SparseAutoencoder",
    "display_label",
    "get_sae_class",
    "variant_key",
    *(cls.__name__ for cls in VARIANTS),
]
