"""``python -m sae_pipeline.evaluate``: the paper's controlled experiment, one command per study.

    python -m sae_pipeline.evaluate all --data digits --out eval_out --max_steps 2000   # every study
    python -m sae_pipeline.evaluate expressivity --data digits --out eval_out --k 5 10 20 40 --p 250 500 1000
    python -m sae_pipeline.evaluate inference --data shards/dinov2 --out eval_dinov2 --k 32 --k_main 32 --p_main 19200
    python -m sae_pipeline.evaluate probing --data mnist_sample --out eval_out --k 10 --p 1000   # sparse probing
    python -m sae_pipeline.evaluate report --out eval_out            # rebuild report.md from results.json
    python -m sae_pipeline.evaluate dictionary --npz authors --out eval_authors
    python -m sae_pipeline.evaluate sae --sae exported/ --data digits --out eval_sae   # ours or SAELens's

Studies share their runs (``OUT/runs``, ``OUT/models``): a run already trained and exported with
the same settings is reused, never retrained, so studies resume and add up; ``results.json``
keeps the results of earlier studies in the same ``OUT``. Bad input ends with one ``error:``
line and exit status 2 before anything is written; a runtime failure (a training run that
failed, a full disk) with one line and 1; Ctrl-C with 130, SIGTERM with 143: finished runs are
kept, and the run being trained saves its checkpoint; rerunning the same command reuses the
finished runs and continues the interrupted one from its checkpoint (:mod:`.run_training`). The convention is
``feature_extraction.exit_status``'s.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from feature_extraction.exit_status import run_cli
from feature_extraction.help_format import DefaultsHelpFormatter
from feature_extraction.output_dirs import check_output_path, prepare_output_dir
from feature_extraction.output_lock import output_lock
from sae_pipeline.evaluate import run_training, runs  # light: torch loads once the flags are valid

PROG = "python -m sae_pipeline.evaluate"


def _parser(**kwargs: Any) -> Any:
    """A jsonargparse parser whose ``--help`` shows the defaults; errors are left to ``run_cli`` (one line)."""
    from jsonargparse import ArgumentParser

    return ArgumentParser(formatter_class=DefaultsHelpFormatter, exit_on_error=False, **kwargs)


def build_parser() -> Any:
    """The flags of every subcommand (jsonargparse: ``--config FILE`` sets any of a subcommand's flags)."""
    from jsonargparse import ActionConfigFile
    from jsonargparse.typing import PositiveInt

    # allow_abbrev: else the top level would read a study's --p as an abbreviation of its own --print_shtab.
    parser = _parser(
        prog=PROG,
        allow_abbrev=False,
        description="Reproduce the paper's controlled experiment (expressivity, "
        "inference-time k, coherence, learned concepts) over the SAE variants, training each "
        "model through `python -m sae_pipeline fit`.",
    )
    commands = parser.add_subcommands(dest="command", required=True)

    def add(name: str, help: str) -> Any:  # noqa: A002 (argparse's word)
        sub = _parser(description=help[0].upper() + help[1:] + ".")
        sub.add_argument("--config", action=ActionConfigFile, help="YAML file setting any of the options below")
        commands.add_subcommand(name, sub, help=help)
        return sub

    for name in (*runs.STUDIES, "probing", "all"):
        what = {"all": "run every study but probing", "probing": "run the sparse probing study (labelled data)"}
        sub = add(name, what.get(name, f"run the {name} study"))
        sub.add_argument(
            "--data",
            default="digits",
            help="digits (bundled), mnist_sample (5000 real MNIST digits, "
            "extra 'mnist'), mnist, a shard directory or an .h5 token cache",
        )
        sub.add_argument("--out", required=True, help="output folder: runs, models, figures, results.json, report.md")
        sub.add_argument(
            "--variants",
            nargs="+",
            default=None,
            help="registry keys of the variants to train "
            "(relu jumprelu topk batchtopk mpsae ...; default: every registered variant)",
        )
        sub.add_argument("--k", nargs="+", type=PositiveInt, default=[5, 10, 20, 40], help="training sparsities")
        sub.add_argument("--k_main", type=PositiveInt, default=10, help="k of the p sweep, coherence and concepts")
        sub.add_argument(
            "--p",
            nargs="+",
            type=PositiveInt,
            default=[125, 250, 500, 1000, 2000],
            help="dictionary sizes of the p sweep",
        )
        sub.add_argument("--p_main", type=PositiveInt, default=1000, help="p of the k sweep, coherence and concepts")
        sub.add_argument(
            "--max_steps",
            type=PositiveInt,
            default=None,
            help="optimiser steps per run (default: the config's own epochs)",
        )
        sub.add_argument(
            "--k_infer",
            nargs="+",
            type=PositiveInt,
            default=[1, 2, 5, 10, 20, 40, 80, 160],
            help="inference-time k values of the inference sweep",
        )
        sub.add_argument("--r_max", type=PositiveInt, default=64, help="largest r of the Babel curves")
        sub.add_argument(
            "--jobs",
            type=PositiveInt,
            default=1,
            help="training runs side by side (subprocesses when > 1; default 1: in-process)",
        )
        sub.add_argument(
            "--group_runs",
            type=bool,
            default=True,
            help="train the runs that share data and steps as one group (one pass over the data for all; "
            "each run as it would train alone); false: one fit per run",
        )
        sub.add_argument("--config_dir", default=None, help="folder of <variant>_<suffix>.yaml (default: configs/)")
        sub.add_argument(
            "--config_suffix",
            default=None,
            help="config suffix (default: digits for digits, mnist for "
            "mnist/mnist_sample, "
            "else the shard manifest's backbone)",
        )
        sub.add_argument("--data_dpath", default=None, help="folder holding MNIST/raw for --data mnist")
        sub.add_argument(
            "--eval_tokens",
            type=PositiveInt,
            default=None,
            help="cap on validation tokens evaluated (default: the whole split, as val/r2 in training)",
        )
        sub.add_argument("--concept_tokens", type=PositiveInt, default=65536, help="inputs for concept statistics")
        sub.add_argument(
            "--example_index", type=int, default=0, help="validation input of the sequential reconstruction"
        )
        if name == "probing":
            sub.add_argument(
                "--probe_k",
                nargs="+",
                type=PositiveInt,
                default=[1, 2, 5, 20],
                help="numbers of latents (and of raw dimensions) each probe may use",
            )
            sub.add_argument(
                "--seeds",
                type=PositiveInt,
                default=5,
                help="draws of the balanced probing tasks: each figure is their mean with a 95%% interval, and "
                "the models are compared pairwise over them (1: one draw, no interval)",
            )
    report = add("report", "rebuild OUT/report.md from OUT/results.json")
    report.add_argument("--out", required=True, help="a study's output folder")
    dictionary = add("dictionary", "concept figures and Babel of an external MP-SAE (.npz)")
    dictionary.add_argument(
        "--npz",
        required=True,
        help=".npz with W_dec [p, d] and b_pre [d]; 'authors' for the paper authors' MNIST MP-SAE (shipped)",
    )
    dictionary.add_argument("--out", required=True, help="output folder: figures, results.json, report.md")
    dictionary.add_argument(
        "--data",
        default="digits28",
        help="digits28 (default: the bundled digits resampled "
        "to 28x28, a stand-in, not MNIST), mnist_sample (5000 real MNIST digits, extra 'mnist'), "
        "mnist (MNIST/raw under --data_dpath) or none",
    )
    dictionary.add_argument("--k", type=PositiveInt, default=10, help="MP steps (the authors trained at k = 10)")
    dictionary.add_argument(
        "--k_infer", nargs="+", type=PositiveInt, default=[1, 2, 5, 10, 20, 40, 80], help="inference-time k values"
    )
    dictionary.add_argument("--r_max", type=PositiveInt, default=64, help="largest r of the Babel curves")
    dictionary.add_argument("--max_tokens", type=PositiveInt, default=None, help="cap on inputs (default: all)")
    dictionary.add_argument("--example_index", type=int, default=0, help="input of the sequential reconstruction")
    dictionary.add_argument("--data_dpath", default="data", help="folder holding MNIST/raw for --data mnist")
    one = add("sae", "R², L0, Babel of one SAE directory: an export or a SAELens SAE")
    one.add_argument(
        "--sae",
        required=True,
        help="export (config.json + sae.safetensors) or SAELens directory (cfg.json + sae_weights.safetensors)",
    )
    one.add_argument("--out", required=True, help="output folder: results.json (saes.<DIR name>), figures")
    one.add_argument(
        "--data",
        default="digits",
        help="the SAE's data: digits, mnist_sample, mnist, a shard directory "
        "or an .h5 "
        "token cache; evaluated on its validation split",
    )
    one.add_argument(
        "--val_fraction",
        type=float,
        default=0.1,
        help="held-out share, as in training's --data.val_fraction (the same rows)",
    )
    one.add_argument(
        "--k_infer",
        nargs="+",
        type=PositiveInt,
        default=None,
        help="inference-time k values (default: powers of two around the trained k)",
    )
    one.add_argument("--r_max", type=PositiveInt, default=64, help="largest r of the Babel curves")
    one.add_argument(
        "--max_tokens", type=PositiveInt, default=None, help="cap on validation tokens (default: the whole split)"
    )
    one.add_argument("--data_dpath", default="data", help="folder holding MNIST/raw for --data mnist")
    causal = add("causal", "each atom's effect on a linear probe and on the error when zeroed in the reconstruction")
    causal.add_argument("--sae", required=True, help="export or SAELens directory (as for the sae subcommand)")
    causal.add_argument("--out", required=True, help="output folder: causal.json, causal.md")
    causal.add_argument(
        "--data",
        default="digits",
        help="labelled data the SAE was trained on: digits, mnist_sample, mnist or a shard directory whose "
        "meta.json carries 'label'; probe fitted on the training split, effects measured on the validation split",
    )
    causal.add_argument("--atoms", nargs="+", type=int, default=None, help="atoms to report (default: all)")
    causal.add_argument("--val_fraction", type=float, default=0.1, help="held-out share, as in training's")
    causal.add_argument("--data_dpath", default="data", help="folder holding MNIST/raw for --data mnist")
    return parser


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
    specs = runs.plan_runs(variants, points, args.data, args.max_steps, config_dpath, suffix, args.data_dpath)
    by_point = {(s.variant, s.k, s.p): s for s in specs}
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
        for spec in specs:
            bar.set_postfix_str(f"evaluating {spec.name}")
            entries[spec.name] = studies.evaluate_run(spec, out_dpath, args.k_infer, args.r_max, args.eval_tokens)
            bar.update()
        results["runs"] = entries
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
            results["probing"] = probing_study(main_specs, out_dpath, sorted(set(args.probe_k)), seeds=args.seeds)
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


def run_dictionary(args: Any) -> Path:
    from sae_pipeline.evaluate.external import evaluate_dictionary
    from sae_pipeline.evaluate.report import read_results, write_report, write_results
    from sae_pipeline.evaluate.report_figures import save_figures

    results_part, figures = evaluate_dictionary(
        args.npz, args.data, args.k, args.k_infer, args.r_max, args.max_tokens, args.example_index, args.data_dpath
    )
    out_dpath = prepare_output_dir(args.out, "--out")
    results = read_results(out_dpath)
    results["dictionary"] = results_part
    save_figures(figures, out_dpath, tag_prefix="dictionary")
    write_results(results, out_dpath)
    write_report(results, out_dpath)
    return out_dpath


def run_sae(args: Any) -> Path:
    from sae_pipeline.evaluate.report import read_results, write_results
    from sae_pipeline.evaluate.report_figures import save_figures
    from sae_pipeline.evaluate.sae_dir import evaluate_sae_dir, summary_line

    results_part, figures = evaluate_sae_dir(
        args.sae, args.data, args.val_fraction, args.k_infer, args.r_max, args.max_tokens, args.data_dpath
    )
    out_dpath = prepare_output_dir(args.out, "--out")
    results = read_results(out_dpath)
    results.setdefault("saes", {})[Path(args.sae).resolve().name] = results_part
    save_figures(figures, out_dpath, tag_prefix="sae")
    print(summary_line(results_part))
    return write_results(results, out_dpath)


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (``feature_extraction.exit_status``: 2 bad input, 1 runtime failure,
    130 / 143 interrupted)."""
    argv = sys.argv[1:] if argv is None else list(argv)

    def flags(config: Any) -> Any:
        """The chosen subcommand's flags, plus ``command`` and the command line (recorded in results.json)."""
        args = config[config.command]
        args.command, args.argv = config.command, argv
        return args

    def run(config: Any) -> Path:
        args = flags(config)
        check_output_path(args.out, "--out")  # before any work: nothing is created until the input is valid
        with output_lock(args.out, f"evaluate {args.command}"):  # one writer per study folder
            if args.command == "report":
                from sae_pipeline.evaluate.report import read_results, write_report, write_results

                results = read_results(Path(args.out))
                if not results:
                    raise ValueError(f"--out {args.out}: no results.json; run a study into it first")
                if "runs" in results:
                    from sae_pipeline.evaluate.claims import check_claims, count_claims

                    results["claims"] = check_claims(results)
                    results["claims_summary"] = count_claims(results["claims"])
                    write_results(results, Path(args.out))
                return write_report(results, Path(args.out))
            if args.command == "sae":
                return run_sae(args)
            if args.command == "causal":
                from sae_pipeline.evaluate.causal_report import run_causal

                return run_causal(args)
            if args.command == "dictionary":
                return run_dictionary(args) / "report.md"
            return run_studies(args) / "report.md"

    status, out_fpath = run_cli(
        build_parser(),
        argv,
        run,
        interrupted=lambda config: (
            f"finished runs in {flags(config).out} are kept; rerun the "
            "same command: it reuses them and continues the "
            "interrupted run from its last checkpoint"
        ),
        kept=lambda config: f"the finished runs in {flags(config).out}",
    )
    if status == 0:
        print(f"wrote {out_fpath}")
    return status


if __name__ == "__main__":
    sys.exit(main())
