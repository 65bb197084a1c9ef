"""OMP-SAE against autograd through a plain per-token OMP loop (``torch.linalg.lstsq`` per step), float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from sae_pipeline.sae.omp import OMPSAE
from sae_pipeline.sae.omp_autograd import RANK_TOLERANCE, LeastSquaresFunction, select_atoms


def plain_omp(x: Tensor, W_dec: Tensor, b_pre: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Reference OMP, one token at a time: dense correlations, a least-squares solve of all selected
    atoms per step, the rank rule of the module docstring by an explicit projection of every atom.
    Differentiable by autograd: ``(indices [B, k], codes [B, d_sae], x_hat [B, d_in])``."""
    d_sae = W_dec.shape[0]
    atom_sq = (W_dec.detach() ** 2).sum(1)
    tolerance = RANK_TOLERANCE * torch.finfo(x.dtype).eps * atom_sq
    all_indices, all_codes = [], []
    for y in x - b_pre:
        chosen: list[int] = []
        coefficients = y.new_zeros(0)
        for _ in range(k):
            if chosen:
                A = W_dec.detach()[chosen]  # [t, d_in]
                residual = y.detach() - coefficients.detach() @ A
                projection = torch.linalg.lstsq(A.T, W_dec.detach().T).solution.T @ A
                distance_sq = ((W_dec.detach() - projection) ** 2).sum(1)
            else:
                residual, distance_sq = y.detach(), atom_sq
            corr = W_dec.detach() @ residual
            corr[distance_sq <= tolerance] = float("-inf")
            corr[chosen] = float("-inf")
            if not torch.isfinite(corr).any():  # no atom can lower the residual: stop
                break
            chosen.append(int(corr.argmax()))
            coefficients = torch.linalg.lstsq(W_dec[chosen].T, y[:, None]).solution[:, 0]
        all_indices.append(torch.tensor(chosen + [-1] * (k - len(chosen))))
        all_codes.append(
            torch.zeros(d_sae, dtype=x.dtype).index_put((torch.tensor(chosen, dtype=torch.int64),), coefficients)
        )
    codes = torch.stack(all_codes)
    return torch.stack(all_indices), codes, codes @ W_dec + b_pre


def make_sae(d_in: int, d_sae: int, k: int, seed: int, unit_norm: bool = True) -> OMPSAE:
    torch.manual_seed(seed)
    sae = OMPSAE(d_in, d_sae, k).double()
    with torch.no_grad():
        sae.b_pre.normal_()
        if not unit_norm:  # the plain loop is defined for any dictionary; so must we be
            sae.W_dec.mul_(torch.rand(d_sae, 1, dtype=torch.float64) + 0.5)
    return sae


def near_degenerate(sae: OMPSAE, angle: float) -> None:
    """Make the odd atoms near-copies of the even ones (``angle`` radians apart): ill-conditioned
    least-squares systems whenever both of a pair are selected."""
    with torch.no_grad():
        W = sae.W_dec
        noise = F.normalize(torch.randn_like(W[1::2]), dim=1)
        W[1::2] = W[0::2] + angle * noise
        sae.normalize_atoms()


def compare(sae: OMPSAE, x: Tensor, k: int, atol: float = 1e-10, grad_atol: float = 1e-8, rtol: float = 0.0) -> Tensor:
    W_ref = sae.W_dec.detach().clone().requires_grad_()
    b_ref = sae.b_pre.detach().clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    x_fast = x.clone().requires_grad_()
    ref_indices, ref_codes, ref_x_hat = plain_omp(x_ref, W_ref, b_ref, k)
    out = sae(x_fast)
    indices, _ = sae.pursuit(x)
    torch.testing.assert_close(indices, ref_indices, rtol=0, atol=0)
    torch.testing.assert_close(out.codes, ref_codes, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.x_hat, ref_x_hat, rtol=0, atol=atol)
    torch.testing.assert_close(sae.decode(out.codes), out.x_hat, rtol=0, atol=atol)
    assert out.pre_acts is None
    grad_codes, grad_x_hat = torch.randn_like(ref_codes), torch.randn_like(ref_x_hat)
    ((ref_codes * grad_codes).sum() + (ref_x_hat * grad_x_hat).sum()).backward()
    ((out.codes * grad_codes).sum() + (out.x_hat * grad_x_hat).sum()).backward()
    torch.testing.assert_close(sae.W_dec.grad, W_ref.grad, rtol=rtol, atol=grad_atol)
    torch.testing.assert_close(sae.b_pre.grad, b_ref.grad, rtol=rtol, atol=grad_atol)
    torch.testing.assert_close(x_fast.grad, x_ref.grad, rtol=rtol, atol=grad_atol)
    return ref_codes


# (batch, d_in, d_sae, k, unit_norm)
SHAPES = [
    (16, 8, 32, 4, True),
    (21, 12, 50, 7, False),
    (40, 6, 24, 3, True),  # crosses the CPU chunk size (set to 16 below)
    (12, 6, 20, 6, True),  # k = d_in: x_hat = x exactly
    (10, 5, 7, 1, True),
    (20, 8, 96, 8, False),  # d_sae with divisors: blocked argmax on CPU; k = d_in
]


@pytest.mark.parametrize("batch, d_in, d_sae, k, unit_norm", SHAPES)
def test_matches_plain_loop_values_and_gradients(
    batch: int, d_in: int, d_sae: int, k: int, unit_norm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sae_pipeline.sae.omp_autograd.CPU_CHUNK_ROWS", 16)
    sae = make_sae(d_in, d_sae, k, seed=batch + d_sae, unit_norm=unit_norm)
    x = torch.randn(batch, d_in, dtype=torch.float64) * 2.0
    compare(sae, x, k)
    if k == d_in:  # d_in independent atoms span the space
        torch.testing.assert_close(sae(x).x_hat, x, rtol=0, atol=1e-10)


def test_near_degenerate_atoms_match_the_plain_loop() -> None:
    """Four pairs of near-copies (1e-3 rad apart) in 6 dimensions with k = 6: at least two pairs are
    selected whole, so the least-squares systems are ill-conditioned (condition number ~1e3)."""
    sae = make_sae(6, 8, 6, seed=7)
    near_degenerate(sae, 1e-3)
    x = torch.randn(30, 6, dtype=torch.float64)
    compare(sae, x, 6, atol=1e-10, grad_atol=1e-8, rtol=1e-9)  # codes ~1e3: relative


def test_duplicate_atoms_are_never_both_selected() -> None:
    """Exact copies: the copy of a selected atom lies in the span, so it is skipped (the system would be
    singular); the span has 4 directions, so with k = 6 every token stops after 4 atoms."""
    sae = make_sae(6, 8, 6, seed=8)
    near_degenerate(sae, 0.0)
    x = torch.randn(30, 6, dtype=torch.float64)
    indices, coefficients = sae.pursuit(x)
    assert (indices[:, 4:] == -1).all() and (coefficients[:, 4:] == 0).all()
    assert ((indices[:, :4, None] // 2) == (indices[:, None, :4] // 2)).sum((1, 2)).eq(4).all()
    compare(sae, x, 6)
    torch.testing.assert_close(sae.encode(x, 6), sae.encode(x, 4), rtol=0, atol=0)


def test_residual_is_orthogonal_to_every_selected_atom_and_shrinks() -> None:
    sae = make_sae(10, 40, 7, seed=2)
    x = torch.randn(50, 10, dtype=torch.float64)
    with torch.no_grad():
        indices, coefficients = sae.pursuit(x)
        norms = sae.residual_norms(x)
    r = x - sae.b_pre.detach()
    atoms = sae.W_dec.detach()[indices]  # [B, k, d_in]
    for t in range(7):  # after step t, the least-squares fit on the first t + 1 atoms
        fit = torch.linalg.lstsq(atoms[:, : t + 1].mT, r[:, :, None]).solution
        residual = r - (fit.mT @ atoms[:, : t + 1])[:, 0]
        assert (atoms[:, : t + 1] @ residual[:, :, None]).abs().max() < 1e-12
        torch.testing.assert_close(norms[:, t + 1], residual.norm(dim=1), rtol=0, atol=1e-10)
    torch.testing.assert_close(norms[:, 0], r.norm(dim=1), rtol=0, atol=1e-12)
    assert (norms[:, 1:] <= norms[:, :-1] + 1e-12).all()
    final = r - (coefficients[:, None, :] @ atoms)[:, 0]
    assert (atoms @ final[:, :, None]).abs().max() < 1e-12


def test_gradcheck_of_the_least_squares_function() -> None:
    torch.manual_seed(0)
    d_in, d_sae, k = 5, 9, 3
    W = torch.randn(d_sae, d_in, dtype=torch.float64, requires_grad=True)
    b = torch.randn(d_in, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, d_in, dtype=torch.float64, requires_grad=True)
    indices = select_atoms((x - b).detach(), W, k)[0]

    def fit(x: Tensor, W: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        _, L, z, _ = select_atoms((x - b).detach(), W.detach(), k)  # factors of the perturbed atoms
        return LeastSquaresFunction.apply(x, W, b, indices, L, z)

    assert torch.equal(select_atoms((x - b).detach(), W, k)[0], indices)
    assert torch.autograd.gradcheck(fit, (x, W, b))


@pytest.mark.parametrize("k_infer", [1, 3, 8])
def test_encode_with_other_k_matches_plain_loop(k_infer: int) -> None:
    sae = make_sae(8, 20, 5, seed=k_infer)
    x = torch.randn(12, 8, dtype=torch.float64)
    _, ref_codes, _ = plain_omp(x, sae.W_dec.detach(), sae.b_pre.detach(), k_infer)
    torch.testing.assert_close(sae.encode(x, k_infer), ref_codes, rtol=0, atol=1e-10)
    assert sae.k == 5


def test_k_above_d_in_stops_at_d_in_atoms() -> None:
    """Beyond d_in steps the residual is 0 (the least-squares system would be singular): the extra steps
    are not taken, in training (same gradients as the plain loop, which stops) and at inference."""
    sae = make_sae(4, 10, 7, seed=4)
    x = torch.randn(9, 4, dtype=torch.float64)
    compare(sae, x, 7)
    indices, coefficients = sae.pursuit(x)
    assert (indices[:, 4:] == -1).all() and (indices[:, :4] >= 0).all() and (coefficients[:, 4:] == 0).all()
    torch.testing.assert_close(sae(x).x_hat, x, rtol=0, atol=1e-10)
    torch.testing.assert_close(sae.encode(x, 10), sae.encode(x, 4), rtol=0, atol=0)
    assert float(sae(x).l0()) == 4.0
    norms = sae.residual_norms(x, 6)
    assert norms[:, 4:].max() < 1e-10
    for k in (0, 11, 2.5):
        with pytest.raises(ValueError, match=r"k must be an integer in \[1, 10\]"):
            sae.encode(x, k)
    with pytest.raises(ValueError, match="k must be"):
        OMPSAE(4, 10, 11)


def test_no_batch_by_dictionary_tensor_is_saved_for_backward() -> None:
    batch, d_in, d_sae, k = 48, 8, 40, 6
    sae = make_sae(d_in, d_sae, k, seed=1)
    x = torch.randn(batch, d_in, dtype=torch.float64)
    shapes: list[tuple[int, ...]] = []

    def pack(t: Tensor) -> Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _ = sae.loss(x, sae(x)).loss
    assert shapes and all(torch.Size(s).numel() < batch * d_sae for s in shapes), shapes


def test_float32_training_step_reduces_the_loss() -> None:
    torch.manual_seed(0)
    sae = OMPSAE(16, 64, 4)
    x = torch.randn(128, 4) @ torch.randn(4, 16) + 0.1 * torch.randn(128, 16)
    sae.init_b_pre(x.mean(0))
    optimizer = torch.optim.Adam(sae.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = sae.loss(x, sae(x)).loss
        loss.backward()
        sae.remove_parallel_grad()
        optimizer.step()
        sae.normalize_atoms()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]


def test_benchmark_script_runs_quick(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import omp_sae as module

    module.main(["--quick"])
    row = capsys.readouterr().out.strip().splitlines()[-1].split("|")
    assert float(row[-1]) == 0.0  # same atoms as the naive OMP at the quick shape
    assert float(row[2].split()[0].rstrip("x")) > 0  # omp/mp printed
