"""TensorBoard during training: the top patches of a few atoms as one image grid, at every validation.

The full browser (``python -m sae_pipeline features``) needs a pass over the dataset; this
callback shows features without leaving TensorBoard, on a bounded sample: the first
``max_tokens`` tokens of the validation split (the training split when there is none), read
with their image ids and positions, encoded by the SAE under training, and ranked with the
same exact top-N table as the browser (:class:`sae_pipeline.features.topn.TopNTable`). Each
row of the grid is one atom (the ``atoms`` given, else the ``n_atoms`` most frequent on the
sample), each column one of its top images (one per image): for shard data the image as
the backbone saw it with the top patch outlined (a CLS or register token outlines the whole
image), for pixel data (digits, MNIST) the input itself. Logged as ``features/top_patches``
at the trainer's global step, by global rank 0 only (no collective, nothing to hang).

Enable it from a config::

    trainer:
      callbacks:
        - class_path: sae_pipeline.features.tensorboard.TopPatches
          init_args: {n_atoms: 6, top: 8}

or on the command line: ``--trainer.callbacks+=sae_pipeline.features.tensorboard.TopPatches``.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from PIL import Image, ImageDraw

from feature_extraction.validate import check_int
from sae_pipeline.data.sources import ShardSource, ShardUnit
from sae_pipeline.features.images import ImageChangedError, SourceImages, pixels_image, view_transform
from sae_pipeline.features.topn import TopNTable

TAG = "features/top_patches"


class TopPatches(L.Callback):
    """Log the top images (top patch outlined) of a few atoms as one TensorBoard image.

    Args:
        atoms: atom ids to show (None: the ``n_atoms`` most frequent on the sample).
        n_atoms: how many atoms when ``atoms`` is None.
        top: images per atom.
        max_tokens: size of the sample the atoms are ranked on.
        tile: pixel size of one image in the grid.
        images: where the extraction's images are now, when they have moved (as ``features --images``).
    """

    def __init__(
        self,
        atoms: list[int] | None = None,
        n_atoms: int = 4,
        top: int = 8,
        max_tokens: int = 8192,
        tile: int = 96,
        images: str | None = None,
    ) -> None:
        for name, value in (("n_atoms", n_atoms), ("top", top), ("max_tokens", max_tokens), ("tile", tile)):
            check_int(f"TopPatches {name}", value, 1)
        self.atoms, self.n_atoms, self.top, self.max_tokens = atoms, n_atoms, top, max_tokens
        self.tile, self.images = tile, images
        self._warned = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        d_sae = pl_module.sae.d_sae
        bad = [a for a in (self.atoms or []) if not 0 <= a < d_sae]
        if bad:
            raise ValueError(
                f"TopPatches atoms {bad[0]}: out of range; the SAE has d_sae = {d_sae} atoms, ids 0..{d_sae - 1}"
            )

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.global_rank != 0:
            return
        logger = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
        datamodule = getattr(trainer, "datamodule", None)
        source = getattr(datamodule, "data_source", None)
        if logger is None or source is None:
            return
        if not isinstance(source, ShardSource) and source.image_shape is None:
            if not self._warned:
                rank_zero_warn("TopPatches: this data has no images to draw (an .h5 token cache); nothing logged")
                self._warned = True
            return
        grid = self.render(pl_module, source, datamodule)
        logger.experiment.add_image(TAG, grid, trainer.global_step, dataformats="HWC")

    @torch.no_grad()
    def render(self, pl_module: L.LightningModule, source, datamodule) -> np.ndarray:  # noqa: ANN001
        """The grid as ``uint8 [H, W, 3]``."""
        split = "val" if getattr(datamodule, "val_fraction", 0) > 0 else "train"
        units = source.units(split, datamodule.val_fraction)
        sae = pl_module.sae
        table = TopNTable(sae.d_sae, self.top, "cpu")
        places: list[tuple] = []  # image key -> (unit, first token in unit) for re-reading
        image_of: dict[tuple[int, str], int] = {}
        pixels: dict[int, np.ndarray] = {}
        n_seen = 0
        for u, unit in enumerate(units):
            done_in_unit = 0
            for chunk in unit.read(0, min(unit.n_tokens, self.max_tokens - n_seen), with_ids=True):
                keys = []
                for i, image_id in enumerate(chunk.image_ids):
                    key = image_of.get((u, image_id))
                    if key is None:
                        key = image_of[(u, image_id)] = len(places)
                        places.append((u, done_in_unit + i))
                        if source.image_shape is not None:
                            pixels[key] = chunk.tokens[i].astype(np.float32)
                    keys.append(key)
                x = torch.from_numpy(chunk.tokens.astype(np.float32)).to(pl_module.device)
                codes = (sae.encode(pl_module.preprocess(x)).float() / pl_module.input_scale).cpu()
                tokens = torch.arange(n_seen, n_seen + len(x))
                table.update_codes(codes, tokens, torch.tensor(keys), torch.from_numpy(chunk.token_positions))
                n_seen += len(x)
                done_in_unit += len(x)
            if n_seen >= self.max_tokens:
                break
        atoms = self.atoms or table.fire_count.argsort(descending=True, stable=True)[: self.n_atoms].tolist()
        tiles = {}
        t = self.tile
        canvas = Image.new("RGB", (t // 2 + self.top * (t + 4), len(atoms) * (t + 4)), "white")
        draw = ImageDraw.Draw(canvas)
        view, images = None, SourceImages(self.images)
        if isinstance(source, ShardSource):
            backbone = source.manifest.get("backbone") or {}
            view = view_transform(backbone.get("preprocess"), int(backbone.get("image_size") or 224))
        for row, atom in enumerate(atoms):
            draw.text((2, row * (t + 4) + t // 2 - 6), f"#{atom}", fill="black")
            for col in range(self.top):
                key, position = int(table.image[atom, col]), int(table.position[atom, col])
                if int(table.token[atom, col]) < 0:
                    continue
                if key not in tiles:
                    tiles[key] = (
                        pixels_image(pixels[key], source.image_shape, 0.0, 1.0).convert("RGB")
                        if key in pixels
                        else self._shard_image(units[places[key][0]], places[key][1], source, view, images)
                    )
                tile = tiles[key].resize((t, t), Image.NEAREST if key in pixels else Image.BILINEAR)
                if key not in pixels:
                    _outline(tile, position, source.manifest)
                canvas.paste(tile, (t // 2 + col * (t + 4), row * (t + 4)))
        return np.asarray(canvas, dtype=np.uint8)

    @staticmethod
    def _shard_image(
        unit: ShardUnit, token_in_unit: int, source: ShardSource, view, images: SourceImages
    ) -> Image.Image:  # noqa: ANN001
        from feature_extraction.shards.read import read_shard_samples

        sample = token_in_unit // int(source.manifest["tokens_per_image"])
        for _, _, _, _, meta in read_shard_samples(unit.fpath, [sample]):
            try:
                return view(images.open(meta))
            except ImageChangedError as error:  # not the image extracted: a blank tile, never another image
                rank_zero_warn(f"TopPatches: {error}")
                return Image.new("RGB", (8, 8), (200, 200, 200))
        raise ValueError(f"{unit.fpath}: sample {sample} not found; re-extract the shard")


def _outline(tile: Image.Image, position: int, manifest: dict) -> None:
    """Outline the token's patch on ``tile`` (the whole tile for a CLS or register token)."""
    n_prefix, (gh, gw) = int(manifest["n_prefix_tokens"]), (int(g) for g in manifest["grid"])
    draw = ImageDraw.Draw(tile)
    w, h = tile.size
    if position < n_prefix:
        draw.rectangle([0, 0, w - 1, h - 1], outline=(29, 78, 216), width=4)
        return
    r, c = divmod(position - n_prefix, gw)
    draw.rectangle([c * w / gw, r * h / gh, (c + 1) * w / gw - 1, (r + 1) * h / gh - 1], outline=(255, 60, 0), width=2)
