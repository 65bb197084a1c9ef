"""Benchmark: one OMP-SAE training step against MP-SAE's and against a naive OMP, same run.

    python -m benchmarks.omp_sae                  # CPU: d_in=256, d_sae=4096; B=1024,k=16 and B=4096,k=32
    python -m benchmarks.omp_sae --device cuda    # the same shapes on a GPU
    python -m benchmarks.omp_sae --device cuda --autocast   # the same under bf16 autocast (as training runs)
    python -m benchmarks.omp_sae --quick          # tiny shapes, used by tests/test_omp_sae.py (also --dry-run)

A step is forward + backward of the MSE. The three sides run on the same dictionary and batch:

- ``omp``: :class:`~sae_pipeline.sae.omp.OMPSAE` (batched selection with incremental QR, a
  backward through the final least-squares fit over the selected atoms only);
- ``mp``: :class:`~sae_pipeline.sae.mp.MatchingPursuitSAE` with the same k (the speed target:
  OMP does more per step, so the ratio says what the orthogonal re-fit costs), with its default
  selection, and ``mp mm`` with ``selection="matmul"``: one correlation matmul per step, as OMP.
  MP's residual moves along one atom per step, so it can update the correlations with one row of
  the Gram matrix instead (its default at these shapes); OMP's moves along ``q_t``, a combination
  of all t selected atoms, so a Gram update would read t rows per step (no cheaper than the matmul
  for k ≳ 16), and OMP keeps the matmul;
- ``naive``: OMP as one would first write it, autograd through a dense loop: a correlation
  matmul, an argmax, ``torch.linalg.lstsq`` of all selected atoms and a dense ``codes @ W_dec``
  per step (the per-token loop of the tests would be slower still).

Times are medians over ``--reps`` after ``--warmup`` untimed steps; "saved" is what the
autograd graph keeps for backward (each storage counted once). "other atoms": the fraction
of tokens whose selected atoms differ between omp and naive (float32 near-ties). On CUDA OMP-SAE
and MP-SAE run the fused Triton pursuit step (sae_pipeline/sae/triton_pursuit.py); a line after each
row gives OMP-SAE's step with ``fused = False`` (the PyTorch ops), measured in the same run.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.mp_sae import maybe_autocast, median_seconds, pursuit_args, saved_bytes
from sae_pipeline.sae.mp import MatchingPursuitSAE
from sae_pipeline.sae.omp import OMPSAE


def naive_omp(x: Tensor, W_dec: Tensor, b_pre: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Dense OMP differentiated by autograd: ``(indices [B, k], x_hat [B, d_in])``."""
    y = x - b_pre
    n_tokens, d_sae = x.shape[0], W_dec.shape[0]
    chosen = torch.empty(n_tokens, 0, dtype=torch.int64, device=x.device)
    r = y
    codes = y.new_zeros(n_tokens, d_sae)
    for _ in range(k):
        corr = (r @ W_dec.T).detach().scatter(1, chosen, float("-inf"))
        chosen = torch.cat([chosen, corr.argmax(dim=1, keepdim=True)], dim=1)
        atoms = W_dec[chosen]  # [B, t, d_in]
        coefficients = torch.linalg.lstsq(atoms.mT, y[:, :, None]).solution[:, :, 0]
        codes = y.new_zeros(n_tokens, d_sae).scatter(1, chosen, coefficients)
        r = y - codes @ W_dec
    return chosen, codes @ W_dec + b_pre


def bench_shape(
    d_in: int, d_sae: int, batch_size: int, k: int, dtype: torch.dtype, device: torch.device, args: argparse.Namespace
) -> dict[str, float]:
    torch.manual_seed(0)
    omp = OMPSAE(d_in, d_sae, k).to(device=device, dtype=dtype)
    mp = MatchingPursuitSAE(d_in, d_sae, k).to(device=device, dtype=dtype)
    mp_mm = MatchingPursuitSAE(d_in, d_sae, k, selection="matmul").to(device=device, dtype=dtype)
    x = torch.randn(batch_size, d_in, device=device, dtype=dtype)
    with torch.no_grad():
        omp.init_b_pre(x.mean(0))
        mp.load_state_dict(omp.state_dict())
        mp_mm.load_state_dict(omp.state_dict())
    W_ref = omp.W_dec.detach().clone().requires_grad_()
    b_ref = omp.b_pre.detach().clone().requires_grad_()

    def loss_of(sae: torch.nn.Module) -> Tensor:
        with maybe_autocast(args, device):
            return F.mse_loss(sae(x).x_hat, x)

    def naive_loss() -> Tensor:
        with maybe_autocast(args, device):
            return F.mse_loss(naive_omp(x, W_ref, b_ref, k)[1], x)

    def step(loss_fn, params) -> None:  # noqa: ANN001
        for p in params:
            p.grad = None
        loss_fn().backward()

    mismatch = naive_s = naive_b = float("nan")
    if not args.skip_reference:
        with torch.no_grad():
            mismatch = (omp.pursuit(x)[0] != naive_omp(x, W_ref, b_ref, k)[0]).any(dim=1).float().mean().item()
    omp_s = median_seconds(lambda: step(lambda: loss_of(omp), list(omp.parameters())), device, args.warmup, args.reps)
    mp_s = median_seconds(lambda: step(lambda: loss_of(mp), list(mp.parameters())), device, args.warmup, args.reps)
    mp_mm_s = median_seconds(
        lambda: step(lambda: loss_of(mp_mm), list(mp_mm.parameters())), device, args.warmup, args.reps
    )
    unfused_s = float("nan")
    if device.type == "cuda":
        omp.fused = False
        unfused_s = median_seconds(
            lambda: step(lambda: loss_of(omp), list(omp.parameters())), device, args.warmup, args.reps
        )
        omp.fused = None
    if not args.skip_reference:
        naive_s = median_seconds(
            lambda: step(naive_loss, [W_ref, b_ref]), device, args.warmup, args.naive_reps or args.reps
        )
        naive_b = saved_bytes(naive_loss)
    return {
        "omp_s": omp_s,
        "unfused_s": unfused_s,
        "mp_s": mp_s,
        "mp_mm_s": mp_mm_s,
        "naive_s": naive_s,
        "omp_over_mp": omp_s / mp_s,
        "omp_over_mp_mm": omp_s / mp_mm_s,
        "naive_over_omp": naive_s / omp_s,
        "omp_mib": saved_bytes(lambda: loss_of(omp)) / 2**20,
        "naive_mib": naive_b / 2**20,
        "other_atoms": mismatch,
    }


def main(argv: list[str] | None = None) -> None:
    args, device = pursuit_args(argv, __doc__, "naive", "naive OMP")
    for _, k in args.shapes:
        if k > min(args.d_in, args.d_sae):
            print(
                f"error: --shapes: k={k} exceeds min(d_in, d_sae)={min(args.d_in, args.d_sae)}, OMP's limit",
                file=sys.stderr,
            )
            sys.exit(2)
    print(f"device={device} threads={torch.get_num_threads()} torch={torch.__version__}")
    print(
        f"{'d_in':>5} {'d_sae':>6} {'B':>5} {'k':>3} {'dtype':>8} | {'omp s':>8} {'mp s':>8} {'mp mm s':>8} "
        f"{'naive s':>8} | {'omp/mp':>7} {'omp/mp mm':>9} {'naive/omp':>9} | {'omp MiB':>8} {'naive MiB':>9} | "
        "other atoms"
    )
    for batch_size, k in args.shapes:
        dtype = getattr(torch, args.dtype)
        r = bench_shape(args.d_in, args.d_sae, batch_size, k, dtype, device, args)
        print(
            f"{args.d_in:>5} {args.d_sae:>6} {batch_size:>5} {k:>3} {args.dtype:>8} | "
            f"{r['omp_s']:>8.4f} {r['mp_s']:>8.4f} {r['mp_mm_s']:>8.4f} {r['naive_s']:>8.4f} | "
            f"{r['omp_over_mp']:>6.2f}x {r['omp_over_mp_mm']:>8.2f}x {r['naive_over_omp']:>8.1f}x | "
            f"{r['omp_mib']:>8.2f} {r['naive_mib']:>9.2f} | {r['other_atoms']:.4f}",
            flush=True,
        )
        if device.type == "cuda":
            print(
                f"      omp fused=False (PyTorch ops): {r['unfused_s']:.4f} s; "
                f"fused step {r['unfused_s'] / r['omp_s']:.2f}x faster",
                flush=True,
            )


if __name__ == "__main__":
    main()
