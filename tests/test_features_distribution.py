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
    SAMPLE,
    DistributionTable,
    bands,
    example_hash,
    merge_distribution_states,
)
from sae_pipeline.features.distribution_html import WIDTH, column_range, distribution_section, histogram_svg

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
    """The band's examples straight from the definition: of the atom's SAMPLE positive tokens of smallest hash,
    those with a value in the band; their distinct images, each at its smallest hash, by hash."""
    v, token = codes["dense"][:, j].astype(np.float64), codes["token"].numpy()
    positive = v > 0
    v, token = v[positive], token[positive]
    h = example_hash(torch.from_numpy(token), torch.full((len(token),), j)).numpy()
    sample = np.lexsort((token, h))[:SAMPLE]
    low, high = column_range(first)[0], column_range(last)[1]
    sample = sample[(v[sample] >= low) & (v[sample] < high)]
    best: dict[int, int] = {}
    for i in sample:
        image = int(token[i] // TOKENS_PER_IMAGE)
        best[image] = min(best.get(image, 1 << 62), int(h[i]))
    return sorted(best, key=lambda image: (best[image], image))[:per_band]


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


def test_bands_hold_a_fifth_each_and_the_memory_is_within_the_old() -> None:
    """An atom with many values spread over under a decade (where quarter-decade bins made one to three bands):
    five bands of about a fifth each, each with four examples; the table's bytes per atom stay below the
    quarter-decade table's (34 int64 counts and 34 x 4 reservoir slots of 36 bytes)."""
    g = np.random.default_rng(11)
    n_tokens = 3000
    dense = np.zeros((n_tokens, D_SAE), np.float32)
    dense[:, 0] = np.exp(g.normal(0.0, 0.44, n_tokens))  # 95 % of the values within a factor 5.6
    dense[g.random(n_tokens) < 0.5, 1] = 2.0  # one value only: one band
    codes = {"dense": dense, "token": torch.arange(n_tokens, dtype=torch.int64)}
    table = DistributionTable(D_SAE)
    feed(table, codes, batch=256)
    out = bands(table.state())
    shares = out["band_count"][0].numpy() / n_tokens
    largest_bin = table.hist_counts[0].max().item() / n_tokens  # a band is a fifth to within one bin's mass
    assert np.abs(shares - 0.2).max() <= min(largest_bin, 0.05), (shares, largest_bin)
    filled = (out["band_token"][0] >= 0).sum(1)  # ~13 of the 64 sampled tokens per band: four examples, mostly
    assert filled.min() >= 2 and filled.sum() >= 17, filled
    assert int((out["band_bins"][1, :, 0] >= 0).sum()) == 1  # one value, one bin: one band holds it all
    assert int(out["band_count"][1].max()) == int((dense[:, 1] > 0).sum())
    old = 34 * 8 + 34 * 4 * 36
    per_atom = sum(t.numel() * t.element_size() for t in DistributionTable(10).state().values()) / 10
    assert per_atom < old and table.res_hash.shape[1] == SAMPLE


def tick_texts(svg: str) -> list[tuple[float, str, str]]:
    import re

    return [
        (float(x), anchor, text)
        for x, anchor, text in re.findall(r'<text class="tick" x="([0-9.]+)"[^>]*text-anchor="(\w+)">([^<]*)<', svg)
    ]


def test_histogram_ticks_are_round_plain_and_inside_the_figure() -> None:
    """Ticks at round values in one notation (no %g's 1e+04 or 1.77828), two at least even for an atom whose values
    span a factor of 2, and none running off the right edge; a band of one token says "1 token"."""
    for low, high in ((1.0, 2.0), (0.013, 3e4), (2e-5, 0.9), (1.33, 1.4)):
        values = np.geomspace(low, high, 200)
        counts = np.histogram(values, bins=np.concatenate([[0], HIST_EDGES, [np.inf]]))[0]
        svg = histogram_svg(counts, np.zeros(N_BINS, np.int64))
        found = tick_texts(svg)
        assert len(found) >= 2, (low, high)
        for x, anchor, text in found:
            assert "e+" not in text and len(text.partition(".")[2]) <= 4 and float(text) > 0, text
            width = 6 * len(text)
            left = {"start": x, "middle": x - width / 2, "end": x - width}[anchor]
            assert 0 <= left and left + width <= WIDTH, (text, x, anchor)
    state = {
        "hist_counts": torch.zeros((1, N_BINS), dtype=torch.int64),
        "hist_negative": torch.zeros(1, dtype=torch.int64),
        "band_bins": torch.full((1, 5, 2), -1),
        "band_count": torch.zeros((1, 5), dtype=torch.int64),
        "band_token": torch.full((1, 5, 4), -1),
    }
    state["hist_counts"][0, 100], state["band_bins"][0, 0], state["band_count"][0, 0] = 1, torch.tensor([100, 100]), 1
    section = distribution_section(state, 0, lambda band, example: "")
    assert "(1 token)" in section and "1 tokens" not in section and "1 positive value" in section
