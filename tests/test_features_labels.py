"""The per-atom label counts of the features pass against a plain dense count, across batches, workers and ranks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_features_label_weights import check_site_weighted

from sae_pipeline.features import labels
from sae_pipeline.features.labels import LabelCounts
from sae_pipeline.features.merge import merge_label_states


def dense_reference(codes: np.ndarray, image_label: np.ndarray, tpi: int) -> dict[str, np.ndarray]:
    """Loops over images and atoms: does the atom fire on any token of the image, and how strongly (its largest
    code on the image, 0 if only negative; summed, and squared and summed, in float64)?"""
    n_images, d_sae = len(image_label), codes.shape[1]
    n_labels = max(int(image_label.max()) + 1, 0)
    fire = np.zeros((d_sae, n_labels), np.int64)
    fire_unlabelled = np.zeros(d_sae, np.int64)
    weight, weight_unlabelled = np.zeros((2, d_sae, n_labels)), np.zeros((2, d_sae))
    images = np.zeros(n_labels, np.int64)
    for i in range(n_images):
        label = image_label[i]
        if label >= 0:
            images[label] += 1
        for j in range(d_sae):
            tokens = codes[i * tpi : (i + 1) * tpi, j].astype(np.float64)
            if np.any(tokens != 0):
                a = max(float(tokens[tokens != 0].max()), 0.0)
                if label >= 0:
                    fire[j, label] += 1
                    weight[:, j, label] += (a, a * a)
                else:
                    fire_unlabelled[j] += 1
                    weight_unlabelled[:, j] += (a, a * a)
    return {
        "label_fire": fire,
        "label_fire_unlabelled": fire_unlabelled,
        "label_images": images,
        "label_images_unlabelled": np.int64((image_label < 0).sum()),
        "label_weight": weight[0],
        "label_weight_sq": weight[1].sum(-1),
        "label_weight_unlabelled": weight_unlabelled[0],
        "label_weight_sq_unlabelled": weight_unlabelled[1],
    }


def dyadic_codes(rng: np.random.Generator, shape: tuple[int, int], rate: float) -> np.ndarray:
    """Sparse codes, a fifth of them negative (MP's signed coefficients), in multiples of 1/64: their float64 sums
    and squares are exact in any order, so the weighted sums can be compared exactly."""
    values = np.round(rng.random(shape) * 256) / 64 * np.where(rng.random(shape) < 0.2, -1, 1)
    return ((rng.random(shape) < rate) * values).astype(np.float32)


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
            batch_codes = torch.from_numpy(codes[start:stop])
            rows, atoms = batch_codes.nonzero(as_tuple=True)
            image = torch.from_numpy(tokens[start:stop] // tpi)
            counts.update(rows, atoms, batch_codes[rows, atoms], image, torch.from_numpy(token_label[start:stop]))
        ranks.append(counts)
    merged = LabelCounts(d_sae, tpi)
    merged.load_state(merge_label_states([counts.state() for counts in ranks]))
    merged.resolve(part for counts in ranks for part in counts.leftover())
    return {name: value.numpy() for name, value in merged.state().items()}


@pytest.mark.parametrize(
    ("tpi", "cuts", "batch", "dense"),
    [
        (1, [0, 60], 7, True),
        (5, [0, 60], 7, True),
        (5, [0, 23, 41, 60], 4, True),
        (5, [0, 23, 41, 60], 4, False),
        (3, [0, 31, 60], 64, True),
        (3, [0, 31, 60], 64, False),
        (4, [0, 60], 1, True),
    ],
)
def test_label_counts_equal_dense_reference(
    tpi: int, cuts: list[int], batch: int, dense: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counts and activation sums (exactly: dyadic codes), images split across batches, shuffled workers and ranks,
    by the dense per-image maxima and by the sorted pairs (``dense=False``: what large batches use)."""
    if not dense:
        monkeypatch.setattr(labels, "DENSE_LIMIT", 0)
    rng = np.random.default_rng(tpi * 100 + batch)
    n_images = cuts[-1] // tpi if cuts[-1] % tpi == 0 else cuts[-1] // tpi + 1
    n_tokens = n_images * tpi
    cuts = [*cuts[:-1], n_tokens]
    codes = dyadic_codes(rng, (n_tokens, 9), 0.15)
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
    assert np.array_equal(
        got["label_fire_unlabelled"], dense_reference(codes, unlabelled, tpi)["label_fire_unlabelled"]
    )


def selectivity_reference(fire: np.ndarray, images: np.ndarray) -> tuple[list, list, list]:
    """Top label, its prior-corrected share and the selectivity of each atom, by loops over the formula."""
    present = [label for label in range(len(images)) if images[label] > 0]
    top, share, selectivity = [], [], []
    for row in fire:
        rates = {label: row[label] / images[label] for label in present}
        total = sum(rates.values())
        if total == 0:
            top.append(-1), share.append(None), selectivity.append(None)
            continue
        q = {label: rate / total for label, rate in rates.items()}
        best = max(present, key=lambda label: (q[label], -label))
        entropy = -sum(v * np.log(v) for v in q.values() if v > 0)
        top.append(best), share.append(q[best])
        selectivity.append(1 - entropy / np.log(len(present)) if len(present) > 1 else None)
    return top, share, selectivity


def check_site_labels(site, codes: np.ndarray, image_label: np.ndarray, tpi: int) -> None:
    """``features.npz`` of a site against the dense reference: counts, prior, top labels, selectivity."""
    table = np.load(site / "features.npz", allow_pickle=False)
    for name, value in dense_reference(codes, image_label, tpi).items():
        if name in labels.WEIGHT_FIELDS:  # float64 sums, in another order
            np.testing.assert_allclose(table[name], value, rtol=1e-12, atol=0, err_msg=name)
        else:
            assert np.array_equal(table[name], value), name
    top, share, selectivity = selectivity_reference(table["label_fire"], table["label_images"])
    assert table["label_top"].tolist() == top
    for got, want in ((table["label_top_share"], share), (table["label_selectivity"], selectivity)):
        assert [None if np.isnan(v) else pytest.approx(v, abs=1e-12) for v in got] == want
    filled = table["token"] >= 0
    assert (table["label_top_images"][filled] == image_label[table["image"][filled]]).all()
    assert (table["label_top_images"][~filled] == -1).all()
    check_site_chance(site, table)
    check_site_weighted(table, json.loads((site / "features.json").read_text())["labels"])


def check_site_chance(site, table) -> None:
    """The fields against chance in ``features.npz`` and ``features.json``: the null at each atom's n, the excess,
    the p-value of S (recomputed from the counts), the top label's exact hypergeometric tail (x L, kept beside it),
    Benjamini-Hochberg over the p-values of S of the atoms with n >= n_min."""
    import json
    import math

    from test_features_chance import bh_direct, one_label, tail

    from sae_pipeline.features.chance import selectivity_p

    summary = json.loads((site / "features.json").read_text())["labels"]["chance"]
    fire, images = table["label_fire"][:, table["label_ids"]], table["label_images"][table["label_ids"]]
    n, total, n_labels = fire.sum(1), int(images.sum()), len(images)
    fired = n > 0
    np.testing.assert_array_equal(table["label_chance_selectivity"][fired], table["label_chance_by_n"][n[fired]])
    np.testing.assert_array_equal(table["label_chance_selectivity_sd"][fired], table["label_chance_sd_by_n"][n[fired]])
    np.testing.assert_allclose(
        table["label_selectivity_excess"], table["label_selectivity"] - table["label_chance_selectivity"]
    )
    for atom in np.flatnonzero(fired):
        best = max(fire[atom] / images)
        tails = [tail(int(c), total, int(m), int(n[atom])) for c, m in zip(fire[atom], images) if c / m == best]
        assert table["label_top_p"][atom] == pytest.approx(min(1.0, n_labels * float(min(tails))), rel=1e-9)
    p, method, *_ = selectivity_p(fire, images, table["label_selectivity"], summary["draws"], summary["seed"])
    np.testing.assert_array_equal(table["label_selectivity_p"], p)
    np.testing.assert_array_equal(table["label_selectivity_p_method"], method)
    n_min = summary["min_images"]
    assert n_min == next(k for k in range(1, total + 1) if one_label(images.tolist(), k) <= 0.05)
    tested = np.flatnonzero(fired & (n >= n_min))
    assert (table["label_too_few"] == (fired & (n < n_min))).all()
    assert np.isnan(table["label_selectivity_p_adjusted"][~np.isin(np.arange(len(n)), tested)]).all()
    beats = {int(tested[i]) for i in bh_direct(table["label_selectivity_p"][tested].tolist(), 0.05)}
    assert set(np.flatnonzero(table["label_beats_chance"]).tolist()) == beats
    assert summary["fdr"] == 0.05 and summary["tested"] == len(tested) and summary["beat_chance"] == len(beats)
    assert summary["draws"] == 1000 and summary["seed"] == 0 and not math.isnan(table["label_chance_by_n"][1])


def test_selectivity_against_loops() -> None:
    """More labels than the fixtures have, a label without images, an atom that never fires, one that fires once."""
    from sae_pipeline.features.selectivity import label_stats

    fire = np.array([[3, 0, 0, 1], [2, 0, 1, 1], [0, 0, 0, 0], [1, 0, 2, 1], [4, 0, 2, 2], [0, 0, 1, 0]], np.int64)
    images = np.array([6, 0, 3, 3], np.int64)
    state = {
        "label_fire": torch.from_numpy(fire),
        "label_images": torch.from_numpy(images),
        "label_fire_unlabelled": torch.zeros(6, dtype=torch.int64),
        "label_images_unlabelled": torch.tensor(2),
        "image": torch.full((6, 2), -1),
    }
    stats = label_stats(state, {"images": {}})
    top, share, selectivity = selectivity_reference(fire, images)
    assert stats.labels.tolist() == [0, 2, 3] and stats.top_label.tolist() == top
    assert [None if np.isnan(v) else pytest.approx(v) for v in stats.top_share] == share
    assert [None if np.isnan(v) else pytest.approx(v) for v in stats.selectivity] == selectivity
    # label 2's page: atoms by F1 = 2 c / (n + m) desc (ties: larger q, then the lower id); an atom with c = 0 is not
    fired = [a for a in range(6) if fire[a, 2] > 0]
    q2 = {a: (fire[a, 2] / 3) / sum(fire[a, label] / images[label] for label in (0, 2, 3)) for a in fired}
    f1 = {a: 2 * fire[a, 2] / (fire[a].sum() + 3) for a in fired}
    want = sorted(fired, key=lambda a: (-f1[a], -q2[a], a))
    assert stats.per_label[2] == want == [3, 5, 4, 1]  # by q alone atom 5 (one image, of label 2 only) would lead
    unlabelled = {**state, "label_fire": torch.zeros((5, 0), dtype=torch.int64), "label_images": torch.zeros(0)}
    assert label_stats(unlabelled, {"images": {}}) is None
