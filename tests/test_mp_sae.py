"""MP-SAE against autograd through the plain Matching Pursuit loop of docs/design.md (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from sae_pipeline.sae import MatchingPursuitSAE
from sae_pipeline.sae.mp_autograd import argmax_block_size, first_argmax, select_atoms
from sae_pipeline.sae.pursuit_cost import GRAM_MAX_BYTES, element_cost, prefer_gram


def plain_loop(x: Tensor, W_dec: Tensor, b_pre: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Reference MP: dense correlations and one-hot updates each step; autograd differentiates it."""
    r = x - b_pre
    codes = torch.zeros(x.shape[0], W_dec.shape[0], dtype=x.dtype)
    chosen = []
    for _ in range(k):
        c = r @ W_dec.T
        j = c.argmax(dim=-1)
        onehot = F.one_hot(j, W_dec.shape[0]).to(x.dtype) * c.gather(1, j[:, None])
        codes = codes + onehot
        r = r - onehot @ W_dec
        chosen.append(j)
    return torch.stack(chosen, dim=1), codes, codes @ W_dec + b_pre


def make_sae(
    d_in: int, d_sae: int, k: int, seed: int, selection: str = "auto", unit_norm: bool = True
) -> MatchingPursuitSAE:
    torch.manual_seed(seed)
    sae = MatchingPursuitSAE(d_in, d_sae, k, selection=selection).double()
    with torch.no_grad():
        sae.b_pre.normal_()
        if not unit_norm:  # the plain loop is defined for any dictionary; so must we be
            sae.W_dec.mul_(torch.rand(d_sae, 1, dtype=torch.float64) + 0.5)
    return sae


# (batch, d_in, d_sae, k, selection, unit_norm)
SHAPES = [
    (16, 8, 32, 4, "gram", True),
    (16, 8, 32, 4, "matmul", True),
    (37, 12, 50, 7, "auto", False),
    (300, 6, 24, 3, "auto", True),  # crosses the CPU chunk size
    (24, 2, 9, 9, "gram", True),  # k >> d_in: atoms repeat
    (24, 2, 9, 9, "matmul", False),
    (10, 5, 7, 1, "auto", True),
    (40, 8, 96, 6, "gram", True),  # d_sae with divisors: blocked argmax on CPU
    (40, 8, 96, 6, "matmul", False),
]


@pytest.mark.parametrize("batch, d_in, d_sae, k, selection, unit_norm", SHAPES)
def test_matches_plain_loop_values_and_gradients(
    batch: int, d_in: int, d_sae: int, k: int, selection: str, unit_norm: bool
) -> None:
    sae = make_sae(d_in, d_sae, k, seed=batch + d_sae, selection=selection, unit_norm=unit_norm)
    x = torch.randn(batch, d_in, dtype=torch.float64) * 2.0
    W_ref = sae.W_dec.detach().clone().requires_grad_()
    b_ref = sae.b_pre.detach().clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    x_fast = x.clone().requires_grad_()

    ref_indices, ref_codes, ref_x_hat = plain_loop(x_ref, W_ref, b_ref, k)
    out = sae(x_fast)
    indices, _ = sae.pursuit(x)
    torch.testing.assert_close(indices, ref_indices, rtol=0, atol=0)
    torch.testing.assert_close(out.codes, ref_codes, rtol=0, atol=1e-10)
    torch.testing.assert_close(out.x_hat, ref_x_hat, rtol=0, atol=1e-10)
    torch.testing.assert_close(sae.decode(out.codes), out.x_hat, rtol=0, atol=1e-10)
    assert out.pre_acts is None

    # random upstream gradients on codes and x_hat together
    grad_codes = torch.randn_like(ref_codes)
    grad_x_hat = torch.randn_like(ref_x_hat)
    ((ref_codes * grad_codes).sum() + (ref_x_hat * grad_x_hat).sum()).backward()
    ((out.codes * grad_codes).sum() + (out.x_hat * grad_x_hat).sum()).backward()
    torch.testing.assert_close(sae.W_dec.grad, W_ref.grad, rtol=0, atol=1e-8)
    torch.testing.assert_close(sae.b_pre.grad, b_ref.grad, rtol=0, atol=1e-8)
    torch.testing.assert_close(x_fast.grad, x_ref.grad, rtol=0, atol=1e-8)
    if k > d_in:
        assert (ref_codes != 0).sum(dim=1).lt(k).any(), "this shape is meant to exercise repeated atoms"


@pytest.mark.parametrize("upstream", ["mse", "codes_only"])
def test_gradients_of_single_outputs(upstream: str) -> None:
    sae = make_sae(10, 40, 6, seed=3)
    x = torch.randn(50, 10, dtype=torch.float64)
    W_ref = sae.W_dec.detach().clone().requires_grad_()
    b_ref = sae.b_pre.detach().clone().requires_grad_()
    _, ref_codes, ref_x_hat = plain_loop(x, W_ref, b_ref, 6)
    out = sae(x)
    if upstream == "mse":
        F.mse_loss(ref_x_hat, x).backward()
        sae.loss(x, out).loss.backward()
    else:
        weights = torch.randn(40, dtype=torch.float64)
        (ref_codes.abs() * weights).sum().backward()
        (out.codes.abs() * weights).sum().backward()
    torch.testing.assert_close(sae.W_dec.grad, W_ref.grad, rtol=0, atol=1e-8)
    torch.testing.assert_close(sae.b_pre.grad, b_ref.grad, rtol=0, atol=1e-8)


@pytest.mark.parametrize("k_infer", [1, 3, 12, 20])
def test_encode_with_other_k_matches_plain_loop(k_infer: int) -> None:
    sae = make_sae(8, 20, 5, seed=k_infer)
    x = torch.randn(30, 8, dtype=torch.float64)
    _, ref_codes, _ = plain_loop(x, sae.W_dec.detach(), sae.b_pre.detach(), k_infer)
    torch.testing.assert_close(sae.encode(x, k_infer), ref_codes, rtol=0, atol=1e-10)
    assert sae.k == 5


@pytest.mark.parametrize("d_sae", [64, 700])
def test_gram_and_matmul_selection_agree_in_float64(d_sae: int) -> None:
    torch.manual_seed(0)
    W = F.normalize(torch.randn(d_sae, 16, dtype=torch.float64), dim=1)
    r = torch.randn(400, 16, dtype=torch.float64)
    torch.testing.assert_close(select_atoms(r, W, 10, "gram"), select_atoms(r, W, 10, "matmul"), rtol=0, atol=0)


@pytest.mark.parametrize("width", [64, 96, 1000, 4096])
def test_first_argmax_is_torch_argmax_with_ties(width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    corr = torch.randint(-3, 4, (50, width), generator=generator).double()  # many exact ties
    corr[0] = 0.0
    corr[1, -1] = 10.0
    block = argmax_block_size(width)
    assert block is not None and width % block == 0
    index, value = first_argmax(corr, block)
    torch.testing.assert_close(index, corr.argmax(dim=1), rtol=0, atol=0)
    torch.testing.assert_close(value[:, 0], corr.amax(dim=1), rtol=0, atol=0)
    assert argmax_block_size(37) is None


def test_prefer_gram_follows_the_cost_model() -> None:
    cpu = element_cost(torch.device("cpu"), torch.float32)
    assert prefer_gram(1024, 16, 256, 4096, cpu)  # B(k-1) = 15360 > 1.1 d_sae
    assert not prefer_gram(64, 16, 256, 4096, cpu)  # 960 < d_sae
    assert not prefer_gram(10**6, 1, 256, 4096, cpu)  # one step needs no update
    assert not prefer_gram(10**6, 16, 8, 4096, cpu)  # tiny d_in: a matmul step is cheaper
    d_sae_huge = int((GRAM_MAX_BYTES / 4) ** 0.5) + 1
    assert not prefer_gram(10**7, 64, 256, d_sae_huge, cpu)  # Gram matrix too large
    # brute force over the stated inequality
    for n_tokens, k, d_in, d_sae in [(100, 5, 32, 300), (4096, 32, 768, 19200), (50, 50, 64, 2000)]:
        gram_cost = 2 * d_sae**2 * d_in + (k - 1) * n_tokens * d_sae * cpu
        matmul_cost = (k - 1) * n_tokens * 2 * d_in * d_sae
        assert prefer_gram(n_tokens, k, d_in, d_sae, cpu) == (gram_cost < matmul_cost)
        syrk_cost = d_sae**2 * (d_in + cpu) + (k - 1) * n_tokens * d_sae * cpu  # half the FLOPs, then a mirror
        assert prefer_gram(n_tokens, k, d_in, d_sae, cpu, symmetric=True) == (syrk_cost < matmul_cost)
    assert not prefer_gram(3500, 2, 256, 4096, cpu) and prefer_gram(3500, 2, 256, 4096, cpu, symmetric=True)


def test_no_batch_by_dictionary_tensor_is_saved_for_backward() -> None:
    batch, d_in, d_sae, k = 48, 8, 40, 6  # batch > d_in so W_dec is smaller than [B, d_sae]
    sae = make_sae(d_in, d_sae, k, seed=1)
    x = torch.randn(batch, d_in, dtype=torch.float64)

    def saved_shapes(fn) -> list[tuple[int, ...]]:  # noqa: ANN001
        shapes: list[tuple[int, ...]] = []

        def pack(t: Tensor) -> Tensor:
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return shapes

    fast = saved_shapes(lambda: sae.loss(x, sae(x)).loss)
    plain = saved_shapes(lambda: F.mse_loss(plain_loop(x, sae.W_dec, sae.b_pre, k)[2], x))
    assert fast and all(torch.Size(s).numel() < batch * d_sae for s in fast), fast
    assert sum(s == (batch, d_sae) for s in plain) >= k  # the hook does see the plain loop's tensors


unit_dictionaries = st.tuples(
    st.integers(1, 12),  # d_in
    st.integers(1, 40),  # d_sae
    st.integers(1, 40),  # k (clipped to d_sae)
    st.integers(1, 20),  # batch
    st.integers(0, 2**31 - 1),  # seed
)


@settings(max_examples=40, deadline=None)
@given(unit_dictionaries)
def test_stepwise_orthogonality_and_monotone_residual(params: tuple[int, int, int, int, int]) -> None:
    """Propositions 1 and 2 of the paper on random unit-norm dictionaries."""
    d_in, d_sae, k, batch, seed = params
    k = min(k, d_sae)
    generator = torch.Generator().manual_seed(seed)
    sae = MatchingPursuitSAE(d_in, d_sae, k).double()
    with torch.no_grad():
        sae.W_dec.copy_(torch.randn(d_sae, d_in, generator=generator, dtype=torch.float64))
        sae.normalize_atoms()
        sae.b_pre.copy_(torch.randn(d_in, generator=generator, dtype=torch.float64))
    x = torch.randn(batch, d_in, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        indices, coefficients = sae.pursuit(x)
        norms = sae.residual_norms(x)
    r = x - sae.b_pre.detach()
    scale = r.norm(dim=1).clamp_min(1.0)
    for t in range(k):
        atom = sae.W_dec.detach()[indices[:, t]]
        previous_norm = r.norm(dim=1)
        r = r - coefficients[:, t, None] * atom
        assert torch.all(torch.linalg.vecdot(r, atom).abs() <= 1e-12 * scale)  # <r_t, d_j_t> = 0
        assert torch.all(r.norm(dim=1) <= previous_norm + 1e-12 * scale)  # ‖r_t‖ ≤ ‖r_{t−1}‖
        torch.testing.assert_close(norms[:, t + 1], r.norm(dim=1), rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"d_in": 4, "d_sae": 8, "k": 0}, "k must be"),
        ({"d_in": 4, "d_sae": 8, "k": 9}, "k must be"),
        ({"d_in": 0, "d_sae": 8, "k": 2}, "d_in must be"),
        ({"d_in": 4, "d_sae": 0, "k": 2}, "d_sae must be"),
        ({"d_in": 4, "d_sae": 8, "k": 2, "selection": "fast"}, "selection must be"),
    ],
)
def test_bad_hyper_parameters_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MatchingPursuitSAE(**kwargs)


def test_bad_inputs_raise() -> None:
    sae = MatchingPursuitSAE(4, 8, 2)
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="k must be"):
        sae.encode(x, 0)
    with pytest.raises(ValueError, match="k must be"):
        sae.encode(x, 2.5)
    assert sae.encode(x, 9).shape == (3, 8)  # k > d_sae is allowed: atoms are picked again
    x[1, 2] = float("nan")
    for fn in (sae, sae.encode, sae.pursuit):
        with pytest.raises(ValueError, match="NaN"):
            fn(x)
    with pytest.raises(ValueError, match="d_in=4"):
        sae(torch.randn(3, 5))


def test_benchmark_script_runs_quick(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import mp_sae as module

    module.main(["--quick"])
    output = capsys.readouterr().out
    assert "speedup" in output and "float32" in output
    row = output.strip().splitlines()[-1].split("|")
    assert float(row[-1]) == 0.0  # same atoms as the plain loop at the quick shape
