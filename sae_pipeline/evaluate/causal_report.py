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
    result = {"sae": str(args.sae), **causal_effects(sae, source, args.data, args.val_fraction, args.atoms)}
    result["seconds_per_atom"] = result["seconds"] / len(result["atoms"]["atom"])
    out_dpath = prepare_output_dir(args.out, "--out")
    write_text_atomic(out_dpath / JSON_FNAME, json.dumps(result, indent=1, allow_nan=False) + "\n")
    write_text_atomic(out_dpath / MD_FNAME, causal_markdown(result))
    print(
        f"{result['atoms_beating_random']} of {result['atoms_firing']} firing atoms drop the probe's accuracy more "
        f"than {result['random_atoms']} random atoms on the same images (chance: about "
        f"{result['atoms_beating_random_by_chance']:.0f}); {len(result['atoms']['atom'])} atoms in "
        f"{result['seconds']:.1f} s"
    )
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


def _number(value: float | None, digits: int = 4) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def causal_markdown(result: dict[str, Any]) -> str:
    """The top atoms by accuracy drop (then error rise), with what each column means."""
    atoms = result["atoms"]
    order = sorted(range(len(atoms["atom"])), key=lambda r: (-atoms["accuracy_drop"][r], -atoms["error_rise"][r], r))[
        :TABLE_ATOMS
    ]
    lines = [
        "# Causal effects of single atoms",
        "",
        f"SAE `{result['sae']}` ({result['class']}, d_sae {result['d_sae']}, k {result['k']}) on `{result['data']}`: "
        f"a linear probe fitted on the reconstructions of {result['n_train_images']} training images reads the "
        f"reconstructions of {result['n_val_images']} validation images at accuracy {result['probe_accuracy']:.4f}; "
        f"mean ‖x − x̂‖² per token {result['baseline_error']:.6g}.",
        "",
        f"{result['atoms_beating_random']} of {result['atoms_firing']} atoms that fire on validation images drop the "
        f"accuracy more than every one of {result['random_atoms']} random atoms removed from the same images with the "
        f"same coefficients (by chance: at most about {result['atoms_beating_random_by_chance']:.1f}, 5 %).",
        "",
        "Accuracy drop: acc(x̂) − acc(x̂ − z_j d_j) over the validation images (± its standard error as a paired mean); "
        "top-label drop: the same over the images of the atom's top label; random max: the largest drop of the random "
        "atoms; error rise: mean ‖x − x̂ + z_j d_j‖² − ‖x − x̂‖² per token (relative: over the mean ‖x − x̂‖²); "
        'changed: images whose predicted label changes. docs/evaluation.md, "Causal effects", gives the formulas.',
        "",
        "| atom | images | top label | accuracy drop | top-label drop | random max | error rise (relative) | changed "
        "| images changed most (label: before → after) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in order:
        label = atoms["top_label"][r]
        label = "—" if label is None else f"{label}{' (tie)' if atoms['top_label_tied'][r] else ''}"
        images = ", ".join(f"{i['id']} ({i['label']}: {i['before']} → {i['after']})" for i in atoms["images"][r])
        lines.append(
            f"| {atoms['atom'][r]} | {atoms['n_images'][r]} | {label} | {atoms['accuracy_drop'][r]:.4f} ± "
            f"{atoms['accuracy_drop_se'][r]:.4f}{' *' if atoms['beats_random'][r] else ''} | "
            f"{_number(atoms['top_label_drop'][r])} | {_number(atoms['random_drop_max'][r])} | "
            f"{atoms['error_rise'][r]:.4g} ({_number(atoms['error_rise_relative'][r], 3)}) | {atoms['changed'][r]} | "
            f"{images or '—'} |"
        )
    lines += ["", "\\* beats every random atom.", ""]
    return "\n".join(lines)
