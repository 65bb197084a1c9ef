"""The study runner: what `python -m sae_pipeline.evaluate {expressivity,inference,coherence,concepts,probing,all}`
does.

Checks the flags against the registry and the data before anything is written, plans the grid of runs the chosen
studies need (`.runs`), trains or reuses them (`.run_training`), evaluates each (`.studies`), then writes
`results.json`, the figures and `report.md` (`.report`, `.report_figures`) with the paper's claims checked
(`.claims`). Every setting is trained from `--sae_seeds` seeds; the per-study tables are seed 0's, and
the comparisons between variants are over the seeds (`seed_section`: `.seed_stats`, `.stability`). Kept
apart from the flags (`.parser`) and from the other subcommands (`sae_pipeline.evaluate.__main__`).
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path
from typing import Any

from feature_extraction.output_dirs import prepare_output_dir
from sae_pipeline.evaluate import run_training, runs
from sae_pipeline.evaluate.parser import PROG


def study_points(study: str, ks: list[int], ps: list[int], k_main: int, p_main: int) -> list[tuple[int, int]]:
    """The (k, p) grid one study needs."""
    if study == "expressivity":
        return [(k, p_main) for k in ks] + [(k_main, p) for p in ps]
    if study == "inference":
        return [(k, p_main) for k in ks]
    return [(k_main, p_main)]


def run_studies(args: Any) -> Path:
    from tqdm import tqdm

    from sae_pipeline.evaluate import studies
    from sae_pipeline.evaluate.claims import check_claims, count_claims
    from sae_pipeline.evaluate.data_flags import check_mnist
    from sae_pipeline.evaluate.report import read_results, write_report, write_results
    from sae_pipeline.evaluate.report_figures import save_figures, study_figures
    from sae_pipeline.sae import SAE_REGISTRY

    start = time.perf_counter()
    chosen = list(runs.STUDIES) if args.command == "all" else [args.command]
    known = tuple(SAE_REGISTRY)  # the registry: loads torch, now that the flags parsed
    unknown = [v for v in args.variants or () if v not in known]
    if unknown:
        raise ValueError(f"unknown variant {unknown[0]!r} in --variants; choose from {', '.join(known)}")
    variants = list(dict.fromkeys(args.variants or known))
    ks, ps = sorted({*args.k, args.k_main}), sorted({*args.p, args.p_main})
    if min(ps) < 2:
        raise ValueError(f"--p {min(ps)}: a dictionary needs at least 2 atoms")
    runs.check_source(args.data)
    check_mnist(args.data, args.data_dpath)
    if "probing" in chosen:
        from sae_pipeline.evaluate.probing import check_labelled

        check_labelled(args.data)
    config_dpath = runs.find_config_dpath(args.config_dir)
    suffix = runs.config_suffix_for(args.data, args.config_suffix)
    points = [point for study in chosen for point in study_points(study, ks, ps, args.k_main, args.p_main)]
    specs = runs.plan_runs(
        variants, points, args.data, args.max_steps, config_dpath, suffix, args.data_dpath, args.sae_seeds
    )
    by_point = {(s.variant, s.k, s.p): s for s in specs if s.seed == 0}
    replicas: dict[tuple[str, int, int], list[runs.RunSpec]] = {}
    for spec in specs:
        replicas.setdefault((spec.variant, spec.k, spec.p), []).append(spec)
    main_specs = [
        by_point[(v, args.k_main, args.p_main)]
        for v in variants
        if any(study in ("coherence", "concepts", "probing") for study in chosen)
    ]
    if "probing" in chosen:
        from sae_pipeline.evaluate.probing import check_classes

        check_classes(main_specs[0])  # before anything trains: a study of one class would refuse only at the end
    out_dpath = prepare_output_dir(args.out, "--out")
    results = read_results(out_dpath)

    n_concepts = len(main_specs) if "concepts" in chosen else 0
    n_probing = 1 if "probing" in chosen else 0
    with tqdm(total=2 * len(specs) + n_concepts + n_probing + 1, desc="study", unit="step", dynamic_ncols=True) as bar:

        def done(spec: runs.RunSpec, trained: bool) -> None:
            bar.set_postfix_str(f"{'trained' if trained else 'reused'} {spec.name}")
            bar.update()

        run_training.ensure_runs(specs, out_dpath, jobs=args.jobs, on_done=done, group=args.group_runs)
        entries = dict(results.get("runs", {}))
        residuals: dict = {}
        for spec in specs:
            bar.set_postfix_str(f"evaluating {spec.name}")
            entries[spec.name] = studies.evaluate_run(
                spec, out_dpath, args.k_infer, args.r_max, args.eval_tokens, residuals
            )
            entries[spec.name]["seed"] = spec.seed
            bar.update()
        results["runs"] = entries
        previous = results.get("seeds")
        if not (chosen == ["probing"] and isinstance(previous, dict) and previous.get("n") == args.sae_seeds):
            # (probing alone plans only the main setting: an earlier study's section over its whole grid stays)
            bar.set_postfix_str("comparisons over SAE seeds")
            results["seeds"] = seed_section(replicas, entries, residuals, out_dpath, args, variants)
        if "expressivity" in chosen:
            results["expressivity"] = studies.expressivity(entries, variants, ks, ps, args.k_main, args.p_main)
        if "inference" in chosen:
            results["inference"] = studies.inference(entries, variants, ks, args.k_main, args.p_main)
        if "coherence" in chosen:
            results["coherence"] = studies.coherence(entries, variants, args.k_main, args.p_main)
        if "concepts" in chosen:
            stats, image_shape = {}, None
            for spec in main_specs:
                bar.set_postfix_str(f"concepts {spec.name}")
                stats[spec.variant] = studies.evaluate_concepts(
                    spec, out_dpath, args.concept_tokens, args.example_index
                )
                stats[spec.variant]["run"] = spec.name
                image_shape = stats[spec.variant].pop("image_shape")
                bar.update()
            results["concepts"] = {"k": args.k_main, "p": args.p_main, "image_shape": image_shape, "variants": stats}
        if "probing" in chosen:
            from sae_pipeline.evaluate.probing import probing_study

            bar.set_postfix_str("sparse probing")
            probed = [r for spec in main_specs for r in replicas[(spec.variant, spec.k, spec.p)]]
            results["probing"] = probing_study(probed, out_dpath, sorted(set(args.probe_k)), seeds=args.seeds)
            bar.update()
        if "mpsae" in variants and any(study in ("coherence", "concepts") for study in chosen):
            bar.set_postfix_str("the authors' MNIST dictionary")
            reference = studies.reference_dictionary(
                by_point[("mpsae", args.k_main, args.p_main)], out_dpath, args.k_infer, args.r_max, args.eval_tokens
            )
            if reference is not None:
                results["reference"] = reference
        bar.set_postfix_str("figures and report")
        results["claims"] = check_claims(results)
        results["claims_summary"] = count_claims(results["claims"])
        results["meta"] = {
            "command": f"{PROG} {shlex.join(args.argv)}",
            "data": args.data,
            "variants": variants,
            "max_steps": args.max_steps,
            "sae_seeds": args.sae_seeds,
            "studies": sorted(set(results.get("meta", {}).get("studies", [])) | set(chosen)),
            "wall_time_s": time.perf_counter() - start,
            "cpu_count": os.cpu_count(),
        }
        save_figures(study_figures(results, out_dpath), out_dpath)
        results["meta"]["wall_time_s"] = time.perf_counter() - start
        write_results(results, out_dpath)
        write_report(results, out_dpath)
        bar.update()
    return out_dpath


def seed_section(
    replicas: dict[tuple[str, int, int], list[runs.RunSpec]],
    entries: dict[str, dict],
    residuals: dict,
    out_dpath: Path,
    args: Any,
    variants: list[str],
) -> dict[str, Any]:
    """``results["seeds"]``: R² per setting and Babel at the main setting over SAE seeds (Welch between variants,
    a bootstrap over validation rows), the paper's claims of R² at equal k and of Babel re-judged over seeds,
    and the stability of each variant's dictionary across its seeds (`.seed_stats`, `.stability`)."""
    from sae_pipeline.artifacts import load_sae
    from sae_pipeline.evaluate.claims import SHALLOW
    from sae_pipeline.evaluate.seed_stats import babel_over_seeds, claim_over_seeds, r2_over_seeds
    from sae_pipeline.evaluate.stability import stability_study

    settings = {key: [spec.name for spec in specs] for key, specs in replicas.items()}
    tokens = {key[1]: x for key, x in residuals.items() if isinstance(key, tuple)}
    section: dict[str, Any] = {"n": args.sae_seeds, "r2": r2_over_seeds(settings, entries, residuals, tokens)}
    main = {v: settings[(v, args.k_main, args.p_main)] for v in variants if (v, args.k_main, args.p_main) in settings}
    if main:
        section["babel"] = babel_over_seeds(main, entries, args.k_main)
        decoders = {
            v: [load_sae(out_dpath / "models" / name).W_dec.detach().double().numpy() for name in names]
            for v, names in main.items()
        }
        section["stability"] = stability_study(decoders, args.k_main, args.p_main)
    equal_k = [
        c
        for c in section["r2"]["comparisons"]
        if c["a"] == "mpsae" and c["b"] in SHALLOW and c["at"]["p"] == args.p_main
    ]
    section["claims"] = {
        "r2_equal_k": {
            "holds": claim_over_seeds(equal_k),
            "comparisons": len(equal_k),
            "significant": sum(c["significant"] for c in equal_k),
        },
    }
    if "babel" in section:
        babel = [c for c in section["babel"]["comparisons"] if c["a"] == "mpsae" and c["b"] in SHALLOW]
        section["claims"]["babel_dictionary"] = {
            "holds": claim_over_seeds(babel),
            "comparisons": len(babel),
            "significant": sum(c["significant"] for c in babel),
        }
    return section
