"""The run locks: a `fit` holds every run folder it writes, and the run it resumes, from before its first write.

Two fits writing one run folder would overwrite each other's `last.ckpt` and TensorBoard steps; and a second
`fit --ckpt_path last`, started once the first has saved a periodic checkpoint, would resolve `last` to the
first fit's own new `version_N`, fork it and train the same steps again. So a `fit` holds the lock
(`feature_extraction.output_lock`, the lock every command takes on its output: `RUN/.lock`) of

- its own run folder, taken before Lightning writes anything: a new `version_N`, claimed by creating it
  (`mkdir`, which one process wins: two fits starting at once get two versions) and handed to the
  TensorBoard logger; the version the config names instead (SLURM's `slurm-<job>`, where a requeued job
  takes over the lock its earlier run left); without a TensorBoard logger `--trainer.default_root_dir`; and
  the run of `--checkpoint.dirpath` when given (the folder `last` would name for its `last.ckpt`);
- with `--ckpt_path last`, the run `last` resolved to (`sae_pipeline.resume_checks`), from the moment it is
  resolved;

until the command ends. Whichever `version_N` a second `fit --ckpt_path last` resolves `last` to, it is
refused in one line, exit 2. Only rank 0 locks, as for every output; the other ranks take rank 0's folder
from Lightning's broadcast. A resume from an explicit `--ckpt_path FILE` does not lock the file's run (the
file may be anyone's), only its own new version.

A new `version_N` that its fit leaves without a checkpoint and without a trained step (bad input found once
the data is built, an allocation that failed, Ctrl-C before the first step) is removed with what TensorBoard
had begun in it: no empty run is left for `ls` or the next version number. One that trained keeps its logs.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from feature_extraction.output_lock import is_launching_process, output_lock

#: What the lock file says is holding the run (`... since T (fit --ckpt_path last)`).
COMMAND = "fit --ckpt_path last"
FIT_COMMAND = "fit"  # the lock of a fit's own run folder
VERSION_PREFIX = "version_"  # TensorBoardLogger's name of a numbered version


def run_of(ckpt_fpath: Path) -> Path:
    """The run folder of a checkpoint: `RUN/checkpoints/last.ckpt` -> `RUN`; any other checkpoint -> its folder."""
    return ckpt_fpath.parent.parent if ckpt_fpath.parent.name == "checkpoints" else ckpt_fpath.parent


def next_version(root: Path) -> int:
    """The number TensorBoardLogger would give a new run under `root`: one above the highest `version_N`."""
    numbers = [
        int(path.name[len(VERSION_PREFIX) :])
        for path in (root.iterdir() if root.is_dir() else ())
        if path.name.startswith(VERSION_PREFIX) and path.name[len(VERSION_PREFIX) :].isdigit() and path.is_dir()
    ]
    return max(numbers, default=-1) + 1


class RunLocks:
    """The run folders one command holds, entered into `stack` (which the CLI holds while the command runs);
    a folder is locked once however many roles it has (the run resumed may be the fit's own folder)."""

    def __init__(self, stack: ExitStack) -> None:
        self.stack = stack
        self.held: set[str] = set()

    def hold(self, dpath: Path, command: str = FIT_COMMAND) -> None:
        """Hold the lock of the run folder `dpath` until the command ends (`OutputLocked` if another holds it)."""
        key = os.path.realpath(dpath.expanduser())
        if key in self.held:
            return
        self.stack.enter_context(output_lock(dpath, command, what="the run"))
        self.held.add(key)

    def resume(self, ckpt_fpath: Path) -> None:
        """Hold the run that `--ckpt_path last` resolved to (`ckpt_fpath`, its newest checkpoint)."""
        self.hold(run_of(ckpt_fpath), COMMAND)

    def new_version(self, root: Path, trained: Callable[[], bool]) -> int | None:
        """Claim and hold a new `root/version_N` for this fit; returns N (None on ranks > 0, which claim nothing).

        `trained()` says whether the fit trained a step: if it did not, a failed fit's folder is removed
        (module docstring)."""
        if not is_launching_process():
            return None
        created = [path for path in (root, *root.parents) if not path.exists()]
        root.mkdir(parents=True, exist_ok=True)
        number = next_version(root)
        while True:
            dpath = root / f"{VERSION_PREFIX}{number}"
            try:
                dpath.mkdir()
                break
            except FileExistsError:  # another fit claimed it since the listing
                number += 1

        def clean_up(exc_type: Any, exc: Any, tb: Any) -> bool:  # noqa: ARG001 (ExitStack.push's signature)
            remove_unused(dpath, failed=exc_type is not None, trained=trained)
            for path in created:  # deepest first; one that holds anything stays, and so do its parents
                try:
                    path.rmdir()
                except OSError:
                    break
            return False

        self.stack.push(clean_up)  # runs after the lock, entered next, is released
        self.hold(dpath)
        return number

    def fit_outputs(self, config: Any, trained: Callable[[], bool]) -> bool:
        """Hold every run folder the `fit` of `config` (its section of the parsed CLI config) writes; returns
        whether a new version was claimed, which was then written into the logger's `version` (to be reset
        once the logger is built, so that `config.yaml` does not pin later fits to this version)."""
        claimed = False
        logger = config.trainer.get("logger")
        class_path = str(logger.get("class_path", "")) if hasattr(logger, "get") else ""
        if class_path.endswith("TensorBoardLogger"):
            root = Path(os.path.expandvars(str(logger.init_args.save_dir))).expanduser() / str(logger.init_args.name)
            version = logger.init_args.get("version")
            if version is None:
                number = self.new_version(root, trained)
                if number is not None:
                    logger.init_args.version = number
                    claimed = True
            else:
                self.hold(root / (version if isinstance(version, str) else f"{VERSION_PREFIX}{version}"))
        elif not logger and config.trainer.get("default_root_dir"):  # checkpoints in default_root_dir/checkpoints
            self.hold(Path(str(config.trainer.default_root_dir)))
        if config.checkpoint.get("dirpath"):
            self.hold(run_of(Path(str(config.checkpoint.dirpath)) / "last.ckpt"))
        return claimed


def remove_unused(dpath: Path, failed: bool, trained: Callable[[], bool]) -> None:
    """Remove a claimed version folder that its fit left empty, or, when the fit failed before its first
    trained step, that holds no checkpoint (only what TensorBoard and the config saver began)."""
    if not dpath.is_dir():
        return
    if failed and not any(dpath.rglob("*.ckpt")) and not trained():
        shutil.rmtree(dpath, ignore_errors=True)
        return
    try:
        dpath.rmdir()  # empty: nothing was logged (a fast_dev_run)
    except OSError:
        pass
