"""The stream's building blocks against plain references: the batch ring, span cutting, resume bookkeeping."""

from __future__ import annotations

import numpy as np
import torch
from test_data import D

from sae_pipeline.data.streams import BatchRing, batches_already_taken, span_pieces


def test_batch_ring_hands_over_and_waits_for_release():
    rng = np.random.default_rng(2)
    ring = BatchRing(n_workers=2, n_slots=2, batch_size=4, d=D, dtype=np.float16)
    written = []
    for index in range(2):  # two free slots for worker 1
        slot, out = ring.slot(1, index)
        written.append(rng.standard_normal((3, D)).astype(np.float16))
        out[:3] = written[-1]
    x = ring.take(1, 0, 3)
    assert x.dtype == torch.float16 and torch.equal(x, torch.from_numpy(written[0]))  # the source dtype
    assert ring.slot(1, 2)[0] == 0  # batch 0 was taken: its slot is free again
    out = ring.slot(1, 2)[1]
    out[:] = 0  # reusing the slot must not change the tensor already taken
    assert torch.equal(x, torch.from_numpy(written[0]))
    ring.close()
    assert ring.slot(1, 4) is None  # slots of batches 2 and 3 not taken: waits, then sees the close


def test_span_pieces_matches_token_by_token_reference():
    rng = np.random.default_rng(1)
    for _ in range(50):
        counts = rng.integers(0, 6, size=rng.integers(1, 8)).tolist()
        total = sum(counts)
        start = int(rng.integers(0, total + 1))
        stop = int(rng.integers(start, total + 1))
        owner = [(u, t) for u, c in enumerate(counts) for t in range(c)]  # token -> (unit, index in unit)
        got = [(u, t) for u, lo, hi in span_pieces(counts, start, stop) for t in range(lo, hi)]
        assert got == owner[start:stop]


def test_batches_already_taken_matches_dataloader_round_robin():
    for quotas in ([3, 3], [4, 3, 3], [2, 1, 1, 0], [5]):
        order = [w for t in range(max(quotas)) for w in range(len(quotas)) if quotas[w] > t]
        for n_done in range(sum(quotas) + 1):
            ref = [order[:n_done].count(w) for w in range(len(quotas))]
            assert batches_already_taken(quotas, n_done) == ref
