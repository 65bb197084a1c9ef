"""A fit run's checkpoints: where they live, which one ``--ckpt_path last`` means, how they are written.

Layout: one folder per run, next to its TensorBoard events, so a second ``fit`` of the same
config never leaves the first run's model under the name a user is told to use::

    runs/<config stem>/version_N/               TensorBoard events, config.yaml
    runs/<config stem>/version_N/checkpoints/   last.ckpt (the run's newest state) + periodic ones
    runs/<config stem>/slurm-<job>/             the same under SLURM, + hpc_ckpt_<n>.ckpt (requeue)

(``--trainer.default_root_dir DIR`` puts ``<config stem>/version_N/`` under DIR instead of runs.)
``last.ckpt`` is saved whenever the run stops: at the end of training whatever ``max_steps``
(Lightning skips it when the last step is not a checkpoint step), on SIGTERM / Ctrl-C
(:mod:`sae_pipeline.training.interrupts`) and alongside every periodic checkpoint. ``--ckpt_path last``
is the newest (by modification time) ``last*.ckpt`` or ``hpc_ckpt_*.ckpt`` over the config's
runs: the run that trained most recently, which a resumed run then continues in a new
``version_N``.

Writes are atomic (``feature_extraction.atomic_files.atomic_path``): the bytes go to a hidden
``.<name>.partial`` file in the same folder, are fsynced, and the file is renamed over the
target, so a ``kill -9`` at any moment leaves the previous checkpoint whole. A save that fails (a full
disk) says what it kept and how to resume from the newest: ``--ckpt_path last`` finds only ``last*.ckpt``,
so a newer periodic file is named. Reads go through the one
reader of every command, :func:`sae_pipeline.artifacts.checkpoint.read_checkpoint` (Lightning's restore
too, :class:`AtomicCheckpointIO`): ``--ckpt_path`` problems (missing, not a checkpoint, truncated, no
training state) are one-line ``CheckpointError`` s that never print torch's advice to load with
``weights_only=False`` (which would run code from the file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from feature_extraction.atomic_files import atomic_path
from sae_pipeline.artifacts.checkpoint import CheckpointError, read_checkpoint
from sae_pipeline.training import lightning_compat

LAST_FNAME = "last.ckpt"
CHECKPOINTS_DNAME = "checkpoints"
PARTIAL_SUFFIX = ".partial"


def run_checkpoints(run_dpath: str | Path) -> list[Path]:
    """Every resumable "newest state" checkpoint of a run name: ``*/checkpoints/last*.ckpt`` and
    Lightning's SLURM ``*/hpc_ckpt_*.ckpt`` under ``runs/<name>``, and ``last*.ckpt`` directly in it
    (an explicit ``--checkpoint.dirpath``) or in its ``checkpoints/`` (a run without a logger)."""
    run_dpath = Path(run_dpath)
    patterns = (
        f"*/{CHECKPOINTS_DNAME}/last*.ckpt",
        "*/hpc_ckpt_*.ckpt",
        "last*.ckpt",
        f"{CHECKPOINTS_DNAME}/last*.ckpt",
    )  # the last two: --checkpoint.dirpath, --trainer.logger false
    return sorted({fpath for pattern in patterns for fpath in run_dpath.glob(pattern) if fpath.is_file()})


def newest_checkpoint(search_dpaths: list[str | Path]) -> Path | None:
    """The most recently written of :func:`run_checkpoints` over ``search_dpaths`` (None if none)."""
    found = {fpath for dpath in search_dpaths for fpath in run_checkpoints(dpath)}
    stamped = []
    for fpath in found:
        try:
            stamped.append((fpath.stat().st_mtime_ns, str(fpath), fpath))
        except FileNotFoundError:  # replaced or removed meanwhile
            continue
    return max(stamped)[2] if stamped else None


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a hidden partial file, fsync, then rename over the target (see the module
    docstring). Remote (``scheme://``) paths keep Lightning's own writer."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial_fpath = target.with_name(f".{target.name}{PARTIAL_SUFFIX}")
        with atomic_path(target, partial_fpath, kept=_kept(target)) as partial, open(partial, "wb") as f:
            self.write(checkpoint, f, target)
        return None

    def write(self, checkpoint: dict[str, Any], f: BinaryIO, target: Path) -> None:
        """The checkpoint's bytes into the open partial file of ``target``. A separate method so that a
        subclass can change how they are written and keep the atomic rename around it: the tests' plugin
        (tests/pause_io.py) stops half-way, to kill or interrupt ``fit`` inside a save."""
        torch.save(checkpoint, f)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Through the one reader (always weights-only, checked like every ``--ckpt_path``): a checkpoint may
        come from someone else, and torch's default can be turned off from the environment
        (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``). Remote (``scheme://``) paths keep Lightning's reader, weights-only."""
        kwargs = {} if map_location is None else {"map_location": map_location}  # else Lightning's default
        if "://" in str(path):
            return super().load_checkpoint(path, weights_only=True, **kwargs)
        return read_checkpoint(path, **kwargs)


def _kept(target: Path) -> str:
    """What a failed save leaves: the checkpoints already in its folder, which it does not touch, and how to
    resume from the newest of them (``last`` finds only ``last*.ckpt``: a periodic file is named)."""
    stamped = sorted(_stamped(target.parent))
    if not stamped:
        return f"no checkpoint in {target.parent} yet"
    names = ", ".join(sorted(fpath.name for *_, fpath in stamped))
    return (
        f"the checkpoints already in {target.parent} ({names}), unchanged (fit {resume_flag(stamped[-1][-1])} "
        "resumes from the newest)"
    )


def _stamped(dpath: Path) -> list[tuple[int, bool, Path]]:
    """The checkpoints in ``dpath`` as ``(mtime, is a last*.ckpt, path)``: sorted, the newest is last, and of two
    written in the same instant the ``last*.ckpt`` (Lightning writes it after the periodic file of its step)."""
    stamped = []
    for fpath in dpath.glob("*.ckpt"):
        try:
            stamped.append((fpath.stat().st_mtime_ns, fpath.name.startswith("last"), fpath))
        except FileNotFoundError:  # replaced or removed meanwhile
            continue
    return stamped


def resume_flag(fpath: Path) -> str:
    """How ``fit`` resumes from ``fpath``: ``--ckpt_path last`` finds a run's newest ``last*.ckpt``
    (`run_checkpoints`), any other file must be named."""
    return "--ckpt_path last" if fpath.name.startswith("last") else f"--ckpt_path {fpath}"


def newest_whole_checkpoint(dpath: str | Path) -> tuple[Path, int] | None:
    """The most recently written checkpoint in ``dpath`` that reads whole with its training state, and its global
    step; None if there is none. What a stopped ``fit`` reports: the disk, not how far its save got."""
    for *_, fpath in sorted(_stamped(Path(dpath)), reverse=True):
        try:
            checkpoint = read_checkpoint(fpath, for_fit=True, mmap=True)
        except CheckpointError:
            continue
        return fpath, int(checkpoint.get("global_step", 0))
    return None


class SAECheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that always leaves the run's final state in ``last.ckpt``.

    Lightning saves ``last.ckpt`` only next to a periodic checkpoint, so a run whose
    ``max_steps`` is not a checkpoint step loses its last steps; this one saves at the end of
    training too (and on demand, for :mod:`sae_pipeline.training.interrupts`). The ``--checkpoint.*``
    flags are ModelCheckpoint's.
    """

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save_final(trainer)

    def save_final(self, trainer: L.Trainer) -> str | None:
        """Save ``last.ckpt`` unless it already holds this global step; return its path.
        Every rank must call it (the save is collective)."""
        if trainer.fast_dev_run:
            return None
        if self.save_last and self.last_model_path and lightning_compat.last_saved_step(self) == trainer.global_step:
            return self.last_model_path
        if self.save_last:
            lightning_compat.save_last_checkpoint(self, trainer)
            return self.last_model_path
        fpath = str(Path(self.dirpath or trainer.default_root_dir) / LAST_FNAME)
        trainer.save_checkpoint(fpath)
        return fpath


def final_checkpoint_dir(trainer: L.Trainer) -> Path:
    """The folder `save_final_checkpoint` writes the run's ``last.ckpt`` into."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, SAECheckpoint) and not trainer.fast_dev_run:
        return Path(callback.dirpath or trainer.default_root_dir)
    return Path(trainer.log_dir or trainer.default_root_dir) / CHECKPOINTS_DNAME


def save_final_checkpoint(trainer: L.Trainer) -> str:
    """Save the run's current state as its ``last.ckpt`` (through :class:`SAECheckpoint` when the
    trainer has one, so its bookkeeping follows); returns the path."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, SAECheckpoint):
        fpath = callback.save_final(trainer)
        if fpath:
            return fpath
    fpath = str(final_checkpoint_dir(trainer) / LAST_FNAME)
    trainer.save_checkpoint(fpath)
    return fpath
