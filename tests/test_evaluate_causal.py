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
    others = causal.random_atoms(sae.d_sae)
    found: dict[str, list] = {key: [] for key in ("drop", "pred", "rise", "changed", "p_after", "random_max", "fired")}
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
        random_drops = []
        for m in others[j]:
            moved = pooled(xhat, per_image) - pooled_j * sae64.W_dec[m].detach().numpy()
            random_drops.append((pred0 == labels).mean() - (probe.predict(moved) == labels).mean())
        found["random_max"].append(max(random_drops))
    proba = probe.predict_proba(pooled(xhat, per_image))
    p0 = np.where(true >= 0, proba[np.arange(len(true)), true.clip(0)], 0.0)
    return {"labels": labels, "pred0": pred0, "p0": p0, **found}


@pytest.mark.parametrize("key", ["topk", "mpsae"])
def test_the_linear_update_equals_zeroing_each_atom_and_decoding(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check_against_direct(random_sae(key, 64), open_source("digits"), "digits", 0.1, monkeypatch)


def test_pooled_two_class_shards_equal_the_direct_recomputation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_shards(tmp_path / "shards", tmp_path / "images", n_images=40, shard_size=4)
    source = open_source(str(tmp_path / "shards"))
    check_against_direct(random_sae("topk", 12, d_sae=16), source, str(tmp_path / "shards"), 0.2, monkeypatch)


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
    n = result["n_val_images"]
    assert n == len(reference["labels"]) and result["n_val_tokens"] == n * result["tokens_per_image"]
    # counts of images: exactly equal (the drops are counts over n)
    assert np.array_equal(np.round(np.array(atoms["accuracy_drop"]) * n), np.round(np.array(reference["drop"]) * n))
    assert np.allclose(atoms["accuracy_drop"], reference["drop"], rtol=0, atol=1e-12)
    assert atoms["changed"] == [len(c) for c in reference["changed"]]
    assert np.allclose(atoms["random_drop_max"], reference["random_max"], rtol=0, atol=1e-12)
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
        assert (top is None) == (len(fired) == 0)
        if top is not None:  # the same drop over the images of the top label only
            rows = reference["labels"] == top
            lost = (reference["pred0"] == reference["labels"]) & (reference["pred"][j] != reference["labels"])
            gained = (reference["pred0"] != reference["labels"]) & (reference["pred"][j] == reference["labels"])
            assert np.isclose(atoms["top_label_drop"][j], (lost[rows].sum() - gained[rows].sum()) / rows.sum())
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
    assert "| atom | images | top label | accuracy drop |" in markdown and "\n| 2 |" in markdown
    assert "firing atoms drop the probe's accuracy" in capsys.readouterr().out


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
