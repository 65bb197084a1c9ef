"""An even, deterministic sample of a split: the first tokens of every unit, shared out by
water-filling. The figures' fixed validation sample and the studies read it, and the validation split
is read through it block by block (:mod:`.validation`): every rank builds the same sample without
reading a whole split, since each unit is read only up to its share."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from sae_pipeline.data.sources import Chunk


def read_sample(units: list, n_tokens: int) -> np.ndarray:
    """The first tokens of every unit, shared out evenly (water-filling), ``[min(n_tokens, total), d]`` float32.

    Deterministic and cheap (a shard is read only up to its share), so every rank builds
    the same sample for figures without reading a whole split.
    """
    return np.concatenate([chunk.tokens.astype(np.float32) for chunk in iter_sample(units, n_tokens)])


def sample_takes(units: list, n_tokens: int) -> list[int]:
    """How many of its first tokens each unit gives to an even sample of ``n_tokens`` (water-filling).

    Every sampler of a split (:func:`read_sample`, :func:`iter_sample`, the validation split) comes through
    here, so an empty split is refused here, with one message, before any shard is read."""
    if sum(unit.n_tokens for unit in units) == 0:
        raise ValueError(
            "the split to sample holds no tokens (with --data.val_fraction 0 the validation split is empty); "
            "set --data.val_fraction above 0 or pass a --data.source that holds tokens"
        )
    if n_tokens < 1:
        raise ValueError(f"a sample of {n_tokens} tokens: ask for at least 1")
    remaining, takes = n_tokens, [0] * len(units)
    order = sorted(range(len(units)), key=lambda i: units[i].n_tokens)
    for left, i in zip(range(len(units), 0, -1), order):
        takes[i] = min(units[i].n_tokens, remaining // left)
        remaining -= takes[i]
    return takes


def iter_sample(units: list, n_tokens: int) -> Iterator[Chunk]:
    """:func:`read_sample`'s tokens as the units' chunks, in its order, read one at a time."""
    for unit, take in zip(units, sample_takes(units, n_tokens)):
        if take:
            yield from unit.read(0, take)
