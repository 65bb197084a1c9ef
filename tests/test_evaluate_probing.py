"""Sparse probing (``python -m sae_pipeline.evaluate probing``): the probe against a plain reference.

The end-to-end run over the study's tiny runs is in tests/test_evaluate.py (it reuses that file's study).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from sae_pipeline.evaluate.__main__ import main
from sae_pipeline.evaluate.probing import balanced_tasks, sparse_probing


def plain_probe(x_train, y_train, x_test, y_test, k):
    """SAEBench's recipe written out: |mean over class 1 - mean over class 0| per column, the k largest, sklearn."""
    d = x_train.shape[1]
    positive, negative = x_train[y_train == 1], x_train[y_train == 0]
    difference = [abs(sum(positive[:, j]) / len(positive) - sum(negative[:, j]) / len(negative)) for j in range(d)]
    chosen = sorted(range(d), key=lambda j: -difference[j])[:k]
    probe = LogisticRegression(C=1.0, max_iter=1000).fit(x_train[:, chosen], y_train)
    return float(np.mean(probe.predict(x_test[:, chosen]) == y_test)), set(chosen)


def planted(rng, n, n_classes, d):
    """Rows whose class shows in columns 3 * c (strongly) and 3 * c + 1 (less); the rest is noise."""
    labels = rng.integers(0, n_classes, n)
    x = rng.normal(size=(n, d))
    x[np.arange(n), 3 * labels] += 2.0
    x[np.arange(n), 3 * labels + 1] += 1.2
    return x.astype(np.float32), labels


def test_balanced_tasks_hold_each_class_and_as_many_others_drawn_evenly() -> None:
    labels = np.random.default_rng(1).integers(0, 4, 203)
    tasks = balanced_tasks(labels)
    assert sorted(tasks) == [0, 1, 2, 3]
    for label, (rows, y) in tasks.items():
        positive = np.flatnonzero(labels == label)
        assert len(set(rows)) == len(rows) == 2 * len(positive)
        assert set(rows[y == 1]) == set(positive) and (labels[rows[y == 0]] != label).all()
        per_class = np.delete(np.bincount(labels[rows[y == 0]], minlength=4), label)
        assert per_class.max() <= math.ceil(len(positive) / 3) and per_class.min() >= 1
    assert all((a[0] == b[0]).all() for a, b in zip(tasks.values(), balanced_tasks(labels).values()))  # seeded


def test_probe_matches_plain_selection_and_scikit_learn() -> None:
    rng = np.random.default_rng(0)
    x_train, train_labels = planted(rng, 400, 4, 24)
    x_test, test_labels = planted(rng, 120, 4, 24)
    train_tasks, test_tasks = balanced_tasks(train_labels), balanced_tasks(test_labels)
    ks = [1, 2, 5]
    found = sparse_probing(x_train, train_tasks, x_test, test_tasks, ks, with_all=True)
    for label, (rows, y) in train_tasks.items():
        test_rows, test_y = test_tasks[label]
        for k in ks:
            accuracy, chosen = plain_probe(x_train[rows], y, x_test[test_rows], test_y, k)
            assert found["by_label"][str(label)][str(k)] == pytest.approx(accuracy, abs=1e-12)
            if k == 2:
                assert chosen == {3 * label, 3 * label + 1}  # the planted columns are the ones selected
        accuracy, _ = plain_probe(x_train[rows], y, x_test[test_rows], test_y, 24)
        assert found["by_label"][str(label)]["all"] == pytest.approx(accuracy, abs=1e-12)
    for key in ("1", "2", "5", "all"):
        assert found["mean"][key] == pytest.approx(np.mean([a[key] for a in found["by_label"].values()]))
    assert found["mean"]["1"] > 0.8 and found["mean"]["2"] >= found["mean"]["1"] - 0.02  # signal, not chance


def test_unlabelled_data_is_one_line_and_writes_nothing(tmp_path, capsys) -> None:
    cache = tmp_path / "tokens.h5"
    cache.write_bytes(b"")  # an existing token cache passes the source check; it carries no labels
    out = tmp_path / "out"
    assert main(["probing", "--data", str(cache), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert "probing needs class labels" in err and "digits, mnist_sample, mnist" in err
    assert not out.exists()


def test_report_puts_the_in_sample_note_and_the_training_rows_r2_beside_the_reference(tmp_path) -> None:
    from sae_pipeline.evaluate.report import IN_SAMPLE_NOTE, report_markdown

    curve = {"ks": [2], "r2": [0.5]}
    model = {"r2": 0.5, "inference": curve, "babel_dict": [0.1, 0.2], "babel_coactive": [0.1, 0.2]}
    accuracies = {"ks": [1, 2], "mean": {"1": 0.6, "2": 0.7, "all": 0.9}, "by_label": {}}
    results = {
        "runs": {"mpsae_p8_k2": model},
        "reference": {"npz": "a.npz", "p": 8, "k": 2, "n_eval_tokens": 10, "same_rows_as": "mpsae_p8_k2", **model},
        "probing": {
            "ks": [1, 2],
            "labels": [0, 1],
            "n_train_rows": 40,
            "n_val_rows": 10,
            "task_rows": {"train": {"0": 20, "1": 20}, "val": {"0": 4, "1": 6}},
            "raw": accuracies,
            "variants": {"mpsae": {**accuracies, "k": 2, "p": 8, "r2_train": 0.812, "r2_val": 0.5}},
            "reference": {**accuracies, "k": 2, "p": 8, "r2_train": 0.934, "r2_val": 0.921},
        },
    }
    report = report_markdown(results, tmp_path)
    reference = report[report.index("## Our MP-SAE vs the paper's") : report.index("## Sparse probing")]
    assert IN_SAMPLE_NOTE in reference and "training rows: the probing section" in reference
    probing = report[report.index("## Sparse probing") :]
    assert "| MP-SAE | 2, 8 | 0.600 | 0.700 | 0.900 |" in probing  # one draw (no seeds): no interval
    assert "| raw inputs (k best dimensions; all) | – | 0.600 | 0.700 | 0.900 |" in probing
    assert (
        "| MP-SAE | 2, 8 | 0.812 | 0.500 |" in probing
        and "| MP-SAE (paper authors) | 2, 8 | 0.934 | 0.921 |" in probing
    )
    assert "both its R² are in-sample" in probing


# --- issue 31, item 14: labels checked before training; k above the columns noted; evaluate's own flags ----------
def no_training(monkeypatch) -> None:
    """Any training run fails the test: the refusals below must come before the first one."""
    from sae_pipeline.evaluate import run_training

    def ensure_runs(*args, **kwargs):
        raise AssertionError("a run was trained before the input was refused")

    monkeypatch.setattr(run_training, "ensure_runs", ensure_runs)


def test_data_of_one_class_is_refused_before_any_run_trains(tmp_path, capsys, monkeypatch, token_shards) -> None:
    no_training(monkeypatch)
    shards = tmp_path / "shards"
    token_shards(shards, [1] * 5, 8)  # one image per shard, each its shard's image 0: every label is 0
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "topk_tiny.yaml").write_text(
        "model: {sae: {class_path: sae_pipeline.sae.TopKSAE, init_args: {d_sae: 16, k: 2}}}\n"
        "data: {source: x, batch_size: 8, num_workers: 0, val_fraction: 0.2}\n"
    )
    out = tmp_path / "out"
    grid = ["--variants", "topk", "--k", "2", "--k_main", "2", "--p", "16", "--p_main", "16"]
    assert main(["probing", "--data", str(shards), "--out", str(out), "--config_dir", str(configs), *grid]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: --data {shards}: probing needs two classes or more in both the training and the validation "
        "split (found 1 and 1); pass labelled data of several classes"
    )
    assert not out.exists()


@pytest.mark.parametrize("command", ["probing", "dictionary"])
def test_offline_mnist_advice_names_evaluates_own_flags(command, tmp_path, capsys, monkeypatch) -> None:
    """evaluate has --data and --data_dpath, not fit's --data.data_dpath / --data.allow_download."""
    no_training(monkeypatch)
    empty, out = tmp_path / "empty", tmp_path / "out"
    empty.mkdir()
    extra = ["--npz", "authors"] if command == "dictionary" else []
    assert main([command, "--data", "mnist", "--data_dpath", str(empty), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: mnist: not found under --data_dpath={empty} (expected MNIST/raw/)"), err
    assert "\n" not in err and "--data." not in err and "--data mnist_sample" in err
    assert not out.exists()


def test_a_probe_k_above_the_columns_is_noted(tmp_path) -> None:
    from sae_pipeline.evaluate.probing_report import ABOVE_COLUMNS_NOTE, probing_section

    rng = np.random.default_rng(0)
    x_train, train_labels = planted(rng, 200, 3, 12)
    x_test, test_labels = planted(rng, 60, 3, 12)
    raw = sparse_probing(x_train, balanced_tasks(train_labels), x_test, balanced_tasks(test_labels), [2, 30], True)
    assert raw["n_columns"] == 12 and raw["mean"]["30"] == raw["mean"]["all"]  # k = 30 used all 12 columns
    model = {**raw, "n_columns": 64, "k": 2, "p": 64}  # a model with 64 latents: k = 30 is a k-sparse probe
    study = {"ks": [2, 30], "labels": [0, 1, 2], "n_train_rows": 200, "n_val_rows": 60, "raw": raw}
    study.update(task_rows={"train": {"0": 1, "1": 1, "2": 1}, "val": {"0": 1, "1": 1, "2": 1}})
    study["variants"] = {"topk": {**model, "r2_train": 0.5, "r2_val": 0.5}}
    lines = probing_section(study)
    (raw_row,) = [line for line in lines if line.startswith("| raw inputs")]
    model_row = next(line for line in lines if line.startswith("| TopK"))  # the accuracies (then the R² table)
    assert f"| {raw['mean']['30']:.3f} (all 12) |" in raw_row and "(all" not in model_row
    assert ABOVE_COLUMNS_NOTE in lines
