"""Every SAE variant against the shared contract, and each variant against a plain re-derivation."""
from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
import torch.nn.functional as F
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
    SparseAutoencoder,
    TopKSAE,
    SAELoss,
    get_sae_class,
    variant_key,
)
from sae_pipeline.sae.base import ShallowSAE

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
    extra = sum((term for name, term in losses.terms.items() if name not in ("mse", "sparsity_loss", "aux_loss")),
                losses.loss.new_zeros(()))  # a variant's own terms (Matryoshka's prefix MSEs)
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
    assert ReLUSAE.sparsity_init_args(10, "mnist_sample") == ReLUSAE.sparsity_init_args(10, "mnist") == \
        {"l1_coefficient": 0.0085}
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


def test_init_b_pre_and_dead_bookkeeping() -> None:
    sae = make("topk", dead_after_tokens=100)
    mean = torch.randn(D_IN)
    sae.init_b_pre(mean)
    torch.testing.assert_close(sae.b_pre.detach(), mean)
    fired = torch.zeros(D_SAE, dtype=torch.bool)
    fired[:5] = True
    sae.record_firing(fired, 60)
    sae.record_firing(fired.roll(1), 60)
    expected = torch.full((D_SAE,), 120)
    expected[:5] = 60
    expected[1:6] = 0
    torch.testing.assert_close(sae.tokens_since_fired, expected)
    torch.testing.assert_close(sae.dead_mask(), expected >= 100)


def test_topk_keeps_exactly_k() -> None:
    sae = make("topk")
    x = batch(n=64)
    out = sae(x)
    assert (out.codes != 0).sum(1).eq(K).all()  # random inputs: far more than K positive
    pre = (x - sae.b_pre) @ sae.W_enc + sae.b_enc
    values, indices = F.relu(pre).topk(K, dim=1)
    torch.testing.assert_close(out.codes, torch.zeros_like(pre).scatter(1, indices, values))


def test_batchtopk_train_keeps_batch_k_and_eval_uses_threshold() -> None:
    sae = make("batchtopk", threshold_momentum=0.9)
    assert isinstance(sae, BatchTopKSAE)
    x1, x2 = batch(seed=1, n=32), batch(seed=2, n=32)
    sae.train()
    out = sae(x1)
    assert int((out.codes != 0).sum()) == 32 * K
    acts = F.relu(out.pre_acts).flatten()
    values, indices = acts.topk(32 * K)
    torch.testing.assert_close(out.codes.flatten(), torch.zeros_like(acts).scatter(0, indices, values))
    theta1 = values.min()
    torch.testing.assert_close(sae.threshold, theta1.detach())  # first update: the batch value
    out2 = sae(x2)
    theta2 = out2.codes[out2.codes > 0].min()
    torch.testing.assert_close(sae.threshold, 0.9 * theta1.detach() + 0.1 * theta2.detach())
    assert int(sae.n_threshold_updates) == 2

    sae.eval()
    frozen = sae.threshold.clone()
    pre = (x1 - sae.b_pre) @ sae.W_enc + sae.b_enc
    expected = F.relu(pre) * (F.relu(pre) > frozen)
    torch.testing.assert_close(sae(x1).codes, expected)
    torch.testing.assert_close(sae.threshold, frozen)  # eval does not move θ
    per_token = sae.encode(x1, 2)  # k given: per-token top-k in any mode
    assert (per_token != 0).sum(1).eq(2).all()


def test_jumprelu_threshold_straight_through_gradient() -> None:
    """θ-gradient against the rectangle-kernel formulas re-derived here (Rajamanoharan et al.)."""
    eps, lam = 0.4, 0.7
    sae = make("jumprelu", bandwidth=eps, initial_threshold=0.3, sparsity_coefficient=lam).double()
    assert isinstance(sae, JumpReLUSAE)
    with torch.no_grad():
        sae.log_threshold.add_(torch.randn(D_SAE, dtype=torch.float64) * 0.2)
    x = batch(n=64, dtype=torch.float64)
    out = sae(x)
    upstream = torch.randn_like(out.codes)
    ((out.codes * upstream).sum() + sae.sparsity_penalty(x, out, step=0)).backward()

    pre = out.pre_acts.detach()
    theta = sae.log_threshold.detach().exp()
    window = (((pre - theta) / eps).abs() < 0.5).double()
    assert window.sum() > 20  # the test exercises the kernel
    d_theta = (-(theta / eps) * window * upstream).sum(0)  # JumpReLU pseudo-derivative
    d_theta += lam * (-(1.0 / eps) * window).sum(0) / x.shape[0]  # λ·mean L0
    torch.testing.assert_close(sae.log_threshold.grad, d_theta * theta)  # chain rule through exp
    active = (pre > theta).double()
    torch.testing.assert_close(out.codes, pre * active)


def test_jumprelu_l0_gradient_is_the_smoothed_step_finite_difference() -> None:
    """d/dθ of Σ K_ε-smoothed H(pre − θ) (a clamp ramp) by central differences equals the STE."""
    eps = 0.5
    sae = make("jumprelu", bandwidth=eps, initial_threshold=0.2, sparsity_coefficient=1.0).double()
    x = batch(n=40, dtype=torch.float64)
    out = sae(x)
    sae.sparsity_penalty(x, out, step=0).backward()
    pre = out.pre_acts.detach()
    log_theta = sae.log_threshold.detach()

    def smoothed_l0(log_threshold: Tensor) -> Tensor:
        return ((pre - log_threshold.exp()) / eps + 0.5).clamp(0, 1).sum(1).mean()

    h = 1e-6
    fd = torch.empty(D_SAE, dtype=torch.float64)
    for i in range(D_SAE):
        step = torch.zeros(D_SAE, dtype=torch.float64)
        step[i] = h
        fd[i] = (smoothed_l0(log_theta + step) - smoothed_l0(log_theta - step)) / (2 * h)
    torch.testing.assert_close(sae.log_threshold.grad, fd, rtol=1e-5, atol=1e-6)


def test_jumprelu_target_l0_form() -> None:
    sae = make("jumprelu", sparsity_loss="target_l0", target_l0=5.0, sparsity_coefficient=2.0)
    x = batch()
    out = sae(x)
    l0 = (out.pre_acts > sae.threshold).float().sum(1).mean()
    torch.testing.assert_close(sae.loss(x, out).sparsity, 2.0 * (l0 / 5.0 - 1.0) ** 2)


def test_relu_l1_warmup_is_linear() -> None:
    sae = make("relu", l1_coefficient=0.01, l1_warmup_steps=10)
    x = batch()
    out = sae(x)
    l1 = out.codes.abs().sum(1).mean()
    for step, scale in [(0, 0.0), (5, 0.5), (10, 1.0), (25, 1.0)]:
        torch.testing.assert_close(sae.loss(x, out, step=step).sparsity, 0.01 * scale * l1)
    no_warmup = make("relu", l1_coefficient=0.01)
    torch.testing.assert_close(no_warmup.loss(x, no_warmup(x), step=0).sparsity, 0.01 * l1)


@pytest.mark.parametrize("name", ["topk", "batchtopk"])
def test_auxk_zero_without_dead_latents_and_reference_with(name: str) -> None:
    sae = make(name, k_aux=6, aux_coefficient=0.5, dead_after_tokens=10)
    assert isinstance(sae, TopKSAE)
    x = batch(n=32)
    out = sae(x)
    assert sae.loss(x, out).aux == 0
    dead = torch.zeros(D_SAE, dtype=torch.bool)
    dead[::3] = True
    sae.record_firing(~dead, n_tokens=10)
    assert torch.equal(sae.dead_mask(), dead)
    aux = sae.loss(x, out).aux
    # reference: top k_aux relu'd pre-activations among the dead, decoded WITHOUT b_pre
    pre = F.relu(out.pre_acts.detach())
    dead_pre = pre[:, dead]
    values, local = dead_pre.topk(6, dim=1)
    e_hat = torch.einsum("bk,bkd->bd", values, sae.W_dec.detach()[dead][local])
    expected = 0.5 * F.mse_loss(e_hat, (x - out.x_hat).detach())
    assert aux > 0
    torch.testing.assert_close(aux.detach(), expected)
    with_b_pre = 0.5 * F.mse_loss(e_hat + sae.b_pre.detach(), (x - out.x_hat).detach())
    assert not torch.isclose(aux.detach(), with_b_pre)
    aux.backward()  # the residual target is detached: no gradient reaches W_dec through x_hat
    assert sae.W_dec.grad[~dead].abs().sum() == 0 and sae.W_dec.grad[dead].abs().sum() > 0


def test_fewer_dead_than_k_aux() -> None:
    """Only two dead latents for k_aux = 10: AuxK uses exactly those two."""
    sae = make("topk", k_aux=10, dead_after_tokens=1)
    dead = torch.zeros(D_SAE, dtype=torch.bool)
    dead[[0, 7]] = True
    sae.record_firing(~dead, n_tokens=1)
    x = batch()
    out = sae(x)
    aux = sae.loss(x, out).aux.detach()
    e_hat = F.relu(out.pre_acts.detach()[:, dead]) @ sae.W_dec.detach()[dead]
    expected = (1 / 32) * F.mse_loss(e_hat, (x - out.x_hat).detach())
    assert math.isfinite(float(aux))
    torch.testing.assert_close(aux, expected)
