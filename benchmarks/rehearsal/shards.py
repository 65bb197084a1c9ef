"""The rehearsal's synthetic DINOv2-shaped shards, written by the project's shard writer.

Each image has DINOv2 ViT-B/14's layout (CLS + 4 registers + 16x16 patches = 261 tokens of d 768 in
float16 by default), stored as the extraction stores it: ``shard-NNNNNN.tar`` + sidecar per
``shard_size`` images (the extraction's default 1000) and ``manifest.json``, so ``fit``, ``features``,
``evaluate`` and ``predict`` take the folder as an extraction output. The tokens have structure for an
SAE to find: each is a sparse sum of unit directions of a fixed random dictionary (8 per token,
exponential coefficients) plus its image's label direction on a third of its patches, plus Gaussian
noise; so R² and the label statistics of ``features`` mean something. Images are generated one at a
time and streamed into the writer, so memory stays flat whatever ``--images``.
Each token's audit hash (``token_hashes``, for ``audit.py`` beside this) is saved per shard beside the shards.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from feature_extraction import shards as S

N_PREFIX, GRID = 5, (16, 16)  # DINOv2 with registers: CLS + 4 registers, 224 / 14 = 16 patches a side
ATOMS_PER_TOKEN = 8
SOURCE = "skimage.data.astronaut"  # stand-in image for the browser's thumbnails (the tokens are synthetic)

_COEFFS: dict[int, np.ndarray] = {}


def token_hashes(tokens: np.ndarray) -> np.ndarray:
    """uint64 hash of each row of float16 ``tokens [n, d]`` .

    An integer dot product of the float16 bit patterns with fixed random 64-bit coefficients, wrapping
    mod 2^64: exact and independent of summation order, so any two callers agree bit for bit."""
    tokens = np.ascontiguousarray(tokens, dtype=np.float16)
    d = tokens.shape[1]
    if d not in _COEFFS:
        _COEFFS[d] = np.random.default_rng(12345).integers(1, 2**63, size=d, dtype=np.int64) | 1
    bits = tokens.view(np.uint16).astype(np.int64)
    with np.errstate(over="ignore"):
        return (bits @ _COEFFS[d]).view(np.uint64)


def layout(d: int) -> dict:
    n_dirs = min(4096, 8 * d)
    return {"n_dirs": n_dirs, "tokens_per_image": N_PREFIX + GRID[0] * GRID[1]}


def n_labels(n_images: int) -> int:
    """ImageNet's 1000 labels at 25 000 images (25 images a label), fewer for smaller runs."""
    return min(1000, max(2, n_images // 25))


def _images(start: int, stop: int, d: int, n_images: int, dictionary: np.ndarray, seed: int) -> Iterator[tuple]:
    tpi = N_PREFIX + GRID[0] * GRID[1]
    labels = n_labels(n_images)
    for i in range(start, stop):
        rng = np.random.default_rng((seed, i))
        label = i % labels
        idx = rng.integers(labels, len(dictionary), size=(tpi, ATOMS_PER_TOKEN))
        coef = rng.exponential(1.0, size=(tpi, ATOMS_PER_TOKEN, 1)).astype(np.float32)
        tokens = (dictionary[idx] * coef).sum(axis=1)
        on_label = rng.random(tpi) < 1 / 3
        on_label[:N_PREFIX] = True  # CLS and registers carry the label too
        tokens[on_label] += 2.0 * dictionary[label]
        tokens += rng.standard_normal((tpi, d), np.float32) * np.float32(0.1)
        key = f"img{i:07d}"
        meta = {"image_id": key, "label": label, "class_name": f"class{label:04d}", "source": SOURCE}
        yield key, tokens.astype(np.float16), meta


def write(out: Path, n_images: int, d: int = 768, shard_size: int = 1000, seed: int = 0) -> dict:
    """``n_images`` images into ``out/shards``, their token hashes into ``out/hashes``; returns the manifest."""
    shards_dpath, hashes_dpath = out / "shards", out / "hashes"
    hashes_dpath.mkdir(parents=True, exist_ok=True)
    dictionary = np.random.default_rng(seed).standard_normal((layout(d)["n_dirs"], d)).astype(np.float32)
    dictionary /= np.linalg.norm(dictionary, axis=1, keepdims=True)
    n_shards = math.ceil(n_images / shard_size)
    for index in range(n_shards):
        hashes = []

        def hashed(samples: Iterator[tuple], hashes: list = hashes) -> Iterator[tuple]:
            for sample in samples:
                hashes.append(token_hashes(sample[1]))
                yield sample

        start = index * shard_size
        stop = min(n_images, start + shard_size)
        S.write_shard(shards_dpath, index, hashed(_images(start, stop, d, n_images, dictionary, seed)))
        np.save(hashes_dpath / f"{index:06d}.npy", np.concatenate(hashes))
    return S.write_manifest(
        shards_dpath,
        n_shards=n_shards,
        spec={"name": "dinov2_synthetic", "image_size": 224, "patch_size": 14},
        layer=0,
        tokens_per_image=N_PREFIX + GRID[0] * GRID[1],
        n_prefix_tokens=N_PREFIX,
        grid=GRID,
        extra={"synthetic": "benchmarks/rehearsal/shards.py", "seed": seed},
    )


def train_hashes(out: Path, val_fraction: float) -> np.ndarray:
    """The audit hashes of every token of the training split (the shards ``fit`` trains on)."""
    from sae_pipeline.data.sources import ShardSource

    source = ShardSource(out / "shards")
    every = source.units("all", val_fraction)  # manifest order: unit i is shard i
    indices = [every.index(unit) for unit in source.units("train", val_fraction)]
    return np.concatenate([np.load(out / "hashes" / f"{i:06d}.npy") for i in indices])


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="synthetic DINOv2-shaped shards (the rehearsal's stage 1)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--images", type=int, required=True)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--shard_size", type=int, default=1000)
    args = parser.parse_args()
    manifest = write(Path(args.out), args.images, args.d, args.shard_size)
    print(json.dumps({"n_tokens": manifest["n_tokens"], "n_shards": len(manifest["shards"])}))


if __name__ == "__main__":
    main()
