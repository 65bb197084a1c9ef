"""The run lock: one `fit --ckpt_path last` resume of a run at a time.

Two resumes of the newest run of one config would write the same `last.ckpt` and TensorBoard folder, each
overwriting the other's steps. So the resume holds the run's lock (`feature_extraction.output_lock`, the lock
every command takes on its output: `RUN/.lock`) from the moment `--ckpt_path last` is resolved
(`sae_pipeline.resume_checks`) until the command ends; a second resume is refused in one line, exit 2. Only
rank 0 locks, as for every output. A resume from an explicit `--ckpt_path FILE` is not locked: the file may
be anyone's.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from feature_extraction.output_lock import output_lock

#: What the lock file says is holding the run (`... since T (fit --ckpt_path last)`).
COMMAND = "fit --ckpt_path last"


def run_of(ckpt_fpath: Path) -> Path:
    """The run folder of a checkpoint: `RUN/checkpoints/last.ckpt` -> `RUN`; any other checkpoint -> its folder."""
    return ckpt_fpath.parent.parent if ckpt_fpath.parent.name == "checkpoints" else ckpt_fpath.parent


def lock_run(ckpt_fpath: Path) -> AbstractContextManager[Any]:
    """The lock of the run `ckpt_fpath` belongs to, for a `fit` that resumes it: enter it to hold the run."""
    return output_lock(run_of(ckpt_fpath), COMMAND, what="the run")
