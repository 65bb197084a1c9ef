"""``features --intervene`` on the tiny random ViT (a middle layer, a token subset): the atom pages' section "Removed
inside the backbone" and ``features.npz``'s ``intervene_*`` equal a plain float64 reference (the layer's tokens taken
by hand, the atom's part subtracted, the rest of the model run block by block; the matched atom found by its summed
|code|); an atom scaled by 1 changes nothing, exactly, in batches of mixed images; with a class head the change is
the KL divergence; and bad input is one line, with nothing written."""

from __future__ import annotations

import copy
import html
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from features_fixtures import write_export, write_shards
from in_process import error_lines, run
from scipy import stats

from feature_extraction import shards as S
from feature_extraction.backbones import load_backbone
from feature_extraction.extract import extract
from feature_extraction.shards.read import read_shard_samples
from sae_pipeline.features.images import SourceImages
from sae_pipeline.features.interventions import atom_arrays, measure
from sae_pipeline.features.interventions_html import verdict
from sae_pipeline.sae import SAE_REGISTRY

D_IN, D_SAE, TOP, MEASURED = 192, 16, 4, 4


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The bundled photos through vit_tiny's first block (6 tokens kept per image), a TopK SAE, its site."""
    from sae_pipeline.__main__ import main

    root = tmp_path_factory.mktemp("intervene")
    extract(
        backbone="vit_tiny",
        images="samples",
        out=str(root / "shards"),
        layer=0,
        shard_size=8,
        batch_size=8,
        num_workers=0,
        device="cpu",
        progress=False,
        tokens_per_image=6,
    )
    manifest = S.load_manifest(root / "shards")
    torch.manual_seed(0)
    sae = SAE_REGISTRY["topk"](d_in=D_IN, d_sae=D_SAE, k=4).eval()
    with torch.no_grad():
        sae.b_pre.normal_(0.0, 0.3)
    sae_dpath = write_export(sae, root / "sae")
    flags = ["--data.num_workers", "0", "--trainer.accelerator", "cpu", "--top", str(TOP), "--neighbours", "2"]
    site = root / "site"
    argv = ["features", "--sae", str(sae_dpath), "--data.source", str(root / "shards"), *flags]
    assert main([*argv, "--out", str(site), "--intervene", "--intervene_atoms", str(MEASURED)]) == 0
    metas = []
    for fpath, entry in zip(S.shard_fpaths(root / "shards", manifest), manifest["shards"]):
        metas += [meta for *_, meta in read_shard_samples(fpath, list(range(entry["count"])))]
    torch.manual_seed(0)  # the extraction's random weights (seed 0)
    backbone = load_backbone("vit_tiny", layer=0).eval()
    return {"root": root, "sae": sae, "site": site, "metas": metas, "backbone": backbone, "argv": argv}


def image_pixels(backbone, meta: dict) -> torch.Tensor:
    return backbone.preprocess(SourceImages().open(meta))


def float64(module: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy, made once per module."""
    if id(module) not in COPIES:
        COPIES[id(module)] = (module, copy.deepcopy(module).double())
    return COPIES[id(module)][1]


COPIES: dict[int, tuple] = {}


@torch.no_grad()
def reference(backbone, sae, pixels: torch.Tensor, atom: int | None = None, xhat: bool = False) -> torch.Tensor:
    """float64: the tokens of block 0, the atom's z d subtracted (or x̂ in their place), blocks 1.., norm, head."""
    backbone, sae = float64(backbone), float64(sae)
    model = backbone.model
    x = backbone(pixels[None].double())
    flat = x.reshape(-1, x.shape[-1])
    z = sae.encode(flat)
    if xhat:
        flat = sae.decode(z)
    elif atom is not None:
        flat = flat - z[:, [atom]] * sae.W_dec[atom]
    x = flat.reshape(x.shape)
    for block in model.blocks[1:]:
        x = block(x)
    return model.forward_head(model.norm(x))[0]


def cosine_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(1 - torch.nn.functional.cosine_similarity(a, b, dim=0))


def code_sums(backbone, sae, pixels: torch.Tensor) -> np.ndarray:
    """Per atom, its |code| summed over the image's tokens (float64)."""
    with torch.no_grad():
        x = float64(backbone)(pixels[None].double())
        return float64(sae).encode(x.reshape(-1, x.shape[-1])).abs().sum(0).numpy()


def matched_atom(sums: np.ndarray, atom: int) -> int:
    """The other atom active on the image whose |code| summed over its tokens is closest to ``atom``'s."""
    others = [j for j in range(len(sums)) if j != atom and sums[j] > 0]
    return min(others, key=lambda j: (abs(sums[j] - sums[atom]), (sums[j], j) > (sums[atom], atom)))


def t_interval(values: np.ndarray) -> tuple[float, float]:
    half = stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
    return values.mean() - half, values.mean() + half


def test_the_section_equals_a_plain_reference(built) -> None:
    site, backbone, sae = built["site"], built["backbone"], built["sae"]
    arrays = np.load(site / "features.npz")
    measured = np.flatnonzero(arrays["intervene_measured"])
    fire = arrays["fire_count"]
    assert sorted(measured) == sorted(sorted(range(D_SAE), key=lambda a: (-fire[a], a))[:MEASURED])
    summary = json.loads((site / "features.json").read_text())["intervene"]
    assert summary["atoms"] == measured.tolist() and summary["output"] == "final embedding"
    effects, seen = [], {}
    for atom in measured:
        for slot in range(TOP):
            key = int(arrays["image"][atom, slot])
            if key not in seen:
                pixels = image_pixels(backbone, built["metas"][key])
                before = reference(backbone, sae, pixels)
                xhat = cosine_distance(before, reference(backbone, sae, pixels, xhat=True))
                seen[key] = pixels, before, xhat, code_sums(backbone, sae, pixels)
            pixels, before, xhat, sums = seen[key]
            effect = cosine_distance(before, reference(backbone, sae, pixels, atom))
            other = matched_atom(sums, atom)
            assert arrays["intervene_image_matched_atom"][atom, slot] == other
            found = [arrays[f"intervene_image_{name}"][atom, slot] for name in ("effect", "matched", "xhat")]
            expected = [effect, cosine_distance(before, reference(backbone, sae, pixels, other)), xhat]
            np.testing.assert_allclose(found, expected, rtol=1e-3, atol=1e-6)
            effects.append(effect)
        per_image = {name: arrays[f"intervene_image_{name}"][atom] for name in ("effect", "matched", "xhat")}
        per_image["excess"] = per_image["effect"] - per_image["matched"]
        for name, values in per_image.items():
            assert arrays[f"intervene_{name}"][atom] == pytest.approx(values.mean(), rel=1e-12, abs=1e-15)
            low, high = t_interval(values)
            assert arrays[f"intervene_{name}_low"][atom] == pytest.approx(low, rel=1e-9, abs=1e-15)
            assert arrays[f"intervene_{name}_high"][atom] == pytest.approx(high, rel=1e-9, abs=1e-15)
        page = (site / "atoms" / f"{atom:02d}.html").read_text()
        section = page.split("<h2>Removed inside the backbone</h2>", 1)[1].split("</section>", 1)[0]
        assert f"<td>this atom removed</td><td>{arrays['intervene_effect'][atom]:.3g}</td>" in section
        low, high = arrays["intervene_excess_low"][atom], arrays["intervene_excess_high"][atom]
        assert f"<td>[{low:.3g}, {high:.3g}]</td>" in section and "the SAE's error x − x̂ kept" in section
        assert html.escape(verdict(TOP, low, high)) in section and "less than chance" not in section
    assert max(effects) > 1e-4  # removing an atom does move the embedding: the comparison is not vacuous
    unmeasured = next(a for a in range(D_SAE) if a not in measured)
    assert "Not measured: --intervene measured the 4 atoms" in (site / "atoms" / f"{unmeasured:02d}.html").read_text()
    assert np.isnan(arrays["intervene_effect"][unmeasured]) and arrays["intervene_n"][unmeasured] == 0


@pytest.mark.parametrize("head", [0, 5])
def test_scale_one_changes_nothing_exactly_and_a_head_gives_kl(built, head: int) -> None:
    """In batches of 3 mixed images (rounds padded): scale 1 gives 0 exactly for every removal; scale 0 with a class
    head gives the KL divergence of the class distributions and the top-class changes of the reference."""
    backbone, sae = copy.deepcopy(built["backbone"]), built["sae"]
    if head:
        torch.manual_seed(2)
        backbone.model.reset_classifier(head)
    pixels = {key: image_pixels(backbone, meta) for key, meta in enumerate(built["metas"][:5])}
    tops = {0: [(0, 0), (1, 3)], 2: [(0, 1), (1, 2), (2, 4)], 5: [(0, 4)], 9: [(0, 0), (1, 1), (2, 2), (3, 3)]}
    same = measure(sae, backbone, tops, pixels, scale=1.0, batch_size=3)
    assert len(same.change) >= 12 and all(value == 0.0 for value in same.change.values())
    assert not any(same.top_changed.values()) and min(same.xhat.values()) > 1e-4
    arrays = atom_arrays(same, tops, D_SAE, TOP)
    excess = arrays["intervene_excess"][list(tops)]
    assert (arrays["intervene_effect"][list(tops)] == 0).all() and (excess[np.isfinite(excess)] == 0).all()
    assert arrays["intervene_n_matched"].sum() > 0
    if not head:
        return
    removed = measure(sae, backbone, tops, pixels, scale=0.0, batch_size=3)
    original = {key: reference(backbone, sae, pixels[key]) for key in pixels}
    for (key, atom), value in removed.change.items():
        before, after = original[key], reference(backbone, sae, pixels[key], atom)
        kl = float((before.softmax(0) * (before.log_softmax(0) - after.log_softmax(0))).sum())
        assert value == pytest.approx(kl, rel=1e-3, abs=1e-7)
        assert removed.top_changed[(key, atom)] == bool(before.argmax() != after.argmax())
    assert max(removed.change.values()) > 1e-6
    shares = atom_arrays(removed, tops, D_SAE, TOP)["intervene_top_changed"]
    expected = np.mean([removed.top_changed[(key, 9)] for key in range(4)])
    assert shares[9] == expected and np.isnan(shares[1])


def vit_tiny_weights(tmp_path: Path, seed: int) -> Path:
    from safetensors.torch import save_file

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = load_backbone("vit_tiny").model
    fpath = tmp_path / f"vit_tiny_{seed}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(fpath))
    return fpath


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no backbone", "--intervene: --data.source {tmp}/synthetic: its manifest records no backbone"),
        ("digits", "--intervene: --data.source digits has no backbone"),
        ("negative", "--intervene_atoms must be an integer >= 0"),
        ("other weights", "--intervene: --checkpoint_path {tmp}/vit_tiny_1.safetensors: other weights"),
    ],
)
def test_bad_input_is_one_line(built, tmp_path, capsys, case: str, message: str) -> None:
    argv = [*built["argv"], "--out", str(tmp_path / "out"), "--intervene"]
    if case == "no backbone":
        write_shards(tmp_path / "synthetic", tmp_path / "images", n_images=2)
        argv[argv.index("--data.source") + 1] = str(tmp_path / "synthetic")
        argv[argv.index("--sae") + 1] = str(write_export(SAE_REGISTRY["topk"](d_in=12, d_sae=8, k=2), tmp_path / "s"))
    elif case == "digits":
        argv[argv.index("--data.source") + 1] = "digits"
        argv[argv.index("--sae") + 1] = str(write_export(SAE_REGISTRY["topk"](d_in=64, d_sae=8, k=2), tmp_path / "s"))
    elif case == "negative":
        argv += ["--intervene_atoms", "-1"]
    else:
        argv += ["--checkpoint_path", str(vit_tiny_weights(tmp_path, seed=1))]
    code, _, err = run(argv, capsys)
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and message.format(tmp=tmp_path) in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
