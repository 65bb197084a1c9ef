"""Sparse probing (SAEBench's k-sparse probing) on labelled images: how much of a class k latents hold.

For each class as a one-vs-rest task: a balanced set (every row of the class and as many others, drawn
evenly from the other classes with a fixed seed) of the training split and of the validation split;
the k latents with the largest |mean over the class − mean over the others| on the balanced
training set; scikit-learn's ``LogisticRegression`` (L2, C = 1, ``max_iter`` 1000, no rescaling) fitted on
those k latents; its accuracy on the balanced validation set. The same probe on the raw inputs gives the
references: all dimensions, and the k best single dimensions by the same mean difference. Every model and the
raw inputs also get the probes on all their columns (evaluate/linear_probe.py: scikit-learn's, and SAEBench's
own all-dimensions probe). Each SAE's figure is the mean over ``--seeds`` draws of the balanced tasks (their
spread its Monte-Carlo error), a variant's the mean over its ``--sae_seeds`` SAEs with a 95 % interval over them,
and variants are compared over those seeds, never over draws (evaluate/probe_stats.py).

What matches SAEBench (``evals/sparse_probing``): the balancing, the |mean difference| selection on the
training set, the classifier and its settings, accuracy on a balanced held-out set, k = 1, 2, 5 (20 added),
the all-dimensions probe.
What differs: the data are images (one row each, or a shard directory's tokens mean-pooled per image, labels
from its meta.json), the split is the run's own train/validation split (4500 / 500 rows on ``mnist_sample``:
about 900 / 100 rows per task, not 4000 / 1000), and the codes are what the SAE computes (``encode``:
matching pursuit for MP-SAE) on the raw inputs.

The study also records each run's R² on its own training rows, beside the held-out one (the same rows
are encoded): the paper authors' MNIST dictionary was trained on rows that ``mnist_sample`` holds, so
its R² there is in-sample, and ours on the training rows is the like-for-like number.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from sae_pipeline.artifacts import load_sae
from sae_pipeline.data import ActivationDataModule
from sae_pipeline.evaluate.data_flags import EVALUATE_FLAGS
from sae_pipeline.evaluate.linear_probe import probe_accuracy, saebench_all_probe_accuracy
from sae_pipeline.evaluate.probe_stats import compare_models, summarise_draws, summarise_replicas
from sae_pipeline.evaluate.runs import RunSpec
from sae_pipeline.evaluate.studies import datamodule_for, load_tokens, reconstruction_r2

PROBE_KS = (1, 2, 5, 20)
LABELLED_SOURCES = ("digits", "mnist_sample", "mnist")
PROBE_SEED = 0  # the first draw of the negative rows: the same tasks for every run and reference
PROBE_SEEDS = 5  # draws per study (`--seeds`): enough for a t-interval, ~5x one draw's probing time
_CHUNK = 4096


def check_labelled(source: str) -> None:
    """One-line error for data without class labels (before anything is written)."""
    if source in LABELLED_SOURCES or _first_shard_label(source) is not None:
        return
    raise ValueError(
        f"--data {source}: probing needs class labels, which only {', '.join(LABELLED_SOURCES)} and shard "
        "directories whose meta.json carries 'label' have; pass one of them"
    )


def _first_shard_label(source: str) -> Any:
    """The ``label`` of the first image of a shard directory, or None (no shards, or no label)."""
    from feature_extraction.shards import MANIFEST_FNAME, iter_shard_samples, load_manifest, shard_fpaths
    from feature_extraction.store import location

    dpath = location(source, "--data")
    if not (dpath / MANIFEST_FNAME).is_file():
        return None
    fpaths = shard_fpaths(dpath, load_manifest(dpath))
    for _, _, meta in iter_shard_samples(fpaths[:1]):
        return meta.get("label")
    return None


def shard_labels(units: list) -> np.ndarray:
    """The ``label`` in each image's meta.json, over the shards in ``units`` in order (one per image)."""
    from feature_extraction.shards import iter_shard_samples

    labels = []
    for _, _, meta in iter_shard_samples([unit.fpath for unit in units]):
        if "label" not in meta:
            raise ValueError("probing: an image's meta.json has no 'label'; every image needs one")
        labels.append(meta["label"])
    return np.asarray(labels)


def source_labels(source: str, data_dpath: str | None) -> np.ndarray:
    """The class of every row of ``source``, in the source's row order."""
    if source == "digits":
        from sklearn.datasets import load_digits

        return load_digits().target
    if source == "mnist_sample":
        from sae_pipeline.data.mnist import load_mnist_sample

        return load_mnist_sample(with_labels=True, flags=EVALUATE_FLAGS)[1]
    if source == "mnist":
        from sae_pipeline.data.mnist import load_mnist

        return load_mnist(data_dpath or "data", allow_download=False, with_labels=True, flags=EVALUATE_FLAGS)[1]
    check_labelled(source)
    raise AssertionError(source)


def check_classes(spec: RunSpec) -> None:
    """One-line error, before anything trains, for data whose splits do not hold two classes to tell apart."""
    labels = split_labels(spec)
    probe_tasks(labels["train"][0], labels["val"][0], spec.source)


def probe_tasks(
    train_labels: np.ndarray, val_labels: np.ndarray, source: str, seed: int = PROBE_SEED
) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], dict[int, tuple[np.ndarray, np.ndarray]]]:
    """The balanced tasks of both splits (drawn with ``seed``); a one-line error when no class has a task in both."""
    train_tasks, val_tasks = balanced_tasks(train_labels, seed), balanced_tasks(val_labels, seed)
    if not set(train_tasks) & set(val_tasks):
        raise ValueError(
            f"--data {source}: probing needs two classes or more in both the training and the validation split "
            f"(found {len(np.unique(train_labels))} and {len(np.unique(val_labels))}); pass labelled data of "
            "several classes"
        )
    return train_tasks, val_tasks


def balanced_tasks(labels: np.ndarray, seed: int = PROBE_SEED) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per class: ``(row indices, 0/1 targets)`` of its balanced one-vs-rest set (SAEBench's balancing)."""
    rng = np.random.default_rng(seed)
    tasks = {}
    classes = np.unique(labels)
    if len(classes) < 2:
        return {}
    for label in classes:
        positive = np.flatnonzero(labels == label)
        others = [c for c in classes if c != label]
        per_class = math.ceil(len(positive) / len(others))
        pool = np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:per_class] for c in others])
        negative = rng.permutation(pool)[: len(positive)]
        rows = np.concatenate([positive, negative])
        targets = np.concatenate([np.ones(len(positive), np.int64), np.zeros(len(negative), np.int64)])
        order = rng.permutation(len(rows))
        tasks[label.item()] = (rows[order], targets[order])
    return tasks


def top_k_mean_difference(x: np.ndarray, y: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` columns of ``x`` whose mean differs most between ``y == 1`` and ``y == 0`` (stable ties)."""
    difference = np.abs(x[y == 1].mean(axis=0, dtype=np.float64) - x[y == 0].mean(axis=0, dtype=np.float64))
    return np.argsort(-difference, kind="stable")[:k]


def sparse_probing(
    train_x: np.ndarray,
    train_tasks: dict[int, tuple[np.ndarray, np.ndarray]],
    test_x: np.ndarray,
    test_tasks: dict[int, tuple[np.ndarray, np.ndarray]],
    ks: list[int],
    with_all: bool = False,
    seed: int = PROBE_SEED,
) -> dict[str, Any]:
    """Accuracy per class and k (top-k by mean difference on the training set), and its mean over classes.

    ``with_all`` adds the probes on every column: scikit-learn's (key ``"all"``) and SAEBench's own
    all-dimensions probe (``"all_saebench"``, evaluate/linear_probe.py; ``seed`` draws its init and batches).
    ``n_columns`` says how many columns there were: a k above it uses them all, so its figure is the
    all-columns one (the report says so).
    """
    keys = [str(k) for k in ks] + (["all", "all_saebench"] if with_all else [])
    by_label: dict[str, dict[str, float]] = {}
    for label, (rows, y) in train_tasks.items():
        if label not in test_tasks:
            continue  # a class without validation rows: no held-out accuracy
        test_rows, test_y = test_tasks[label]
        x_task, x_test = train_x[rows], test_x[test_rows]
        accuracies = {}
        for k in ks:
            chosen = top_k_mean_difference(x_task, y, min(k, x_task.shape[1]))
            accuracies[str(k)] = probe_accuracy(x_task[:, chosen], y, x_test[:, chosen], test_y)
        if with_all:
            accuracies["all"] = probe_accuracy(x_task, y, x_test, test_y)
            accuracies["all_saebench"] = saebench_all_probe_accuracy(x_task, y, x_test, test_y, seed)
        by_label[str(label)] = accuracies
    mean = {key: float(np.mean([accuracies[key] for accuracies in by_label.values()])) for key in keys}
    return {"ks": list(ks), "mean": mean, "by_label": by_label, "n_columns": int(train_x.shape[1])}


@torch.no_grad()
def encode_images(sae: torch.nn.Module, x: torch.Tensor, per_image: int = 1) -> np.ndarray:
    """The codes the SAE computes (``encode``: matching pursuit for MP-SAE), mean-pooled over each image's
    ``per_image`` consecutive tokens chunk by chunk (the token codes are never all in memory), float32 ``[n, p]``."""
    size = per_image * max(1, _CHUNK // per_image)
    return np.concatenate([pooled(sae.encode(chunk).float().numpy(), per_image) for chunk in x.split(size)])


def split_data(spec: RunSpec) -> dict[str, tuple[torch.Tensor, np.ndarray, int]]:
    """``{"train": (tokens, labels, tokens per image), "val": ...}``: the run's own split, in reading order.

    A row source has one token per image; a shard directory ``tokens_per_image`` (whose codes and inputs are
    mean-pooled per image, as SAEBench pools a text's tokens).
    """
    datamodule = datamodule_for(spec)
    found = {}
    for split, (labels, per_image) in split_labels(spec, datamodule).items():
        x = load_tokens(datamodule, split)
        if len(labels) * per_image != x.shape[0]:
            raise RuntimeError(f"{spec.source}: {x.shape[0]} {split} tokens read, {len(labels)} images labelled")
        found[split] = (x, labels, per_image)
    return found


def split_labels(spec: RunSpec, datamodule: ActivationDataModule | None = None) -> dict[str, tuple[np.ndarray, int]]:
    """``{"train": (one label per image, tokens per image), "val": ...}`` of the run's own split, in reading order,
    without reading the tokens of a row source (a shard directory's are read with their meta.json)."""
    datamodule = datamodule or datamodule_for(spec)
    source = datamodule.data_source
    found = {}
    for split in ("train", "val"):
        if source.unit_kind == "shards":
            units = source.units(split, datamodule.val_fraction)
            found[split] = (shard_labels(units), units[0].tokens_per_image if units else 1)
        else:
            rows = np.sort(source.split_rows(split, datamodule.val_fraction))
            found[split] = (source_labels(spec.source, spec.data_dpath)[rows], 1)
    return found


def pooled(values: np.ndarray, per_image: int) -> np.ndarray:
    """The mean over each image's ``per_image`` consecutive tokens."""
    return values.reshape(-1, per_image, values.shape[1]).mean(axis=1) if per_image > 1 else values


def probing_study(
    specs: list[RunSpec], out_dpath: Path, ks: list[int], with_reference: bool = True, seeds: int = PROBE_SEEDS
) -> dict[str, Any]:
    """Sparse probing of every run in ``specs`` (each variant's SAE seeds, same data), of the raw inputs and (on
    MNIST) of the paper authors' dictionary, over ``seeds`` draws of the balanced tasks per SAE: each SAE's
    figure is its mean over the draws (their spread its Monte-Carlo error), a variant's the mean over its SAE
    seeds, and variants are compared over those seeds (evaluate/probe_stats.py)."""
    data = split_data(specs[0])
    (train_x, train_labels, per_image), (val_x, val_labels, _) = data["train"], data["val"]
    draws = [probe_tasks(train_labels, val_labels, specs[0].source, PROBE_SEED + s) for s in range(seeds)]
    train_tasks, val_tasks = draws[0]
    replicas: dict[str, list[RunSpec]] = {}
    for spec in specs:
        replicas.setdefault(spec.variant, []).append(spec)

    # (model, SAE seed or None, train features, validation features)
    features: list[tuple[str, RunSpec | None, np.ndarray, np.ndarray]] = [
        ("raw", None, pooled(train_x.numpy(), per_image), pooled(val_x.numpy(), per_image))
    ]
    entries: dict[str, dict[str, Any]] = {"raw": {}}
    for variant, runs in replicas.items():
        entries[variant] = {"run": runs[0].name, "k": runs[0].k, "p": runs[0].p, "sae_seeds": []}
        for spec in runs:
            sae = load_sae(Path(out_dpath) / "models" / spec.name)
            features.append(
                (variant, spec, encode_images(sae, train_x, per_image), encode_images(sae, val_x, per_image))
            )
            r2 = {"r2_train": reconstruction_r2(sae, train_x), "r2_val": reconstruction_r2(sae, val_x)}
            entries[variant]["sae_seeds"].append({"seed": spec.seed, "run": spec.name, **r2})
        for key in ("r2_train", "r2_val"):
            entries[variant][key] = float(np.mean([r[key] for r in entries[variant]["sae_seeds"]]))
    if with_reference and train_x.shape[1] == 784:
        from sae_pipeline.evaluate.external import REFERENCE_NPZ_FPATH, load_npz_dictionary

        sae = load_npz_dictionary(REFERENCE_NPZ_FPATH, k=10)
        features.append(
            ("reference", None, encode_images(sae, train_x, per_image), encode_images(sae, val_x, per_image))
        )
        entries["reference"] = {"npz": REFERENCE_NPZ_FPATH.name, "k": 10, "p": sae.d_sae}
        entries["reference"].update(r2_train=reconstruction_r2(sae, train_x), r2_val=reconstruction_r2(sae, val_x))

    summaries: dict[str, list[dict[str, Any]]] = {}
    with tqdm(total=seeds * len(features), desc="probing", unit="model", dynamic_ncols=True, leave=False) as bar:
        for name, spec, train, val in features:
            by_draw = []
            for s, (train_tasks_s, val_tasks_s) in enumerate(draws):
                by_draw.append(sparse_probing(train, train_tasks_s, val, val_tasks_s, ks, True, PROBE_SEED + s))
                bar.update()
            summary = summarise_draws([{"mean": d["mean"], "by_label": d["by_label"]} for d in by_draw])
            summaries.setdefault(name, []).append(summary)
            if spec is None or spec.seed == replicas[name][0].seed:  # the first SAE's draws, kept whole
                entries[name].update(
                    ks=list(ks),
                    n_columns=by_draw[0]["n_columns"],
                    by_draw=[{"mean": d["mean"], "by_label": d["by_label"]} for d in by_draw],
                )
            if spec is not None:
                seed_entry = next(r for r in entries[name]["sae_seeds"] if r["seed"] == spec.seed)
                seed_entry.update(mean=summary["mean"], mc_error=summary["mc_error"])
    for name, found in summaries.items():
        summarise_replicas(entries[name], found)

    variants = {variant: entries[variant] for variant in replicas}
    keys = [str(k) for k in ks] + ["all", "all_saebench"]
    n_sae_seeds = min(len(runs) for runs in replicas.values())
    result: dict[str, Any] = {
        "ks": list(ks),
        "seeds": seeds,
        "draws": seeds,
        "sae_seeds": n_sae_seeds,
        "labels": sorted(set(train_tasks) & set(val_tasks)),
        "n_train_rows": len(train_labels),
        "n_val_rows": len(val_labels),
        "tokens_per_image": per_image,
        "task_rows": {
            "train": {str(c): len(rows) for c, (rows, _) in train_tasks.items() if c in val_tasks},
            "val": {str(c): len(rows) for c, (rows, _) in val_tasks.items() if c in train_tasks},
        },
        "raw": entries["raw"],
        "variants": variants,
        "comparisons": compare_models(variants, keys) if n_sae_seeds > 1 else [],
    }
    if "reference" in entries:
        result["reference"] = entries["reference"]
    return result
