"""The user's images through the SAE's own backbone and the SAE, for `features explain`: each image's top atoms.

Why a module of its own: this is the one step of explain that computes (the backbone's forward and
the SAE's sparse codes, batch by batch); what runs is decided before it (`explain_backbone.py`) and
what is written after it (`explain_pages.py`). The tokens are the ones the extraction stores: the
token subset of an extraction with `--tokens_per_image` is chosen from the seed and the image id, as
there (ids: paths relative to a folder given, file names of files given, names of `samples`), and
the codes are split per image as the features pass splits them. An image that does not decode is
skipped and returned with the reason, for the command to name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


def image_records(paths: list[str]) -> list[Any]:
    """The images to explain: files as given (id: file name), folders and ``samples`` as the extraction lists them."""
    from feature_extraction.images import ImageRecord, list_images

    records = []
    for path in paths:
        if path == "samples" or Path(path).is_dir():
            records += list_images(path)
        elif Path(path).is_file():
            records.append(ImageRecord(Path(path).name, str(Path(path).resolve()), None))
        else:
            raise ValueError(f"--images {path}: not found; give image files, folders of images, or samples")
    return records


def image_tokens(
    backbone: Any, selection: dict | None, pixels: torch.Tensor, ids: list[str], device: torch.device
) -> tuple[torch.Tensor, np.ndarray | None]:
    """The tokens the extraction stores for these images (float16 ``[B, t, d]``) and their positions (None: all)."""
    from feature_extraction.shard_loop import forward_tokens
    from feature_extraction.token_selection import selected_positions

    spec = backbone.spec
    positions = None
    if selection is not None:
        positions = selected_positions(ids, selection=selection, n_prefix_tokens=spec.n_prefix_tokens, grid=spec.grid)
    tokens, event = forward_tokens(backbone, pixels, device, None if positions is None else torch.from_numpy(positions))
    if event is not None:  # CUDA: the copy to the host is asynchronous
        event.synchronize()
    return tokens, positions


@torch.no_grad()
def explain_images(sae: Any, backbone: Any, record: dict, records: list[Any], batch_size: int, device: str) -> dict:
    """Every decodable image's top atoms and view: ``{"explained": [(record, top, view)], "skipped": [(id, why)]}``."""
    from feature_extraction.images import ImageDataset
    from sae_pipeline.features.image_codes import split_images
    from sae_pipeline.features.image_top import image_top_atoms
    from sae_pipeline.features.images import view_transform
    from sae_pipeline.training.interrupts import raise_if_interrupted

    spec = backbone.spec
    view = view_transform(record["backbone"].get("preprocess"), spec.image_size)
    dataset = ImageDataset(records, lambda image: (backbone.preprocess(image), view(image)), log_skips=False)
    selection = record.get("token_selection")
    torch_device = torch.device(device)
    backbone.to(torch_device)
    sae = sae.to(torch_device)
    explained, skipped = [], []
    for start in range(0, len(records), batch_size):
        raise_if_interrupted()
        items = [dataset[i] for i in range(start, min(start + batch_size, len(records)))]
        ok = [(i, pair) for i, pair, _ in items if pair is not None]
        skipped += [(records[i].image_id, why) for i, pair, why in items if pair is None]
        if not ok:
            continue
        ids = [records[i].image_id for i, _ in ok]
        tokens, positions = image_tokens(
            backbone, selection, torch.stack([pair[0] for _, pair in ok]), ids, torch_device
        )
        b, t, d = tokens.shape
        x = tokens.reshape(b * t, d).to(torch_device).float()
        codes = split_images(sae.encode_sparse(x), t)  # as the features pass: the sparse entries, per image
        for j, (i, pair) in enumerate(ok):
            stored = np.arange(spec.n_tokens) if positions is None else positions[j].astype(np.int64)
            explained.append((records[i], image_top_atoms(codes[j], stored, spec.n_tokens), pair[1]))
    return {"explained": explained, "skipped": skipped}
