"""Each atom's activation distribution: a fine histogram of its values, and examples across the whole range.

Why: the top-N images show only an atom's strongest activations; what it does at ordinary
strength can differ (Anthropic/Neuronpedia-style dashboards show both). Kept per atom ``j``:

- ``hist_counts [d_sae, 258]`` int64: the number of tokens with ``z_j > 0`` in each bin of
  ``log10(z_j)``. Column 0 is the underflow ``0 < z < 1e-4``, columns 1..256 the 256 bins of a
  32nd of a decade each (7.5 % apart in value) over ``[1e-4, 1e4)`` (edges
  ``HIST_EDGES = 10 ** linspace(-4, 4, 257)``, each bin ``[e_i, e_{i+1})``), column 257 the overflow
  ``z >= 1e4``; ``hist_negative [d_sae]`` counts the tokens with ``z_j < 0`` (MP/OMP coefficients
  can be negative), which have no bins.
- a sample per atom: the ``SAMPLE`` tokens with the smallest hash of ``(token index, atom)`` among
  the tokens where the atom is positive (ties: the lower token index), each with its image,
  value and position: a uniform sample of the atom's positive values. Being a deterministic
  function of the *set* of entries, it does not depend on the order of batches, workers or
  ranks, and merging two samples is taking the smallest of their union: exact, like the top-N
  merge (`sae_pipeline.features.merge`).

After the pass (`bands`), each atom's bins are split into ``N_BANDS`` quantile bands by its own
histogram: bin ``i`` belongs to band ``floor(N_BANDS · (mass below i + half of i's) / total)``, so
each band holds a fifth of the atom's positive values, to within the mass of one bin. Why bins this
fine rather than per-atom bins fitted to each atom's range: one pass fixes the bins before any
value is seen; a 32nd of a decade is finer than any atom's spread of values (an atom whose values
span a factor of 2 still gets 10 bins), so the quantile bands exist wherever the values are not
piled into one 7.5 % interval; an atom with fewer than five distinct bins' worth of values has
fewer bands. A band's examples are the distinct images of the sample's tokens in the band, by
smallest hash (``RESERVOIR`` at most): a band holds a fifth of the values, so about
``SAMPLE / 5 = 13`` of the sample's tokens (fewer than four distinct images in under 1 % of bands).
Memory: ``d_sae · (258 · 8 + SAMPLE · 36)`` bytes, 4.4 KB per atom, 84 MB at d_sae = 19 200, plus the
candidates held between merges (``HELD · d_sae`` entries of 44 bytes: 7 MB there); the quarter-decade
histogram with four examples per bin it replaces took 99 MB.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

HIST_EDGES = 10.0 ** np.linspace(-4.0, 4.0, 257)
N_BINS = len(HIST_EDGES) + 1  # underflow, 256 bins, overflow
SAMPLE = 64  # tokens kept per atom (the uniform sample the band examples come from)
RESERVOIR = 4  # examples shown per band
HELD = 8  # candidate entries per atom held back before they are merged into the samples at once
N_BANDS = 5
NO_HASH = (1 << 62) - 1
M31 = (1 << 31) - 1
DIST_FIELDS = ("hist_counts", "hist_negative", "res_hash", "res_image", "res_token", "res_value", "res_position")


def _mix31(x: Tensor) -> Tensor:
    """A 31-bit integer hash (two multiply-xorshift rounds; products stay below 2^58: no overflow)."""
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & M31
    return (x >> 16) ^ x


def example_hash(token: Tensor, atom: Tensor) -> Tensor:
    """The sample order of a token for an atom: a hash of ``(token index, atom)`` in ``[0, 2^31)``."""
    return _mix31(_mix31(token & M31) ^ _mix31((token >> 31) ^ (atom << 8)))


def bin_of(values: Tensor) -> Tensor:
    """The histogram column of each positive value (0 underflow .. 33 overflow), in float64 as numpy bins."""
    edges = torch.as_tensor(HIST_EDGES, dtype=torch.float64, device=values.device)
    return torch.bucketize(values.double(), edges, right=True)


def _rank(cell: Tensor, hash_: Tensor, token: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Positions of the entries kept (the first ``n`` distinct tokens per cell in (hash, token) order) and
    their rank; stable sorts only, so the result depends on the entries, not their order."""
    order = torch.sort(token, stable=True).indices
    key = ((cell << 31) | hash_).index_select(0, order)  # cell < 2^31, hash < 2^31
    order = order.index_select(0, torch.sort(key, stable=True).indices)
    c, g = cell.index_select(0, order), token.index_select(0, order)
    first = torch.ones_like(c, dtype=torch.bool)
    first[1:] = (c[1:] != c[:-1]) | (g[1:] != g[:-1])
    first = first.nonzero().squeeze(1)
    order, c = order.index_select(0, first), c.index_select(0, first)
    starts = torch.ones_like(c, dtype=torch.bool)
    starts[1:] = c[1:] != c[:-1]
    index = torch.arange(c.numel(), device=c.device)
    rank = index - torch.cummax(torch.where(starts, index, torch.zeros_like(index)), 0).values
    keep = (rank < n).nonzero().squeeze(1)
    return order.index_select(0, keep), rank.index_select(0, keep)


class DistributionTable:
    """Per-atom histogram and sample (see the module docstring)."""

    def __init__(self, d_sae: int, device: torch.device | str = "cpu", reservoir: int = SAMPLE) -> None:
        self.d_sae, self.reservoir = int(d_sae), int(reservoir)
        shape = (self.d_sae, self.reservoir)
        self.hist_counts = torch.zeros((self.d_sae, N_BINS), dtype=torch.int64, device=device)
        self.hist_negative = torch.zeros(self.d_sae, dtype=torch.int64, device=device)
        self.res_hash = torch.full(shape, NO_HASH, dtype=torch.int64, device=device)
        self.res_image = torch.full(shape, -1, dtype=torch.int64, device=device)
        self.res_token = torch.full(shape, -1, dtype=torch.int64, device=device)
        self.res_value = torch.zeros(shape, dtype=torch.float32, device=device)
        self.res_position = torch.full(shape, -1, dtype=torch.int64, device=device)
        # candidates that passed the samples' threshold, merged every HELD · d_sae of them: a merge costs
        # O(SAMPLE) per atom it touches, so merging per batch would touch most atoms every batch
        self.held: list[tuple[Tensor, ...]] = []
        self.held_count = 0

    @torch.no_grad()
    def update(
        self, rows: Tensor, atoms: Tensor, values: Tensor, token: Tensor, image: Tensor, position: Tensor
    ) -> None:
        """Add a batch's non-zero codes ``values`` at ``(rows, atoms)`` of tokens ``token [B]`` (global
        indices) of images ``image [B]`` at ``position [B]``."""
        # index_select / index_copy_ rather than advanced indexing: several times faster on the CPU, where
        # this runs once per batch of the features pass
        negative = values < 0
        self.hist_negative += torch.bincount(atoms[negative], minlength=self.d_sae)
        positive = (values > 0).nonzero().squeeze(1)
        rows, atoms, values = (t.index_select(0, positive) for t in (rows, atoms, values))
        values = values.float()
        cell = atoms * N_BINS + bin_of(values)
        self.hist_counts.view(-1).index_add_(0, cell, torch.ones_like(cell))
        token_of = token.index_select(0, rows)
        hash_ = example_hash(token_of, atoms)
        last = self.res_hash.view(-1).index_select(0, atoms * self.reservoir + (self.reservoir - 1))
        wanted = (hash_ <= last).nonzero().squeeze(1)
        rows_wanted = rows.index_select(0, wanted)
        self.held.append(
            (
                atoms.index_select(0, wanted),
                hash_.index_select(0, wanted),
                image.index_select(0, rows_wanted),
                token_of.index_select(0, wanted),
                values.index_select(0, wanted),
                position.index_select(0, rows_wanted),
            )
        )
        self.held_count += int(wanted.numel())
        if self.held_count >= HELD * self.d_sae:
            self.flush()

    def flush(self) -> None:
        """Merge the held candidates (exact: the threshold they passed was at least the current one)."""
        if self.held:
            self.offer(*(torch.cat(parts) for parts in zip(*self.held)))
        self.held, self.held_count = [], 0

    def offer(self, cell: Tensor, hash_: Tensor, image: Tensor, token: Tensor, value: Tensor, position: Tensor) -> None:
        """Merge candidate entries into the samples of their atoms (``cell``: the atom; exact)."""
        if cell.numel() == 0:
            return
        affected = torch.unique(cell)
        slots = (affected[:, None] * self.reservoir + torch.arange(self.reservoir, device=cell.device)).view(-1)
        slots = slots[self.res_token.view(-1)[slots] >= 0]
        fields = (self.res_hash, self.res_image, self.res_token, self.res_value, self.res_position)
        old = [f.view(-1).index_select(0, slots) for f in fields]
        cell = torch.cat([torch.div(slots, self.reservoir, rounding_mode="floor"), cell])
        h, g, t, v, p = (torch.cat([o, n]) for o, n in zip(old, (hash_, image, token, value, position)))
        keep, rank = _rank(cell, h, t, self.reservoir)
        for field, empty in zip(fields, (NO_HASH, -1, -1, 0.0, -1)):
            field.index_fill_(0, affected, empty)
        at = cell.index_select(0, keep) * self.reservoir + rank  # distinct slots: index_copy_ is exact
        for field, new in zip(fields, (h, g, t, v, p)):
            field.view(-1).index_copy_(0, at, new.index_select(0, keep))

    def state(self) -> dict[str, Tensor]:
        self.flush()
        return {name: getattr(self, name) for name in DIST_FIELDS}

    def load_state(self, state: dict[str, Tensor]) -> None:
        for name in DIST_FIELDS:
            setattr(self, name, state[name].to(self.hist_counts.device))
        self.held, self.held_count = [], 0


def merge_distribution_states(states: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """One distribution state from several (any order gives the same result)."""
    device = states[0]["hist_counts"].device
    d_sae, reservoir = states[0]["hist_counts"].shape[0], states[0]["res_hash"].shape[1]
    merged = DistributionTable(d_sae, device, reservoir)
    merged.hist_counts = sum(s["hist_counts"] for s in states)
    merged.hist_negative = sum(s["hist_negative"] for s in states)
    for s in states:
        filled = s["res_token"] >= 0
        cell = torch.arange(d_sae, device=device)[:, None].expand_as(filled)[filled]
        merged.offer(cell, *(s[name][filled] for name in DIST_FIELDS[2:]))
    return merged.state()


def gather_merge_distribution(table: DistributionTable, strategy: Any) -> dict[str, Tensor]:
    """All ranks' distributions merged, on every rank (Lightning ``strategy.all_gather``)."""
    state = table.state()
    world_size = int(getattr(strategy, "world_size", 1))
    if world_size == 1:
        return state
    gathered = {name: strategy.all_gather(value) for name, value in state.items()}
    return merge_distribution_states([{n: gathered[n][r] for n in DIST_FIELDS} for r in range(world_size)])


def bands(state: dict[str, Tensor], n_bands: int = N_BANDS, shown: int = RESERVOIR) -> dict[str, Tensor]:
    """The quantile bands and their examples from a merged state (see the module docstring).

    Returns ``band_bins [d_sae, n_bands, 2]`` (first and last histogram column, -1 when empty),
    ``band_count [d_sae, n_bands]`` (values in the band) and ``band_image``, ``band_token``,
    ``band_value``, ``band_position [d_sae, n_bands, shown]`` (token -1 where no example).
    """
    counts = state["hist_counts"].cpu().numpy()
    d_sae = counts.shape[0]
    total = np.maximum(counts.sum(1, keepdims=True), 1)
    middle = np.cumsum(counts, 1) - counts / 2
    band = np.minimum((n_bands * middle / total).astype(np.int64), n_bands - 1)
    band[counts == 0] = -1
    cols = np.arange(N_BINS)
    out: dict[str, np.ndarray] = {"band_bins": np.full((d_sae, n_bands, 2), -1, np.int64)}
    out["band_count"] = np.zeros((d_sae, n_bands), np.int64)
    for b in range(n_bands):
        inside = band == b
        out["band_count"][:, b] = np.where(inside, counts, 0).sum(1)
        out["band_bins"][:, b, 0] = np.where(inside, cols, N_BINS).min(1)
        out["band_bins"][:, b, 1] = np.where(inside, cols, -1).max(1)
    out["band_bins"][out["band_bins"][:, :, 1] < 0] = -1
    for name, fill, dtype in (("image", -1, np.int64), ("token", -1, np.int64), ("value", 0.0, np.float32)):
        out[f"band_{name}"] = np.full((d_sae, n_bands, shown), fill, dtype)
    out["band_position"] = np.full((d_sae, n_bands, shown), -1, np.int64)
    res = {name: state[name].cpu().numpy().reshape(-1) for name in DIST_FIELDS[2:]}
    atom = np.repeat(np.arange(d_sae), state["res_hash"].shape[1])
    entry = np.flatnonzero(res["res_token"] >= 0)
    column = np.searchsorted(HIST_EDGES, res["res_value"][entry].astype(np.float64), side="right")
    slot_band = band[atom[entry], column]  # the band of each sampled value's bin (its bin has it: never -1)
    a, h, g, t = atom[entry], res["res_hash"][entry], res["res_image"][entry], res["res_token"][entry]
    order = np.lexsort((t, h, g, slot_band, a))  # per (atom, band, image): its smallest-hash token first
    first = np.ones(len(order), bool)
    first[1:] = (np.diff(a[order]) != 0) | (np.diff(slot_band[order]) != 0) | (np.diff(g[order]) != 0)
    kept = order[first]
    kept = kept[np.lexsort((g[kept], h[kept], slot_band[kept], a[kept]))]  # per (atom, band): by hash
    group = a[kept] * n_bands + slot_band[kept]
    starts = np.flatnonzero(np.concatenate([[True], group[1:] != group[:-1]]))
    rank = np.arange(len(kept)) - np.repeat(starts, np.diff(np.append(starts, len(kept))))
    kept, rank = kept[rank < shown], rank[rank < shown]
    where = (a[kept], slot_band[kept], rank)
    for name in ("image", "token", "value", "position"):
        out[f"band_{name}"][where] = res[f"res_{name}"][entry[kept]]
    return {name: torch.from_numpy(value) for name, value in out.items()}


__all__ = ["DistributionTable", "HIST_EDGES", "N_BANDS", "SAMPLE", "bands", "gather_merge_distribution"]
