"""After the top-N pass: re-read the top images' tokens and take each atom's activation over them.

The top-N pass keeps one token per (atom, image); a heatmap needs the atom's code on every
token of the image. Only the images in some atom's list are read again (at most d_sae · N,
usually far fewer), sample by sample (:func:`feature_extraction.shards.read.read_shard_samples`
reads just those members), and each rank reads the shards ``s`` with ``s mod world_size =
rank``. A heatmap is laid out over the backbone's *full* token sequence (prefix tokens, then
the patch grid in row-major order), each stored token at its recorded position
(``positions.npy`` for a token subset) and NaN where the extraction stored no token, so a
subset extraction draws its stored patches in place and leaves the others blank.

While an image's codes are at hand, its own top atoms (by maximum and by sum over its tokens,
with their heatmaps on it) are kept for its image page (:mod:`sae_pipeline.features.image_top`).
The codes stay the SAE's sparse entries throughout (`encode` returns them; `image_codes.py`
groups them per image), never ``[tokens, d_sae]``.

Pixel data (digits, MNIST) has one token per image, the image itself: no heatmap, the
thumbnail is the token. An ``.h5`` token cache has tokens without images: entries are listed
with their id and position only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from feature_extraction.shards import shard_fpaths
from feature_extraction.shards.read import read_shard_samples
from sae_pipeline.data.sources import RowSource, ShardSource
from sae_pipeline.features.image_codes import split_images
from sae_pipeline.features.image_top import image_top_atoms
from sae_pipeline.sae.sparse_decode import SparseCodes

ENCODE_TOKENS = 4096  # tokens per encode call in this pass


@dataclass(frozen=True)
class Layout:
    """How tokens map to images: ``kind`` is "patches" (shards), "pixels" (digits, MNIST) or "tokens" (.h5)."""

    kind: str
    tokens_per_image: int
    n_cls: int = 0
    n_registers: int = 0
    grid: tuple[int, int] = (0, 0)
    image_shape: tuple[int, int] | None = None

    @property
    def n_prefix(self) -> int:
        return self.n_cls + self.n_registers

    @property
    def n_full(self) -> int:
        """Tokens of the backbone's full sequence: the length of a heatmap."""
        return self.n_prefix + self.grid[0] * self.grid[1]


def layout_of(source: ShardSource | RowSource) -> Layout:
    """The token layout of an opened data source."""
    if isinstance(source, ShardSource):
        manifest = source.manifest
        n_prefix = int(manifest["n_prefix_tokens"])
        n_cls = min(1, n_prefix)
        return Layout(
            "patches",
            int(manifest["tokens_per_image"]),
            n_cls,
            n_prefix - n_cls,
            tuple(int(g) for g in manifest["grid"]),
        )
    if source.image_shape is not None:
        return Layout("pixels", 1, image_shape=tuple(source.image_shape))
    return Layout("tokens", 1)


def image_keys(tokens: Tensor, layout: Layout) -> Tensor:
    """Global image key of each global token index (tokens of one image share it)."""
    return torch.div(tokens, layout.tokens_per_image, rounding_mode="floor")


def row_labels(source: RowSource, data_dpath: str = "data") -> np.ndarray | None:
    """Class labels of the rows of digits / MNIST (None when the source has none, as an .h5 cache).

    ``data_dpath`` is unused: the source's reader already holds the labels (kept for callers)."""
    labels = source.reader.labels(np.arange(source.reader.n_rows))
    return labels if (labels >= 0).any() else None


@torch.no_grad()
def collect_images(
    state: dict[str, Tensor],
    source: ShardSource | RowSource,
    layout: Layout,
    encode: Callable[[Tensor], SparseCodes],
    rank: int = 0,
    world_size: int = 1,
    progress: Callable[[int], None] | None = None,
    data_dpath: str = "data",
) -> dict[str, Any]:
    """This rank's part of the top images: their metadata, and for patch data the heatmaps; ``encode``
    gives the canonical sparse entries of a chunk's codes (`SparseAutoencoder.encode_sparse`).

    Returns ``{"images": {key: meta}, "heat_atom": int64 [E], "heat_rank": int64 [E], "heat": float16
    [E, n_full]}``; ``meta`` adds ``pixels`` (pixel data), ``positions`` (stored positions) and
    ``top_atoms`` (the image's own top atoms, :func:`sae_pipeline.features.image_top.image_top_atoms`;
    not for ``.h5`` tokens, which have no images).
    """
    token = state["token"].cpu()
    filled = token >= 0
    atom_grid = torch.arange(token.shape[0])[:, None].expand_as(token)
    rank_grid = torch.arange(token.shape[1])[None, :].expand_as(token)
    atoms, ranks, keys = atom_grid[filled].numpy(), rank_grid[filled].numpy(), state["image"].cpu()[filled].numpy()
    tokens = token[filled].numpy()
    out: dict[str, Any] = {
        "images": {},
        "heat_atom": np.zeros(0, np.int64),
        "heat_rank": np.zeros(0, np.int64),
        "heat": np.zeros((0, layout.n_full), np.float16),
    }
    if isinstance(source, ShardSource):
        return _collect_shard_images(out, source, layout, encode, atoms, ranks, keys, rank, world_size, progress)
    unique_rows = np.unique(tokens)
    mine = unique_rows[unique_rows % world_size == rank]
    if len(mine):
        ids = source.reader.image_ids(mine)
        positions = source.reader.token_positions(mine)
        labels = row_labels(source, data_dpath)
        pixels = source.reader.read(mine) if layout.kind == "pixels" else None
        codes = []
        if pixels is not None:
            x = np.asarray(pixels, np.float32)
            for s in range(0, len(x), ENCODE_TOKENS):
                codes += split_images(encode(torch.from_numpy(x[s : s + ENCODE_TOKENS])), 1)
        for i, row in enumerate(mine.tolist()):
            meta = {
                "image_id": ids[i],
                "label": None if labels is None else int(labels[row]),
                "position": int(positions[i]),
            }
            if pixels is not None:
                meta["pixels"] = pixels[i].astype(np.float32)
                meta["top_atoms"] = image_top_atoms(codes[i], np.zeros(1, np.int64), 0)
            out["images"][int(row)] = meta
    if progress is not None:
        progress(len(mine))
    return out


def _collect_shard_images(
    out: dict,
    source: ShardSource,
    layout: Layout,
    encode: Callable[[Tensor], SparseCodes],
    atoms: np.ndarray,
    ranks: np.ndarray,
    keys: np.ndarray,
    rank: int,
    world_size: int,
    progress: Callable[[int], None] | None,
) -> dict:
    manifest = source.manifest
    counts = np.array([entry["count"] for entry in manifest["shards"]], np.int64)
    first_image = np.concatenate([[0], np.cumsum(counts)])
    fpaths = shard_fpaths(source.name, manifest)
    wanted = np.unique(keys)
    shard_of = np.searchsorted(first_image, wanted, side="right") - 1
    by_image: dict[int, list[int]] = {}
    for i, key in enumerate(keys.tolist()):
        by_image.setdefault(key, []).append(i)
    heat_rows: list[np.ndarray] = []
    heat_entries: list[int] = []
    for shard in np.unique(shard_of).tolist():
        if shard % world_size != rank:
            continue
        shard_keys = wanted[shard_of == shard]
        shape = (layout.tokens_per_image, source.d)  # a forged .npy header is refused before it is allocated
        samples = list(read_shard_samples(fpaths[shard], (shard_keys - first_image[shard]).tolist(), shape))
        for start in range(0, len(samples), max(1, ENCODE_TOKENS // layout.tokens_per_image)):
            chunk = samples[start : start + max(1, ENCODE_TOKENS // layout.tokens_per_image)]
            x = torch.from_numpy(np.concatenate([tokens for _, _, tokens, _, _ in chunk]).astype(np.float32))
            codes = split_images(encode(x), layout.tokens_per_image)
            for j, (index, _, tokens, positions, meta) in enumerate(chunk):
                key = int(first_image[shard] + index)
                stored = np.arange(len(tokens)) if positions is None else positions.astype(np.int64)
                image_codes = codes[j]
                out["images"][key] = {
                    **meta,
                    "positions": stored,
                    "top_atoms": image_top_atoms(image_codes, stored, layout.n_full),
                }
                entries = by_image[key]
                rows = np.full((len(entries), layout.n_full), np.nan, np.float16)
                rows[:, stored] = image_codes.columns(atoms[entries])
                heat_rows.append(rows)
                heat_entries.extend(entries)
        if progress is not None:
            progress(len(shard_keys))
    if heat_entries:
        entries = np.array(heat_entries, np.int64)
        out["heat_atom"], out["heat_rank"] = atoms[entries], ranks[entries]
        out["heat"] = np.concatenate(heat_rows)
    return out


def merge_collections(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' :func:`collect_images` results as one."""
    merged = {
        "images": {},
        "heat_atom": np.concatenate([p["heat_atom"] for p in parts]),
        "heat_rank": np.concatenate([p["heat_rank"] for p in parts]),
        "heat": np.concatenate([p["heat"] for p in parts]),
    }
    for part in parts:
        merged["images"].update(part["images"])
    return merged
