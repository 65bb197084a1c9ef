"""The study's training runs: plan a grid (variant x k x p) and train each through the real CLI.

Every run is ``python -m sae_pipeline fit --config <config_dir>/<variant>_<suffix>.yaml`` with
flags that override the dictionary size p, the sparsity k, the data source and the run length
(``configs/<variant>_digits.yaml`` for the bundled digits, a backbone's configs for shards),
so the study measures exactly what a user's ``fit`` would train. Runs that share data and steps
(every config section but the model, the source, the run length) train as one group (``fit`` of
``model.members``: one pass over the data for all of them; each member equals the run trained alone,
:mod:`sae_pipeline.training.group`) under ``runs/group_<hash>/``, and each is exported and recorded as
its own run; ``--group_runs false`` trains one ``fit`` per run. Each setting is trained from
``--sae_seeds`` seeds (:attr:`RunSpec.seed`): seed 0 is the run a study without seeds trained (same name and
settings, so older study folders are reused), seed s > 0 the run ``<name>_s<s>`` (in a group, a member with its
own ``seed``; alone, ``--seed_everything``). One job runs the CLI in-process
(:func:`sae_pipeline.cli.cli_main`, no interpreter start-up per run); ``jobs > 1`` runs that many
``python -m sae_pipeline fit`` subprocesses side by side. The training itself is
:mod:`sae_pipeline.evaluate.run_training`; this module plans the runs and finds what they left.

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
import json
import logging
from pathlib import Path

from feature_extraction.file_checks import load_json
from feature_extraction.shards import MANIFEST_FNAME, backbone_name, peek_manifest  # torch-free
from feature_extraction.store import location
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
    seed: int = 0  # the SAE seed replica (``--sae_seeds``): 0 is the run a study without replicas trains

    @property
    def name(self) -> str:
        """``<variant>_p<p>_k<k>``, and ``_s<seed>`` for a replica other than seed 0 (so a study written before
        replicas existed, whose runs are all seed 0, is reused as it is)."""
        return f"{self.variant}_p{self.p}_k{self.k}" + (f"_s{self.seed}" if self.seed else "")

    @property
    def base_name(self) -> str:
        """The name of the setting the replicas share (seed 0's run name)."""
        return f"{self.variant}_p{self.p}_k{self.k}"

    def settings(self) -> dict:
        """What a finished run must match; seed 0 leaves ``seed`` out, as runs written before replicas did."""
        settings = dataclasses.asdict(self)
        if not self.seed:
            del settings["seed"]
        return settings

    def training_seed(self) -> int:
        """The seed the replica trains with: the config's ``seed_everything`` (0 when it sets none) plus ``seed``."""
        base = self.config().get("seed_everything")
        return (base if isinstance(base, int) and not isinstance(base, bool) else 0) + self.seed

    def config(self) -> dict:
        return load_config(self.config_fpath)

    def fit_args(self, out_dpath: Path) -> list[str]:
        """The ``fit`` command line (without ``python -m sae_pipeline``)."""
        args = ["fit", "--config", self.config_fpath, "--data.source", self.source]
        args += ["--model.sae.init_args.d_sae", str(self.p), *sparsity_args(self.variant, self.k, self.source)]
        if self.seed:  # alone, a replica's seed also redraws the batch order (in a group it shares the stream)
            args += ["--seed_everything", str(self.training_seed())]
        return args + self.run_args(out_dpath, self.name)

    def member(self) -> dict:
        """This run as a member of a group (``model.members.<name>``, :mod:`sae_pipeline.training.group`):
        its config's model section with p and the sparsity of k set, as :meth:`fit_args` sets them."""
        from sae_pipeline.sae import SAE_REGISTRY

        model = dict(self.config().get("model") or {})
        sae = dict(model.pop("sae"))
        init_args = {**(sae.get("init_args") or {}), "d_sae": self.p}
        init_args.update(SAE_REGISTRY[self.variant].sparsity_init_args(self.k, self.source))
        member = {"sae": {"class_path": sae["class_path"], "init_args": init_args}, **model}
        if self.seed:  # its initial weights drawn from its own seed; the batches are the group's
            member["seed"] = self.training_seed()
        return member

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
    fpath = location(source, "--data")
    if fpath.suffix in (".h5", ".hdf5") and fpath.is_file():
        return
    if fpath.is_dir() and (fpath / MANIFEST_FNAME).is_file():
        return
    what = f"has no {MANIFEST_FNAME} (finish the extraction first)" if fpath.is_dir() else "not found"
    raise ValueError(
        f"--data {fpath}: {what}; pass digits, mnist, mnist_sample, a shard directory (or its s3:// URL) or an .h5 "
        "token cache"
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
    sae_seeds: int = 1,
) -> list[RunSpec]:
    """One :class:`RunSpec` per variant, (k, p) point and SAE seed (``sae_seeds`` replicas, seed 0 first), in a
    stable order, without duplicates."""
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
            for seed in range(sae_seeds):
                spec = RunSpec(variant, k, p, max_steps, source, str(config_fpath), sha, data_dpath, seed)
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
    record = read_run_record(model_dpath)
    if record is None or record["settings"] != spec.settings():
        return False
    try:
        check_export(model_dpath)
    except ExportError as exn:
        logging.getLogger(__name__).warning("%s; training %s again", exn, spec.name)
        return False
    return True


def read_run_record(model_dpath: Path) -> dict | None:
    """``models/<name>/study_run.json``: ``{settings, command, log_dpath[, group]}`` (``settings`` required, the
    others strings where present, ``log_dpath`` with ``group``), or None when it is missing or not that (cut short,
    edited, another program's): such a run is not finished and is trained again.

    Read bounded (`feature_extraction.file_checks`); ``group`` names a folder under ``runs/``, so it must be one
    plain folder name."""
    try:
        record = load_json(
            Path(model_dpath) / RUN_FNAME,
            what="run record",
            fix="the run is trained again",
            kind=dict,
            max_bytes=1 << 20,
        )
    except (OSError, ValueError):
        return None
    group = record.get("group")
    if not (
        isinstance(record.get("settings"), dict)
        and all(isinstance(record.get(key, ""), str) for key in ("command", "log_dpath"))
        and (group is None or isinstance(group, str) and Path(group).name == group and group not in ("", ".", ".."))
        and (group is None or "log_dpath" in record)
    ):
        return None
    return record


def log_dpath(spec: RunSpec, out_dpath: Path) -> Path:
    """The run's TensorBoard folder: the one version folder of a fresh run (``version_0``, or
    ``slurm-<job id>`` when trained inside a SLURM job, see :mod:`sae_pipeline.cli`); for a run trained
    in a group, its member folder ``runs/<group>/<version>/<name>``."""
    record = read_run_record(Path(out_dpath) / "models" / spec.name) or {}
    if record.get("group"):
        member_dpath = Path(out_dpath) / "runs" / str(record["group"]) / Path(str(record["log_dpath"])).parent.name
        return member_dpath / spec.name
    run_dpath = Path(out_dpath) / "runs" / spec.name
    versions = tensorboard_versions(run_dpath)
    if not versions:
        raise ValueError(
            f"{run_dpath}: no TensorBoard events; delete {Path(out_dpath) / 'models' / spec.name} "
            "and rerun the study to retrain it"
        )
    return run_dpath / versions[-1]


def tensorboard_versions(run_dpath: Path) -> list[str]:
    """Names of the run's TensorBoard version folders (those holding an event file), sorted; none for a missing run."""
    return sorted(d.name for d in run_dpath.glob("*") if d.is_dir() and any(d.glob("events.out.tfevents*")))
