"""Training a study's planned runs (:mod:`.runs` plans them): one ``fit`` per run, or one per group of runs
that share data and steps, in-process or as ``jobs`` subprocesses side by side; each run exported and
recorded in ``models/<name>/study_run.json``, an interrupted run or group continued from its ``last.ckpt``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from feature_extraction.atomic_files import write_text_atomic
from feature_extraction.file_checks import load_json
from sae_pipeline.evaluate.runs import PLAN_FNAME, RUN_FNAME, RunSpec, is_finished, log_dpath, tensorboard_versions


def ensure_runs(
    specs: list[RunSpec],
    out_dpath: Path,
    jobs: int = 1,
    on_done: Callable[[RunSpec, bool], None] | None = None,
    group: bool = True,
) -> list[RunSpec]:
    """Train and export every unfinished run; returns the runs that were trained.

    ``on_done(spec, trained)`` is called once per run (the progress bar), finished runs first. With
    ``group``, unfinished runs that share data, steps and every config section but the model train as
    one group (:func:`train_group`: one pass over the data for all of them), split so that each of the
    ``jobs`` has one (:func:`work_units`).
    """
    out_dpath = Path(out_dpath)
    todo = []
    for spec in specs:
        if is_finished(spec, out_dpath):
            if on_done:
                on_done(spec, False)
        else:
            todo.append(spec)
    (out_dpath / "logs").mkdir(parents=True, exist_ok=True)

    units = work_units(todo, group, jobs)

    def one(unit: list[RunSpec]) -> list[RunSpec]:
        threads = max(1, (os.cpu_count() or 1) // jobs)
        if len(unit) == 1:
            train_and_export(unit[0], out_dpath, in_process=jobs == 1, threads=threads)
        else:
            train_group(unit, out_dpath, in_process=jobs == 1, threads=threads)
        for spec in unit:
            if on_done:
                on_done(spec, True)
        return unit

    if jobs == 1:
        return [spec for unit in units for spec in one(unit)]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        try:
            return [spec for unit in pool.map(one, units) for spec in unit]
        except BaseException:  # Ctrl-C / SIGTERM (or a failed run): the other runs save and stop too
            pool.shutdown(wait=False, cancel_futures=True)
            _stop_live_runs()
            raise


def work_units(todo: list[RunSpec], group: bool, jobs: int) -> list[list[RunSpec]]:
    """The ``fit`` commands to run: each run alone, or (``group``) the runs that share data and steps
    together. Groups are split until every job has one: a grid whose runs all share data would
    otherwise be one group, one job, and the other jobs' cores would idle (each job gets
    ``cpu_count // jobs`` threads). The costliest part is split first (:func:`split_evenly`)."""
    keyed: dict[str, list[RunSpec]] = {}
    for spec in todo:
        keyed.setdefault(spec.shared() if group else spec.name, []).append(spec)
    units = list(keyed.values())
    while len(units) < jobs and any(len(unit) > 1 for unit in units):
        costliest = max(units, key=lambda unit: sum(map(run_cost, unit)) if len(unit) > 1 else -1)
        units.remove(costliest)
        units += split_evenly(costliest)
    return units


def run_cost(spec: RunSpec) -> int:
    """A run's cost relative to the grid's others, for balancing: ``p · k`` (every variant's step grows
    with the dictionary, a pursuit's also with its steps)."""
    return spec.p * max(spec.k, 1)


def split_evenly(unit: list[RunSpec]) -> list[list[RunSpec]]:
    """Two parts of a group that take about as long: each variant's runs, costliest first, dealt in
    snake order (A B B A, continuing across variants), so each part gets half of every variant and
    its costly and cheap runs alternate. Dealing alternately in plan order gave one half every
    k = 40 and p = 2000 run of the MNIST grid (it trained 6 minutes after the other had finished)."""
    variants = list(dict.fromkeys(spec.variant for spec in unit))
    ordered = sorted(unit, key=lambda spec: (variants.index(spec.variant), -run_cost(spec)))
    parts: tuple[list[RunSpec], list[RunSpec]] = ([], [])
    for index, spec in enumerate(ordered):
        parts[index % 4 in (1, 2)].append(spec)
    return [parts[0], parts[1]]


_LIVE: set[subprocess.Popen] = set()  # the `fit` subprocesses running now (jobs > 1)
_LIVE_LOCK = threading.Lock()


def _stop_live_runs() -> None:
    """SIGTERM to every running ``fit`` subprocess: each saves its ``last.ckpt`` and exits (a rerun resumes it)."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for process in live:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in live:
        process.wait()


def train_and_export(spec: RunSpec, out_dpath: Path, in_process: bool = True, threads: int = 1) -> Path:
    """Train one run from scratch through the CLI, export it, then write its ``study_run.json``."""
    run_dpath, model_dpath = out_dpath / "runs" / spec.name, out_dpath / "models" / spec.name
    resume = interrupted_run(spec, out_dpath)
    shutil.rmtree(model_dpath, ignore_errors=True)
    args = spec.fit_args(out_dpath)
    if resume is None:
        shutil.rmtree(run_dpath, ignore_errors=True)
        run_dpath.mkdir(parents=True)
        write_text_atomic(run_dpath / PLAN_FNAME, json.dumps(spec.settings(), indent=2) + "\n")
    ckpt_fpath = _fit(args, resume, run_dpath, out_dpath, f"run {spec.name}", in_process, threads)
    from sae_pipeline.artifacts.export import export_checkpoint  # torch: imported only when a run is trained

    export_checkpoint(ckpt_fpath, model_dpath)
    record = {
        "settings": spec.settings(),
        "command": "python -m sae_pipeline " + " ".join(args),
        "log_dpath": str(log_dpath(spec, out_dpath)),
    }
    write_text_atomic(model_dpath / RUN_FNAME, json.dumps(record, indent=2) + "\n")  # the marker appears whole, last
    return model_dpath


def group_name(specs: list[RunSpec]) -> str:
    """``group_<hash of the members' settings>``: the same group of runs gets the same folder (to resume it)."""
    digest = hashlib.sha256(json.dumps([spec.settings() for spec in specs], sort_keys=True).encode()).hexdigest()
    return f"group_{digest[:12]}"


def train_group(specs: list[RunSpec], out_dpath: Path, in_process: bool = True, threads: int = 1) -> list[Path]:
    """Train runs that share data and steps as one group (``fit`` of ``model.members``, one pass over the data),
    then export each member into ``models/<name>`` and write its ``study_run.json``, as :func:`train_and_export`
    does for one run. A member equals the run trained alone (:mod:`sae_pipeline.training.group`); its
    TensorBoard run is ``runs/<group>/<version>/<name>``."""
    import yaml

    name = group_name(specs)
    run_dpath = out_dpath / "runs" / name
    plan = [spec.settings() for spec in specs]
    resume = _interrupted(run_dpath, plan)
    for spec in specs:
        shutil.rmtree(out_dpath / "models" / spec.name, ignore_errors=True)
    config_fpath = run_dpath / "group.yaml"
    config = {key: value for key, value in specs[0].config().items() if key != "model"}
    config["model"] = {"members": {spec.name: spec.member() for spec in specs}}
    config = json.loads(json.dumps(config))  # plain ints (jsonargparse's PositiveInt is a subclass)
    if resume is None:
        shutil.rmtree(run_dpath, ignore_errors=True)
        run_dpath.mkdir(parents=True)
        write_text_atomic(config_fpath, yaml.safe_dump(config, sort_keys=False))
        write_text_atomic(run_dpath / PLAN_FNAME, json.dumps(plan, indent=2) + "\n")
    else:
        check_stored_config(config_fpath, config)
    args = ["fit", "--config", str(config_fpath), "--data.source", specs[0].source, *specs[0].run_args(out_dpath, name)]
    ckpt_fpath = _fit(args, resume, run_dpath, out_dpath, f"group {name}", in_process, threads)
    from sae_pipeline.artifacts.export import export_checkpoint

    version = tensorboard_versions(run_dpath)[-1]
    model_dpaths = []
    for spec in specs:
        model_dpath = out_dpath / "models" / spec.name
        export_checkpoint(ckpt_fpath, model_dpath, name=spec.name)
        record = {
            "settings": spec.settings(),
            "command": "python -m sae_pipeline " + " ".join(args),
            "group": name,
            "log_dpath": str(run_dpath / version / spec.name),
        }
        write_text_atomic(model_dpath / RUN_FNAME, json.dumps(record, indent=2) + "\n")
        model_dpaths.append(model_dpath)
    return model_dpaths


def check_stored_config(config_fpath: Path, config: dict) -> None:
    """Refuse to resume a group whose stored ``group.yaml`` is not the one this study writes for it.

    A study folder may come from someone else, and ``fit --config`` imports every class its config names
    (a callback's ``class_path``, from the folder the user runs in). The file is a function of the
    study's plan, so the one this run would write is the check: any edit is refused, nothing imported.
    """
    from sae_pipeline.config_files import read_yaml

    try:
        stored = read_yaml(config_fpath)
    except (OSError, ValueError):
        stored = None
    if stored != config:
        raise ValueError(
            f"{config_fpath}: not the config this study writes for the group (edited, or from another version); "
            f"nothing was imported or trained: delete {config_fpath.parent} to train the group again"
        )


def _fit(
    args: list[str],
    resume: tuple[Path, str] | None,
    run_dpath: Path,
    out_dpath: Path,
    what: str,
    in_process: bool,
    threads: int,
) -> Path:
    """Run ``fit`` (continuing ``resume``'s checkpoint and version folder when given); its ``last.ckpt``."""
    if resume is not None:
        args += ["--ckpt_path", str(resume[0]), "--trainer.logger.init_args.version", resume[1]]
    if in_process:
        _fit_in_process(args)
    else:
        _fit_subprocess(args, out_dpath / "logs" / f"{run_dpath.name}.log", threads)
    ckpt_fpath = run_dpath / "checkpoints" / "last.ckpt"
    if not ckpt_fpath.is_file():
        raise RuntimeError(f"{what} finished without {ckpt_fpath}; see {out_dpath / 'logs'}")
    return ckpt_fpath


def _interrupted(run_dpath: Path, plan: object) -> tuple[Path, str] | None:
    """``(last.ckpt, its version folder)`` of an interrupted run (or group) planned as ``plan``, else None."""
    from sae_pipeline.artifacts.checkpoint import read_checkpoint

    ckpt_fpath, plan_fpath = run_dpath / "checkpoints" / "last.ckpt", run_dpath / PLAN_FNAME
    if not (ckpt_fpath.is_file() and plan_fpath.is_file()):
        return None
    try:  # a plan that is not this one (or not readable) starts the run afresh
        if load_json(plan_fpath, what="run plan", fix="the run starts afresh", max_bytes=1 << 20) != plan:
            return None
        read_checkpoint(ckpt_fpath, need=("global_step",), for_fit=True, mmap=True)
    except (ValueError, OSError):  # CheckpointError is a ValueError
        return None
    versions = tensorboard_versions(run_dpath)
    return (ckpt_fpath, versions[0]) if len(versions) == 1 else None


def interrupted_run(spec: RunSpec, out_dpath: Path) -> tuple[Path, str] | None:
    """``(last.ckpt, its TensorBoard version folder name)`` of an interrupted run of these settings, else None."""
    return _interrupted(Path(out_dpath) / "runs" / spec.name, spec.settings())


def _fit_in_process(args: list[str]) -> None:
    from sae_pipeline.cli import cli_main
    from sae_pipeline.training.interrupts import stop_signals

    quiet = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning")]
    levels = [logger.level for logger in quiet]
    argv = sys.argv
    try:
        for logger in quiet:
            logger.setLevel(logging.WARNING)
        sys.argv = [argv[0]]  # LightningCLI(args=...) warns when sys.argv holds arguments too
        # stop_signals: a Ctrl-C before the Trainer's Interrupts callback is armed stops with 130 too (Python's
        # KeyboardInterrupt there would become Lightning's silent exit 1)
        with warnings.catch_warnings(), stop_signals():
            warnings.simplefilter("ignore")
            cli_main(args)
    finally:
        sys.argv = argv
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)


def _fit_subprocess(args: list[str], log_fpath: Path, threads: int) -> None:
    command = [sys.executable, "-m", "sae_pipeline", *args]
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONWARNINGS": "ignore",
    }
    with log_fpath.open("w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)
        with _LIVE_LOCK:
            _LIVE.add(process)
        try:
            code = process.wait()
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(process)
    if code != 0:
        tail = log_fpath.read_text(errors="replace").strip().splitlines()[-1:]
        raise RuntimeError(f"training exited with code {code} ({' '.join(tail)}); see {log_fpath}")
