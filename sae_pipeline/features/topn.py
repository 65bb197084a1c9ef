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

NO_TOKEN = -1


class Entries(NamedTuple):
    """Flat candidate entries: one row per (atom, token)."""

    atom: Tensor  # int64
    value: Tensor  # float32
    token: Tensor  # int64, global token index
    image: Tensor  # int64, global image key (equal for tokens of one image)
    position: Tensor  # int64, the token's place in the backbone's full sequence

    def select(self, mask_or_index: Tensor) -> "Entries":
        return Entries(*(field[mask_or_index] for field in self))


def _cat(parts: list[Entries]) -> Entries:
    return Entries(*(torch.cat(fields) for fields in zip(*parts)))


def rank_entries(entries: Entries, n: int) -> tuple[Entries, Tensor]:
    """Keep each atom's best ``n`` distinct images; returns the kept entries and their rank (0-based).

    Order within an atom: value desc, then token index asc. One entry per (atom, image): its
    first in that order. Stable sorts only, so the result depends on the entries, not on
    their order.
    """
    # (atom asc, value desc, token asc) by successive stable sorts, least significant key first.
    order = torch.sort(entries.token, stable=True).indices
    order = order[torch.sort(entries.value[order], descending=True, stable=True).indices]
    order = order[torch.sort(entries.atom[order], stable=True).indices]
    ranked = entries.select(order)
    # First entry of each (atom, image) pair in that order: a stable sort by (atom, image).
    by_image = torch.sort(ranked.image, stable=True).indices
    by_image = by_image[torch.sort(ranked.atom[by_image], stable=True).indices]
    a, g = ranked.atom[by_image], ranked.image[by_image]
    first = torch.ones_like(a, dtype=torch.bool)
    first[1:] = (a[1:] != a[:-1]) | (g[1:] != g[:-1])
    keep = torch.zeros_like(first)
    keep[by_image[first]] = True
    ranked = ranked.select(keep)
    # Rank within each atom: position minus the atom's first position.
    if ranked.atom.numel() == 0:
        return ranked, ranked.atom.clone()
    starts = torch.ones_like(ranked.atom, dtype=torch.bool)
    starts[1:] = ranked.atom[1:] != ranked.atom[:-1]
    index = torch.arange(ranked.atom.numel(), device=ranked.atom.device)
    group_start = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), 0).values
    rank = index - group_start
    within = rank < n
    return ranked.select(within), rank[within]


class TopNTable:
    """Per-atom top-N table and activation statistics (see the module docstring).

    Args:
        d_sae: number of atoms.
        n: entries kept per atom (``--top``).
        device: where the table lives (the SAE's device).
    """

    def __init__(self, d_sae: int, n: int, device: torch.device | str = "cpu") -> None:
        if n < 1:
            raise ValueError(f"--top must be >= 1, got {n}")
        self.d_sae, self.n = int(d_sae), int(n)
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
    def update_codes(self, codes: Tensor, token: Tensor, image: Tensor, position: Tensor,
                     steps: tuple[Tensor, Tensor] | None = None) -> None:
        """Add a batch: dense ``codes [B, d_sae]`` of tokens ``token [B]`` (global indices) of images
        ``image [B]`` at ``position [B]``; ``steps``: MP's ``(atom indices [B, k], step 1..k)`` order."""
        rows, atoms = codes.nonzero(as_tuple=True)
        values = codes[rows, atoms].float()
        self.fire_count.index_add_(0, atoms, torch.ones_like(atoms))
        self.value_sum.index_add_(0, atoms, values.double())
        self.n_tokens += codes.shape[0]
        if steps is not None:
            indices, step = steps
            valid = indices >= 0
            self.step_sum.index_add_(0, indices[valid], step.expand_as(indices)[valid].to(torch.int64))
            self.step_count.index_add_(0, indices[valid], torch.ones_like(indices[valid]))
        positive = values > 0
        rows, atoms, values = rows[positive], atoms[positive], values[positive]
        self.offer(Entries(atoms, values, token[rows], image[rows], position[rows]))

    @torch.no_grad()
    def offer(self, candidates: Entries) -> None:
        """Merge candidate entries into the table (exact; see the module docstring)."""
        threshold = self.value[:, -1]
        candidates = candidates.select(candidates.value >= threshold[candidates.atom])
        if candidates.atom.numel() == 0:
            return
        affected = torch.unique(candidates.atom)
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
        atoms = torch.arange(self.d_sae, device=self.value.device) if atoms is None else atoms
        token = self.token[atoms]
        filled = token != NO_TOKEN
        atom = atoms[:, None].expand_as(token)
        return Entries(atom[filled], self.value[atoms][filled], token[filled], self.image[atoms][filled],
                       self.position[atoms][filled])

    # --- results -----------------------------------------------------------------------------
    def state(self) -> dict[str, Tensor]:
        """Every tensor of the table (what ranks exchange, and what the site is built from)."""
        return {name: getattr(self, name) for name in STATE_FIELDS}

    def load_state(self, state: dict[str, Tensor]) -> None:
        for name in STATE_FIELDS:
            setattr(self, name, state[name])


STATE_FIELDS = ("value", "token", "image", "position", "fire_count", "value_sum", "step_sum", "step_count",
                "n_tokens")
