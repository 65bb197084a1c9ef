"""Evaluate one SAE directory: ours (``export``) or SAELens's (``cfg.json`` + ``sae_weights.safetensors``).

``python -m sae_pipeline.evaluate sae --sae DIR --data SOURCE --out OUT`` loads the SAE with
:func:`sae_pipeline.artifacts.load_sae` (which reads both formats), takes the validation split of
``SOURCE`` as training would hold it out (:func:`sae_pipeline.data.validation.validation_split`: the same
rows for the same ``--val_fraction``, read block by block on each pass, so memory does not grow with the
split), and
reports what the study reports per run: R² of the model as it is (``forward``), L0, the dead
fraction on those tokens, R² against the inference k, and the Babel curves of the dictionary
and of the co-activated atoms. Numbers go into ``OUT/results.json`` under ``saes.<DIR name>``
(several SAEs add up in one OUT); figures into ``OUT/figures/sae_<DIR name>_*.png`` and
``OUT/tensorboard``; a one-line summary is printed.

The data must be in the units the SAE was trained on: an exported SAE takes raw activations
(its input scale is folded in); a SAELens SAE takes what its ``normalize_activations`` says,
and only run-time-free settings load (see :mod:`sae_pipeline.artifacts.saelens_load`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from sae_pipeline.artifacts import load_sae
from sae_pipeline.artifacts.export_files import export_format
from sae_pipeline.data.validation import validation_split
from sae_pipeline.evaluate.data_flags import EVALUATE_FLAGS
from sae_pipeline.evaluate.studies import reconstruction_r2
from sae_pipeline.figures import atom_grid_figure, babel_curve_figure, r2_vs_k_figure
from sae_pipeline.metrics import evaluate_sae


def evaluate_sae_dir(
    sae_dpath: Path | str,
    data: str = "digits",
    val_fraction: float = 0.1,
    k_infer: list[int] | None = None,
    r_max: int = 64,
    max_tokens: int | None = None,
    data_dpath: str = "data",
) -> tuple[dict[str, Any], dict[str, Figure]]:
    """``(results, figures)`` of the SAE in ``sae_dpath`` on the validation split of ``data``."""
    sae_dpath = Path(sae_dpath)
    if not sae_dpath.is_dir():
        raise ValueError(
            f"--sae {sae_dpath}: not a directory; pass an export (config.json + sae.safetensors) or a "
            "SAELens directory (cfg.json + sae_weights.safetensors)"
        )
    sae = load_sae(sae_dpath)
    x = validation_split(data, val_fraction, max_tokens, data_dpath, EVALUATE_FLAGS)
    if x.shape[1] != sae.d_in:
        raise ValueError(
            f"--data {data}: tokens are {x.shape[1]}-d but the SAE in {sae_dpath} takes "
            f"d_in = {sae.d_in}; pass the data it was trained on"
        )
    report = evaluate_sae(sae, x, r_max, ks=k_infer)
    name = sae_dpath.resolve().name
    results = {
        "sae": str(sae_dpath),
        "format": export_format(sae_dpath),
        "class": type(sae).__name__,
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "k": sae.k,
        "data": data,
        "val_fraction": val_fraction,
        "n_eval_tokens": int(x.shape[0]),
        "r2": reconstruction_r2(sae, x),
        "l0": report["l0"],
        "dead_fraction_eval": float((report["frequency"] == 0).double().mean()),
        "inference": {"ks": report["ks"], "r2": report["r2_by_k"]},
        "babel_dict": report["babel_dict"].tolist(),
        "babel_coactive": report["babel_coactive"].tolist(),
    }
    label = f"{name} ({type(sae).__name__})"
    figures: dict[str, Figure] = {
        f"sae_{name}_babel": babel_curve_figure(
            {"dictionary": results["babel_dict"], f"co-active ({data})": results["babel_coactive"]},
            f"Babel μ₁(r): {name}",
        ),
        f"sae_{name}_r2_vs_k": r2_vs_k_figure(
            report["ks"],
            {label: report["r2_by_k"]},
            trained_k=sae.k,
            title=f"R² against inference k ({data}, validation)",
        ),
    }
    side = round(sae.d_in**0.5)
    if side * side == sae.d_in:  # image-shaped inputs (digits, MNIST): the most frequent atoms as images
        order = report["frequency"].argsort(descending=True)[:25].tolist()
        figures[f"sae_{name}_atoms_by_frequency"] = atom_grid_figure(
            sae.W_dec.detach()[order],
            (side, side),
            n_atoms=len(order),
            labels=[f"#{j}" for j in order],
            title=f"{name}: top {len(order)} atoms by frequency",
        )
    return results, figures


def summary_line(results: dict[str, Any]) -> str:
    """One line for the terminal: what was evaluated and its R², L0 and Babel μ₁(1)."""
    return (
        f"{results['sae']} ({results['class']}, {results['format']}): R² {results['r2']:.4f}, "
        f"L0 {results['l0']:.2f}, dictionary μ₁(1) {results['babel_dict'][0]:.3f}, "
        f"co-active μ₁(1) {results['babel_coactive'][0]:.3f} on {results['n_eval_tokens']} "
        f"validation tokens of {results['data']}"
    )
