"""The validation split: what an SAE is measured on outside a training run, in memory or read as it is used.

Training holds the split out (``ActivationDataModule``'s ``val_fraction``: whole shards of a shard
directory, a fixed permutation of rows otherwise, see :mod:`sae_pipeline.data.sources`), and every
other reader of "the validation split of SOURCE" takes it from here, so ``evaluate sae``, the
SAELens export's MP-SAE check and a training run with the same ``val_fraction`` see the same tokens.

:func:`validation_tokens` returns the split as one tensor; :func:`validation_split` returns a
:class:`ValidationSplit`, which reads it from disk again on every pass, one block at a time, so a
measurement over the whole split (``evaluate sae``) holds a block, not the split: its memory does not
grow with the number of tokens (``python -m benchmarks.scaling``'s ``memory_tokens`` curve).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from feature_extraction.validate import check_float
from sae_pipeline.data.mnist import FIT_FLAGS, DataFlags
from sae_pipeline.data.sample import iter_sample, read_sample, sample_takes
from sae_pipeline.data.sources import open_source

__all__ = ["ValidationSplit", "validation_split", "validation_tokens"]


def _units(source: str, val_fraction: float, data_dpath: str, flags: DataFlags = FIT_FLAGS) -> tuple[list, int]:
    check_float("--val_fraction", val_fraction, 0.0, 1.0, strict_minimum=True, strict_maximum=True)
    opened = open_source(source, data_dpath, flags=flags)
    return opened.units("val", val_fraction), int(opened.d)


def validation_tokens(
    source: str, val_fraction: float, n_tokens: int | None = None, data_dpath: str = "data"
) -> Tensor:
    """The validation split of ``source`` (any ``--data.source``; the rows training holds out for the same
    ``val_fraction``), or an even sample of ``n_tokens`` of it, float32 ``[n, d]``."""
    units, _ = _units(source, val_fraction, data_dpath)
    total = sum(unit.n_tokens for unit in units)
    return torch.from_numpy(read_sample(units, min(total, n_tokens or total))).float()


def validation_split(
    source: str,
    val_fraction: float,
    n_tokens: int | None = None,
    data_dpath: str = "data",
    flags: DataFlags = FIT_FLAGS,
) -> ValidationSplit:
    """`validation_tokens`' rows, in its order, read block by block on each pass instead of held whole
    (``flags``: how the running command spells its data flags, for MNIST's advice)."""
    units, d = _units(source, val_fraction, data_dpath, flags)
    total = sum(unit.n_tokens for unit in units)
    n = min(total, n_tokens or total)
    sample_takes(units, n)  # refuses an empty split now, not on the first pass
    return ValidationSplit(units, n, d)


class ValidationSplit:
    """The part of a float32 ``[n, d]`` tensor that ``metrics.evaluate_sae`` and ``reconstruction_r2`` use
    (``shape``, ``ndim``, ``device``, ``split(rows)``), with ``split``'s blocks read from the shards when
    iterated: the same blocks, bit for bit, as the tensor's, so the same numbers, without holding the split."""

    ndim = 2
    device = torch.device("cpu")

    def __init__(self, units: list, n_tokens: int, d: int) -> None:
        self.units = units
        self.shape = torch.Size([n_tokens, d])

    def split(self, rows: int) -> _Blocks:
        return _Blocks(self, rows)

    def chunks(self) -> Iterator[np.ndarray]:
        return (chunk.tokens for chunk in iter_sample(self.units, self.shape[0]))


class _Blocks:
    """``rows`` rows at a time (the last block the rest), re-read from the start on every iteration."""

    def __init__(self, split: ValidationSplit, rows: int) -> None:
        self.split, self.rows = split, rows

    def __len__(self) -> int:
        return math.ceil(self.split.shape[0] / self.rows)

    def __iter__(self) -> Iterator[Tensor]:
        n, d = self.split.shape
        block, held, done = None, 0, 0
        for tokens in self.split.chunks():
            while len(tokens):
                if block is None:  # a fresh buffer per block: the caller may still hold the previous one
                    block = np.empty((min(self.rows, n - done), d), np.float32)
                take = min(len(tokens), len(block) - held)
                block[held : held + take] = tokens[:take]
                tokens, held = tokens[take:], held + take
                if held == len(block):
                    yield torch.from_numpy(block)
                    block, held, done = None, 0, done + held
