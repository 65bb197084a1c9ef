"""JumpReLU at backbone scale: float32 pre-activations and threshold under bf16 autocast, θ calibrated to the
target L0 on the first training batch, defaults that fit inputs normalised to E‖x‖² = d_in; MP-SAE with an
inference k above d_sae."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.vit_like_tokens import vit_like_tokens
from sae_pipeline.sae import BatchTopKSAE, JumpReLUSAE, MatchingPursuitSAE
from sae_pipeline.sae.jumprelu import DEFAULT_BANDWIDTH, UNCALIBRATED_THRESHOLD

D, P = 64, 512


def normalised_tokens(n: int = 2048, seed: int = 0) -> torch.Tensor:
    """ViT-like tokens (massive register-like dimensions) scaled to E‖x‖² = d_in, as SAEModule does."""
    x = torch.from_numpy(vit_like_tokens(n, D, seed=seed))
    return x * math.sqrt(D / float((x**2).sum(1).mean()))


def jumprelu(**kwargs: object) -> JumpReLUSAE:
    torch.manual_seed(0)
    sae = JumpReLUSAE(D, P, sparsity_loss="target_l0", target_l0=32, sparsity_coefficient=1.0, **kwargs)
    with torch.no_grad():
        sae.b_pre.copy_(normalised_tokens().mean(0))
    return sae


def test_pre_activations_and_threshold_gradient_stay_float32_under_bf16_autocast() -> None:
    x = normalised_tokens(512)
    sae = jumprelu(initial_threshold=0.8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = sae(x)
        loss = output.x_hat.float().pow(2).mean() + sae.sparsity_penalty(x, output, step=0)
    assert output.pre_acts.dtype == torch.float32
    loss.backward()
    grad_bf16 = sae.log_threshold.grad.clone()
    sae.zero_grad()
    reference = sae(x)  # plain float32
    (reference.x_hat.pow(2).mean() + sae.sparsity_penalty(x, reference, step=0)).backward()
    torch.testing.assert_close(output.pre_acts, reference.pre_acts)  # same float32 values, not bf16-rounded
    # The θ gradient counts pre-activations within ε/2 of θ; with bf16 pre-activations (spacing ~0.004 near 1)
    # that count is a rounding artefact. Here only the decoder matmul is bf16, so the count agrees:
    assert (grad_bf16 != 0).sum() == (sae.log_threshold.grad != 0).sum() > 0
    assert torch.sign(grad_bf16).eq(torch.sign(sae.log_threshold.grad)).float().mean() > 0.95


def test_threshold_is_calibrated_to_the_target_l0_on_the_first_training_batch_only() -> None:
    sae = jumprelu()
    assert sae.bandwidth == DEFAULT_BANDWIDTH and sae.initial_threshold is None
    x = normalised_tokens()
    assert torch.allclose(sae.threshold, torch.full((P,), UNCALIBRATED_THRESHOLD))
    sae.eval()
    sae(x)  # evaluation does not calibrate
    assert torch.allclose(sae.threshold, torch.full((P,), UNCALIBRATED_THRESHOLD))
    sae.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = sae(x)
    l0 = float((first.codes != 0).sum(1).float().mean())
    assert abs(l0 - 32) <= 1, l0  # the batch's quantile: L0 = target on that batch
    theta = sae.threshold.detach().clone()
    sae(normalised_tokens(seed=1))
    assert torch.equal(sae.threshold, theta)  # once
    loaded = jumprelu()
    loaded.load_state_dict(sae.state_dict())
    loaded.train()(x)
    assert torch.equal(loaded.threshold, theta)  # a loaded or resumed model keeps its θ


def test_explicit_initial_threshold_is_kept() -> None:
    sae = jumprelu(initial_threshold=0.7).train()
    sae(normalised_tokens())
    assert torch.allclose(sae.threshold, torch.full((P,), 0.7))


def test_mp_sae_accepts_an_inference_k_above_d_sae() -> None:
    torch.manual_seed(0)
    sae = MatchingPursuitSAE(16, 8, k=4)
    x = torch.randn(64, 16)
    errors = []
    with torch.no_grad():
        for k in (4, 8, 9, 16, 40):
            codes = sae.encode(x, k)
            assert (codes != 0).sum(1).max() <= 8  # atoms repeat: at most d_sae distinct ones
            residual = x - sae.decode(codes)
            errors.append(float(residual.pow(2).sum()))
            norms = sae.residual_norms(x, k)
            assert norms.shape == (64, k + 1)
            torch.testing.assert_close(norms[:, -1], residual.norm(dim=1), rtol=1e-4, atol=1e-5)
    assert all(b <= a + 1e-4 for a, b in zip(errors, errors[1:]))  # Proposition 2 beyond d_sae steps
    assert errors[-1] < errors[1]  # steps 9..40 still reduce the residual


def scaled_pair(cls: type, **kwargs: object) -> tuple:
    """Two float64 copies of one SAE with a token-scaled threshold: the dense and the sparse path."""
    torch.manual_seed(0)
    dense = cls(16, 64, token_scaled_threshold=True, **kwargs).double()
    sparse = cls(16, 64, token_scaled_threshold=True, **kwargs).double()
    sparse.load_state_dict(dense.state_dict())
    dense.sparse_max_density, sparse.sparse_max_density = 0.0, 1.0
    return dense, sparse


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (
            JumpReLUSAE,
            {
                "sparsity_loss": "target_l0",
                "target_l0": 8,
                "initial_threshold": 0.5,
                "bandwidth": 0.5,
                "l0_gradient_to_encoder": True,
            },
        ),
        (BatchTopKSAE, {"k": 8}),
    ],
)
def test_token_scaled_threshold_ignores_a_tokens_norm_and_matches_the_plain_reference(cls: type, kwargs: dict) -> None:
    dense, sparse = scaled_pair(cls, **kwargs)
    x = torch.randn(32, 16, dtype=torch.float64) * torch.logspace(-1, 2, 32, dtype=torch.float64)[:, None]
    for sae in (dense, sparse):
        output = sae(x)
        sae.loss(x, output).loss.backward()
    assert sparse(x).sparse is not None
    torch.testing.assert_close(dense(x).x_hat, sparse(x).x_hat)
    for (name, a), b in zip(dense.named_parameters(), sparse.parameters()):
        if a.grad is not None or b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, msg=name)
    sae = dense.eval()
    with torch.no_grad():
        sae.b_enc.zero_()
        codes = sae.encode(x)
        scale = (x - sae.b_pre).norm(dim=1, keepdim=True) / 4.0  # ‖x − b_pre‖/√d_in, plain
        pre = (x - sae.b_pre) @ sae.W_enc
        theta = sae.threshold if cls is JumpReLUSAE else sae.threshold.clamp_min(0)
        reference = pre * (pre > theta * scale) if cls is JumpReLUSAE else pre.clamp_min(0) * (pre / scale > theta)
        torch.testing.assert_close(codes, reference)
        # b_enc = 0: a token scaled about b_pre by 1000 keeps its support (a per-latent θ would open it wide)
        far = sae.b_pre + 1000 * (x - sae.b_pre)
        assert torch.equal(sae.encode(far) != 0, codes != 0)
        before = sae.encode(x)
        sae.fold_input_scale(3.0)  # θ is unitless: folding a normalisation leaves it
        torch.testing.assert_close(sae.encode(x / 3.0) * 3.0, before)


def test_l0_gradient_reaches_the_encoder_only_when_asked() -> None:
    x = normalised_tokens(256)
    grads = {}
    for flag in (False, True):
        sae = jumprelu(initial_threshold=0.5, l0_gradient_to_encoder=flag)
        output = sae(x)
        sae.sparsity_penalty(x, output, step=0).backward()
        grads[flag] = (sae.W_enc.grad, sae.log_threshold.grad)
    assert (grads[False][0] is None or not grads[False][0].any()) and grads[True][0].abs().sum() > 0
    torch.testing.assert_close(grads[False][1], grads[True][1])  # θ's own gradient is unchanged


def test_saelens_export_refuses_a_token_scaled_threshold() -> None:
    from sae_pipeline.artifacts.saelens_export import saelens_architecture
    from sae_pipeline.sae.config import ExportError

    assert saelens_architecture(BatchTopKSAE(8, 16, k=2)) == "jumprelu"
    with pytest.raises(ExportError, match="token_scaled_threshold"):
        saelens_architecture(BatchTopKSAE(8, 16, k=2, token_scaled_threshold=True))
