"""Label statistics weighted by activation: against plain loops, and the approximate p-value against a Monte-Carlo
permutation reference (labels permuted among the images, the atom's activations kept)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_features_chance import bh_direct, exact_tail, one_label

from sae_pipeline.features.label_weights import MIN_EFFECTIVE, weighted_stats
from sae_pipeline.features.selectivity import label_stats


def weighted_reference(weight: np.ndarray, weight_sq: np.ndarray, images: np.ndarray) -> tuple[list, ...]:
    """Top label (lowest id on ties), q_w[top], S_w and n_eff of each atom, by loops over the formulas."""
    top, share, selectivity, n_eff = [], [], [], []
    for w, v in zip(weight, weight_sq):  # v: the atom's sum of squared activations
        rates = [w[label] / images[label] for label in range(len(images))]
        total = sum(rates)
        if total == 0:
            top.append(-1), share.append(None), selectivity.append(None), n_eff.append(None)
            continue
        q = [rate / total for rate in rates]
        best = max(range(len(q)), key=lambda label: (q[label], -label))
        entropy = -sum(x * math.log(x) for x in q if x > 0)
        top.append(best), share.append(q[best]), n_eff.append(sum(w) ** 2 / v)
        selectivity.append(1 - entropy / math.log(len(images)) if len(images) > 1 else None)
    return top, share, selectivity, n_eff


def check_site_weighted(table, summary: dict) -> None:
    """The weighted fields of ``features.npz`` against the loops; where the labels are few the p-values against a
    brute-force enumeration of the null at floor(n_eff) images, and Benjamini-Hochberg over the atoms tested."""
    ids = table["label_ids"]
    weight, weight_sq, images = (
        table["label_weight"][:, ids],
        table["label_weight_sq"],
        table["label_images"][ids],
    )
    top, share, selectivity, n_eff = weighted_reference(weight, weight_sq, images)
    assert table["label_weighted_top"].tolist() == [ids[t] if t >= 0 else -1 for t in top]
    for name, want in (("top_share", share), ("selectivity", selectivity), ("n_eff", n_eff)):
        got = table[f"label_weighted_{name}"]
        assert [None if np.isnan(v) else pytest.approx(v, rel=1e-9, abs=1e-12) for v in got] == want, name
    n = np.floor(np.nan_to_num(table["label_weighted_n_eff"]) + 1e-9).astype(int)
    least = max(summary["chance"]["min_images"], MIN_EFFECTIVE)
    tested = np.flatnonzero(n >= least)
    assert summary["weighted"]["min_effective_images"] == least and summary["weighted"]["tested"] == len(tested)
    p = table["label_weighted_selectivity_p"]
    assert np.isnan(p[n < least]).all() and np.isfinite(p[tested]).all()
    if len(images) <= 3 and images.sum() <= 40:
        for atom in tested:
            s = float(table["label_weighted_selectivity"][atom])
            want = (
                float(one_label(images.tolist(), n[atom])) if s >= 1 - 1e-9 else exact_tail(images.tolist(), n[atom], s)
            )
            assert p[atom] == pytest.approx(want, rel=1e-9), atom
    beats = {int(tested[i]) for i in bh_direct(p[tested].tolist(), summary["chance"]["fdr"])}
    assert set(np.flatnonzero(table["label_weighted_beats_chance"]).tolist()) == beats
    low, high = table["label_weighted_selectivity_low"], table["label_weighted_selectivity_high"]
    assert (np.isfinite(low) == np.isfinite(table["label_weighted_selectivity"])).all()
    assert (low[np.isfinite(low)] <= high[np.isfinite(low)]).all()


def state_of(fire: np.ndarray, weight: np.ndarray, weight_sq: np.ndarray, images: np.ndarray) -> dict:
    d_sae = len(fire)
    return {
        "label_fire": torch.from_numpy(np.asarray(fire, np.int64)),
        "label_images": torch.from_numpy(np.asarray(images, np.int64)),
        "label_fire_unlabelled": torch.zeros(d_sae, dtype=torch.int64),
        "label_images_unlabelled": torch.tensor(0),
        "label_weight": torch.from_numpy(np.asarray(weight, np.float64)),
        "label_weight_sq": torch.from_numpy(np.asarray(weight_sq, np.float64).sum(-1)),  # per atom
        "label_weight_unlabelled": torch.zeros(d_sae, dtype=torch.float64),
        "label_weight_sq_unlabelled": torch.zeros(d_sae, dtype=torch.float64),
        "image": torch.full((d_sae, 2), -1),
    }


def test_weighted_statistics_against_loops() -> None:
    """A label without images, an atom that never fires, one whose images all weigh alike (n_eff = n), one dominated
    by one image (n_eff near 1: too few to say), one that only fires negatively (weight 0, counted all the same)."""
    images = np.array([9, 0, 8, 7])
    activations = {  # atom -> [(label, a)] per image it fires on
        0: [(0, 2.0)] * 7 + [(2, 0.5), (3, 0.25)],
        1: [],
        2: [(0, 1.0), (2, 1.0), (3, 1.0)] * 3,
        3: [(0, 40.0), (2, 0.5), (3, 0.5), (0, 0.5)],
        4: [(2, 0.0), (3, 0.0)],
        5: [(2, 3.0)] * 6 + [(0, 0.1)] * 2,
    }
    fire, weight, weight_sq = (np.zeros((6, 4)) for _ in range(3))
    for atom, pairs in activations.items():
        for label, a in pairs:
            fire[atom, label] += 1
            weight[atom, label] += a
            weight_sq[atom, label] += a * a
    state = state_of(fire, weight, weight_sq, images)
    stats = label_stats(state, {"images": {}})
    weighted = stats.weighted
    labels = stats.labels
    assert labels.tolist() == [0, 2, 3]
    top, share, selectivity, n_eff = weighted_reference(weight[:, labels], weight_sq.sum(1), images[labels])
    assert weighted.top_label.tolist() == [labels[t] if t >= 0 else -1 for t in top]
    for got, want in ((weighted.top_share, share), (weighted.selectivity, selectivity), (weighted.n_eff, n_eff)):
        assert [None if np.isnan(v) else pytest.approx(v, rel=1e-12) for v in got] == want
    assert weighted.n_eff[2] == pytest.approx(9) and weighted.selectivity[2] == pytest.approx(stats.selectivity[2])
    assert weighted.n_eff[3] < 1.2 and weighted.too_few[3] and np.isnan(weighted.p[3])
    assert np.isnan(weighted.selectivity[4]) and stats.fire[4].sum() == 2  # fires, but never positively
    # atom 5 is weighted towards label 2 more than counted: S_w above S, and tested at floor(n_eff) images
    assert weighted.selectivity[5] > stats.selectivity[5]
    n5 = math.floor(weighted.n_eff[5])
    assert n5 >= MIN_EFFECTIVE and weighted.p[5] == pytest.approx(
        exact_tail(images[labels].tolist(), n5, weighted.selectivity[5]), rel=1e-9
    )
    # the interval: as wide as n_eff images, so the dominated atom's (3) is wider than the even one's (2)
    low, high = weighted.interval[0], weighted.interval[1]
    assert high[3] - low[3] > high[2] - low[2] and low[2] <= weighted.selectivity[2] <= high[2]
    arrays = stats.arrays()
    assert all(arrays[name].dtype.kind in "fiub" for name in arrays)  # numeric only
    assert stats.summary()["weighted"]["min_effective_images"] == max(stats.chance.n_min, MIN_EFFECTIVE)
    older = {k: v for k, v in state.items() if not k.startswith("label_weight")}  # a state without the sums
    assert (
        label_stats(older, {"images": {}}).weighted is None
        and weighted_stats(older, labels, images, 3, 0.05, 10) is None
    )


def selectivity_rows(weight: np.ndarray, images: np.ndarray) -> np.ndarray:
    rate = weight / images
    q = rate / rate.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(q > 0, q * np.log(q), 0.0).sum(-1)
    return 1 - entropy / math.log(len(images))


def permutation_p(a: np.ndarray, images: np.ndarray, observed: float, rng, permutations: int) -> float:
    """P(S_w >= observed) with the labels of all images permuted and the atom's activations ``a`` on its images
    kept: Monte-Carlo, ``(1 + hits) / (1 + permutations)``."""
    pool = np.repeat(np.arange(len(images)), images)
    labels = rng.permuted(np.broadcast_to(pool, (permutations, len(pool))), axis=1)[:, : len(a)]
    weight = np.zeros((permutations, len(images)))
    np.add.at(weight, (np.repeat(np.arange(permutations), len(a)), labels.ravel()), np.tile(a, permutations))
    return (1 + int((selectivity_rows(weight, images) >= observed - 1e-9).sum())) / (1 + permutations)


@pytest.mark.parametrize("images", [[50] * 8, [12, 24, 48, 96, 120]])
def test_approximate_p_against_a_permutation_reference(images: list[int]) -> None:
    """Fresh random atoms (exponential, log-normal and uniform activations on 3-80 images; half of them drawing a
    third of their images from label 0): the p-value of S_w at floor(n_eff) images is close to the permutation
    reference and never far below it (anti-conservative) beyond Monte-Carlo error. Taking the atom's n instead of
    n_eff fails it."""
    rng = np.random.default_rng(2027)
    images = np.array(images)
    pool = np.repeat(np.arange(len(images)), images)
    draw = (
        lambda n: rng.exponential(1.0, n),
        lambda n: rng.lognormal(0.0, 1.5, n),
        lambda n: rng.uniform(0.5, 1.0, n),
    )
    atoms, fire, weight, weight_sq = [], [], [], []
    for i in range(60):
        n = int(rng.integers(3, 80))
        a = draw[i % 3](n)
        planted = min(n // 3, images[0]) if i % 2 else 0
        chosen = (
            np.concatenate(
                [
                    rng.choice(np.flatnonzero(pool == 0), planted, replace=False),
                    rng.choice(np.flatnonzero(pool != 0), n - planted, replace=False),
                ]
            )
            if planted
            else rng.choice(len(pool), n, replace=False)
        )
        labels = pool[chosen]
        atoms.append(a)
        fire.append(np.bincount(labels, minlength=len(images)))
        weight.append(np.bincount(labels, weights=a, minlength=len(images)))
        weight_sq.append(np.bincount(labels, weights=a * a, minlength=len(images)))
    state = state_of(np.array(fire), np.array(weight), np.array(weight_sq), images)
    weighted = weighted_stats(state, np.arange(len(images)), images, 3, 0.05, 1000)
    permutations = 3000
    reference = np.array(
        [permutation_p(a, images, weighted.selectivity[i], rng, permutations) for i, a in enumerate(atoms)]
    )
    kept = np.isfinite(weighted.p) & (reference >= 30 / (1 + permutations))  # the reference resolves it
    assert kept.sum() >= 30
    ratio = np.log10(weighted.p[kept] / reference[kept])
    # 30 hits or more: the reference's relative error is at most about 1 / sqrt(30), so 0.25 in log10 is > 4 SE
    assert ratio.min() > -0.25, (ratio.min(), np.flatnonzero(kept)[ratio.argmin()])
    assert abs(float(np.median(ratio))) < 0.2  # close: conservative by a little, as measured
    # the same with n images instead of n_eff: S_w's null is wider than that of n equal images
    weight, n = np.array(weight), np.array(fire).sum(1)
    as_n = torch.from_numpy(weight.sum(1) ** 2 / n)  # sum a^2 = (sum a)^2 / n: n_eff = n
    with_n = weighted_stats({**state, "label_weight_sq": as_n}, np.arange(len(images)), images, 3, 0.05, 1000)
    naive = np.log10(with_n.p[kept] / reference[kept])
    assert naive.min() < -0.25 or np.median(naive) < -0.2


def test_index_script_shows_the_weighted_column() -> None:
    """The index's script, run by node on the index's own row data: a fifth label cell with S_w and its interval,
    and none without activation sums; the weighted lines write p-values as the counts' lines do."""
    import json
    import shutil
    import subprocess

    from sae_pipeline.features import label_pages, label_weight_pages
    from sae_pipeline.features.label_assets import LABELS_JS

    values = [1.0, 0.05, 0.0012, 3e-30, float("nan")]
    for module in (label_pages, label_weight_pages):  # one notation on both lines (features/label_text.py)
        assert [module._p(v) for v in values] == ["1.0e0", "5.0e-2", "1.2e-3", "3.0e-30", "–"]
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the index's script is checked by the browser tests")
    images = np.array([10, 10, 10])
    fire = np.array([[8, 1, 1], [3, 3, 3]])
    weight = fire * np.array([[2.0, 0.5, 0.5], [1.0, 1.0, 1.0]])
    state = state_of(fire, weight, weight * weight / np.maximum(fire, 1), images)
    cells = []
    for weighted in (True, False):
        stats = label_stats(state, {"images": {}})
        stats.weighted = stats.weighted if weighted else None  # as a state without the sums gives
        columns = ["id", "page", *label_pages.INDEX_COLUMNS]
        rows = [[atom, None, *label_pages.index_columns(stats, atom)] for atom in range(2)]
        data = json.dumps({"columns": columns, "rows": rows, **label_pages.index_data(stats)})
        script = (
            "let ready = null; const window = {};\n"
            "const document = {addEventListener(_, f) { ready = f; }, getElementById(id) {"
            f" return id === 'atom-data' ? {{textContent: {json.dumps(data)}}} : null; }}}};\n"
            + LABELS_JS
            + "\nready(); const d = JSON.parse(document.getElementById('atom-data').textContent);"
            "\nconsole.log(JSON.stringify(d.rows.map(r => window.siteIndexHooks.cells(r, d.columns))));"
        )
        out = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=60, check=True).stdout
        cells.append((rows, json.loads(out)))
    (rows, weighted_cells), (_, plain_cells) = cells
    assert [len(row) for row in weighted_cells] == [5, 5] and [len(row) for row in plain_cells] == [4, 4]
    s_w, low, high = rows[0][-3:]  # S_w and its interval, as the index's data holds them
    assert s_w == pytest.approx(label_stats(state, {"images": {}}).weighted.selectivity[0], abs=1e-3)
    assert weighted_cells[0][4] == f'<td>{s_w:.3f} <span class="muted">[{low:.2f}, {high:.2f}]</span></td>'
