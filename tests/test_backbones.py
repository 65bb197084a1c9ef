"""Backbone registry: token layout, layers, preprocessing and weight loading, on the CPU.

Every entry is built with random weights; its token count, prefix count, grid and `d`
are checked against the architecture the library actually built (library attributes and
a forward pass), and layer outputs against a plain forward hook on the library model.
The lists of entries come from the registry, so a new entry is tested without editing
this file; what is read from a library model is written here per library (independent
of the adapters it checks), so a new library adds its reading here.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from feature_extraction.backbones import BACKBONES, BackboneSpec, get_backbone_spec, load_backbone
from feature_extraction.backbones.backbone import ADAPTERS

PAPER = ["dinov2", "siglip", "clip", "vit"]  # Costa et al. 2025's four ViT-B backbones
TINY = [name for name, spec in BACKBONES.items() if spec.pretrained_tag is None]  # random only
PRETRAINED = [name for name, spec in BACKBONES.items() if spec.pretrained_tag is not None]
ONE_PER_LIBRARY = [next(n for n in PRETRAINED if BACKBONES[n].library == lib) for lib in ADAPTERS]


def built_layout(backbone) -> tuple[int, tuple[int, int], int, int]:
    """(prefix tokens, grid, d, blocks) read from the library model itself."""
    model = backbone.model
    if backbone.spec.library == "timm":
        return (model.num_prefix_tokens, tuple(model.patch_embed.grid_size), model.embed_dim, len(model.blocks))
    n_patches = model.grid_size[0] * model.grid_size[1]
    n_prefix = model.positional_embedding.shape[0] - n_patches  # CLS has a position too
    blocks = model.transformer.resblocks
    return n_prefix, tuple(model.grid_size), model.transformer.width, len(blocks)


def check_layout(backbone, n_images: int) -> None:
    spec = backbone.spec
    assert built_layout(backbone) == (spec.n_prefix_tokens, spec.grid, spec.d, spec.n_blocks)
    record = backbone.to_json()
    assert record["n_tokens"] == spec.n_prefix_tokens + spec.grid[0] * spec.grid[1]
    if n_images:
        size = spec.image_size
        with torch.no_grad():
            tokens = backbone(torch.randn(n_images, 3, size, size))
        assert tokens.shape == (n_images, record["n_tokens"], record["d"])
        assert torch.isfinite(tokens).all()


def check_preprocess_config(backbone) -> None:
    """The recorded preprocessing is the library's config for the pretrained tag."""
    spec, config = backbone.spec, backbone.preprocess_config
    assert config["size"] == [spec.image_size, spec.image_size]
    if spec.library == "timm":
        from timm.models import get_pretrained_cfg

        tag_cfg = get_pretrained_cfg(f"{spec.model_name}.{spec.pretrained_tag}")
        library = {
            "mean": tag_cfg.mean,
            "std": tag_cfg.std,
            "interpolation": tag_cfg.interpolation,
            "crop": {"crop_pct": tag_cfg.crop_pct, "crop_mode": tag_cfg.crop_mode},
        }
    else:
        import open_clip

        tag_cfg = open_clip.get_pretrained_cfg(spec.model_name, spec.pretrained_tag)
        library = {
            "mean": tag_cfg["mean"],
            "std": tag_cfg["std"],
            "interpolation": tag_cfg["interpolation"],
            "crop": {"resize_mode": tag_cfg["resize_mode"], "fill_color": 0},
        }
    library["mean"], library["std"] = list(library["mean"]), list(library["std"])
    assert {k: config[k] for k in library} == library


def hooked_reference(backbone, images: torch.Tensor, layer: int) -> torch.Tensor:
    """Block `layer`'s output captured by a forward hook on a plain library forward pass."""
    model, captured = backbone.model, []
    blocks = model.blocks if backbone.spec.library == "timm" else model.transformer.resblocks
    handle = blocks[layer].register_forward_hook(lambda _m, _i, out: captured.append(out))
    with torch.no_grad():
        model.forward_features(images) if backbone.spec.library == "timm" else model(images)
    handle.remove()
    return captured[0]


def test_registry_names_and_unknown_name() -> None:
    assert {name for name, spec in BACKBONES.items() if spec.has_configs} >= set(PAPER)
    assert all(isinstance(s, BackboneSpec) and s.name == n for n, s in BACKBONES.items())
    assert all(s.library in ADAPTERS for s in BACKBONES.values())
    assert {BACKBONES[n].library for n in TINY} == set(ADAPTERS)  # every adapter runs in the fast tests
    assert not any(BACKBONES[n].has_configs for n in TINY)  # configs extract pretrained weights
    assert get_backbone_spec("dinov2").n_tokens == 261  # the paper's count at 224 px
    with pytest.raises(ValueError, match="dinov2_tiny"):
        get_backbone_spec("dinov4")


@pytest.mark.parametrize("name", TINY)
def test_tiny_layout_matches_record(name: str) -> None:
    check_layout(load_backbone(name), n_images=2)


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("layer", [0, -1])
def test_layer_tokens_match_hook(name: str, layer: int) -> None:
    torch.manual_seed(0)
    backbone = load_backbone(name, layer=layer)
    size = backbone.spec.image_size
    images = torch.randn(2, 3, size, size)
    expected = hooked_reference(backbone, images, layer)
    if layer == -1:  # the final layer is read after the model's final norm
        assert backbone.final_norm and backbone.layer == backbone.spec.n_blocks - 1
        norm = backbone.model.norm if backbone.spec.library == "timm" else backbone.model.ln_post
        expected = norm(expected)
    else:
        assert not backbone.final_norm and backbone.layer == layer
    with torch.no_grad():
        torch.testing.assert_close(backbone(images), expected)


def test_layer_out_of_range_and_bad_images() -> None:
    with pytest.raises(ValueError, match=r"-2\.\.1"):
        load_backbone("vit_tiny", layer=2)
    backbone = load_backbone("vit_tiny", layer=-2)
    assert backbone.layer == 0 and backbone.to_json()["layer"] == 0
    with pytest.raises(ValueError, match="images must have shape"):
        backbone(torch.randn(1, 3, 32, 32))


@pytest.mark.parametrize("name", TINY)
def test_preprocess_gives_model_input(name: str) -> None:
    backbone = load_backbone(name)
    size = backbone.spec.image_size
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 80, 3), dtype=np.uint8))
    pixels = backbone.preprocess(photo)
    assert pixels.shape == (3, size, size)
    config = backbone.preprocess_config
    assert config["size"] == [size, size]
    # Normalisation: a constant grey image maps to (grey - mean) / std per channel.
    grey = backbone.preprocess(Image.new("RGB", (size, size), (128, 128, 128)))
    expected = (128 / 255 - torch.tensor(config["mean"])) / torch.tensor(config["std"])
    torch.testing.assert_close(grey.mean(dim=(1, 2)), expected, atol=1e-2, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", PRETRAINED)
def test_pretrained_entry_layout_matches_record(name: str) -> None:
    """Built with random weights: the architecture and preprocessing of the pretrained tag."""
    backbone = load_backbone(name)
    check_layout(backbone, n_images=1 if backbone.spec.d <= 768 else 0)  # ViT-L: no forward
    check_preprocess_config(backbone)
    spec = backbone.spec
    if spec.library == "open_clip":  # OpenAI CLIP weights need QuickGELU in the random build too
        import open_clip

        quick_gelu = open_clip.get_pretrained_cfg(spec.model_name, spec.pretrained_tag).get("quick_gelu", False)
        gelu = backbone.model.transformer.resblocks[0].mlp.gelu
        assert (type(gelu).__name__ == "QuickGELU") == quick_gelu


@pytest.mark.parametrize("name", ["dinov2_tiny", "dinov3_tiny", "pe_core_tiny"])  # ViT, and timm's Eva twice
def test_checkpoint_roundtrip_timm(tmp_path, name: str) -> None:
    torch.manual_seed(1)
    source = load_backbone(name)
    state = {k: v.contiguous() for k, v in source.model.state_dict().items()}
    save_file(state, tmp_path / "w.safetensors")
    torch.save({"state_dict": state}, tmp_path / "w.pt")
    size = source.spec.image_size
    images = torch.randn(2, 3, size, size)
    with torch.no_grad():
        expected = source(images)
        for fpath in ["w.safetensors", "w.pt"]:
            loaded = load_backbone(name, checkpoint_path=str(tmp_path / fpath))
            torch.testing.assert_close(loaded(images), expected)
            assert loaded.to_json()["checkpoint_path"] == str(tmp_path / fpath)
            assert loaded.to_json()["weights_sha256"] == source.weights_sha256()  # the numbers, not the file format
        other = load_backbone(name)
        assert not torch.allclose(other(images), expected)
        assert other.weights_sha256() != source.weights_sha256()


def test_checkpoint_resamples_position_embedding(tmp_path) -> None:
    """A DINOv2 checkpoint at another resolution (timm ships 518 px) loads into 224 px."""
    import timm

    other = timm.create_model(
        "vit_small_patch14_reg4_dinov2",
        pretrained=False,
        num_classes=0,
        img_size=84,
        depth=2,
        embed_dim=64,
        num_heads=2,
    )
    save_file(other.state_dict(), tmp_path / "w.safetensors")
    loaded = load_backbone("dinov2_tiny", checkpoint_path=str(tmp_path / "w.safetensors"))
    assert loaded.model.pos_embed.shape == (1, 16, 64)
    torch.testing.assert_close(loaded.model.blocks[1].mlp.fc1.weight, other.blocks[1].mlp.fc1.weight)


def test_checkpoint_roundtrip_open_clip(tmp_path) -> None:
    torch.manual_seed(2)
    source = load_backbone("clip_tiny")
    full = {f"visual.{k}": v for k, v in source.model.state_dict().items()}
    full["text_projection"] = torch.zeros(32, 32)  # a full CLIP checkpoint has a text tower too
    torch.save(full, tmp_path / "clip.pt")
    images = torch.randn(2, 3, 32, 32)
    loaded = load_backbone("clip_tiny", checkpoint_path=str(tmp_path / "clip.pt"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(images), source(images))


def test_checkpoint_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="missing.safetensors"):
        load_backbone("vit_tiny", checkpoint_path=str(tmp_path / "missing.safetensors"))
    save_file(load_backbone("vit_tiny").model.state_dict(), tmp_path / "vit.safetensors")
    with pytest.raises(ValueError, match="does not fit"):
        load_backbone("siglip_tiny", checkpoint_path=str(tmp_path / "vit.safetensors"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.pt"):
        load_backbone("vit_tiny", checkpoint_path=str(tmp_path / "junk.pt"))
    with pytest.raises(ValueError, match="choose one"):
        load_backbone("vit", pretrained=True, checkpoint_path=str(tmp_path / "vit.safetensors"))
    with pytest.raises(ValueError, match="without pretrained weights"):
        load_backbone("clip_tiny", pretrained=True)


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """No DNS, no sockets, empty weight caches."""
    import huggingface_hub.constants as hub

    def refuse(*args, **kwargs):
        raise OSError("network disabled by the test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    for proxy in ["HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"]:
        monkeypatch.delenv(proxy, raising=False)
    return hub


@pytest.mark.parametrize("name", ONE_PER_LIBRARY)
def test_pretrained_offline_fails_in_one_line(no_network, monkeypatch, name: str) -> None:
    monkeypatch.setattr(no_network, "HF_HUB_OFFLINE", False)
    with pytest.raises(RuntimeError, match="--checkpoint_path") as info:
        load_backbone(name, pretrained=True)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["vit_tiny", "clip"])
def test_pretrained_hub_error_is_wrapped(no_network, monkeypatch, name: str) -> None:
    """With HF_HUB_OFFLINE the library itself fails (empty cache); we still give one line."""
    import feature_extraction.backbones as backbones

    monkeypatch.setattr(no_network, "HF_HUB_OFFLINE", True)
    if name == "vit_tiny":  # a small timm model with real pretrained weights on the hub
        tiny = BACKBONES["vit_tiny"]
        spec = BackboneSpec("vit_tiny", "timm", tiny.model_name, "augreg_in21k_ft_in1k", 1, (14, 14), 192, 224, 12)
        monkeypatch.setitem(backbones.BACKBONES, "vit_tiny", spec)
    with pytest.raises(RuntimeError, match="--checkpoint_path") as info:
        load_backbone(name, pretrained=True)
    assert "\n" not in str(info.value)


def test_checkpoint_in_dinov3_original_names(tmp_path) -> None:
    """A DINOv3 file in Meta's key names (`storage_tokens` for the registers) loads through timm's Eva
    filter, which the ViT filter would leave unconverted (a strict load then fails)."""
    torch.manual_seed(3)
    source = load_backbone("dinov3_tiny")
    renamed = {"reg_token": "storage_tokens"}
    state = {renamed.get(k, k): v.contiguous() for k, v in source.model.state_dict().items()}
    assert "storage_tokens" in state
    save_file(state, tmp_path / "meta.safetensors")
    loaded = load_backbone("dinov3_tiny", checkpoint_path=str(tmp_path / "meta.safetensors"))
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(images), source(images))
