"""The backbone registry: one entry per backbone, nothing else to edit to add one.

An entry names the library (which picks the adapter), the library's model name and
pretrained tag, and the token layout the model produces. `has_configs=True` says it ships
`configs/extract_<name>.yaml`, its data piece `configs/data/<name>.yaml` and the shortcut
`configs/<variant>_<name>.yaml` per SAE variant: the tests take their backbone lists from
here and require exactly those files. A backbone without them trains with any variant as
`fit --config configs/vision/<variant>.yaml --data <its data piece>` (`sae_pipeline.config_files`).

- The paper trains on "frozen features from the final layer of each backbone", with the
  CLS token and all spatial tokens (~261 per image for DINOv2 with registers, Costa et
  al. 2025, appendix "Large vision models"); `load_backbone` reads the last block after
  the final norm by default.
- The only preprocessing override is the input size where we choose it (DINOv2 at 224 px
  as in the paper, timm's default is 518): `img_size` in the model kwargs.
- SigLIP comes from timm (`vit_base_patch16_siglip_224.webli`): the same weights as
  open_clip's `ViT-B-16-SigLIP` (which wraps this very timm model), with timm's
  `forward_intermediates` and data config, so three of the four families share one
  adapter. CLIP comes from open_clip (OpenAI weights, QuickGELU).
- The backbones the field moved to since the paper: DINOv3 (timm's port, an `Eva` model with RoPE,
  CLS + 4 registers) at its native 256 px, where its 16x16 patches give the 261 tokens of DINOv2 at
  224 px; SigLIP 2 from timm (`vit_base_patch16_siglip_224.v2_webli`), the very model and weights
  that open_clip's `ViT-B-16-SigLIP2` wraps as its image tower, so it shares SigLIP's path (and does
  not build open_clip's 256k-token text tower only to drop it); Perception Encoder core
  (`vit_pe_core_base_patch16_224`, an `Eva` with a CLS token). timm's `Eva` gives the same
  `forward_intermediates` and data config as its ViTs, so these need no adapter of their own.
- Tiny entries (no pretrained tag) keep their family's code path (registers, no-CLS
  pooling, open_clip tower) at a width and depth that build and run in milliseconds;
  the tests run every one of them.
"""

from __future__ import annotations

from typing import Any

from feature_extraction.backbones.spec import BackboneSpec, Library


def _spec(
    name: str,
    library: Library,
    model_name: str,
    tag: str | None,
    n_prefix: int,
    grid: int,
    d: int,
    image_size: int,
    n_blocks: int,
    *,
    has_configs: bool = False,
    **model_kwargs: Any,
) -> BackboneSpec:
    return BackboneSpec(
        name, library, model_name, tag, n_prefix, (grid, grid), d, image_size, n_blocks, model_kwargs, has_configs
    )


_TINY_TIMM = dict(depth=2, embed_dim=64, num_heads=2)
_TINY_CLIP = dict(
    embed_dim=32,
    vision_cfg=dict(image_size=32, patch_size=8, width=64, layers=2, head_width=32),
    text_cfg=dict(context_length=8, vocab_size=64, width=32, heads=2, layers=1),
)

BACKBONES: dict[str, BackboneSpec] = {
    spec.name: spec
    for spec in [
        # The paper's four backbones (ViT-B), with extraction and training configs.
        # DINOv2 at 224 px: 16x16 patches + CLS + 4 registers = 261 tokens.
        _spec(
            "dinov2",
            "timm",
            "vit_base_patch14_reg4_dinov2",
            "lvd142m",
            5,
            16,
            768,
            224,
            12,
            has_configs=True,
            img_size=224,
        ),
        _spec("siglip", "timm", "vit_base_patch16_siglip_224", "webli", 0, 14, 768, 224, 12, has_configs=True),
        _spec("clip", "open_clip", "ViT-B-16", "openai", 1, 14, 768, 224, 12, has_configs=True),
        _spec("vit", "timm", "vit_base_patch16_224", "augreg2_in21k_ft_in1k", 1, 14, 768, 224, 12, has_configs=True),
        # Newer backbones (2025): DINOv3 at 256 px (5 + 16x16 = 261 tokens), SigLIP 2, Perception Encoder core.
        _spec("dinov3", "timm", "vit_base_patch16_dinov3", "lvd1689m", 5, 16, 768, 256, 12, has_configs=True),
        _spec("siglip2", "timm", "vit_base_patch16_siglip_224", "v2_webli", 0, 14, 768, 224, 12, has_configs=True),
        _spec("pe_core", "timm", "vit_pe_core_base_patch16_224", "fb", 1, 14, 768, 224, 12, has_configs=True),
        # ViT-L sizes (no configs of their own).
        _spec("dinov2_large", "timm", "vit_large_patch14_reg4_dinov2", "lvd142m", 5, 16, 1024, 224, 24, img_size=224),
        _spec("siglip_large", "timm", "vit_large_patch16_siglip_256", "webli", 0, 16, 1024, 256, 24),
        _spec("clip_large", "open_clip", "ViT-L-14", "openai", 1, 16, 1024, 224, 24),
        _spec("vit_large", "timm", "vit_large_patch16_224", "augreg_in21k_ft_in1k", 1, 14, 1024, 224, 24),
        _spec("dinov3_large", "timm", "vit_large_patch16_dinov3", "lvd1689m", 5, 16, 1024, 256, 24),
        # Test entries: random weights only.
        _spec("dinov2_tiny", "timm", "vit_small_patch14_reg4_dinov2", None, 5, 4, 64, 56, 2, img_size=56, **_TINY_TIMM),
        _spec("siglip_tiny", "timm", "vit_base_patch16_siglip_224", None, 0, 4, 64, 64, 2, img_size=64, **_TINY_TIMM),
        _spec("clip_tiny", "open_clip", "ViT-B-16", None, 1, 4, 64, 32, 2, **_TINY_CLIP),
        _spec("dinov3_tiny", "timm", "vit_small_patch16_dinov3", None, 5, 4, 64, 64, 2, img_size=64, **_TINY_TIMM),
        _spec("pe_core_tiny", "timm", "vit_pe_core_base_patch16_224", None, 1, 4, 64, 64, 2, img_size=64, **_TINY_TIMM),
        _spec("vit_tiny", "timm", "vit_tiny_patch16_224", None, 1, 4, 192, 64, 2, img_size=64, depth=2),
    ]
}


def get_backbone_spec(name: str) -> BackboneSpec:
    """The registry entry for `name`; a ValueError lists the valid names."""
    if name not in BACKBONES:
        raise ValueError(f"backbone {name!r} is unknown; choose one of {sorted(BACKBONES)}")
    return BACKBONES[name]
