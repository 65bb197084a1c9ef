"""MP-SAE's scratch memory: the backward's atoms are gathered in bounded blocks of tokens, a Gram
matrix is kept between steps only up to a bound, and the backward in blocks computes what the
plain loop does (tests/test_mp_sae.py checks the whole step against the plain loop at
sizes that fit one block)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sae_pipeline.sae import MatchingPursuitSAE, mp_autograd


def plain_loop(x: Tensor, W_dec: Tensor, b_pre: Tensor, k: int) -> Tensor:
    """x_hat of the reference MP (dense correlations and one-hot updates), for autograd."""
    r = x - b_pre
    codes = torch.zeros(x.shape[0], W_dec.shape[0], dtype=x.dtype)
    for _ in range(k):
        c = r @ W_dec.T
        onehot = F.one_hot(c.argmax(dim=-1), W_dec.shape[0]).to(x.dtype) * c.amax(dim=-1, keepdim=True)
        codes = codes + onehot
        r = r - onehot @ W_dec
    return codes @ W_dec + b_pre


def test_backward_in_token_blocks_matches_the_plain_loop(monkeypatch) -> None:  # noqa: ANN001
    batch, d_in, d_sae, k = 23, 6, 30, 5
    # room for the atoms of 4 tokens: blocks of 4 (6 blocks), the last one short
    monkeypatch.setattr(mp_autograd, "CPU_BACKWARD_SCRATCH_BYTES", 4 * 2 * k * d_in * 8)
    torch.manual_seed(0)
    sae = MatchingPursuitSAE(d_in, d_sae, k, selection="gram").double()
    with torch.no_grad():
        sae.b_pre.normal_()
    x = torch.randn(batch, d_in, dtype=torch.float64)
    W_ref = sae.W_dec.detach().clone().requires_grad_()
    b_ref = sae.b_pre.detach().clone().requires_grad_()
    x_ref, x_fast = x.clone().requires_grad_(), x.clone().requires_grad_()
    upstream = torch.randn(batch, d_in, dtype=torch.float64)
    (plain_loop(x_ref, W_ref, b_ref, k) * upstream).sum().backward()
    (sae(x_fast).x_hat * upstream).sum().backward()
    torch.testing.assert_close(sae.W_dec.grad, W_ref.grad, rtol=0, atol=1e-10)
    torch.testing.assert_close(sae.b_pre.grad, b_ref.grad, rtol=0, atol=1e-10)
    torch.testing.assert_close(x_fast.grad, x_ref.grad, rtol=0, atol=1e-10)


def test_only_bounded_scratch_is_kept_between_steps(monkeypatch) -> None:  # noqa: ANN001
    batch, d_in, d_sae, k = 300, 64, 300, 6  # its correlation buffer (256 × d_sae) is smaller than both
    x = torch.randn(batch, d_in)
    gram_bytes = d_sae * d_sae * 4
    monkeypatch.setattr(mp_autograd, "CPU_KEPT_GRAM_BYTES", gram_bytes - 1)  # this Gram matrix: one byte too large
    monkeypatch.setattr(mp_autograd, "CPU_BACKWARD_SCRATCH_BYTES", 100 * 2 * k * d_in * 4)  # atoms of 100 tokens
    sae = MatchingPursuitSAE(d_in, d_sae, k, selection="gram")
    sae.loss(x, sae(x)).loss.backward()
    kept = {name: t.numel() for name, t in sae.workspace.tensors.items()}
    assert kept, "the correlation buffer is kept: the check below would pass on an empty workspace"
    assert all(n < d_sae * d_sae and n < k * batch * d_in for n in kept.values()), kept
    assert kept["atoms"] == kept["grad_atoms"] == k * 100 * d_in  # one block's worth
    monkeypatch.setattr(mp_autograd, "CPU_KEPT_GRAM_BYTES", gram_bytes)  # now it fits: kept
    sae.loss(x, sae(x)).loss.backward()
    assert sae.workspace.tensors["gram"].numel() == d_sae * d_sae
