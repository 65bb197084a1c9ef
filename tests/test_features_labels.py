"""The per-atom label counts of the features pass against a plain dense count, across batches, workers and ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sae_pipeline.features.labels import LabelCounts
from sae_pipeline.features.merge import merge_label_states


def dense_reference(codes: np.ndarray, image_label: np.ndarray, tpi: int) -> dict[str, np.ndarray]:
    """Loops over images and atoms: does the atom fire on any token of the image?"""
    n_images, d_sae = len(image_label), codes.shape[1]
    n_labels = max(int(image_label.max()) + 1, 0)
    fire = np.zeros((d_sae, n_labels), np.int64)
    fire_unlabelled = np.zeros(d_sae, np.int64)
    images = np.zeros(n_labels, np.int64)
    for i in range(n_images):
        label = image_label[i]
        if label >= 0:
            images[label] += 1
        for j in range(d_sae):
            if np.any(codes[i * tpi : (i + 1) * tpi, j] != 0):
                if label >= 0:
                    fire[j, label] += 1
                else:
                    fire_unlabelled[j] += 1
    return {
        "label_fire": fire,
        "label_fire_unlabelled": fire_unlabelled,
        "label_images": images,
        "label_images_unlabelled": np.int64((image_label < 0).sum()),
    }


def run_ranks(codes: np.ndarray, image_label: np.ndarray, tpi: int, cuts: list[int], batch: int, seed: int) -> dict:
    """Ranks own the token ranges between ``cuts``; each streams its range in batches, in a shuffled order
    (workers interleave), then the ranks' counts are merged as on DDP."""
    rng = np.random.default_rng(seed)
    d_sae = codes.shape[1]
    tokens = np.arange(len(codes))
    token_label = np.repeat(image_label, tpi)
    ranks = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        counts = LabelCounts(d_sae, tpi)
        starts = list(range(lo, hi, batch))
        rng.shuffle(starts)
        for start in starts:
            stop = min(start + batch, hi)
            rows, atoms = torch.from_numpy(codes[start:stop]).nonzero(as_tuple=True)
            image = torch.from_numpy(tokens[start:stop] // tpi)
            counts.update(rows, atoms, image, torch.from_numpy(token_label[start:stop]))
        ranks.append(counts)
    merged = LabelCounts(d_sae, tpi)
    merged.load_state(merge_label_states([counts.state() for counts in ranks]))
    merged.resolve(part for counts in ranks for part in counts.leftover())
    return {name: value.numpy() for name, value in merged.state().items()}


@pytest.mark.parametrize(
    ("tpi", "cuts", "batch"),
    [(1, [0, 60], 7), (5, [0, 60], 7), (5, [0, 23, 41, 60], 4), (3, [0, 31, 60], 64), (4, [0, 60], 1)],
)
def test_label_counts_equal_dense_reference(tpi: int, cuts: list[int], batch: int) -> None:
    rng = np.random.default_rng(tpi * 100 + batch)
    n_images = cuts[-1] // tpi if cuts[-1] % tpi == 0 else cuts[-1] // tpi + 1
    n_tokens = n_images * tpi
    cuts = [*cuts[:-1], n_tokens]
    codes = (rng.random((n_tokens, 9)) < 0.15) * rng.random((n_tokens, 9)).astype(np.float32)
    codes[:, 8] = 0  # a dead atom
    image_label = rng.integers(-1, 5, n_images)
    image_label[image_label == 3] = 4  # label 3 absent: a gap in the prior
    got = run_ranks(codes, image_label, tpi, cuts, batch, seed=tpi)
    want = dense_reference(codes, image_label, tpi)
    for name, value in want.items():
        assert np.array_equal(got[name], value), name


def test_ranks_with_different_label_sets_and_no_labels() -> None:
    rng = np.random.default_rng(1)
    tpi, n_images = 3, 20
    codes = (rng.random((n_images * tpi, 6)) < 0.3).astype(np.float32)
    image_label = np.where(np.arange(n_images) < 10, 0, 7)  # rank 0 sees label 0 only, rank 1 label 7
    got = run_ranks(codes, image_label, tpi, [0, 31, n_images * tpi], 5, seed=0)
    want = dense_reference(codes, image_label, tpi)
    assert got["label_fire"].shape == (6, 8)
    for name, value in want.items():
        assert np.array_equal(got[name], value), name
    unlabelled = np.full(n_images, -1)
    got = run_ranks(codes, unlabelled, tpi, [0, 31, n_images * tpi], 5, seed=0)
    assert got["label_fire"].shape == (6, 0) and got["label_images"].shape == (0,)
    assert int(got["label_images_unlabelled"]) == n_images
    assert np.array_equal(got["label_fire_unlabelled"], dense_reference(codes, unlabelled, tpi)["label_fire_unlabelled"])
