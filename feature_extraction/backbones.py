"""Vision backbones whose token activations the SAEs are trained on.

A registry (`BACKBONES`) maps short names to a `BackboneSpec`; `load_backbone` builds
the model through its own library (timm or open_clip) and wraps it in a `Backbone`
module that returns *all* tokens of one layer: prefix tokens (CLS, registers) first,
then the patch tokens in row-major grid order.

Design choices:

- The paper trains on "frozen features from the final layer of each backbone", with the
  CLS token and all spatial tokens (~261 per image for DINOv2 with registers, Costa et
  al. 2025, appendix "Large vision models"). The default layer is therefore the last
  block's output *after the final norm*, i.e. what the model hands its heads
  (`forward_features` in timm, `ln_post` tokens in open_clip). Any other block is the
  raw residual stream after that block (no final norm); `Backbone.final_norm` says which.
- The spec's numbers (tokens, grid, width, depth) are written down here, not read from
  the model, so that a test can check them against the real architecture and a
  library upgrade that changes an architecture fails loudly instead of silently
  changing the shard layout.
- Preprocessing is never retyped: it comes from timm's data config of the pretrained
  tag, or open_clip's preprocess config of the tag. The only override is the input
  size where we choose it (DINOv2 at 224 px as in the paper, timm's default is 518).
- SigLIP comes from timm (`vit_base_patch16_siglip_224.webli`): the same weights as
  open_clip's `ViT-B-16-SigLIP` (which wraps this very timm model), with timm's
  `forward_intermediates` and data config, so three of the four families share one
  code path. CLIP comes from open_clip (OpenAI weights, QuickGELU).
- Nothing touches the network unless `pretrained=True`; without a network that fails
  in one line that names `checkpoint_path` (see `load_backbone`).
"""

from __future__ import annotations

import copy
import os
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import torch
from PIL import Image
from torch import Tensor, nn

__all__ = ["BACKBONES", "Backbone", "BackboneSpec", "get_backbone_spec", "load_backbone"]


@dataclass(frozen=True)
class BackboneSpec:
    """What a backbone is and the token layout it produces (recorded in the manifest)."""

    name: str
    library: Literal["timm", "open_clip"]
    model_name: str
    pretrained_tag: str | None  # timm hub tag / open_clip pretrained tag; None: random only
    n_prefix_tokens: int  # CLS + register tokens (SigLIP has none)
    grid: tuple[int, int]  # patch grid (rows, columns) at `image_size`
    d: int  # token width
    image_size: int
    n_blocks: int  # transformer depth; valid layers are 0..n_blocks-1
    model_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)  # builder overrides

    @property
    def n_tokens(self) -> int:
        """Tokens per image: prefix tokens plus one per patch."""
        return self.n_prefix_tokens + self.grid[0] * self.grid[1]

    def to_json(self) -> dict:
        """A JSON-ready dict (tuples become lists) for the shard manifest."""
        record = asdict(self)
        record["grid"] = list(self.grid)
        record["n_tokens"] = self.n_tokens
        return record


def _spec(name: str, library: Literal["timm", "open_clip"], model_name: str, tag: str | None,
          n_prefix: int, grid: int, d: int, image_size: int, n_blocks: int,
          **model_kwargs: Any) -> BackboneSpec:
    return BackboneSpec(name, library, model_name, tag, n_prefix, (grid, grid), d, image_size,
                        n_blocks, model_kwargs)


# Tiny entries keep the family's code path (registers, no-CLS pooling, open_clip tower)
# at a width and depth that build and run in milliseconds; they have no weights.
_TINY_TIMM = dict(depth=2, embed_dim=64, num_heads=2)
_TINY_CLIP = dict(
    embed_dim=32,
    vision_cfg=dict(image_size=32, patch_size=8, width=64, layers=2, head_width=32),
    text_cfg=dict(context_length=8, vocab_size=64, width=32, heads=2, layers=1),
)

BACKBONES: dict[str, BackboneSpec] = {
    spec.name: spec
    for spec in [
        # The paper's four backbones (ViT-B).
        # DINOv2 at 224 px: 16x16 patches + CLS + 4 registers = 261 tokens.
        _spec("dinov2", "timm", "vit_base_patch14_reg4_dinov2", "lvd142m", 5, 16, 768, 224, 12,
              img_size=224),
        _spec("siglip", "timm", "vit_base_patch16_siglip_224", "webli", 0, 14, 768, 224, 12),
        _spec("clip", "open_clip", "ViT-B-16", "openai", 1, 14, 768, 224, 12),
        _spec("vit", "timm", "vit_base_patch16_224", "augreg2_in21k_ft_in1k", 1, 14, 768, 224, 12),
        # ViT-L sizes.
        _spec("dinov2_large", "timm", "vit_large_patch14_reg4_dinov2", "lvd142m", 5, 16, 1024, 224,
              24, img_size=224),
        _spec("siglip_large", "timm", "vit_large_patch16_siglip_256", "webli", 0, 16, 1024, 256,
              24),
        _spec("clip_large", "open_clip", "ViT-L-14", "openai", 1, 16, 1024, 224, 24),
        _spec("vit_large", "timm", "vit_large_patch16_224", "augreg_in21k_ft_in1k", 1, 14, 1024,
              224, 24),
        # Test entries: random weights only.
        _spec("dinov2_tiny", "timm", "vit_small_patch14_reg4_dinov2", None, 5, 4, 64, 56, 2,
              img_size=56, **_TINY_TIMM),
        _spec("siglip_tiny", "timm", "vit_base_patch16_siglip_224", None, 0, 4, 64, 64, 2,
              img_size=64, **_TINY_TIMM),
        _spec("clip_tiny", "open_clip", "ViT-B-16", None, 1, 4, 64, 32, 2, **_TINY_CLIP),
        _spec("vit_tiny", "timm", "vit_tiny_patch16_224", None, 1, 4, 192, 64, 2, img_size=64,
              depth=2),
    ]
}


def get_backbone_spec(name: str) -> BackboneSpec:
    """The registry entry for `name`; a ValueError lists the valid names."""
    if name not in BACKBONES:
        raise ValueError(f"backbone {name!r} is unknown; choose one of {sorted(BACKBONES)}")
    return BACKBONES[name]


class Backbone(nn.Module):
    """A frozen backbone that returns all tokens of one layer, `[B, n_tokens, d]`."""

    def __init__(self, spec: BackboneSpec, model: nn.Module, layer: int,
                 preprocess: Callable[[Image.Image], Tensor], preprocess_config: dict,
                 pretrained: bool, checkpoint_path: str | None) -> None:
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
            raise ValueError(f"images must have shape [B, 3, {size}, {size}] for backbone "
                             f"{self.spec.name!r}, got {list(images.shape)}; "
                             f"use Backbone.preprocess")
        if self.spec.library == "timm":
            if self.final_norm:
                return self.model.forward_features(images)
            (taken,) = self.model.forward_intermediates(
                images, indices=[self.layer], return_prefix_tokens=True, norm=False,
                stop_early=True, output_fmt="NLC", intermediates_only=True)
            if isinstance(taken, tuple):  # (patches, prefix) when the model has prefix tokens
                patches, prefix = taken
                return torch.cat([prefix, patches], dim=1)
            return taken
        out = self.model.forward_intermediates(
            images, indices=[self.layer], stop_early=True, normalize_intermediates=self.final_norm,
            intermediates_only=True, output_fmt="NLC", output_extra_tokens=True)
        prefix, patches = out["image_intermediates_prefix"][0], out["image_intermediates"][0]
        return torch.cat([prefix, patches], dim=1)

    def to_json(self) -> dict:
        """The manifest record: spec, resolved layer, preprocessing and weight source."""
        return {**self.spec.to_json(), "layer": self.layer, "final_norm": self.final_norm,
                "preprocess": self.preprocess_config, "pretrained": self.pretrained,
                "checkpoint_path": self.checkpoint_path}


def load_backbone(name: str, *, pretrained: bool = False, checkpoint_path: str | None = None,
                  layer: int = -1) -> Backbone:
    """Build backbone `name` with random, downloaded (`pretrained`) or local weights.

    `layer` indexes the transformer blocks (negative counts from the end); the last
    block is returned after the final norm, as the paper's "final layer" features.
    `checkpoint_path` is a safetensors file or a torch state dict (read with
    `weights_only=True`), in the library's own key format.
    """
    spec = get_backbone_spec(name)
    if not -spec.n_blocks <= layer < spec.n_blocks:
        raise ValueError(f"layer {layer} is out of range for backbone {name!r} with "
                         f"{spec.n_blocks} blocks; valid: -{spec.n_blocks}..{spec.n_blocks - 1} "
                         f"(-1 = final block after the final norm)")
    if pretrained and checkpoint_path is not None:
        raise ValueError("can't provide both --pretrained true and --checkpoint_path; choose one")
    if pretrained and spec.pretrained_tag is None:
        raise ValueError(f"backbone {name!r} is a test entry without pretrained weights; "
                         f"use --pretrained false or --checkpoint_path FILE")
    state_dict = _read_state_dict(checkpoint_path) if checkpoint_path is not None else None
    build = _build_timm if spec.library == "timm" else _build_open_clip
    model, preprocess, preprocess_config = build(spec, pretrained, state_dict, checkpoint_path)
    _check_architecture(spec, model)
    return Backbone(spec, model, layer % spec.n_blocks, preprocess, preprocess_config, pretrained,
                    checkpoint_path)


def _build_timm(spec: BackboneSpec, pretrained: bool, state_dict: dict[str, Tensor] | None,
                checkpoint_path: str | None) -> tuple[nn.Module, Callable, dict]:
    import timm
    from timm.data import create_transform, resolve_model_data_config
    from timm.models.vision_transformer import checkpoint_filter_fn

    full_name = spec.model_name + (f".{spec.pretrained_tag}" if spec.pretrained_tag else "")
    kwargs = copy.deepcopy(spec.model_kwargs)
    size = spec.image_size  # the data config must describe the size the model is built at
    kwargs["pretrained_cfg_overlay"] = dict(input_size=(3, size, size))
    if pretrained:
        _require_hub_reachable(spec)
        try:
            model = timm.create_model(full_name, pretrained=True, num_classes=0, **kwargs)
        except Exception as error:  # hub/network/cache errors take many forms
            raise _download_error(spec, error) from error
    else:
        model = timm.create_model(full_name, pretrained=False, num_classes=0, **kwargs)
    if state_dict is not None:
        # timm's own filter converts original DINOv2 keys and resamples position embeddings
        # (e.g. a 518 px checkpoint into our 224 px model).
        state_dict = checkpoint_filter_fn(state_dict, model)
        own_keys = model.state_dict().keys()
        state_dict = {k: v for k, v in state_dict.items()
                      if k in own_keys or not k.startswith("head.")}  # classifier not kept
        _load_state_dict(model, state_dict, checkpoint_path)
    config = resolve_model_data_config(model)
    preprocess = create_transform(**config, is_training=False)
    preprocess_config = {
        "library": "timm", "size": list(config["input_size"][1:]),
        "crop": {"crop_pct": config["crop_pct"], "crop_mode": config["crop_mode"]},
        "mean": list(config["mean"]), "std": list(config["std"]),
        "interpolation": config["interpolation"],
    }
    return model, preprocess, preprocess_config


def _build_open_clip(spec: BackboneSpec, pretrained: bool, state_dict: dict[str, Tensor] | None,
                     checkpoint_path: str | None) -> tuple[nn.Module, Callable, dict]:
    import open_clip
    from open_clip.transform import PreprocessCfg, image_transform_v2

    tag_cfg = (open_clip.get_pretrained_cfg(spec.model_name, spec.pretrained_tag)
               if spec.pretrained_tag else {})
    quick_gelu = bool(tag_cfg.get("quick_gelu", False))  # OpenAI weights were trained with it
    kwargs = copy.deepcopy(spec.model_kwargs)
    if pretrained:
        _require_hub_reachable(spec)
        try:
            model = open_clip.create_model(spec.model_name, pretrained=spec.pretrained_tag,
                                           force_quick_gelu=quick_gelu, **kwargs)
        except Exception as error:  # hub/network/cache errors take many forms
            raise _download_error(spec, error) from error
    else:
        # Without weights open_clip uses its default preprocessing; take the tag's instead.
        fields = PreprocessCfg.__dataclass_fields__
        tag_preprocess = {k: v for k, v in tag_cfg.items() if k in fields}
        model = open_clip.create_model(spec.model_name, pretrained=None,
                                       force_quick_gelu=quick_gelu,
                                       force_preprocess_cfg=tag_preprocess, **kwargs)
    visual = model.visual  # the text tower is dropped with `model`
    if state_dict is not None:
        if any(k.startswith("visual.") for k in state_dict):  # a full CLIP checkpoint
            state_dict = {k[len("visual."):]: v for k, v in state_dict.items()
                          if k.startswith("visual.")}
        _load_state_dict(visual, state_dict, checkpoint_path)
    config = dict(visual.preprocess_cfg)
    preprocess = image_transform_v2(PreprocessCfg(**config), is_train=False)
    size = config["size"]
    preprocess_config = {
        "library": "open_clip",
        "size": list(size) if isinstance(size, (tuple, list)) else [size, size],
        "crop": {"resize_mode": config["resize_mode"], "fill_color": config["fill_color"]},
        "mean": list(config["mean"]), "std": list(config["std"]),
        "interpolation": config["interpolation"],
    }
    return visual, preprocess, preprocess_config


def _check_architecture(spec: BackboneSpec, model: nn.Module) -> None:
    """Fail if the library built something other than what the registry (and manifest) says."""
    if spec.library == "timm":
        built = (model.num_prefix_tokens, tuple(model.patch_embed.grid_size), model.embed_dim,
                 len(model.blocks))
    else:
        n_patches = model.grid_size[0] * model.grid_size[1]
        n_prefix = model.positional_embedding.shape[0] - n_patches  # the CLS token's position
        built = (n_prefix, tuple(model.grid_size), model.transformer.width,
                 len(model.transformer.resblocks))
    expected = (spec.n_prefix_tokens, spec.grid, spec.d, spec.n_blocks)
    if built != expected:
        raise RuntimeError(f"backbone {spec.name!r}: {spec.library} built (prefix, grid, d, "
                           f"blocks)={built} but the registry says {expected}; update BACKBONES")


def _read_state_dict(checkpoint_path: str) -> dict[str, Tensor]:
    """Tensors from a safetensors file or a torch state dict, never unpickling objects."""
    fpath = Path(checkpoint_path)
    if not fpath.is_file():
        raise ValueError(f"checkpoint_path {checkpoint_path!r} is not a file; give a local "
                         f".safetensors file or torch state dict")
    try:
        if fpath.suffix == ".safetensors":
            from safetensors.torch import load_file
            obj: Any = load_file(fpath)
        else:
            obj = torch.load(fpath, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ValueError(f"checkpoint_path {checkpoint_path!r} could not be read as safetensors "
                         f"or a weights-only torch state dict ({type(error).__name__}); convert "
                         f"it to .safetensors") from error
    for wrapper in ("state_dict", "model", "module"):  # common training-checkpoint nestings
        if isinstance(obj, dict) and isinstance(obj.get(wrapper), dict):
            obj = obj[wrapper]
    if not isinstance(obj, dict) or not any(isinstance(v, Tensor) for v in obj.values()):
        raise ValueError(f"checkpoint_path {checkpoint_path!r} holds no state dict of tensors")
    return {k.removeprefix("module."): v for k, v in obj.items() if isinstance(v, Tensor)}


def _load_state_dict(model: nn.Module, state_dict: dict[str, Tensor], checkpoint_path: str | None
                     ) -> None:
    """Strict load whose failure is one line naming the file and a few offending keys."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    mismatched = sorted(k for k in set(own) & set(state_dict)
                        if own[k].shape != state_dict[k].shape)
    if missing or unexpected or mismatched:
        raise ValueError(f"checkpoint_path {checkpoint_path!r} does not fit the architecture: "
                         f"missing {missing[:3]} ({len(missing)}), unexpected {unexpected[:3]} "
                         f"({len(unexpected)}), shape mismatch {mismatched[:3]} "
                         f"({len(mismatched)})")
    model.load_state_dict(state_dict, strict=True)


def _require_hub_reachable(spec: BackboneSpec) -> None:
    """Fail in seconds, not after a minute of hub retries, when the hub cannot be reached.

    Skipped when `HF_HUB_OFFLINE` is set (the hub library then serves its cache or fails
    fast itself) and behind a proxy (a direct connection says nothing there).
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or any(os.environ.get(v) for v in (
            "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=5).close()
    except OSError as error:
        raise _download_error(spec, error) from error


def _download_error(spec: BackboneSpec, error: BaseException) -> RuntimeError:
    detail = " ".join(str(error).split())[:200]
    return RuntimeError(
        f"could not download pretrained weights for backbone {spec.name!r} ({spec.model_name}, "
        f"tag {spec.pretrained_tag}): {type(error).__name__}: {detail}. Offline, pass "
        f"--checkpoint_path FILE (local .safetensors or state dict) with --pretrained false, or "
        f"set HF_HUB_OFFLINE=1 to use weights already in the Hugging Face cache")
