"""The demo's stages: each one the real command a user would type, run in its own process.

`python -m feature_extraction` into `<out>/shards` (resumed, or started afresh when the folder holds another
extraction), `python -m sae_pipeline fit` on the photo shards and on the digits, `python -m sae_pipeline features`
on the runs: their output goes to `<out>/logs/`, and a failed stage prints the end of its log. What `make demo`
runs in turn (`sae_pipeline.demo`), and what `tests/test_demo.py` runs alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from sae_pipeline.demo_report import last_run_metrics

SHARD_SIZE = 2  # images per shard: 7 shards of the 14 photos
# Messages of feature_extraction's check that --out holds the same extraction (extract.py)
OTHER_EXTRACTION = ("was extracted with other settings", "holds shards of backbone", "holds shard files but no")


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
        print_tail("extraction", code, log_fpath)
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
        print_tail("demo_shards", code, log_fpath)
        raise RuntimeError(f"training on {shards_dpath} exited with code {code}; see {log_fpath}")
    return last_run_metrics(runs_dpath / "demo_shards")


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
            print_tail("feature browser", code, log_fpath)
            raise RuntimeError(f"building {site_dpath} exited with code {code}; see {log_fpath}")
        sites.append(site_dpath / "index.html")
    return sites


def print_tail(name: str, code: int, log_fpath: Path) -> None:
    """Say on stderr that a stage failed, with the last lines of its log."""
    tail = log_fpath.read_text(errors="replace").splitlines()[-15:]
    print(f"error: {name} exited with code {code}; end of {log_fpath}:", file=sys.stderr)
    print("\n".join(tail), file=sys.stderr)
