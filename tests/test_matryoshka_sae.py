"""Matryoshka BatchTopK against a plain re-derivation: dense prefix decodes, autograd, float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from sae_pipeline.sae import BatchTopKSAE, MatryoshkaBatchTopKSAE, get_sae_class
from sae_pipeline.sae.matryoshka import prefix_widths

D_IN, D_SAE, K, BATCH = 12, 64, 4, 32


def make(seed: int = 0, **kwargs: object) -> MatryoshkaBatchTopKSAE:
    torch.manual_seed(seed)
    sae = MatryoshkaBatchTopKSAE(D_IN, D_SAE, K, **kwargs).double()
    with torch.no_grad():
        sae.b_pre.normal_(std=0.3)
        sae.b_enc.normal_(std=0.1)
    return sae


def reference_terms(sae: MatryoshkaBatchTopKSAE, x: Tensor, codes: Tensor) -> dict[str, Tensor]:
    """Each inner prefix decoded densely from the first m codes and atoms."""
    return {f"mse_prefix_{m}": F.mse_loss(codes[:, :m] @ sae.W_dec[:m] + sae.b_pre, x) for m in sae.prefix_widths[:-1]}


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("training", [True, False])
def test_prefix_losses_and_gradients_match_dense_reference(sparse: bool, training: bool) -> None:
    sae = make(n_prefixes=4, prefix_ratio=2.0)
    sae.sparse_max_density = 1.0 if sparse else 0.0
    assert sae.prefix_widths == (8, 16, 32, 64)
    x = torch.randn(BATCH, D_IN, dtype=torch.float64)
    if not training:
        sae(x)  # one training batch sets θ
        sae.eval()
    out = sae(x)
    assert (out.sparse is not None) == sparse
    losses = sae.loss(x, out)
    names = [f"mse_prefix_{m}" for m in (8, 16, 32)]
    assert list(losses.terms) == ["mse", "sparsity_loss", "aux_loss", *names]
    torch.testing.assert_close(losses.loss, sum(losses.terms.values()))

    # reference: the same SAE's dense codes, every prefix decoded densely, autograd
    ref = make(n_prefixes=4, prefix_ratio=2.0)
    ref.load_state_dict(sae.state_dict())
    ref.sparse_max_density = 0.0
    ref.train(sae.training)
    ref_out = ref(x)
    torch.testing.assert_close(ref_out.codes, out.codes.detach())
    expected = reference_terms(ref, x, ref_out.codes)
    for name in names:
        torch.testing.assert_close(losses.terms[name], expected[name], rtol=1e-12, atol=1e-12)
    ref_loss = F.mse_loss(ref_out.x_hat, x) + sum(expected.values())
    losses.loss.backward()
    ref_loss.backward()
    for name, param in sae.named_parameters():
        torch.testing.assert_close(
            param.grad,
            dict(ref.named_parameters())[name].grad,
            rtol=1e-10,
            atol=1e-12,
            msg=lambda m, name=name: f"{name}: {m}",
        )


def test_codes_are_batchtopk_codes() -> None:
    """Only the loss differs from BatchTopK: same weights give the same codes, x_hat and θ."""
    sae = make()
    plain = BatchTopKSAE(D_IN, D_SAE, K).double()
    plain.load_state_dict(sae.state_dict())
    x = torch.randn(BATCH, D_IN, dtype=torch.float64)
    out, plain_out = sae(x), plain(x)
    torch.testing.assert_close(out.codes, plain_out.codes, rtol=0, atol=0)
    torch.testing.assert_close(out.x_hat, plain_out.x_hat, rtol=0, atol=0)
    torch.testing.assert_close(sae.threshold, plain.threshold, rtol=0, atol=0)
    losses, plain_losses = sae.loss(x, out), plain.loss(x, plain_out)
    torch.testing.assert_close(losses.mse, plain_losses.mse)
    assert losses.loss > plain_losses.loss  # plus the prefix terms


def test_empty_group_and_single_prefix() -> None:
    """A group with no active latent contributes 0; one prefix is plain BatchTopK's loss."""
    sae = make(n_prefixes=2, prefix_ratio=2.0)
    x = torch.randn(BATCH, D_IN, dtype=torch.float64)
    with torch.no_grad():
        sae.b_enc[:32] = -100.0  # the first half never fires
    out = sae(x)
    torch.testing.assert_close(sae.loss(x, out).terms["mse_prefix_32"], F.mse_loss(sae.b_pre.expand_as(x), x))
    single = make(n_prefixes=1)
    out = single(x)
    assert set(single.loss(x, out).terms) == {"mse", "sparsity_loss", "aux_loss"}


def test_prefix_widths_and_bad_hyper_parameters() -> None:
    assert prefix_widths(1000, 4, 4.0) == (16, 62, 250, 1000)
    assert prefix_widths(19200, 4, 4.0) == (300, 1200, 4800, 19200)
    assert prefix_widths(48, 6, 4.0) == (1, 3, 12, 48)  # widths that round to 1 count once
    assert prefix_widths(100, 3, 1.5) == (44, 67, 100)
    assert MatryoshkaBatchTopKSAE(D_IN, D_SAE, K).prefix_widths == (1, 4, 16, 64)
    for bad, match in [
        ({"n_prefixes": 0}, "n_prefixes"),
        ({"n_prefixes": 2.5}, "n_prefixes"),
        ({"prefix_ratio": 1.0}, "prefix_ratio"),
        ({"prefix_ratio": float("inf")}, "prefix_ratio"),
    ]:
        with pytest.raises(ValueError, match=match):
            MatryoshkaBatchTopKSAE(D_IN, D_SAE, K, **bad)


def test_registered_and_trains() -> None:
    """Registry key and label; a few Adam steps lower both the full and the smallest prefix's MSE."""
    assert get_sae_class("matryoshka") is MatryoshkaBatchTopKSAE
    assert MatryoshkaBatchTopKSAE.label == "Matryoshka BatchTopK"
    torch.manual_seed(0)
    sae = MatryoshkaBatchTopKSAE(16, 64, 4, n_prefixes=2, prefix_ratio=8.0)
    x = torch.randn(128, 6) @ torch.randn(6, 16)
    sae.init_b_pre(x.mean(0))
    optimizer = torch.optim.Adam(sae.parameters(), lr=1e-2)
    history = []
    for _ in range(15):
        optimizer.zero_grad()
        losses = sae.loss(x, sae(x))
        losses.loss.backward()
        sae.remove_parallel_grad()
        optimizer.step()
        sae.normalize_atoms()
        history.append({name: float(term.detach()) for name, term in losses.terms.items()})
    assert history[-1]["mse"] < history[0]["mse"] and history[-1]["mse_prefix_8"] < history[0]["mse_prefix_8"]
