"""The features pass on 2 DDP ranks (gloo, CPU, Lightning's own launcher) gives the same site as one process."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import fork_server
import numpy as np
import pytest
from features_fixtures import identity_sae, write_export, write_shards
from test_features_labels import check_site_labels

from sae_pipeline.__main__ import main


def features(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return fork_server.run([sys.executable, "-m", "sae_pipeline", "features", *args], cwd=cwd, env=env, timeout=300)


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path: Path) -> None:
    tokens, _ = write_shards(tmp_path / "shards", tmp_path / "images", n_images=13, shard_size=3)  # 5 uneven shards
    sae = write_export(identity_sae(), tmp_path / "sae")
    common = [
        "--sae",
        str(sae),
        "--data.source",
        str(tmp_path / "shards"),
        "--top",
        "3",
        "--data.batch_size",
        "8",
        "--data.num_workers",
        "1",
        "--trainer.accelerator",
        "cpu",
    ]
    assert main(["features", *common, "--out", str(tmp_path / "one"), "--trainer.devices", "1"]) == 0  # in-process
    two = features([*common, "--out", "two", "--trainer.devices", "2", "--trainer.strategy", "ddp"], tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "GLOBAL_RANK: 1" in two.stderr + two.stdout  # really two processes
    a, b = np.load(tmp_path / "one" / "features.npz"), np.load(tmp_path / "two" / "features.npz")
    # the label counts too (image 6 straddles the ranks' boundary at token 58 of 117: counted once)
    check_site_labels(tmp_path / "two", np.maximum(tokens, 0), np.arange(13) % 2, len(tokens) // 13)
    for name in a.files:
        if name == "value_sum" or (name.startswith("label_weight") and a[name].dtype.kind == "f"):  # float64 sums
            # in another order, and what is computed from them
            np.testing.assert_allclose(a[name], b[name], rtol=1e-9, equal_nan=True, err_msg=name)
        else:
            assert np.array_equal(a[name], b[name], equal_nan=a[name].dtype.kind == "f"), name  # NaN: no value
    pages = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert pages == sorted(p.relative_to(tmp_path / "two") for p in (tmp_path / "two").rglob("*") if p.is_file())
    different = [
        str(p)
        for p in pages
        if p.suffix == ".html" and not filecmp.cmp(tmp_path / "one" / p, tmp_path / "two" / p, shallow=False)
    ]
    assert different == []
