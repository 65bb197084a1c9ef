"""Label statistics of the features pass: per atom, how many images of each class label it fires on, and how
strongly.

Counted per *image*, not per token: an atom fires on an image when its code is non-zero on
at least one of the image's tokens, and that image counts once for the atom (and once in the
label prior, whether any atom fires on it or not). Its activation on the image is the largest
positive code over the image's tokens (0 where every code is negative: MP's and OMP's signed
coefficients), the value the top-N table ranks images by (`sae_pipeline.features.topn`). Kept on
the SAE's device:

- ``label_fire [d_sae, L]`` int64: images of label ``l`` on which atom ``j`` fires;
- ``label_weight [d_sae, L]`` float64: the sum of atom ``j``'s activation over those images, and
  ``label_weight_sq [d_sae]`` the sum of its squares over every labelled image (the spread: Kish's
  effective number of images ``(sum a)^2 / sum a^2``, `sae_pipeline.features.label_weights`, needs it
  per atom only, so it is not kept per label);
- ``label_fire_unlabelled [d_sae]``, ``label_weight_unlabelled``, ``label_weight_sq_unlabelled``: the
  same for images without a label;
- ``label_images [L]`` and ``label_images_unlabelled``: images per label (the prior).

``L`` is one more than the largest label seen (the buffers grow as labels appear, doubling, so
class folders read in order cost O(log L) copies, not L), so memory is O(d_sae · L) beside the
top-N table's O(d_sae · N), whatever the token count: 16 bytes per atom and label (the count and
the sum): 307 MB at d_sae 19 200 with 1 000 labels (315 MB once grown by doubling to 1 024
columns), 154 MB of it the counts. A batch adds each sum with a 1-D scatter, as the counts (one
scatter of ``[n, 2]`` rows holding both sums was measured slower than two 1-D ones: BENCHMARKS.md,
"Feature browser", 3g).

Why it stays exact although an image's tokens can arrive in several batches (its tokens
straddle a batch boundary, DataLoader workers interleave their batches, a rank's share ends
mid-image): an image whose tokens are all in the batch is counted at once; the per-atom maxima
of a partial image are kept (``pending``, a float32 ``[d_sae]`` per image, -inf where the atom
has not fired) until its ``tokens_per_image`` tokens have all been seen. Each worker has at most
one image open at a time plus the two at the ends of its span, so ``pending`` stays a few
entries. What is left at the end of a rank (an image split between ranks) is resolved in the
merge (:func:`sae_pipeline.features.merge.gather_merge_labels`), where the parts' maxima are
united and the image counted once. The maximum is exact in any order; only the float64 sums
depend on the order of the images (to rounding).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

# bytes of the dense per-image maxima (float32 [images in the batch, d_sae]) below which they are found densely
DENSE_LIMIT = 1 << 26

COUNT_FIELDS = ("label_fire", "label_fire_unlabelled", "label_images", "label_images_unlabelled")
WEIGHT_FIELDS = ("label_weight", "label_weight_sq", "label_weight_unlabelled", "label_weight_sq_unlabelled")
LABEL_FIELDS = COUNT_FIELDS + WEIGHT_FIELDS
NOT_FIRED = -torch.inf  # a pending image's maximum where the atom has not fired


class LabelCounts:
    """Per-atom label counts and activation sums over images (see the module docstring).

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
        self.label_weight = torch.zeros((self.d_sae, 0), dtype=torch.float64, device=device)
        self.label_weight_sq = torch.zeros(self.d_sae, dtype=torch.float64, device=device)
        self.label_weight_unlabelled = torch.zeros(self.d_sae, dtype=torch.float64, device=device)
        self.label_weight_sq_unlabelled = torch.zeros(self.d_sae, dtype=torch.float64, device=device)
        self.n_labels = 0  # labels 0..n_labels-1 seen; the buffers may hold more columns (spare capacity)
        self.pending: dict[int, tuple[Tensor, int, int]] = {}  # image key -> (per-atom max, tokens seen, label)

    @property
    def device(self) -> torch.device:
        return self.label_fire.device

    def grow(self, n_labels: int) -> None:
        """Make room for labels ``0..n_labels-1``."""
        capacity = self.label_fire.shape[1]
        if n_labels > capacity:
            extra = max(n_labels, 2 * capacity, 16) - capacity
            self.label_images = torch.cat([self.label_images, self.label_images.new_zeros(extra)])
            for name in ("label_fire", "label_weight"):
                value = getattr(self, name)
                setattr(self, name, torch.cat([value, value.new_zeros((self.d_sae, extra))], 1))
        self.n_labels = max(self.n_labels, n_labels)

    @torch.no_grad()
    def update(self, rows: Tensor, atoms: Tensor, values: Tensor, image: Tensor, label: Tensor) -> None:
        """Add a batch: the non-zero codes ``values`` at ``(rows, atoms)`` of tokens of images ``image [B]`` with
        ``label [B]``."""
        keys, inverse, counts = torch.unique(image, return_inverse=True, return_counts=True)
        image_label = torch.full(keys.shape, -1, dtype=torch.int64, device=keys.device)
        image_label[inverse] = label.to(keys.device)
        pair_image, pair_atom, pair_max = self._image_maxima(inverse[rows], atoms, values.float(), len(keys))
        complete = counts == self.tokens_per_image
        whole = complete[pair_image]
        self._count(image_label[complete], pair_atom[whole], image_label[pair_image[whole]], pair_max[whole])
        for i in (~complete).nonzero().squeeze(1).tolist():
            best = torch.full((self.d_sae,), NOT_FIRED, dtype=torch.float32, device=self.device)
            mine = pair_image == i
            best[pair_atom[mine]] = pair_max[mine]
            self.add_part(int(keys[i]), best, int(counts[i]), int(image_label[i]))

    def _image_maxima(
        self, image_index: Tensor, atoms: Tensor, values: Tensor, n_images: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The distinct (image, atom) pairs among the non-zero codes, with the pair's largest code."""
        if self.tokens_per_image == 1:
            return image_index, atoms, values  # one token per image: already distinct
        flat = image_index * self.d_sae + atoms
        if n_images * self.d_sae * 4 <= DENSE_LIMIT:
            best = torch.full((n_images * self.d_sae,), NOT_FIRED, dtype=torch.float32, device=atoms.device)
            best.scatter_reduce_(0, flat, values, "amax")
            found = (best > NOT_FIRED).nonzero().squeeze(1)
            return torch.div(found, self.d_sae, rounding_mode="floor"), found % self.d_sae, best[found]
        pairs, inverse = torch.unique(flat, return_inverse=True)
        best = torch.full(pairs.shape, NOT_FIRED, dtype=torch.float32, device=atoms.device)
        best.scatter_reduce_(0, inverse, values, "amax")
        return torch.div(pairs, self.d_sae, rounding_mode="floor"), pairs % self.d_sae, best

    def add_part(self, key: int, best: Tensor, seen: int, label: int) -> None:
        """Part of an image (``best``: each atom's largest code on it, -inf where none): kept until its tokens are
        complete, then counted once."""
        if key in self.pending:
            before, before_seen, _ = self.pending[key]
            best, seen = torch.maximum(before, best), before_seen + seen
        if seen >= self.tokens_per_image:
            self.pending.pop(key, None)
            self.count_image(best, label)
        else:
            self.pending[key] = (best, seen, label)

    def count_image(self, best: Tensor, label: int) -> None:
        """One whole image with label ``label`` (-1: none); ``best``: each atom's largest code on it (-inf: none)."""
        best = best.to(self.device)
        atoms = (best > NOT_FIRED).nonzero().squeeze(1)
        labels = torch.tensor([label], dtype=torch.int64, device=self.device)
        self._count(labels, atoms, labels.expand_as(atoms), best[atoms])

    def _count(self, image_labels: Tensor, atoms: Tensor, atom_labels: Tensor, maxima: Tensor) -> None:
        """Whole images: their labels, and one (atom, label, activation) per image the atom fires on."""
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
        weight = maxima.double().clamp_(min=0.0)  # the positive part, as the top-N table ranks
        labelled, unlabelled = weight[known], weight[~known]
        self.label_weight.view(-1).index_add_(0, flat, labelled)
        self.label_weight_sq.index_add_(0, atoms[known], labelled * labelled)
        self.label_weight_unlabelled.index_add_(0, unknown, unlabelled)
        self.label_weight_sq_unlabelled.index_add_(0, unknown, unlabelled * unlabelled)

    # --- results -----------------------------------------------------------------------------
    def state(self) -> dict[str, Tensor]:
        """The counts and sums, ``[..., n_labels]`` (no spare columns)."""
        state = {name: getattr(self, name) for name in LABEL_FIELDS}
        for name in ("label_fire", "label_weight"):
            state[name] = state[name][:, : self.n_labels].contiguous()
        state["label_images"] = state["label_images"][: self.n_labels].contiguous()
        return state

    def load_state(self, state: dict[str, Tensor]) -> None:
        for name in LABEL_FIELDS:
            setattr(self, name, state[name].to(self.device))
        self.n_labels = int(self.label_fire.shape[1])

    def leftover(self) -> list[tuple[int, np.ndarray, np.ndarray, int, int]]:
        """The images still incomplete here, as ``(key, atoms fired, their largest codes, tokens seen, label)`` (what
        ranks exchange)."""
        parts = []
        for key, (best, seen, label) in sorted(self.pending.items()):
            atoms = (best > NOT_FIRED).nonzero().squeeze(1)
            parts.append((key, atoms.cpu().numpy(), best[atoms].cpu().numpy(), seen, label))
        return parts

    def resolve(self, parts: Iterable[tuple[int, np.ndarray, np.ndarray, int, int]]) -> None:
        """Count the images split between ranks, each once (its parts' maxima united); an image never completed
        (the data ended inside it) is counted as it is."""
        self.pending.clear()
        for key, atoms, maxima, seen, label in parts:
            best = torch.full((self.d_sae,), NOT_FIRED, dtype=torch.float32, device=self.device)
            best[torch.as_tensor(atoms, dtype=torch.int64, device=self.device)] = torch.as_tensor(
                maxima, dtype=torch.float32, device=self.device
            )
            self.add_part(int(key), best, int(seen), int(label))
        for best, _, label in self.pending.values():
            self.count_image(best, label)
        self.pending.clear()
