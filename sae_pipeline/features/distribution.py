"""Each atom's activation distribution: an exact histogram of its values, and examples across the whole range.

Why: the top-N images show only an atom's strongest activations; what it does at ordinary
strength can differ (Anthropic/Neuronpedia-style dashboards show both). Kept per atom ``j``:

- ``hist_counts [d_sae, 34]`` int64: the number of tokens with ``z_j > 0`` in each bin of
  ``log10(z_j)``. Column 0 is the underflow ``0 < z < 1e-4``, columns 1..32 the 32 bins of a
  quarter decade each over ``[1e-4, 1e4)`` (edges ``HIST_EDGES = 10 ** linspace(-4, 4, 33)``,
  each bin ``[e_i, e_{i+1})``), column 33 the overflow ``z >= 1e4``; ``hist_negative [d_sae]``
  counts the tokens with ``z_j < 0`` (MP/OMP coefficients can be negative), which have no bins.
- a reservoir per (atom, bin): the ``RESERVOIR`` distinct images with the smallest hash of
  ``(image key, atom)`` among the images with a token of that atom in that bin (ties: image
  key, then the lowest token index). Being a deterministic function of the *set* of entries,
  it does not depend on the order of batches, workers or ranks, and merging two reservoirs is
  taking the smallest of their union: exact, like the top-N merge (`sae_pipeline.features.merge`).

After the pass (`bands`), the bins are split into ``N_BANDS`` quantile bands by the
histogram: bin ``i`` belongs to band ``floor(N_BANDS · (mass below i + half of i's) / total)``,
so each band holds about a fifth of the atom's positive values (a bin holding more than a band's
share takes a band alone and leaves a neighbour empty). A band's examples are its
``RESERVOIR`` distinct images of smallest hash over its bins' reservoirs, which are the smallest
over every image with a token in the band (each of them is among its own bin's smallest).
Memory: O(d_sae · 34 · (1 + RESERVOIR)) entries, 36 bytes per reservoir slot (94 MB at
d_sae = 19 200): more than O(d_sae · (bins + bands · examples)), the price of choosing the
bands after a single pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

HIST_EDGES = 10.0 ** np.linspace(-4.0, 4.0, 33)
N_BINS = len(HIST_EDGES) + 1  # underflow, 32 bins, overflow
RESERVOIR = 4  # examples kept per (atom, bin), and shown per band
N_BANDS = 5
NO_HASH = (1 << 62) - 1
M31 = (1 << 31) - 1
DIST_FIELDS = ("hist_counts", "hist_negative", "res_hash", "res_image", "res_token", "res_value", "res_position")


def _mix31(x: Tensor) -> Tensor:
    """A 31-bit integer hash (two multiply-xorshift rounds; products stay below 2^58: no overflow)."""
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & M31
    return (x >> 16) ^ x


def example_hash(image: Tensor, atom: Tensor) -> Tensor:
    """The reservoir order of an image for an atom: a hash of ``(image, atom)`` in ``[0, 2^31)``."""
    return _mix31(_mix31(image & M31) ^ _mix31((image >> 31) ^ (atom << 8)))


def bin_of(values: Tensor) -> Tensor:
    """The histogram column of each positive value (0 underflow .. 33 overflow), in float64 as numpy bins."""
    edges = torch.as_tensor(HIST_EDGES, dtype=torch.float64, device=values.device)
    return torch.bucketize(values.double(), edges, right=True)


def _rank(cell: Tensor, hash_: Tensor, image: Tensor, token: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Positions of the entries kept (the first ``n`` distinct images per cell in (hash, image, token)
    order) and their rank; stable sorts only, so the result depends on the entries, not their order.
    Image keys grow with the token index (`image_keys`), so ordering by token orders by (image, token)."""
    order = torch.sort(token, stable=True).indices
    key = ((cell << 31) | hash_).index_select(0, order)  # cell < 2^31, hash < 2^31
    order = order.index_select(0, torch.sort(key, stable=True).indices)
    c, g = cell.index_select(0, order), image.index_select(0, order)
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
    """Per-atom histogram and per-(atom, bin) reservoirs (see the module docstring)."""

    def __init__(self, d_sae: int, device: torch.device | str = "cpu", reservoir: int = RESERVOIR) -> None:
        self.d_sae, self.reservoir = int(d_sae), int(reservoir)
        shape = (self.d_sae * N_BINS, self.reservoir)
        self.hist_counts = torch.zeros((self.d_sae, N_BINS), dtype=torch.int64, device=device)
        self.hist_negative = torch.zeros(self.d_sae, dtype=torch.int64, device=device)
        self.res_hash = torch.full(shape, NO_HASH, dtype=torch.int64, device=device)
        self.res_image = torch.full(shape, -1, dtype=torch.int64, device=device)
        self.res_token = torch.full(shape, -1, dtype=torch.int64, device=device)
        self.res_value = torch.zeros(shape, dtype=torch.float32, device=device)
        self.res_position = torch.full(shape, -1, dtype=torch.int64, device=device)

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
        image_of = image.index_select(0, rows)
        hash_ = example_hash(image_of, atoms)
        last = self.res_hash.view(-1).index_select(0, cell * self.reservoir + (self.reservoir - 1))
        wanted = (hash_ <= last).nonzero().squeeze(1)
        rows_wanted = rows.index_select(0, wanted)
        self.offer(
            *(t.index_select(0, wanted) for t in (cell, hash_, image_of)),
            token.index_select(0, rows_wanted),
            values.index_select(0, wanted),
            position.index_select(0, rows_wanted),
        )

    def offer(self, cell: Tensor, hash_: Tensor, image: Tensor, token: Tensor, value: Tensor, position: Tensor) -> None:
        """Merge candidate entries into the reservoirs of their cells (exact)."""
        if cell.numel() == 0:
            return
        affected = torch.unique(cell)
        slots = (affected[:, None] * self.reservoir + torch.arange(self.reservoir, device=cell.device)).view(-1)
        slots = slots[self.res_token.view(-1)[slots] >= 0]
        fields = (self.res_hash, self.res_image, self.res_token, self.res_value, self.res_position)
        old = [f.view(-1).index_select(0, slots) for f in fields]
        cell = torch.cat([torch.div(slots, self.reservoir, rounding_mode="floor"), cell])
        h, g, t, v, p = (torch.cat([o, n]) for o, n in zip(old, (hash_, image, token, value, position)))
        keep, rank = _rank(cell, h, g, t, self.reservoir)
        for field, empty in zip(fields, (NO_HASH, -1, -1, 0.0, -1)):
            field.index_fill_(0, affected, empty)
        at = cell.index_select(0, keep) * self.reservoir + rank  # distinct slots: index_copy_ is exact
        for field, new in zip(fields, (h, g, t, v, p)):
            field.view(-1).index_copy_(0, at, new.index_select(0, keep))

    def state(self) -> dict[str, Tensor]:
        return {name: getattr(self, name) for name in DIST_FIELDS}

    def load_state(self, state: dict[str, Tensor]) -> None:
        for name in DIST_FIELDS:
            setattr(self, name, state[name].to(self.hist_counts.device))


def merge_distribution_states(states: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """One distribution state from several (any order gives the same result)."""
    device = states[0]["hist_counts"].device
    d_sae, reservoir = states[0]["hist_counts"].shape[0], states[0]["res_hash"].shape[1]
    merged = DistributionTable(d_sae, device, reservoir)
    merged.hist_counts = sum(s["hist_counts"] for s in states)
    merged.hist_negative = sum(s["hist_negative"] for s in states)
    for s in states:
        filled = s["res_token"] >= 0
        cell = torch.arange(d_sae * N_BINS, device=device)[:, None].expand_as(filled)[filled]
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


def bands(state: dict[str, Tensor], n_bands: int = N_BANDS) -> dict[str, Tensor]:
    """The quantile bands and their examples from a merged state (see the module docstring).

    Returns ``band_bins [d_sae, n_bands, 2]`` (first and last histogram column, -1 when empty),
    ``band_count [d_sae, n_bands]`` (values in the band) and ``band_image``, ``band_token``,
    ``band_value``, ``band_position [d_sae, n_bands, RESERVOIR]`` (token -1 where no example).
    """
    counts = state["hist_counts"].cpu().numpy()
    d_sae, reservoir = counts.shape[0], int(state["res_hash"].shape[1])
    total = np.maximum(counts.sum(1, keepdims=True), 1)
    middle = np.cumsum(counts, 1) - counts / 2
    band = np.minimum((n_bands * middle / total).astype(np.int64), n_bands - 1)
    band[counts == 0] = -1
    cols = np.arange(N_BINS)
    out: dict[str, np.ndarray] = {"band_bins": np.full((d_sae, n_bands, 2), -1, np.int64)}
    out["band_count"] = np.zeros((d_sae, n_bands), np.int64)
    res = {name: state[name].cpu().numpy().reshape(d_sae, N_BINS * reservoir) for name in DIST_FIELDS[2:]}
    slot_band = np.repeat(band, reservoir, axis=1)
    for name, fill, dtype in (("image", -1, np.int64), ("token", -1, np.int64), ("value", 0.0, np.float32)):
        out[f"band_{name}"] = np.full((d_sae, n_bands, reservoir), fill, dtype)
    out["band_position"] = np.full((d_sae, n_bands, reservoir), -1, np.int64)
    rows = np.arange(d_sae)[:, None]
    for b in range(n_bands):
        inside = band == b
        out["band_count"][:, b] = np.where(inside, counts, 0).sum(1)
        out["band_bins"][:, b, 0] = np.where(inside, cols, N_BINS).min(1)
        out["band_bins"][:, b, 1] = np.where(inside, cols, -1).max(1)
        valid = (slot_band == b) & (res["res_token"] >= 0)
        key = np.where(valid, res["res_hash"], NO_HASH)
        order = np.lexsort((res["res_token"], res["res_image"], key), axis=1)
        image, ok = res["res_image"][rows, order], valid[rows, order]
        ok[:, 1:] &= image[:, 1:] != image[:, :-1]  # one token per image (an image's hash is fixed per atom)
        rank = np.cumsum(ok, 1) - 1
        a, s = np.nonzero(ok & (rank < reservoir))
        for name in ("image", "token", "value", "position"):
            out[f"band_{name}"][a, b, rank[a, s]] = res[f"res_{name}"][a, order[a, s]]
    out["band_bins"][out["band_bins"][:, :, 1] < 0] = -1
    return {name: torch.from_numpy(value) for name, value in out.items()}


__all__ = ["DistributionTable", "HIST_EDGES", "N_BANDS", "bands", "gather_merge_distribution"]
