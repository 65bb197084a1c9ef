"""The variant registry: one key per variant, what the package reads off a class, named loss terms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sae_variants_fixtures import BATCH, D_IN, D_SAE, K, batch, make
from torch import Tensor

import sae_pipeline.sae as sae_package
from sae_pipeline.sae import (
    SAE_ALIASES,
    SAE_REGISTRY,
    VARIANTS,
    BatchTopKSAE,
    JumpReLUSAE,
    MatchingPursuitSAE,
    ReLUSAE,
    SAELoss,
    TopKSAE,
    display_label,
    get_sae_class,
    variant_key,
)


def test_registry() -> None:
    assert get_sae_class("mpsae") is MatchingPursuitSAE and get_sae_class("relu") is ReLUSAE
    assert {"relu", "jumprelu", "topk", "batchtopk", "mpsae"} <= set(SAE_REGISTRY)
    assert list(SAE_REGISTRY.values()) == list(VARIANTS)
    with pytest.raises(ValueError) as info:
        get_sae_class("gated")
    assert all(name in str(info.value) for name in SAE_REGISTRY)
    assert variant_key(MatchingPursuitSAE) == "mpsae" and variant_key(BatchTopKSAE) == "batchtopk"

    class MyTopK(TopKSAE):  # inherits key "topk" but is not the registered variant
        pass

    assert variant_key(MyTopK) is None and variant_key(int) is None


def test_display_labels_are_the_classes_labels() -> None:
    """Tables, legends and reports name a variant by its class's label; any other curve keeps its own name."""
    assert [display_label(key) for key in SAE_REGISTRY] == [cls.label for cls in VARIANTS]
    assert display_label("mpsae") == "MP-SAE" and display_label("topk") == "TopK"
    assert display_label("MP-SAE (paper authors)") == "MP-SAE (paper authors)"


def test_mp_alias_still_resolves() -> None:
    """``mp`` was MP-SAE's key (registry, exported config.json) before ``mpsae``; old names still work."""
    assert SAE_ALIASES["mp"] == "mpsae"
    assert get_sae_class("mp") is MatchingPursuitSAE
    assert "mp" not in SAE_REGISTRY  # listings show one name per variant


@pytest.mark.parametrize("name", sorted(SAE_REGISTRY))
def test_class_metadata(name: str) -> None:
    """What the rest of the package reads off a variant class: one key, a label, a sparsity knob that
    is a constructor argument and sets the sparsity for the study planner, the pursuit flag."""
    cls = SAE_REGISTRY[name]
    assert cls.key == name and "key" in vars(cls) and cls.label
    assert getattr(sae_package, cls.__name__) is cls  # configs' class_path: sae_pipeline.sae.<ClassName>
    args = cls.sparsity_init_args(7, "digits")
    assert cls.sparsity_knob in args
    sae = cls(D_IN, D_SAE, **{**cls.test_kwargs, **args})
    assert getattr(sae, cls.sparsity_knob) == args[cls.sparsity_knob]
    assert cls.is_pursuit == hasattr(cls, "pursuit")
    if cls.is_pursuit:
        indices, coefficients = make(name).pursuit(batch(), 3)
        assert indices.shape == coefficients.shape == (BATCH, 3)


def test_sparsity_init_args() -> None:
    """k itself, JumpReLU's target L0, ReLU's L1 coefficient calibrated per data set (smaller λ for larger k)."""
    assert TopKSAE.sparsity_init_args(8) == {"k": 8} == MatchingPursuitSAE.sparsity_init_args(8, "mnist")
    assert JumpReLUSAE.sparsity_init_args(8) == {"target_l0": 8}
    relu = [ReLUSAE.sparsity_init_args(k)["l1_coefficient"] for k in (5, 10, 40)]
    assert relu[0] > relu[1] > relu[2] > 0 and relu[1] == 0.038
    assert (
        ReLUSAE.sparsity_init_args(10, "mnist_sample")
        == ReLUSAE.sparsity_init_args(10, "mnist")
        == {"l1_coefficient": 0.0085}
    )
    assert ReLUSAE.sparsity_init_args(10, "shards/dinov2") == {"l1_coefficient": 0.038}


def test_loss_terms_are_named_and_summed() -> None:
    """A variant adds a term by extending loss_terms: it enters the loss and SAELoss keeps it by name."""

    class WithExtraTerm(TopKSAE):
        def loss_terms(self, x: Tensor, output, step: int) -> dict[str, Tensor]:
            return {**super().loss_terms(x, output, step), "code_energy": 0.5 * output.codes.square().mean()}

    torch.manual_seed(0)
    sae, x = WithExtraTerm(D_IN, D_SAE, k=K), batch()
    out = sae(x)
    losses = sae.loss(x, out)
    assert list(losses.terms) == ["mse", "sparsity_loss", "aux_loss", "code_energy"]
    torch.testing.assert_close(losses.loss, F.mse_loss(out.x_hat, x) + 0.5 * out.codes.square().mean())
    for bad in ({}, {"loss": x.sum()}, {"": x.sum()}):
        with pytest.raises(ValueError, match="loss terms"):
            SAELoss(bad)
