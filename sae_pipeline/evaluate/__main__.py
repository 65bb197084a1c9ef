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

Here: each subcommand run under the lock of its ``--out``; the flags are in ``.parser``, the studies' run in
``.study_runner``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from feature_extraction.exit_status import run_cli
from feature_extraction.output_dirs import check_output_path, prepare_output_dir
from feature_extraction.output_lock import output_lock
from sae_pipeline.evaluate.parser import build_parser  # light: torch loads once the flags are valid
from sae_pipeline.evaluate.study_runner import run_studies


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


def interrupted_line(args: Any) -> str:
    """What a stop leaves, after ``interrupted (Ctrl-C):``: the studies train runs; ``causal`` trains nothing and
    writes its two files only at its end."""
    if args.command == "causal":
        return (
            f"the causal test stopped; {Path(args.out) / 'causal.json'} and causal.md are written only once every "
            "atom is measured, each whole (earlier ones stay until then); rerun the same command to measure again"
        )
    if args.command == "intervene":
        return (
            f"the intervention stopped; {Path(args.out) / 'intervene.json'} and intervene.md are written only once "
            "every image is measured, each whole (earlier ones stay until then); rerun the same command to "
            "measure again"
        )
    return (
        f"finished runs in {args.out} are kept; rerun the same command: it reuses them and continues the "
        "interrupted run from its last checkpoint"
    )


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
            if args.command == "intervene":
                from sae_pipeline.evaluate.intervene_report import run_intervene

                return run_intervene(args)
            if args.command == "dictionary":
                return run_dictionary(args) / "report.md"
            return run_studies(args) / "report.md"

    status, out_fpath = run_cli(
        build_parser(),
        argv,
        run,
        interrupted=lambda config: interrupted_line(flags(config)),
        kept=lambda config: (
            f"{flags(config).out} as it was"
            if flags(config).command in ("causal", "intervene")
            else f"the finished runs in {flags(config).out}"
        ),
    )
    if status == 0:
        print(f"wrote {out_fpath}")
    return status


if __name__ == "__main__":
    sys.exit(main())
