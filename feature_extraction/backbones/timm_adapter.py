"""The timm adapter (DINOv2, DINOv3, SigLIP, SigLIP 2, PE core, supervised ViT): build, layer tokens, layout.

Preprocessing is timm's data config of the pretrained tag, built at the spec's image
size (`pretrained_cfg_overlay`). A layer's tokens come from `forward_intermediates`
(prefix tokens returned separately, put first); the final layer after the final norm is
`forward_features`, what timm hands its heads.

A weights file goes through the checkpoint filter of the model's own timm module
(`vision_transformer` for the ViTs, `eva` for DINOv3 and PE): each converts its family's original
key names (and resamples position embeddings), and one family's filter mangles the other's keys.
"""

from __future__ import annotations

import copy
import importlib

import torch
from torch import Tensor, nn

from feature_extraction.backbones.adapter import Built, Layout
from feature_extraction.backbones.hub import download
from feature_extraction.backbones.spec import BackboneSpec
from feature_extraction.backbones.weights import load_strict


def build(
    spec: BackboneSpec, pretrained: bool, state_dict: dict[str, Tensor] | None, checkpoint_path: str | None
) -> Built:
    import timm
    from timm.data import create_transform, resolve_model_data_config

    full_name = spec.model_name + (f".{spec.pretrained_tag}" if spec.pretrained_tag else "")
    kwargs = copy.deepcopy(spec.model_kwargs)
    size = spec.image_size  # the data config must describe the size the model is built at
    kwargs["pretrained_cfg_overlay"] = dict(input_size=(3, size, size))
    if pretrained:
        model = download(spec, lambda: timm.create_model(full_name, pretrained=True, num_classes=0, **kwargs))
    else:
        model = timm.create_model(full_name, pretrained=False, num_classes=0, **kwargs)
    if state_dict is not None:
        # timm's own filter converts original DINOv2 keys and resamples position embeddings
        # (e.g. a 518 px checkpoint into our 224 px model).
        state_dict = checkpoint_filter(model)(state_dict, model)
        own_keys = model.state_dict().keys()
        state_dict = {
            k: v for k, v in state_dict.items() if k in own_keys or not k.startswith("head.")
        }  # classifier not kept
        load_strict(model, state_dict, checkpoint_path)
    config = resolve_model_data_config(model)
    preprocess = create_transform(**config, is_training=False)
    preprocess_config = {
        "library": "timm",
        "size": list(config["input_size"][1:]),
        "crop": {"crop_pct": config["crop_pct"], "crop_mode": config["crop_mode"]},
        "mean": list(config["mean"]),
        "std": list(config["std"]),
        "interpolation": config["interpolation"],
    }
    return Built(model, preprocess, preprocess_config)


def checkpoint_filter(model: nn.Module):  # noqa: ANN201 (timm's filter signature)
    """The `checkpoint_filter_fn` of the timm module that defines the model's class."""
    module = importlib.import_module(type(model).__module__)
    if not hasattr(module, "checkpoint_filter_fn"):
        module = importlib.import_module("timm.models.vision_transformer")
    return module.checkpoint_filter_fn


def tokens(model: nn.Module, images: Tensor, layer: int, final_norm: bool) -> Tensor:
    if final_norm:
        return model.forward_features(images)
    (taken,) = model.forward_intermediates(
        images,
        indices=[layer],
        return_prefix_tokens=True,
        norm=False,
        stop_early=True,
        output_fmt="NLC",
        intermediates_only=True,
    )
    if isinstance(taken, tuple):  # (patches, prefix) when the model has prefix tokens
        patches, prefix = taken
        return torch.cat([prefix, patches], dim=1)
    return taken


def layout(model: nn.Module) -> Layout:
    return (model.num_prefix_tokens, tuple(model.patch_embed.grid_size), model.embed_dim, len(model.blocks))
