"""The probing study's section of ``report.md``: the probes' accuracy per variant and k, over SAE seeds, with the
draws' spread as Monte-Carlo error (evaluate/probing.py measures; evaluate/report.py assembles the page)."""

from __future__ import annotations

from typing import Any

from sae_pipeline.evaluate.report_figures import AUTHORS_LABEL
from sae_pipeline.evaluate.report_text import table
from sae_pipeline.sae import display_label

IN_SAMPLE_NOTE_BOTH = (
    "The paper authors trained their dictionary on MNIST's training set, which holds both sets of rows: both its R² "
    "are in-sample, to be compared with our models' R² on their training rows."
)


def _train_r2_lines(study: dict[str, Any] | None) -> list[str]:
    """R² of each probed run (and of the authors' dictionary) on the run's training rows and on its validation
    rows: the in-sample number is what compares with the authors' in-sample R²."""
    if not study or not any("r2_train" in e for e in study["variants"].values()):
        return []
    models = [(display_label(v), e) for v, e in study["variants"].items()]
    if "reference" in study:
        models.append((AUTHORS_LABEL, study["reference"]))
    return [
        f"R² on the {study['n_train_rows']} training rows (in-sample) and on the {study['n_val_rows']} "
        "validation rows (held out), at each model's trained k. "
        + (IN_SAMPLE_NOTE_BOTH if "reference" in study else ""),
        "",
        *table(
            ["model", "k, p", "R² training rows", "R² validation rows"],
            [[name, f"{e['k']}, {e['p']}", f"{e['r2_train']:.3f}", f"{e['r2_val']:.3f}"] for name, e in models],
        ),
        "",
    ]


ABOVE_COLUMNS_NOTE = (
    "(all N): k is above the N latents (or input dimensions) there are, so that probe used all N: the figure is the "
    "all-columns one, not a k-sparse probe."
)


def probing_section(study: dict[str, Any]) -> list[str]:
    """Sparse probing: mean held-out accuracy over the one-vs-rest tasks, per k, for each model and the raw
    inputs: a variant's figure over its SAE seeds, the draws' spread as Monte-Carlo error, and the comparisons
    between variants over seeds (evaluate/probe_stats.py)."""
    ks = study["ks"]
    raw = study["raw"]
    models = [(display_label(v), e) for v, e in study["variants"].items()]
    if "reference" in study:
        models.append((AUTHORS_LABEL, study["reference"]))
    extra = [key for key in ("all", "all_saebench") if key in raw["mean"]]
    rows = [
        [name, f"{e['k']}, {e['p']}", *[_accuracy(e, str(k)) for k in ks], *[_accuracy(e, key) for key in extra]]
        for name, e in models
    ]
    rows.append(
        [
            "raw inputs (k best dimensions; all)",
            "–",
            *[_accuracy(raw, str(k)) for k in ks],
            *[_accuracy(raw, key) for key in extra],
        ]
    )
    above = any("(all " in cell for row in rows for cell in row[2 : 2 + len(ks)])
    n_train = sum(study["task_rows"]["train"].values()) / len(study["labels"])
    n_val = sum(study["task_rows"]["val"].values()) / len(study["labels"])
    spread = _probing_spread(study)
    headers = {"all": "all dimensions", "all_saebench": "all, SAEBench's probe"}
    return [
        "## Sparse probing (SAEBench's k-sparse probing)",
        "",
        f"Mean held-out accuracy over {len(study['labels'])} one-vs-rest tasks (one per class; balanced sets of "
        f"{n_train:.0f} training and {n_val:.0f} validation rows per task on average, from the "
        f"{study['n_train_rows']} / {study['n_val_rows']} rows of the split); the probe uses the k latents "
        "with the largest class mean difference on the training set. " + spread,
        "",
        *table(["model", "trained k, p", *[f"k = {k}" for k in ks], *[headers[key] for key in extra]], rows),
        "",
        *([ABOVE_COLUMNS_NOTE, ""] if above else []),
        *(
            [
                '"all, SAEBench\'s probe" is the probe SAEBench puts on all dimensions, trained as it trains it: '
                "it keeps the epoch with the best held-out accuracy, so it reads high by construction.",
                "",
            ]
            if "all_saebench" in extra
            else []
        ),
        *_comparison_lines(study, models),
        *_train_r2_lines(study),
    ]


def _probing_spread(study: dict[str, Any]) -> str:
    """What a cell's ± is: the 95 % interval over SAE seeds, and the draws' Monte-Carlo error beside it."""
    draws, sae_seeds = study.get("draws", study.get("seeds", 1)), study.get("sae_seeds", 1)
    if "sae_seeds" not in study and draws > 1:  # written before SAE seeds: its ± is over draws
        return (
            f"Each cell is the mean over {draws} draws of the balanced tasks ± the half-width of its 95 % interval "
            "over the draws (a study written before SAE seeds, one SAE per variant): Monte-Carlo error of that SAE's "
            "figure, not a difference between variants; rerun the study for intervals over SAE seeds."
        )
    text = (
        f"Each SAE's figure is the mean over {draws} draws of the rows that balance each task (the SAE and the "
        "images fixed); "
    )
    if sae_seeds > 1:
        text += (
            f"a variant's cell is the mean over its {sae_seeds} SAE seeds ± the half-width of the 95 % interval "
            "over those seeds (Student's t). "
        )
    else:
        text += "one SAE seed per variant: no interval between SAEs is known (pass `--sae_seeds 3`). "
    mc = [
        e["mc_error"][key]
        for e in [*study["variants"].values(), study["raw"]]
        for key in (e.get("mc_error") or {})
        if e["mc_error"][key] is not None
    ]
    if mc:
        text += (
            f"The draws' own spread is Monte-Carlo error (at most {max(mc):.3f} here, the standard error of a "
            "cell's mean over draws): it says how precisely the cell is computed, not that variants differ."
        )
    return text


def _comparison_lines(study: dict[str, Any], models: list[tuple[str, dict]]) -> list[str]:
    """Pairwise differences between variants, per key: the difference of their means over SAE seeds and whether
    Welch's test over the seeds calls it significant after Holm's correction over the study."""
    comparisons = study.get("comparisons") or []
    if not comparisons or study.get("sae_seeds", 1) < 2:
        return []  # a study written before SAE seeds compared draws: not a comparison of variants
    names = {v: display_label(v) for v in study["variants"]} | {"reference": AUTHORS_LABEL}
    keys = list(dict.fromkeys(c["key"] for c in comparisons))
    pairs = list(dict.fromkeys((c["a"], c["b"]) for c in comparisons))
    by = {(c["a"], c["b"], c["key"]): c for c in comparisons}

    def cell(c: dict[str, Any]) -> str:
        mark = " *" if c["significant"] else ""
        return f"{c['difference']:+.3f}{mark} ({c['classes_higher']}/{c['n_classes']})"

    label = {"all": "all", "all_saebench": "all (SAEBench)"}
    rows = [[f"{names[a]} − {names[b]}", *[cell(by[(a, b, key)]) for key in keys]] for a, b in pairs]
    n_significant = sum(c["significant"] for c in comparisons)
    return [
        f"Differences between the variants (first minus second, of their means over {study['sae_seeds']} SAE "
        "seeds); `*`: significant at 0.05 after Holm's correction over all "
        f"{len(comparisons)} comparisons (Welch's t-test over the SAE seeds, not over draws; {n_significant} "
        "are); in brackets, the classes where the first is higher. `results.json` holds each interval and p-value.",
        "",
        *table(["models", *[f"k = {key}" if key.isdigit() else label[key] for key in keys]], rows),
        "",
    ]


def _accuracy(entry: dict[str, Any], key: str) -> str:
    """A mean accuracy ± its 95 % half-width over draws, marked when k is above the columns the probe had
    (``n_columns``): then it used them all."""
    n_columns = entry.get("n_columns")
    mark = f" (all {n_columns})" if key.isdigit() and n_columns is not None and int(key) > n_columns else ""
    if key not in entry["mean"]:
        return "–"  # a study from before the all-latents probes
    interval = (entry.get("interval") or {}).get(key)
    spread = f" ± {(interval[1] - interval[0]) / 2:.3f}" if interval else ""
    return f"{entry['mean'][key]:.3f}{spread}{mark}"
