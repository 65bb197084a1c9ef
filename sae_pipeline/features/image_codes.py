"""One image's codes, grouped by atom: its per-atom maximum and sum over its tokens, and the columns a heatmap reads.

An image page ranks the image's atoms by their maximum and by their sum over its tokens
(`image_top.py`), and a heatmap is one atom's codes over the image's tokens. Taken from dense
`[tokens, d_sae]` codes, both cost a pass over tokens · d_sae elements per image (3.4 ms of CPU at
261 × 19 200, the largest part of the site's image work in BENCHMARKS.md); taken from the
canonical sparse entries (`sae_pipeline/sae/inference_codes.py`: k per token for the k-sparse
variants) they cost a sort of the image's tokens · k entries and two scatter-reductions over its
(image, atom) pairs (`np.add.at`, `np.maximum.reduceat`), done for a whole chunk of images at once.

Exact, not within rounding: an atom's entries on an image are summed in token order by `np.add.at`,
one by one from 0, as numpy's `codes.sum(axis=0)` adds an image's rows (the zeros it also adds change
no float: x + 0 = x); a maximum does not depend on the order, and the tokens an atom is 0 on count
as 0 in it. The reductions run on the CPU whatever the SAE's device (the entries are small:
they replace the dense codes that were copied to the host before).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sae_pipeline.sae.inference_codes import from_dense
from sae_pipeline.sae.sparse_decode import SparseCodes


@dataclass(frozen=True)
class ImageCodes:
    """The non-zero codes of one image of ``n_tokens`` tokens, by (atom, token)."""

    n_tokens: int
    atoms: np.ndarray  # int64 [P], increasing: the atoms non-zero on some token
    peak: np.ndarray  # float32 [P]: the maximum over all tokens (0 where the atom is 0 on some token)
    total: np.ndarray  # float32 [P]: the sum over all tokens
    crow: np.ndarray  # int64 [P + 1]: each atom's entries in ``token`` / ``value``
    token: np.ndarray  # int64 [nnz]: the image's token (0-based), increasing within an atom
    value: np.ndarray  # float32 [nnz]

    @classmethod
    def from_dense(cls, codes: np.ndarray) -> ImageCodes:
        """From one image's dense codes ``[tokens, d_sae]``."""
        return split_images(from_dense(torch.from_numpy(np.asarray(codes, np.float32))), len(codes))[0]

    def lookup(self, atoms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(pair, present)`` of ``atoms``: the index of each in ``self.atoms`` and whether it is there."""
        pair = np.searchsorted(self.atoms, atoms)
        present = pair < len(self.atoms)
        present[present] = self.atoms[pair[present]] == atoms[present]
        return pair, present

    def columns(self, atoms: np.ndarray) -> np.ndarray:
        """``codes[:, atoms].T`` float32 ``[len(atoms), n_tokens]`` of the dense codes (0 off the entries)."""
        atoms = np.asarray(atoms, np.int64)
        out = np.zeros((len(atoms), self.n_tokens), np.float32)
        pair, present = self.lookup(atoms)
        rows, pair = np.flatnonzero(present), pair[present]
        lengths = self.crow[pair + 1] - self.crow[pair]
        entry = np.repeat(self.crow[pair] - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
        out[np.repeat(rows, lengths), self.token[entry]] = self.value[entry]
        return out


def split_images(codes: SparseCodes, tokens_per_image: int) -> list[ImageCodes]:
    """The canonical entries of a chunk of whole images (``tokens_per_image`` consecutive tokens each) per image.

    On the CPU in numpy, one thread: a few sorts and reductions over the chunk's entries, where torch's
    thread hand-offs would cost more than the work on a busy machine (as `sparse_decode.py` notes for its sort)."""
    assert codes.values is not None
    rows, atoms = codes.rows.cpu().numpy(), codes.indices.cpu().numpy()
    values = codes.values.detach().cpu().float().numpy()
    n_images = codes.batch_size // tokens_per_image
    # Entries by (image, atom, token): a stable sort of the (token, atom)-ordered entries by (image, atom).
    key = rows // tokens_per_image * codes.d_sae + atoms
    order = np.argsort(key, kind="stable")
    key, token, value = key[order], rows[order] % tokens_per_image, values[order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if len(key) else np.zeros(0, np.int64)
    crow = np.r_[starts, len(key)].astype(np.int64)
    count, pairs = np.diff(crow), key[starts]
    total = np.zeros(len(pairs), np.float32)
    np.add.at(total, np.repeat(np.arange(len(pairs)), count), value)  # one by one, in token order
    peak = np.maximum.reduceat(value, starts) if len(pairs) else np.zeros(0, np.float32)
    peak = np.where(count < tokens_per_image, np.maximum(peak, 0), peak)  # the atom's zero tokens
    bounds = np.searchsorted(pairs // codes.d_sae, np.arange(n_images + 1))
    pair_atom = pairs % codes.d_sae
    out = []
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        first, last = crow[lo], crow[hi]
        out.append(
            ImageCodes(
                tokens_per_image,
                pair_atom[lo:hi],
                peak[lo:hi],
                total[lo:hi],
                crow[lo : hi + 1] - first,
                token[first:last],
                value[first:last],
            )
        )
    return out
