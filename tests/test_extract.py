"""The extraction command: tokens equal a plain per-image forward, task splits and resume give the same shards."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import skimage.data
import torch
import xxhash
from PIL import Image
from terminal import child_pids

from feature_extraction import shards as S
from feature_extraction.__main__ import build_parser, main
from feature_extraction.backbones import BACKBONES, BackboneSpec, load_backbone
from feature_extraction.extract import default_task, extract
from feature_extraction.shards import LOCK_FNAME, image_id_from_key, image_key
from feature_extraction.shards import read as R
from feature_extraction.shards import write as W

REPO_DPATH = Path(__file__).resolve().parents[1]
BACKBONE = "vit_tiny"
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "coins")


def make_folder(root: Path, n_per_class: int, size: int = 40, seed: int = 0) -> Path:
    """Class folders of random crops of scikit-image photos; names with dots; one corrupt file."""
    rng = np.random.default_rng(seed)
    photos = [np.asarray(Image.fromarray(getattr(skimage.data, name)()).convert("RGB")) for name in PHOTOS]
    for label, class_name in enumerate(["cat.v1", "dog"]):
        for i in range(n_per_class):
            photo = photos[(i + label) % len(photos)]
            y, x = rng.integers(0, photo.shape[0] - size), rng.integers(0, photo.shape[1] - size)
            fpath = root / class_name / f"img.{i:03d}.png"  # dots beyond the extension
            fpath.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(photo[y : y + size, x : x + size]).save(fpath)
    (root / "dog" / "_broken.jpg").write_bytes(rng.bytes(300))
    return root


def run(images: Path, out: Path, **kwargs) -> dict:
    options = (
        dict(
            backbone=BACKBONE,
            images=str(images),
            out=str(out),
            shard_size=3,
            batch_size=2,
            num_workers=0,
            device="cpu",
            progress=False,
        )
        | kwargs
    )
    return extract(**options)


def is_running(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.tar"))}


def without_time(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k != "created_at"}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return make_folder(tmp_path_factory.mktemp("images"), n_per_class=5)


@pytest.fixture(scope="module")
def reference(images, tmp_path_factory) -> Path:
    """One uninterrupted single-task run that the other runs must reproduce."""
    out = tmp_path_factory.mktemp("reference") / "shards"
    run(images, out)
    return out


def test_image_key_is_valid_and_reversible() -> None:
    rng = random.Random(0)
    alphabet = "ab._%/-Z"
    ids = {"a.png", "a_png", "a%2Epng", "__x", "_x.y", "d.ir/f.g.h", "%", "x/_y.jpg"}
    while len(ids) < 400:
        parts = [
            "".join(rng.choice(alphabet.replace("/", "")) for _ in range(rng.randint(1, 6)))
            for _ in range(rng.randint(1, 3))
        ]
        ids.add("/".join(parts))
    keys = {image_key(i): i for i in ids}
    assert len(keys) == len(ids)  # one-to-one
    for key, image_id in keys.items():
        S.check_key(key)  # webdataset-safe
        assert image_id_from_key(key) == image_id


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {
                "SLURM_ARRAY_TASK_ID": "5",
                "SLURM_ARRAY_TASK_MIN": "3",
                "SLURM_ARRAY_TASK_COUNT": "4",
                "RANK": "1",
                "WORLD_SIZE": "2",
            },
            (2, 4),
        ),
        (
            {
                "SLURM_ARRAY_TASK_ID": "4",
                "SLURM_ARRAY_TASK_MIN": "0",
                "SLURM_ARRAY_TASK_STEP": "2",
                "SLURM_ARRAY_TASK_COUNT": "3",
            },
            (2, 3),
        ),
        ({"RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),
        ({}, (0, 1)),
    ],
)
def test_default_task_from_environment(env, expected) -> None:
    assert default_task(env) == expected


def test_default_task_rejects_unmappable_array_id() -> None:
    with pytest.raises(ValueError, match="--task_index"):
        default_task({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "3"})


def test_tokens_match_plain_forward(images, reference) -> None:
    manifest = S.load_manifest(reference, verify=True)
    torch.manual_seed(0)
    model = load_backbone(BACKBONE)
    image_fpaths = sorted(p for p in images.rglob("*") if p.is_file())
    good, bad = [], []
    for fpath in image_fpaths:
        try:
            with Image.open(fpath) as image:
                good.append((fpath, image.convert("RGB")))
        except OSError:
            bad.append(fpath)
    assert len(bad) == 1
    assert [s["image_id"] for s in manifest["skipped"]] == [bad[0].relative_to(images).as_posix()]
    assert "cannot identify image file" in manifest["skipped"][0]["reason"]  # counted and listed with why
    samples = list(R.iter_shard_samples(S.shard_fpaths(reference, manifest)))
    assert manifest["n_images"] == len(samples) == len(good)
    by_id = {meta["image_id"]: (key, tokens, meta) for key, tokens, meta in samples}
    all_tokens = []
    for fpath, image in good:
        image_id = fpath.relative_to(images).as_posix()
        key, tokens, meta = by_id[image_id]
        assert image_id_from_key(key) == image_id
        assert meta["label"] == ["cat.v1", "dog"].index(image_id.split("/")[0])
        assert meta["source"] == os.path.abspath(fpath)
        assert meta["image_xxh3_64"] == xxhash.xxh3_64_hexdigest(fpath.read_bytes())  # the file's bytes, as read
        with torch.no_grad():
            expected = model(model.preprocess(image)[None])[0].numpy()
        assert tokens.dtype == np.float16 and tokens.shape == (17, 192)
        np.testing.assert_allclose(tokens.astype(np.float32), expected, rtol=2e-3, atol=2e-3)
        all_tokens.append(tokens.astype(np.float64))
    # Shards hold the sorted keys in fixed-size chunks (the corrupt image leaves a gap, not a shift).
    keys = sorted(image_key(p.relative_to(images).as_posix()) for p in image_fpaths)
    chunks = [keys[i : i + 3] for i in range(0, len(keys), 3)]
    stored = [[k for k, _, _ in R.iter_shard_samples([reference / e["fname"]])] for e in manifest["shards"]]
    bad_key = image_key(bad[0].relative_to(images).as_posix())
    assert stored == [[k for k in chunk if k != bad_key] for chunk in chunks]
    flat = np.concatenate(all_tokens)
    np.testing.assert_allclose(manifest["stats"]["mean"], flat.mean(0), rtol=1e-9, atol=1e-12)
    assert (manifest["tokens_per_image"], manifest["n_prefix_tokens"], manifest["grid"]) == (17, 1, [4, 4])
    assert manifest["backbone"]["name"] == BACKBONE and manifest["layer"] == 1


def test_tasks_together_equal_one_run(images, reference, tmp_path) -> None:
    out = tmp_path / "shards"
    n_shards = len(S.load_manifest(reference)["shards"])
    for task in range(3):
        summary = run(images, out, task_index=task, num_tasks=3, num_workers=2 if task == 1 else 0)
        assert summary["shards_written"] == list(range(task, n_shards, 3))
        assert summary["finalized"] == (task == 2) == (out / S.MANIFEST_FNAME).exists()
    assert shard_bytes(out) == shard_bytes(reference)
    assert without_time(S.load_manifest(out)) == without_time(S.load_manifest(reference))
    again = run(images, out)  # a rerun skips everything
    assert again["shards_written"] == [] and again["shards_already_complete"] == n_shards


def test_refuses_directory_of_another_extraction(images, reference, tmp_path) -> None:
    with pytest.raises(
        ValueError, match="backbone 'vit_tiny' layer 1 but this run extracts backbone 'dinov2_tiny' layer 1"
    ):
        run(images, reference, backbone="dinov2_tiny")
    with pytest.raises(ValueError, match="backbone 'vit_tiny' layer 1 .* backbone 'vit_tiny' layer 0"):
        run(images, reference, layer=0)
    with pytest.raises(ValueError, match="shard_size: 3 there, 4 now"):
        run(images, reference, shard_size=4)
    with pytest.raises(ValueError, match="seed"):
        run(images, reference, seed=1)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "shard-000000.tar").write_bytes(b"")
    with pytest.raises(ValueError, match="no extraction.json"):
        run(images, foreign)


def test_a_rerun_refuses_an_edited_extraction_json(images, reference, tmp_path, capsys) -> None:
    """An edited layer would otherwise be believed: the rerun with that layer would mix two layers' shards."""
    out = tmp_path / "shards"
    shutil.copytree(reference, out)
    fpath = out / S.EXTRACTION_FNAME
    record = json.loads(fpath.read_text())
    fpath.write_text(json.dumps(record, indent=4))  # spacing is not content: still accepted
    assert run(images, out)["shards_written"] == []
    fpath.write_text(json.dumps({**record, "layer": 0}))
    rerun = ["--backbone", BACKBONE, "--images", str(images), "--shard_size", "3", "--layer", "0", "--device", "cpu"]
    for argv in (rerun, ["finalize"]):
        assert main([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"error: {fpath} was edited after the extraction wrote it"), err
        names_fields = "fields that differ from this run's: backbone_record" in err  # it holds the layer
        assert "undo the edit" in err and names_fields == (argv == rerun)
    assert not (out / "shard-000000.tar.tmp").exists() and S.shard_is_intact(out, 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backbone", "nope"], "backbone 'nope' is unknown; choose one of .*vit_tiny"),
        (["--images", "{tmp}/missing"], "--images .*missing: does not exist"),
        (["--images", "{tmp}/empty"], "images source .*empty' holds no images"),
        (["--batch_size", "0"], "--batch_size must be an integer >= 1"),
        (
            ["--task_index", "3", "--num_tasks", "3"],
            r"--task_index must be an integer in \[0, 2\] for --num_tasks 3, got 3",
        ),
    ],
)
def test_bad_input_one_line_error(images, tmp_path, capsys, args, message) -> None:
    (tmp_path / "empty").mkdir()
    argv = [
        "--backbone",
        BACKBONE,
        "--images",
        str(images),
        "--out",
        str(tmp_path / "out"),
        "--device",
        "cpu",
        "--progress",
        "false",
    ] + [a.format(tmp=tmp_path) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ")
    assert __import__("re").search(message, err), err


def test_disk_full_keeps_complete_shards(images, reference, tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "shards"
    original_write = W._HashingWriter.write

    def failing_write(self, data: bytes) -> int:
        if self.f.name.endswith("shard-000001.tar.tmp") and self.n_bytes > 5000:  # midway through shard 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original_write(self, data)

    monkeypatch.setattr(W._HashingWriter, "write", failing_write)
    argv = [
        "--backbone",
        BACKBONE,
        "--images",
        str(images),
        "--out",
        str(out),
        "--shard_size",
        "3",
        "--batch_size",
        "2",
        "--num_workers",
        "0",
        "--device",
        "cpu",
        "--progress",
        "false",
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(
        f"error: no space left on device writing {out / 'shard-000001.tar'}; kept: the complete shards in {out} "
    )
    assert not list(out.glob("*.tmp")) and not (out / S.MANIFEST_FNAME).exists()
    assert S.shard_is_complete(out, 0) and not S.shard_is_complete(out, 1)
    kept = shard_bytes(out)  # other writer threads may have finished later shards: those are complete too
    assert "shard-000001.tar" not in kept and kept == {name: (reference / name).read_bytes() for name in kept}
    assert all(S.shard_is_complete(out, int(name[6:12])) for name in kept)
    monkeypatch.setattr(W._HashingWriter, "write", original_write)
    assert main(argv) == 0
    assert shard_bytes(out) == shard_bytes(reference)


def test_finalize_command_and_lock(images, reference, tmp_path, capsys) -> None:
    out = tmp_path / "shards"
    run(images, out, task_index=0, num_tasks=2)
    assert main(["finalize", "--out", str(out)]) == 2  # task 1's shards are missing
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "shards 1, 3 of 4 are incomplete" in err
    (out / LOCK_FNAME).touch()  # another task is finalizing: the last task leaves it the manifest
    assert run(images, out, task_index=1, num_tasks=2)["finalized"] is False
    assert not (out / S.MANIFEST_FNAME).exists()
    assert main(["finalize", "--out", str(out)]) == 1 and "--force true" in capsys.readouterr().err
    old = time.time() - 3600
    os.utime(out / LOCK_FNAME, (old, old))  # a stale lock is taken over
    assert main(["finalize", "--out", str(out)]) == 0
    assert not (out / LOCK_FNAME).exists()
    assert without_time(S.load_manifest(out, verify=True)) == without_time(S.load_manifest(reference))


def test_a_new_backbone_is_one_registry_entry(images, tmp_path, monkeypatch) -> None:
    """An entry for a model nothing else names (DeiT: CLS + distillation token) extracts as it is."""
    spec = BackboneSpec(
        "deit_tiny",
        "timm",
        "deit_tiny_distilled_patch16_224",
        None,
        2,
        (4, 4),
        64,
        64,
        2,
        dict(img_size=64, depth=2, embed_dim=64, num_heads=2),
    )
    monkeypatch.setitem(BACKBONES, "deit_tiny", spec)
    out = tmp_path / "shards"
    assert run(images, out, backbone="deit_tiny")["finalized"]
    manifest = S.load_manifest(out, verify=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the extraction's seed: the same random weights, so the same weights_sha256
        assert manifest["backbone"] == load_backbone("deit_tiny").to_json()
    assert (manifest["tokens_per_image"], manifest["n_prefix_tokens"], manifest["grid"]) == (18, 2, [4, 4])
    _, tokens, _ = next(R.iter_shard_samples(S.shard_fpaths(out, manifest)))
    assert tokens.shape == (18, 64)


def test_configs_parse() -> None:
    """Every registry entry with configs has ``extract_<name>.yaml`` writing ``shards/<name>`` (what its
    training configs read, tests/test_configs.py); the only other one is the demo's."""
    parser = build_parser()
    configs = {}
    for fpath in sorted((REPO_DPATH / "configs").glob("extract_*.yaml")):
        config = parser.parse_args(["--config", str(fpath)])
        assert config.backbone in BACKBONES, fpath
        assert config.shard_size >= 1 and config.batch_size >= 1
        configs[fpath.stem.removeprefix("extract_")] = config
    with_configs = {name for name, spec in BACKBONES.items() if spec.has_configs}
    assert set(configs) == with_configs | {"demo"}
    for name in with_configs:
        assert (configs[name].backbone, configs[name].out, configs[name].pretrained) == (name, f"shards/{name}", True)


def test_help_lists_every_option(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for flag in (
        "--config",
        "--backbone",
        "--images",
        "--out",
        "--pretrained",
        "--checkpoint_path",
        "--layer",
        "--batch_size",
        "--shard_size",
        "--num_workers",
        "--device",
        "--task_index",
        "--num_tasks",
        "finalize",
    ):
        assert flag in text, flag


@pytest.mark.slow
def test_resume_after_sigkill(tmp_path) -> None:
    """SIGKILL mid-run, rerun: the shard set equals an uninterrupted run's, byte for byte."""
    images = make_folder(tmp_path / "images", n_per_class=20, size=160)
    out = tmp_path / "shards"
    command = [
        sys.executable,
        "-m",
        "feature_extraction",
        "--backbone",
        BACKBONE,
        "--images",
        str(images),
        "--out",
        str(out),
        "--shard_size",
        "2",
        "--batch_size",
        "2",
        "--num_workers",
        "0",
        "--device",
        "cpu",
        "--progress",
        "false",
    ]
    process = subprocess.Popen(command, cwd=REPO_DPATH, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (out / "shard-000000.tar").exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    writers = child_pids(process.pid)
    process.send_signal(signal.SIGKILL)
    _, stderr = process.communicate()
    assert process.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    deadline = time.time() + 10  # the shard-writer processes die with their parent, leaving no writer behind
    while any(map(is_running, writers)) and time.time() < deadline:
        time.sleep(0.05)
    assert writers and time.time() < deadline
    n_shards = 21  # 40 photos and a corrupt file, 2 per shard
    complete = [i for i in range(n_shards) if S.shard_is_complete(out, i)]
    assert len(complete) < n_shards and not (out / S.MANIFEST_FNAME).exists()  # really interrupted

    summary = run(images, out, shard_size=2)
    assert summary["shards_already_complete"] == len(complete) and summary["finalized"]
    reference = tmp_path / "reference"
    run(images, reference, shard_size=2)
    assert not list(out.glob("*.tmp"))
    assert shard_bytes(out) == shard_bytes(reference)
    manifest, expected = S.load_manifest(out, verify=True), S.load_manifest(reference)
    assert without_time(manifest) == without_time(expected)
    assert len(manifest["skipped"]) == 1 and manifest["n_images"] == 40
    digest = hashlib.sha256(b"".join(shard_bytes(out).values())).hexdigest()
    assert digest == hashlib.sha256(b"".join(shard_bytes(reference).values())).hexdigest()
