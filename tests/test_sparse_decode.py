"""The sparse path of the shallow SAEs against a plain dense re-derivation (codes, x_hat, loss and
every gradient, AuxK and the parallel-gradient removal included), and its building blocks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from sae_pipeline.sae import BatchTopKSAE, JumpReLUSAE, ReLUSAE, ShallowSAE, TopKSAE
from sae_pipeline.sae.sparse_decode import SparseCodes, sparse_decode, sparse_encode

D_IN, D_SAE, K, BATCH = 12, 48, 4, 20
MAKERS = {
    "topk": lambda: TopKSAE(D_IN, D_SAE, k=K, k_aux=6, aux_coefficient=0.5, dead_after_tokens=10),
    "batchtopk": lambda: BatchTopKSAE(D_IN, D_SAE, k=K, k_aux=6, aux_coefficient=0.5, dead_after_tokens=10),
    "relu": lambda: ReLUSAE(D_IN, D_SAE, l1_coefficient=0.01, dead_after_tokens=10),
    "jumprelu": lambda: JumpReLUSAE(
        D_IN, D_SAE, sparsity_coefficient=0.01, bandwidth=0.3, initial_threshold=0.4, dead_after_tokens=10
    ),
}


def make(name: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> ShallowSAE:
    torch.manual_seed(seed)
    sae = MAKERS[name]().to(dtype)
    with torch.no_grad():
        sae.b_pre.normal_(std=0.3)
        sae.b_enc.normal_(mean=-0.5 if name == "relu" else 0.0, std=0.3)  # ReLU: about a third active
        sae.W_enc.add_(0.2 * torch.randn_like(sae.W_enc))  # untie, so encoder and decoder gradients differ
    return sae


def batch(dtype: torch.dtype = torch.float64, n: int = BATCH, seed: int = 1) -> Tensor:
    return torch.randn(n, D_IN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def kill_every_third(sae: ShallowSAE) -> Tensor:
    dead = torch.zeros(D_SAE, dtype=torch.bool)
    dead[::3] = True
    sae.record_firing(~dead, n_tokens=sae.dead_after_tokens)
    assert torch.equal(sae.dead_mask(), dead)
    return dead


def reference_step(name: str, sae: ShallowSAE, x: Tensor) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
    """Plain dense autograd of the docs/design.md definitions: (x_hat, codes, loss, projected grads)."""
    params = {n: p.detach().clone().requires_grad_(True) for n, p in sae.named_parameters()}
    W_enc, b_enc, W_dec, b_pre = params["W_enc"], params["b_enc"], params["W_dec"], params["b_pre"]
    pre = (x - b_pre) @ W_enc + b_enc
    acts = F.relu(pre)
    sparsity = x.new_zeros(())
    if name == "topk":
        values, indices = acts.topk(K, dim=1)
        codes = torch.zeros_like(acts).scatter(1, indices, values)
    elif name == "batchtopk":
        values, indices = acts.flatten().topk(BATCH * K)
        codes = torch.zeros_like(acts).flatten().scatter(0, indices, values).view_as(acts)
    elif name == "relu":
        codes = acts
        sparsity = 0.01 * codes.abs().sum(1).mean()
    else:  # JumpReLU with its straight-through θ gradients written as surrogates
        theta = params["log_threshold"].exp()
        eps = sae.bandwidth
        step = (pre > theta).to(x.dtype).detach()
        kernel = (((pre - theta) / eps).abs() < 0.5).to(x.dtype).detach()
        codes = pre * step + (theta - theta.detach()) * (-(theta.detach() / eps) * kernel)
        l0 = (step + (theta - theta.detach()) * (-(1 / eps) * kernel)).sum(1).mean()
        sparsity = 0.01 * l0
    x_hat = codes @ W_dec + b_pre
    loss = F.mse_loss(x_hat, x) + sparsity
    dead = sae.dead_mask()
    if name in ("topk", "batchtopk") and dead.any():
        dead_acts = acts[:, dead]
        values, local = dead_acts.topk(min(6, int(dead.sum())), dim=1)
        e_hat = torch.einsum("bk,bkd->bd", values, W_dec[dead][local])
        loss = loss + 0.5 * F.mse_loss(e_hat, (x - x_hat).detach())
    loss.backward()
    grads = {n: p.grad for n, p in params.items()}
    g, w = grads["W_dec"], W_dec.detach()
    grads["W_dec"] = g - ((g * w).sum(1, keepdim=True) / (w * w).sum(1, keepdim=True)) * w
    return x_hat.detach(), codes.detach(), loss.detach(), grads


def our_step(sae: ShallowSAE, x: Tensor, density: float) -> tuple[object, Tensor, dict[str, Tensor]]:
    sae.sparse_max_density = density
    out = sae(x)
    loss = sae.loss(x, out).loss
    loss.backward()
    sae.remove_parallel_grad()
    return out, loss.detach(), {n: p.grad for n, p in sae.named_parameters()}


@pytest.mark.parametrize("with_dead", [False, True], ids=["no-dead", "dead"])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_sparse_path_equals_plain_reference_float64(name: str, with_dead: bool) -> None:
    template = make(name)
    if with_dead:
        kill_every_third(template)
    x = batch()
    x_hat, codes, loss, grads = reference_step(name, template, x)
    for density in (1.0, 0.0):  # sparse path, then the dense fallback: both equal the reference
        sae = copy.deepcopy(template)
        out, our_loss, our_grads = our_step(sae, x, density)
        assert (out.sparse is not None) == (density > 0)
        torch.testing.assert_close(out.x_hat.detach(), x_hat, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.codes.detach(), codes, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(our_loss, loss, rtol=1e-12, atol=1e-12)
        for pname, grad in grads.items():
            torch.testing.assert_close(our_grads[pname], grad, rtol=1e-11, atol=1e-12, msg=f"{name} d{pname}")
        assert int(out.l0() * BATCH) == int((codes != 0).sum())
        assert torch.equal(out.fired(), (codes != 0).any(0))
    if name == "jumprelu":  # the band below θ carries gradient: the test exercises it
        assert (((out.pre_acts - template.threshold.detach()) / 0.3).abs() < 0.5).any()
        assert grads["log_threshold"].abs().sum() > 0
    if with_dead and name in ("topk", "batchtopk"):
        assert grads["W_dec"][template.dead_mask()].abs().sum() > 0


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_sparse_path_float32_within_rounding(name: str) -> None:
    template = make(name, dtype=torch.float32)
    kill_every_third(template)
    x = batch(torch.float32)
    sparse_out, sparse_loss, sparse_grads = our_step(copy.deepcopy(template), x, 1.0)
    dense_out, dense_loss, dense_grads = our_step(copy.deepcopy(template), x, 0.0)
    assert sparse_out.sparse is not None and dense_out.sparse is None
    torch.testing.assert_close(sparse_out.x_hat, dense_out.x_hat, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sparse_out.codes, dense_out.codes, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sparse_loss, dense_loss, rtol=1e-5, atol=1e-6)
    for pname, grad in dense_grads.items():
        torch.testing.assert_close(sparse_grads[pname], grad, rtol=1e-4, atol=1e-5, msg=f"{name} d{pname}")


def test_functions_gradcheck_with_empty_tokens() -> None:
    """Both Functions against finite differences, with a token that has no entry."""
    torch.manual_seed(0)
    d_sae, d_in, n = 10, 5, 4
    mask = torch.rand(n, d_sae) < 0.4
    mask[2] = False
    support = SparseCodes.from_mask(mask)
    x = torch.randn(n, d_in, dtype=torch.float64, requires_grad=True)
    b_pre = torch.randn(d_in, dtype=torch.float64, requires_grad=True)
    W_enc = torch.randn(d_in, d_sae, dtype=torch.float64, requires_grad=True)
    b_enc = torch.randn(d_sae, dtype=torch.float64, requires_grad=True)
    W_dec = torch.randn(d_sae, d_in, dtype=torch.float64, requires_grad=True)

    def f(x: Tensor, b_pre: Tensor, W_enc: Tensor, b_enc: Tensor, W_dec: Tensor) -> Tensor:
        pre = ((x - b_pre) @ W_enc + b_enc).detach()
        values = sparse_encode(x, b_pre, W_enc, b_enc, pre, support)
        return sparse_decode(support.with_values(values), W_dec, b_pre)

    assert torch.autograd.gradcheck(f, (x, b_pre, W_enc, b_enc, W_dec))
    dense = ((x - b_pre) @ W_enc + b_enc) * mask
    torch.testing.assert_close(f(x, b_pre, W_enc, b_enc, W_dec), dense @ W_dec + b_pre)
    assert torch.equal(f(x, b_pre, W_enc, b_enc, W_dec)[2], b_pre.detach())  # no entry: only the bias


def test_no_dense_tensor_saved_for_backward_and_codes_built_only_on_demand() -> None:
    sae = TopKSAE(64, 1024, k=8)  # the default sparse_max_density applies: 8 / 1024 is sparse
    x = torch.randn(32, 64)
    saved: list[tuple[int, ...]] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = sae(x)
        loss = sae.loss(x, out).loss
    assert out.sparse is not None and out._codes is None  # nothing densified the codes
    assert saved and all(
        32 * 1024 not in (shape[0] * shape[-1] if shape else 1,) or shape in ((64, 1024), (1024, 64)) for shape in saved
    ), saved  # parameters and [B, d_in] / [nnz] tensors only
    loss.backward()
    assert out.codes.shape == (32, 1024) and int((out.codes != 0).sum(1).max()) <= 8


def test_dense_fallback_above_the_density_limit() -> None:
    sae = ReLUSAE(8, 64)  # at init about half the latents fire: far above 1/8
    out = sae(torch.randn(16, 8))
    assert out.sparse is None and out.codes.shape == (16, 64)


def test_a_kernel_that_fails_falls_back_once_with_the_reason(monkeypatch) -> None:
    """A Triton kernel that cannot compile on this GPU costs speed, not the run: the products answer through
    torch's operators from then on, with one warning naming the reason."""
    import types
    import warnings

    from sae_pipeline.sae import sparse_decode as module

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("PTX .version 9.9 does not support .target sm_90a\nmore")

    fake = types.SimpleNamespace(segment_sums=broken, entry_dots=broken)
    monkeypatch.setattr(module, "use_triton", True)
    monkeypatch.setattr(module, "_gpu_kernels", lambda *operands: fake if module.use_triton else None)
    torch.manual_seed(0)
    codes = module.SparseCodes.from_topk(torch.randn(6, 16).topk(3, dim=1).indices, 16)
    weight, values, grad = torch.randn(16, 5), torch.randn(18), torch.randn(6, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decoded = module.token_sums(codes, weight, values)
        dots = module.entry_dots(codes, grad, weight)
        sums = module.latent_sums(codes, grad, values)
    assert len(calls) == 1 and module.use_triton is False  # tried once, then torch's path only
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "RuntimeError: PTX .version 9.9" in messages[0] and "more" not in messages[0]
    dense = codes.with_values(values).to_dense()
    torch.testing.assert_close(decoded, dense @ weight)
    torch.testing.assert_close(dots, (grad @ weight.T)[codes.rows, codes.indices])
    torch.testing.assert_close(sums, dense.T @ grad)


def test_a_pursuit_kernel_that_fails_falls_back_to_the_same_selection(monkeypatch) -> None:
    import warnings

    from sae_pipeline.sae import mp_autograd, sparse_decode

    def broken(*args, **kwargs):
        raise RuntimeError("0 active drivers ([]). There should only be one.")

    monkeypatch.setattr(sparse_decode, "use_triton", True)
    monkeypatch.setattr(mp_autograd, "mp_select", broken)
    torch.manual_seed(1)
    W_dec = torch.nn.functional.normalize(torch.randn(48, 12, dtype=torch.float64), dim=1)
    residual = torch.randn(10, 12, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = mp_autograd.select_atoms(residual, W_dec, 4, "gram", fused=True)
    assert sparse_decode.use_triton is False
    assert [str(w.message) for w in caught if "Triton" in str(w.message)][0].startswith(
        "the Triton kernels failed on this device (RuntimeError: 0 active drivers"
    )
    torch.testing.assert_close(fused, mp_autograd.select_atoms(residual, W_dec, 4, "gram", fused=False))
