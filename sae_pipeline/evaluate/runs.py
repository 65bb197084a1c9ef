"""The study's training runs: plan a grid (variant x k x p) and train each through the real CLI.

Every run is ``python -m sae_pipeline fit --config <config_dir>/<variant>_<suffix>.yaml`` with
flags that override the dictionary size p, the sparsity k, the data source and the run length
(``configs/<variant>_digits.yaml`` for the bundled digits, a backbone's configs for shards),
so the study measures exactly what a user's ``fit`` would train. Runs that share data and steps
(every config section but the model, the source, the run length) train as one group
(:func:`train_group`, ``fit`` of ``model.members``: one pass over the data for all of them; each member
equals the run trained alone, :mod:`sae_pipeline.training.group`) under ``runs/group_<hash>/``, and each
is exported and recorded as its own run; ``--group_runs false`` trains one ``fit`` per run. One job runs the CLI
in-process (:func:`sae_pipeline.cli.cli_main`, no interpreter start-up per run); ``jobs > 1``
runs that many ``python -m sae_pipeline fit`` subprocesses side by side.

Layout under ``OUT``: ``runs/<name>/version_0`` (TensorBoard), ``runs/<name>/checkpoints``,
``models/<name>`` (the export: ``sae.safetensors`` + ``config.json``) and
``models/<name>/study_run.json`` (the run's settings, written last). Resume rule: a run whose
``study_run.json`` exists and equals the planned settings is finished and never retrained. A run
that was interrupted (Ctrl-C or SIGTERM make ``fit`` save ``last.ckpt`` before it exits) continues
from that checkpoint, in the same TensorBoard folder, when ``runs/<name>/study_plan.json`` (its
settings, written when it started) equals the planned settings; any other run is trained from
scratch (its old folders are deleted first, so a half-written run cannot mix versions or
checkpoints).

How k reaches each variant (the paper compares SAEs "at equal sparsity") is the variant class's
knowledge, ``sparsity_init_args(k, data)``: TopK, BatchTopK and MP-SAE take k itself; JumpReLU its
``target_l0``; ReLU has no k, so its L1 coefficient is calibrated from k and the data
(``ReLUSAE.l1_for_k``) and its measured L0 is reported beside it.

The variants are those of the registry (:mod:`sae_pipeline.sae`), read where they are used, because
importing it loads torch and this module must stay light (``python -m sae_pipeline.evaluate --help``
and flag errors answer without torch).
"""

from __future__ import annotations

import dataclasses
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
from feature_extraction.shards import MANIFEST_FNAME, backbone_name, peek_manifest  # torch-free
from sae_pipeline.config_files import config_sha256, load_config  # torch-free

ROW_SOURCES = ("digits", "mnist", "mnist_sample")
MNIST_SOURCES = ("mnist", "mnist_sample")  # 28x28: configs/<variant>_mnist.yaml
STUDIES = ("expressivity", "inference", "coherence", "concepts")
RUN_FNAME = "study_run.json"
PLAN_FNAME = "study_plan.json"  # runs/<name>/: the settings a run was started with (to resume it)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run of the study; its fields are the settings a finished run must match."""

    variant: str
    k: int
    p: int
    max_steps: int | None
    source: str
    config_fpath: str
    config_sha256: str
    data_dpath: str | None = None

    @property
    def name(self) -> str:
        return f"{self.variant}_p{self.p}_k{self.k}"

    def settings(self) -> dict:
        return dataclasses.asdict(self)

    def config(self) -> dict:
        return load_config(self.config_fpath)

    def fit_args(self, out_dpath: Path) -> list[str]:
        """The ``fit`` command line (without ``python -m sae_pipeline``)."""
        args = ["fit", "--config", self.config_fpath, "--data.source", self.source]
        args += ["--model.sae.init_args.d_sae", str(self.p), *sparsity_args(self.variant, self.k, self.source)]
        return args + self.run_args(out_dpath, self.name)

    def member(self) -> dict:
        """This run as a member of a group (``model.members.<name>``, :mod:`sae_pipeline.training.group`):
        its config's model section with p and the sparsity of k set, as :meth:`fit_args` sets them."""
        from sae_pipeline.sae import SAE_REGISTRY

        model = dict(self.config().get("model") or {})
        sae = dict(model.pop("sae"))
        init_args = {**(sae.get("init_args") or {}), "d_sae": self.p}
        init_args.update(SAE_REGISTRY[self.variant].sparsity_init_args(self.k, self.source))
        return {"sae": {"class_path": sae["class_path"], "init_args": init_args}, **model}

    def shared(self) -> str:
        """What runs must share to train as one group: data, steps and every config section but the model."""
        config = {key: value for key, value in self.config().items() if key != "model"}
        return json.dumps([self.source, self.data_dpath, self.max_steps, config], sort_keys=True, default=str)

    def run_args(self, out_dpath: Path, name: str) -> list[str]:
        """The flags of a run named ``name`` (one run, or a group): where it writes, data, length, validation."""
        runs_dpath = Path(out_dpath) / "runs"
        args = [
            "--trainer.logger.init_args.save_dir",
            str(runs_dpath),
            "--trainer.logger.init_args.name",
            name,
            "--checkpoint.dirpath",
            str(runs_dpath / name / "checkpoints"),
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_model_summary",
            "false",
        ]
        if self.data_dpath is not None:
            args += ["--data.data_dpath", self.data_dpath]
        if self.max_steps is not None:
            # Validate exactly once, after the last step: the logged val/r2 is the final model's.
            args += [
                "--trainer.max_steps",
                str(self.max_steps),
                "--trainer.max_epochs",
                "-1",
                "--trainer.check_val_every_n_epoch",
                "null",
                "--trainer.val_check_interval",
                str(self.max_steps),
            ]
        else:
            epochs = (self.config().get("trainer") or {}).get("max_epochs")
            if not isinstance(epochs, int) or epochs < 1:
                raise ValueError(f"{self.config_fpath} sets no trainer.max_epochs; pass --max_steps N")
            args += ["--trainer.check_val_every_n_epoch", str(epochs)]
        return args


def sparsity_args(variant: str, k: int, data: str = "digits") -> list[str]:
    """The flags that set sparsity k for ``variant`` on ``data`` (the class's ``sparsity_init_args``)."""
    from sae_pipeline.sae import SAE_REGISTRY

    if variant not in SAE_REGISTRY:
        raise ValueError(f"unknown variant {variant!r} in --variants; choose from {', '.join(SAE_REGISTRY)}")
    init_args = SAE_REGISTRY[variant].sparsity_init_args(k, data)
    return [item for name, value in init_args.items() for item in (f"--model.sae.init_args.{name}", str(value))]


def find_config_dpath(config_dir: str | None) -> Path:
    """``--config_dir``, else ``configs/`` in the current directory, else beside the package."""
    if config_dir is not None:
        dpath = Path(config_dir)
        if not dpath.is_dir():
            raise ValueError(
                f"--config_dir {config_dir}: not a directory; point it at a folder of "
                "<variant>_<suffix>.yaml training configs"
            )
        return dpath
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / "configs").is_dir():
            return root / "configs"
    raise ValueError("no configs/ folder in the current directory or the source checkout; pass --config_dir DIR")


def check_source(source: str) -> None:
    """One-line error for a data source that cannot exist (before anything is written)."""
    if source in ROW_SOURCES:
        return
    fpath = Path(source)
    if fpath.suffix in (".h5", ".hdf5") and fpath.is_file():
        return
    if fpath.is_dir() and (fpath / MANIFEST_FNAME).is_file():
        return
    what = f"has no {MANIFEST_FNAME} (finish the extraction first)" if fpath.is_dir() else "not found"
    raise ValueError(
        f"--data {source}: {what}; pass digits, mnist, mnist_sample, a shard directory or an .h5 token cache"
    )


def config_suffix_for(source: str, suffix: str | None) -> str:
    """``--config_suffix``, else ``mnist`` for MNIST (full or sample), ``digits`` for digits, else the shard
    manifest's backbone name."""
    if suffix is not None:
        return suffix
    if source in MNIST_SOURCES:
        return "mnist"
    if source in ROW_SOURCES:
        return "digits"
    manifest = peek_manifest(source)
    if manifest is not None and (name := backbone_name(manifest)):
        return name
    raise ValueError(
        f"--data {source}: cannot tell which configs to use; pass --config_suffix (e.g. dinov2 for "
        "configs/<variant>_dinov2.yaml)"
    )


def plan_runs(
    variants: list[str],
    points: list[tuple[int, int]],
    source: str,
    max_steps: int | None,
    config_dpath: Path,
    suffix: str,
    data_dpath: str | None = None,
) -> list[RunSpec]:
    """One :class:`RunSpec` per variant and (k, p) point, in a stable order, without duplicates."""
    from sae_pipeline.sae import SAE_REGISTRY

    specs: dict[str, RunSpec] = {}
    for variant in variants:
        if variant not in SAE_REGISTRY:
            raise ValueError(f"unknown variant {variant!r} in --variants; choose from {', '.join(SAE_REGISTRY)}")
        config_fpath = config_dpath / f"{variant}_{suffix}.yaml"
        if not config_fpath.is_file():
            raise ValueError(
                f"{config_fpath}: not found; pass --config_dir / --config_suffix naming existing "
                f"<variant>_<suffix>.yaml configs"
            )
        sha = config_sha256(config_fpath)  # the file and the pieces it includes
        for k, p in points:
            if k > p:
                raise ValueError(f"--k {k} exceeds the dictionary size p = {p}; choose k <= p")
            spec = RunSpec(variant, k, p, max_steps, source, str(config_fpath), sha, data_dpath)
            specs.setdefault(spec.name, spec)
    return list(specs.values())


def is_finished(spec: RunSpec, out_dpath: Path) -> bool:
    """True when the run's export exists, intact, with exactly these settings (then it is not retrained).

    A damaged export (a file cut short or changed since, found by ``artifacts.export.check_export``) is
    logged and trained again, rather than stopping the study at its evaluation.
    """
    from sae_pipeline.artifacts.export import ExportError, check_export

    model_dpath = Path(out_dpath) / "models" / spec.name
    marker = model_dpath / RUN_FNAME
    if not (marker.is_file() and (model_dpath / "sae.safetensors").is_file()):
        return False
    try:
        if json.loads(marker.read_text()).get("settings") != spec.settings():
            return False
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    try:
        check_export(model_dpath)
    except ExportError as exn:
        logging.getLogger(__name__).warning("%s; training %s again", exn, spec.name)
        return False
    return True


def log_dpath(spec: RunSpec, out_dpath: Path) -> Path:
    """The run's TensorBoard folder: the one version folder of a fresh run (``version_0``, or
    ``slurm-<job id>`` when trained inside a SLURM job, see :mod:`sae_pipeline.cli`); for a run trained
    in a group, its member folder ``runs/<group>/<version>/<name>``."""
    try:
        record = json.loads((Path(out_dpath) / "models" / spec.name / RUN_FNAME).read_text())
    except (OSError, ValueError):
        record = {}
    if isinstance(record, dict) and record.get("group"):
        member_dpath = Path(out_dpath) / "runs" / str(record["group"]) / Path(str(record["log_dpath"])).parent.name
        return member_dpath / spec.name
    run_dpath = Path(out_dpath) / "runs" / spec.name
    versions = sorted(d for d in run_dpath.glob("*") if d.is_dir() and any(d.glob("events.out.tfevents*")))
    if not versions:
        raise ValueError(
            f"{run_dpath}: no TensorBoard events; delete {Path(out_dpath) / 'models' / spec.name} "
            "and rerun the study to retrain it"
        )
    return versions[-1]


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
    one group (:func:`train_group`: one pass over the data for all of them); ``jobs`` then counts groups.
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

    units: dict[str, list[RunSpec]] = {}
    for spec in todo:
        units.setdefault(spec.shared() if group else spec.name, []).append(spec)

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
        return [spec for unit in units.values() for spec in one(unit)]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        try:
            return [spec for unit in pool.map(one, units.values()) for spec in unit]
        except BaseException:  # Ctrl-C / SIGTERM (or a failed run): the other runs save and stop too
            pool.shutdown(wait=False, cancel_futures=True)
            _stop_live_runs()
            raise


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
    if resume is None:
        shutil.rmtree(run_dpath, ignore_errors=True)
        run_dpath.mkdir(parents=True)
        config = {key: value for key, value in specs[0].config().items() if key != "model"}
        config["model"] = {"members": {spec.name: spec.member() for spec in specs}}
        config = json.loads(json.dumps(config))  # plain ints (jsonargparse's PositiveInt is a subclass)
        write_text_atomic(config_fpath, yaml.safe_dump(config, sort_keys=False))
        write_text_atomic(run_dpath / PLAN_FNAME, json.dumps(plan, indent=2) + "\n")
    args = ["fit", "--config", str(config_fpath), "--data.source", specs[0].source, *specs[0].run_args(out_dpath, name)]
    ckpt_fpath = _fit(args, resume, run_dpath, out_dpath, f"group {name}", in_process, threads)
    from sae_pipeline.artifacts.export import export_checkpoint

    version = _versions(run_dpath)[-1]
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


def _versions(run_dpath: Path) -> list[str]:
    return sorted(d.name for d in run_dpath.iterdir() if d.is_dir() and any(d.glob("events.out.tfevents*")))


def _interrupted(run_dpath: Path, plan: object) -> tuple[Path, str] | None:
    """``(last.ckpt, its version folder)`` of an interrupted run (or group) planned as ``plan``, else None."""
    from sae_pipeline.artifacts.checkpoint import CheckpointError, read_checkpoint

    ckpt_fpath, plan_fpath = run_dpath / "checkpoints" / "last.ckpt", run_dpath / PLAN_FNAME
    if not (ckpt_fpath.is_file() and plan_fpath.is_file()):
        return None
    try:
        if json.loads(plan_fpath.read_text()) != plan:
            return None
        read_checkpoint(ckpt_fpath, need=("global_step",), for_fit=True, mmap=True)
    except (json.JSONDecodeError, UnicodeDecodeError, CheckpointError, OSError):
        return None
    versions = _versions(run_dpath)
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
