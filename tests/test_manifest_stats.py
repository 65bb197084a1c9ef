"""The manifest's statistics are checked against the shards' sidecars when ``fit`` reads them
(reliability issue, item 7: a hand-edited ``mean_sq_norm`` trained with input scale 0.00044
instead of 1.0 and most latents dead, exit 0). feature_extraction/shards/manifest_stats.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import fork_server
import numpy as np
import pytest

from feature_extraction.shards import MANIFEST_FNAME, ShardFormatError, load_manifest
from feature_extraction.shards.manifest_stats import RTOL, sidecar_stats
from sae_pipeline.__main__ import main

REPO_DPATH = Path(__file__).resolve().parents[1]
TOPK = str(REPO_DPATH / "configs" / "topk_digits.yaml")
D = 16
FIT = [
    "fit",
    "--config",
    TOPK,
    "--model.sae.init_args.d_sae",
    "32",
    "--data.batch_size",
    "64",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
]


@pytest.fixture()
def shards(tmp_path: Path, token_shards) -> tuple[Path, np.ndarray]:
    """A finished shard directory (3 shards, tokens far from unit scale) and all its tokens, float64."""
    dpath = tmp_path / "shards"
    samples = token_shards(dpath, [8, 8, 8], D, scale=30.0, offset=2.0)
    tokens = np.concatenate([s[1] for shard in samples for s in shard]).astype(np.float64)
    return dpath, tokens


def edit_stats(dpath: Path, edit) -> bytes:
    """Apply ``edit`` to the manifest's ``stats`` (as a user with an editor would) and return the new bytes."""
    fpath = dpath / MANIFEST_FNAME
    manifest = json.loads(fpath.read_text())
    edit(manifest["stats"])
    fpath.write_text(json.dumps(manifest, indent=2))
    return fpath.read_bytes()


def test_sidecar_statistics_equal_a_plain_reference(shards: tuple[Path, np.ndarray]) -> None:
    dpath, tokens = shards
    manifest = load_manifest(dpath)  # an untouched manifest passes the check
    stats = sidecar_stats(dpath, manifest)
    assert stats.n_tokens == tokens.shape[0] == manifest["stats"]["n_tokens"]
    np.testing.assert_allclose(stats.mean(), tokens.mean(axis=0), rtol=1e-12, atol=1e-12)
    assert stats.mean_sq_norm() == pytest.approx(float((tokens**2).sum(axis=1).mean()), rel=1e-12)
    assert manifest["stats"]["mean_sq_norm"] == stats.mean_sq_norm()  # same sums, same order: exact


def _scale(factor: float):
    def edit(stats: dict) -> None:
        stats["mean_sq_norm"] *= factor

    return edit


def _shift_mean(stats: dict) -> None:
    stats["mean"][3] += 0.5


def _count(stats: dict) -> None:
    stats["n_tokens"] += 1


EDITS = {  # name: (edit, the field the error names, whether extraction.json is there)
    "mean_sq_norm raised": (_scale(5e6), "stats.mean_sq_norm", False),
    "mean_sq_norm off by 10 x the tolerance": (_scale(1 + 10 * RTOL), "stats.mean_sq_norm", True),
    "one mean dimension moved": (_shift_mean, "stats.mean", True),
    "n_tokens": (_count, "stats.n_tokens", False),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_an_edited_manifest_is_refused_naming_the_field_and_values(
    case: str,
    shards: tuple[Path, np.ndarray],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dpath, tokens = shards
    edit, field, with_record = EDITS[case]
    if with_record:
        (dpath / "extraction.json").write_text("{}")  # only its presence decides which fix is named
    written = edit_stats(dpath, edit)
    monkeypatch.chdir(tmp_path)
    try:
        status = main([*FIT, "--data.source", str(dpath)])
    except SystemExit as exit_:
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert f"{dpath / MANIFEST_FNAME}: field '{field}' is " in lines[0] and "but the shards' sidecars give" in lines[0]
    if field == "stats.mean":
        assert f"is [3] = {json.loads(written)['stats']['mean'][3]!r} but" in lines[0]
        assert float(lines[0].split("sidecars give ")[1].split(";")[0]) == pytest.approx(tokens[:, 3].mean(), rel=1e-9)
    fix = (
        f"run `python -m feature_extraction finalize --out {dpath}`"
        if with_record
        else "rewrite it with feature_extraction.shards.write_manifest"
    )
    assert fix in lines[0], lines[0]
    assert (dpath / MANIFEST_FNAME).read_bytes() == written  # the manifest is left as the user made it
    assert not (tmp_path / "runs" / "topk_digits" / "version_0").exists()


def test_a_difference_within_the_tolerance_passes(shards: tuple[Path, np.ndarray]) -> None:
    dpath, _ = shards
    edit_stats(dpath, _scale(1 + RTOL / 10))
    load_manifest(dpath)
    edit_stats(dpath, _scale(1 + 10 * RTOL))
    with pytest.raises(ShardFormatError, match="stats.mean_sq_norm"):
        load_manifest(dpath)


def test_the_command_refuses_a_hand_edited_scale(shards: tuple[Path, np.ndarray], tmp_path: Path) -> None:
    """The issue's case, through a real ``python -m sae_pipeline fit``: exit 2, nothing trained."""
    dpath, tokens = shards
    written = edit_stats(dpath, _scale(5e6))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_DPATH), os.environ.get("PYTHONPATH", "")])}
    result = fork_server.run(
        [sys.executable, "-m", "sae_pipeline", *FIT, "--data.source", str(dpath)], cwd=tmp_path, env=env, timeout=300
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    expected = float((tokens**2).sum(axis=1).mean())
    assert len(lines) == 1 and "field 'stats.mean_sq_norm' is " in lines[0], result.stderr[-3000:]
    assert float(lines[0].split("sidecars give ")[1].split(";")[0]) == pytest.approx(expected, rel=1e-12)
    assert (dpath / MANIFEST_FNAME).read_bytes() == written
    assert not list(tmp_path.rglob("*.ckpt"))
