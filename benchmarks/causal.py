"""Benchmark: the cost per atom of ``evaluate causal`` (issue 34, item 5) against a direct recomputation.

    python -m benchmarks.causal              # d_in 768, d_sae 19200, k 32, 8192 images, 10 classes
    python -m benchmarks.causal --dry-run    # tiny shapes (tests/test_evaluate_causal.py)

On synthetic codes (k random atoms per image, positive values), a random unit-norm dictionary, images
x = x̂ + noise and random probe weights, both ways measure every figure of one atom: the accuracy drop, the
changed predictions, the true class's probability and the error rise.

- linear update (what the command runs): every atom at once, ``sae_pipeline.evaluate.causal``'s ``error_rise``
  (O(nnz · d)) and ``atom_effects`` (O(nnz · classes), times 20 with its 19 random atoms), timed once;
- direct: for ``--direct_atoms`` atoms, the codes with atom j zeroed decoded again (sparse product), the probe's
  logits, argmax and softmax, and the error, timed per atom; "all atoms" multiplies by d_sae (extrapolated).

The SAE's own encoding and the probe's fit are the same for both ways and are not timed. Both ways' figures for
the measured atoms must agree (the last column). Timings are one run each (no repetitions): the ratio is
orders of magnitude, not a few per cent.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from sae_pipeline.evaluate.causal import atom_effects, error_rise, reconstruct


def synthetic(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(0)
    n, k, d_sae, d = args.images, args.k, args.d_sae, args.d_in
    j = np.argsort(rng.random((n, d_sae)), axis=1)[:, :k] if d_sae <= 4096 else _distinct(rng, n, k, d_sae)
    j = np.sort(j, axis=1).reshape(-1)
    t = np.repeat(np.arange(n), k)
    v = rng.exponential(1.0, n * k)
    D = rng.standard_normal((d_sae, d))
    D /= np.linalg.norm(D, axis=1, keepdims=True)
    b = rng.standard_normal(d) * 0.1
    xhat = reconstruct(torch.from_numpy(D), torch.from_numpy(b), n, t, j, v)
    x = xhat + rng.standard_normal((n, d)) * 0.3
    W = rng.standard_normal((args.classes, d)) / np.sqrt(d)
    y = (xhat @ W.T).argmax(1)
    flip = rng.random(n) < 0.2  # a probe that is right on about 80 % of the images
    y[flip] = rng.integers(0, args.classes, flip.sum())
    return {"t": t, "j": j, "v": v, "D": D, "b": b, "x": x, "xhat": xhat, "W": W, "y": y}


def _distinct(rng: np.random.Generator, n: int, k: int, d_sae: int) -> np.ndarray:
    """k distinct atoms per row without an [n, d_sae] sort."""
    rows = [rng.choice(d_sae, k, replace=False) for _ in range(n)]
    return np.stack(rows)


def linear_update(data: dict, n_random: int) -> tuple[dict, np.ndarray, float]:
    D, x, xhat, W = data["D"], data["x"], data["xhat"], data["W"]
    start = time.perf_counter()
    rise, base = error_rise(x, xhat, (data["t"], data["j"], data["v"]), D, (D * D).sum(1))
    logits = xhat @ W.T
    effects = atom_effects(
        logits,
        D @ W.T,
        data["y"],
        (data["t"], data["j"], data["v"]),
        np.arange(len(D)),
        np.full(len(D), -1),
        n_random=n_random,
    )
    return effects, rise / len(x), time.perf_counter() - start


def direct(data: dict, atom: int) -> tuple[float, float, int]:
    """``(accuracy drop, error rise, changed)`` of one atom: its codes zeroed, decoded again, the probe run."""
    t, j, v, D, x, y, W = (data[key] for key in ("t", "j", "v", "D", "x", "y", "W"))
    keep = j != atom
    xhat_j = reconstruct(torch.from_numpy(D), torch.from_numpy(data["b"]), len(x), t[keep], j[keep], v[keep])
    logits, logits_j = data["xhat"] @ W.T, xhat_j @ W.T
    pred0, pred = logits.argmax(1), logits_j.argmax(1)
    weights = np.exp(logits_j - logits_j.max(1, keepdims=True))
    _ = weights[np.arange(len(y)), y] / weights.sum(1)  # p(true), as the command lists it
    rise = ((x - xhat_j) ** 2).sum(1).mean() - ((x - data["xhat"]) ** 2).sum(1).mean()
    return float((pred0 == y).mean() - (pred == y).mean()), float(rise), int((pred != pred0).sum())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d_in", type=int, default=768)
    parser.add_argument("--d_sae", type=int, default=19200)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--images", type=int, default=8192, help="validation images (one token each)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--direct_atoms", type=int, default=3, help="atoms recomputed directly (timed each)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes: checks the script runs and agrees")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.d_in, args.d_sae, args.k, args.images, args.classes, args.direct_atoms = 16, 64, 4, 300, 3, 2
    for name in ("d_in", "d_sae", "k", "images", "classes", "direct_atoms"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.k > args.d_sae:
        parser.error(f"--k {args.k} must be <= --d_sae {args.d_sae}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    data = synthetic(args)
    _, _, plain_s = linear_update(data, n_random=0)
    effects, rise, all_s = linear_update(data, n_random=19)
    order = np.argsort(-np.bincount(data["j"], minlength=args.d_sae))[: args.direct_atoms]  # the most frequent
    direct_s, agree = [], True
    for atom in order:
        start = time.perf_counter()
        drop, atom_rise, changed = direct(data, int(atom))
        direct_s.append(time.perf_counter() - start)
        agree &= bool(
            np.isclose(drop, effects["accuracy_drop"][atom], rtol=0, atol=1e-12)
            and np.isclose(atom_rise, rise[atom], rtol=1e-9, atol=1e-12)
            and changed == effects["changed"][atom]
        )
    per_atom = float(np.mean(direct_s))
    print(
        "| d_in | d_sae | k | images | classes | all atoms, linear update (19 random atoms) | per atom "
        "| without random atoms | direct, per atom | direct, all atoms (extrapolated) | ratio | figures |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.d_in} | {args.d_sae} | {args.k} | {args.images} | {args.classes} | {all_s:.3f} s | "
        f"{all_s / args.d_sae * 1e6:.1f} µs | {plain_s:.3f} s | {per_atom:.4f} s | {per_atom * args.d_sae:.3g} s | "
        f"{per_atom * args.d_sae / all_s:.0f}× | {'equal' if agree else 'DIFFER'} |"
    )
    if not agree:
        raise SystemExit("the linear update and the direct recomputation differ")


if __name__ == "__main__":
    main()
