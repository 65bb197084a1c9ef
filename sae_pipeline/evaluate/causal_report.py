"""``evaluate causal``'s outputs: ``OUT/causal.json`` (every figure, plain JSON) and ``OUT/causal.md`` (the
atoms whose removal costs the probe most), and the command itself (:mod:`.causal` holds the measurement)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from feature_extraction.atomic_files import write_text_atomic
from feature_extraction.output_dirs import prepare_output_dir

JSON_FNAME, MD_FNAME = "causal.json", "causal.md"
TABLE_ATOMS = 20


def run_causal(args: Any) -> Path:
    """Check the input (one line each), measure, write both files; returns the Markdown file."""
    from sae_pipeline.artifacts import load_sae
    from sae_pipeline.data.sources import open_source
    from sae_pipeline.evaluate.causal import causal_effects
    from sae_pipeline.evaluate.data_flags import EVALUATE_FLAGS

    check_inputs(args.sae, args.data, args.data_dpath, args.val_fraction)
    sae = load_sae(args.sae)
    check_atoms(args.atoms, sae.d_sae, args.sae)
    source = open_source(args.data, args.data_dpath, flags=EVALUATE_FLAGS)
    result = {
        "sae": str(args.sae),
        **causal_effects(sae, source, args.data, args.val_fraction, args.atoms, args.set_size),
    }
    result["seconds_per_atom"] = result["seconds"] / len(result["atoms"]["atom"])
    out_dpath = prepare_output_dir(args.out, "--out")
    write_text_atomic(out_dpath / JSON_FNAME, json.dumps(result, indent=1, allow_nan=False) + "\n")
    write_text_atomic(out_dpath / MD_FNAME, causal_markdown(result))
    print(f"{verdict(result)}; {len(result['atoms']['atom'])} atoms in {result['seconds']:.1f} s")
    return out_dpath / MD_FNAME


def check_atoms(atoms: list[int] | None, d_sae: int, sae_dpath: Path | str) -> None:
    """One-line error for an ``--atoms`` index outside the dictionary."""
    for atom in atoms or ():
        if not 0 <= atom < d_sae:
            raise ValueError(
                f"--atoms {atom}: out of range for the SAE in {sae_dpath} (d_sae = {d_sae}); pass atoms 0..{d_sae - 1}"
            )


def check_inputs(sae_dpath: Path | str, data: str, data_dpath: str, val_fraction: float) -> None:
    """The one-line errors that need no SAE or data read: a missing SAE folder, unlabelled data, no MNIST, a
    held-out share that leaves no validation split (the effects are measured there)."""
    from feature_extraction.validate import check_float
    from sae_pipeline.evaluate.data_flags import check_mnist
    from sae_pipeline.evaluate.probing import check_labelled

    if not Path(sae_dpath).is_dir():
        raise ValueError(
            f"--sae {sae_dpath}: not a directory; pass an export (config.json + sae.safetensors) or a "
            "SAELens directory (cfg.json + sae_weights.safetensors)"
        )
    check_float("--val_fraction", val_fraction, 0.0, 1.0, strict_minimum=True, strict_maximum=True)
    check_labelled(data)
    check_mnist(data, data_dpath)


def verdict(result: dict[str, Any]) -> str:
    """The finding in words that cannot be read as "fewer than chance": a count of discoveries, not a comparison."""
    return (
        f"{result['atoms_beating_matched']} of {result['atoms_tested']} tested atoms lower the true class's "
        f"log-probability more than removing a matched other atom of the same image does (Benjamini-Hochberg "
        f"q < {result['fdr']:g}; tested: firing on 2 or more validation images that have another active atom)"
    )


def _number(value: float | None, digits: int = 4) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _interval(atoms: dict, key: str, r: int) -> str:
    mean, low, high = atoms[key][r], atoms[f"{key}_low"][r], atoms[f"{key}_high"][r]
    if mean is None:
        return "—"
    return f"{mean:.4f}" if low is None else f"{mean:.4f} [{low:.4f}, {high:.4f}]"


def changed_images(images: list[dict[str, Any]]) -> str:
    """The "images changed most" cell: only the images whose prediction the ablation changed (the list behind it
    fills up with unchanged ones, by log p drop, when fewer changed)."""
    return ", ".join(
        f"{i['id']} ({i['label']}: {i['before']} → {i['after']})" for i in images if i["before"] != i["after"]
    )


def causal_markdown(result: dict[str, Any]) -> str:
    """The top atoms by the paired excess over the matched baseline (then the log-probability drop), with what
    each column means, and the set ablations."""
    atoms = result["atoms"]

    def key(r: int) -> tuple:
        excess, drop = atoms["excess"][r], atoms["logp_drop"][r]
        return (excess is None, -(excess or 0.0), -(drop or 0.0), r)

    order = sorted(range(len(atoms["atom"])), key=key)[:TABLE_ATOMS]
    level = f"{100 * result['confidence']:g} %"
    lines = [
        "# Causal effects of single atoms",
        "",
        f"SAE `{result['sae']}` ({result['class']}, d_sae {result['d_sae']}, k {result['k']}) on `{result['data']}`: "
        f"a linear probe fitted on the reconstructions of {result['n_train_images']} training images reads the "
        f"reconstructions of {result['n_val_images']} validation images at accuracy {result['probe_accuracy']:.4f}; "
        f"mean ‖x − x̂‖² per token {result['baseline_error']:.6g}.",
        "",
        verdict(result) + f"; {result['atoms_firing']} atoms fire on validation images. An atom not counted here is "
        "not shown to matter less than any other: on few images the test cannot tell.",
        "",
        "log p drop: the mean over the images the atom fires on of log p(true) before − after "
        f"removing it (x̂ − z_j d_j), with its {level} t interval; matched: the same when, on each of "
        "those images, the other active atom with the closest |code| is removed instead; excess: the "
        "paired difference atom − matched, its interval, and the Benjamini-Hochberg q of a one-sided "
        "t test (* below the FDR). Accuracy drop: acc(x̂) − acc(x̂ − z_j d_j) over all validation images "
        "(± its standard error); error rise: mean ‖x − x̂ + z_j d_j‖² − ‖x − x̂‖² per token; top label: "
        "the feature browser's (largest prior-corrected share q over every image of the data, "
        f"{result['top_label_images']} splits: the browser's when it ran on the same data). "
        'docs/evaluation.md, "Causal effects", gives the formulas.',
        "",
        "| atom | images | top label | log p drop | matched | excess | q | accuracy drop | error rise | changed "
        "| images changed most (label: before → after) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in order:
        label = atoms["top_label"][r]
        label = "—" if label is None else f"{label}{' (tie)' if atoms['top_label_tied'][r] else ''}"
        images = changed_images(atoms["images"][r])
        lines.append(
            f"| {atoms['atom'][r]} | {atoms['n_images'][r]} | {label} | {_interval(atoms, 'logp_drop', r)} | "
            f"{_number(atoms['matched_logp_drop'][r])} | {_interval(atoms, 'excess', r)} | "
            f"{_number(atoms['q'][r], 3)}{' *' if atoms['beats_matched'][r] else ''} | "
            f"{atoms['accuracy_drop'][r]:.4f} ± {atoms['accuracy_drop_se'][r]:.4f} | "
            f"{atoms['error_rise'][r]:.4g} ({_number(atoms['error_rise_relative'][r], 3)}) | {atoms['changed'][r]} | "
            f"{images or '—'} |"
        )
    lines += [
        "",
        f"\\* q < {result['fdr']:g}.",
        "",
        "## Set ablations",
        "",
        f"Per class, the {result['set_size']} atoms whose mean code on its training images most exceeds their mean on "
        "the other classes' images, removed together (SAEBench's TPP; the probe's accuracy on each class's images "
        "stands in for its per-class probes): targeted, the class's own accuracy drop; untargeted, the mean drop of "
        "the other classes'; TPP = targeted − untargeted"
        + (f", mean {result['tpp_mean']:.4f}." if result["tpp_mean"] is not None else "."),
        "",
        "| class | images | atoms | targeted | untargeted | TPP | log p drop, its images | log p drop, the others |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, row in result["set_ablations"].items():
        lines.append(
            f"| {label} | {row['images']} | {' '.join(map(str, row['atoms'])) or '—'} | "
            f"{_number(row['targeted_accuracy_drop'])} | {_number(row['untargeted_accuracy_drop'])} | "
            f"{_number(row['tpp'])} | {_number(row['targeted_logp_drop'])} | {_number(row['untargeted_logp_drop'])} |"
        )
    return "\n".join([*lines, ""])
