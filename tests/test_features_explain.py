"""Image pages and ``features explain`` end to end: the bundled photos extracted with the tiny ViT (random weights
from the recorded seed, a token subset), a small SAE, its site, and explain run on the same photos: explain's
tokens are the extraction's (so its pages equal the site's), the rankings equal a plain numpy reference, bad input
is one line, and every page renders in Chromium with no broken link or image."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from features_fixtures import identity_sae, write_export
from in_process import error_lines, run
from PIL import Image
from site_walk import chromium, walk_site

from feature_extraction import shards as S
from feature_extraction.extract import extract
from feature_extraction.shards.read import read_shard_samples
from sae_pipeline.__main__ import main
from sae_pipeline.features.explain_backbone import recorded_extraction
from sae_pipeline.sae import ReLUSAE

D_IN, D_SAE, TOP = 192, 24, 16  # vit_tiny's width; a dictionary small enough that most atoms fire on a photo
CARD = re.compile(
    r'#(\d+)(?:</a>)? · <span class="num">max <span class="value">([^<]+)</span></span> · '
    r'<span class="num">sum ([^<]+)</span></figcaption>'
)


def rankings(page: Path) -> dict[str, list[tuple[int, float, float]]]:
    """The two rankings of an image page as ``(atom, max, sum)`` rows."""
    text = page.read_text()
    out = {}
    for name in ("by-max", "by-sum"):
        section = text.split(f'<section class="{name}">', 1)[1].split("</section>", 1)[0]
        out[name] = [(int(a), float(m), float(s)) for a, m, s in CARD.findall(section)]
    return out


def reference_rankings(sae: ReLUSAE, tokens: np.ndarray) -> dict[str, list[int]]:
    """A plain numpy ReLU SAE over one image's tokens, ranked by max and by sum (positive only, ties by id)."""
    state = {k: v.double().numpy() for k, v in sae.state_dict().items()}
    codes = np.maximum((tokens.astype(np.float64) - state["b_pre"]) @ state["W_enc"] + state["b_enc"], 0)
    out = {}
    for name, values in (("by-max", codes.max(0)), ("by-sum", codes.sum(0))):
        atoms = sorted((a for a in range(len(values)) if values[a] > 0), key=lambda a: (-values[a], a))
        out[name] = atoms[:TOP]
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("explain")
    extract(
        backbone="vit_tiny",
        images="samples",
        out=str(root / "shards"),
        shard_size=8,
        batch_size=8,
        num_workers=0,
        device="cpu",
        progress=False,
        tokens_per_image=6,
    )
    manifest = S.load_manifest(root / "shards")
    torch.manual_seed(0)
    sae = ReLUSAE(d_in=D_IN, d_sae=D_SAE)
    with torch.no_grad():
        sae.b_enc.fill_(0.05)  # most atoms fire somewhere: full rankings
    sae_dpath = write_export(sae, root / "sae")
    config = json.loads((sae_dpath / "config.json").read_text())
    config["data"] = {
        "source": str(root / "shards"),
        "manifest_sha256": S.manifest_sha256(manifest),
        "extraction": S.extraction_record(manifest),
    }
    (sae_dpath / "config.json").write_text(json.dumps(config))
    site = root / "site"
    flags = ["--data.num_workers", "0", "--trainer.accelerator", "cpu", "--top", "4", "--neighbours", "2"]
    assert (
        main(["features", "--sae", str(sae_dpath), "--data.source", str(root / "shards"), "--out", str(site), *flags])
        == 0
    )
    (root / "broken.jpg").write_bytes(b"not an image")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        explained = ["--images", "samples", str(root / "broken.jpg"), "--site", str(site)]
        assert main(["features", "explain", "--sae", str(sae_dpath), *explained]) == 0
    tokens = {}
    for fpath, entry in zip(S.shard_fpaths(root / "shards", manifest), manifest["shards"]):
        for _, _, image_tokens, _, meta in read_shard_samples(fpath, list(range(entry["count"]))):
            tokens[meta["image_id"]] = image_tokens.astype(np.float32)
    return {"root": root, "sae": sae, "sae_dpath": sae_dpath, "site": site, "tokens": tokens, "err": err.getvalue()}


def site_image_pages(site: Path) -> dict[str, Path]:
    """image id -> its page in the site (from the title)."""
    pages = {}
    for page in (site / "images").glob("[0-9]*.html"):
        pages[re.search(r"<title>Image (.*?)</title>", page.read_text()).group(1)] = page
    return pages


def test_site_image_pages_rank_atoms_as_a_plain_reference(built) -> None:
    pages = site_image_pages(built["site"])
    assert len(pages) >= 10  # most photos are some atom's top image
    for image_id, page in pages.items():
        shown = rankings(page)
        expected = reference_rankings(built["sae"], built["tokens"][image_id])
        assert [a for a, _, _ in shown["by-max"]] == expected["by-max"], image_id
        assert [a for a, _, _ in shown["by-sum"]] == expected["by-sum"], image_id
    # the atom pages link their top images to these pages, and the index page to the list of images
    atom_page = (built["site"] / "atoms" / "00.html").read_text()
    assert re.search(r'class="image" href="\.\./images/\d+\.html"', atom_page)
    assert 'href="images/index.html"' in (built["site"] / "index.html").read_text()


def test_explain_equals_the_extraction_and_links_into_the_site(built) -> None:
    """explain's tokens for a photo are the extraction's: its rankings and values equal the site's page of it."""
    explained = built["site"] / "explained"
    summary = json.loads((explained / "features.json").read_text())
    assert summary["backbone"] == "vit_tiny" and len(summary["images"]) == 14
    assert [s["image_id"] for s in summary["skipped"]] == ["broken.jpg"]
    assert "broken.jpg" in built["err"] and "broken.jpg" in (explained / "images" / "index.html").read_text()
    pages = {
        re.search(r"<title>Image (.*?)</title>", p.read_text()).group(1): p
        for p in (explained / "images").glob("[0-9]*.html")
    }
    assert sorted(pages) == sorted(built["tokens"])
    for image_id, page in site_image_pages(built["site"]).items():
        ours, theirs = rankings(pages[image_id]), rankings(page)
        for name in ("by-max", "by-sum"):
            assert [a for a, _, _ in ours[name]] == [a for a, _, _ in theirs[name]], (image_id, name)
            np.testing.assert_allclose([v[1:] for v in ours[name]], [v[1:] for v in theirs[name]], rtol=2e-3)
    assert 'href="../../atoms/00.html"' in "".join(p.read_text() for p in pages.values())


def test_explain_tokens_are_the_extractions(built) -> None:
    """The recorded backbone rebuilt (random weights from the seed) on the photos gives the shards' tokens."""
    from feature_extraction.images import ImageDataset, list_images
    from sae_pipeline.features.explain_backbone import build_backbone
    from sae_pipeline.features.explain_images import image_tokens

    record = recorded_extraction(built["sae_dpath"])
    backbone = build_backbone(record, None, D_IN)
    records = list_images("samples")
    pixels = torch.stack([ImageDataset(records, backbone.preprocess)[i][1] for i in range(len(records))])
    ids = [r.image_id for r in records]
    for start in (0, 8):  # the extraction's batches (batch_size = shard_size = 8): the same float32 sums
        tokens, positions = image_tokens(
            backbone, record["token_selection"], pixels[start : start + 8], ids[start : start + 8], torch.device("cpu")
        )
        assert positions is not None and tokens.shape[1:] == (7, D_IN)  # CLS + 6 of the 16 patches
        for image_id, tokens_ in zip(ids[start : start + 8], tokens.numpy()):
            np.testing.assert_array_equal(tokens_.astype(np.float32), built["tokens"][image_id])  # bit for bit


def test_the_record_falls_back_to_the_manifest(built, tmp_path) -> None:
    """An export without the copied record reads it from its shards' manifest.json, if that is the one it names."""
    config = json.loads((built["sae_dpath"] / "config.json").read_text())
    record = config["data"].pop("extraction")
    old = write_export(built["sae"], tmp_path / "old")
    (old / "config.json").write_text(
        json.dumps({**json.loads((old / "config.json").read_text()), "data": config["data"]})
    )
    assert recorded_extraction(old) == record
    saelens = tmp_path / "saelens"  # SAELens's cfg.json names the data in its metadata
    saelens.mkdir()
    metadata = {"dataset_path": config["data"]["source"], "manifest_sha256": config["data"]["manifest_sha256"]}
    (saelens / "cfg.json").write_text(json.dumps({"metadata": metadata}))
    assert recorded_extraction(saelens) == record
    config["data"]["manifest_sha256"] = "0" * 64
    (old / "config.json").write_text(
        json.dumps({**json.loads((old / "config.json").read_text()), "data": config["data"]})
    )
    with pytest.raises(ValueError, match="not the one it was trained on"):
        recorded_extraction(old)


def record_with(built, tmp_path: Path, name: str, sae, **weights) -> Path:
    """An export of ``sae`` whose extraction record's weights say ``weights``."""
    config = json.loads((built["sae_dpath"] / "config.json").read_text())
    dpath = write_export(sae, tmp_path / name)
    record = config["data"]["extraction"]
    record = {**record, "weights": {**record["weights"], **weights}}
    (dpath / "config.json").write_text(
        json.dumps({**json.loads((dpath / "config.json").read_text()), "data": {"extraction": record}})
    )
    return dpath


@pytest.mark.parametrize(
    "case, message",
    [
        ("no record", "records no backbone"),
        ("weights file gone", "pass --checkpoint_path FILE"),
        ("other d_in", "but the SAE takes d_in = 12"),
        ("another site", "not this one"),
        ("another SAE's site of the same size", "is the site of another SAE"),
        ("other backbone weights", "other weights than the extraction's"),
        ("bad device", "--device 'nope' is not a torch device"),
    ],
)
def test_bad_input_is_one_line(built, tmp_path, capsys, case: str, message: str) -> None:
    sae_dpath = built["sae_dpath"]
    extra = []
    if case == "no record":
        sae_dpath = write_export(identity_sae(), tmp_path / "digits_sae")
    elif case == "weights file gone":
        sae_dpath = record_with(
            built, tmp_path, "gone", built["sae"], checkpoint_path=str(tmp_path / "vit.safetensors")
        )
    elif case == "other d_in":
        sae_dpath = record_with(built, tmp_path, "narrow", identity_sae())
    elif case == "another SAE's site of the same size":  # d_in and d_sae agree: only the hash tells
        torch.manual_seed(1)
        sae_dpath = record_with(built, tmp_path, "other_sae", ReLUSAE(d_in=D_IN, d_sae=D_SAE))
        extra = ["--site", str(built["site"])]
    elif case == "other backbone weights":  # the same architecture (vit_tiny) with other numbers
        extra = ["--checkpoint_path", str(vit_tiny_weights(tmp_path, seed=1))]
    elif case == "bad device":
        extra = ["--device", "nope"]
    else:
        other = tmp_path / "other_site"
        other.mkdir()
        (other / "features.json").write_text(json.dumps({"d_in": 12, "d_sae": 12}))
        extra = ["--site", str(other)]
    out = tmp_path / "out"
    code, _, err = run(
        ["features", "explain", "--sae", str(sae_dpath), "--images", "samples", "--out", str(out), *extra], capsys
    )
    assert code == 2 and len(error_lines(err)) == 1 and message in error_lines(err)[0], err
    assert not out.exists()


def vit_tiny_weights(tmp_path: Path, seed: int) -> Path:
    """vit_tiny's random weights of ``seed`` as a .safetensors file (the extraction drew seed 0)."""
    from safetensors.torch import save_file

    from feature_extraction.backbones import load_backbone

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = load_backbone("vit_tiny").model
    fpath = tmp_path / f"vit_tiny_{seed}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(fpath))
    return fpath


def test_the_extractions_weights_are_recorded_and_checked(built, tmp_path, capsys) -> None:
    """The manifest names the backbone's weights by content: the seed's weights saved as a file pass, others do
    not; a record from before the hash cannot tell, and says so once."""
    from sae_pipeline.features.explain_backbone import build_backbone

    record = recorded_extraction(built["sae_dpath"])
    assert len(record["backbone"]["weights_sha256"]) == 64
    same = vit_tiny_weights(tmp_path, seed=0)
    assert build_backbone(record, str(same), D_IN).weights_sha256() == record["backbone"]["weights_sha256"]
    with pytest.raises(ValueError, match="other weights than the extraction's"):
        build_backbone(record, str(vit_tiny_weights(tmp_path, seed=1)), D_IN)
    assert capsys.readouterr().err == ""
    old = {**record, "backbone": {k: v for k, v in record["backbone"].items() if k != "weights_sha256"}}
    build_backbone(old, str(same), D_IN)  # an old record still loads
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: --checkpoint_path") and "not checked" in err[0], err


@pytest.mark.parametrize("name", ["relu", "jumprelu", "topk", "mpsae"])
def test_the_sae_hash_survives_both_export_formats(name: str, tmp_path) -> None:
    """A site built from a checkpoint records the hash that explain computes from its export, native or SAELens
    (JumpReLU's threshold crosses as exp / log), so the right site is never refused; a trained step changes it."""
    from sae_pipeline.artifacts import load_sae
    from sae_pipeline.artifacts.saelens_export import write_saelens
    from sae_pipeline.sae import get_sae_class

    cls = get_sae_class(name)
    torch.manual_seed(0)
    sae = cls(d_in=16, d_sae=64, **({"k": 4} if "k" in inspect.signature(cls).parameters else {}))
    with torch.no_grad():
        for param in sae.parameters():
            param.add_(0.1 * torch.randn_like(param))
    digest = sae.content_sha256()
    assert load_sae(write_export(sae, tmp_path / "native")).content_sha256() == digest
    assert load_sae(write_saelens(sae, tmp_path / "saelens")).content_sha256() == digest
    with torch.no_grad():
        sae.W_dec[0, 0] += 1e-6
    assert sae.content_sha256() != digest


def one_photo(tmp_path: Path) -> Path:
    fpath = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(fpath)
    return fpath


def test_a_site_from_before_sae_hashes_is_used_with_one_warning(built, tmp_path, capsys) -> None:
    """A site whose features.json has no sae_sha256 cannot be told from another SAE's: said once, then used."""
    old_site = tmp_path / "old_site"
    shutil.copytree(built["site"], old_site, ignore=shutil.ignore_patterns("explained"))
    summary = json.loads((old_site / "features.json").read_text())
    assert len(summary.pop("sae_sha256")) == 64
    (old_site / "features.json").write_text(json.dumps(summary))
    args = ["features", "explain", "--sae", str(built["sae_dpath"]), "--images", str(one_photo(tmp_path))]
    code, _, err = run([*args, "--site", str(old_site)], capsys)
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert code == 0 and len(warnings) == 1 and "built before sites recorded their SAE's hash" in warnings[0], err
    assert (old_site / "explained" / "images" / "index.html").is_file()


def test_an_image_that_does_not_decode_is_named_once(built, tmp_path, capsys, caplog) -> None:
    """explain names each skipped image in one warning line, not also through the image reader's log."""
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not an image")
    args = ["--images", str(one_photo(tmp_path)), str(broken), "--out", str(tmp_path / "out")]
    code, _, err = run(["features", "explain", "--sae", str(built["sae_dpath"]), *args], capsys)
    said = [line for line in err.splitlines() if "broken.jpg" in line]
    said += [record.getMessage() for record in caplog.records if "broken.jpg" in record.getMessage()]
    assert code == 0 and len(said) == 1 and said[0].startswith("warning: broken.jpg: does not decode"), said


@pytest.mark.slow
def test_explained_pages_render_with_no_broken_link(built) -> None:
    """The explained pages in Chromium: every href and src resolves (into the site's atom pages too)."""
    explained = (built["site"] / "explained").resolve()
    with chromium() as browser:
        report = walk_site(browser, [explained / "images" / "index.html"], within=explained)
    assert set(report) == set(explained.rglob("*.html"))  # every page is reachable from the index
    assert {page: problems for page, problems in report.items() if problems} == {}


def test_pretrained_weights_offline_is_one_line_naming_checkpoint_path(tmp_path, capsys, monkeypatch) -> None:
    """An SAE on a pretrained backbone, explained with no network and an empty cache: one line, the fix named."""
    import socket

    import huggingface_hub.constants as hub

    from feature_extraction.backbones import BACKBONES

    def refuse(*args, **kwargs):
        raise OSError("network disabled by the test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    for proxy in ["HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"]:
        monkeypatch.delenv(proxy, raising=False)
    spec = BACKBONES["vit"]
    record = {
        "backbone": {**spec.to_json(), "layer": spec.n_blocks - 1, "pretrained": True, "checkpoint_path": None},
        "layer": spec.n_blocks - 1,
        "weights": {"pretrained": True, "checkpoint_path": None, "seed": None},
        "token_selection": None,
        "d": spec.d,
    }
    sae_dpath = write_export(identity_sae(spec.d), tmp_path / "vit_sae")
    config = json.loads((sae_dpath / "config.json").read_text())
    (sae_dpath / "config.json").write_text(json.dumps({**config, "data": {"extraction": record}}))
    out = tmp_path / "out"
    code, _, err = run(
        ["features", "explain", "--sae", str(sae_dpath), "--images", "samples", "--out", str(out)], capsys
    )
    assert code == 2 and len(error_lines(err)) == 1 and "pass --checkpoint_path FILE" in error_lines(err)[0], err
    assert "not available offline" in error_lines(err)[0] and not out.exists()


@pytest.mark.parametrize("recorded", [True, False], ids=["checkpoint with the record", "checkpoint before it"])
@pytest.mark.parametrize("fmt", ["saelens", "native"])
def test_an_export_is_explained_from_any_folder_once_its_shards_are_gone(
    built, tmp_path, capsys, monkeypatch, fmt: str, recorded: bool
) -> None:
    """Issue 31, item 15: fit and export ran where the shards are the relative path ``shards``. The export keeps
    the extraction record (from the checkpoint, or from the manifest for a checkpoint that predates it) and the
    shards' absolute path, so explain runs from another folder, also after the shards were moved away."""
    import shutil

    from sae_pipeline.sae.config import sae_config

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    shutil.copytree(built["root"] / "shards", work / "shards")
    elsewhere.mkdir()
    manifest = S.load_manifest(work / "shards")
    data = {"source": "shards", "manifest_sha256": S.manifest_sha256(manifest)}
    if recorded:
        data["extraction"] = S.extraction_record(manifest)
    sae = built["sae"]
    state = {f"sae.{key}": value for key, value in sae.state_dict().items()}
    torch.save({"state_dict": state, "sae_config": sae_config(sae), "input_scale": 1.0, "data": data}, work / "x.ckpt")
    monkeypatch.chdir(work)
    status, _, err = run(["export", "--ckpt_path", "x.ckpt", "--out", "exported", "--format", fmt], capsys)
    assert status == 0, err
    assert recorded_extraction(work / "exported") == S.extraction_record(manifest)
    shutil.rmtree(work / "shards")  # moved away: the export no longer needs them
    monkeypatch.chdir(elsewhere)
    args = ["features", "explain", "--sae", str(work / "exported"), "--images", "samples", "--out", "pages"]
    status, _, err = run(args, capsys)
    assert status == 0 and not error_lines(err), err
    summary = json.loads((elsewhere / "pages" / "features.json").read_text())
    assert summary["backbone"] == "vit_tiny" and len(summary["images"]) == 14


def test_an_old_saelens_export_with_a_relative_path_says_so(built, tmp_path) -> None:
    """A SAELens export from before the record, whose dataset path was relative to where export ran: one line."""
    config = json.loads((built["sae_dpath"] / "config.json").read_text())
    (tmp_path / "old").mkdir()
    metadata = {"dataset_path": "shards", "manifest_sha256": config["data"]["manifest_sha256"]}
    (tmp_path / "old" / "cfg.json").write_text(json.dumps({"metadata": metadata}))
    with pytest.raises(ValueError, match="a path relative to the folder it was exported in.*export its checkpoint"):
        recorded_extraction(tmp_path / "old")
