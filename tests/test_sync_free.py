"""The training step never waits for the device: no host read on the steps Lightning does not log, for
every variant alone and in a group (counted on the CPU by `sae_pipeline.training.sync_guard`; the
same steps run on a GPU under CUDA's own sync check in ``tests/test_gpu_sync.py``), and the sync-free
code computes what the host-read shortcuts that the CPU keeps compute (float64)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor

from sae_pipeline.sae import SAE_REGISTRY, SparseAutoencoder, get_sae_class
from sae_pipeline.sae.config import class_path_of
from sae_pipeline.sae.topk import spread_indices
from sae_pipeline.training import lightning_compat
from sae_pipeline.training.group import SAEGroupModule
from sae_pipeline.training.module import NonFiniteBatchError, SAEModule
from sae_pipeline.training.sync_guard import HostSyncCounter
from tests.test_module import make_data, memory_loader, trainer

D_IN, D_SAE, STEPS, LOG_EVERY = 16, 64, 7, 3
#: Settings that take every branch of the step: first-batch calibrations (ReLU, JumpReLU), latents dead
#: after a few steps (AuxK), the sparse path where the variant has one.
SETTINGS: dict[str, dict[str, Any]] = {
    "relu": {"initial_l0": 8.0},
    "jumprelu": {"sparsity_loss": "target_l0", "target_l0": 8.0},
    "topk": {"k": 4, "dead_after_tokens": 64},
    "batchtopk": {"k": 4, "dead_after_tokens": 64},
    "matryoshka": {"k": 4, "dead_after_tokens": 64, "n_prefixes": 3},
    "mpsae": {"k": 4},
    "ompsae": {"k": 4},
}


def test_every_variant_has_settings() -> None:
    assert set(SETTINGS) == set(SAE_REGISTRY)


def build(key: str, sync_free: bool | None) -> SparseAutoencoder:
    """The variant with half of its latents dead from the start (AuxK runs with dead latents at once)."""
    torch.manual_seed(0)
    sae = get_sae_class(key)(D_IN, D_SAE, **SETTINGS[key])
    sae.sync_free = sync_free
    sae.tokens_since_fired[: D_SAE // 2] = sae.dead_after_tokens
    return sae


class GuardSteps(L.Callback):
    """Counts the syncing calls of every step Lightning does not log, from the batch's start to its end."""

    def __init__(self) -> None:
        self.counter: HostSyncCounter | None = None
        self.calls: list[str] = []
        self.guarded = 0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if not lightning_compat.should_update_logs(trainer):
            self.counter = HostSyncCounter()
            self.counter.__enter__()
            self.guarded += 1

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.calls += self.counter.calls
            self.counter = None


def fit_guarded(tmp_path: Path, module: L.LightningModule, data: Tensor, **kwargs: Any) -> GuardSteps:
    guard = GuardSteps()
    run = trainer(tmp_path, max_steps=STEPS, log_every_n_steps=LOG_EVERY, callbacks=[guard], **kwargs)
    run.fit(module, memory_loader(data))
    assert guard.guarded == STEPS - STEPS // LOG_EVERY  # steps 0, 1, 3, 4, 6: the first batch's set-up included
    return guard


def initialised(module: SAEModule, data: Tensor) -> SAEModule:
    """Input scale and ``b_pre`` from the data, as the datamodule's statistics give them (the first-batch
    fallback without statistics reads the batch's moments once)."""
    module.init_from_data(data.mean(0).float(), float(data.float().square().sum(1).mean()))
    return module


@pytest.mark.parametrize("key", sorted(SAE_REGISTRY))
def test_training_step_does_not_sync(tmp_path: Path, key: str) -> None:
    data = make_data(STEPS * 32)
    module = initialised(SAEModule(build(key, sync_free=True), warmup_steps=0), data)
    guard = fit_guarded(tmp_path, module, data)
    assert guard.calls == [], f"{key}: {len(guard.calls)} host syncs: {sorted(set(guard.calls))}"


def test_group_step_does_not_sync(tmp_path: Path) -> None:
    data = make_data(STEPS * 32)
    members = {
        key: {"sae": {"class_path": class_path_of(SAE_REGISTRY[key]), "init_args": {"d_sae": D_SAE, **SETTINGS[key]}}}
        for key in ("relu", "topk", "mpsae")
    }
    group = SAEGroupModule(members, d_in=D_IN)
    for _, member in group.named_members():
        member.sae.sync_free = True
        member.sae.tokens_since_fired[: D_SAE // 2] = member.sae.dead_after_tokens
        initialised(member, data)
    guard = fit_guarded(tmp_path, group, data)
    assert guard.calls == [], f"{len(guard.calls)} host syncs: {sorted(set(guard.calls))}"


@pytest.mark.parametrize("key", sorted(SAE_REGISTRY))
def test_sync_free_step_computes_what_the_cpu_step_computes(tmp_path: Path, key: str) -> None:
    """Float64: the GPU's code (masks instead of host reads) and the CPU's (host-read shortcuts) train to
    the same weights, buffers and losses (the order of a few sums may differ: AuxK's picks, the dense
    instead of the sparse path of ReLU and JumpReLU)."""
    data = make_data(STEPS * 32).double()
    states, losses = [], []
    for sync_free in (False, True):
        module = initialised(SAEModule(build(key, sync_free), warmup_steps=0, lr=1e-2), data)
        seen: list[Tensor] = []
        step_loss = module.step_loss

        def recording_step_loss(batch: dict[str, Any], step_loss: Any = step_loss, seen: list = seen) -> Any:
            x, output, terms = step_loss(batch)
            seen.append(torch.stack([term.detach() for term in terms.terms.values()]))
            return x, output, terms

        module.step_loss = recording_step_loss  # type: ignore[method-assign]
        trainer(tmp_path, precision="64-true", max_steps=STEPS, log_every_n_steps=LOG_EVERY).fit(
            module, memory_loader(data)
        )
        states.append(module.sae.state_dict())
        losses.append(torch.stack(seen))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-10, atol=1e-12)
    if key in ("topk", "batchtopk", "matryoshka"):
        aux = losses[0][:, 2]  # steps with dead latents (AuxK computed) and without (AuxK 0): both compared
        assert bool((aux > 0).any()) and bool((aux == 0).any()), aux
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, rtol=1e-10, atol=1e-12, msg=f"{key}: {name}")


def test_non_finite_batch_found_without_a_read_per_step(tmp_path: Path) -> None:
    """Where the step reads nothing (a GPU), a NaN batch is still named by its step and shard, and no
    checkpoint is written from weights that saw it."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=-1)
    run = trainer(tmp_path, max_steps=8, enable_checkpointing=True, callbacks=[checkpoint], log_every_n_steps=50)
    module = SAEModule(build("topk", sync_free=True), warmup_steps=0)
    with pytest.raises(NonFiniteBatchError) as info:
        run.fit(module, memory_loader(make_data(8 * 32), nan_at_batch=3))
    message = str(info.value)
    assert "global step 3" in message and "shard-000003.tar" in message and "1 NaN/Inf" in message, message
    saved = sorted((tmp_path / "ckpts").glob("*.ckpt"))
    assert len(saved) == 3
    for fpath in saved:
        assert torch.isfinite(torch.load(fpath, weights_only=True)["state_dict"]["sae.W_dec"]).all()


def test_non_finite_batch_raises_on_the_next_logging_step(tmp_path: Path) -> None:
    run = trainer(tmp_path, max_steps=8, log_every_n_steps=3)
    steps: list[int] = []
    module = SAEModule(build("mpsae", sync_free=True), warmup_steps=0)
    train = module.training_step

    def counting_step(batch: dict[str, Any], batch_idx: int) -> Tensor:
        steps.append(batch_idx)
        return train(batch, batch_idx)

    module.training_step = counting_step  # type: ignore[method-assign]
    with pytest.raises(NonFiniteBatchError, match="global step 3: batch from shards shard-000003.tar"):
        run.fit(module, memory_loader(make_data(8 * 32), nan_at_batch=3))
    assert steps == [0, 1, 2, 3, 4, 5]  # step 5 is the second logging step (every 3)


def test_auxk_with_fewer_dead_latents_than_k_aux_matches_the_host_read_path() -> None:
    """Fewer dead latents than ``k_aux``: the sync-free AuxK's masked picks (worth 0) sit on spread
    latents (`spread_indices`), and its loss and gradients are the host-read path's (float64)."""
    x = make_data(64).double()
    results = []
    for sync_free in (False, True):
        torch.manual_seed(0)
        sae = get_sae_class("topk")(D_IN, D_SAE, k=4, k_aux=8).double()
        sae.sync_free = sync_free
        sae.tokens_since_fired[:3] = sae.dead_after_tokens  # 3 dead latents, 8 picks per token
        output = sae(x)
        assert output.sparse is not None  # the sparse path, where the picks are entries of a support
        loss = sae.auxiliary_loss(x, output)
        loss.backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in sae.named_parameters()}))
    (loss_read, grads_read), (loss_free, grads_free) = results
    assert float(loss_read) > 0
    torch.testing.assert_close(loss_free, loss_read, rtol=1e-10, atol=1e-12)
    for name, grad in grads_read.items():
        torch.testing.assert_close(grads_free[name], grad, rtol=1e-10, atol=1e-12, msg=name)


def test_spread_indices_give_each_latent_its_share() -> None:
    picks = spread_indices(torch.zeros(64, 8, dtype=torch.int64), D_SAE)
    assert all(len(set(row.tolist())) == 8 for row in picks)  # no latent twice in a token
    assert torch.bincount(picks.reshape(-1), minlength=D_SAE).tolist() == [64 * 8 // D_SAE] * D_SAE
