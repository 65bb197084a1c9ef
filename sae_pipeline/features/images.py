"""Re-read the source images of an extraction, as the backbone saw them, for thumbnails and heatmaps.

Shards record where each image came from (``meta.json``: ``image_id``, ``source``, and
``member`` for image tars; ``skimage.data.<name>`` for the bundled samples). The browser
draws each token's activation over the patch grid, so an image is shown through the
geometric part of the backbone's own preprocessing (resize and crop, from the manifest's
``backbone.preprocess``) with the normalisation left out: patch (row, col) of the grid is
then exactly cell (row, col) of the thumbnail.

When the images have moved since extraction, ``--images DIR`` names their new place: a
file is looked up as ``DIR/<image_id>`` (ids are paths relative to the extracted folder), a
tar as ``DIR/<tar file name>``.

An image is drawn only if it is the one that was extracted: the extraction stores the
xxh3-64 of each image's bytes in ``meta.json`` (``image_xxh3_64``), and :meth:`SourceImages.open`
hashes the bytes it reads and raises :class:`ImageChangedError` on a mismatch (a file replaced
or edited after extraction would otherwise get the old image's heatmaps, silently); the site
lists such images instead of drawing them. Shards written before the hash was recorded carry
none: their images are drawn unchecked and counted (``unchecked``), and the command says so.
Images are converted to RGB by ``feature_extraction.image_modes`` (16-bit, float, alpha,
CMYK, ...), as the extraction converted them for the backbone.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from feature_extraction.image_modes import to_rgb
from feature_extraction.images import CONTENT_HASH_KEY, content_hash, sample_array

SAMPLES_PREFIX = "skimage.data."


class ImagesMovedError(ValueError):
    """An image is not where the extraction recorded it; the message names the path and ``--images DIR``."""


class ImageChangedError(ValueError):
    """An image's bytes no longer hash to what the extraction recorded: it was replaced or edited since."""

    def __init__(self, image_id: str, where: str) -> None:
        super().__init__(
            f"image {image_id!r}: {where} changed since extraction (its bytes no longer match the "
            f"recorded {CONTENT_HASH_KEY}); not drawn: restore it, or re-extract and retrain"
        )
        self.image_id, self.where = image_id, where


def view_transform(preprocess: dict | None, image_size: int) -> Callable[[Image.Image], Image.Image]:
    """The backbone's resize and crop (no normalisation), as a PIL -> PIL function."""
    from torchvision.transforms.functional import to_pil_image

    preprocess = preprocess or {}
    size = list(preprocess.get("size") or [image_size, image_size])
    if preprocess.get("library") == "open_clip":
        from open_clip.transform import PreprocessCfg, image_transform_v2

        crop = preprocess.get("crop") or {}
        cfg = PreprocessCfg(
            size=tuple(size),
            mean=(0.0, 0.0, 0.0),
            std=(1.0, 1.0, 1.0),
            interpolation=preprocess.get("interpolation", "bicubic"),
            resize_mode=crop.get("resize_mode", "shortest"),
            fill_color=crop.get("fill_color", 0),
        )
        transform = image_transform_v2(cfg, is_train=False)
    else:
        from timm.data import create_transform

        crop = preprocess.get("crop") or {}
        transform = create_transform(
            input_size=(3, *size),
            is_training=False,
            mean=(0.0, 0.0, 0.0),
            std=(1.0, 1.0, 1.0),
            crop_pct=crop.get("crop_pct", 1.0),
            crop_mode=crop.get("crop_mode", "center"),
            interpolation=preprocess.get("interpolation", "bicubic"),
        )
    return lambda image: to_pil_image(transform(image.convert("RGB")).clamp(0, 1))


class SourceImages:
    """Open the images that shards point at, honouring ``--images DIR``.

    Args:
        images_dpath: where the images are now (None: where the extraction found them).

    ``unchecked`` counts the images opened without a recorded content hash (older shards).
    """

    def __init__(self, images_dpath: str | Path | None = None) -> None:
        self.images_dpath = Path(images_dpath) if images_dpath is not None else None
        self._tar_index: dict[Path, dict[str, tuple[int, int]]] = {}
        self.unchecked = 0

    def path_of(self, meta: dict) -> Path | None:
        """Where ``meta``'s image is read from (None for scikit-image's bundled samples)."""
        source = str(meta.get("source") or "")
        if source.startswith(SAMPLES_PREFIX):
            return None
        if not source:
            raise ImagesMovedError(
                f"image {meta.get('image_id')!r}: its meta.json records no source; the browser "
                "cannot draw it (pass --images DIR, the folder that holds the images)"
            )
        if self.images_dpath is None:
            return Path(source)
        if meta.get("member"):
            return self.images_dpath / Path(source).name
        return self.images_dpath / str(meta.get("image_id"))

    def check(self, meta: dict) -> None:
        """A one-line :class:`ImagesMovedError` when ``meta``'s image is not where it should be."""
        path = self.path_of(meta)
        if path is not None and not path.is_file():
            hint = (
                "the folder that now holds the images"
                if self.images_dpath is None
                else "the folder that holds them (ids are paths relative to it; tars by file name)"
            )
            raise ImagesMovedError(
                f"image {meta.get('image_id')!r}: {path} not found (moved since extraction?); pass --images DIR, {hint}"
            )

    def open(self, meta: dict) -> Image.Image:
        """The image of ``meta`` as RGB; :class:`ImageChangedError` if it is not the one extracted."""
        source = str(meta.get("source") or "")
        if source.startswith(SAMPLES_PREFIX):
            array = sample_array(source[len(SAMPLES_PREFIX) :])
            self._verify(meta, array.tobytes(), source)
            return to_rgb(Image.fromarray(array))
        self.check(meta)
        path = self.path_of(meta)
        assert path is not None
        if meta.get("member"):
            data = self._read_member(path, str(meta["member"]))
            where = f"{path} member {meta['member']}"
        else:
            data = path.read_bytes()
            where = str(path)
        self._verify(meta, data, where)
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return to_rgb(image)

    def _verify(self, meta: dict, data: bytes, where: str) -> None:
        expected = meta.get(CONTENT_HASH_KEY)
        if expected is None:
            self.unchecked += 1
        elif content_hash(data) != expected:
            raise ImageChangedError(str(meta.get("image_id")), where)

    def _read_member(self, tar_fpath: Path, member: str) -> bytes:
        index = self._tar_index.get(tar_fpath)
        if index is None:
            with tarfile.open(tar_fpath, "r:") as tar:
                index = {info.name: (info.offset_data, info.size) for info in tar if info.isfile()}
            self._tar_index[tar_fpath] = index
        if member not in index:
            raise ImagesMovedError(
                f"{tar_fpath}: has no member {member!r} (another tar under the same name?); "
                "pass --images DIR, the folder that holds the extraction's tars"
            )
        offset, size = index[member]
        with open(tar_fpath, "rb") as f:
            f.seek(offset)
            return f.read(size)


def pixels_image(
    pixels: np.ndarray, shape: tuple[int, int], low: float | None = None, high: float | None = None
) -> Image.Image:
    """A grey image of a pixel-data token (digits, MNIST): ``pixels [h·w]`` scaled from [low, high] to 0..255."""
    array = np.asarray(pixels, np.float64).reshape(shape)
    low = float(array.min()) if low is None else low
    high = float(array.max()) if high is None else high
    scaled = np.clip((array - low) / max(high - low, 1e-12), 0, 1)
    return Image.fromarray((scaled * 255).round().astype(np.uint8), mode="L")


def atom_image(atom: np.ndarray, shape: tuple[int, int]) -> Image.Image:
    """A dictionary atom drawn on a diverging scale (blue < 0 < red, white at 0), symmetric in |max|."""
    array = np.asarray(atom, np.float64).reshape(shape)
    scale = max(float(np.abs(array).max()), 1e-12)
    t = np.clip(array / scale, -1, 1)
    red = np.where(t > 0, 1.0, 1.0 + t)
    blue = np.where(t < 0, 1.0, 1.0 - t)
    green = 1.0 - np.abs(t)
    rgb = np.stack([red, green, blue], axis=-1)
    return Image.fromarray((rgb * 255).round().astype(np.uint8), mode="RGB")


def save_thumbnail(image: Image.Image, fpath: Path, max_side: int = 224) -> None:
    """Write a thumbnail once: JPEG for photos, PNG for small pixel images (kept at native size)."""
    if fpath.exists():
        return
    if max(image.size) > max_side:
        image = image.copy()
        image.thumbnail((max_side, max_side))
    fpath.parent.mkdir(parents=True, exist_ok=True)
    if fpath.suffix == ".png":
        image.save(fpath, optimize=True)
    else:
        image.save(fpath, quality=85)


def describe(meta: dict[str, Any]) -> str:
    """A label for the page: class name when known, else the integer label, else ''."""
    if meta.get("class_name"):
        return str(meta["class_name"])
    return "" if meta.get("label") is None else str(meta["label"])
