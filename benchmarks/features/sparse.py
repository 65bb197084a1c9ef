"""Part 6 of `python -m benchmarks.features`: the pass and image rankings from sparse codes vs the former dense path.

    python -m benchmarks.features --parts sparse --d 768 --d_sae 19200 --k 32 --images 160 --repeats 3

Same run, same batches of whole images (DINOv2's 261-token layout, random tokens), a TopK SAE; sides
alternate for ``--repeats`` rounds, CPU seconds of each stage (best round):

- "dense (former)": ``encode`` -> ``[B, d_sae]`` codes, ``TopNTable.update_codes`` (their non-zeros), the
  label counts, and each image's top atoms from its dense ``[261, d_sae]`` codes (`former_image_top`: the
  max and sum over tokens this code base computed before the codes stayed sparse);
- "sparse": ``encode_sparse`` -> canonical entries, ``TopNTable.update_entries``, the label counts, and each
  image's top atoms from ``split_images`` (`sae_pipeline/features/image_codes.py`).

Both sides' tables, label counts and image rankings are checked equal before any figure is printed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.features.data import TPI, make_sae
from sae_pipeline.features.patch_atoms import PATCH_TOP


def former_image_top(codes: np.ndarray, positions: np.ndarray, n_full: int, k: int = 16) -> dict[str, Any]:
    """The former `image_top_atoms`, over one image's dense ``[tokens, d_sae]`` codes (the reference)."""

    def ranking(values: np.ndarray) -> np.ndarray:
        positive = np.flatnonzero(values > 0)
        return positive[np.lexsort((positive, -values[positive]))[:k]]

    codes = np.asarray(codes, np.float32)
    peak, total = codes.max(axis=0), codes.sum(axis=0)
    by_max, by_sum = ranking(peak), ranking(total)
    atoms = np.union1d(by_max, by_sum).astype(np.int64)
    levels = None
    if n_full > 0:
        levels = np.full((len(atoms), n_full), 255, np.uint8)
        scale = np.maximum(peak[atoms], 1e-12)
        levels[:, positions] = np.round(np.clip(codes[:, atoms].T / scale[:, None], 0, 1) * 250).astype(np.uint8)
    padded = np.pad(codes, ((0, 0), (0, max(PATCH_TOP - codes.shape[1], 0))))  # fewer atoms than PATCH_TOP
    best = np.argsort(-padded, axis=1, kind="stable")[:, :PATCH_TOP]  # per token, largest first, ties by atom id
    token_values = np.take_along_axis(padded, best, axis=1)
    token_atoms = np.where(token_values > 0, best, -1).astype(np.int32)
    token_values = np.where(token_values > 0, token_values, 0).astype(np.float32)
    return {
        "atoms": atoms,
        "max": peak[atoms].astype(np.float32),
        "sum": total[atoms].astype(np.float32),
        "top": positions[codes[:, atoms].argmax(axis=0)] if len(atoms) else np.zeros(0, np.int64),
        "levels": levels,
        "by_max": by_max.astype(np.int64),
        "by_sum": by_sum.astype(np.int64),
        "token_atoms": token_atoms,
        "token_values": token_values,
        "positions": np.asarray(positions, np.int64),
    }


def _side(sparse: bool, sae: Any, batches: list, d_sae: int, top: int) -> tuple[dict[str, float], tuple]:
    """One pass over ``batches``: CPU seconds per stage and what it computed."""
    import torch

    from sae_pipeline.features.image_codes import split_images
    from sae_pipeline.features.image_top import image_top_atoms
    from sae_pipeline.features.labels import LabelCounts
    from sae_pipeline.features.topn import TopNTable

    table, counts = TopNTable(d_sae, top), LabelCounts(d_sae, TPI)
    seconds = {"encode": 0.0, "table + labels": 0.0, "image rankings": 0.0}
    ranked = []
    positions = np.arange(TPI)
    with torch.no_grad():
        for x, token, image, label in batches:
            start = time.process_time()
            if sparse:
                codes = sae.encode_sparse(x)
            else:
                dense = sae.encode(x).float()
            middle = time.process_time()
            if sparse:
                args = (codes.rows, codes.indices, codes.values, codes.batch_size)
                rows, atoms = table.update_entries(*args, token, image, token % TPI)
                values = codes.values
            else:
                rows, atoms = table.update_codes(dense, token, image, token % TPI)
                values = dense[rows, atoms]
            counts.update(rows, atoms, values, image, label)
            end = time.process_time()
            if sparse:
                ranked += [image_top_atoms(part, positions, TPI) for part in split_images(codes, TPI)]
            else:
                array = dense.numpy()
                ranked += [former_image_top(array[i : i + TPI], positions, TPI) for i in range(0, len(array), TPI)]
            seconds["encode"] += middle - start
            seconds["table + labels"] += end - middle
            seconds["image rankings"] += time.process_time() - end
    return seconds, (table.state(), counts.state(), ranked)


def _check_equal(a: tuple, b: tuple) -> None:
    import torch

    for state_a, state_b in zip(a[:2], b[:2]):
        for name, value in state_a.items():
            assert torch.equal(value, state_b[name]), f"{name} differs between the sparse and dense sides"
    assert len(a[2]) == len(b[2])
    for one, other in zip(a[2], b[2]):
        for name, value in one.items():
            assert (value is None and other[name] is None) or np.array_equal(value, other[name]), name


def sparse_vs_dense(args: argparse.Namespace, work: Path) -> None:
    """Part 6 (see the module docstring)."""
    import torch

    sae = make_sae(args.d, args.d_sae, args.k)
    per_batch = max(1, args.batch_size // TPI)
    rng = torch.Generator().manual_seed(0)
    batches = []
    for first in range(0, args.images, per_batch):
        n = min(per_batch, args.images - first) * TPI
        token = torch.arange(first * TPI, first * TPI + n)
        batches.append((torch.randn(n, args.d, generator=rng), token, token // TPI, (token // TPI) % 1000))
    n_tokens = sum(len(b[1]) for b in batches)
    print(
        f"6. features pass and image rankings, sparse codes vs the former dense path: {args.images:,} images x {TPI} "
        f"tokens ({n_tokens:,}, {len(batches)} batches), d {args.d}, TopK d_sae {args.d_sae} k {args.k}, N {args.top}, "
        f"CPU, torch threads {torch.get_num_threads()}"
    )
    best: dict[bool, dict[str, float]] = {}
    results = {}
    for round_ in range(max(args.repeats, 1)):
        for sparse in (False, True):
            seconds, results[sparse] = _side(sparse, sae, batches, args.d_sae, args.top)
            best[sparse] = {k: min(v, best.get(sparse, seconds)[k]) for k, v in seconds.items()}
            side = "sparse" if sparse else "dense "
            print(f"   round {round_ + 1} {side}: " + ", ".join(f"{k} {v:.3f} s" for k, v in seconds.items()))
    _check_equal(results[True], results[False])
    print("   outputs equal (top-N table, label counts, every image's rankings, levels, sums and per-token top atoms)")
    for stage in best[False]:
        dense, sparse = best[False][stage], best[True][stage]
        print(f"   {stage:<15} dense {dense:8.3f} s CPU, sparse {sparse:8.3f} s CPU: {dense / max(sparse, 1e-9):5.2f}x")
    dense, sparse = sum(best[False].values()), sum(best[True].values())
    print(f"   {'all':<15} dense {dense:8.3f} s CPU, sparse {sparse:8.3f} s CPU: {dense / max(sparse, 1e-9):5.2f}x")
