"""The open_clip adapter (OpenAI CLIP): build the image tower, tokens of a layer, layout.

The text tower is dropped after building. The tag's own config decides QuickGELU (the
OpenAI weights were trained with it) and the preprocessing, also for random weights,
where open_clip would otherwise use its defaults. A layer's tokens come from the image
tower's `forward_intermediates`; the final layer is normalised by `ln_post`.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from feature_extraction.backbones.adapter import Built, Layout
from feature_extraction.backbones.hub import download
from feature_extraction.backbones.spec import BackboneSpec
from feature_extraction.backbones.weights import load_strict


def build(
    spec: BackboneSpec, pretrained: bool, state_dict: dict[str, Tensor] | None, checkpoint_path: str | None
) -> Built:
    import open_clip
    from open_clip.transform import PreprocessCfg, image_transform_v2

    tag_cfg = open_clip.get_pretrained_cfg(spec.model_name, spec.pretrained_tag) if spec.pretrained_tag else {}
    quick_gelu = bool(tag_cfg.get("quick_gelu", False))  # OpenAI weights were trained with it
    kwargs = copy.deepcopy(spec.model_kwargs)
    if pretrained:
        model = download(
            spec,
            lambda: open_clip.create_model(
                spec.model_name, pretrained=spec.pretrained_tag, force_quick_gelu=quick_gelu, **kwargs
            ),
        )
    else:
        # Without weights open_clip uses its default preprocessing; take the tag's instead.
        fields = PreprocessCfg.__dataclass_fields__
        tag_preprocess = {k: v for k, v in tag_cfg.items() if k in fields}
        model = open_clip.create_model(
            spec.model_name, pretrained=None, force_quick_gelu=quick_gelu, force_preprocess_cfg=tag_preprocess, **kwargs
        )
    visual = model.visual  # the text tower is dropped with `model`
    if state_dict is not None:
        if any(k.startswith("visual.") for k in state_dict):  # a full CLIP checkpoint
            state_dict = {k[len("visual.") :]: v for k, v in state_dict.items() if k.startswith("visual.")}
        load_strict(visual, state_dict, checkpoint_path)
    config = dict(visual.preprocess_cfg)
    preprocess = image_transform_v2(PreprocessCfg(**config), is_train=False)
    size = config["size"]
    preprocess_config = {
        "library": "open_clip",
        "size": list(size) if isinstance(size, (tuple, list)) else [size, size],
        "crop": {"resize_mode": config["resize_mode"], "fill_color": config["fill_color"]},
        "mean": list(config["mean"]),
        "std": list(config["std"]),
        "interpolation": config["interpolation"],
    }
    return Built(visual, preprocess, preprocess_config)


def tokens(model: nn.Module, images: Tensor, layer: int, final_norm: bool) -> Tensor:
    out = model.forward_intermediates(
        images,
        indices=[layer],
        stop_early=True,
        normalize_intermediates=final_norm,
        intermediates_only=True,
        output_fmt="NLC",
        output_extra_tokens=True,
    )
    prefix, patches = out["image_intermediates_prefix"][0], out["image_intermediates"][0]
    return torch.cat([prefix, patches], dim=1)


def layout(model: nn.Module) -> Layout:
    n_patches = model.grid_size[0] * model.grid_size[1]
    n_prefix = model.positional_embedding.shape[0] - n_patches  # the CLS token's position
    return (n_prefix, tuple(model.grid_size), model.transformer.width, len(model.transformer.resblocks))
