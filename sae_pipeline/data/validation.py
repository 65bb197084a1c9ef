"""The validation split as tokens in memory: what an SAE is measured on outside a training run.

Training holds the split out (``ActivationDataModule``'s ``val_fraction``: whole shards of a shard
directory, a fixed permutation of rows otherwise, see :mod:`sae_pipeline.data.sources`), and every
other reader of "the validation split of SOURCE" takes it from here, so ``evaluate sae``, the
SAELens export's MP-SAE check and a training run with the same ``val_fraction`` see the same tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from feature_extraction.validate import check_float
from sae_pipeline.data.sources import open_source, read_sample

__all__ = ["validation_tokens"]


def validation_tokens(
    source: str, val_fraction: float, n_tokens: int | None = None, data_dpath: str = "data"
) -> Tensor:
    """The validation split of ``source`` (any ``--data.source``; the rows training holds out for the same
    ``val_fraction``), or an even sample of ``n_tokens`` of it, float32 ``[n, d]``."""
    check_float("--val_fraction", val_fraction, 0.0, 1.0, strict_minimum=True, strict_maximum=True)
    units = open_source(source, data_dpath).units("val", val_fraction)
    total = sum(unit.n_tokens for unit in units)
    return torch.from_numpy(read_sample(units, min(total, n_tokens or total))).float()
