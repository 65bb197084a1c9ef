"""The study's numbers: evaluate each exported run, then gather them per study (paper Figs. 2-5).

Each run is evaluated from its export (``load_sae``: raw units, input scale folded in) on the
*whole* validation split of the data it was trained on, built by the same
``ActivationDataModule`` with the config's ``data`` settings, so its R² is the ``val/r2``
that training logged at its last step (R² does not change when inputs and reconstructions
share a scale; the test checks the agreement to 1e-5). Babel curves, the inference-time sweep
and the activation statistics come from :func:`sae_pipeline.metrics.measure.evaluate_sae`.

Studies (names as in the CLI):

- ``expressivity``: R² and measured L0 against k at p = p_main, and against p at k = k_main;
- ``inference``: R² against the inference k for models trained at each k (p = p_main);
- ``coherence``: Babel μ₁(r) of the dictionary and of the co-activated atoms (k_main, p_main),
  and the co-active coherence controlled for support size (:mod:`.coherence`);
- ``concepts``: per-atom statistics of the k_main / p_main models (see :mod:`.concepts`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sae_pipeline.artifacts import load_sae
from sae_pipeline.data import ActivationDataModule
from sae_pipeline.data.sample import read_sample
from sae_pipeline.evaluate import concepts
from sae_pipeline.evaluate.coherence import support_coherence
from sae_pipeline.evaluate.runs import RUN_FNAME, STUDIES, RunSpec, log_dpath, read_run_record
from sae_pipeline.metrics import ReconstructionR2, evaluate_sae
from sae_pipeline.sae import SparseAutoencoder

__all__ = ["STUDIES", "coherence", "evaluate_concepts", "evaluate_run", "expressivity", "inference"]
_CHUNK = 4096


def datamodule_for(spec: RunSpec) -> ActivationDataModule:
    """The data module of the run's config (its split), read in the main process."""
    data = dict(spec.config().get("data") or {})
    data.update(source=spec.source, num_workers=0)
    if spec.data_dpath is not None:
        data["data_dpath"] = spec.data_dpath
    data.pop("allow_download", None)
    return ActivationDataModule(**data)


def load_tokens(datamodule: ActivationDataModule, split: str, max_tokens: int | None = None) -> torch.Tensor:
    """All tokens of ``split`` (``val`` or ``all``), or an even sample of ``max_tokens`` of them, float32."""
    if split == "val" and datamodule.val_fraction == 0:
        raise ValueError(
            "the config sets data.val_fraction: 0, so there is no validation split to evaluate on; "
            "set it > 0 in the config"
        )
    units = datamodule.data_source.units(split, datamodule.val_fraction)
    total = sum(unit.n_tokens for unit in units)
    return torch.from_numpy(read_sample(units, min(total, max_tokens or total)))


@torch.no_grad()
def reconstruction_r2(sae: SparseAutoencoder, x: torch.Tensor) -> float:
    """R² of the model as trained (``forward``), accumulated like the training's ``val/r2``."""
    metric = ReconstructionR2(sae.d_in, sync_on_compute=False)
    for chunk in x.split(_CHUNK):
        metric.update(chunk, sae(chunk).x_hat)
    return float(metric.compute())


def logged_metrics(spec: RunSpec, out_dpath: Path) -> dict[str, Any]:
    """The last ``val/r2`` and ``val/l0`` the run wrote to TensorBoard, with their step."""
    accumulator = EventAccumulator(str(log_dpath(spec, out_dpath)), size_guidance={"scalars": 0})
    accumulator.Reload()
    found = {}
    for tag in ("val/r2", "val/l0"):
        if tag in accumulator.Tags()["scalars"]:
            event = accumulator.Scalars(tag)[-1]
            found[tag] = {"step": int(event.step), "value": float(event.value)}
    return found


@torch.no_grad()
def row_errors(sae: SparseAutoencoder, x: torch.Tensor) -> np.ndarray:
    """Σ_d (x − x̂)² of each row, float64: what the bootstrap over validation rows resamples (`.seed_stats`)."""
    return np.concatenate(
        [(chunk.double() - sae(chunk).x_hat.double()).square().sum(dim=1).numpy() for chunk in x.split(_CHUNK)]
    )


def data_key(spec: RunSpec, eval_tokens: int | None) -> str:
    """Which validation rows a run is evaluated on: runs with the same key share them."""
    data = spec.config().get("data") or {}
    return json.dumps([spec.source, spec.data_dpath, data, eval_tokens], sort_keys=True, default=str)


def evaluate_run(
    spec: RunSpec,
    out_dpath: Path,
    k_infer: list[int],
    r_max: int,
    eval_tokens: int | None = None,
    residuals: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every per-run number: R², L0, inference sweep, Babel curves (on the validation split).

    ``residuals``, when given, receives ``{run name: (data key, each row's squared error)}`` and
    ``{("tokens", data key): the rows}`` for the bootstrap over validation rows (not written anywhere)."""
    sae = load_sae(Path(out_dpath) / "models" / spec.name)
    x = load_tokens(datamodule_for(spec), "val", eval_tokens)
    if residuals is not None:
        key = data_key(spec, eval_tokens)
        residuals[spec.name] = (key, row_errors(sae, x))
        residuals.setdefault(("tokens", key), x.double().numpy())
    any_k = sae.k_above_d_sae  # MP may pick atoms again: any inference k, also above p
    report = evaluate_sae(sae, x, r_max, ks=sorted({spec.k, *(k for k in k_infer if any_k or k <= sae.d_sae)}))
    record = read_run_record(Path(out_dpath) / "models" / spec.name)
    if record is None:
        raise ValueError(
            f"{Path(out_dpath) / 'models' / spec.name / RUN_FNAME}: missing or damaged while the study read it; "
            "rerun the same command (the run is trained again)"
        )
    support = coherence_stats(sae, x, len(report["babel_coactive"]))
    return {
        "name": spec.name,
        "variant": spec.variant,
        "k": spec.k,
        "p": spec.p,
        "r2": reconstruction_r2(sae, x),
        "l0": report["l0"],
        "n_eval_tokens": int(x.shape[0]),
        "dead_fraction_eval": float((report["frequency"] == 0).double().mean()),
        "logged": logged_metrics(spec, out_dpath),
        "inference": {"ks": report["ks"], "r2": report["r2_by_k"]},
        "babel_dict": report["babel_dict"].tolist(),
        "babel_coactive": report["babel_coactive"].tolist(),
        "support_coherence": support,
        "command": record.get("command"),
    }


@torch.no_grad()
def coherence_stats(sae: SparseAutoencoder, x: torch.Tensor, r_max: int) -> dict[str, Any]:
    """Co-active coherence controlled for support size (see :mod:`.coherence`) on ``x``."""
    codes = torch.cat([sae.encode(chunk) for chunk in x.split(_CHUNK)])
    return support_coherence(sae.W_dec, codes, r_max)


def evaluate_concepts(spec: RunSpec, out_dpath: Path, concept_tokens: int | None, example_index: int) -> dict[str, Any]:
    """Concept statistics of one run over the whole dataset (train and validation) and one example."""
    datamodule = datamodule_for(spec)
    sae = load_sae(Path(out_dpath) / "models" / spec.name)
    x = load_tokens(datamodule, "all", concept_tokens)
    held_out = load_tokens(datamodule, "val")
    example = held_out[example_index % held_out.shape[0]]
    result = concepts.concept_statistics(sae, x)
    result["sequence"] = concepts.sequential_reconstruction(sae, example)
    result["image_shape"] = list(datamodule.image_shape) if datamodule.image_shape else None
    return result


def reference_dictionary(
    spec: RunSpec, out_dpath: Path, k_infer: list[int], r_max: int, eval_tokens: int | None = None
) -> dict[str, Any] | None:
    """The paper authors' MNIST MP-SAE (p = 1000, k = 10) on the validation rows of ``spec`` (our MP-SAE's run).

    The same numbers as :func:`evaluate_run` (R² against the inference k, Babel curves, support-
    controlled co-active coherence), so that report.md can put "ours vs the paper's" side by side.
    None when the run's inputs are not 784-d (MNIST's pixels).
    """
    from sae_pipeline.evaluate.external import REFERENCE_NPZ_FPATH, load_npz_dictionary

    datamodule = datamodule_for(spec)
    if datamodule.d_in != 784:
        return None
    sae = load_npz_dictionary(REFERENCE_NPZ_FPATH, k=10)
    x = load_tokens(datamodule, "val", eval_tokens)
    report = evaluate_sae(sae, x, r_max, ks=sorted({10, *k_infer}))
    return {
        "npz": REFERENCE_NPZ_FPATH.name,
        "p": sae.d_sae,
        "k": 10,
        "n_eval_tokens": int(x.shape[0]),
        "same_rows_as": spec.name,
        "r2": reconstruction_r2(sae, x),
        "l0": report["l0"],
        "inference": {"ks": report["ks"], "r2": report["r2_by_k"]},
        "babel_dict": report["babel_dict"].tolist(),
        "babel_coactive": report["babel_coactive"].tolist(),
        "support_coherence": coherence_stats(sae, x, len(report["babel_coactive"])),
        "concepts": concepts.concept_statistics(sae, load_tokens(datamodule, "all")),
    }


def expressivity(
    entries: dict[str, dict], variants: list[str], ks: list[int], ps: list[int], k_main: int, p_main: int
) -> dict[str, Any]:
    """R² against k at ``p_main`` and against p at ``k_main``, per variant (paper Fig. 2a/2b)."""

    def row(variant: str, k: int, p: int) -> dict[str, Any]:
        entry = entries[f"{variant}_p{p}_k{k}"]
        return {"k": k, "p": p, "r2": entry["r2"], "l0": entry["l0"]}

    return {
        "p_main": p_main,
        "k_main": k_main,
        "vs_k": {v: [row(v, k, p_main) for k in ks] for v in variants},
        "vs_p": {v: [row(v, k_main, p) for p in ps] for v in variants},
    }


def inference(entries: dict[str, dict], variants: list[str], ks: list[int], k_main: int, p_main: int) -> dict[str, Any]:
    """R² against inference k for each training k (paper Fig. 8), main training k first."""
    by_train_k = {v: {str(k): entries[f"{v}_p{p_main}_k{k}"]["inference"] for k in ks} for v in variants}
    return {
        "p": p_main,
        "k_train": k_main,
        "main": {v: by_train_k[v][str(k_main)] for v in variants},
        "by_train_k": by_train_k,
    }


def coherence(entries: dict[str, dict], variants: list[str], k_main: int, p_main: int) -> dict[str, Any]:
    """Babel curves of the dictionary and of the co-activated atoms (paper Fig. 5a/5b)."""
    chosen = {v: entries[f"{v}_p{p_main}_k{k_main}"] for v in variants}
    return {
        "k": k_main,
        "p": p_main,
        "dictionary": {v: e["babel_dict"] for v, e in chosen.items()},
        "coactive": {v: e["babel_coactive"] for v, e in chosen.items()},
        "support": {v: e["support_coherence"] for v, e in chosen.items()},
    }
