"""The synthetic data of ``python -m benchmarks.features`` (and of the scaling benchmark's feature parts):
shards in DINOv2's token layout, JPEG photos for them, and a TopK SAE, shared by the pass parts
(``benchmarks/features/__main__.py``) and the site parts (``benchmarks/features/site.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

N_PREFIX, GRID = 5, (16, 16)
TPI = N_PREFIX + GRID[0] * GRID[1]


def write_synthetic_shards(
    dpath: Path, n_images: int, d: int, images_per_shard: int = 64, seed: int = 0, photos: Path | None = None
) -> None:
    """Shards in DINOv2's layout; with ``photos``, each sample's source is ``photos/<i>.jpg`` (see write_photos)."""
    from feature_extraction import shards as S

    rng = np.random.default_rng(seed)
    n_shards = 0
    for index, start in enumerate(range(0, n_images, images_per_shard)):
        count = min(images_per_shard, n_images - start)
        samples = [
            (
                f"img{start + i:07d}",
                rng.standard_normal((TPI, d)).astype(np.float16),
                {"image_id": f"img{start + i:07d}", "label": (start + i) % 1000, "source": "skimage.data.astronaut"}
                if photos is None
                else {
                    "image_id": f"{start + i}.jpg",
                    "label": (start + i) % 1000,
                    "class_name": f"n{(start + i) % 1000:08d}",
                    "source": str(photos / f"{start + i}.jpg"),
                },
            )
            for i in range(count)
        ]
        S.write_shard(dpath, index, samples)
        n_shards += 1
    S.write_manifest(
        dpath,
        n_shards=n_shards,
        spec={"name": "synthetic", "image_size": 224},
        layer=0,
        tokens_per_image=TPI,
        n_prefix_tokens=N_PREFIX,
        grid=GRID,
    )


def make_sae(d: int, d_sae: int, k: int, seed: int = 0):  # noqa: ANN201
    import torch

    from sae_pipeline.sae import TopKSAE

    torch.manual_seed(seed)
    return TopKSAE(d_in=d, d_sae=d_sae, k=k).eval()


def write_photos(dpath: Path, n_images: int, rng: np.random.Generator) -> None:
    """``<i>.jpg``: smooth synthetic photos (gradients and a disc), 256x256 JPEG like ImageNet's."""
    from PIL import Image

    dpath.mkdir(exist_ok=True)  # parts run one after another in one work folder
    yy, xx = np.mgrid[0:256, 0:256] / 256.0
    for i in range(n_images):
        c = rng.random((3, 3))
        disc = ((xx - c[0, 0]) ** 2 + (yy - c[0, 1]) ** 2 < 0.05 + 0.1 * c[0, 2])[..., None]
        array = (np.stack([c[1, j] * xx + c[2, j] * yy for j in range(3)], -1) * 0.6 + disc * 0.4) * 255
        Image.fromarray(array.astype(np.uint8)).save(dpath / f"{i}.jpg", quality=90)
