"""Every SAE variant against the shared contract (shapes, unit atoms, round trips, bad input)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sae_variants_fixtures import BATCH, D_IN, D_SAE, KWARGS, batch, hyper_parameters, make

from sae_pipeline.sae import SAE_REGISTRY, get_sae_class
from sae_pipeline.sae.base import ShallowSAE


@pytest.mark.parametrize("name", sorted(SAE_REGISTRY))
def test_shapes_and_decoding(name: str) -> None:
    sae = make(name)
    x = batch()
    out = sae(x)
    assert out.x_hat.shape == (BATCH, D_IN) and out.codes.shape == (BATCH, D_SAE)
    if not isinstance(sae, ShallowSAE):  # MP-SAE: no encoder, no pre-activations
        assert out.pre_acts is None
    else:
        assert out.pre_acts is not None and out.pre_acts.shape == (BATCH, D_SAE)
    torch.testing.assert_close(out.x_hat, out.codes @ sae.W_dec + sae.b_pre)
    torch.testing.assert_close(sae.decode(out.codes), out.codes @ sae.W_dec + sae.b_pre)
    losses = sae.loss(x, out, step=3)
    torch.testing.assert_close(losses.mse, F.mse_loss(out.x_hat, x))
    assert {"mse", "sparsity_loss", "aux_loss"} <= set(losses.terms)
    torch.testing.assert_close(losses.loss, sum(losses.terms.values()))
    extra = sum(
        (term for name, term in losses.terms.items() if name not in ("mse", "sparsity_loss", "aux_loss")),
        losses.loss.new_zeros(()),
    )  # a variant's own terms (Matryoshka's prefix MSEs)
    torch.testing.assert_close(losses.loss, losses.mse + losses.sparsity + losses.aux + extra)
    losses.loss.backward()
    assert sae.W_dec.grad is not None and sae.W_dec.grad.abs().sum() > 0
    assert sae.encode(x).shape == (BATCH, D_SAE)


@pytest.mark.parametrize("name", sorted(SAE_REGISTRY))
def test_atoms_start_and_stay_unit_norm(name: str) -> None:
    sae = make(name)
    torch.testing.assert_close(sae.W_dec.norm(dim=1), torch.ones(D_SAE))
    directions = F.normalize(sae.W_dec.detach(), dim=1)
    with torch.no_grad():
        sae.W_dec.mul_(torch.rand(D_SAE, 1) * 3 + 0.1)
    sae.normalize_atoms()
    torch.testing.assert_close(sae.W_dec.norm(dim=1), torch.ones(D_SAE))
    torch.testing.assert_close(sae.W_dec.detach(), directions)


@pytest.mark.parametrize("name", sorted(SAE_REGISTRY))
def test_remove_parallel_grad(name: str) -> None:
    sae = make(name).double()
    with torch.no_grad():
        sae.W_dec.mul_(torch.rand(D_SAE, 1, dtype=torch.float64) + 0.5)  # also off the unit sphere
    grad = torch.randn(D_SAE, D_IN, dtype=torch.float64)
    sae.W_dec.grad = grad.clone()
    sae.remove_parallel_grad()
    W = sae.W_dec.detach()
    expected = grad - ((grad * W).sum(1, keepdim=True) / (W * W).sum(1, keepdim=True)) * W
    torch.testing.assert_close(sae.W_dec.grad, expected)
    assert (sae.W_dec.grad * W).sum(1).abs().max() < 1e-12


@pytest.mark.parametrize("name", sorted(SAE_REGISTRY))
def test_to_float64_and_state_dict_round_trip(name: str) -> None:
    sae = make(name, seed=0).double()
    x = batch(dtype=torch.float64)
    sae.train()
    sae(x)  # BatchTopK: moves the threshold buffer
    sae.record_firing(torch.rand(D_SAE) < 0.5, n_tokens=BATCH)
    sae.eval()
    assert sae(x).x_hat.dtype == torch.float64
    assert sae.tokens_since_fired.dtype == torch.int64
    state = sae.state_dict()
    assert "tokens_since_fired" in state
    if name == "batchtopk":
        assert {"threshold", "n_threshold_updates"} <= set(state) and state["threshold"] > 0
    other = make(name, seed=123).double().eval()
    other.load_state_dict(state)
    for key, value in sae.state_dict().items():
        torch.testing.assert_close(other.state_dict()[key], value, rtol=0, atol=0)
    torch.testing.assert_close(other(x).x_hat, sae(x).x_hat, rtol=0, atol=0)
    torch.testing.assert_close(other.encode(x, 2), sae.encode(x, 2), rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(SAE_REGISTRY))
def test_train_eval_do_not_change_hyper_parameters(name: str) -> None:
    sae = make(name)
    before = hyper_parameters(sae)
    assert before["d_in"] == D_IN and before["d_sae"] == D_SAE
    sae.eval()
    sae.train()
    sae.eval()
    assert hyper_parameters(sae) == before


BAD_HYPER_PARAMETERS = [
    ("relu", {"d_in": 0}, "d_in"),
    ("relu", {"d_sae": 0}, "d_sae"),
    ("relu", {"l1_coefficient": float("nan")}, "l1_coefficient"),
    ("relu", {"l1_coefficient": -1.0}, "l1_coefficient"),
    ("relu", {"l1_warmup_steps": -1}, "l1_warmup_steps"),
    ("relu", {"dead_after_tokens": 0}, "dead_after_tokens"),
    ("jumprelu", {"bandwidth": 0.0}, "bandwidth"),
    ("jumprelu", {"initial_threshold": float("inf")}, "initial_threshold"),
    ("jumprelu", {"sparsity_coefficient": float("nan")}, "sparsity_coefficient"),
    ("jumprelu", {"sparsity_loss": "l1"}, "sparsity_loss"),
    ("jumprelu", {"sparsity_loss": "target_l0"}, "target_l0"),
    ("jumprelu", {"sparsity_loss": "target_l0", "target_l0": 0.0}, "target_l0"),
    ("topk", {"k": 0}, "k must"),
    ("topk", {"k": D_SAE + 1}, "k must"),
    ("topk", {"k_aux": 0}, "k_aux"),
    ("topk", {"aux_coefficient": float("inf")}, "aux_coefficient"),
    ("batchtopk", {"k": D_SAE + 1}, "k must"),
    ("batchtopk", {"threshold_momentum": 1.0}, "threshold_momentum"),
    ("batchtopk", {"threshold_momentum": float("nan")}, "threshold_momentum"),
    ("mpsae", {"k": 0}, "k must"),
]


@pytest.mark.parametrize("name, overrides, match", BAD_HYPER_PARAMETERS)
def test_bad_hyper_parameters_raise(name: str, overrides: dict, match: str) -> None:
    kwargs = {"d_in": D_IN, "d_sae": D_SAE, **KWARGS[name], **overrides}
    with pytest.raises(ValueError, match=match):
        get_sae_class(name)(**kwargs)


@pytest.mark.parametrize("name", sorted(SAE_REGISTRY))
def test_bad_inputs_raise(name: str) -> None:
    sae = make(name)
    x = batch()
    x[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        sae(x)
    with pytest.raises(ValueError, match="NaN"):
        sae.encode(x)
    with pytest.raises(ValueError, match=f"d_in={D_IN}"):
        sae(torch.randn(4, D_IN + 1))
    for k in (0, D_SAE + 1) if not sae.k_above_d_sae else (0, -1):  # MP accepts k > d_sae (atoms repeat)
        with pytest.raises(ValueError, match="k must"):
            sae.encode(batch(), k)
    with pytest.raises(ValueError, match="mean"):
        sae.init_b_pre(torch.zeros(D_IN + 1))


@pytest.mark.parametrize("name", sorted(SAE_REGISTRY))
def test_encode_with_inference_k_keeps_at_most_k(name: str) -> None:
    sae = make(name).eval()
    x = batch()
    for k in (1, 3, 7):
        assert (sae.encode(x, k) != 0).sum(1).le(k).all()
    if name in ("relu", "jumprelu"):  # the k largest of the variant's own codes
        own = sae.encode(x)
        values, indices = own.topk(3, dim=1)
        torch.testing.assert_close(sae.encode(x, 3), torch.zeros_like(own).scatter(1, indices, values))


@pytest.mark.parametrize("name", sorted(key for key, cls in SAE_REGISTRY.items() if cls.is_pursuit))
def test_pursuit_runs_in_half_precision_and_keeps_dtypes(name: str) -> None:
    torch.manual_seed(5)
    sae = SAE_REGISTRY[name](16, 64, 4).double()
    with torch.no_grad():
        sae.b_pre.normal_()
    sae = sae.to(torch.bfloat16)
    x = torch.randn(32, 16, dtype=torch.bfloat16)
    out = sae(x)
    sae.loss(x, out).loss.backward()
    assert out.x_hat.dtype == out.codes.dtype == sae.W_dec.grad.dtype == torch.bfloat16
    assert (out.codes != 0).sum(dim=1).le(4).all()
    # Same dictionary in float32: bf16 correlations may break near-ties differently, so
    # compare the tokens whose selected atoms agree (most of them).
    ref = SAE_REGISTRY[name](16, 64, 4)
    ref.load_state_dict({key: value.float() for key, value in sae.state_dict().items()})
    with torch.no_grad():
        same = (sae.pursuit(x)[0] == ref.pursuit(x.float())[0]).all(dim=1)
        ref_x_hat = ref(x.float()).x_hat
    assert same.float().mean() >= 0.75
    torch.testing.assert_close(out.x_hat.float()[same], ref_x_hat[same], rtol=0.03, atol=0.03)
