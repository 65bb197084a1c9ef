"""Benchmark: writing shards of a token subset (`--tokens_per_image N`) against all tokens, same run.

    python -m benchmarks.token_subset                      # DINOv2 ViT-B/14 layout: 5 + 16x16 tokens, d 768
    python -m benchmarks.token_subset --n_patches 64 --n_images 512 --repeats 5

Both sides write the same float16 activations of `--n_images` images (random, DINOv2's
shape) with `shards.write_shard`, the function the extraction's writer processes run:

- all tokens (the reference): every sample `[261, 768]`, no positions.
- subset: per batch of `--batch_size` images, `token_selection.selected_positions` picks
  the tokens and a gather keeps them, as `shard_loop.forward_tokens` does on the device;
  each sample is `[5 + N, 768]` plus its `positions.npy`.

Printed: bytes on disk, their ratio to the all-token shard (the disk saving that the
disk table of docs/extraction.md states from the formula) and the images/s of each side with their ratio
(best of `--repeats`, alternating, after a warm-up). The subset side's time includes the
selection and the gather.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from feature_extraction.shards import shard_fname, write_shard
from feature_extraction.token_selection import make_selection, selected_positions

N_PREFIX, GRID, D = 5, (16, 16), 768  # DINOv2 ViT-B/14 with registers at 224 px


def image_ids(n_images: int) -> list[str]:
    return [f"n01440764/n01440764_{10026 + i}%2EJPEG" for i in range(n_images)]


def write_all(out: Path, tokens: torch.Tensor, ids: list[str]) -> float:
    start = time.perf_counter()
    samples = ((key, tokens[i].numpy(), {"image_id": key}) for i, key in enumerate(ids))
    write_shard(out, 0, samples)
    return time.perf_counter() - start


def write_subset(out: Path, tokens: torch.Tensor, ids: list[str], batch_size: int, selection: dict) -> float:
    start = time.perf_counter()

    def samples():  # noqa: ANN202
        for lo in range(0, len(ids), batch_size):
            batch_ids = ids[lo : lo + batch_size]
            positions = selected_positions(batch_ids, selection, N_PREFIX, GRID)
            index = torch.from_numpy(positions.astype(np.int64))
            kept = tokens[lo : lo + batch_size].gather(1, index[:, :, None].expand(-1, -1, D)).numpy()
            for j, key in enumerate(batch_ids):
                yield key, kept[j], {"image_id": key}, positions[j]

    write_shard(out, 0, samples())
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n_images", type=int, default=256)
    parser.add_argument("--n_patches", type=int, default=64, help="--tokens_per_image of the subset side")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    tokens = torch.randn(args.n_images, N_PREFIX + GRID[0] * GRID[1], D).to(torch.float16)
    ids = image_ids(args.n_images)
    selection = make_selection(args.n_patches, True, 0, N_PREFIX, GRID)
    with tempfile.TemporaryDirectory(prefix="bench-subset-") as tmp:
        all_dpath, subset_dpath = Path(tmp) / "all", Path(tmp) / "subset"
        write_all(all_dpath, tokens[:8], ids[:8])  # warm-up
        write_subset(subset_dpath, tokens[:8], ids[:8], args.batch_size, selection)
        all_s, subset_s = [], []
        for _ in range(args.repeats):
            all_s.append(write_all(all_dpath, tokens, ids))
            subset_s.append(write_subset(subset_dpath, tokens, ids, args.batch_size, selection))
        all_bytes = (all_dpath / shard_fname(0)).stat().st_size
        subset_bytes = (subset_dpath / shard_fname(0)).stat().st_size
    n_stored = N_PREFIX + args.n_patches
    all_rate, subset_rate = args.n_images / min(all_s), args.n_images / min(subset_s)
    print(
        f"token subset: DINOv2 layout ({N_PREFIX} + {GRID[0]}x{GRID[1]} tokens, d={D}, float16), "
        f"{args.n_images} images, batch {args.batch_size}, best of {args.repeats}, {torch.get_num_threads()} threads"
    )
    print(
        f"  all tokens ({N_PREFIX + GRID[0] * GRID[1]}/image)  {all_bytes / args.n_images / 1024:8.1f} KiB/image  "
        f"{all_rate:8.1f} images/s"
    )
    print(
        f"  subset N={args.n_patches} ({n_stored}/image)   {subset_bytes / args.n_images / 1024:8.1f} KiB/image  "
        f"{subset_rate:8.1f} images/s"
    )
    print(
        f"  ratio subset/all: bytes {subset_bytes / all_bytes:.3f} (tokens alone {n_stored / 261:.3f}), "
        f"write speed {subset_rate / all_rate:.2f}x"
    )


if __name__ == "__main__":
    main()
