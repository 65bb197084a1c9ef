"""``make demo``: the whole pipeline through the real CLIs on bundled data, then a table of metrics.

    python -m sae_pipeline.demo                      # photo shards + both digits variants, under demo_out/
    python -m sae_pipeline.demo --variants mpsae     # one digits variant
    python -m sae_pipeline.demo --skip_shards        # digits only
    tensorboard --logdir demo_out/runs               # then look at the curves and figures
    # then open demo_out/features/mpsae_digits/index.html and demo_out/features/demo_shards/index.html

Each variant runs ``python -m sae_pipeline fit --config configs/<variant>_digits.yaml`` in its
own process, exactly as a user would type it (p = 1000 atoms, k = 10: the paper's controlled
setting, on scikit-learn's 8x8 digits instead of MNIST so that nothing is downloaded). The
final metrics are read back from the TensorBoard event files the run wrote: ``val/r2``,
``val/l0`` and the Babel scalars (dictionary μ₁(1) and μ₁(k), co-active μ₁(k)) of
:class:`sae_pipeline.training.callbacks.SAEFigures` from the last validation (the digits configs validate at the end of
training).

First stage (the whole pipeline, end to end): ``python -m feature_extraction --config
configs/extract_demo.yaml`` extracts scikit-image's 14 bundled photos with a tiny randomly
initialised ViT (17 tokens x 192-d per image) into ``<out>/shards`` (2 images per shard, so 7
shards: the validation split holds out whole shards), then ``python -m sae_pipeline fit --config
configs/demo_shards.yaml`` trains a small TopK SAE on them. A rerun resumes the extraction (complete
shards are skipped); a folder holding another extraction is deleted and extracted again. Random
weights and 238 tokens make this a smoke test of the plumbing, not a meaningful SAE.

Last, ``python -m sae_pipeline features`` builds the feature browser of the digits MP-SAE and of
the photo-shard run (``<out>/features/<run>/index.html``, printed at the end; ``--skip_features``
leaves it out).

The variants train in parallel, one CPU thread each when the machine has few cores: the
runs are small enough that two single-threaded processes finish sooner than two
two-threaded ones in turn (start-up, Python and Lightning overheads overlap too).

Here: the flags and the order of the stages; each stage's command is in `sae_pipeline.demo_stages`, the
final table in `sae_pipeline.demo_report`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from feature_extraction.exit_status import run_cli
from feature_extraction.help_format import DefaultsHelpFormatter
from sae_pipeline.demo_report import SHARDS_LABEL, final_rows, print_results
from sae_pipeline.demo_stages import build_feature_sites, extract_shards, launch, launch_shards_fit, print_tail


def build_parser() -> Any:
    """The demo's flags (jsonargparse, as every command: ``--config FILE`` sets any of them)."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(
        prog="python -m sae_pipeline.demo",
        formatter_class=DefaultsHelpFormatter,
        exit_on_error=False,
        description="Extract the bundled photos into shards and train an SAE on them, "
        "train SAEs on the bundled digits, all through the CLIs, and compare them.",
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file setting any of the options below")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["mpsae", "topk"],
        help="registry keys of the variants to train on digits, each from configs/<key>_digits.yaml "
        "(relu jumprelu topk batchtopk mpsae ...; default: mpsae topk)",
    )
    parser.add_argument("--out", default="demo_out", help="output folder (default: demo_out)")
    parser.add_argument("--sequential", action="store_true", help="train one variant after the other")
    parser.add_argument("--skip_shards", action="store_true", help="skip the photo extraction and its SAE")
    parser.add_argument("--skip_features", action="store_true", help="do not build the feature browser sites")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m sae_pipeline.demo``; returns the exit status (``feature_extraction.exit_status``)."""
    status, result = run_cli(
        build_parser(),
        sys.argv[1:] if argv is None else argv,
        run,
        interrupted=lambda args: f"the runs so far are in {args.out}; rerun the demo to start them again",
    )
    return status if status != 0 else int(result)


def run(args: Any) -> int:
    """The demo itself; 1 when a stage failed (its log's end is printed), else 0."""
    from sae_pipeline.sae import SAE_REGISTRY  # loads torch: only once the flags parsed

    unknown = [v for v in args.variants if v not in SAE_REGISTRY]
    if unknown:
        raise ValueError(f"argument --variants: invalid choice: {unknown[0]!r} (choose from {', '.join(SAE_REGISTRY)})")
    labels = {key: cls.label for key, cls in SAE_REGISTRY.items()}

    out_dpath = Path(args.out)
    runs_dpath, logs_dpath = out_dpath / "runs", out_dpath / "logs"
    logs_dpath.mkdir(parents=True, exist_ok=True)
    for variant in args.variants:  # a fresh run each time: no stale versions or checkpoints to mix up
        shutil.rmtree(runs_dpath / f"{variant}_digits", ignore_errors=True)
    n_cores = os.cpu_count() or 1
    n_runs = len(args.variants) + (0 if args.skip_shards else 1)
    parallel = not args.sequential and n_runs > 1
    threads = max(1, n_cores // n_runs) if parallel else n_cores
    start = time.perf_counter()

    launched: list[tuple[str, subprocess.Popen, Path]] = []
    failed = False
    if not args.skip_shards:
        print(
            f"Extracting scikit-image's bundled photos with a tiny random ViT into {out_dpath / 'shards'} ...",
            flush=True,
        )
        try:
            shards_dpath = extract_shards(out_dpath, logs_dpath, n_cores)
        except RuntimeError:
            return 1
        print(f"  extraction done after {time.perf_counter() - start:.0f} s", flush=True)
        process, log_fpath = launch_shards_fit(shards_dpath, runs_dpath, logs_dpath, threads)
        launched.append((SHARDS_LABEL, process, log_fpath))
        if not parallel:
            failed |= _wait(SHARDS_LABEL, process, log_fpath, start)
    print(
        f"Training {SHARDS_LABEL + ', ' if not args.skip_shards else ''}"
        f"{', '.join(labels[v] for v in args.variants)} on the bundled digits "
        f"(p = 1000 atoms, k = 10) {'in parallel' if parallel else 'in turn'}, {threads} thread(s) each ...",
        flush=True,
    )
    for variant in args.variants:
        process, log_fpath = launch(variant, runs_dpath, logs_dpath, threads)
        launched.append((labels[variant], process, log_fpath))
        if not parallel:
            failed |= _wait(labels[variant], process, log_fpath, start)
    if parallel:
        for label, process, log_fpath in launched:
            failed |= _wait(label, process, log_fpath, start)
    if failed:
        return 1

    try:
        rows = final_rows(runs_dpath, args.variants, labels, with_shards=not args.skip_shards)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print_results(rows, bool(args.variants), None if args.skip_shards else out_dpath / "shards")
    if not args.skip_features and ("mpsae" in args.variants or not args.skip_shards):
        print("\nBuilding the feature browser (python -m sae_pipeline features) ...", flush=True)
        try:
            sites = build_feature_sites(out_dpath, args.variants, not args.skip_shards, threads)
        except RuntimeError:
            return 1
        for site in sites:
            print(f"  feature browser: open {site}")
    print(f"\nTensorBoard logs: {runs_dpath}   (view with: tensorboard --logdir {runs_dpath})")
    print(f"Checkpoints: {runs_dpath}/<run>/version_N/checkpoints/last.ckpt; training logs: {logs_dpath}")
    print(f"Total time: {time.perf_counter() - start:.0f} s")
    return 0


def _wait(label: str, process: subprocess.Popen, log_fpath: Path, start: float) -> bool:
    """Wait for one run; print its outcome (and the end of its log on failure). True when it failed."""
    code = process.wait()
    if code == 0:
        print(f"  {label:<10} done after {time.perf_counter() - start:.0f} s", flush=True)
        return False
    print_tail(f"{label} training", code, log_fpath)
    return True


if __name__ == "__main__":
    sys.exit(main())
