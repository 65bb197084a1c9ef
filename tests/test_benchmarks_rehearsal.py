"""``python -m benchmarks.rehearsal --quick``: every stage as a real process, the ``kill -9`` of ``fit`` and its
resume counted batch by batch and token by token; and the audit's check failing on a repeated batch.
(The quick run starts eight ``python -m`` processes: slow.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.rehearsal.audit import check_resume

REPO_DPATH = Path(__file__).resolve().parents[1]
STAGES = [
    "shards",
    "fit, killed (kill -9)",
    "fit, resumed (--ckpt_path last)",
    "features mpsae",
    "export",
    "evaluate sae mpsae",
    "predict mpsae",
]


@pytest.mark.slow
def test_quick_rehearsal_counts_every_batch_across_the_kill(tmp_path: Path) -> None:
    out = tmp_path / "rehearsal"
    paths = [str(REPO_DPATH), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.rehearsal", "--out", str(out), "--quick"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resume check: passed" in done.stdout
    table = [line.split("|")[1].strip() for line in done.stdout.splitlines() if line.startswith("| ")]
    assert table[2:] == [*STAGES, "**total**"], done.stdout
    results = json.loads((out / "rehearsal.json").read_text())
    count = results["resume"]
    assert count["failures"] == []
    # the kill landed between two checkpoints: some batches were trained, lost and trained again
    assert count["killed_run_batches"] - 1 > count["checkpoint_step"] > 0
    assert count["epoch_batches"] == count["expected_batches"] == results["n_batches"] == count["final_global_step"]
    assert count["checkpoint_step"] + count["resumed_run_batches"] == results["n_batches"]
    assert count["tokens_trained"] == results["n_batches"] * results["size"]["batch_size"]
    assert count["tokens_repeated"] == count["tokens_foreign"] == 0 and count["replay_equal"]
    assert 0 <= count["tokens_left_out"] < results["size"]["batch_size"]
    assert all(r["wall_s"] > 0 and r["peak_rss_mib"] > 0 and r["disk_bytes"] > 0 for r in results["rows"])
    assert (out / "predict" / "codes.h5").is_file() and (out / "features" / "mpsae" / "index.html").is_file()


def _audit(fpath: Path, steps: list[int], batches: list[np.ndarray]) -> None:
    with open(fpath, "wb") as f:
        for step, hashes in zip(steps, batches):
            f.write(np.array([step, len(hashes)], np.uint64).tobytes() + hashes.astype(np.uint64).tobytes())


def test_the_audit_finds_a_repeated_batch_and_a_lost_one(tmp_path: Path) -> None:
    train = np.arange(1, 41, dtype=np.uint64)  # 40 tokens, batches of 4: 10 steps
    batches = [train[i : i + 4] for i in range(0, 40, 4)]
    _audit(tmp_path / "killed.bin", list(range(6)), batches[:6])  # checkpoint at 4, killed at step 5
    _audit(tmp_path / "resumed.bin", list(range(4, 10)), batches[4:])
    good = check_resume(tmp_path / "killed.bin", tmp_path / "resumed.bin", 4, 10, 4, train)
    assert good["failures"] == [] and good["redone_after_kill"] == 2 and good["tokens_left_out"] == 0
    # a loader that resumed one batch early: batch 3 trained twice, batch 9 never
    _audit(tmp_path / "resumed.bin", list(range(4, 10)), batches[3:9])
    bad = check_resume(tmp_path / "killed.bin", tmp_path / "resumed.bin", 4, 10, 4, train)
    assert bad["tokens_repeated"] == 4 and bad["tokens_left_out"] == 4 and not bad["replay_equal"]
    assert any("twice" in f for f in bad["failures"]) and any("never trained on" in f for f in bad["failures"])
    # a record cut by the kill is dropped, not misread
    with open(tmp_path / "killed.bin", "ab") as f:
        f.write(np.array([6, 4, 99], np.uint64).tobytes())
    assert check_resume(tmp_path / "killed.bin", tmp_path / "resumed.bin", 4, 10, 4, train)["killed_run_batches"] == 6
