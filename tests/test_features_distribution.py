"""Each atom's activation histogram and quantile-band examples: exact against numpy, mergeable, on the atom page."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from features_fixtures import identity_sae, write_export, write_shards

from sae_pipeline.__main__ import main
from sae_pipeline.features.distribution import (
    HIST_EDGES,
    N_BINS,
    DistributionTable,
    bands,
    example_hash,
    merge_distribution_states,
)
from sae_pipeline.features.distribution_html import column_range

D_SAE, TOKENS_PER_IMAGE = 7, 3


def random_codes(seed: int, n_tokens: int = 600) -> dict[str, torch.Tensor]:
    """Sparse codes with values spread over the bins, the edges, under- and overflow, and negatives."""
    g = np.random.default_rng(seed)
    dense = np.where(g.random((n_tokens, D_SAE)) < 0.4, 10.0 ** g.uniform(-5, 5, (n_tokens, D_SAE)), 0.0)
    dense[g.random((n_tokens, D_SAE)) < 0.03] *= -1
    dense[:5, :] = HIST_EDGES[g.integers(0, len(HIST_EDGES), (5, D_SAE))]  # exactly on edges
    dense = dense.astype(np.float32)
    token = np.arange(n_tokens, dtype=np.int64) + 1000 * seed
    return {"dense": dense, "token": torch.from_numpy(token)}


def feed(table: DistributionTable, codes: dict, batch: int = 64) -> None:
    dense, token = torch.from_numpy(codes["dense"]), codes["token"]
    order = torch.randperm(len(token), generator=torch.Generator().manual_seed(7))  # batches in any order
    for s in range(0, len(token), batch):
        rows_of = order[s : s + batch]
        x = dense[rows_of]
        rows, atoms = x.nonzero(as_tuple=True)
        tok = token[rows_of]
        table.update(rows, atoms, x[rows, atoms], tok, tok // TOKENS_PER_IMAGE, tok % TOKENS_PER_IMAGE)


def test_histogram_equals_numpy_with_the_same_edges() -> None:
    codes = random_codes(0)
    table = DistributionTable(D_SAE)
    feed(table, codes)
    edges = np.concatenate([[np.finfo(np.float64).tiny], HIST_EDGES, [np.finfo(np.float64).max]])
    for j in range(D_SAE):
        v = codes["dense"][:, j].astype(np.float64)
        expected, _ = np.histogram(v[v > 0], bins=edges)
        # numpy closes its last bin; no value reaches float64's max, so the bins agree
        assert np.array_equal(table.hist_counts[j].numpy(), expected), j
        assert int(table.hist_negative[j]) == int((v < 0).sum())


def test_merge_of_two_halves_equals_the_whole() -> None:
    a, b = random_codes(1), random_codes(2)
    whole, half_a, half_b = DistributionTable(D_SAE), DistributionTable(D_SAE), DistributionTable(D_SAE)
    both = {"dense": np.concatenate([a["dense"], b["dense"]]), "token": torch.cat([a["token"], b["token"]])}
    feed(whole, both, batch=50)
    feed(half_a, a)
    feed(half_b, b, batch=17)
    for merged in (
        merge_distribution_states([half_a.state(), half_b.state()]),
        merge_distribution_states([half_b.state(), half_a.state()]),
    ):
        for name, value in whole.state().items():
            assert torch.equal(merged[name], value), name


def reference_bands(codes: dict, j: int, first: int, last: int, per_band: int) -> list[int]:
    """The band's examples straight from the definition: the smallest-hash distinct images with a value in it."""
    v, token = codes["dense"][:, j].astype(np.float64), codes["token"].numpy()
    low, high = column_range(first)[0], column_range(last)[1]
    inside = (v > 0) & (v >= low) & (v < high)
    images = np.unique(token[inside] // TOKENS_PER_IMAGE)
    h = example_hash(torch.from_numpy(images), torch.full((len(images),), j)).numpy()
    return images[np.lexsort((images, h))][:per_band].tolist()


def test_band_examples_lie_in_their_band_and_are_deterministic() -> None:
    codes = random_codes(3, n_tokens=900)
    table = DistributionTable(D_SAE)
    feed(table, codes)
    out = bands(table.state())
    again = DistributionTable(D_SAE)
    feed(again, codes, batch=31)
    for name, value in bands(again.state()).items():
        assert torch.equal(out[name], value), name
    per_band = out["band_token"].shape[2]
    for j in range(D_SAE):
        positive = int((codes["dense"][:, j] > 0).sum())
        assert int(out["band_count"][j].sum()) == positive
        for b in range(out["band_bins"].shape[1]):
            first, last = out["band_bins"][j, b].tolist()
            if first < 0:
                assert (out["band_token"][j, b] < 0).all()
                continue
            low, high = column_range(first)[0], column_range(last)[1]
            filled = out["band_token"][j, b] >= 0
            values = out["band_value"][j, b][filled].double().numpy()
            assert ((values >= low) & (values < high)).all()
            assert out["band_image"][j, b][filled].tolist() == reference_bands(codes, j, first, last, per_band)
            assert np.array_equal(out["band_token"][j, b][filled] // TOKENS_PER_IMAGE, out["band_image"][j, b][filled])
        shares = out["band_count"][j].numpy() / max(positive, 1)
        assert shares.max() <= 1.0 and len(out["band_bins"][j]) == 5


def test_atom_page_draws_the_histogram_and_band_rows(tmp_path: Path) -> None:
    write_shards(tmp_path / "shards", tmp_path / "images", n_images=6, shard_size=3)
    sae = write_export(identity_sae(), tmp_path / "sae")
    out = tmp_path / "site"
    args = ["features", "--sae", str(sae), "--data.source", str(tmp_path / "shards"), "--top", "2"]
    assert main([*args, "--out", str(out), "--data.batch_size", "8", "--trainer.accelerator", "cpu"]) == 0
    npz = np.load(out / "features.npz")
    assert npz["hist_counts"].shape[1] == N_BINS and "band_image" in npz.files
    atom = int(np.argmax(npz["hist_counts"].sum(1)))
    page = next((out / "atoms").glob(f"*{atom}.html")).read_text()
    assert (
        '<svg class="histogram"' in page
        and "Values [" in page
        and "quantiles 0–" in page
        and "activation value" in page
    )
    shown = npz["band_image"][atom][npz["band_token"][atom] >= 0]
    assert len(shown) and all(f"thumbs/{key}.jpg" in page for key in shown.tolist())
