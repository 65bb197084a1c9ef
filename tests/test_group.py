"""SAEGroupModule: a member trained in a group equals the same SAE trained alone (float64, every variant),
with its own learning rate, schedule and clipping; bad groups are one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from sae_pipeline.sae import SAE_REGISTRY
from sae_pipeline.sae.config import build_sae, class_path_of
from sae_pipeline.training.group import SAEGroupModule
from sae_pipeline.training.module import SAEModule
from tests.sae_variants_fixtures import D_SAE, KWARGS
from tests.test_module import D_IN, make_data, memory_loader, trainer

STEPS = 4


def member_config(index: int, key: str) -> dict[str, Any]:
    """A distinct recipe per member: its own lr, warm-up and clipping (some clip, some do not)."""
    sae = {"class_path": class_path_of(SAE_REGISTRY[key]), "init_args": {"d_sae": D_SAE, **KWARGS[key]}}
    config: dict[str, Any] = {"sae": sae, "lr": 1e-3 * (index + 1), "warmup_steps": index % 3, "min_lr": 1e-6}
    if index % 2 == 0:
        config["gradient_clip_val"] = 0.05 * (index + 1)
    return config


def float64_trainer(tmp_path: Path, **kwargs: Any) -> L.Trainer:
    return trainer(tmp_path, precision="64-true", max_steps=STEPS, limit_val_batches=0, **kwargs)


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    return make_data().double()


@pytest.mark.slow
def test_every_variant_in_a_group_equals_itself_alone(tmp_path: Path, data: torch.Tensor) -> None:
    members = {key: member_config(index, key) for index, key in enumerate(sorted(SAE_REGISTRY))}
    L.seed_everything(0)
    group = SAEGroupModule(members, d_in=D_IN)
    float64_trainer(tmp_path / "group").fit(group, memory_loader(data))
    assert group.trainer.global_step == STEPS  # one optimiser step per batch, whatever the group's size

    for key, config in members.items():
        L.seed_everything(0)
        sae_dict = {**config["sae"], "init_args": {**config["sae"]["init_args"], "d_in": D_IN}}
        settings = {name: config[name] for name in ("lr", "warmup_steps", "min_lr")}
        alone = SAEModule(build_sae(sae_dict), **settings)
        clip = config.get("gradient_clip_val")
        float64_trainer(tmp_path / key, gradient_clip_val=clip).fit(alone, memory_loader(data))
        member = group.members[key]
        for name, value in alone.state_dict().items():
            assert torch.equal(member.state_dict()[name], value), f"{key}: {name} differs from the run alone"
        assert member.sae.W_dec.dtype == torch.float64


def test_group_errors_are_one_line() -> None:
    topk = {"sae": {"class_path": "TopKSAE", "init_args": {"d_sae": 8, "k": 2}}}
    cases = [
        ({}, "model.members is empty"),
        ({"a": {"sae": {"class_path": "TopKSAE", "init_args": {"d_in": 5, "d_sae": 8, "k": 2}}}}, "differs from"),
        ({"a": {**topk, "lr": -1.0}}, "model.members.a.lr"),
        ({"a": {**topk, "learning_rate": 1.0}}, "unknown setting(s) learning_rate"),
        ({"a b": topk}, "name 'a b'"),
        ({"a": {**topk, "gradient_clip_val": 0}}, "model.members.a.gradient_clip_val"),
    ]
    for members, expected in cases:
        with pytest.raises(ValueError, match=None) as info:
            SAEGroupModule(members, d_in=4)
        assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)
