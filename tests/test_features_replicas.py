"""`features --replicas`: each form a replica is given in reads the SAE it names (the site itself:
tests/test_features.py::test_replicas_found_in_j_of_n_seeds and its bad-input test)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from features_fixtures import write_export
from test_group_artifacts import group_checkpoint

from sae_pipeline.features.replicas import load_replicas, match_replicas
from sae_pipeline.sae import TopKSAE
from sae_pipeline.sae.config import sae_config


def test_every_form_reads_its_sae(tmp_path: Path) -> None:
    group = group_checkpoint(tmp_path / "group.ckpt", ["seed0", "seed1", "seed2"])
    members = torch.load(group, weights_only=True)["state_dict"]
    torch.manual_seed(5)
    mine, other = TopKSAE(8, 16, k=2), TopKSAE(8, 16, k=2)
    export = write_export(other, tmp_path / "export")
    state = {f"sae.{key}": value for key, value in other.state_dict().items()}
    run = tmp_path / "runs" / "topk" / "version_0" / "checkpoints"
    run.mkdir(parents=True)
    torch.save({"state_dict": state, "sae_config": sae_config(other), "input_scale": 2.0}, run / "last.ckpt")
    shutil.copy(run / "last.ckpt", tmp_path / "single.ckpt")
    forms = {
        str(export): other.W_dec,
        str(tmp_path / "single.ckpt"): other.W_dec,
        str(tmp_path / "runs" / "topk"): other.W_dec,  # a run folder: its newest checkpoint
        f"{group}:seed1": members["members.seed1.sae.W_dec"],
        f"{group}:seed2": members["members.seed2.sae.W_dec"],
    }
    for spec, expected in forms.items():
        (decoder,) = load_replicas([spec], mine)
        assert torch.equal(torch.from_numpy(decoder).float(), expected.float()), spec
    # the browsed SAE against two replicas: one column of cosines each, found_in counted from them
    match = match_replicas(mine, load_replicas([str(export), f"{group}:seed1"], mine), [str(export), "g:seed1"])
    assert match.cosine.shape == (16, 2) and match.found_in.tolist() == (1 + (match.cosine >= 0.7).sum(1)).tolist()


@pytest.mark.parametrize(
    ("suffix", "expected"),
    [
        ("", "holds a group of SAEs; pass the member as"),
        (":nobody", "has no member 'nobody' (seed0, seed1)"),
    ],
)
def test_a_group_needs_its_member(tmp_path: Path, suffix: str, expected: str) -> None:
    group = group_checkpoint(tmp_path / "group.ckpt", ["seed0", "seed1"])
    with pytest.raises(ValueError, match="^--replicas ") as error:
        load_replicas([f"{group}{suffix}"], TopKSAE(8, 16, k=2))
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_a_single_checkpoint_has_no_member(tmp_path: Path) -> None:
    sae = TopKSAE(8, 16, k=2)
    state = {f"sae.{key}": value for key, value in sae.state_dict().items()}
    torch.save({"state_dict": state, "sae_config": sae_config(sae), "input_scale": 1.0}, tmp_path / "one.ckpt")
    with pytest.raises(ValueError, match="holds one SAE, not a group; pass FILE.ckpt for one SAE"):
        load_replicas([f"{tmp_path / 'one.ckpt'}:seed1"], TopKSAE(8, 16, k=2))
