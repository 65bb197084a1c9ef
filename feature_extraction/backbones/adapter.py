"""The interface every library adapter module implements (`timm_adapter`, `open_clip_adapter`).

A library is one module with three functions, so the rest of the package never asks which
library a model came from:

- `build(spec, pretrained, state_dict, checkpoint_path) -> Built`: the image model with
  random, downloaded (`pretrained`, through `hub.download`) or local weights (`state_dict`,
  already read by `weights.read_state_dict`; the adapter maps the library's key format
  and loads it with `weights.load_strict`), plus the preprocessing of the spec's
  pretrained tag, never retyped: it comes from the library's config of that tag.
- `tokens(model, images, layer, final_norm) -> [B, n_tokens, d]`: all tokens of block
  `layer`, prefix tokens (CLS, registers) first, then patches row-major; after the
  model's final norm when `final_norm` (what the model hands its heads), else the raw
  residual stream after that block.
- `layout(model) -> (n_prefix_tokens, grid, d, n_blocks)`: read from the built model, for
  the architecture check against the registry entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from PIL import Image
from torch import Tensor, nn

from feature_extraction.backbones.spec import BackboneSpec

Layout = tuple[int, tuple[int, int], int, int]  # (n_prefix_tokens, grid, d, n_blocks)


class Built(NamedTuple):
    """What an adapter's `build` returns; `preprocess_config` goes into the manifest."""

    model: nn.Module
    preprocess: Callable[[Image.Image], Tensor]
    preprocess_config: dict


class Adapter(Protocol):
    """A library adapter (a module): see the module docstring for the contract."""

    def build(
        self, spec: BackboneSpec, pretrained: bool, state_dict: dict[str, Tensor] | None, checkpoint_path: str | None
    ) -> Built: ...

    def tokens(self, model: nn.Module, images: Tensor, layer: int, final_norm: bool) -> Tensor: ...

    def layout(self, model: nn.Module) -> Layout: ...
