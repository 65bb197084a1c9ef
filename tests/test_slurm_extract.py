"""slurm/extract.sh: its arguments, and a real 2-task SLURM array job against a single-process run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import system_tools
import torch
from slurm_cluster import EXECUTABLES, INSTALL_HINT, SlurmCluster

from feature_extraction import shards as S
from feature_extraction.extract import extract

REPO_DPATH = Path(__file__).resolve().parents[1]
SCRIPT = REPO_DPATH / "slurm" / "extract.sh"
EXTRACT_ARGS = "--shard_size 3 --batch_size 2 --num_workers 0 --device cpu --progress false"


def test_script_without_backbone_exits_2() -> None:
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: missing backbone")


def test_script_builds_command_from_environment(tmp_path) -> None:
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')  # prints each argument on its own line
    fake_python.chmod(0o755)
    env = {
        **os.environ,
        "PYTHON": str(fake_python),
        "IMAGES": "/data/my images",
        "SHARDS_ROOT": "/out",
        "EXTRACT_ARGS": "--layer 6 --batch_size 8",
        "SLURM_CPUS_PER_TASK": "3",
    }
    result = subprocess.run(["bash", str(SCRIPT), "dinov2", "--seed", "1"], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "-m",
        "feature_extraction",
        "--backbone",
        "dinov2",
        "--images",
        "/data/my images",
        "--out",
        "/out/dinov2",
        "--pretrained",
        "true",
        "--num_workers",
        "3",
        "--layer",
        "6",
        "--batch_size",
        "8",
        "--seed",
        "1",
    ]
    defaults = subprocess.run(
        ["bash", str(SCRIPT), "clip"],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "HOME": "/home/u", "PYTHON": str(fake_python)},
    )
    args = defaults.stdout.splitlines()
    assert args[args.index("--images") + 1] == "/home/u/data/imagenet/train"
    assert args[args.index("--out") + 1] == "./shards/clip"


def test_sbatch_header_requests_a_gpu() -> None:
    header = [line for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")]
    options = dict(line.split()[1].lstrip("-").split("=", 1) for line in header)
    assert options["gres"] == "gpu:1" and options["array"] == "0-7"
    assert options["output"] == "slurm-logs/%x-%A_%a.out"


@pytest.mark.slow
@pytest.mark.parametrize(
    "subset", [{}, {"tokens_per_image": 8, "keep_prefix_tokens": False}], ids=["all_tokens", "token_subset"]
)
def test_array_job_equals_single_process_run(tmp_path, subset) -> None:
    """Each task stores the same tokens as one process would: all of them, or the same seeded subset."""
    system_tools.require(EXECUTABLES, INSTALL_HINT)
    extract_args = EXTRACT_ARGS + "".join(f" --{k} {str(v).lower()}" for k, v in subset.items())
    shards_root, logs = tmp_path / "shards", tmp_path / "logs"
    logs.mkdir()
    env = {
        "IMAGES": "samples",
        "SHARDS_ROOT": str(shards_root),
        "PYTHON": sys.executable,
        "PRETRAINED": "false",
        "EXTRACT_ARGS": extract_args,
        "OMP_NUM_THREADS": "1",
        "SBATCH_GRES": "none",
    }
    with SlurmCluster(tmp_path / "cluster") as cluster:
        # The header asks for a GPU; SBATCH_GRES=none (as docs/where-to-run.md says) drops it on this GPU-less node.
        job_id = cluster.sbatch(
            ["--array=0-1", "--cpus-per-task=1", "--mem=2G", f"--output={logs}/%x-%A_%a.out", str(SCRIPT), "vit_tiny"],
            env=env,
            cwd=REPO_DPATH,
        )
        states = cluster.wait(job_id, timeout=400)
    log_text = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(logs.glob("*.out")))
    assert sorted(states.values()) == ["COMPLETED 0:0"] * 2, f"{states}\n{log_text}"
    # Each task wrote only its strided share of the 5 shards (14 photos, 3 per shard).
    assert "task 0/2: 3 of 5 shards owned, 0 complete, 3 to write" in log_text, log_text
    assert "task 1/2: 2 of 5 shards owned, 0 complete, 2 to write" in log_text, log_text

    out = shards_root / "vit_tiny"
    manifest = S.load_manifest(out, verify=True)  # written by whichever task finished last
    reference = tmp_path / "reference"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        extract(
            "vit_tiny",
            "samples",
            str(reference),
            shard_size=3,
            batch_size=2,
            num_workers=0,
            device="cpu",
            progress=False,
            **subset,
        )  # the same settings as extract_args
    finally:
        torch.set_num_threads(threads)
    expected = S.load_manifest(reference)
    assert manifest["n_images"] == 14 and len(manifest["shards"]) == 5
    assert manifest["tokens_per_image"] == (8 if subset else 17)
    for entry in manifest["shards"]:
        assert (out / entry["fname"]).read_bytes() == (reference / entry["fname"]).read_bytes()
    drop = ("created_at",)
    assert {k: v for k, v in manifest.items() if k not in drop} == {k: v for k, v in expected.items() if k not in drop}
