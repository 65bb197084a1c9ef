"""The report's section on SAE seeds (``results["seeds"]``, written by `.study_runner.seed_section`).

Kept beside `.report` because it is one concept, the answer to "does the variant differ, or did one run?":
R² per setting over seeds with Welch comparisons and the bootstrap over validation rows, dictionary Babel
over seeds, the paper's claims of R² at equal k and of Babel re-judged over seeds, and how many atoms come
back in another seed (`.stability`).
"""

from __future__ import annotations

from typing import Any

from sae_pipeline.evaluate.report_text import table
from sae_pipeline.sae import display_label


def _mean_pm(cell: dict[str, Any], digits: int = 3) -> str:
    interval = cell.get("interval")
    spread = f" ± {(interval[1] - interval[0]) / 2:.{digits}f}" if interval else ""
    return f"{cell['mean']:.{digits}f}{spread}"


def _p(comparison: dict[str, Any]) -> str:
    if comparison.get("p") is None:
        return "–"
    mark = " *" if comparison.get("significant") else ""
    return f"{comparison['p_holm']:.3g}{mark}"


VERDICT = {True: "yes", False: "**no**", None: "not shown (within seed-to-seed spread)"}


def seeds_section(results: dict[str, Any]) -> list[str]:
    """The section's lines (see the module docstring)."""
    seeds = results["seeds"]
    n = seeds["n"]
    lines = [
        f"## Across SAE seeds ({n} per variant and setting)",
        "",
        "Every SAE above was trained from "
        + (f"{n} seeds (0 to {n - 1}); the tables above show seed 0's run. " if n > 1 else "one seed. ")
        + "Here each figure is the mean over the seeds ± the half-width of its 95 % t-interval over them; a "
        "difference between variants is Welch's t-test over the per-seed values (`*`: significant at 0.05 after "
        'Holm\'s correction over the table). "images" is the 95 % percentile interval of the same mean when the '
        f"validation rows are resampled ({seeds['r2']['resamples']} bootstrap resamples, seeds fixed): how far "
        "it moves on other images, not a test between variants.",
        "",
    ]
    if n < 2:
        lines += [
            "With one seed there is no spread between SAEs to compare variants against: pass `--sae_seeds 3`.",
            "",
        ]
    rows = []
    for variant, cells in seeds["r2"]["variants"].items():
        for cell in sorted(cells, key=lambda c: (c["k"], c["p"])):  # the study's order: runs reused come first
            boot = cell.get("bootstrap_interval")
            rows.append(
                [
                    display_label(variant),
                    f"{cell['k']}, {cell['p']}",
                    _mean_pm(cell),
                    f"{boot[0]:.3f}–{boot[1]:.3f}" if boot else "–",
                ]
            )
    lines += table(["variant", "k, p", "R² over seeds", "images"], rows) + [""]
    comparisons = seeds["r2"]["comparisons"]
    if comparisons and n > 1:
        rows = []
        for c in sorted(comparisons, key=lambda c: (c["at"]["k"], c["at"]["p"])):  # stable: the pairs' order kept
            boot = c.get("bootstrap_interval")
            rows.append(
                [
                    f"{display_label(c['a'])} − {display_label(c['b'])}",
                    f"{c['at']['k']}, {c['at']['p']}",
                    f"{c['difference']:+.4f}",
                    f"{c['interval'][0]:+.4f} to {c['interval'][1]:+.4f}" if c.get("interval") else "–",
                    _p(c),
                    f"{boot[0]:+.4f} to {boot[1]:+.4f}" if boot else "–",
                ]
            )
        lines += ["R² differences between variants over seeds:", ""]
        lines += table(["variants", "k, p", "difference", "95 % (Welch)", "p (Holm)", "images"], rows) + [""]
    if "babel" in seeds:
        babel = seeds["babel"]
        lines += [f"Dictionary Babel μ₁({babel['r']}) over seeds:", ""]
        rows = [[display_label(v), _mean_pm(cell)] for v, cell in babel["variants"].items()]
        lines += table(["variant", f"μ₁({babel['r']})"], rows) + [""]
        if n > 1 and babel["comparisons"]:
            rows = [
                [f"{display_label(c['a'])} − {display_label(c['b'])}", f"{c['difference']:+.3f}", _p(c)]
                for c in babel["comparisons"]
            ]
            lines += table(["variants", "difference", "p (Holm)"], rows) + [""]
    claims = seeds.get("claims") or {}
    what = {
        "r2_equal_k": "MP-SAE has a higher R² than every shallow SAE at each trained k (p fixed)",
        "babel_dictionary": "MP-SAE's dictionary is more coherent (higher μ₁(k)) than every shallow SAE's",
    }
    if claims and n > 1:
        lines += ["The paper's claims judged over seeds (holds: every comparison significant in its favour):", ""]
        rows = [
            [what.get(key, key), VERDICT[c["holds"]], f"{c['significant']} of {c['comparisons']}"]
            for key, c in claims.items()
        ]
        lines += table(["claim", "holds over seeds?", "significant comparisons"], rows) + [""]
    if seeds.get("stability", {}).get("variants"):
        stab = seeds["stability"]
        lines += [
            f"Stability of the dictionaries (k = {stab['k']}, p = {stab['p']}): atoms of two seeds matched one to "
            f"one (Hungarian, on |cosine| of the decoder rows) and counted as found again at |cosine| ≥ "
            f'{stab["threshold"]}; the share is averaged over the pairs of seeds; "found in j of N" counts seed '
            "0's atoms (those shown on the atom pages) by the number of seeds that have them.",
            "",
        ]
        rows = []
        for v, found in stab["variants"].items():
            counts = found["found_in_counts"]
            spread = ", ".join(f"{j} of {found['n_seeds']}: {counts[str(j)]}" for j in range(found["n_seeds"], 0, -1))
            rows.append([display_label(v), f"{found['share_matched']:.2f}", spread])
        lines += table(["variant", "share found again", "seed 0's atoms found in"], rows) + [""]
    return lines
