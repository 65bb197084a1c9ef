"""The features pass and site from the SAE's sparse entries: each image's max/sum over atoms and heatmap columns
(`features/image_codes.py`) equal the former dense computation bit for bit, and a whole site is the same
whether the codes stayed sparse or went through `[B, d_sae]` (`sparse_max_density` 0)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from features_fixtures import D, write_export, write_shards

from benchmarks.features.sparse import former_image_top
from sae_pipeline.__main__ import main
from sae_pipeline.features.image_codes import ImageCodes, split_images
from sae_pipeline.features.image_top import image_top_atoms
from sae_pipeline.sae import ShallowSAE, TopKSAE
from sae_pipeline.sae.inference_codes import from_dense


def random_codes(rng: np.random.Generator, tokens: int, d_sae: int, trial: int) -> np.ndarray:
    """Sparse codes of any sign over 6 orders of magnitude (a sum in another order rounds differently),
    rounded every other trial (ties), some images all 0."""
    codes = rng.standard_normal((tokens, d_sae)) * 10.0 ** rng.uniform(-3, 3, (tokens, d_sae))
    codes = np.round(codes) if trial % 2 else codes
    codes[rng.random((tokens, d_sae)) < rng.uniform(0.3, 1.0)] = 0
    return codes.astype(np.float32)


def test_image_top_atoms_from_entries_equal_the_dense_computation() -> None:
    rng = np.random.default_rng(0)
    for trial in range(60):
        tokens, d_sae = int(rng.integers(1, 40)), int(rng.integers(1, 50))
        codes = random_codes(rng, tokens, d_sae, trial) * (trial % 7 != 0)
        positions = rng.permutation(tokens + 4)[:tokens]
        n_full = 0 if trial % 4 == 0 else tokens + 4
        k = int(rng.integers(1, 20))
        expected = former_image_top(codes, positions, n_full, k)
        got = image_top_atoms(ImageCodes.from_dense(codes), positions, n_full, k)
        for name, value in expected.items():
            assert (got[name] is None) if value is None else (got[name].dtype == value.dtype), name
            assert value is None or np.array_equal(got[name], value), (trial, name)


def test_split_images_equals_each_image_read_alone() -> None:
    """A chunk of whole images: per image the atoms, max, sum and the columns heatmaps read of its dense slice."""
    rng = np.random.default_rng(1)
    for trial in range(10):
        tpi, n_images, d_sae = int(rng.integers(1, 12)), int(rng.integers(1, 6)), int(rng.integers(1, 40))
        codes = random_codes(rng, tpi * n_images, d_sae, trial)
        codes[:tpi] = 0  # an image without codes
        images = split_images(from_dense(torch.from_numpy(codes)), tpi)
        assert len(images) == n_images
        for i, image in enumerate(images):
            dense = codes[i * tpi : (i + 1) * tpi]
            nonzero = np.flatnonzero((dense != 0).any(0))
            assert image.atoms.tolist() == nonzero.tolist()
            assert np.array_equal(image.peak, dense.max(0)[nonzero])
            assert np.array_equal(image.total, dense.sum(0)[nonzero])
            wanted = rng.permutation(d_sae)[: int(rng.integers(0, d_sae + 1))]
            assert np.array_equal(image.columns(wanted), dense[:, wanted].T)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sparse_features")
    write_shards(root / "shards", root / "images")
    return root


def tied_topk() -> TopKSAE:
    """TopK over 2·D atoms whose encoder columns come in equal pairs (ties between atoms; the shards hold ties
    between tokens)."""
    torch.manual_seed(0)
    sae = TopKSAE(d_in=D, d_sae=2 * D, k=3)
    with torch.no_grad():
        w = torch.randn(D, D)
        sae.W_enc.copy_(torch.cat([w, w], 1))
        sae.b_enc.fill_(-0.2)
    return sae


@pytest.mark.slow
def test_site_is_the_same_from_sparse_and_dense_codes(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sae_dpath = write_export(tied_topk(), shards / "sae")
    sites = {}
    for density in (ShallowSAE.sparse_max_density, 0.0):
        monkeypatch.setattr(ShallowSAE, "sparse_max_density", density)
        out = shards / f"site_{density}"
        args = ["--sae", str(sae_dpath), "--data.source", str(shards / "shards"), "--out", str(out)]
        args += ["--top", "3", "--data.batch_size", "20", "--data.num_workers", "0", "--trainer.accelerator", "cpu"]
        assert main(["features", *args]) == 0
        sites[density] = out
    sparse, dense = sites.values()
    a, b = np.load(sparse / "features.npz"), np.load(dense / "features.npz")
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
        assert np.array_equal(a[name], b[name], equal_nan=a[name].dtype.kind == "f"), name
    pages = sorted(p.relative_to(sparse) for p in sparse.rglob("*.html"))
    assert pages == sorted(p.relative_to(dense) for p in dense.rglob("*.html"))
    assert any(p.parts[0] == "images" for p in pages) and any(p.parts[0] == "atoms" for p in pages)
    for page in pages:
        assert (sparse / page).read_text() == (dense / page).read_text(), page
