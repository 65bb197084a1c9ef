"""One line, exit 2 for bad input; 1 for runtime failures; 130 / 143 interrupted (issue 10, items 7 and 8).

Extraction, evaluate, export and the data options, as a new user gets them wrong: each case
must end with exactly one ``error:`` line naming what is wrong, the right exit status, no
traceback, and nothing already written damaged. Most run the commands' ``main`` in process
(fast); the interruption tests start real processes and send real signals.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from PIL import Image
from terminal import default_sigint

from feature_extraction import shards as S
from feature_extraction.__main__ import main as extraction_main
from feature_extraction.h5cache import FORMAT_ATTR, TOKEN_CACHE_FORMAT
from sae_pipeline.artifacts.export import export_checkpoint
from sae_pipeline.artifacts.export import main as export_main
from sae_pipeline.data.sources import open_source
from sae_pipeline.evaluate.__main__ import main as evaluate_main
from sae_pipeline.sae import TopKSAE
from sae_pipeline.sae.config import sae_config
from sae_pipeline.training.module import SAEModule

REPO_DPATH = Path(__file__).resolve().parents[1]
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
]


def unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot create files in (root ignores permissions: use sysfs then)."""
    locked = tmp_path / "locked"
    locked.mkdir(exist_ok=True)
    locked.chmod(0o555)
    probe = locked / "probe"
    try:
        probe.mkdir()
    except OSError:
        return locked
    probe.rmdir()
    if Path("/sys/kernel").is_dir():
        return Path("/sys/kernel")
    pytest.skip("running as root without a read-only directory to use")


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and " INFO " not in line and " WARNING " not in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Things of the wrong kind: an image, an .npy, a plain file, a 3-D token cache, a finished extraction."""
    root = tmp_path_factory.mktemp("inputs")
    Image.new("RGB", (8, 8)).save(root / "a.png")
    np.save(root / "x.npy", np.zeros((4, 3), np.float32))
    (root / "afile").write_text("not a directory")
    with h5py.File(root / "t3.h5", "w") as h5:
        h5.attrs[FORMAT_ATTR] = TOKEN_CACHE_FORMAT
        h5["tokens"] = np.zeros((2, 3, 4), np.float32)
    assert extraction_main([*EXTRACT, "--images", "samples", "--out", str(root / "shards")]) == 0
    return root


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--images", "{root}/a.png"], r"--images .*a\.png: is an image, not an image folder"),
        (["--images", "{root}/x.npy"], r"--images .*x\.npy: is a \.npy file, not an image folder"),
        (["--images", "{root}/missing"], r"--images .*missing: does not exist"),
        (["--out", "{root}/afile"], r"--out .*afile: is a file, not a directory"),
        (["--out", "{root}/afile/sub"], r"--out .*afile/sub: .*afile is a file, not a directory"),
        (
            ["--out", "{locked}/out"],
            r"--out .*out: .*(cannot create the directory|is not writable) \(permission denied\)",
        ),
    ],
)
def test_extraction_bad_input(files: Path, tmp_path: Path, capsys, args, message) -> None:
    values = {"root": files, "locked": unwritable_dir(tmp_path)}
    argv = [*EXTRACT, "--images", "samples", "--out", str(tmp_path / "out")] + [a.format(**values) for a in args]
    before = (files / "afile").read_text()
    assert extraction_main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert re.search(message, line), line
    assert (files / "afile").read_text() == before


def _edit_manifest(dpath: Path, **fields) -> None:
    manifest = json.loads((dpath / S.MANIFEST_FNAME).read_text())
    manifest.update(fields)
    (dpath / S.MANIFEST_FNAME).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{root}/x.npy", r"x\.npy: is a \.npy file, not a data source .*write_token_cache"),
        ("{root}/a.png", r"a\.png: is a \.png file, not a data source"),
        ("{root}/t3.h5", r"t3\.h5: dataset 'tokens' is 3-D \[2, 3, 4\], expected \[N, d\]"),
        ("{copy}/manifest.json", r"pass the shard directory \(.*\), not its manifest"),
        ("{copy}", r"field 'd' is 100 but the shards' statistics have 192 dimensions; .* finalize --out"),
        ("{nest}", r"holds no manifest\.json but its sub-directories do; pass one of them: .*nest/vit_tiny"),
    ],
)
def test_data_source_bad_input(files: Path, tmp_path: Path, source: str, message: str) -> None:
    copy, nest = tmp_path / "copy", tmp_path / "nest"
    shutil.copytree(files / "shards", copy)
    shutil.copytree(files / "shards", nest / "vit_tiny")
    _edit_manifest(copy, d=100)
    with pytest.raises(ValueError, match=message) as info:
        open_source(source.format(root=files, copy=copy, nest=nest))
    assert "\n" not in str(info.value)


def test_fit_data_source_error_is_exit_2_through_the_cli(files: Path, capsys) -> None:
    from sae_pipeline.__main__ import main as sae_main

    status = sae_main(
        [
            "fit",
            "--data.source",
            str(files / "x.npy"),
            "--model.sae.class_path",
            "TopKSAE",
            "--model.sae.init_args.d_sae",
            "8",
            "--model.sae.init_args.k",
            "2",
        ]
    )
    assert status == 2
    assert "is a .npy file, not a data source" in one_error_line(capsys.readouterr().err)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint as `fit` writes one (state dict, sae_config, input_scale), without training."""
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    module = SAEModule(TopKSAE(64, 128, k=2))  # d_in = 64: the digits (evaluate runs them)
    ckpt = {"state_dict": module.state_dict(), "sae_config": sae_config(module.sae), "input_scale": 1.0}
    torch.save(ckpt, root / "model.ckpt")
    return root / "model.ckpt"


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("{files}/afile", r"--out .*afile: is a file, not a directory"),
        ("{locked}/export", r"--out .*export: cannot create the directory \(permission denied\)"),
    ],
)
def test_export_bad_out(files: Path, checkpoint: Path, tmp_path: Path, capsys, out: str, message: str) -> None:
    target = out.format(files=files, locked=unwritable_dir(tmp_path))
    assert export_main(["--ckpt_path", str(checkpoint), "--out", target]) == 2
    assert re.search(message, one_error_line(capsys.readouterr().err))


def test_failed_export_leaves_the_previous_one_whole(checkpoint: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    out = tmp_path / "export"
    export_checkpoint(checkpoint, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    import sae_pipeline.artifacts.export_files as export_files  # writes both formats' files

    real_save = export_files.save_file

    def disk_full(tensors, fpath, metadata=None):  # noqa: ANN001
        real_save(tensors, fpath, metadata=metadata)
        with open(fpath, "r+b") as f:
            f.truncate(100)  # half a file, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_files, "save_file", disk_full)
    assert export_main(["--ckpt_path", str(checkpoint), "--out", str(out)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line == (
        f"error: no space left on device writing {out / 'sae.safetensors'}; kept: the previous export in "
        f"{out}, unchanged; free space and rerun the same command"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no temporary file left either


def test_mixed_or_damaged_exports_are_one_line(checkpoint: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "export"
    export_checkpoint(checkpoint, out)
    weights = out / "sae.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert evaluate_main(["sae", "--sae", str(out), "--data", "digits", "--out", str(tmp_path / "eval")]) == 2
    assert "sha256 differs from config.json's 'weights_sha256'" in one_error_line(capsys.readouterr().err)
    weights.write_bytes(bytes(data[:50]))
    config = json.loads((out / "config.json").read_text())
    del config["weights_sha256"]  # an export written before the hash: the safetensors reader finds it
    (out / "config.json").write_text(json.dumps(config))
    assert evaluate_main(["sae", "--sae", str(out), "--data", "digits", "--out", str(tmp_path / "eval")]) == 2
    assert "not a readable safetensors file" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("{files}/afile", r"--out .*afile: is a file, not a directory"),
        ("{files}/afile/sub", r"--out .*afile/sub: .*afile is a file"),
    ],
)
def test_evaluate_bad_out(files: Path, checkpoint: Path, tmp_path: Path, capsys, out: str, message: str) -> None:
    export_checkpoint(checkpoint, tmp_path / "export")
    target = out.format(files=files)
    assert evaluate_main(["sae", "--sae", str(tmp_path / "export"), "--data", "digits", "--out", target]) == 2
    assert re.search(message, one_error_line(capsys.readouterr().err))


def test_evaluate_unwritable_out(checkpoint: Path, tmp_path: Path, capsys) -> None:
    export_checkpoint(checkpoint, tmp_path / "export")
    target = unwritable_dir(tmp_path) / "eval"
    assert evaluate_main(["sae", "--sae", str(tmp_path / "export"), "--data", "digits", "--out", str(target)]) == 2
    assert re.search(r"--out .*eval: (cannot create|.* is not writable)", one_error_line(capsys.readouterr().err))


@pytest.fixture(scope="module")
def many_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i in range(160):
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / f"i{i:03d}.png")
    return root


@pytest.mark.slow  # two real extraction processes, ~5 s each on a quiet 2-core box
@pytest.mark.parametrize(
    ("signum", "status", "line"),
    [
        (signal.SIGINT, 130, "interrupted (Ctrl-C): finished shards are kept; rerun the same command to resume"),
        (signal.SIGTERM, 143, "terminated (SIGTERM): finished shards are kept; rerun the same command to resume"),
    ],
)
def test_interrupted_extraction_is_one_line_and_keeps_finished_shards(
    many_images: Path, tmp_path: Path, signum, status, line
) -> None:
    """The signal goes to the whole process group, as Ctrl-C in a terminal and `scancel` send it: the
    DataLoader worker and the shard writers get it too."""
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "feature_extraction",
        "--backbone",
        "vit_tiny",
        "--images",
        str(many_images),
        "--out",
        str(out),
        "--num_workers",
        "1",
        "--device",
        "cpu",
        "--shard_size",
        "8",
        "--batch_size",
        "2",
        "--progress",
        "false",
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO_DPATH)},
        preexec_fn=default_sigint,
    )
    deadline = time.monotonic() + 120
    while not (out / S.sidecar_fname(1)).exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    os.killpg(process.pid, signum)
    _, err = process.communicate(timeout=120)
    assert process.returncode == status, err
    lines = [x for x in err.splitlines() if x.strip() and " INFO " not in x]
    assert lines == [line], err
    complete = [i for i in range(20) if S.shard_is_complete(out, i)]
    assert complete[:2] == [0, 1] and all(S.shard_is_intact(out, i) for i in complete)
    assert not list(out.glob("*.tmp"))


@pytest.mark.parametrize(
    ("raise_it", "status", "line"),
    [
        (lambda: os.kill(os.getpid(), signal.SIGINT), 130, "interrupted (Ctrl-C): runs kept"),
        (lambda: os.kill(os.getpid(), signal.SIGTERM), 143, "terminated (SIGTERM): runs kept"),
        (
            lambda: open("/nonexistent-dir/x", "w"),
            1,
            "error: [Errno 2] No such file or directory: '/nonexistent-dir/x'",
        ),
        (lambda: int("x"), 2, "error: invalid literal for int() with base 10: 'x'"),
    ],
)
def test_exit_status_convention_with_real_signals(raise_it, status, line, capsys) -> None:
    """The convention evaluate, export and the extraction share (feature_extraction.exit_status)."""
    from feature_extraction.exit_status import run_command

    def work() -> None:
        raise_it()
        time.sleep(5)  # a signal is delivered before this ends
        raise AssertionError("not interrupted")

    previous = signal.getsignal(signal.SIGTERM)
    # A shell starts background jobs with SIGINT ignored (nohup, `cmd &`): give it Python's handler.
    original_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert run_command(work, interrupted="runs kept") == (status, None)
    finally:
        signal.signal(signal.SIGINT, original_sigint)
    assert [x for x in capsys.readouterr().err.splitlines() if x.strip()] == [line]
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler is put back
