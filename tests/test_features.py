"""``python -m sae_pipeline features`` end to end: exact tables, heatmaps of a token subset, MP steps, bad input."""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from features_fixtures import GRID, N_PREFIX, REPLACED, identity_sae, write_export, write_replicas, write_shards
from test_features_labels import check_site_labels
from test_features_topn import brute_force

from sae_pipeline.__main__ import main
from sae_pipeline.artifacts import load_sae
from sae_pipeline.sae import MatchingPursuitSAE, ReLUSAE


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("features")
    tokens, positions = write_shards(root / "shards", root / "images")
    return {
        "root": root,
        "shards": root / "shards",
        "images": root / "images",
        "tokens": tokens,
        "positions": positions,
        "sae": write_export(identity_sae(), root / "sae"),
        "replicas": write_replicas(root),
    }


def run(args: list[str], capsys) -> tuple[int, str]:
    code = main(["features", *args])
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def site(data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site") / "site"
    assert (
        main(
            [
                "features",
                "--sae",
                str(data["sae"]),
                "--data.source",
                str(data["shards"]),
                "--out",
                str(out),
                "--top",
                "4",
                "--data.batch_size",
                "16",
                "--data.num_workers",
                "0",
                "--trainer.accelerator",
                "cpu",
                "--replicas",
                *data["replicas"],
            ]
        )
        == 0
    )
    return out


def test_table_equals_brute_force(data, site) -> None:
    table = np.load(site / "features.npz", allow_pickle=False)
    tokens = data["tokens"]
    codes = np.maximum(tokens, 0)  # the identity SAE
    tpi = len(tokens) // 14
    expected = brute_force(codes, np.arange(len(tokens)) // tpi, n=4)
    got = [
        [(float(v), int(t)) for v, t in zip(table["value"][j], table["token"][j]) if t >= 0]
        for j in range(codes.shape[1])
    ]
    assert got == expected
    assert table["fire_count"].tolist() == (codes != 0).sum(0).tolist()
    np.testing.assert_allclose(table["value_sum"], codes.astype(np.float64).sum(0), rtol=1e-12)
    filled = table["token"] >= 0
    assert (table["position"][filled] == data["positions"][table["token"][filled]]).all()
    assert int(table["n_tokens"]) == len(tokens)


def test_label_statistics_equal_dense_reference(data, site) -> None:
    """Batches of 16 tokens and 9 tokens per image: images straddle batches, each still counted once."""
    tokens = data["tokens"]
    check_site_labels(site, np.maximum(tokens, 0), np.arange(14) % 2, len(tokens) // 14)
    page = (site / "atoms" / "03.html").read_text()
    assert page.count('<svg class="lbar"') == 4 and "selectivity S = 1 − H(q) / log L" in page
    # weighted by activation, beside the counts: S_w with its interval and its line against chance, the formulas
    table = np.load(site / "features.npz", allow_pickle=False)
    low, high = table["label_weighted_selectivity_low"][3], table["label_weighted_selectivity_high"][3]
    assert f"S_w = {table['label_weighted_selectivity'][3]:.3f} (95 % interval {low:.3f}–{high:.3f})" in page
    assert f"n_eff = {table['label_weighted_n_eff'][3]:.1f} equal images" in page
    n = int(np.floor(table["label_weighted_n_eff"][3]))
    assert f"Weighted against chance (approximate): {n} random images would score" in page
    assert "S_w = 1 − H(q_w) / log L" in page and "c_eff[l] = w[l] · n_eff / Σ w" in page
    assert "weighted by activation (Σ a = " in page  # its bar
    index = (site / "index.html").read_text()
    assert 'data-key="weighted_selectivity"' in index and '"weighted_selectivity_low"' in index
    assert (site / "labels" / "1.html").is_file() and "Label class1" in (site / "labels" / "1.html").read_text()


def decode_cards(page: str) -> list[tuple[np.ndarray, int]]:
    return [
        (np.frombuffer(base64.b64decode(heat), np.uint8), int(top))
        for heat, top in re.findall(r'data-heat="([^"]+)" data-top="(\d+)"', page)
    ]


def test_heatmaps_put_each_token_at_its_recorded_position(data, site) -> None:
    table = np.load(site / "features.npz", allow_pickle=False)
    tokens, positions = data["tokens"], data["positions"]
    tpi = len(tokens) // 14
    n_full = N_PREFIX + GRID[0] * GRID[1]
    for atom in (0, 3, 7):
        page = (site / "atoms" / f"{atom:02d}.html").read_text()
        cards = decode_cards(page)
        shown = np.concatenate([table["token"][atom], table["band_token"][atom].reshape(-1)])  # top, then bands
        shown = shown[shown >= 0]
        assert len(cards) == len(shown) > int((table["token"][atom] >= 0).sum()) > 0
        scale = max(float(table["value"][atom][0]), 0.0)
        for (levels, top), token in zip(cards, shown.tolist()):
            image = token // tpi
            rows = slice(image * tpi, (image + 1) * tpi)
            expected = np.full(n_full, 255, np.uint8)
            expected[positions[rows]] = np.round(np.clip(np.maximum(tokens[rows, atom], 0) / scale, 0, 1) * 250)
            assert levels.tolist() == expected.tolist()
            assert top == positions[token]
        # prefix tokens are chips of their own, apart from the grid
        assert page.count('data-i="0">CLS<') == len(cards) and page.count(">R2</span>") == len(cards)
    keys = np.concatenate([table["image"][table["token"] >= 0], table["band_image"][table["band_token"] >= 0]])
    assert len(list((site / "thumbs").glob("*.jpg"))) == len(set(keys.tolist()))


def test_mp_sae_mean_selection_step(tmp_path, capsys) -> None:
    torch.manual_seed(0)
    sae = MatchingPursuitSAE(d_in=64, d_sae=40, k=4, selection="matmul")
    with torch.no_grad():
        sae.W_dec.copy_(torch.nn.functional.normalize(torch.randn(40, 64), dim=1))
    out = tmp_path / "site"
    code, err = run(
        [
            "--sae",
            str(write_export(sae, tmp_path / "mp")),
            "--data.source",
            "digits",
            "--out",
            str(out),
            "--data.num_workers",
            "0",
            "--trainer.accelerator",
            "cpu",
        ],
        capsys,
    )
    assert code == 0, err
    from sklearn.datasets import load_digits

    x = torch.from_numpy(load_digits().data.astype(np.float32) / 16.0)
    indices, _ = load_sae(tmp_path / "mp").pursuit(x)
    step_sum, step_count = np.zeros(40), np.zeros(40)
    for row in indices.tolist():
        for step, atom in enumerate(row, start=1):
            step_sum[atom] += step
            step_count[atom] += 1
    table = np.load(out / "features.npz", allow_pickle=False)
    assert table["step_sum"].tolist() == step_sum.tolist() and table["step_count"].tolist() == step_count.tolist()
    assert "mean MP selection step" in (out / "atoms" / "00.html").read_text()
    codes = load_sae(tmp_path / "mp").codes_from_pursuit(*load_sae(tmp_path / "mp").pursuit(x)).detach().numpy()
    check_site_labels(out, codes, load_digits().target, 1)  # pixel data: labels from the source
    assert sorted(p.name for p in (out / "labels").iterdir()) == sorted(f"{d}.html" for d in range(10))
    assert len(list((out / "atoms" / "img").glob("*.png"))) == 40  # pixel data: the atoms drawn
    # pixel data has image pages too: each shown digit's atoms by value (one token: max = sum), as the pursuit's codes
    sae = load_sae(tmp_path / "mp")
    pages = sorted((out / "images").glob("[0-9]*.html"))
    assert len(pages) >= 10
    for page in pages[:5]:
        row = int(page.stem)
        codes = sae.codes_from_pursuit(*sae.pursuit(x[row : row + 1]))[0].detach()
        expected = sorted((a for a in range(40) if codes[a] > 0), key=lambda a: (-float(codes[a]), a))
        assert expected, row
        section = page.read_text().split('<section class="by-max">', 1)[1].split("</section>", 1)[0]
        assert [int(a) for a in re.findall(r'href="\.\./atoms/\d+\.html">#(\d+)<', section)] == expected, row
        # one token: one ranking, each card the atom's decoder image (not the input again), which exists
        text = page.read_text()
        assert '<section class="by-sum">' not in text and text.count(f"thumbs/{row}.png") == 1, row
        decoders = re.findall(r'class="pixels decoder" alt="atom (\d+)" src="\.\./atoms/img/(\d+)\.png"', section)
        assert [int(a) for a, _ in decoders] == expected and all(a == b for a, b in decoders), row
        assert all((out / "atoms" / "img" / f"{a}.png").is_file() for a, _ in decoders)


def test_bad_input_is_one_line_and_exit_2(data, tmp_path, capsys) -> None:
    base = [
        "--sae",
        str(data["sae"]),
        "--data.source",
        str(data["shards"]),
        "--data.num_workers",
        "0",
        "--trainer.accelerator",
        "cpu",
    ]
    cases = {
        "--top must be an integer >= 1": [*base, "--out", str(tmp_path / "a"), "--top", "0"],
        "--atoms 12: out of range": [*base, "--out", str(tmp_path / "b"), "--atoms", "3", "12"],
        "tokens are 64-d but the SAE takes d_in = 12": [
            "--sae",
            str(data["sae"]),
            "--data.source",
            "digits",
            "--out",
            str(tmp_path / "c"),
        ],
        "not a feature browser site": [*base, "--out", str(data["images"])],
        "pass exactly one of --ckpt_path": ["--data.source", "digits", "--out", str(tmp_path / "d")],
        "--fdr must be a finite number in (0, 1) (a false-discovery rate), got 1.0": [
            *base,
            "--out",
            str(tmp_path / "a"),
            "--fdr",
            "1",
        ],
    }
    for expected, args in cases.items():
        code, err = run(args, capsys)
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1 and expected in lines[0], (expected, err[-2000:])
        assert not (tmp_path / "a").exists()
    # images moved: named, with --images; then --images finds them
    moved = data["root"] / "moved"
    shutil.move(str(data["images"]), moved)
    try:
        code, err = run([*base, "--out", str(tmp_path / "e")], capsys)
        line = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(line) == 1 and "not found" in line[0] and "--images DIR" in line[0]
        assert str(data["images"]) in line[0] and not (tmp_path / "e").exists()
        code, err = run([*base, "--out", str(tmp_path / "e"), "--images", str(moved), "--top", "2"], capsys)
        assert code == 0, err
        assert (tmp_path / "e" / "index.html").is_file()
    finally:
        shutil.move(str(moved), data["images"])


def test_help_shows_every_default() -> None:
    from sae_pipeline.features.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--top TOP top images kept per atom (type: int, default: 16)" in text
    for option in ("--data.source", "--data.batch_size", "--trainer.devices", "--trainer.precision"):
        assert f"as `fit {option}` (default: the config's, else" in text


def test_h5_token_cache_lists_tokens_without_images(data, tmp_path, capsys) -> None:
    from feature_extraction.h5cache import write_token_cache

    tokens = data["tokens"][:60]
    write_token_cache(
        tmp_path / "cache.h5", tokens, image_ids=[f"im{i // 5}" for i in range(60)], token_positions=np.arange(60) % 5
    )
    out = tmp_path / "site"
    code, err = run(
        [
            "--sae",
            str(data["sae"]),
            "--data.source",
            str(tmp_path / "cache.h5"),
            "--out",
            str(out),
            "--top",
            "3",
            "--data.num_workers",
            "0",
            "--trainer.accelerator",
            "cpu",
        ],
        capsys,
    )
    assert code == 0, err
    table = np.load(out / "features.npz")
    assert [
        [(float(v), int(t)) for v, t in zip(table["value"][j], table["token"][j]) if t >= 0] for j in range(12)
    ] == brute_force(np.maximum(tokens, 0), np.arange(60), n=3)  # one token per row: no image grouping
    page = (out / "atoms" / "02.html").read_text()
    best = int(table["token"][2][0])
    assert f"im{best // 5}" in page and f"token {best % 5}" in page and "<img" not in page
    # no labels: the pages say so, the counts are empty, nothing else changes
    assert "carry no labels" in page and "carry no labels" in (out / "index.html").read_text()
    assert table["label_fire"].shape == (12, 0) and int(table["label_images_unlabelled"]) == 60
    assert not (out / "labels").exists() and "label_selectivity" not in table.files
    # no --replicas: no seed counts anywhere
    assert "found_in" not in table.files and "found in" not in page
    assert "found_in" not in (out / "index.html").read_text()
    assert json.loads((out / "features.json").read_text())["replicas"] is None


def test_replicas_found_in_j_of_n_seeds(data, site) -> None:
    """--replicas (an export and a checkpoint): per atom, in how many of the 3 seeds it is found, as the dense
    matching of the decoders says, on its page, in the index and in features.npz."""
    from sae_pipeline.artifacts.checkpoint import read_checkpoint, sae_from_checkpoint
    from sae_pipeline.metrics.dictionary_match import THRESHOLD, match_cosines

    mine = load_sae(data["sae"]).W_dec.detach().double().numpy()
    others = [
        load_sae(data["replicas"][0]).W_dec,
        sae_from_checkpoint(read_checkpoint(data["replicas"][1])).W_dec,
    ]
    cosines = np.stack([match_cosines(mine, w.detach().double().numpy()) for w in others], axis=1)
    table = np.load(site / "features.npz", allow_pickle=False)
    np.testing.assert_allclose(table["replica_cosine"], cosines, atol=1e-6)
    expected = [1 + sum(atom not in lost for lost in REPLACED) for atom in range(12)]
    assert table["found_in"].tolist() == (1 + (cosines >= THRESHOLD).sum(1)).tolist() == expected
    for atom in (0, 3, 7):
        page = (site / "atoms" / f"{atom:02d}.html").read_text()
        assert f"<b>{expected[atom]} of 3 seeds</b>" in page and f"found where ≥ {THRESHOLD}" in page
        assert ", ".join(f"{c:.3f}" for c in cosines[atom]) in page
    index = (site / "index.html").read_text()
    assert 'data-key="found_in"' in index and "found in (of 3 seeds)" in index
    rows = json.loads(re.search(r'id="atom-data">(.*?)</script>', index).group(1).replace("<\\/", "</"))
    at = rows["columns"].index("found_in")
    assert rows["replicas"] == 3 and {row[0]: row[at] for row in rows["rows"]} == dict(enumerate(expected))
    summary = json.loads((site / "features.json").read_text())["replicas"]
    assert summary["n_seeds"] == 3 and summary["found_in_counts"] == {"1": 1, "2": 2, "3": 9}


def test_bad_replicas_are_one_line_and_exit_2(data, tmp_path, capsys) -> None:
    from sae_pipeline.sae import TopKSAE

    wider = write_export(ReLUSAE(d_in=12, d_sae=24), tmp_path / "wider")
    topk = write_export(TopKSAE(d_in=12, d_sae=12, k=2), tmp_path / "topk")
    torch.save({"state_dict": {}, "x": Path("code")}, tmp_path / "pickled.ckpt")  # a pickled object: refused
    cases = {
        "d_sae 24, but the browsed SAE has d_in 12, d_sae 12": [str(wider)],
        "a TopKSAE, but the browsed SAE is a ReLUSAE": [str(topk)],
        "the browsed SAE itself": [str(data["sae"])],
        "given twice": [data["replicas"][0], data["replicas"][0]],
        "not found; pass the other seeds' SAEs": [str(tmp_path / "nowhere")],
        f"--replicas {tmp_path / 'pickled.ckpt'}: not a readable checkpoint": [str(tmp_path / "pickled.ckpt")],
    }
    for expected, replicas in cases.items():
        out = tmp_path / "out"
        code, err = run(
            [
                "--sae",
                str(data["sae"]),
                "--data.source",
                str(data["shards"]),
                "--data.num_workers",
                "0",
                "--trainer.accelerator",
                "cpu",
                "--out",
                str(out),
                "--replicas",
                *replicas,
            ],
            capsys,
        )
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1 and expected in lines[0], (expected, err[-2000:])
        assert "Traceback" not in err and not out.exists()
