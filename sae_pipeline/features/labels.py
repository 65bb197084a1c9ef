"""Label statistics of the features pass: per atom, how many images of each class label it fires on.

Counted per *image*, not per token: an atom fires on an image when its code is non-zero on
at least one of the image's tokens, and that image counts once for the atom (and once in the
label prior, whether any atom fires on it or not). Kept on the SAE's device:

- ``label_fire [d_sae, L]`` int64: images of label ``l`` on which atom ``j`` fires;
- ``label_fire_unlabelled [d_sae]``: the same for images without a label;
- ``label_images [L]`` and ``label_images_unlabelled``: images per label (the prior).

``L`` is one more than the largest label seen (the buffers grow as labels appear, doubling, so
class folders read in order cost O(log L) copies, not L), so memory is O(d_sae · L) beside the
top-N table's O(d_sae · N), whatever the token count.

Why it stays exact although an image's tokens can arrive in several batches (its tokens
straddle a batch boundary, DataLoader workers interleave their batches, a rank's share ends
mid-image): an image whose tokens are all in the batch is counted at once; the atoms fired
on a partial image are kept (``pending``, a ``[d_sae]`` mask per image) until its
``tokens_per_image`` tokens have all been seen. Each worker has at most one image open at a
time plus the two at the ends of its span, so ``pending`` stays a few entries. What is left
at the end of a rank (an image split between ranks) is resolved in the merge
(:func:`sae_pipeline.features.merge.gather_merge_labels`), where the parts are united and the
image counted once.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

DENSE_LIMIT = 1 << 26  # (images in a batch) x d_sae below which the per-image dedup uses a dense mask

LABEL_FIELDS = ("label_fire", "label_fire_unlabelled", "label_images", "label_images_unlabelled")


class LabelCounts:
    """Per-atom label counts over images (see the module docstring).

    Args:
        d_sae: number of atoms.
        tokens_per_image: stored tokens per image (an image is complete once it has this many).
        device: where the counts live (the SAE's device).
    """

    def __init__(self, d_sae: int, tokens_per_image: int, device: torch.device | str = "cpu") -> None:
        self.d_sae, self.tokens_per_image = int(d_sae), int(tokens_per_image)
        self.label_fire = torch.zeros((self.d_sae, 0), dtype=torch.int64, device=device)
        self.label_fire_unlabelled = torch.zeros(self.d_sae, dtype=torch.int64, device=device)
        self.label_images = torch.zeros(0, dtype=torch.int64, device=device)
        self.label_images_unlabelled = torch.zeros((), dtype=torch.int64, device=device)
        self.n_labels = 0  # labels 0..n_labels-1 seen; the buffers may hold more columns (spare capacity)
        self.pending: dict[int, tuple[Tensor, int, int]] = {}  # image key -> (fired mask, tokens seen, label)

    @property
    def device(self) -> torch.device:
        return self.label_fire.device

    def grow(self, n_labels: int) -> None:
        """Make room for labels ``0..n_labels-1``."""
        if n_labels > self.label_fire.shape[1]:
            extra = max(n_labels, 2 * self.label_fire.shape[1], 16) - self.label_fire.shape[1]
            self.label_fire = torch.cat([self.label_fire, self.label_fire.new_zeros((self.d_sae, extra))], 1)
            self.label_images = torch.cat([self.label_images, self.label_images.new_zeros(extra)])
        self.n_labels = max(self.n_labels, n_labels)

    @torch.no_grad()
    def update(self, rows: Tensor, atoms: Tensor, image: Tensor, label: Tensor) -> None:
        """Add a batch: the non-zero codes at ``(rows, atoms)`` of tokens of images ``image [B]`` with ``label [B]``."""
        keys, inverse, counts = torch.unique(image, return_inverse=True, return_counts=True)
        image_label = torch.full(keys.shape, -1, dtype=torch.int64, device=keys.device)
        image_label[inverse] = label.to(keys.device)
        pair_image, pair_atom = self._unique_pairs(inverse[rows], atoms, len(keys))
        complete = counts == self.tokens_per_image
        whole = complete[pair_image]
        self._count(image_label[complete], pair_atom[whole], image_label[pair_image[whole]])
        for i in (~complete).nonzero().squeeze(1).tolist():
            fired = torch.zeros(self.d_sae, dtype=torch.bool, device=self.device)
            fired[pair_atom[pair_image == i]] = True
            self.add_part(int(keys[i]), fired, int(counts[i]), int(image_label[i]))

    def _unique_pairs(self, image_index: Tensor, atoms: Tensor, n_images: int) -> tuple[Tensor, Tensor]:
        """The distinct (image, atom) pairs among the non-zero codes."""
        if self.tokens_per_image == 1:
            return image_index, atoms  # one token per image: already distinct
        if n_images * self.d_sae <= DENSE_LIMIT:
            mask = torch.zeros((n_images, self.d_sae), dtype=torch.bool, device=atoms.device)
            mask[image_index, atoms] = True
            found = mask.nonzero()
            return found[:, 0], found[:, 1]
        pairs = torch.unique(image_index * self.d_sae + atoms)
        return torch.div(pairs, self.d_sae, rounding_mode="floor"), pairs % self.d_sae

    def add_part(self, key: int, fired: Tensor, seen: int, label: int) -> None:
        """Part of an image: kept until its tokens are complete, then counted once."""
        if key in self.pending:
            before, before_seen, _ = self.pending[key]
            fired, seen = before | fired, before_seen + seen
        if seen >= self.tokens_per_image:
            self.pending.pop(key, None)
            self.count_image(fired, label)
        else:
            self.pending[key] = (fired, seen, label)

    def count_image(self, fired: Tensor, label: int) -> None:
        """One whole image with label ``label`` (-1: none) on which the atoms of mask ``fired`` fire."""
        atoms = fired.to(self.device).nonzero().squeeze(1)
        labels = torch.tensor([label], dtype=torch.int64, device=self.device)
        self._count(labels, atoms, labels.expand_as(atoms))

    def _count(self, image_labels: Tensor, atoms: Tensor, atom_labels: Tensor) -> None:
        """Whole images: their labels, and one (atom, label) per image the atom fires on."""
        if image_labels.numel():
            self.grow(int(image_labels.max()) + 1)
        known = image_labels >= 0
        self.label_images.index_add_(0, image_labels[known], torch.ones_like(image_labels[known]))
        self.label_images_unlabelled += (~known).sum()
        known = atom_labels >= 0
        n_labels = self.label_fire.shape[1]
        flat = atoms[known] * n_labels + atom_labels[known]
        self.label_fire.view(-1).index_add_(0, flat, torch.ones_like(flat))
        unknown = atoms[~known]
        self.label_fire_unlabelled.index_add_(0, unknown, torch.ones_like(unknown))

    # --- results -----------------------------------------------------------------------------
    def state(self) -> dict[str, Tensor]:
        """The counts, ``[..., n_labels]`` (no spare columns)."""
        state = {name: getattr(self, name) for name in LABEL_FIELDS}
        state["label_fire"] = state["label_fire"][:, : self.n_labels].contiguous()
        state["label_images"] = state["label_images"][: self.n_labels].contiguous()
        return state

    def load_state(self, state: dict[str, Tensor]) -> None:
        for name in LABEL_FIELDS:
            setattr(self, name, state[name].to(self.device))
        self.n_labels = int(self.label_fire.shape[1])

    def leftover(self) -> list[tuple[int, np.ndarray, int, int]]:
        """The images still incomplete here, as ``(key, atoms fired, tokens seen, label)`` (what ranks exchange)."""
        return [
            (key, fired.nonzero().squeeze(1).cpu().numpy(), seen, label)
            for key, (fired, seen, label) in sorted(self.pending.items())
        ]

    def resolve(self, parts: Iterable[tuple[int, np.ndarray, int, int]]) -> None:
        """Count the images split between ranks, each once (its parts united); an image never completed
        (the data ended inside it) is counted as it is."""
        self.pending.clear()
        for key, atoms, seen, label in parts:
            fired = torch.zeros(self.d_sae, dtype=torch.bool, device=self.device)
            fired[torch.as_tensor(atoms, dtype=torch.int64, device=self.device)] = True
            self.add_part(int(key), fired, int(seen), int(label))
        for fired, _, label in self.pending.values():
            self.count_image(fired, label)
        self.pending.clear()
