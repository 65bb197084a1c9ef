"""``evaluate causal``: every figure of the linear update equals a direct recomputation (zero atom j in the codes,
decode in float64, run the probe) for a k-sparse SAE and MP-SAE on digits and for pooled, two-class shards; the
command writes its files; bad input is one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from features_fixtures import write_export, write_shards

from sae_pipeline.data.sample import read_sample
from sae_pipeline.data.sources import open_source
from sae_pipeline.evaluate import causal
from sae_pipeline.evaluate.__main__ import main
from sae_pipeline.evaluate.probing import pooled, shard_labels
from sae_pipeline.sae import SAE_REGISTRY


@pytest.fixture(autouse=True)
def one_thread() -> object:
    """The probe's solver on one thread: on the shared 2-core box its threads wait on each other (20x slower)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1):
        yield


def random_sae(key: str, d_in: int, d_sae: int = 24, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    sae = SAE_REGISTRY[key](d_in=d_in, d_sae=d_sae, k=4).eval()
    with torch.no_grad():
        sae.b_pre.uniform_(0.0, 0.5)
    return sae


def split(source: object, name: str, val_fraction: float) -> tuple[np.ndarray, np.ndarray, int]:
    """Tokens, one label per image and tokens per image of a split, read apart from the module under test."""
    units = source.units(name, val_fraction)
    x = read_sample(units, sum(unit.n_tokens for unit in units))
    if source.unit_kind == "shards":
        return x, shard_labels(units), units[0].tokens_per_image
    from sklearn.datasets import load_digits

    return x, load_digits().target[np.sort(source.split_rows(name, val_fraction))], 1


@torch.no_grad()
def direct(sae: torch.nn.Module, probe: object, source: object, val_fraction: float, atoms: np.ndarray) -> dict:
    """Each atom's figures recomputed the slow way: dense codes, atom j zeroed, decode, pool, ``probe.predict``."""
    sae64 = copy.deepcopy(sae).double()
    x, labels, per_image = split(source, "val", val_fraction)
    z = sae.encode(torch.from_numpy(x)).double()
    xhat = sae64.decode(z).numpy()
    x = x.astype(np.float64)
    error = ((x - xhat) ** 2).sum(1).mean()
    pred0 = probe.predict(pooled(xhat, per_image))
    column = {c: i for i, c in enumerate(probe.classes_)}
    true = np.array([column.get(label, -1) for label in labels])
    found: dict[str, list] = {key: [] for key in ("drop", "pred", "rise", "changed", "p_after", "fired")}
    for j in atoms:
        zj = z.clone()
        zj[:, j] = 0
        xhat_j = sae64.decode(zj).numpy()
        pred = probe.predict(pooled(xhat_j, per_image))
        found["drop"].append((pred0 == labels).mean() - (pred == labels).mean())
        found["rise"].append(((x - xhat_j) ** 2).sum(1).mean() - error)
        found["changed"].append(np.flatnonzero(pred != pred0))
        found["pred"].append(pred)
        proba = probe.predict_proba(pooled(xhat_j, per_image))
        found["p_after"].append(np.where(true >= 0, proba[np.arange(len(true)), true.clip(0)], 0.0))
        pooled_j = pooled(z[:, j].numpy()[:, None], per_image)  # z̄_ij
        found["fired"].append(pooled_j[:, 0] != 0)
    proba = probe.predict_proba(pooled(xhat, per_image))
    p0 = np.where(true >= 0, proba[np.arange(len(true)), true.clip(0)], 0.0)
    codes = np.stack([pooled(z[:, m].numpy()[:, None], per_image)[:, 0] for m in range(sae.d_sae)], 1)  # z̄ [n, d_sae]
    return {"labels": labels, "pred0": pred0, "p0": p0, "codes": codes, "xhat": pooled(xhat, per_image), **found}


def matched_reference(codes: np.ndarray, i: int, j: int) -> int | None:
    """The other active atom of image i with the closest |z̄| (ties: the nearest in (|z̄|, atom) order, below first)."""
    mine = (abs(codes[i, j]), j)
    others = [(abs(codes[i, m]), m) for m in np.flatnonzero(codes[i]) if m != j]
    if not others:
        return None
    gap = min(abs(key[0] - mine[0]) for key in others)
    closest = [key for key in others if abs(key[0] - mine[0]) == gap]
    below = [key for key in closest if key < mine]
    return max(below)[1] if below else min(closest)[1]


def benjamini_hochberg_reference(p: dict[int, float]) -> dict[int, float]:
    """BH adjusted p-values, written out: q_(r) = min over r' >= r of p_(r') m / r'."""
    ranked = sorted(p, key=lambda a: (p[a], a))
    m = len(ranked)
    return {a: min(1.0, min(p[b] * m / (r + 1) for r, b in enumerate(ranked) if r >= ranked.index(a))) for a in p}


def check_log_p(sae: torch.nn.Module, probe: object, reference: dict, atoms: dict) -> None:
    """The log p(true) drops, the matched baseline, its paired t test and BH, from ``predict_proba`` and scipy."""
    from scipy import stats

    codes, labels, xhat = reference["codes"], reference["labels"], reference["xhat"]
    column = {c: i for i, c in enumerate(probe.classes_)}
    true = np.array([column.get(label, -1) for label in labels])
    D = sae.W_dec.detach().double().numpy()

    def log_p(rows: np.ndarray, moved: np.ndarray) -> np.ndarray:
        if len(rows) == 0:
            return np.zeros(0)
        return np.log(probe.predict_proba(moved)[np.arange(len(rows)), true[rows]])

    p_values = {}
    for j in range(sae.d_sae):
        rows = np.flatnonzero((codes[:, j] != 0) & (true >= 0))
        before = log_p(rows, xhat[rows])
        drop = before - log_p(rows, xhat[rows] - codes[rows, j, None] * D[j])
        assert atoms["n_scored"][j] == len(rows)
        if len(rows) == 0:
            assert atoms["logp_drop"][j] is None
            continue
        assert np.isclose(atoms["logp_drop"][j], drop.mean(), rtol=1e-9, atol=1e-12)
        partners = [matched_reference(codes, i, j) for i in rows]
        keep = np.array([m is not None for m in partners])
        matched = [m for m in partners if m is not None]
        moved = xhat[rows[keep]] - codes[rows[keep], matched, None] * D[matched]
        excess = drop[keep] - (before[keep] - log_p(rows[keep], moved))
        assert atoms["n_matched"][j] == len(excess)
        if len(excess) < 2:
            assert atoms["p"][j] is None and atoms["excess_low"][j] is None
            continue
        assert np.isclose(atoms["excess"][j], excess.mean(), rtol=1e-9, atol=1e-12)
        low, high = stats.t.interval(0.95, len(excess) - 1, excess.mean(), stats.sem(excess))
        assert np.allclose([atoms["excess_low"][j], atoms["excess_high"][j]], [low, high], rtol=1e-7, atol=1e-10)
        p_values[j] = stats.ttest_1samp(excess, 0.0, alternative="greater").pvalue
        assert np.isclose(atoms["p"][j], p_values[j], rtol=1e-6, atol=1e-12)
    assert len(p_values) >= 3  # the test is not between empty sets
    for j, q in benjamini_hochberg_reference(p_values).items():
        assert np.isclose(atoms["q"][j], q, rtol=1e-6, atol=1e-12) and atoms["beats_matched"][j] == (q < 0.05)


@pytest.mark.parametrize("key", ["topk", "mpsae"])
def test_the_linear_update_equals_zeroing_each_atom_and_decoding(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check_against_direct(random_sae(key, 64), open_source("digits"), "digits", 0.1, monkeypatch)


def test_pooled_two_class_shards_equal_the_direct_recomputation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_shards(tmp_path / "shards", tmp_path / "images", n_images=40, shard_size=4)
    source = open_source(str(tmp_path / "shards"))
    check_against_direct(random_sae("topk", 12, d_sae=16), source, str(tmp_path / "shards"), 0.2, monkeypatch)


@torch.no_grad()
def browser_top_labels(sae: torch.nn.Module, source: object, val_fraction: float) -> list:
    """Each atom's top label as the feature browser counts it, over every image (train and validation): the images
    of each label with a nonzero code on one of their tokens, over the label's images; argmax of that rate."""
    fired, labels = [], []
    for name in ("train", "val"):
        x, y, per_image = split(source, name, val_fraction)
        z = sae.encode(torch.from_numpy(x)).numpy()
        fired.append((z.reshape(len(y), per_image, -1) != 0).any(1))
        labels.append(y)
    fired, labels = np.concatenate(fired), np.concatenate(labels)
    values = np.unique(labels)
    rate = np.stack([fired[labels == v].mean(0) for v in values], 1)  # [d_sae, L]
    return [values[np.argmax(r)].item() if r.any() else None for r in rate]


def check_against_direct(sae: torch.nn.Module, source: object, data: str, val_fraction: float, monkeypatch) -> None:
    fitted = []

    def fit(xhat: np.ndarray, labels: np.ndarray) -> object:
        fitted.append(real_fit(xhat, labels))
        return fitted[-1]

    real_fit = causal.fit_probe
    monkeypatch.setattr(causal, "fit_probe", fit)
    result = causal.causal_effects(sae, source, data, val_fraction, None)
    atoms = result["atoms"]
    assert atoms["atom"] == list(range(sae.d_sae))
    reference = direct(sae, fitted[0], source, val_fraction, np.arange(sae.d_sae))
    browser_top = browser_top_labels(sae, source, val_fraction)
    n = result["n_val_images"]
    assert n == len(reference["labels"]) and result["n_val_tokens"] == n * result["tokens_per_image"]
    # counts of images: exactly equal (the drops are counts over n)
    assert np.array_equal(np.round(np.array(atoms["accuracy_drop"]) * n), np.round(np.array(reference["drop"]) * n))
    assert np.allclose(atoms["accuracy_drop"], reference["drop"], rtol=0, atol=1e-12)
    assert atoms["changed"] == [len(c) for c in reference["changed"]]
    assert np.allclose(atoms["error_rise"], reference["rise"], rtol=1e-9, atol=1e-12)
    assert any(abs(r) > 1e-3 for r in atoms["error_rise"])  # the comparison is not between zeros
    assert sum(atoms["changed"]) > 0 and sum(atoms["n_images"]) > 0
    for j in range(sae.d_sae):
        changed = np.isin(np.arange(n), reference["changed"][j])
        p_drop = reference["p0"] - reference["p_after"][j]
        fired = np.flatnonzero(reference["fired"][j])
        # the listed images: of those the atom fires on, changed predictions first, then the largest drop of p(true)
        expected = fired[np.lexsort((-p_drop[fired], ~changed[fired]))][: causal.TOP_IMAGES]
        listed = atoms["images"][j]
        assert [image["index"] for image in listed] == expected.tolist()
        for image in listed:
            assert np.isclose(image["p_true_after"], reference["p_after"][j][image["index"]], rtol=1e-9, atol=1e-12)
            assert (image["before"] != image["after"]) == changed[image["index"]]
        top = atoms["top_label"][j]
        assert top == browser_top[j]
        rows = reference["labels"] == top
        if top is not None and rows.any():  # the same drop over the validation images of the top label only
            lost = (reference["pred0"] == reference["labels"]) & (reference["pred"][j] != reference["labels"])
            gained = (reference["pred0"] != reference["labels"]) & (reference["pred"][j] == reference["labels"])
            assert np.isclose(atoms["top_label_drop"][j], (lost[rows].sum() - gained[rows].sum()) / rows.sum())
    check_log_p(sae, fitted[0], reference, atoms)
    json.dumps(result, allow_nan=False)  # plain JSON


def test_the_command_writes_json_and_markdown_for_chosen_atoms(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_export(random_sae("topk", 64), tmp_path / "sae")
    status = main(["causal", "--sae", str(tmp_path / "sae"), "--data", "digits", "--atoms", "5", "2", "5"])
    assert status == 2 and "--out" in capsys.readouterr().err
    argv = ["causal", "--sae", str(tmp_path / "sae"), "--data", "digits", "--atoms", "5", "2", "5"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "causal.json").read_text())
    assert result["atoms"]["atom"] == [2, 5] and result["d_sae"] == 24 and result["n_val_images"] == 180
    markdown = (tmp_path / "out" / "causal.md").read_text()
    assert "| atom | images | top label | log p drop | matched | excess |" in markdown and "\n| 2 |" in markdown
    assert "## Set ablations" in markdown and len(result["set_ablations"]) == 10
    out = capsys.readouterr().out
    assert "lower the true class's log-probability more than removing a matched other atom" in out
    assert "chance" not in out and "random" not in out


def test_ctrl_c_speaks_of_the_causal_test_and_keeps_earlier_files(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_export(random_sae("topk", 64), tmp_path / "sae")
    out = tmp_path / "out"
    out.mkdir()
    (out / "causal.json").write_text("{}")  # an earlier run's

    def stopped(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(causal, "causal_effects", stopped)
    assert main(["causal", "--sae", str(tmp_path / "sae"), "--data", "digits", "--out", str(out)]) == 130
    line = capsys.readouterr().err.strip()
    assert line.startswith("interrupted (Ctrl-C): the causal test stopped;") and str(out / "causal.json") in line
    words = line.replace(str(out), "OUT").replace("rerun", "")
    assert "rerun the same command" in line and "run" not in words and "checkpoint" not in words
    assert (out / "causal.json").read_text() == "{}" and not (out / "causal.md").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sae", "{tmp}/missing"], "--sae {tmp}/missing: not a directory; pass an export"),
        (["--sae", "{tmp}/sae", "--atoms", "24"], "--atoms 24: out of range for the SAE in {tmp}/sae (d_sae = 24)"),
        (["--sae", "{tmp}/sae", "--atoms", "-1"], "--atoms -1: out of range"),
        (["--sae", "{tmp}/sae", "--data", "{tmp}/tokens.h5"], "probing needs class labels"),
        (["--sae", "{tmp}/sae", "--val_fraction", "0"], "--val_fraction"),
    ],
)
def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, args: list, message: str) -> None:
    from feature_extraction.h5cache import write_token_cache

    write_export(random_sae("topk", 64), tmp_path / "sae")
    write_token_cache(tmp_path / "tokens.h5", np.zeros((4, 64), np.float32))
    argv = ["causal", *(a.format(tmp=tmp_path) for a in args), "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message.format(tmp=tmp_path) in err, err
    assert not (tmp_path / "out" / "causal.json").exists()


@pytest.mark.slow
def test_benchmark_dry_run_measures_both_ways_and_they_agree() -> None:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.causal", "--dry-run"], capture_output=True, text=True, timeout=600, cwd=repo
    )
    assert result.returncode == 0, result.stderr[-3000:]
    row = [cell.strip() for cell in result.stdout.splitlines()[-1].strip("|").split("|")]
    assert row[:5] == ["16", "64", "4", "300", "3"] and row[-1] == "equal", result.stdout
    assert float(row[5].removesuffix(" s")) > 0 and float(row[8].removesuffix(" s")) > 0


def test_images_changed_most_lists_only_changed_predictions() -> None:
    """The per-atom image list fills up with unchanged images (by log p drop) when few predictions changed; the
    "images changed most" cell shows only those whose prediction the ablation changed."""
    from sae_pipeline.evaluate.causal_report import changed_images

    images = [
        {"id": "a.png", "label": 3, "before": 3, "after": 5},
        {"id": "b.png", "label": 1, "before": 1, "after": 1},
        {"id": "c.png", "label": 2, "before": 7, "after": 2},
    ]
    assert changed_images(images) == "a.png (3: 3 → 5), c.png (2: 7 → 2)"
    assert changed_images(images[1:2]) == ""
