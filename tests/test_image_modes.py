"""Every image mode is read as it is: each file decodes through ImageDataset to what a plain numpy conversion of
the same pixels gives (feature_extraction/image_modes.py states the rules), and a mode that cannot be read is
skipped with its reason instead of guessed at."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image

from feature_extraction.image_modes import UnsupportedImageMode, to_rgb
from feature_extraction.images import ImageDataset, list_images

H, W = 12, 10
RNG = np.random.default_rng(7)


def as_array(image: Image.Image) -> torch.Tensor:
    """The dataset's preprocess here: the converted pixels as they are, ``uint8 [H, W, 3]``."""
    assert image.mode == "RGB"
    return torch.from_numpy(np.asarray(image).copy())


def decoded(path: Path) -> tuple[np.ndarray | None, str]:
    """What extraction hands the backbone for the file at ``path`` (through list_images and ImageDataset)."""
    records = list_images(str(path.parent))
    dataset = ImageDataset(records, as_array)
    index = [r.image_id for r in records].index(path.name)
    _, pixels, note = dataset[index]
    return (None if pixels is None else pixels.numpy()), note


def grey(values: np.ndarray) -> np.ndarray:
    return np.repeat(np.asarray(values, np.uint8)[..., None], 3, axis=2)


def stretch(values: np.ndarray) -> np.ndarray:
    """Reference: the finite [min, max] onto 0..255, NaN and -inf 0, +inf 255."""
    values = values.astype(np.float64)
    finite = np.isfinite(values)
    low, high = values[finite].min(), values[finite].max()
    out = np.where(finite, (values - low) / (high - low) * 255, np.where(values == np.inf, 255, 0))
    return np.floor(np.nan_to_num(out) + 0.5)


def over_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Reference: straight alpha composited over white."""
    a = alpha.astype(np.float64)[..., None] / 255
    return rgb.astype(np.float64) * a + 255 * (1 - a)


def assert_close(actual: np.ndarray | None, expected: np.ndarray, atol: int = 1) -> None:
    assert actual is not None and actual.shape == expected.shape, None if actual is None else actual.shape
    difference = np.abs(actual.astype(np.int64) - np.round(expected).astype(np.int64))
    assert difference.max() <= atol, difference.max()


def save(path: Path, image: Image.Image, fmt: str) -> Path:
    image.save(path, format=fmt)
    return path


def test_16_bit_png_is_stretched_not_clipped_white(tmp_path: Path) -> None:
    """The issue's case: a 12-bit camera's counts (with a dark offset) in a 16-bit PNG."""
    values = RNG.integers(100, 4096, (H, W), dtype=np.uint16)
    path = save(tmp_path / "cells.png", Image.fromarray(values), "PNG")
    with Image.open(path) as image:
        assert image.mode == "I;16"
        clipped = np.asarray(image.convert("RGB"))[..., 0]  # what convert("RGB") makes of it: clipped at 255
        assert np.array_equal(clipped, np.minimum(values, 255)) and (clipped == 255).mean() > 0.9
    pixels, _ = decoded(path)
    assert_close(pixels, grey(stretch(values)))
    assert pixels.min() == 0 and pixels.max() == 255


def test_16_bit_big_endian_tiff(tmp_path: Path) -> None:
    values = RNG.integers(0, 65536, (H, W)).astype(">u2")
    path = save(tmp_path / "stack.tif", Image.fromarray(values), "TIFF")
    with Image.open(path) as image:
        assert image.mode == "I;16B"
    assert_close(decoded(path)[0], grey(stretch(values)))


def test_32_bit_integer_tiff(tmp_path: Path) -> None:
    values = RNG.integers(-70000, 70000, (H, W)).astype(np.int32)
    path = save(tmp_path / "counts.tif", Image.fromarray(values), "TIFF")
    with Image.open(path) as image:
        assert image.mode == "I"
    assert_close(decoded(path)[0], grey(stretch(values)))


def test_float_tiff_by_its_finite_range(tmp_path: Path) -> None:
    values = RNG.normal(0.3, 2.0, (H, W)).astype(np.float32)
    values[0, :3] = [np.nan, np.inf, -np.inf]
    path = save(tmp_path / "depth.tif", Image.fromarray(values), "TIFF")
    with Image.open(path) as image:
        assert image.mode == "F"
    pixels, _ = decoded(path)
    assert_close(pixels, grey(stretch(values)))
    assert pixels[0, :3, 0].tolist() == [0, 255, 0]


def test_constant_16_bit_image_is_black(tmp_path: Path) -> None:
    path = save(tmp_path / "flat.png", Image.fromarray(np.full((H, W), 3000, np.uint16)), "PNG")
    assert_close(decoded(path)[0], np.zeros((H, W, 3)), atol=0)


def test_1_bit_and_grey(tmp_path: Path) -> None:
    bits = RNG.integers(0, 2, (H, W)).astype(bool)
    path = save(tmp_path / "mask.png", Image.fromarray(bits), "PNG")
    with Image.open(path) as image:
        assert image.mode == "1"
    assert_close(decoded(path)[0], grey(bits * 255), atol=0)
    values = RNG.integers(0, 256, (H, W), dtype=np.uint8)
    assert_close(decoded(save(tmp_path / "grey.png", Image.fromarray(values), "PNG"))[0], grey(values), atol=0)


def palette_image(indices: np.ndarray, palette: np.ndarray) -> Image.Image:
    image = Image.fromarray(indices.astype(np.uint8), mode="P")
    image.putpalette(palette.astype(np.uint8).reshape(-1).tolist())
    return image


def test_palette_without_and_with_transparency(tmp_path: Path) -> None:
    palette = RNG.integers(0, 256, (4, 3))
    indices = RNG.integers(0, 4, (H, W))
    path = save(tmp_path / "plain.png", palette_image(indices, palette), "PNG")
    assert_close(decoded(path)[0], palette[indices], atol=0)
    alphas = np.array([0, 100, 200, 255])
    image = palette_image(indices, palette)
    image.info["transparency"] = bytes(alphas.tolist())
    path = save(tmp_path / "clear.png", image, "PNG")
    with Image.open(path) as reread:
        assert reread.mode == "P" and "transparency" in reread.info
    assert_close(decoded(path)[0], over_white(palette[indices], alphas[indices]))


def test_grey_and_colour_with_alpha_over_white(tmp_path: Path) -> None:
    la = RNG.integers(0, 256, (H, W, 2), dtype=np.uint8)
    path = save(tmp_path / "la.png", Image.fromarray(la, mode="LA"), "PNG")
    assert_close(decoded(path)[0], over_white(grey(la[..., 0]), la[..., 1]))
    rgba = RNG.integers(0, 256, (H, W, 4), dtype=np.uint8)
    rgba[0, 0] = [0, 0, 0, 0]  # a transparent pixel storing black: white, not black
    path = save(tmp_path / "rgba.png", Image.fromarray(rgba, mode="RGBA"), "PNG")
    pixels, _ = decoded(path)
    assert_close(pixels, over_white(rgba[..., :3], rgba[..., 3]))
    assert pixels[0, 0].tolist() == [255, 255, 255]


def test_premultiplied_and_palette_alpha_in_memory() -> None:
    """Modes no file decodes to (PA, RGBa) but PIL can hand over."""
    palette = RNG.integers(0, 256, (4, 3))
    indices, alpha = RNG.integers(0, 4, (H, W)), RNG.integers(0, 256, (H, W))
    pa = palette_image(indices, palette).convert("PA")
    pa.putalpha(Image.fromarray(alpha.astype(np.uint8)))
    assert pa.mode == "PA"
    assert_close(np.asarray(to_rgb(pa)), over_white(palette[indices], alpha))
    rgba = RNG.integers(0, 256, (H, W, 4), dtype=np.uint8)
    rgba[..., 3] = np.maximum(rgba[..., 3], 64)  # premultiplying loses too much below
    premultiplied = Image.fromarray(rgba, mode="RGBA").convert("RGBa")
    assert_close(np.asarray(to_rgb(premultiplied)), over_white(rgba[..., :3], rgba[..., 3]), atol=3)


def test_cmyk_tiff(tmp_path: Path) -> None:
    cmyk = RNG.integers(0, 256, (H, W, 4), dtype=np.uint8)
    path = save(tmp_path / "print.tif", Image.frombytes("CMYK", (W, H), cmyk.tobytes()), "TIFF")
    with Image.open(path) as image:
        assert image.mode == "CMYK"
    expected = (255 - cmyk[..., :3].astype(np.float64)) * (255 - cmyk[..., 3:].astype(np.float64)) / 255
    assert_close(decoded(path)[0], expected)


def test_unreadable_modes_are_skipped_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedImageMode, match="'La'"):
        to_rgb(Image.new("La", (W, H)))
    # A float RGB TIFF: PIL has no mode for it; the dataset yields no pixels and says why.
    buffer = io.BytesIO()
    tifffile.imwrite(buffer, RNG.random((H, W, 3)).astype(np.float32), photometric="rgb")
    (tmp_path / "float_rgb.tif").write_bytes(buffer.getvalue())
    pixels, why = decoded(tmp_path / "float_rgb.tif")
    assert pixels is None and "cannot identify image file" in why
