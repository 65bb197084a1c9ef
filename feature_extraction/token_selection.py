"""Which of a backbone's tokens an extraction stores: all of them, or a seeded subset per image.

All tokens of ImageNet-1k through a ViT-B/14 are ~0.5 TB of float16 per backbone and
layer (docs/extraction.md, "Disk per backbone"). `--tokens_per_image N` stores N patch tokens per
image instead, and `--keep_prefix_tokens` keeps or drops the CLS and register tokens.

Design choices:
- The subset depends only on the extraction seed and the image id, never on the task,
  the batch or the shard, so every task of an array job, every rerun and any reader
  can recompute it. Patch p (0-based, row-major) scores splitmix64's finaliser of
  `key + (p + 1) * 0x9E3779B97F4A7C15 mod 2^64`, with `key` the 8-byte little-endian
  blake2b digest of `f"{seed}\\0{image_id}"`; the N lowest scores win (ties by patch
  index). Plain integer arithmetic, so no numpy or torch release can change which patches
  are picked (a `Generator.choice` stream carries no such promise).
- A different random subset per image rather than one fixed sub-grid: over the dataset
  every patch position is equally represented (tested), so the SAE sees the whole
  image plane, and each image still costs N tokens.
- Positions are stored ascending, as positions in the backbone's full token sequence
  (prefix tokens 0..n_prefix_tokens-1, then n_prefix_tokens + row * grid_w + col), so a
  stored token maps back to its patch without knowing how it was chosen.
- Keeping every token is *not* a selection (`None`): N equal to the patch count with the
  prefix kept, or a backbone without prefix tokens (SigLIP) with N omitted, writes the
  same shards as an extraction without the flags and no `positions.npy`.
- A backbone's prefix is its CLS token (first) then its registers; SigLIP has neither.
- `shards.load_manifest` fills `token_selection: null` and all-token `token_kinds` into a
  manifest written before these fields, so old shard directories read as all tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from feature_extraction.validate import check_int

__all__ = ["full_token_count", "grid_cell", "make_selection", "patch_scores", "selected_positions", "token_kinds"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment (2^64 / golden ratio)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def full_token_count(n_prefix_tokens: int, grid: tuple[int, int] | list[int]) -> int:
    """Tokens the backbone produces per image: prefix tokens plus one per patch."""
    return int(n_prefix_tokens) + int(grid[0]) * int(grid[1])


def make_selection(
    tokens_per_image: int | None,
    keep_prefix_tokens: bool,
    seed: int,
    n_prefix_tokens: int,
    grid: tuple[int, int] | list[int],
    backbone: str = "the backbone",
) -> dict | None:
    """The manifest's `token_selection` for these flags, or None when every token is kept.

    Raises a one-line ValueError for N outside [1, number of patches].
    """
    n_patches = int(grid[0]) * int(grid[1])
    if tokens_per_image is not None:
        check_int(
            "--tokens_per_image",
            tokens_per_image,
            1,
            n_patches,
            note=f" (the {grid[0]}x{grid[1]} patches of {backbone})",
            fix="; omit it to keep every token",
        )
    if not isinstance(keep_prefix_tokens, bool):
        raise ValueError(f"--keep_prefix_tokens must be true or false, got {keep_prefix_tokens!r}")
    n = n_patches if tokens_per_image is None else tokens_per_image
    if n == n_patches and (keep_prefix_tokens or n_prefix_tokens == 0):
        return None
    return {"patches_per_image": int(n), "keep_prefix_tokens": keep_prefix_tokens, "seed": int(seed)}


def token_kinds(n_prefix_tokens: int, grid: tuple[int, int] | list[int], selection: dict | None) -> dict:
    """Stored tokens per sample by kind: `{"cls": .., "registers": .., "patches": ..}`."""
    keep_prefix = selection is None or selection["keep_prefix_tokens"]
    n_cls = min(1, int(n_prefix_tokens)) if keep_prefix else 0
    n_registers = int(n_prefix_tokens) - min(1, int(n_prefix_tokens)) if keep_prefix else 0
    n_patches = int(grid[0]) * int(grid[1]) if selection is None else int(selection["patches_per_image"])
    return {"cls": n_cls, "registers": n_registers, "patches": n_patches}


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic): a fixed, well-mixed 64-bit hash."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX2
    return x ^ (x >> np.uint64(31))


def patch_scores(image_ids: Sequence[str], seed: int, n_patches: int) -> np.ndarray:
    """The uint64 score `[len(image_ids), n_patches]` of each patch of each image; the lowest are stored."""
    keys = b"".join(
        hashlib.blake2b(f"{int(seed)}\0{image_id}".encode(), digest_size=8).digest() for image_id in image_ids
    )
    with np.errstate(over="ignore"):
        offsets = np.arange(1, n_patches + 1, dtype=np.uint64) * _GOLDEN
        return _splitmix64(np.frombuffer(keys, dtype="<u8").astype(np.uint64)[:, None] + offsets)


def selected_positions(
    image_ids: Sequence[str], selection: dict | None, n_prefix_tokens: int, grid: tuple[int, int] | list[int]
) -> np.ndarray:
    """Ascending positions, in the full token sequence, of the tokens stored for each image: `[B, n_stored]`.

    int16 when every position fits (any ViT up to 181x181 patches), else int32. One call
    per batch: the hash and the sort run over the whole batch at once (70 us an image at batch 256
    on the loaded 2-core dev box, beside milliseconds of forward and writing).
    """
    n_prefix, n_patches = int(n_prefix_tokens), int(grid[0]) * int(grid[1])
    dtype = np.int16 if n_prefix + n_patches <= np.iinfo(np.int16).max else np.int32
    if selection is None:
        return np.broadcast_to(np.arange(n_prefix + n_patches, dtype=dtype), (len(image_ids), n_prefix + n_patches))
    n = int(selection["patches_per_image"])
    scores = patch_scores(image_ids, selection["seed"], n_patches)
    patches = np.sort(np.argsort(scores, axis=1, kind="stable")[:, :n], axis=1) + n_prefix
    prefix = np.arange(n_prefix if selection["keep_prefix_tokens"] else 0)
    return np.concatenate([np.broadcast_to(prefix, (len(image_ids), len(prefix))), patches], axis=1).astype(dtype)


def grid_cell(position: int, n_prefix_tokens: int, grid: tuple[int, int] | list[int]) -> tuple[int, int] | None:
    """`(row, col)` of a full-sequence token position on the patch grid; None for a CLS or register token."""
    patch = int(position) - int(n_prefix_tokens)
    if patch < 0:
        return None
    if patch >= int(grid[0]) * int(grid[1]):
        raise ValueError(
            f"token position {position} is beyond the {grid[0]}x{grid[1]} grid after {n_prefix_tokens} prefix tokens"
        )
    return divmod(patch, int(grid[1]))
