"""Shard integrity (issue 10, item 3): a corrupted shard never trains silently; reruns and finalize redo it.

A real extraction (the tiny random ViT over scikit-image's 14 photos, 4 shards) is damaged by
flipping bytes inside one sample's ``tokens.npy`` payload, keeping the file's size, which the
size-only completeness check cannot see. Checksums are compared with a plain reference: xxh3-64
of each member's bytes as ``tarfile`` reads them.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import sys
import tarfile
from pathlib import Path

import fork_server
import numpy as np
import pytest
import xxhash

from feature_extraction import shards as S
from feature_extraction.__main__ import main as extraction_main
from sae_pipeline.data.sources import ShardSource, ShardUnit

REPO_DPATH = Path(__file__).resolve().parents[1]
EXTRACT = [
    "--backbone",
    "vit_tiny",
    "--images",
    "samples",
    "--shard_size",
    "4",
    "--batch_size",
    "4",
    "--num_workers",
    "0",
    "--num_writers",
    "1",
    "--device",
    "cpu",
    "--progress",
    "false",
]


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("integrity") / "shards"
    assert extraction_main([*EXTRACT, "--out", str(out)]) == 0
    return out


@pytest.fixture()
def shards(extracted: Path, tmp_path: Path) -> Path:
    """A private copy of the extraction, to damage."""
    out = tmp_path / "shards"
    shutil.copytree(extracted, out)
    record = json.loads((out / "extraction.json").read_text())
    assert record["images"] == "samples"
    return out


def members(tar_fpath: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(tar_fpath) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]


def flip_tokens_payload(tar_fpath: Path, sample: int = 1) -> None:
    """Overwrite 8 bytes in the middle of sample ``sample``'s tokens.npy data (after its .npy header)."""
    with tarfile.open(tar_fpath) as tar:
        member = [m for m in tar if m.name.endswith(".tokens.npy")][sample]
    data = bytearray(tar_fpath.read_bytes())
    at = member.offset_data + 128 + member.size // 2
    data[at : at + 8] = np.full(4, 533.0, np.float16).tobytes()  # large but finite float16 values
    tar_fpath.write_bytes(bytes(data))


def read_all(dpath: Path, with_ids: bool = False) -> list[np.ndarray]:
    source = ShardSource(dpath)
    return [chunk.tokens for unit in source.units("all", 0.0) for chunk in unit.read(0, unit.n_tokens, with_ids)]


def test_sidecars_record_xxh3_of_every_member_as_tarfile_reads_it(extracted: Path) -> None:
    for index in range(4):
        sidecar = S.read_sidecar(extracted, index)
        tar = members(extracted / S.shard_fname(index))
        tokens = [xxhash.xxh3_64_hexdigest(data) for name, data in tar if name.endswith(".tokens.npy")]
        assert sidecar["sample_checksums"] == {"algorithm": "xxh3_64", "tokens.npy": tokens}
        assert len(tokens) == sidecar["count"]
        assert sidecar["xxh3_64"] == xxhash.xxh3_64_hexdigest((extracted / S.shard_fname(index)).read_bytes())


def test_positions_are_checksummed_and_checked(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    samples = [
        (f"img{i}", rng.standard_normal((3, 8)).astype(np.float16), {}, np.array([0, 2 + i, 4], np.int16))
        for i in range(2)
    ]
    sidecar = S.write_shard(tmp_path, 0, samples)
    tar = members(tmp_path / S.shard_fname(0))
    assert sidecar["sample_checksums"]["positions.npy"] == [
        xxhash.xxh3_64_hexdigest(data) for name, data in tar if name.endswith(".positions.npy")
    ]
    S.write_manifest(
        tmp_path,
        n_shards=1,
        spec={"name": "fake"},
        layer=0,
        tokens_per_image=3,
        n_prefix_tokens=1,
        grid=(2, 2),
        token_selection={"patches_per_image": 2, "keep_prefix_tokens": True, "seed": 0},
    )
    assert len(read_all(tmp_path, with_ids=True)) == 2
    with tarfile.open(tmp_path / S.shard_fname(0)) as tar_file:
        member = [m for m in tar_file if m.name.endswith(".positions.npy")][1]
    data = bytearray((tmp_path / S.shard_fname(0)).read_bytes())
    data[member.offset_data + member.size - 4] ^= 0x01  # position 3 -> 2 (int16, little-endian): still valid
    (tmp_path / S.shard_fname(0)).write_bytes(bytes(data))
    with pytest.raises(S.ShardFormatError, match=r"img1\.positions\.npy' does not match its checksum"):
        read_all(tmp_path, with_ids=True)


@pytest.mark.slow  # a real `fit` process, ~8 s on a quiet 2-core box
def test_flipped_payload_bytes_stop_fit_with_one_line_naming_shard_and_repair(shards: Path, tmp_path: Path) -> None:
    flip_tokens_payload(shards / S.shard_fname(1))
    assert S.shard_is_complete(shards, 1)  # same size: the old completeness test does not see it
    completed = fork_server.run(
        [
            sys.executable,
            "-m",
            "sae_pipeline",
            "fit",
            "--data.source",
            str(shards),
            "--data.batch_size",
            "16",
            "--data.val_fraction",
            "0.25",
            "--data.shuffle_buffer_tokens",
            "64",
            "--trainer.max_epochs",
            "2",
            "--trainer.accelerator",
            "cpu",
            "--trainer.logger",
            "false",
            "--trainer.enable_progress_bar",
            "false",
            "--checkpoint.dirpath",
            str(tmp_path / "ckpt"),
            "--model.sae.class_path",
            "sae_pipeline.sae.TopKSAE",
            "--model.sae.init_args.d_sae",
            "16",
            "--model.sae.init_args.k",
            "2",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert completed.returncode == 2, completed.stderr[-2000:]
    assert "Traceback" not in completed.stderr
    line = completed.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ShardFormatError:") and "shard-000001.tar" in line
    assert "does not match its checksum in shard-000001.json" in line
    assert f"python -m feature_extraction --backbone vit_tiny --images samples --out {shards}" in line


def test_stream_fails_on_the_damaged_sample_and_reads_clean_shards(shards: Path) -> None:
    clean = read_all(shards)
    flip_tokens_payload(shards / S.shard_fname(2), sample=3)
    with pytest.raises(S.ShardFormatError, match=r"shard-000002\.tar: member '.*tokens\.npy' does not match"):
        read_all(shards)
    source = ShardSource(shards)
    unit = source.units("all", 0.0)[2]
    first_three = [c.tokens for c in unit.read(0, 3 * unit.tokens_per_image)]  # before the damaged sample
    assert all(np.array_equal(a, b) for a, b in zip(first_three, clean[8:11]))
    ShardUnit.verify = False
    try:  # what main did: the damaged values reach training
        assert np.abs(np.concatenate(read_all(shards))).max() == 533.0
    finally:
        ShardUnit.verify = True


def test_extraction_rerun_redoes_the_corrupt_shard_byte_identically(
    shards: Path, extracted: Path, caplog: pytest.LogCaptureFixture
) -> None:
    flip_tokens_payload(shards / S.shard_fname(1))
    assert extraction_main([*EXTRACT, "--out", str(shards)]) == 0
    assert "shards 1: their bytes no longer match their sidecars" in caplog.text
    for index in range(4):
        assert (shards / S.shard_fname(index)).read_bytes() == (extracted / S.shard_fname(index)).read_bytes()
    assert S.load_manifest(shards, verify=True)["n_images"] == 14
    assert len(read_all(shards)) == 14


def test_finalize_refuses_a_corrupt_shard_and_its_repair_command_works(shards: Path, capsys) -> None:
    manifest_before = (shards / S.MANIFEST_FNAME).read_bytes()
    flip_tokens_payload(shards / S.shard_fname(3), sample=0)
    assert extraction_main(["finalize", "--out", str(shards)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if " INFO " not in line]
    assert len(err) == 1 and err[0].startswith("error: ") and "shard 3 no longer matches its sidecar" in err[0]
    assert (shards / S.MANIFEST_FNAME).read_bytes() == manifest_before  # nothing written over
    command = shlex.split(err[0].split("rerun `", 1)[1].split("`", 1)[0])
    assert command[:3] == ["python", "-m", "feature_extraction"]
    assert extraction_main([*command[3:], "--num_workers", "0", "--device", "cpu", "--progress", "false"]) == 0
    assert extraction_main(["finalize", "--out", str(shards)]) == 0
    assert len(read_all(shards)) == 14


def test_old_sidecars_are_checked_by_sha256_and_finalize_adds_checksums(shards: Path, extracted: Path) -> None:
    for index in range(4):
        fpath = shards / S.sidecar_fname(index)
        sidecar = json.loads(fpath.read_text())
        del sidecar["sample_checksums"], sidecar["xxh3_64"]
        fpath.write_text(json.dumps(sidecar))
    assert len(read_all(shards)) == 14  # still readable (each shard's sha256 checked once)
    flip_tokens_payload(shards / S.shard_fname(0))
    with pytest.raises(S.ShardFormatError, match=r"shard-000000\.tar: corrupt shard \(its sha256 differs"):
        read_all(shards)
    shutil.copyfile(extracted / S.shard_fname(0), shards / S.shard_fname(0))
    assert extraction_main(["finalize", "--out", str(shards)]) == 0
    for index in range(4):  # the same checksums as a fresh extraction records
        upgraded, fresh = S.read_sidecar(shards, index), S.read_sidecar(extracted, index)
        assert upgraded["sample_checksums"] == fresh["sample_checksums"]
        assert upgraded["xxh3_64"] == fresh["xxh3_64"]


def cut_and_rehash(tar_fpath: Path, keep: int) -> None:
    """Keep the tar's first ``keep`` bytes and make its sidecar match them (size, sha256, xxh3-64), as a
    writer whose tail was lost after it hashed what it wrote, or a cut copy re-hashed, would leave it."""
    data = tar_fpath.read_bytes()[:keep]
    tar_fpath.write_bytes(data)
    sidecar_fpath = tar_fpath.with_suffix(".json")
    sidecar = json.loads(sidecar_fpath.read_text())
    sidecar |= {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "xxh3_64": xxhash.xxh3_64_hexdigest(data),
    }
    sidecar_fpath.write_text(json.dumps(sidecar))


@pytest.mark.parametrize("cut", ["end", "half"])
def test_a_cut_shard_whose_sidecar_matches_names_the_rerun_that_redoes_it(
    shards: Path, extracted: Path, capsys, cut: str
) -> None:
    """The tar loses its end-of-archive marker (``end``: the reader's tail check finds it) or half its bytes
    (``half``: the manifest's sizes find it); a finalize that trusts the sidecars (``--verify false``, what
    every finalize did before) writes a manifest that agrees. The reader's line and a checking finalize name
    the same rerun, and following it restores the shard byte for byte."""
    tar_fpath = shards / S.shard_fname(1)
    data = tar_fpath.read_bytes()
    cut_and_rehash(tar_fpath, -(-len(data.rstrip(b"\0")) // 512) * 512 if cut == "end" else len(data) // 2)
    assert S.shard_is_complete(shards, 1)
    assert extraction_main(["finalize", "--out", str(shards), "--verify", "false"]) == 0
    capsys.readouterr()
    with pytest.raises(S.ShardFormatError) as caught:
        read_all(shards)
    line = str(caught.value)
    assert line.startswith(f"{tar_fpath}: ") and "\n" not in line and "re-extract" in line, line
    assert ("truncated tar" if cut == "end" else "the shard was cut short") in line
    rerun = line.split("rerun `", 1)[1].split("`", 1)[0]
    assert extraction_main(["finalize", "--out", str(shards)]) == 2  # it reads every shard: it refuses this one
    err = [line for line in capsys.readouterr().err.splitlines() if " INFO " not in line]
    assert len(err) == 1 and str(tar_fpath) in err[0] and f"rerun `{rerun}`" in err[0], err
    command = shlex.split(rerun)
    assert command[:3] == ["python", "-m", "feature_extraction"]
    assert extraction_main([*command[3:], "--num_workers", "0", "--device", "cpu", "--progress", "false"]) == 0
    assert tar_fpath.read_bytes() == (extracted / S.shard_fname(1)).read_bytes()
    assert extraction_main(["finalize", "--out", str(shards)]) == 0
    assert len(read_all(shards)) == 14
