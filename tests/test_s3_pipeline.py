"""The whole pipeline on a bucket of a real S3 server (SeaweedFS): extraction -> fit -> resume -> features -> evaluate.

Nothing of the data is on a local path the commands are given: the extraction writes into
`s3://BUCKET/vit_tiny`, every later command reads it from there, and no secret reaches what they
write (config, checkpoint, export, site, results).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fork_server
import numpy as np
import pytest
import torch
from PIL import Image

from feature_extraction.__main__ import main as extract_main
from feature_extraction.store import reset

REPO_DPATH = Path(__file__).resolve().parents[1]
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def run(module: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    result = fork_server.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_extract_fit_resume_features_evaluate_from_a_bucket(s3_bucket: str, s3_env: dict, tmp_path: Path) -> None:
    reset()
    rng = np.random.default_rng(0)
    for i in range(12):
        fpath = tmp_path / "images" / f"class{i % 2}" / f"img{i:02d}.png"
        fpath.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)).save(fpath)
    url = f"s3://{s3_bucket}/vit_tiny"
    flags = ["--backbone", "vit_tiny", "--pretrained", "false", "--images", str(tmp_path / "images"), "--out", url]
    flags += ["--shard_size", "3", "--device", "cpu", "--progress", "false", "--stage", str(tmp_path / "stage")]
    assert extract_main(flags) == 0

    fit = [
        "fit",
        "--config",
        str(REPO_DPATH / "configs" / "topk_vit.yaml"),
        "--data.source",
        url,
        "--data.batch_size",
        "32",
        "--data.num_workers",
        "1",
        "--data.shuffle_buffer_tokens",
        "64",
        "--data.val_fraction",
        "0.25",
        "--model.sae.init_args.d_sae",
        "64",
        "--model.sae.init_args.k",
        "4",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "1",
        "--trainer.precision",
        "32",
        *QUIET,
    ]
    run("sae_pipeline", [*fit, "--trainer.max_steps", "3"], tmp_path)
    run("sae_pipeline", [*fit, "--trainer.max_steps", "6", "--ckpt_path", "last"], tmp_path)  # resume
    run_dpath = tmp_path / "runs" / "topk_vit" / "version_0"
    ckpt_fpath = tmp_path / "runs" / "topk_vit" / "version_1" / "checkpoints" / "last.ckpt"  # the resumed run's
    assert torch.load(ckpt_fpath, weights_only=True)["global_step"] == 6

    site = tmp_path / "site"
    run(
        "sae_pipeline", ["features", "--ckpt_path", str(ckpt_fpath), "--data.source", url, "--out", str(site)], tmp_path
    )
    assert (site / "index.html").is_file() and len(list((site / "thumbs").glob("*.jpg"))) == 12  # every image drawn
    export = tmp_path / "export"
    run("sae_pipeline", ["export", "--ckpt_path", str(ckpt_fpath), "--out", str(export)], tmp_path)
    results = tmp_path / "eval"
    run("sae_pipeline.evaluate", ["sae", "--sae", str(export), "--data", url, "--out", str(results)], tmp_path)
    r2 = json.loads((results / "results.json").read_text())["saes"]["export"]["r2"]
    assert np.isfinite(r2)

    secret = s3_env["AWS_SECRET_ACCESS_KEY"]
    written = [p for p in tmp_path.rglob("*") if p.is_file() and "images" not in p.parts and "stage" not in p.parts]
    assert written and not [p for p in written if secret.encode() in p.read_bytes()]
    assert url in (run_dpath / "config.yaml").read_text()
