"""A group's artifacts met by the commands (issue 31, items 2 and 16): member names read from a checkpoint
are the config's names (a name that leaves ``--out`` is refused before anything is written), the folder
``export`` fills with a group's members is named as such by ``--sae``, and a group fit with periodic
checkpoints prints no advice meant for other manual-optimisation code. Checkpoints are made by hand, as
a stranger could, so no test trains more than a few steps."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from features_fixtures import write_export
from in_process import QUIET, error_lines, run
from test_group_cli import MEMBERS, in_dir, write_config

from sae_pipeline.artifacts import CheckpointError, load_sae, read_checkpoint
from sae_pipeline.sae import TopKSAE
from sae_pipeline.sae.config import sae_config
from sae_pipeline.training.group import member_entry

# names that leave the folder they are joined to, or carry a newline into a folder name
BAD_NAMES = ["../../x", "/abs/x", "abc\n", "a/b", "..", ".hidden"]


def group_checkpoint(fpath: Path, names: list[str]) -> Path:
    """A group's checkpoint as ``fit`` writes one (``sae_group`` + ``members.<name>.`` weights), one TopK per name."""
    torch.manual_seed(0)
    state, group = {}, {}
    for name in names:
        sae = TopKSAE(8, 16, k=2)
        state.update({f"members.{name}.sae.{key}": value for key, value in sae.state_dict().items()})
        group[name] = {"sae_config": sae_config(sae), "input_scale": 1.0, "hyper_parameters": {}}
    torch.save({"state_dict": state, "sae_group": group}, fpath)
    return fpath


def files_under(dpath: Path) -> list[str]:
    return sorted(str(path.relative_to(dpath)) for path in dpath.rglob("*"))


@pytest.mark.parametrize("fmt", ["native", "saelens"])
@pytest.mark.parametrize("name", BAD_NAMES)
def test_export_refuses_member_names_that_are_no_folder_name(
    name: str, fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = str(tmp_path / "abs" / "x") if name == "/abs/x" else name
    ckpt = group_checkpoint(tmp_path / "group.ckpt", ["good", name])
    out = tmp_path / "deep" / "er" / "out"
    status, _, err = run(["export", "--ckpt_path", str(ckpt), "--out", str(out), "--format", fmt], capsys)
    lines = error_lines(err)
    assert status == 2 and len(lines) == 1, err
    assert f"its group names a member {name!r}" in lines[0] and "must start with a letter or digit" in lines[0]
    assert files_under(tmp_path) == ["group.ckpt"]  # nothing written, inside --out or outside it


def test_every_reader_of_a_group_checkpoint_checks_its_names(tmp_path: Path) -> None:
    """``--name`` of a good member does not make a checkpoint with a bad one acceptable (features, predict)."""
    ckpt = group_checkpoint(tmp_path / "group.ckpt", ["good", "abc\n"])
    for kwargs in ({}, {"name": "good"}, {"name": "good", "need": ("input_scale",)}):
        with pytest.raises(CheckpointError, match="its group names a member 'abc\\\\n'"):
            read_checkpoint(ckpt, **kwargs)
    good = read_checkpoint(group_checkpoint(tmp_path / "ok.ckpt", ["a.b=1", "topk_k10"]), name="topk_k10")
    assert good["member"] == "topk_k10"


def test_a_config_member_name_with_a_trailing_newline_is_refused() -> None:
    """The config's rule, matched whole: ``^...$`` with ``re.match`` let ``"abc\\n"`` through."""
    entry = {"sae": {"class_path": "TopKSAE", "init_args": {"d_sae": 8, "k": 2}}}
    with pytest.raises(ValueError, match="model.members: name 'abc\\\\n' must start with a letter or digit"):
        member_entry("abc\n", entry, 4)
    assert member_entry("abc", entry, 4)[0]["init_args"]["d_in"] == 4


def test_evaluate_on_a_group_exports_folder_names_the_members(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sae_pipeline.evaluate.__main__ import main as evaluate_main

    parent = tmp_path / "all"
    for name in ("topk", "jump"):
        write_export(TopKSAE(64, 32, k=2), parent / name)
    out = tmp_path / "eval"
    assert evaluate_main(["sae", "--sae", str(parent), "--data", "digits", "--out", str(out)]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and f"{parent}: holds no export but 2 in its folders jump, topk" in lines[0], lines
    assert f"pass one of them, e.g. {parent / 'jump'}" in lines[0] and "config.json" not in lines[0]
    assert not out.exists() and load_sae(parent / "topk").d_sae == 32  # a member's folder is what to pass


def test_a_group_fit_with_periodic_checkpoints_prints_no_manual_optimisation_advice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, MEMBERS)
    args = ["fit", "--config", str(config), "--trainer.max_steps", "2", "--checkpoint.every_n_train_steps", "1"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # what a user's terminal shows: every warning, every time
        status, _, err = in_dir(tmp_path, [*args, "--trainer.limit_val_batches", "0", *QUIET], capsys)
    assert status == 0, err[-2000:]
    shown = [str(warning.message) for warning in caught] + [err]
    assert not [text for text in shown if "manual optimization" in text], shown
    assert (tmp_path / "runs" / "pair" / "version_0" / "checkpoints" / "last.ckpt").is_file()
