"""Every image becomes 8-bit RGB the same way, whatever its mode: what the backbone sees and the browser draws.

PIL's ``convert("RGB")`` clips instead of scaling: a 16-bit grayscale PNG (mode ``I;16``,
common in microscopy) holding a 12-bit camera's counts 0..4095 becomes an all-white image,
silently. ``to_rgb`` is used wherever an image is decoded (extraction, the feature browser's
thumbnails and heatmaps, TensorBoard's top patches), so both see the same pixels.

The conversions, by PIL mode:

- ``RGB``: unchanged. ``L``, ``1`` (black 0 / white 255), ``RGBX``, ``YCbCr``, ``HSV``, ``LAB``:
  PIL's conversion (each is already an 8-bit encoding; 1-bit white is 255).
- ``CMYK``: PIL's conversion, ``R = (255 - C)(255 - K) / 255`` (likewise G, B), without colour
  management: an embedded ICC profile is not applied (as in torchvision and timm).
- ``I;16``, ``I;16B``, ``I;16L``, ``I;16N`` (16-bit), ``I`` (32-bit integer) and ``F`` (32-bit
  float): stretched from the image's own [min, max] to 0..255, ``round(255 (v - min) / (max -
  min))``, as ImageJ/Fiji shows a 16-bit image when it opens it (display range from the data).
  A 12- or 14-bit camera stores its counts in a 16-bit file, so scaling by the type's range
  (``v / 257``) would leave such images almost black, and a camera's dark offset would take
  part of the range. The cost: brightness is not comparable between images (each one is
  stretched on its own), and a constant image becomes black. For ``F``, min and max are taken
  over the finite values; NaN and -inf become 0, +inf 255.
- ``RGBA``, ``LA``, ``PA``, ``P`` with a transparent colour (``transparency``) and the
  premultiplied ``RGBa``: composited over white, ``round((c a + 255 (255 - a)) / 255)``. White
  because that is how the picture looks in a browser or image viewer (transparent PNGs are
  drawn for light pages); dropping alpha instead, as ``convert("RGB")`` does, shows whatever
  colour the transparent pixels happen to store.
- ``P`` without transparency: its palette colours.
- Anything else (e.g. ``La``): :class:`UnsupportedImageMode`. The extraction counts such an
  image as skipped and lists it, with the reason, in the manifest's ``skipped``.

A multi-frame file (a TIFF stack, an animated GIF) gives its first frame. A 16-bit colour
file (48-bit RGB PNG or TIFF) reaches these rules already reduced to 8 bits per channel by
PIL's decoder (the high byte of each value); a float colour TIFF cannot be decoded by PIL and
is skipped.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

__all__ = ["ALPHA_MODES", "HIGH_BIT_MODES", "UnsupportedImageMode", "to_rgb"]

HIGH_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")
ALPHA_MODES = ("RGBA", "RGBa", "LA", "PA")
_PIL_CONVERTED = ("1", "L", "RGBX", "YCbCr", "HSV", "LAB", "CMYK")
BACKGROUND = (255, 255, 255, 255)


class UnsupportedImageMode(ValueError):
    """An image mode with no conversion to RGB here; the image is skipped, not guessed at."""


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` as 8-bit RGB by the rules of this module's docstring."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in _PIL_CONVERTED:
        return image.convert("RGB")
    if mode in HIGH_BIT_MODES:
        return Image.fromarray(stretch_to_uint8(np.asarray(image)), mode="L").convert("RGB")
    if mode in ALPHA_MODES or (mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, BACKGROUND), rgba).convert("RGB")
    if mode == "P":
        return image.convert("RGB")
    raise UnsupportedImageMode(
        f"image mode {mode!r} has no conversion to RGB (supported: RGB, "
        f"{', '.join(_PIL_CONVERTED + HIGH_BIT_MODES + ALPHA_MODES)}, P)"
    )


def stretch_to_uint8(array: np.ndarray) -> np.ndarray:
    """``array``'s finite [min, max] onto 0..255 (a constant array gives 0; NaN and -inf 0, +inf 255)."""
    values = np.asarray(array, dtype=np.float64)
    finite = np.isfinite(values)
    out = np.zeros(values.shape, np.uint8)
    out[np.isposinf(values)] = 255
    if not finite.any():
        return out
    low, high = float(values[finite].min()), float(values[finite].max())
    if high > low:
        out[finite] = np.round((values[finite] - low) * (255.0 / (high - low))).astype(np.uint8)
    return out
