"""The browser draws only the images that were extracted: an image replaced after extraction is listed, not drawn
with the old image's heatmaps; shards older than the content hash are drawn unchecked, and the command says so."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from features_fixtures import identity_sae, write_export, write_shards
from PIL import Image

from feature_extraction.extract import extract
from sae_pipeline.__main__ import main

N_IMAGES = 6


def features(shards: Path, sae: Path, out: Path, capsys) -> str:
    """``python -m sae_pipeline features`` (in this process); returns its stderr."""
    code = main(
        [
            "features",
            "--sae",
            str(sae),
            "--data.source",
            str(shards),
            "--out",
            str(out),
            "--top",
            "8",
            "--data.batch_size",
            "64",
            "--data.num_workers",
            "0",
            "--trainer.accelerator",
            "cpu",
        ]
    )
    assert code == 0
    return capsys.readouterr().err


def cards_of(site: Path, image_id: str) -> list[str]:
    """Every card of every atom page that shows ``image_id``."""
    cards = []
    for page in (site / "atoms").glob("*.html"):
        cards += [
            card
            for card in page.read_text().split('<figure class="card"')[1:]
            if f">{image_id}<" in card or f"<br>{image_id}" in card
        ]
    return cards


@pytest.mark.slow
def test_image_replaced_after_extraction_is_listed_not_drawn(tmp_path: Path, capsys) -> None:
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(N_IMAGES):
        Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(images / f"img{i}.png")
    shards = tmp_path / "shards"
    extract(
        backbone="vit_tiny",
        images=str(images),
        out=str(shards),
        shard_size=4,
        batch_size=4,
        num_workers=0,
        device="cpu",
        progress=False,
    )
    sae = write_export(identity_sae(192), tmp_path / "sae")  # vit_tiny's tokens are 192-d

    before = features(shards, sae, tmp_path / "site-before", capsys)
    summary = json.loads((tmp_path / "site-before" / "features.json").read_text())
    assert summary["images_changed"] == [] and summary["images_unchecked"] == 0 and "warning" not in before
    assert summary["n_images_shown"] == N_IMAGES  # every image is among some atom's top 8: each one is drawn
    assert all("<img" in card for card in cards_of(tmp_path / "site-before", "img2.png"))

    # Same name, same size, other pixels: only the hash can tell.
    Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(images / "img2.png")
    site = tmp_path / "site"
    err = features(shards, sae, site, capsys)
    summary = json.loads((site / "features.json").read_text())
    assert summary["images_changed"] == [{"image_id": "img2.png", "where": str(images / "img2.png")}]
    assert summary["n_images_shown"] == N_IMAGES - 1 and summary["images_unchecked"] == 0
    assert len(list((site / "thumbs").glob("*.jpg"))) == N_IMAGES - 1
    changed = cards_of(site, "img2.png")
    assert changed and all(
        "<img" not in card and "data-heat" not in card and "changed since extraction" in card for card in changed
    )
    assert all("<img" in card for card in cards_of(site, "img1.png"))  # the others are still drawn
    index = (site / "index.html").read_text()
    assert "Images changed since extraction (1): not drawn" in index and "<li>img2.png " in index
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "1 images changed since extraction" in warnings[0] and "img2.png" in warnings[0]


def test_shards_without_hashes_are_drawn_unchecked_and_said_once(tmp_path: Path, capsys) -> None:
    shards = tmp_path / "shards"
    write_shards(shards, tmp_path / "images")  # meta.json as written before content hashes
    assert "image_xxh3_64" not in (next(shards.glob("shard-*.tar")).read_bytes().decode("latin-1"))
    err = features(shards, write_export(identity_sae(), tmp_path / "sae"), tmp_path / "site", capsys)
    summary = json.loads((tmp_path / "site" / "features.json").read_text())
    shown = summary["n_images_shown"]
    assert shown > 0 and summary["images_unchecked"] == shown and summary["images_changed"] == []
    warnings = [line for line in err.splitlines() if "drawn unchecked" in line]
    expected = (
        f"warning: {shown} images drawn unchecked: their shards predate content hashes (re-extract to check them)"
    )
    assert warnings == [expected]
    assert f"{shown} images drawn unchecked" in (tmp_path / "site" / "index.html").read_text()
