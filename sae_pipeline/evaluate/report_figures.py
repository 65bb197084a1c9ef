"""The study's figures: rendered from ``results.json`` plus the exported dictionaries (atom grids need
the atoms), written as PNGs at dpi 100 (small enough to commit) under ``OUT/figures`` and logged to
``OUT/tensorboard`` under ``evaluate/<figure name>``. ``report.md`` (evaluate/report.py) embeds them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from torch.utils.tensorboard import SummaryWriter

from feature_extraction.atomic_files import writing
from sae_pipeline.artifacts import load_sae
from sae_pipeline.evaluate.results_schema import RESULTS_FNAME, section_guard
from sae_pipeline.figures import atom_grid_figure, compare, r2_vs_k_figure
from sae_pipeline.sae import display_label

DPI = 100
AUTHORS_LABEL = "MP-SAE (paper authors)"  # the paper authors' dictionary beside our variants


def study_figures(results: dict[str, Any], out_dpath: Path) -> dict[str, Figure]:
    """Every figure the results support, by file stem; each section drawn under `section_guard` (a section
    kept from an earlier study's results.json that does not hold what its figures read is one line naming it)."""
    figures: dict[str, Figure] = {}
    fpath = Path(out_dpath) / RESULTS_FNAME
    for section, draw in FIGURES.items():
        if section in results and (section != "reference" or "runs" in results):
            with section_guard(fpath, section):
                figures.update(draw(results, out_dpath))
    return figures


def _expressivity_figures(results: dict[str, Any], out_dpath: Path) -> dict[str, Figure]:
    study = results["expressivity"]
    return {
        "expressivity_vs_k": compare.expressivity_vs_k_figure(study["vs_k"], study["p_main"]),
        "expressivity_vs_p": compare.expressivity_vs_p_figure(study["vs_p"], study["k_main"]),
    }


def _coherence_figures(results: dict[str, Any], out_dpath: Path) -> dict[str, Figure]:
    study = results["coherence"]
    return {"babel": compare.babel_panels_figure(study["dictionary"], study["coactive"], study["k"])}


def _probing_figures(results: dict[str, Any], out_dpath: Path) -> dict[str, Figure]:
    study = results["probing"]
    reference = (AUTHORS_LABEL, study["reference"]) if "reference" in study else None
    return {"probing_accuracy_vs_k": compare.probing_accuracy_figure(study["variants"], study["raw"], reference)}


def reference_figures(results: dict[str, Any]) -> dict[str, Figure]:
    """Our MP-SAE beside the paper authors' dictionary on the same validation rows: R² against the inference
    k, Babel curves and the authors' top atoms (ours are ``atoms_mpsae_by_*``)."""
    reference = results["reference"]
    ours = results["runs"][reference["same_rows_as"]]
    ks = [k for k in ours["inference"]["ks"] if k in reference["inference"]["ks"]]

    def at(sweep: dict) -> list[float]:
        return [sweep["r2"][sweep["ks"].index(k)] for k in ks]

    figures = {
        "reference_r2_vs_k": r2_vs_k_figure(
            ks,
            {
                f"MP-SAE (ours, {reference['same_rows_as']})": at(ours["inference"]),
                AUTHORS_LABEL: at(reference["inference"]),
            },
            trained_k=reference["k"],
            title="R² against inference k: ours vs the paper's",
        )
    }
    figures["reference_babel"] = compare.babel_panels_figure(
        {"mpsae": ours["babel_dict"], AUTHORS_LABEL: reference["babel_dict"]},
        {"mpsae": ours["babel_coactive"], AUTHORS_LABEL: reference["babel_coactive"]},
        reference["k"],
    )
    stats = reference.get("concepts")
    if stats:
        from sae_pipeline.evaluate.external import REFERENCE_NPZ_FPATH, load_npz_dictionary

        W_dec = load_npz_dictionary(REFERENCE_NPZ_FPATH).W_dec.detach()
        for key, what in (("top_by_frequency", "frequency"), ("top_by_mean", "mean")):
            order = stats[key]
            figures[f"atoms_authors_by_{what}"] = atom_grid_figure(
                W_dec[order],
                (28, 28),
                n_atoms=len(order),
                labels=[f"#{j}" for j in order],
                title=f"{AUTHORS_LABEL}: top {len(order)} atoms by {what}",
            )
    return figures


def concept_figures(study: dict[str, Any], out_dpath: Path) -> dict[str, Figure]:
    """Atom grids (top 25 by frequency and by mean value), scatters and the sequential reconstruction."""
    variants = study["variants"]
    figures = {
        "frequency_vs_mean": compare.frequency_vs_mean_panels(variants),
        "selection_step_vs_mean": compare.selection_step_panels(variants),
    }
    image_shape = study.get("image_shape")
    if not image_shape:
        return figures  # not image-shaped: atoms and reconstructions cannot be drawn as images
    image_shape = tuple(image_shape)
    figures["sequential_reconstruction"] = compare.sequential_reconstruction_figure(
        {v: s["sequence"] for v, s in variants.items()}, image_shape
    )
    for variant, stats in variants.items():
        W_dec = load_sae(Path(out_dpath) / "models" / stats["run"]).W_dec.detach()
        for key, what in (("top_by_frequency", "frequency"), ("top_by_mean", "mean")):
            order = stats[key]
            figures[f"atoms_{variant}_by_{what}"] = atom_grid_figure(
                W_dec[order],
                image_shape,
                n_atoms=len(order),
                labels=[f"#{j}" for j in order],
                title=f"{display_label(variant)}: top {len(order)} atoms by {what}",
            )
    return figures


#: results.json's sections that have figures, in order, and what draws them from the whole results.
FIGURES = {
    "expressivity": _expressivity_figures,
    "inference": lambda results, out_dpath: {
        "inference_r2_vs_k": compare.inference_by_train_k_figure(results["inference"]["by_train_k"])
    },
    "coherence": _coherence_figures,
    "concepts": lambda results, out_dpath: concept_figures(results["concepts"], out_dpath),
    "reference": lambda results, out_dpath: reference_figures(results),
    "probing": _probing_figures,
}


def save_figures(figures: dict[str, Figure], out_dpath: Path, tag_prefix: str = "evaluate") -> list[Path]:
    """PNG files under ``OUT/figures`` and the same figures in ``OUT/tensorboard``."""
    figures_dpath = Path(out_dpath) / "figures"
    figures_dpath.mkdir(parents=True, exist_ok=True)
    written = []
    with writing(Path(out_dpath) / "tensorboard"):
        writer = SummaryWriter(str(Path(out_dpath) / "tensorboard"))
    try:
        for name, figure in figures.items():
            fpath = figures_dpath / f"{name}.png"
            with writing(fpath):
                figure.savefig(fpath, dpi=DPI)
            written.append(fpath)
            with writing(Path(out_dpath) / "tensorboard"):
                writer.add_figure(f"{tag_prefix}/{name}", figure, global_step=0, close=False)
    finally:
        with writing(Path(out_dpath) / "tensorboard"):
            writer.close()
    return written
