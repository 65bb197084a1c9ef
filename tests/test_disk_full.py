"""A full disk is one line, exit 1, and keeps what was there (reliability issue, items 3, 4 and 9).

Every command is run for real (``python -m sae_pipeline ...`` in a subprocess) with its output on a
small tmpfs that a filler file has left almost full; the previous artifact there (checkpoint,
export, site) must come out byte for byte unchanged and no temporary or partial file may be left.
Mounting needs root: these tests skip otherwise (and fail with SAE_PIPELINE_REQUIRE_SYSTEM_TOOLS=1).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import fork_server
import pytest
import system_tools
import torch
from features_fixtures import identity_sae, write_export, write_shards
from in_process import QUIET

from sae_pipeline.artifacts.checkpoint import read_checkpoint
from sae_pipeline.sae import TopKSAE
from sae_pipeline.sae.config import sae_config
from sae_pipeline.training.module import SAEModule

REPO_DPATH = Path(__file__).resolve().parents[1]
TOPK_DIGITS = str(REPO_DPATH / "configs" / "topk_digits.yaml")
SMALL_FIT = ["--config", TOPK_DIGITS, "--model.sae.init_args.d_sae", "128", *QUIET, "--trainer.max_steps", "2"]
FEATURES = ["--top", "4", "--data.batch_size", "16", "--data.num_workers", "0", "--trainer.accelerator", "cpu"]
EXTRACT = [
    "--backbone",
    "vit_tiny",
    "--num_workers",
    "0",
    "--device",
    "cpu",
    "--progress",
    "false",
    "--shard_size",
    "4",
    "--images",
    "samples",
]
FILLER = "filler"
DISK_FULL = "error: no space left on device writing "


def _refuse(message: str) -> None:
    """Skip, or fail where CI requires every system test to run."""
    if os.environ.get(system_tools.REQUIRE_ENV) == "1":
        pytest.fail(f"{message} ({system_tools.REQUIRE_ENV}=1: CI must not skip this)")
    pytest.skip(message)


@contextmanager
def tmpfs(dpath: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on ``dpath`` for the block (root only)."""
    system_tools.require_root("mounts a small tmpfs (mount -t tmpfs) to fill it")
    system_tools.require(["mount", "umount"], "apt-get install mount")
    dpath.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(dpath)], capture_output=True, text=True
    )
    if result.returncode != 0:
        _refuse(f"mount -t tmpfs failed (a container without CAP_SYS_ADMIN?): {result.stderr.strip()}")
    try:
        yield dpath
    finally:
        subprocess.run(["umount", "-l", str(dpath)], check=True)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "disk", "8m") as dpath:
        yield dpath


def fill(dpath: Path, leave: int) -> None:
    """Leave ``leave`` bytes free on ``dpath``'s file system."""
    stat = os.statvfs(dpath)
    free = stat.f_bavail * stat.f_frsize
    with open(dpath / FILLER, "wb") as f:
        f.truncate(0)
        f.write(b"\0" * max(free - leave, 0))


def sae_pipeline(*args: str, cwd: Path | None = None, umask: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_DPATH), "PYTHONWARNINGS": "ignore"}
    env.pop("SAE_PIPELINE_TRACEBACK", None)
    return fork_server.run(
        [sys.executable, "-m", "sae_pipeline", *args], cwd=cwd or REPO_DPATH, env=env, timeout=600, umask=umask
    )


def features(features_data: dict, out: str, **kwargs) -> subprocess.CompletedProcess:
    """``python -m sae_pipeline features`` of the small SAE over the small shards into ``out``."""
    data = ["--sae", str(features_data["sae"]), "--data.source", str(features_data["shards"])]
    return sae_pipeline("features", *data, *FEATURES, "--out", out, **kwargs)


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def snapshot(dpath: Path) -> dict[str, bytes]:
    """Every file under ``dpath`` but the filler, with its bytes (hidden temporary files included)."""
    return {
        str(p.relative_to(dpath)): p.read_bytes() for p in sorted(dpath.rglob("*")) if p.is_file() and p.name != FILLER
    }


def leftovers(dpath: Path) -> list[str]:
    return [str(p.relative_to(dpath)) for p in dpath.rglob("*") if ".tmp" in p.name or ".partial" in p.name]


def write_checkpoint(fpath: Path, d_sae: int) -> Path:
    """A checkpoint as `fit` writes one (weights, sae_config, input_scale), without training."""
    torch.manual_seed(0)
    module = SAEModule(TopKSAE(64, d_sae, k=2))
    fpath.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": module.state_dict(), "sae_config": sae_config(module.sae), "input_scale": 1.0}, fpath)
    return fpath


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real fit's last.ckpt (resumable), outside any small disk."""
    root = tmp_path_factory.mktemp("trained")
    result = sae_pipeline("fit", *SMALL_FIT, "--trainer.default_root_dir", str(root))
    assert result.returncode == 0, result.stderr[-3000:]
    return next(root.rglob("last.ckpt"))


@pytest.fixture(scope="module")
def features_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("features")
    write_shards(root / "shards", root / "images")
    return {"shards": root / "shards", "sae": write_export(identity_sae(), root / "sae")}


# --- each command on a full disk: (prepare the previous artifact, the command), given the disk -------------------
def _fit(disk: Path, trained: Path, data: dict) -> tuple[list[str], int]:
    previous = disk / "topk_digits" / "version_0" / "checkpoints"
    previous.mkdir(parents=True)
    (previous / "last.ckpt").write_bytes(trained.read_bytes())
    return ["fit", *SMALL_FIT, "--trainer.default_root_dir", str(disk)], 100_000  # room for logs, not a checkpoint


def _fit_resumed(disk: Path, trained: Path, data: dict) -> tuple[list[str], int]:
    args, leave = _fit(disk, trained, data)
    return [*args, "--ckpt_path", "last", "--trainer.max_steps", "4"], leave


def _fit_over_last(disk: Path, trained: Path, data: dict) -> tuple[list[str], int]:
    (disk / "ckpts").mkdir()
    (disk / "ckpts" / "last.ckpt").write_bytes(trained.read_bytes())
    return [
        "fit",
        *SMALL_FIT,
        "--checkpoint.dirpath",
        str(disk / "ckpts"),
        "--trainer.default_root_dir",
        str(data["root"]),
    ], 100_000


def _predict(disk: Path, trained: Path, data: dict) -> tuple[list[str], int]:
    return [
        "predict",
        *SMALL_FIT,
        "--ckpt_path",
        str(trained),
        "--codes.fpath",
        str(disk / "codes" / "codes.h5"),
        "--trainer.default_root_dir",
        str(data["root"]),
    ], 60_000


def _export(disk: Path, trained: Path, data: dict) -> tuple[list[str], int]:
    small = write_checkpoint(data["root"] / "small.ckpt", 128)
    result = sae_pipeline("export", "--ckpt_path", str(small), "--out", str(disk / "export"))
    assert result.returncode == 0, result.stderr[-3000:]
    big = write_checkpoint(data["root"] / "big.ckpt", 1024)
    return ["export", "--ckpt_path", str(big), "--out", str(disk / "export")], 100_000


def _features(disk: Path, trained: Path, data: dict) -> tuple[list[str], int]:
    args = [
        "features",
        "--sae",
        str(data["sae"]),
        "--data.source",
        str(data["shards"]),
        *FEATURES,
        "--out",
        str(disk / "site"),
    ]
    result = sae_pipeline(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    return args, 20_000


def _extract(disk: Path, trained: Path, data: dict) -> tuple[list[str], int]:
    return ["extract", *EXTRACT, "--out", str(disk / "shards")], 8_000


def _evaluate(disk: Path, trained: Path, data: dict) -> tuple[list[str], int]:
    small = write_checkpoint(data["root"] / "small.ckpt", 128)
    result = sae_pipeline("export", "--ckpt_path", str(small), "--out", str(data["root"] / "export"))
    assert result.returncode == 0, result.stderr[-3000:]
    return [
        "evaluate",
        "sae",
        "--sae",
        str(data["root"] / "export"),
        "--data",
        "digits",
        "--out",
        str(disk / "eval"),
    ], 4_000


def _evaluate_study(disk: Path, trained: Path, data: dict) -> tuple[list[str], int]:
    return [
        "evaluate",
        "inference",
        "--variants",
        "topk",
        "--k",
        "5",
        "--p",
        "128",
        "--p_main",
        "128",
        "--k_main",
        "5",
        "--max_steps",
        "2",
        "--sae_seeds",
        "1",  # one run, trained alone: the line names its checkpoint folder
        "--out",
        str(disk / "eval"),
    ], 150_000  # fits the run's logs, not its checkpoint


CASES: dict[str, tuple[Callable, str]] = {  # command -> (set-up, what the line must say was kept)
    "fit": (_fit, "kept: no checkpoint in {disk}/topk_digits/version_1/checkpoints yet"),
    "fit --ckpt_path last": (_fit_resumed, "kept: no checkpoint in {disk}/topk_digits/version_1/checkpoints yet"),
    "fit over a previous last.ckpt": (
        _fit_over_last,
        "kept: the checkpoints already in {disk}/ckpts (last.ckpt), "
        "unchanged (fit --ckpt_path last resumes from the newest)",
    ),
    "predict": (_predict, "kept: no codes file (the partial codes.h5.tmp was removed)"),
    "export over a previous export": (_export, "kept: the previous export in {disk}/export, unchanged"),
    "features over a previous site": (_features, "kept: the previous site in {disk}/site, unchanged"),
    "extract": (_extract, "kept: the complete shards in {disk}/shards"),
    "evaluate": (_evaluate, "kept: the finished runs in {disk}/eval"),
    "evaluate study": (_evaluate_study, "kept: no checkpoint in {disk}/eval/runs/topk_p128_k5/checkpoints yet"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_full_disk_is_one_line_and_keeps_what_was_there(
    case: str, disk: Path, trained: Path, features_data, tmp_path: Path
) -> None:
    prepare, kept = CASES[case]
    data = {**features_data, "root": tmp_path / "work"}
    data["root"].mkdir()
    args, leave = prepare(disk, trained, data)
    before = snapshot(disk)
    fill(disk, leave)
    result = sae_pipeline(*args)
    line = one_error_line(result.stderr)
    assert result.returncode == 1, result.stderr[-3000:]
    assert line.startswith(DISK_FULL) and kept.format(disk=disk) in line, line
    assert line.endswith("; free space and rerun the same command"), line
    assert leftovers(disk) == []
    after = snapshot(disk)
    assert {name: after.get(name) for name in before} == before  # everything that was there, unchanged


@pytest.mark.slow
def test_a_full_disk_at_last_ckpt_names_the_periodic_checkpoint_it_kept(disk: Path, trained: Path) -> None:
    """Issue 31, item 13: room for the step's periodic checkpoint but not for its last.ckpt. The line advised
    `--ckpt_path last`, which finds only last*.ckpt, so nothing: it must name the file kept."""
    fill(disk, 100_000 + trained.stat().st_size * 3 // 2)  # the logs and one checkpoint, not two
    result = sae_pipeline(
        "fit", *SMALL_FIT, "--checkpoint.every_n_train_steps", "2", "--trainer.default_root_dir", str(disk)
    )
    assert result.returncode == 1, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    (kept,) = (disk / "topk_digits" / "version_0" / "checkpoints").glob("*.ckpt")
    assert kept.name != "last.ckpt" and f"(fit --ckpt_path {kept} resumes from the newest)" in line, line
    assert read_checkpoint(kept, for_fit=True)["global_step"] == 2  # what fit --ckpt_path checks, whole
    assert leftovers(disk) == []


def test_codes_writer_stops_before_hdf5_fails(disk: Path) -> None:
    """Chunks of incompressible codes until the disk is full: one DiskFullError, no crash, no temporary file."""
    script = f"""
import numpy as np
from feature_extraction.atomic_files import DiskFullError
from sae_pipeline.artifacts.codes import CodesWriter
rng = np.random.default_rng(0)
try:
    with CodesWriter({str(disk / "codes.h5")!r}, d_sae=1 << 20) as writer:
        for _ in range(1000):
            n = 4096
            writer.write([f"img{{i}}" for i in range(n)], np.arange(n), rng.integers(0, 1 << 20, (n, 32)),
                         rng.standard_normal((n, 32)).astype(np.float32))
except DiskFullError as exn:
    print("DiskFullError", exn)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO_DPATH)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]  # a segmentation fault would be -11
    assert result.stdout.startswith(f"DiskFullError no space left on device writing {disk / 'codes.h5'} ("), (
        result.stdout
    )
    assert sorted(p.name for p in disk.iterdir()) == []


# --- item 4: features' --out checked before the pass ------------------------------------------------------------
@pytest.mark.slow
def test_features_out_on_a_read_only_file_system_is_exit_2_before_the_pass(tmp_path: Path, features_data) -> None:
    with tmpfs(tmp_path / "ro", "64k", read_only=True) as read_only:
        result = features(features_data, str(read_only / "site"))
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert f"--out {read_only / 'site'}: its folder {read_only} cannot be written" in line, line
    assert "GPU available" not in result.stderr + result.stdout  # the Trainer of the pass was never built


@pytest.mark.slow
def test_features_out_on_a_mount_point_is_exit_2_before_the_pass(disk: Path, features_data) -> None:
    result = features(features_data, str(disk))
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert f"--out {disk}: is a mount point" in line and f"--out {disk / 'site'}" in line, line
    assert "GPU available" not in result.stderr + result.stdout
    assert list(disk.iterdir()) == []


@pytest.mark.slow
def test_a_killed_features_partial_folder_is_removed_by_the_rerun(tmp_path: Path, features_data) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".site.partial-{dead.pid}"
    (stale / "atoms").mkdir(parents=True)
    (stale / "atoms" / "0.html").write_text("half")
    other = tmp_path / f".other.partial-{dead.pid}"  # another site's: not ours to remove
    other.mkdir()
    result = features(features_data, str(tmp_path / "site"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name, "site"]


# --- item 9: a bad --layer leaves no folder; exports follow the umask ---------------------------------------------
def test_bad_layer_leaves_no_output_folder(tmp_path: Path) -> None:
    result = sae_pipeline("extract", *EXTRACT, "--layer", "99", "--out", str(tmp_path / "shards"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "layer 99 is out of range" in one_error_line(result.stderr)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("umask", "mode", "export_format"), [(0o022, 0o644, "native"), (0o077, 0o600, "saelens")])
def test_exported_files_follow_the_umask(tmp_path: Path, umask: int, mode: int, export_format: str) -> None:
    ckpt = write_checkpoint(tmp_path / "model.ckpt", 128)
    result = sae_pipeline(
        "export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "export"), "--format", export_format, umask=umask
    )
    assert result.returncode == 0, result.stderr[-3000:]
    files = sorted((tmp_path / "export").iterdir())
    assert len(files) == 2 and {oct(p.stat().st_mode & 0o777) for p in files} == {oct(mode)}


def test_stale_folders_of_dead_runs_are_removed_and_a_swapped_out_site_put_back(tmp_path: Path) -> None:
    from sae_pipeline.features.site_dir import MARKER_FNAME, remove_stale_partials

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = tmp_path / f".site.old-{dead.pid}"  # killed between moving the old site away and moving the new one in
    old.mkdir()
    (old / MARKER_FNAME).write_text("{}")
    (tmp_path / f".site.partial-{dead.pid}").mkdir()
    running = tmp_path / f".site.partial-{os.getppid()}"  # a build still running (our parent is alive)
    running.mkdir()
    assert remove_stale_partials(tmp_path / "site") == [tmp_path / f".site.partial-{dead.pid}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [running.name, "site"]
    assert (tmp_path / "site" / MARKER_FNAME).read_text() == "{}"
