"""The streaming top-N pass: per atom, the N images that activate it most, in O(d_sae · N) memory.

What is kept per atom ``j`` (all on the SAE's device):

- the top-N *images* by their best token: for every image the token with the largest
  positive code ``z_j`` (ties: the lowest global token index), then the images ordered by
  (value desc, token index asc), the first N kept. One entry per image, because a page that
  shows one photo sixteen times (its sixteen sky patches) says less than sixteen photos; for
  one-token-per-image data (digits, MNIST) this is simply the top-N tokens;
- activation count (``z_j != 0``), sum of values, and for MP-SAE the sum and count of the
  pursuit steps (1-based) at which ``j`` was selected (every selection counts, as in
  :mod:`sae_pipeline.evaluate.concepts`).

Why it is exact: a token whose value is below the current N-th value of its atom can never
enter the final list (N other images already beat it, and the N-th value only grows), so
each batch is filtered against that threshold, and only the atoms with surviving candidates
are re-ranked (sorts over the candidates plus those atoms' current N entries). The same
re-ranking merges the tables of several ranks (:mod:`sae_pipeline.features.merge`): image
keys and token indices are global, so the merged table equals a single process's.
No dense ``[tokens, d_sae]`` buffer exists beyond the batch's own codes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from feature_extraction.validate import check_int

NO_TOKEN = -1


class Entries(NamedTuple):
    """Flat candidate entries: one row per (atom, token)."""

    atom: Tensor  # int64
    value: Tensor  # float32
    token: Tensor  # int64, global token index
    image: Tensor  # int64, global image key (equal for tokens of one image)
    position: Tensor  # int64, the token's place in the backbone's full sequence

    def select(self, index: Tensor) -> Entries:
        """The entries at ``index`` (int64 positions; a boolean mask is turned into positions once)."""
        if index.dtype == torch.bool:
            index = index.nonzero().squeeze(1)
        return Entries(*(field.index_select(0, index) for field in self))


def _cat(parts: list[Entries]) -> Entries:
    return Entries(*(torch.cat(fields) for fields in zip(*parts)))


def _value_desc_key(atom: Tensor, value: Tensor) -> Tensor:
    """One int64 key ordering (atom asc, value desc): the atom in the high 32 bits, the float32 value's bits
    turned into an order-preserving unsigned integer (negated) in the low 32 (one sort instead of two)."""
    bits = value.float().contiguous().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) + (1 << 31)  # ascending with the value, in [0, 2^32)
    return (atom << 32) | ((1 << 32) - 1 - ordered)


def rank_entries(entries: Entries, n: int) -> tuple[Entries, Tensor]:
    """Keep each atom's best ``n`` distinct images; returns the kept entries and their rank (0-based).

    Order within an atom: value desc, then token index asc. One entry per (atom, image): its
    first in that order. Stable sorts only, so the result depends on the entries, not on
    their order.
    """
    if entries.atom.numel() == 0:
        return entries, entries.atom.clone()
    # (atom asc, value desc, token asc): a stable sort by token, then by the packed (atom, value) key.
    order = torch.sort(entries.token, stable=True).indices
    order = order[torch.sort(_value_desc_key(entries.atom[order], entries.value[order]), stable=True).indices]
    ranked = entries.select(order)
    # The first entry of each (atom, image) pair in that order: a stable sort by (atom, image).
    n_images = int(ranked.image.max()) + 1
    if (int(ranked.atom.max()) + 1) * n_images < (1 << 62):
        by_image = torch.sort(ranked.atom * n_images + ranked.image, stable=True).indices
    else:  # keys too wide to pack: two sorts
        by_image = torch.sort(ranked.image, stable=True).indices
        by_image = by_image[torch.sort(ranked.atom[by_image], stable=True).indices]
    a, g = ranked.atom[by_image], ranked.image[by_image]
    first = torch.ones_like(a, dtype=torch.bool)
    first[1:] = (a[1:] != a[:-1]) | (g[1:] != g[:-1])
    keep = torch.zeros_like(first)
    keep[by_image[first]] = True
    ranked = ranked.select(keep.nonzero().squeeze(1))
    # Rank within each atom: position minus the atom's first position.
    starts = torch.ones_like(ranked.atom, dtype=torch.bool)
    starts[1:] = ranked.atom[1:] != ranked.atom[:-1]
    index = torch.arange(ranked.atom.numel(), device=ranked.atom.device)
    group_start = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), 0).values
    rank = index - group_start
    within = (rank < n).nonzero().squeeze(1)
    return ranked.select(within), rank[within]


class TopNTable:
    """Per-atom top-N table and activation statistics (see the module docstring).

    Args:
        d_sae: number of atoms.
        n: entries kept per atom (``--top``).
        device: where the table lives (the SAE's device).
    """

    def __init__(self, d_sae: int, n: int, device: torch.device | str = "cpu") -> None:
        self.d_sae, self.n = int(d_sae), check_int("--top", n, 1)
        shape = (self.d_sae, self.n)
        self.value = torch.full(shape, -torch.inf, dtype=torch.float32, device=device)
        self.token = torch.full(shape, NO_TOKEN, dtype=torch.int64, device=device)
        self.image = torch.full(shape, NO_TOKEN, dtype=torch.int64, device=device)
        self.position = torch.full(shape, NO_TOKEN, dtype=torch.int64, device=device)
        self.fire_count = torch.zeros(self.d_sae, dtype=torch.int64, device=device)
        self.value_sum = torch.zeros(self.d_sae, dtype=torch.float64, device=device)
        self.step_sum = torch.zeros(self.d_sae, dtype=torch.int64, device=device)
        self.step_count = torch.zeros(self.d_sae, dtype=torch.int64, device=device)
        self.n_tokens = torch.zeros((), dtype=torch.int64, device=device)

    # --- per batch -----------------------------------------------------------------------
    @torch.no_grad()
    def update_codes(
        self, codes: Tensor, token: Tensor, image: Tensor, position: Tensor, steps: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Add a batch of dense ``codes [B, d_sae]``: `update_entries` of their non-zeros."""
        rows, atoms = codes.nonzero(as_tuple=True)
        return self.update_entries(rows, atoms, codes[rows, atoms], codes.shape[0], token, image, position, steps)

    @torch.no_grad()
    def update_entries(
        self,
        rows: Tensor,
        atoms: Tensor,
        values: Tensor,
        n_tokens: int,
        token: Tensor,
        image: Tensor,
        position: Tensor,
        steps: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Add a batch of ``n_tokens`` tokens ``token [B]`` (global indices) of images ``image [B]`` at
        ``position [B]`` from their non-zero codes ``values`` at ``(rows, atoms)``, in the order of
        ``dense.nonzero()`` (as `sae_pipeline.sae.inference_codes` gives them: the sums then add the
        same floats in the same order as from the dense codes); ``steps``: MP's ``(atom indices
        [B, k], step 1..k)`` order. Returns ``(rows, atoms)`` (the label counts reuse them)."""
        nonzero = rows, atoms
        values = values.float()
        self.fire_count += torch.bincount(atoms, minlength=self.d_sae)
        self.value_sum.index_add_(0, atoms, values.double())
        self.n_tokens += n_tokens
        if steps is not None:
            indices, step = steps
            valid = indices >= 0
            self.step_sum.index_add_(0, indices[valid], step.expand_as(indices)[valid].to(torch.int64))
            self.step_count.index_add_(0, indices[valid], torch.ones_like(indices[valid]))
        positive = values > 0
        rows, atoms, values = rows[positive], atoms[positive], values[positive]
        self.offer(Entries(atoms, values, token[rows], image[rows], position[rows]))
        return nonzero

    @torch.no_grad()
    def offer(self, candidates: Entries) -> None:
        """Merge candidate entries into the table (exact; see the module docstring)."""
        threshold = self.value[:, -1]
        candidates = candidates.select(candidates.value >= threshold[candidates.atom])
        if candidates.atom.numel() == 0:
            return
        hit = torch.zeros(self.d_sae, dtype=torch.bool, device=self.value.device)
        hit[candidates.atom] = True
        affected = hit.nonzero().squeeze(1)
        current = self.entries(affected)
        kept, rank = rank_entries(_cat([current, candidates]), self.n)
        self.value[affected] = -torch.inf
        for field in (self.token, self.image, self.position):
            field[affected] = NO_TOKEN
        self.value[kept.atom, rank] = kept.value
        self.token[kept.atom, rank] = kept.token
        self.image[kept.atom, rank] = kept.image
        self.position[kept.atom, rank] = kept.position

    def entries(self, atoms: Tensor | None = None) -> Entries:
        """The table's filled entries (of ``atoms``, all when None) as flat entries."""
        device = self.value.device
        atoms = torch.arange(self.d_sae, device=device) if atoms is None else atoms
        slots = (atoms[:, None] * self.n + torch.arange(self.n, device=device)).view(-1)
        slots = slots[self.token.view(-1).index_select(0, slots) != NO_TOKEN]
        return Entries(
            torch.div(slots, self.n, rounding_mode="floor"),
            self.value.view(-1).index_select(0, slots),
            self.token.view(-1).index_select(0, slots),
            self.image.view(-1).index_select(0, slots),
            self.position.view(-1).index_select(0, slots),
        )

    # --- results -----------------------------------------------------------------------------
    def state(self) -> dict[str, Tensor]:
        """Every tensor of the table (what ranks exchange, and what the site is built from)."""
        return {name: getattr(self, name) for name in STATE_FIELDS}

    def load_state(self, state: dict[str, Tensor]) -> None:
        for name in STATE_FIELDS:
            setattr(self, name, state[name])


STATE_FIELDS = ("value", "token", "image", "position", "fire_count", "value_sum", "step_sum", "step_count", "n_tokens")
