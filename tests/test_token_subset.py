"""`--tokens_per_image N`: a seeded per-image token subset, stored with its positions and read back everywhere."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from test_cli import QUIET, REPO_DPATH, run_cli
from test_extract import make_folder, run, shard_bytes, without_time

from feature_extraction import shards as S
from feature_extraction.__main__ import main
from feature_extraction.shards import image_id_from_key
from feature_extraction.shards import read as R
from feature_extraction.token_selection import grid_cell, make_selection, patch_scores, selected_positions, token_kinds
from sae_pipeline.data import ActivationDataModule, TokenLoader, TrainTokenLoader

BACKBONE = "dinov2_tiny"  # CLS + 4 registers, 4x4 patches, d 64
N_PREFIX, GRID, N = 5, (4, 4), 6


def reference_scores(image_id: str, seed: int, n_patches: int) -> list[int]:
    """splitmix64 in plain Python integers, the way the docstring of token_selection describes it."""
    mask = (1 << 64) - 1
    key = int.from_bytes(hashlib.blake2b(f"{seed}\0{image_id}".encode(), digest_size=8).digest(), "little")
    scores = []
    for p in range(1, n_patches + 1):
        x = (key + p * 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        scores.append(x ^ (x >> 31))
    return scores


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return make_folder(tmp_path_factory.mktemp("images"), n_per_class=6)


@pytest.fixture(scope="module")
def full(images, tmp_path_factory) -> Path:
    """All tokens, the reference the subset must be cut from (seed 3: the same random weights)."""
    out = tmp_path_factory.mktemp("full") / "shards"
    run(images, out, backbone=BACKBONE, num_writers=1, seed=3)
    return out


@pytest.fixture(scope="module")
def subset(images, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("subset") / "shards"
    run(images, out, backbone=BACKBONE, num_writers=1, tokens_per_image=N, seed=3)
    return out


def test_scores_match_a_plain_reference() -> None:
    rng = np.random.default_rng(0)
    for _ in range(10):
        ids = ["".join(rng.choice(list("abc/._%é"), size=rng.integers(1, 12))) for _ in range(rng.integers(1, 5))]
        seed, n_patches = int(rng.integers(-5, 10**6)), int(rng.integers(1, 300))
        assert patch_scores(ids, seed, n_patches).tolist() == [reference_scores(i, seed, n_patches) for i in ids]


def test_positions_are_seeded_per_image_and_spread_evenly() -> None:
    selection = make_selection(64, True, 7, 5, (16, 16))
    ids = [f"n01440764/img_{i:05d}.JPEG" for i in range(2000)]
    chosen = selected_positions(ids, selection, 5, (16, 16))
    assert chosen.shape == (2000, 69)
    for positions in chosen[:50]:
        assert positions.dtype == np.int16 and len(positions) == 5 + 64
        assert positions[:5].tolist() == list(range(5)) and (np.diff(positions) > 0).all()
        assert 5 <= positions[5:].min() and positions.max() < 5 + 256
    alone = [selected_positions([i], selection, 5, (16, 16))[0] for i in ids[:20]]
    assert np.array_equal(np.stack(alone), chosen[:20])  # in any batch, alone or not: the same
    assert len({p.tobytes() for p in chosen}) == len(ids)  # every image its own subset
    other_seed = make_selection(64, True, 8, 5, (16, 16))
    assert not np.array_equal(selected_positions(ids[:1], other_seed, 5, (16, 16))[0], chosen[0])
    # Each patch is kept with probability 64/256: over 2000 images, 500 +- 19 (sd); allow 6 sd.
    counts = np.bincount(chosen[:, 5:].ravel() - 5, minlength=256)
    assert np.abs(counts - 500).max() < 6 * np.sqrt(2000 * 0.25 * 0.75)
    no_prefix = make_selection(3, False, 7, 5, (16, 16))
    lowest = np.argsort(patch_scores(ids[:1], 7, 256)[0], kind="stable")[:3] + 5
    assert selected_positions(ids[:1], no_prefix, 5, (16, 16))[0].tolist() == sorted(lowest.tolist())


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((None, True, 0, 5, (4, 4)), None),  # every token
        ((16, True, 0, 5, (4, 4)), None),  # N = all patches, prefix kept: the same as every token
        ((None, False, 0, 0, (4, 4)), None),  # no prefix to drop (SigLIP)
        ((None, False, 2, 5, (4, 4)), {"patches_per_image": 16, "keep_prefix_tokens": False, "seed": 2}),
        ((4, True, 2, 5, (4, 4)), {"patches_per_image": 4, "keep_prefix_tokens": True, "seed": 2}),
    ],
)
def test_selection_record(args, expected) -> None:
    assert make_selection(*args) == expected
    kinds = token_kinds(args[3], args[4], expected)
    assert selected_positions(["x", "y"], expected, args[3], args[4]).shape == (2, sum(kinds.values()))


def test_grid_cell_maps_positions_back() -> None:
    assert grid_cell(0, 5, (16, 16)) is None and grid_cell(4, 5, (16, 16)) is None
    assert grid_cell(5, 5, (16, 16)) == (0, 0) and grid_cell(5 + 17, 5, (16, 16)) == (1, 1)
    assert grid_cell(195, 0, (14, 14)) == (13, 13)
    with pytest.raises(ValueError, match="beyond the 14x14 grid"):
        grid_cell(196, 0, (14, 14))


def test_subset_is_the_full_tokens_at_the_stored_positions(full, subset) -> None:
    manifest = S.load_manifest(subset, verify=True)
    assert manifest["token_selection"] == {"patches_per_image": N, "keep_prefix_tokens": True, "seed": 3}
    assert manifest["token_kinds"] == {"cls": 1, "registers": 4, "patches": N}
    assert (manifest["tokens_per_image"], manifest["n_prefix_tokens"], manifest["grid"]) == (N_PREFIX + N, 5, [4, 4])
    full_manifest = S.load_manifest(full)
    assert full_manifest["token_selection"] is None and full_manifest["tokens_per_image"] == 21
    assert manifest["n_tokens"] == manifest["n_images"] * (N_PREFIX + N) and manifest["n_images"] == 12
    reference = {key: tokens for key, tokens, _ in R.iter_shard_samples(S.shard_fpaths(full, full_manifest))}
    stored = list(R.iter_shard_samples(S.shard_fpaths(subset, manifest), with_positions=True))
    assert [key for key, *_ in stored] == list(reference)
    all_tokens = []
    for key, tokens, meta, positions in stored:
        assert meta["image_id"] == image_id_from_key(key)
        expected = selected_positions([meta["image_id"]], manifest["token_selection"], N_PREFIX, GRID)[0]
        assert positions.dtype == np.int16 and np.array_equal(positions, expected)
        assert np.array_equal(tokens, reference[key][positions])  # same batches: byte-identical float16
        all_tokens.append(tokens.astype(np.float64))
    np.testing.assert_allclose(manifest["stats"]["mean"], np.concatenate(all_tokens).mean(0), rtol=1e-9, atol=1e-12)
    # The fast training reader agrees with webdataset's, positions included.
    fast = [s for fpath in S.shard_fpaths(subset, manifest) for s in R.iter_shard_tokens(fpath, with_positions=True)]
    assert [(k, t.tobytes(), p.tolist()) for k, t, p in fast] == [(k, t.tobytes(), p.tolist()) for k, t, _, p in stored]
    # Any webdataset pipeline sees positions.npy as one more field of the sample.
    dataset = wds.WebDataset([str(p) for p in S.shard_fpaths(subset, manifest)], shardshuffle=False)
    first = next(iter(dataset))
    assert set(first) >= {"__key__", "tokens.npy", "positions.npy", "meta.json"}


def test_task_splits_and_reruns_store_the_same_subset(images, subset, tmp_path) -> None:
    out = tmp_path / "shards"
    for task in range(2):
        run(
            images,
            out,
            backbone=BACKBONE,
            num_writers=2,
            tokens_per_image=N,
            seed=3,
            task_index=task,
            num_tasks=2,
            batch_size=3 if task else 2,
        )
    assert shard_bytes(out) == shard_bytes(subset)
    assert without_time(S.load_manifest(out)) == without_time(S.load_manifest(subset))
    assert run(images, out, backbone=BACKBONE, tokens_per_image=N, seed=3)["shards_written"] == []


def test_rerun_with_other_token_settings_is_refused(images, full, subset) -> None:
    before = shard_bytes(subset)
    for kwargs, message in [
        (dict(tokens_per_image=N + 1, seed=3), "'patches_per_image': 7"),
        (dict(tokens_per_image=N, seed=4), "'seed': 4"),
        (dict(tokens_per_image=N, seed=3, keep_prefix_tokens=False), "'keep_prefix_tokens': False"),
        (dict(seed=3), r"token_selection \(--tokens_per_image, --keep_prefix_tokens, --seed\): .* there, None now"),
    ]:
        with pytest.raises(ValueError, match=f"other settings .*{message}"):
            run(images, subset, backbone=BACKBONE, **kwargs)
    with pytest.raises(ValueError, match=r"token_selection \(.*\): None there"):
        run(images, full, backbone=BACKBONE, tokens_per_image=N, seed=3)
    assert shard_bytes(subset) == before


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", r"--tokens_per_image must be an integer in \[1, 16\] \(the 4x4 patches of dinov2_tiny\), got 0"),
        ("17", r"--tokens_per_image must be an integer in \[1, 16\] .* got 17; omit it to keep every token"),
    ],
)
def test_bad_tokens_per_image_is_a_one_line_error(images, tmp_path, capsys, value, message) -> None:
    out = tmp_path / "out"
    argv = [
        "--backbone",
        BACKBONE,
        "--images",
        str(images),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--progress",
        "false",
        "--tokens_per_image",
        value,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ") and re.search(message, err), err
    assert not out.exists()  # refused before anything is written


def test_patches_only_without_n(images, tmp_path) -> None:
    out = tmp_path / "shards"
    run(images, out, backbone=BACKBONE, num_writers=1, keep_prefix_tokens=False)
    manifest = S.load_manifest(out)
    assert manifest["token_kinds"] == {"cls": 0, "registers": 0, "patches": 16} and manifest["tokens_per_image"] == 16
    for _, _, _, positions in R.iter_shard_samples(S.shard_fpaths(out, manifest), with_positions=True):
        assert positions.tolist() == list(range(5, 21))


def test_training_and_predict_streams_use_the_stored_positions(subset) -> None:
    dm = ActivationDataModule(str(subset), batch_size=8, num_workers=0, val_fraction=0.25)
    assert dm.d_in == 64
    manifest = S.load_manifest(subset)
    stored = {
        (key, int(p)): tokens[j].tobytes()
        for key, tokens, _, positions in R.iter_shard_samples(S.shard_fpaths(subset, manifest), True)
        for j, p in enumerate(positions)
    }
    seen = {}
    for batch in TokenLoader(dm.predict_dataset(), num_workers=0):
        for key, position, x in zip(batch["image_ids"], batch["token_positions"].tolist(), batch["x"]):
            seen[(key, position)] = x.numpy().astype(np.float16).tobytes()
    assert seen == stored  # every stored token once, at its full-sequence position
    train = [x for batch in TrainTokenLoader(dm.train_dataset()) for x in batch["x"]]
    n_train_tokens = sum(e["n_tokens"] for e in manifest["shards"]) - sum(
        u.n_tokens for u in dm.data_source.units("val", 0.25)
    )
    assert len(train) == n_train_tokens // 8 * 8


def test_old_manifest_and_shards_without_positions_still_read(full, tmp_path) -> None:
    import shutil

    old = tmp_path / "old"
    shutil.copytree(full, old)
    manifest = json.loads((old / S.MANIFEST_FNAME).read_text())
    for field in ("token_selection", "token_kinds"):
        del manifest[field]
    (old / S.MANIFEST_FNAME).write_text(json.dumps(manifest))
    loaded = S.load_manifest(old)
    assert loaded["token_selection"] is None and loaded["token_kinds"] == {"cls": 1, "registers": 4, "patches": 16}
    batches = list(TokenLoader(ActivationDataModule(str(old), batch_size=21, num_workers=0).predict_dataset()))
    assert all(b["token_positions"].tolist() == list(range(21)) for b in batches)
    assert all(len(set(b["image_ids"])) == 1 for b in batches)
    manifest["token_kinds"] = {"cls": 1, "registers": 4, "patches": 6}  # disagrees with tokens_per_image 21
    (old / S.MANIFEST_FNAME).write_text(json.dumps(manifest))
    with pytest.raises(S.ShardFormatError, match="'token_kinds'.*disagree.*re-run finalize"):
        S.load_manifest(old)


def test_subset_shard_without_positions_is_an_error(subset, tmp_path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(subset, broken)
    manifest = S.load_manifest(broken)
    fpath = S.shard_fpaths(broken, manifest)[0]
    samples = [(k, t, m) for k, t, m, _ in R.iter_shard_samples([fpath], with_positions=True)]
    sidecar = S.write_shard(broken, 0, samples)  # rewritten without positions.npy
    manifest["shards"][0].update(sha256=sidecar["sha256"], bytes=sidecar["bytes"])
    (broken / S.MANIFEST_FNAME).write_text(json.dumps(manifest))
    dm = ActivationDataModule(str(broken), batch_size=8, num_workers=0)
    with pytest.raises(S.ShardFormatError, match="lacks positions.npy.*token_selection"):
        list(TokenLoader(dm.predict_dataset()))


@pytest.mark.slow
def test_fit_and_predict_commands_on_subset_shards(subset, tmp_path) -> None:
    """The real commands: fit trains on the subset, predict's codes carry the stored positions."""
    from sae_pipeline.artifacts.codes import read_codes

    config = str(REPO_DPATH / "configs" / "demo_shards.yaml")
    common = ["--config", config, "--data.source", str(subset), "--data.val_fraction", "0.25", *QUIET]
    result = run_cli(["fit", *common, "--trainer.max_steps", "3", "--trainer.max_epochs", "1"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt_fpath = tmp_path / "runs" / "demo_shards" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt_fpath, weights_only=True)["global_step"] == 3
    result = run_cli(["predict", *common, "--ckpt_path", str(ckpt_fpath), "--codes.fpath", "codes.h5"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    codes = read_codes(tmp_path / "codes.h5")
    manifest = S.load_manifest(subset)
    expected = [
        (key, int(p))
        for key, _, _, positions in R.iter_shard_samples(S.shard_fpaths(subset, manifest), with_positions=True)
        for p in positions
    ]
    assert list(zip(codes["image_ids"].tolist(), codes["token_positions"].tolist())) == expected


def test_docs_disk_table_follows_from_the_backbone_specs() -> None:
    from feature_extraction.backbones import BACKBONES

    text = (REPO_DPATH / "docs" / "extraction.md").read_text(encoding="utf-8")
    section = text.split("## Disk per backbone", 1)[1].split("\n#", 1)[0]
    rows = [
        [c.strip().strip("`") for c in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| `")
    ]
    n_images = 1_281_167
    assert {row[0] for row in rows} == {name for name in BACKBONES if not name.endswith("_tiny")}
    for name, layout, d, all_gb, n_stored, subset_gb, saving in rows:
        spec = BACKBONES[name]
        stored = sum(
            token_kinds(
                spec.n_prefix_tokens, spec.grid, make_selection(64, True, 0, spec.n_prefix_tokens, spec.grid)
            ).values()
        )
        assert layout == f"{spec.n_prefix_tokens} + {spec.grid[0]}×{spec.grid[1]} = {spec.n_tokens}"
        assert (int(d), int(n_stored)) == (spec.d, stored)
        assert all_gb == f"{n_images * spec.n_tokens * spec.d * 2 / 1e9:,.0f} GB"
        assert subset_gb == f"{n_images * stored * spec.d * 2 / 1e9:,.0f} GB"
        assert saving == f"{spec.n_tokens / stored:.1f}×"


@pytest.mark.parametrize(
    "selection",
    [
        {"patches_per_image": 0, "keep_prefix_tokens": True, "seed": 0},
        {"patches_per_image": "6", "keep_prefix_tokens": True, "seed": 0},
        {"patches_per_image": 6},
        [6],
    ],
)
def test_malformed_token_selection_is_named(subset, tmp_path, selection) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(subset, copy)
    manifest = json.loads((copy / S.MANIFEST_FNAME).read_text())
    manifest["token_selection"] = selection
    (copy / S.MANIFEST_FNAME).write_text(json.dumps(manifest))
    with pytest.raises(S.ShardFormatError, match="field 'token_selection' must be null or"):
        S.load_manifest(copy)
