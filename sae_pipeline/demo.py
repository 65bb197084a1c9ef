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
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from feature_extraction.exit_status import run_cli
from feature_extraction.help_format import DefaultsHelpFormatter

SHARDS_LABEL = "TopK (photo shards)"
SHARD_SIZE = 2  # images per shard: 7 shards of the 14 photos
# Messages of feature_extraction's check that --out holds the same extraction (extract.py)
OTHER_EXTRACTION = ("was extracted with other settings", "holds shards of backbone", "holds shard files but no")
FINAL_TAGS = ("val/r2", "val/l0", "val/babel_dict_r1", "val/babel_dict_rk", "val/babel_coactive_rk")


def find_config(variant: str, fname: str | None = None) -> Path:
    """``configs/<variant>_digits.yaml`` (or ``configs/<fname>``) from the current directory, else beside the
    package."""
    name = Path("configs") / (fname or f"{variant}_digits.yaml")
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (root / name).is_file():
            return root / name
    raise FileNotFoundError(
        f"{name} not found in {Path.cwd()} or the source checkout; run the demo from the repository root (make demo)"
    )


def read_final_metrics(log_dpath: Path, tags: tuple[str, ...] = FINAL_TAGS) -> dict[str, tuple[int, float]]:
    """``{tag: (step, value)}`` of the last event of each scalar ``tag`` in a TensorBoard run folder."""
    accumulator = EventAccumulator(str(log_dpath), size_guidance={"scalars": 0, "images": 1, "histograms": 1})
    accumulator.Reload()
    available = set(accumulator.Tags()["scalars"])
    missing = [tag for tag in tags if tag not in available]
    if missing:
        raise ValueError(f"{log_dpath}: no scalar {', '.join(missing)} in the event files (has {sorted(available)})")
    return {tag: (accumulator.Scalars(tag)[-1].step, accumulator.Scalars(tag)[-1].value) for tag in tags}


def launch(variant: str, runs_dpath: Path, logs_dpath: Path, threads: int) -> tuple[subprocess.Popen, Path]:
    """Start ``python -m sae_pipeline fit`` for one variant, its output going to a log file."""
    log_fpath = logs_dpath / f"{variant}.log"
    command = [
        sys.executable,
        "-m",
        "sae_pipeline",
        "fit",
        "--config",
        str(find_config(variant)),
        "--trainer.logger.init_args.save_dir",
        str(runs_dpath),
        "--trainer.enable_progress_bar",
        "false",
    ]
    environment = _environment(threads)
    with log_fpath.open("w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)
    return process, log_fpath


def _environment(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}


def _run_logged(command: list[str], log_fpath: Path, threads: int) -> int:
    """Run ``command`` to completion, its output appended to ``log_fpath``; returns the exit status."""
    with log_fpath.open("a") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=_environment(threads)).returncode


def extract_shards(out_dpath: Path, logs_dpath: Path, threads: int) -> Path:
    """Extract the bundled photos into ``out_dpath / "shards"`` through the real CLI; returns that folder.

    Resumes a previous demo extraction; if the folder holds a different one (the CLI refuses it with
    exit status 2), the folder is the demo's own, so it is deleted and extracted afresh."""
    shards_dpath = out_dpath / "shards"
    log_fpath = logs_dpath / "extract.log"
    log_fpath.write_text("")
    command = [
        sys.executable,
        "-m",
        "feature_extraction",
        "--config",
        str(find_config("", "extract_demo.yaml")),
        "--out",
        str(shards_dpath),
        "--shard_size",
        str(SHARD_SIZE),
    ]
    code = _run_logged(command, log_fpath, threads)
    if code == 2 and any(message in log_fpath.read_text(errors="replace") for message in OTHER_EXTRACTION):
        print(f"  {shards_dpath} holds another extraction: deleting it and extracting again", flush=True)
        shutil.rmtree(shards_dpath)
        code = _run_logged(command, log_fpath, threads)
    if code != 0:
        _print_tail("extraction", code, log_fpath)
        raise RuntimeError(f"extraction into {shards_dpath} exited with code {code}; see {log_fpath}")
    return shards_dpath


def launch_shards_fit(
    shards_dpath: Path, runs_dpath: Path, logs_dpath: Path, threads: int
) -> tuple[subprocess.Popen, Path]:
    """Start ``python -m sae_pipeline fit --config configs/demo_shards.yaml`` on the extracted shards."""
    config_fpath = find_config("", "demo_shards.yaml")
    shutil.rmtree(runs_dpath / config_fpath.stem, ignore_errors=True)  # a fresh run, as for the digits
    log_fpath = logs_dpath / "demo_shards.log"
    command = [
        sys.executable,
        "-m",
        "sae_pipeline",
        "fit",
        "--config",
        str(config_fpath),
        "--data.source",
        str(shards_dpath),
        "--trainer.logger.init_args.save_dir",
        str(runs_dpath),
        "--trainer.enable_progress_bar",
        "false",
    ]
    with log_fpath.open("w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_environment(threads))
    return process, log_fpath


def run_shard_stage(out_dpath: Path, threads: int = 1) -> dict[str, tuple[int, float]]:
    """The demo's first stage on its own: extract the photos into ``out_dpath / "shards"``, train the
    TopK SAE of ``configs/demo_shards.yaml`` on them, return its final metrics (as :func:`read_final_metrics`)."""
    out_dpath = Path(out_dpath)
    runs_dpath, logs_dpath = out_dpath / "runs", out_dpath / "logs"
    logs_dpath.mkdir(parents=True, exist_ok=True)
    shards_dpath = extract_shards(out_dpath, logs_dpath, threads)
    process, log_fpath = launch_shards_fit(shards_dpath, runs_dpath, logs_dpath, threads)
    code = process.wait()
    if code != 0:
        _print_tail("demo_shards", code, log_fpath)
        raise RuntimeError(f"training on {shards_dpath} exited with code {code}; see {log_fpath}")
    return _last_run_metrics(runs_dpath / "demo_shards")


def _last_run_metrics(run_dpath: Path) -> dict[str, tuple[int, float]]:
    versions = sorted(run_dpath.glob("version_*"))
    if not versions:
        raise FileNotFoundError(f"no TensorBoard run folder under {run_dpath}")
    return read_final_metrics(versions[-1])


def launch_features(
    name: str,
    config_fname: str,
    out_dpath: Path,
    runs_dpath: Path,
    logs_dpath: Path,
    threads: int,
    extra: list[str] | None = None,
) -> tuple[subprocess.Popen, Path, Path]:
    """Start ``python -m sae_pipeline features`` on a demo run's last checkpoint; returns the process, its log and
    the site folder (``<out>/features/<name>``)."""
    config_fpath = find_config("", config_fname)
    site_dpath = out_dpath / "features" / name
    log_fpath = logs_dpath / f"features_{name}.log"
    command = [
        sys.executable,
        "-m",
        "sae_pipeline",
        "features",
        "--config",
        str(config_fpath),
        "--ckpt_path",
        "last",
        "--runs",
        str(runs_dpath),
        "--out",
        str(site_dpath),
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "1",
        *(extra or []),
    ]
    with log_fpath.open("w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_environment(threads))
    return process, log_fpath, site_dpath


def build_feature_sites(out_dpath: Path, variants: list[str], with_shards: bool, threads: int = 1) -> list[Path]:
    """The feature browser of the digits MP-SAE and of the photo-shard run (those that were trained), built in
    parallel; returns each site's ``index.html``. Raises RuntimeError naming the log of a failed build."""
    out_dpath = Path(out_dpath)
    runs_dpath, logs_dpath = out_dpath / "runs", out_dpath / "logs"
    logs_dpath.mkdir(parents=True, exist_ok=True)
    launched = []
    if "mpsae" in variants:
        launched.append(
            launch_features("mpsae_digits", "mpsae_digits.yaml", out_dpath, runs_dpath, logs_dpath, threads)
        )
    if with_shards:
        launched.append(
            launch_features(
                "demo_shards",
                "demo_shards.yaml",
                out_dpath,
                runs_dpath,
                logs_dpath,
                threads,
                ["--data.source", str(out_dpath / "shards")],
            )
        )
    sites = []
    for process, log_fpath, site_dpath in launched:
        code = process.wait()
        if code != 0:
            _print_tail("feature browser", code, log_fpath)
            raise RuntimeError(f"building {site_dpath} exited with code {code}; see {log_fpath}")
        sites.append(site_dpath / "index.html")
    return sites


def format_table(rows: list[tuple[str, dict[str, tuple[int, float]]]]) -> str:
    """Variant, val R², L0 and Babel μ₁ of the dictionary (r = 1, r = k) and of the co-active atoms (r = k)."""
    columns = [
        ("val R²", "val/r2", 7, 3),
        ("L0", "val/l0", 6, 2),
        ("dict μ₁(1)", "val/babel_dict_r1", 11, 3),
        ("dict μ₁(k)", "val/babel_dict_rk", 11, 3),
        ("co-active μ₁(k)", "val/babel_coactive_rk", 16, 3),
    ]
    label_width = max([10] + [len(label) + 1 for label, _ in rows])
    header = f"{'variant':<{label_width}}" + "".join(f" {title:>{width}}" for title, _, width, _ in columns)
    lines = [header, "-" * len(header)]
    for label, metrics in rows:
        cells = "".join(f" {metrics[tag][1]:>{width}.{digits}f}" for _, tag, width, digits in columns if tag in metrics)
        lines.append(f"{label:<{label_width}}{cells}")
    return "\n".join(lines)


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

    rows = []
    try:
        for variant in args.variants:
            rows.append((labels[variant], _last_run_metrics(runs_dpath / f"{variant}_digits")))
        shard_row = None if args.skip_shards else (SHARDS_LABEL, _last_run_metrics(runs_dpath / "demo_shards"))
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if shard_row is not None:
        rows.append(shard_row)
    step = rows[0][1]["val/r2"][0]
    print(f"\nFinal validation metrics (held-out data, logged at step {step}; Babel μ₁(r), r = 1 or k):")
    print(format_table(rows))
    if args.variants:
        print(
            "\nThe paper's claims (Costa et al. 2025): at equal k MP-SAE reaches the higher R², and it learns a "
            "more coherent\ndictionary (higher dictionary Babel) yet picks less coherent atoms per token (lower "
            "co-active Babel).\nThis run is short (240 steps on 8x8 digits, not MNIST): compare the whole curves "
            "in the val/babel figures."
        )
    if shard_row is not None:
        print(
            f"{SHARDS_LABEL}: trained on the photo shards in {out_dpath / 'shards'} (14 photos x 17 tokens of a "
            "random tiny ViT; d_sae = 256, k = 8,\nheld-out shard): a check that the pipeline runs end to end, "
            "not a result."
        )
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


def _print_tail(name: str, code: int, log_fpath: Path) -> None:
    tail = log_fpath.read_text(errors="replace").splitlines()[-15:]
    print(f"error: {name} exited with code {code}; end of {log_fpath}:", file=sys.stderr)
    print("\n".join(tail), file=sys.stderr)


def _wait(label: str, process: subprocess.Popen, log_fpath: Path, start: float) -> bool:
    """Wait for one run; print its outcome (and the end of its log on failure). True when it failed."""
    code = process.wait()
    if code == 0:
        print(f"  {label:<10} done after {time.perf_counter() - start:.0f} s", flush=True)
        return False
    _print_tail(f"{label} training", code, log_fpath)
    return True


if __name__ == "__main__":
    sys.exit(main())
