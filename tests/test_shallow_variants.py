"""Each shallow variant's own behaviour against a plain re-derivation (TopK, BatchTopK, JumpReLU, ReLU, AuxK)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from sae_variants_fixtures import D_IN, D_SAE, K, batch, make
from torch import Tensor

from sae_pipeline.sae import BatchTopKSAE, JumpReLUSAE, TopKSAE


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
