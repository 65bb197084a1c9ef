"""Checkpoints written before the layout move load with today's code (issue 21, item 4).

Before the move the modules were ``sae_pipeline.module``, ``sae_pipeline.checkpointing``,
``sae_pipeline.export``, ... (now under ``sae_pipeline.training.`` and ``sae_pipeline.artifacts.``).
A real checkpoint of the old code (``fit`` at commit 73f013a) stores none of these names: its only
``sae_pipeline.*`` strings are the SAE's public class path, the same today (checked here on a fresh
checkpoint and export, so a module path that starts being stored is noticed). A saved config can
still name a moved module (LightningCLI stores a model given by class path as ``_class_path``), and
the one checkpoint reader maps it through the explicit table ``MOVED_MODULES``. Such a checkpoint is
made here without the old code, from a real one with that name rewritten to its old path, and every
command loads it; a path the table does not name is still refused, importing nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import fork_server
import pytest
import torch
from test_checkpointing import SMALL, TOPK_DIGITS, error_lines, run

from sae_pipeline.artifacts import CheckpointError, load_sae, read_checkpoint
from sae_pipeline.artifacts.checkpoint import MOVED_MODULES, current_class_path

REPO_DPATH = Path(__file__).resolve().parents[1]
OLD_MODULE_CLASS = "sae_pipeline.module.SAEModule"  # where SAEModule was before the move


def stored_strings(data: object) -> set[str]:
    """Every string a checkpoint or config holds, keys included."""
    if isinstance(data, dict):
        return {s for key, value in data.items() for s in stored_strings(key) | stored_strings(value)}
    if isinstance(data, (list, tuple)):
        return {s for value in data for s in stored_strings(value)}
    return {data} if isinstance(data, str) else set()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a real ``fit`` checkpoint (6 steps on the digits) at ``new.ckpt``, and ``old.ckpt``: the
    same with its model class stored under the pre-move module path."""
    cwd = tmp_path_factory.mktemp("old_ckpt")
    result = fork_server.run(
        [
            sys.executable,
            "-m",
            "sae_pipeline",
            "fit",
            "--config",
            TOPK_DIGITS,
            *SMALL,
            "--trainer.max_steps",
            "6",
            "--trainer.default_root_dir",
            "runs",
        ],
        cwd=cwd,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    fpath = cwd / "runs" / "topk_digits" / "version_0" / "checkpoints" / "last.ckpt"
    (cwd / "new.ckpt").write_bytes(fpath.read_bytes())
    checkpoint = torch.load(fpath, map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"]["_class_path"] = OLD_MODULE_CLASS
    torch.save(checkpoint, cwd / "old.ckpt")
    return cwd


def test_a_checkpoint_and_an_export_store_no_module_path_that_can_move(trained: Path) -> None:
    from sae_pipeline.artifacts import export_checkpoint

    checkpoint = torch.load(trained / "new.ckpt", map_location="cpu", weights_only=True)
    names = {s for s in stored_strings(checkpoint) if s.startswith("sae_pipeline.")}
    assert names == {"sae_pipeline.sae.TopKSAE"}  # the public class path, resolved through the registry
    assert not any(key.startswith("sae_pipeline.") for key in checkpoint["callbacks"])  # keyed by class name
    config = json.loads((export_checkpoint(trained / "new.ckpt", trained / "export") / "config.json").read_text())
    assert {s for s in stored_strings(config) if s.startswith("sae_pipeline.")} == {
        "sae_pipeline.sae.TopKSAE",
        "sae_pipeline.export/1",
    }  # the class path and the format's name, as before


def test_moved_modules_map_to_modules_that_exist() -> None:
    assert current_class_path(OLD_MODULE_CLASS) == "sae_pipeline.training.module.SAEModule"
    assert (
        current_class_path("sae_pipeline.export.export_checkpoint") == "sae_pipeline.artifacts.export.export_checkpoint"
    )
    assert current_class_path("sae_pipeline.sae.TopKSAE") == "sae_pipeline.sae.TopKSAE"
    for old, new in MOVED_MODULES.items():
        assert (REPO_DPATH / (new.replace(".", "/") + ".py")).is_file(), new
        assert not (REPO_DPATH / (old.replace(".", "/") + ".py")).exists(), old
    assert "sae_pipeline.module" not in sys.modules  # nothing is created under the old name


def test_the_reader_rewrites_the_old_path(trained: Path) -> None:
    checkpoint = read_checkpoint(trained / "old.ckpt")
    assert checkpoint["hyper_parameters"]["_class_path"] == "sae_pipeline.training.module.SAEModule"


@pytest.mark.slow
@pytest.mark.parametrize("command", ["validate", "fit", "export", "export saelens", "features", "predict"])
def test_every_command_loads_a_checkpoint_naming_moved_modules(
    command: str, trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ckpt = str(trained / "old.ckpt")
    args = {
        "validate": ["validate", "--config", TOPK_DIGITS, *SMALL, "--ckpt_path", ckpt],
        "predict": ["predict", "--config", TOPK_DIGITS, *SMALL, "--ckpt_path", ckpt, "--codes.fpath", "codes.h5"],
        "fit": [
            "fit",
            "--config",
            TOPK_DIGITS,
            *SMALL,
            "--trainer.max_steps",
            "6",
            "--trainer.default_root_dir",
            "resumed",
            "--ckpt_path",
            ckpt,
        ],
        "export": ["export", "--ckpt_path", ckpt, "--out", "native"],
        "export saelens": ["export", "--ckpt_path", ckpt, "--out", "saelens", "--format", "saelens"],
        "features": [
            "features",
            "--ckpt_path",
            ckpt,
            "--data.source",
            "digits",
            "--out",
            "site",
            "--atoms",
            "0",
            "1",
            "--top",
            "2",
        ],
    }[command]
    status, out, err = run(args, capsys)
    assert status == 0, err[-3000:]
    if command == "fit":  # Lightning restored the training state (a new run would train its 6 steps)
        assert f"Nothing to train: {ckpt} is already at global step 6 (--trainer.max_steps 6)" in out, out[-2000:]
    if command.startswith("export"):
        sae = load_sae(tmp_path / ("native" if command == "export" else "saelens"))
        reference = load_sae_from(trained / "new.ckpt", tmp_path / "reference")
        x = torch.rand(32, 64)
        with torch.no_grad():
            torch.testing.assert_close(sae.encode(x), reference.encode(x), rtol=1e-5, atol=1e-5)


def load_sae_from(ckpt_fpath: Path, out_dpath: Path):  # noqa: ANN201 -- SparseAutoencoder
    from sae_pipeline.artifacts import export_checkpoint

    return load_sae(export_checkpoint(ckpt_fpath, out_dpath))


def test_an_old_path_the_table_does_not_name_is_refused(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = torch.load(trained / "new.ckpt", map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"]["_class_path"] = "sae_pipeline.planted.SAEModule"
    torch.save(checkpoint, tmp_path / "planted.ckpt")
    with pytest.raises(CheckpointError, match="names module 'sae_pipeline.planted', which is not loaded"):
        read_checkpoint(tmp_path / "planted.ckpt")
    monkeypatch.chdir(tmp_path)
    status, _, err = run(["validate", "--config", TOPK_DIGITS, *SMALL, "--ckpt_path", "planted.ckpt"], capsys)
    assert status == 2 and "sae_pipeline.planted" in error_lines(err)[0], err[-2000:]
    assert "sae_pipeline.planted" not in sys.modules
