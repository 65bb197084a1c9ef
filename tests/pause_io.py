"""A checkpoint writer that stops half-way through a save of ``last.ckpt``, so that a test can kill or
interrupt the real ``python -m sae_pipeline fit`` while the file is being written.

Why a plugin kept here: the product's writer (``AtomicCheckpointIO``) has no test hook; a test hands
this subclass to ``fit`` on its command line (:func:`pause_in_save_args`), as a user would hand any
Lightning ``CheckpointIO`` plugin, and ``SAECLI`` keeps a given ``CheckpointIO`` instead of adding its
own. The subprocess imports it as ``tests.pause_io``: :func:`env_with_repo_root` puts the repository
root on its ``PYTHONPATH``.
"""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from typing import Any, BinaryIO

import torch

from sae_pipeline.training.checkpointing import AtomicCheckpointIO

REPO_DPATH = Path(__file__).resolve().parents[1]
PAUSE_S = 120.0  # far longer than any test waits: the test ends the process during the pause


class PauseInSaveIO(AtomicCheckpointIO):
    """The first save of a ``last*.ckpt`` at or after global step ``step`` writes half of its bytes,
    creates the file ``marker`` (the test's cue) and sleeps ``pause_s`` seconds before the rest."""

    def __init__(self, step: int, marker: str, pause_s: float = PAUSE_S) -> None:
        super().__init__()
        self.step = step
        self.marker = Path(marker)
        self.pause_s = pause_s
        self.paused = False

    def write(self, checkpoint: dict[str, Any], f: BinaryIO, target: Path) -> None:
        if self.paused or not target.name.startswith("last") or int(checkpoint.get("global_step", -1)) < self.step:
            super().write(checkpoint, f, target)
            return
        self.paused = True  # once per process
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        self.marker.write_text(f"{checkpoint.get('global_step')}\n")
        time.sleep(self.pause_s)
        f.write(data[len(data) // 2 :])


def pause_in_save_args(step: int, marker: Path) -> list[str]:
    """The ``fit`` flags that install :class:`PauseInSaveIO` (run with :func:`env_with_repo_root`)."""
    plugin = {"class_path": "tests.pause_io.PauseInSaveIO", "init_args": {"step": step, "marker": str(marker)}}
    return ["--trainer.plugins", json.dumps(plugin)]


def env_with_repo_root(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the repository root first on ``PYTHONPATH``, so a subprocess imports ``tests.pause_io``."""
    paths = [str(REPO_DPATH), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}
