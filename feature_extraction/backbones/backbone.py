"""`load_backbone`: a registry entry, built through its library's adapter, as a frozen `Backbone`.

The `Backbone` module returns *all* tokens of one layer, prefix tokens (CLS, registers)
first, then the patch tokens in row-major grid order; its `to_json` is the manifest's
backbone record. Everything library-specific sits in the adapter modules (`ADAPTERS`).

The record names the weights twice: by where they came from (`pretrained`, `checkpoint_path`;
the random weights' seed is in the extraction record) and by what they are (`weights_sha256`,
over the loaded tensors): a file moved, converted to another format or downloaded again still
matches, other weights of the same architecture do not (`features explain` refuses them).
"""

from __future__ import annotations

from collections.abc import Callable

from PIL import Image
from torch import Tensor, nn

from feature_extraction.backbones import open_clip_adapter, timm_adapter
from feature_extraction.backbones.adapter import Adapter, Layout
from feature_extraction.backbones.registry import get_backbone_spec
from feature_extraction.backbones.spec import BackboneSpec
from feature_extraction.backbones.weights import read_state_dict
from feature_extraction.file_hashes import tensors_sha256

ADAPTERS: dict[str, Adapter] = {"timm": timm_adapter, "open_clip": open_clip_adapter}


class Backbone(nn.Module):
    """A frozen backbone that returns all tokens of one layer, `[B, n_tokens, d]`."""

    def __init__(
        self,
        spec: BackboneSpec,
        model: nn.Module,
        layer: int,
        preprocess: Callable[[Image.Image], Tensor],
        preprocess_config: dict,
        pretrained: bool,
        checkpoint_path: str | None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.model = model.eval().requires_grad_(False)
        self.layer = layer
        self.final_norm = layer == spec.n_blocks - 1
        self.preprocess = preprocess
        self.preprocess_config = preprocess_config
        self.pretrained = pretrained
        self.checkpoint_path = checkpoint_path

    @property
    def n_tokens(self) -> int:
        return self.spec.n_tokens

    def train(self, mode: bool = True) -> Backbone:
        """Always eval: a frozen feature extractor must not switch on dropout or drop-path."""
        return super().train(False)

    def forward(self, images: Tensor) -> Tensor:
        """Tokens of `self.layer`: prefix tokens first, then patches row-major."""
        size = self.spec.image_size
        if images.ndim != 4 or tuple(images.shape[1:]) != (3, size, size):
            raise ValueError(
                f"images must have shape [B, 3, {size}, {size}] for backbone "
                f"{self.spec.name!r}, got {list(images.shape)}; "
                f"use Backbone.preprocess"
            )
        return ADAPTERS[self.spec.library].tokens(self.model, images, self.layer, self.final_norm)

    def to_json(self) -> dict:
        """The manifest record: spec, resolved layer, preprocessing and weight source."""
        return {
            **self.spec.to_json(),
            "layer": self.layer,
            "final_norm": self.final_norm,
            "preprocess": self.preprocess_config,
            "pretrained": self.pretrained,
            "checkpoint_path": self.checkpoint_path,
            "weights_sha256": self.weights_sha256(),
        }

    def weights_sha256(self) -> str:
        """The loaded weights' identity (`feature_extraction.file_hashes.tensors_sha256`)."""
        return tensors_sha256(self.model.state_dict())


def load_backbone(
    name: str, *, pretrained: bool = False, checkpoint_path: str | None = None, layer: int = -1
) -> Backbone:
    """Build backbone `name` with random, downloaded (`pretrained`) or local weights.

    `layer` indexes the transformer blocks (negative counts from the end); the last
    block is returned after the final norm, as the paper's "final layer" features.
    `checkpoint_path` is a safetensors file or a torch state dict (read with
    `weights_only=True`), in the library's own key format.
    """
    spec = get_backbone_spec(name)
    if not -spec.n_blocks <= layer < spec.n_blocks:
        raise ValueError(
            f"layer {layer} is out of range for backbone {name!r} with "
            f"{spec.n_blocks} blocks; valid: -{spec.n_blocks}..{spec.n_blocks - 1} "
            f"(-1 = final block after the final norm)"
        )
    if pretrained and checkpoint_path is not None:
        raise ValueError("can't provide both --pretrained true and --checkpoint_path; choose one")
    if pretrained and spec.pretrained_tag is None:
        raise ValueError(
            f"backbone {name!r} is a test entry without pretrained weights; "
            f"use --pretrained false or --checkpoint_path FILE"
        )
    state_dict = read_state_dict(checkpoint_path) if checkpoint_path is not None else None
    adapter = ADAPTERS[spec.library]
    built = adapter.build(spec, pretrained, state_dict, checkpoint_path)
    check_architecture(spec, adapter.layout(built.model))
    return Backbone(
        spec, built.model, layer % spec.n_blocks, built.preprocess, built.preprocess_config, pretrained, checkpoint_path
    )


def check_architecture(spec: BackboneSpec, built: Layout) -> None:
    """Fail if the library built something other than what the registry (and manifest) says."""
    expected = (spec.n_prefix_tokens, spec.grid, spec.d, spec.n_blocks)
    if built != expected:
        raise RuntimeError(
            f"backbone {spec.name!r}: {spec.library} built (prefix, grid, d, "
            f"blocks)={built} but the registry says {expected}; update BACKBONES"
        )
