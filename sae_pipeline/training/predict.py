"""``predict``: write the SAE codes of a whole dataset to HDF5 (the format in ``codes.py``).

Per token: the active atoms' indices and values (largest |value| first, ties by index, padded with index
-1 / value 0 to the widest token), the image id and the token position. The values are in
raw-activation units, as the exported SAE (``sae_pipeline.artifacts.load_sae``) gives them.

Usage: ``python -m sae_pipeline predict --config CFG.yaml --ckpt_path CKPT --codes.fpath codes.h5``
(``--codes.fpath`` defaults to ``codes.h5``; the command prints where it wrote them). Each rank writes its own part
(``codes.h5.rank{R}``) while predicting; at the end rank 0 merges the parts in rank order
into the one file and deletes them. Predictions are not also kept in memory
(``trainer.predict`` returns None): a dataset's codes can exceed RAM.

Ctrl-C or SIGTERM (:mod:`sae_pipeline.training.interrupts`) stops it within seconds, exit 130 / 143: the
codes being written (under ``NAME.tmp``) and the rank parts are removed, so nothing half-written
carries the codes file's name and a previous file of that name is left as it was; the one line
says so and to rerun the same command.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor

from feature_extraction.exit_status import Interrupted
from sae_pipeline.artifacts.codes import CodesWriter, count_codes, merge_codes
from sae_pipeline.training.heap import fix_mmap_threshold


def part_fpath(fpath: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its part of ``fpath``."""
    return fpath.with_name(f"{fpath.name}.rank{rank}")


class CodesPredictionWriter(BasePredictionWriter):
    """Write ``SAEModule.predict_step`` outputs to an HDF5 codes file.

    Args:
        fpath: the codes file to write (``.h5``); its parent directory is created.
    """

    def __init__(self, fpath: str = "codes.h5") -> None:
        super().__init__(write_interval="batch")
        self.fpath = Path(fpath)
        self._writer: CodesWriter | None = None

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.predict_loop.return_predictions = False  # codes go to the file, not to RAM
        fix_mmap_threshold()  # and per-batch tensors do not pile up in glibc's heap (training/heap.py)
        module = pl_module.predict_target() if hasattr(pl_module, "predict_target") else pl_module  # a group's member
        sae = module.sae
        attrs = {
            "d_sae": sae.d_sae,
            "d_in": sae.d_in,
            "k": sae.k,
            "sae_class": type(sae).__name__,
            "input_scale": float(module.input_scale),
            "world_size": trainer.world_size,
            "values_units": "raw activations (trained codes / input_scale)",
        }
        target = self.fpath if trainer.world_size == 1 else part_fpath(self.fpath, trainer.global_rank)
        self._writer = CodesWriter(target, attrs)
        self._writer.__enter__()

    def write_on_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        assert self._writer is not None
        self._writer.write(
            prediction["image_ids"],
            _numpy(prediction["token_positions"]),
            _numpy(prediction["indices"]),
            _numpy(prediction["values"]),
        )

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.__exit__(None, None, None)
        if trainer.world_size > 1:
            trainer.strategy.barrier("codes_parts_written")
            if trainer.global_rank == 0:
                parts = [part_fpath(self.fpath, rank) for rank in range(trainer.world_size)]
                merge_codes(parts, self.fpath)
                for part in parts:
                    part.unlink()
        if trainer.is_global_zero:
            print(f"Wrote the codes of {count_codes(self.fpath)} tokens to {self.fpath}", flush=True)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:  # removes the temporary file: no half-written codes under the real name
            writer.__exit__(type(exception), exception, None)
        if not trainer.predicting:  # this callback is on every command's Trainer
            return
        if trainer.world_size > 1:  # this rank's finished part (rank 0 may have been merging them)
            part_fpath(self.fpath, trainer.global_rank).unlink(missing_ok=True)
        if isinstance(exception, Interrupted) and not exception.detail:
            kept = "left as it was" if self.fpath.exists() else "not created"
            exception.detail = f"no codes written, {self.fpath} {kept}; rerun the same command"


def _numpy(value: Any) -> np.ndarray:
    return value.detach().cpu().numpy() if isinstance(value, Tensor) else np.asarray(value)
