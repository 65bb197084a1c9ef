"""The demo's first stage end to end: photos -> tiny random ViT -> shards -> TopK SAE through the CLIs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import types

import fork_server
import pytest

from sae_pipeline import demo_stages
from sae_pipeline.demo_report import FINAL_TAGS, SHARDS_LABEL, format_table
from sae_pipeline.demo_stages import build_feature_sites, run_shard_stage


def forked_popen(argv, *, stdout, stderr, env):
    """``subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)`` as the demo's stages call it, forked
    from the test's fork server (tests/fork_server.py): the same ``python -m`` command in a process of its own, with
    its output in the log, without a fresh interpreter's ten CPU-seconds of imports. ``MKL_NUM_THREADS`` equal to
    ``OMP_NUM_THREADS`` is what the forked child applies anyway (torch and every BLAS get ``OMP_NUM_THREADS``); any
    command the server cannot stand in for runs as the demo runs it."""
    forked_env = dict(env)
    if forked_env.get("MKL_NUM_THREADS") == forked_env.get("OMP_NUM_THREADS"):
        forked_env.pop("MKL_NUM_THREADS", None)
    server = fork_server._SERVER or (fork_server._start() if fork_server.ENABLED else None)
    if server is None or not server.accepts(argv, forked_env):
        return subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=env)
    out = stdout.fileno()
    err = out if stderr == subprocess.STDOUT else stderr.fileno()
    with open(os.devnull) as stdin:
        process = fork_server.ForkedProcess(server, argv, cwd=os.getcwd(), env=forked_env, stdio=(stdin, out, err))
    forked.append(argv[2])
    return process


def forked_run(argv, *, stdout, stderr, env):
    process = forked_popen(argv, stdout=stdout, stderr=stderr, env=env)
    return subprocess.CompletedProcess(argv, process.wait())


forked: list[str] = []  # the modules of the commands forked


@pytest.mark.slow
def test_shard_stage_end_to_end(tmp_path, monkeypatch):
    """`make demo`'s shard stage as it runs (its configs' sizes: the demo has no flags for them), each stage's
    command forked rather than started in a fresh interpreter."""
    shim = types.SimpleNamespace(Popen=forked_popen, run=forked_run, STDOUT=subprocess.STDOUT)
    monkeypatch.setattr(demo_stages, "subprocess", shim)
    forked.clear()
    metrics = run_shard_stage(tmp_path, threads=2)
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["n_images"] == 14 and manifest["n_tokens"] == 14 * manifest["tokens_per_image"]
    assert len(list((tmp_path / "shards").glob("shard-*.tar"))) > 2  # several shards: one can be held out
    assert set(metrics) == set(FINAL_TAGS)
    assert all(math.isfinite(value) for _, value in metrics.values())
    assert -1.0 < metrics["val/r2"][1] <= 1.0
    assert metrics["val/l0"][1] == pytest.approx(8.0)  # TopK, k = 8 in configs/demo_shards.yaml
    assert SHARDS_LABEL in format_table([(SHARDS_LABEL, metrics)])
    again = run_shard_stage(tmp_path, threads=2)  # a rerun resumes the complete extraction and trains afresh
    assert set(again) == set(FINAL_TAGS)
    assert all(math.isfinite(value) for _, value in again.values())
    sites = build_feature_sites(tmp_path, variants=[], with_shards=True, threads=2)  # make demo's feature browser
    assert [site.relative_to(tmp_path).as_posix() for site in sites] == ["features/demo_shards/index.html"]
    assert len(list((tmp_path / "features" / "demo_shards" / "atoms").glob("*.html"))) == 256  # d_sae of the run
    assert len(list((tmp_path / "features" / "demo_shards" / "thumbs").glob("*.jpg"))) == 14  # each photo once
    assert len(list((tmp_path / "features" / "demo_shards" / "images").glob("[0-9]*.html"))) == 14  # a page each
    # fit kept the extraction's backbone record: its export explains new images with no shards at hand
    from sae_pipeline.__main__ import main

    ckpt = sorted(tmp_path.rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)[-1]
    assert main(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "exported")]) == 0
    extraction = json.loads((tmp_path / "exported" / "config.json").read_text())["data"]["extraction"]
    assert extraction["backbone"]["name"] == "vit_tiny" and extraction["weights"]["seed"] is not None
    (tmp_path / "shards" / "manifest.json").unlink()  # explain needs the export alone
    site = tmp_path / "features" / "demo_shards"
    argv = ["features", "explain", "--sae", str(tmp_path / "exported"), "--images", "samples", "--site", str(site)]
    assert main(argv) == 0
    assert len(list((site / "explained" / "images").glob("[0-9]*.html"))) == 14
    if fork_server.ENABLED:  # extract, fit, extract (resumed), fit, features: none started a fresh interpreter
        assert forked == ["feature_extraction", "sae_pipeline"] * 2 + ["sae_pipeline"]


def test_unknown_variant_is_one_error_line_naming_the_registered_ones(tmp_path, capsys) -> None:
    from sae_pipeline.demo import main
    from sae_pipeline.sae import SAE_REGISTRY

    assert main(["--variants", "mpsae", "gated", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: "), err
    message = err
    assert "invalid choice: 'gated'" in message and all(key in message for key in SAE_REGISTRY)
    assert not (tmp_path / "out").exists()  # nothing written
