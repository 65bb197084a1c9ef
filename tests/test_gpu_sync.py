"""On a GPU the training step never waits for the device: CUDA's own check
(``torch.cuda.set_sync_debug_mode("error")``) on every step Lightning does not log, for every variant
alone and in a group. The CPU counterpart, with the same steps, is ``tests/test_sync_free.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from sae_pipeline.sae import SAE_REGISTRY
from sae_pipeline.sae.config import class_path_of
from sae_pipeline.training import lightning_compat
from sae_pipeline.training.group import SAEGroupModule
from sae_pipeline.training.module import SAEModule
from tests.test_module import make_data, memory_loader, trainer
from tests.test_sync_free import D_IN, D_SAE, LOG_EVERY, SETTINGS, STEPS, build, initialised

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class CudaSyncCheck(L.Callback):
    """CUDA raises on a host sync from the start of each step Lightning does not log to its end
    (but the steps `unguarded` names, e.g. a CUDA graph's capture, which synchronises once by design)."""

    def __init__(self) -> None:
        self.guarded = 0
        self.devices: set[str] = set()  # where the steps ran (Lightning moves the module back to the CPU after fit)

    def unguarded(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        return False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.devices.add(pl_module.device.type)
        if not lightning_compat.should_update_logs(trainer) and not self.unguarded(trainer, pl_module):
            torch.cuda.set_sync_debug_mode("error")
            self.guarded += 1

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        torch.cuda.set_sync_debug_mode("default")

    def on_exception(self, trainer: L.Trainer, *args: Any) -> None:
        torch.cuda.set_sync_debug_mode("default")


def fit_checked(tmp_path: Path, module: L.LightningModule) -> None:
    check = CudaSyncCheck()
    run = trainer(tmp_path, accelerator="cuda", max_steps=STEPS, log_every_n_steps=LOG_EVERY, callbacks=[check])
    try:
        run.fit(module, memory_loader(make_data(STEPS * 32)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert check.guarded == STEPS - STEPS // LOG_EVERY
    assert check.devices == {"cuda"}


@pytest.mark.parametrize("key", sorted(SAE_REGISTRY))
def test_training_step_does_not_sync_on_cuda(tmp_path: Path, key: str) -> None:
    module = initialised(SAEModule(build(key, sync_free=None), warmup_steps=0), make_data(STEPS * 32))
    assert module.sae.sync_free is None  # the default, which is sync-free on the GPU: not forced
    fit_checked(tmp_path, module)


def test_group_step_does_not_sync_on_cuda(tmp_path: Path) -> None:
    members = {
        key: {"sae": {"class_path": class_path_of(SAE_REGISTRY[key]), "init_args": {"d_sae": D_SAE, **SETTINGS[key]}}}
        for key in ("relu", "topk", "mpsae")
    }
    group = SAEGroupModule(members, d_in=D_IN)
    for _, member in group.named_members():
        member.sae.tokens_since_fired[: D_SAE // 2] = member.sae.dead_after_tokens
        initialised(member, make_data(STEPS * 32))
    fit_checked(tmp_path, group)
