"""``evaluate intervene`` on the tiny random backbones (timm's ViT, open_clip's CLIP; a middle and the last layer):
with no atom changed the model's output is its own, bit for bit, and the hook sees the extracted tokens; atoms removed
or scaled equal a plain reference that decodes the changed codes, adds the error term back and runs the rest of the
model by hand (all atoms removed: the error term + b_pre); with a class head the change is the KL divergence; the
command writes its files and bad input is one line."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from features_fixtures import write_export
from PIL import Image

from feature_extraction.backbones import load_backbone
from sae_pipeline.evaluate.__main__ import main
from sae_pipeline.evaluate.intervene import intervene
from sae_pipeline.sae import SAE_REGISTRY

D_SAE = 32
CASES = [("vit_tiny", 0), ("vit_tiny", -1), ("clip_tiny", 0), ("clip_tiny", -1)]


@functools.cache
def backbone_and_sae(name: str, layer: int, head: int = 0) -> tuple:
    """Built once per case (read only by the tests)."""
    torch.manual_seed(0)
    backbone = load_backbone(name, layer=layer)
    if head:
        backbone.model.reset_classifier(head)
    torch.manual_seed(1)
    sae = SAE_REGISTRY["topk"](d_in=backbone.spec.d, d_sae=D_SAE, k=4).eval()
    with torch.no_grad():
        sae.b_pre.normal_(0.0, 0.3)
    return backbone, sae


def pixels(backbone, n: int = 2) -> torch.Tensor:
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)) for _ in range(n)]
    return torch.stack([backbone.preprocess(image) for image in images])


@torch.no_grad()
def reference(backbone, sae, images: torch.Tensor, atoms: list[int], scale: float) -> torch.Tensor:
    """The tokens of the layer, x̂' = decode(z with z_j scaled) + (x − x̂), the rest of the model run block by block."""
    model = backbone.model
    x = backbone(images)
    z = sae.encode(x.reshape(-1, x.shape[-1]))
    changed = z.clone()
    changed[:, atoms] *= scale
    x = (sae.decode(changed) + (x.reshape(-1, x.shape[-1]) - sae.decode(z))).reshape(x.shape)
    rest = slice(backbone.layer + 1, None)
    if backbone.spec.library == "timm":
        if not backbone.final_norm:
            for block in model.blocks[rest]:
                x = block(x)
            x = model.norm(x)
        return model.forward_head(x)
    if not backbone.final_norm:
        for block in model.transformer.resblocks[rest]:
            x = block(x)
        x = model.ln_post(x)
    pooled, _ = model._global_pool(x)
    return pooled @ model.proj


TINY = ["vit_tiny", "clip_tiny", "dinov2_tiny", "siglip_tiny", "dinov3_tiny", "pe_core_tiny"]


@pytest.mark.parametrize("layer", [0, -1])
@pytest.mark.parametrize("name", TINY)
def test_the_hook_sees_the_extracted_tokens(name: str, layer: int) -> None:
    """Every tiny registry backbone: the hooked module's output is what the extraction stores, and with no atom
    changed the model's output is its own."""
    backbone, sae = backbone_and_sae(name, layer)
    images = pixels(backbone, 1)
    with torch.no_grad():
        tokens, own = backbone(images), backbone.model(images)
    found = intervene(sae, backbone, images, [0, 1], 1.0)
    assert torch.equal(found["tokens"], tokens) and torch.equal(found["intervened"], own)


@pytest.mark.parametrize(("name", "layer"), CASES)
def test_no_change_is_the_models_own_output(name: str, layer: int) -> None:
    backbone, sae = backbone_and_sae(name, layer)
    images = pixels(backbone)
    with torch.no_grad():
        own = backbone.model(images)
    for atoms, scale in (([], 0.0), ([1, 5, 7], 1.0)):
        found = intervene(sae, backbone, images, atoms, scale)
        assert torch.equal(found["original"], own) and torch.equal(found["intervened"], own)
        assert torch.equal(found["change"], torch.zeros(len(images)))
    assert (found["xhat_change"] > 1e-4).all()  # dropping the error does move it: the comparison is not vacuous


@pytest.mark.parametrize(("name", "layer"), CASES)
@pytest.mark.parametrize(("atoms", "scale"), [(list(range(D_SAE)), 0.0), (None, 2.5)])
def test_atoms_changed_equal_a_plain_reference(name: str, layer: int, atoms: list[int] | None, scale: float) -> None:
    backbone, sae = backbone_and_sae(name, layer)
    images = pixels(backbone)
    if atoms is None:  # a few atoms, among them those of the first token (CLIP's last layer pools that token alone)
        with torch.no_grad():
            first = sae.encode(backbone(images)[:, 0])
        atoms = sorted({1, 5, *torch.nonzero(first)[:, 1].tolist()})
    found = intervene(sae, backbone, images, atoms, scale)
    expected = reference(backbone, sae, images, atoms, scale)
    assert torch.allclose(found["intervened"], expected, rtol=1e-4, atol=1e-5)
    assert (found["change"] > 1e-6).all()
    cosine = torch.nn.functional.cosine_similarity(found["original"].double(), expected.double(), dim=-1)
    assert torch.allclose(found["change"].double(), 1 - cosine, atol=1e-5)


def test_all_atoms_removed_leave_the_error_and_b_pre() -> None:
    backbone, sae = backbone_and_sae("vit_tiny", 0)
    images = pixels(backbone)
    with torch.no_grad():
        x = backbone(images)
        x = x - sae.decode(sae.encode(x.reshape(-1, x.shape[-1]))).reshape(x.shape) + sae.b_pre
        for block in backbone.model.blocks[1:]:
            x = block(x)
        expected = backbone.model.forward_head(backbone.model.norm(x))
    found = intervene(sae, backbone, images, list(range(D_SAE)), 0.0)
    assert torch.allclose(found["intervened"], expected, rtol=1e-4, atol=1e-5)


def test_with_a_class_head_the_change_is_the_kl_divergence() -> None:
    backbone, sae = backbone_and_sae("vit_tiny", 0, head=5)
    images = pixels(backbone, 3)
    found = intervene(sae, backbone, images, [1, 5, 7, 11], 0.0)
    expected = reference(backbone, sae, images, [1, 5, 7, 11], 0.0)
    assert found["original"].shape == (3, 5) and torch.allclose(found["intervened"], expected, rtol=1e-4, atol=1e-5)
    kl = torch.nn.functional.kl_div(
        expected.log_softmax(-1), found["original"].log_softmax(-1), log_target=True, reduction="none"
    ).sum(-1)
    assert torch.allclose(found["change"], kl, atol=1e-6) and (kl > 0).all()
    assert torch.equal(found["top_after"], expected.argmax(-1))


@pytest.fixture
def sae_dir(tmp_path: Path) -> Path:
    backbone, sae = backbone_and_sae("vit_tiny", 0)
    dpath = write_export(sae, tmp_path / "sae")
    config = json.loads((dpath / "config.json").read_text())
    weights = {"pretrained": False, "checkpoint_path": None, "seed": 0}
    config["data"] = {"extraction": {"backbone": backbone.to_json(), "layer": 0, "weights": weights, "d": 192}}
    (dpath / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(tmp_path / f"image{i}.png")
    return dpath


def test_the_command_writes_json_and_markdown(sae_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "broken.png").write_bytes(b"not an image")
    images = [str(tmp_path / f"image{i}.png") for i in range(3)] + [str(tmp_path / "broken.png")]
    argv = ["intervene", "--sae", str(sae_dir), "--images", *images, "--atoms", "5", "1", "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    result = json.loads((tmp_path / "o" / "intervene.json").read_text())
    assert result["atoms"] == [1, 5] and result["output"] == "final embedding" and result["layer"] == 0
    assert [row["id"] for row in result["rows"]] == ["image0.png", "image1.png", "image2.png"]
    assert [row["id"] for row in result["skipped"]] == ["broken.png"]
    assert all(row["change"] >= 0 and row["xhat_change"] > 0 for row in result["rows"])
    markdown = (tmp_path / "o" / "intervene.md").read_text()
    assert "| image | change | x̂ only |" in markdown and "error x − x̂ kept" in markdown
    out, err = capsys.readouterr()
    assert err.count("broken.png") == 1 and err.startswith("warning: skipped image broken.png:")
    assert "mean cosine distance of the final embedding" in out
    assert [line.split(":")[0] for line in out.splitlines()[:3]] == ["image0.png", "image1.png", "image2.png"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sae", "{tmp}/missing"], "--sae {tmp}/missing: not a directory"),
        (["--atoms", "32"], "--atoms 32: out of range for the SAE in {tmp}/sae (d_sae = 32)"),
        (["--scale", "nan"], "--scale"),
        (["--images", "{tmp}/nothing.png"], "--images {tmp}/nothing.png: not found"),
        (["--device", "nope"], "--device 'nope' is not a torch device"),
        (["--sae", "{tmp}/plain"], "records no backbone"),
    ],
)
def test_bad_input_is_one_line(sae_dir: Path, tmp_path: Path, capsys, args: list, message: str) -> None:
    write_export(SAE_REGISTRY["topk"](d_in=192, d_sae=D_SAE, k=4), tmp_path / "plain")
    flags = {"--sae": str(sae_dir), "--images": str(tmp_path / "image0.png"), "--atoms": "1"}
    for flag, value in zip(args[::2], args[1::2]):
        flags[flag] = value.format(tmp=tmp_path)
    argv = ["intervene", *(x for pair in flags.items() for x in pair), "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message.format(tmp=tmp_path) in err, err
    assert "explain" not in err and not (tmp_path / "o").exists()


def test_ctrl_c_names_the_intervention_and_keeps_earlier_files(
    sae_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sae_pipeline.evaluate import intervene as module

    out = tmp_path / "o"
    out.mkdir()
    (out / "intervene.json").write_text("{}")  # an earlier run's

    def stopped(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "intervene_images", stopped)
    argv = ["intervene", "--sae", str(sae_dir), "--images", str(tmp_path / "image0.png"), "--atoms", "1"]
    assert main([*argv, "--out", str(out)]) == 130
    line = capsys.readouterr().err.strip()
    assert line.startswith("interrupted (Ctrl-C): the intervention stopped;") and "checkpoint" not in line
    assert (out / "intervene.json").read_text() == "{}" and not (out / "intervene.md").exists()
