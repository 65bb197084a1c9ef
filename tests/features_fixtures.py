"""Synthetic inputs of the feature-browser tests: shards of a token subset over real image files, and an SAE
whose codes are known exactly (ReLU with an identity encoder: codes = relu(x))."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

from feature_extraction import shards as S
from feature_extraction.token_selection import make_selection, selected_positions, token_kinds
from sae_pipeline.artifacts.export import EXPORT_FORMAT
from sae_pipeline.artifacts.export_files import CONFIG_FNAME, WEIGHTS_FNAME
from sae_pipeline.sae import ReLUSAE
from sae_pipeline.sae.config import sae_config

N_CLS, N_REGISTERS, GRID, PATCHES_KEPT, D = 1, 2, (4, 4), 6, 12
N_PREFIX = N_CLS + N_REGISTERS
IMAGE_SIZE = 32
PREPROCESS = {
    "library": "timm",
    "size": [IMAGE_SIZE, IMAGE_SIZE],
    "crop": {"crop_pct": 1.0, "crop_mode": "center"},
    "mean": [0.5, 0.5, 0.5],
    "std": [0.5, 0.5, 0.5],
    "interpolation": "bilinear",
}


def write_images(dpath: Path, n: int) -> list[str]:
    """``n`` small PNG files in two class folders; returns their ids (paths relative to ``dpath``)."""
    rng = np.random.default_rng(0)
    ids = []
    for i in range(n):
        image_id = f"class{i % 2}/img{i:03d}.png"
        (dpath / image_id).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(dpath / image_id)
        ids.append(image_id)
    return ids


def write_shards(
    dpath: Path, images_dpath: Path, n_images: int = 14, shard_size: int = 4, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """A finished shard directory of a token subset (prefix tokens + PATCHES_KEPT patches per image).

    Returns ``(tokens [n_tokens, D] float32 in global order, positions [n_tokens])``.
    """
    ids = write_images(images_dpath, n_images)
    selection = make_selection(PATCHES_KEPT, True, 3, N_PREFIX, GRID)
    positions = selected_positions(ids, selection, N_PREFIX, GRID)
    tpi = sum(token_kinds(N_PREFIX, GRID, selection).values())
    rng = np.random.default_rng(seed)
    tokens = (rng.standard_normal((n_images, tpi, D)) * 2).astype(np.float16)
    tokens[:, :, 0] = np.round(tokens[:, :, 0])  # atom 0 has many exact ties
    n_shards = 0
    for index, start in enumerate(range(0, n_images, shard_size)):
        samples = []
        for i in range(start, min(start + shard_size, n_images)):
            meta = {
                "image_id": ids[i],
                "label": i % 2,
                "class_name": f"class{i % 2}",
                "source": str((images_dpath / ids[i]).resolve()),
            }
            samples.append((f"img{i:03d}", tokens[i], meta, positions[i]))
        S.write_shard(dpath, index, samples)
        n_shards += 1
    spec = {"name": "synthetic", "image_size": IMAGE_SIZE, "preprocess": PREPROCESS}
    S.write_manifest(
        dpath,
        n_shards=n_shards,
        spec=spec,
        layer=0,
        tokens_per_image=tpi,
        n_prefix_tokens=N_PREFIX,
        grid=GRID,
        token_selection=selection,
    )
    return tokens.reshape(-1, D).astype(np.float32), positions.reshape(-1).astype(np.int64)


def identity_sae(d: int = D) -> ReLUSAE:
    """codes = relu(x) exactly: W_enc = I, b_enc = 0, b_pre = 0 (W_dec = I too)."""
    sae = ReLUSAE(d_in=d, d_sae=d)
    with torch.no_grad():
        for name, value in sae.state_dict().items():
            if name in ("W_enc", "W_dec"):
                value.copy_(torch.eye(d))
            elif name in ("b_enc", "b_pre"):
                value.zero_()
    return sae


def write_export(sae: torch.nn.Module, dpath: Path) -> Path:
    """An export directory (config.json + sae.safetensors) as ``python -m sae_pipeline export`` writes."""
    dpath.mkdir(parents=True, exist_ok=True)
    config = {"format": EXPORT_FORMAT, **sae_config(sae), "d_in": sae.d_in, "d_sae": sae.d_sae}
    (dpath / CONFIG_FNAME).write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in sae.state_dict().items()}, str(dpath / WEIGHTS_FNAME))
    return dpath


REPLACED = ({3, 7}, {5, 7})  # the atoms each replica lost: 7 is found in 1 of 3 seeds, 3 and 5 in 2, the rest in 3


def write_replicas(root: Path) -> list[str]:
    """Two seeds of the identity SAE: its atoms permuted (and, in the second, signs flipped), those of ``REPLACED``
    swapped for random rows orthogonal to them; the first an export, the second a checkpoint of `fit`'s form."""
    rng = np.random.default_rng(7)
    paths = []
    for r, lost in enumerate(REPLACED):
        sae = identity_sae()
        w = torch.eye(D)
        for atom in lost:
            w[atom] = torch.from_numpy(rng.normal(size=D)).float()
            w[atom, sorted(lost)] = 0.0
        w = w[torch.from_numpy(rng.permutation(D))] * (
            torch.from_numpy(rng.choice([-1.0, 1.0], (D, 1))).float() if r else 1
        )
        with torch.no_grad():
            sae.W_dec.copy_(torch.nn.functional.normalize(w, dim=1))
        if r == 0:
            paths.append(str(write_export(sae, root / "seed1")))
            continue
        state = {f"sae.{key}": value for key, value in sae.state_dict().items()}
        torch.save({"state_dict": state, "sae_config": sae_config(sae), "input_scale": 1.0}, root / "seed2.ckpt")
        paths.append(str(root / "seed2.ckpt"))
    return paths
